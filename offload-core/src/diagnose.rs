//! Why a step was slower than its bound: the timeline of one step read back
//! into named causes, each with the seconds it cost and the blocks it cost them
//! at.
//!
//! The compute stream of a streamed step does three things: it runs the
//! blocks, it runs the model's work between them, and it waits for copies.
//! Only the waits (and a host that cannot keep the device fed) put a step above
//! `max(compute, bytes ÷ bandwidth)`. Each wait is charged to what held its
//! block's copy back, read from the copy stream's spans:
//!
//! - **shared link**: the copy ran slower than the link's rate (its bytes over
//!   its transfer time, against the given bandwidth or the step's fastest copy),
//!   or it was issued (the host's mark) while the copy stream was idle and yet
//!   started later (the copy engine busy with transfers of another stream: on
//!   an H100 two streams' host-to-device copies run one after the other):
//!   something else used the link at the time, such as the model's own
//!   host-to-device copies;
//! - **slot**: the copy was ordered after the release of the block that last
//!   used its slot, and that block was still computing when the copy could have
//!   started (a deeper ring gives it a free slot earlier);
//! - **late**: the copy stream sat idle before the copy was issued: it was
//!   issued too late to hide, `depth` blocks ahead of a block whose compute was
//!   shorter than the copy (a deeper prefetch issues it earlier);
//! - **link**: none of those: the copies ran back to back at the link's rate and
//!   the compute before the block was too short to hide them (a copy-bound
//!   step; only fewer bytes help: resident blocks, coding, fp8).
//!
//! And one cause that is no wait: **host**, where the host took about as long
//! to issue the step as the device took to run it (Python time per block, or a
//! host synchronisation inside a block: `.item()`, `.cpu()`,
//! `torch.cuda.synchronize()`), so the device idled for the host. On a backend
//! whose compute runs on the host (the simulated device, candle's CPU device)
//! the host's time outside the blocks is that cause.

use crate::timeline::{Span, Timeline};
use serde::Serialize;
use std::fmt::Write as _;

/// What held a block's copy back, or the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// The copies ran back to back at the link's rate: a copy-bound step.
    Link,
    /// The copy stream sat idle before the copy: issued too late (depth).
    Late,
    /// The copy waited for its slot's previous block to finish computing (depth).
    Slot,
    /// The copy ran slower than the link: other traffic shared it.
    SharedLink,
    /// The device waited for the host.
    Host,
}

impl Cause {
    /// The cause's name as [`Diagnosis::verdict`] and the summary give it.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Link => "link",
            Cause::Late => "late",
            Cause::Slot => "slot",
            Cause::SharedLink => "shared_link",
            Cause::Host => "host",
        }
    }
}

/// One block whose copy the compute stream waited for.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BlockWait {
    /// The block (`transformer_blocks.3`).
    pub block: String,
    /// Device seconds the compute stream waited for its copy.
    pub wait_s: f64,
    /// Of those, charged to each cause (`link`, `late`, `slot`, `shared_link`).
    pub by_cause: Vec<(Cause, f64)>,
    /// The copy's rate, bytes over its transfer time, GB/s.
    pub copy_gbps: f64,
    /// Seconds the copy stream sat idle before this copy started.
    pub idle_before_s: f64,
    /// Of those, seconds after the host had issued it (the copy queued behind
    /// another stream's transfers).
    pub queued_s: f64,
    /// Seconds the copy waited for its slot's previous block (`after`).
    pub slot_wait_s: f64,
    /// The block whose release the copy was ordered after, if any.
    pub after: Option<String>,
}

/// One step's diagnosis (see the module's documentation).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Diagnosis {
    /// Component name.
    pub component: String,
    /// Device seconds from the step's first to its last compute-stream span.
    pub step_s: f64,
    /// Device seconds the blocks computed.
    pub compute_s: f64,
    /// Device seconds the compute stream waited for copies.
    pub wait_s: f64,
    /// The rest of the step: the model's work between blocks, or the device idle.
    pub between_s: f64,
    /// Device seconds the copy stream transferred (slot waits excluded).
    pub copy_s: f64,
    /// Bytes copied in the step.
    pub copy_bytes: u64,
    /// The link's rate the copies are measured against, GB/s: the given
    /// bandwidth, else the step's fastest copy.
    pub link_gbps: f64,
    /// Host seconds from the step's first block asked for to its last released.
    pub host_s: f64,
    /// Each block's host seconds from asked for to released, slowest first (at
    /// most eight).
    pub host_blocks: Vec<(String, f64)>,
    /// Seconds charged to each cause, largest first (causes that cost nothing
    /// left out).
    pub causes: Vec<(Cause, f64)>,
    /// The blocks whose copies were waited for, longest wait first.
    pub waits: Vec<BlockWait>,
    /// The cause that cost the most, or `None` where the step lost under 2 % of
    /// its time to waits and the host kept ahead (it is at its bound).
    pub verdict: Option<Cause>,
    /// The diagnosis in words, for a person.
    pub summary: String,
}

/// What [`diagnose`] needs besides the timeline.
#[derive(Clone, Debug, Default)]
pub struct DiagnoseInput<'a> {
    /// The component.
    pub component: &'a str,
    /// The step to read (its spans' and marks' `step`).
    pub step: u64,
    /// The link's measured bandwidth, bytes per second, if known.
    pub link_bytes_per_s: Option<f64>,
    /// Whether the backend computes on the host (the simulated device).
    pub compute_on_host: bool,
    /// The ring's prefetch depth, for the summary's advice.
    pub depth: usize,
}

/// A wait shorter than this share of the step is noise, not a cause.
const NOISE: f64 = 0.002;
/// A copy slower than this share of the link's rate shared the link.
const SLOW: f64 = 0.8;
/// How far the host's clock and the device's may disagree (seconds).
const SKEW: f64 = 100e-6;
/// A host that needs this share of the device's step keeps the device waiting.
const HOST_BOUND: f64 = 0.8;

fn block_of<'s>(span: &'s Span, prefix: &str) -> Option<&'s str> {
    span.name.strip_prefix(prefix)
}

fn end(s: &Span) -> f64 {
    s.start_s + s.dur_s
}

/// Read step `input.step` of `timeline` into causes. `None` where the step has
/// no compute spans (not traced, or not closed yet).
pub fn diagnose(timeline: &Timeline, input: &DiagnoseInput<'_>) -> Option<Diagnosis> {
    let in_step: Vec<&Span> = timeline.spans.iter().filter(|s| s.step == input.step).collect();
    let compute: Vec<&Span> = in_step.iter().copied().filter(|s| s.stream == "compute").collect();
    let first = compute.iter().map(|s| s.start_s).fold(f64::INFINITY, f64::min);
    let last = compute.iter().map(|s| end(s)).fold(f64::NEG_INFINITY, f64::max);
    if compute.is_empty() || last.partial_cmp(&first).is_none_or(|o| o.is_lt()) {
        return None;
    }
    let step_s = last - first;
    let compute_s: f64 = compute.iter().filter(|s| block_of(s, "compute ").is_some()).map(|s| s.dur_s).sum();
    let wait_s: f64 = compute.iter().filter(|s| block_of(s, "wait ").is_some()).map(|s| s.dur_s).sum();
    let between_s = (step_s - compute_s - wait_s).max(0.0);

    // Every copy of the timeline in stream order: a step's first blocks were
    // copied during the step before.
    let mut copies: Vec<&Span> = timeline.spans.iter().filter(|s| s.stream == "copy").collect();
    copies.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    let computes: Vec<&Span> = timeline.spans.iter().filter(|s| block_of(s, "compute ").is_some()).collect();
    // The transfer of copy `i`: from the later of its start and its slot's release.
    let transfer = |i: usize| -> (f64, f64, f64) {
        let c = copies[i];
        let released = c
            .after
            .as_deref()
            .and_then(|p| {
                computes.iter().filter(|s| block_of(s, "compute ") == Some(p) && end(s) <= end(c) + 1e-9).map(|s| end(s)).reduce(f64::max)
            })
            .unwrap_or(f64::NEG_INFINITY);
        let begin = c.start_s.max(released);
        let slot_wait = (released - c.start_s).clamp(0.0, c.dur_s);
        (begin, (end(c) - begin).max(0.0), slot_wait)
    };
    let rate = |i: usize| {
        let (_, t, _) = transfer(i);
        (t > 0.0).then(|| copies[i].bytes as f64 / t)
    };
    let step_copies: Vec<usize> = (0..copies.len()).filter(|&i| copies[i].step == input.step).collect();
    let link =
        input.link_bytes_per_s.filter(|b| *b > 0.0).or_else(|| step_copies.iter().filter_map(|&i| rate(i)).reduce(f64::max)).unwrap_or(0.0);
    let copy_s: f64 = step_copies.iter().map(|&i| transfer(i).1).sum();
    let copy_bytes: u64 = step_copies.iter().map(|&i| copies[i].bytes).sum();

    let mut waits = Vec::new();
    for w in compute.iter().filter(|s| s.dur_s > 0.0) {
        let Some(block) = block_of(w, "wait ") else { continue };
        let name = format!("copy {block}");
        let Some(i) = (0..copies.len()).rev().find(|&i| copies[i].name == name && copies[i].start_s <= end(w)) else { continue };
        let c = copies[i];
        let (_, t, slot_wait) = transfer(i);
        let idle_before = match i {
            0 => 0.0,
            _ => (c.start_s - end(copies[i - 1])).max(0.0),
        };
        // When the host issued it (its latest mark before the span began, the
        // two clocks agreeing to tens of microseconds): an idle stream after that
        // was another stream's traffic ahead of it on the copy engine.
        let mark = format!("issue copy {block}");
        let issued = timeline.host.iter().filter(|m| m.name == mark && m.at_s <= c.start_s + SKEW).map(|m| m.at_s).reduce(f64::max);
        let queued = match issued {
            Some(at) => (c.start_s - at.max(c.start_s - idle_before)).clamp(0.0, idle_before),
            None => 0.0,
        };
        let gbps = if t > 0.0 { c.bytes as f64 / t / 1e9 } else { 0.0 };
        let slow = match link > 0.0 {
            true if (c.bytes as f64 / link) < SLOW * t => t - c.bytes as f64 / link,
            _ => 0.0,
        };
        let mut left = w.dur_s;
        let mut by_cause = Vec::new();
        let queued = if queued > SKEW { queued } else { 0.0 };
        for (cause, s) in [(Cause::SharedLink, slow + queued), (Cause::Slot, slot_wait), (Cause::Late, idle_before - queued)] {
            let take = s.min(left);
            if take > 0.0 {
                by_cause.push((cause, take));
                left -= take;
            }
        }
        if left > 0.0 {
            by_cause.push((Cause::Link, left));
        }
        waits.push(BlockWait {
            block: block.to_owned(),
            wait_s: w.dur_s,
            by_cause,
            copy_gbps: gbps,
            idle_before_s: idle_before,
            queued_s: queued,
            slot_wait_s: slot_wait,
            after: c.after.clone(),
        });
    }
    waits.sort_by(|a, b| b.wait_s.total_cmp(&a.wait_s));

    let (host_s, host_blocks) = host_time(timeline, input.step);

    let mut causes: Vec<(Cause, f64)> = Vec::new();
    for w in &waits {
        for &(c, s) in &w.by_cause {
            match causes.iter_mut().find(|(k, _)| *k == c) {
                Some((_, t)) => *t += s,
                None => causes.push((c, s)),
            }
        }
    }
    let host_lost = match input.compute_on_host {
        // The device is the host: its time outside the blocks is the host's.
        true => between_s,
        // The device idles for the host when the host needs about the device's time.
        // What it cost is not measured (the device's idle time inside a block is
        // in that block's span): charged as the host's time beyond that share,
        // at least the step's time between blocks.
        false if host_s >= HOST_BOUND * step_s => (host_s - HOST_BOUND * step_s).max(between_s),
        false => 0.0,
    };
    if host_lost > 0.0 {
        causes.push((Cause::Host, host_lost));
    }
    causes.retain(|(_, s)| *s > NOISE * step_s);
    causes.sort_by(|a, b| b.1.total_cmp(&a.1));
    let verdict = causes.first().map(|(c, _)| *c);

    let mut d = Diagnosis {
        component: input.component.to_owned(),
        step_s,
        compute_s,
        wait_s,
        between_s,
        copy_s,
        copy_bytes,
        link_gbps: link / 1e9,
        host_s,
        host_blocks,
        causes,
        waits,
        verdict,
        summary: String::new(),
    };
    d.summary = summary(&d, input);
    Some(d)
}

/// The host's time in step `step`: from the first block asked for to the last
/// released, and the eight blocks that held the host longest (from each one's
/// request to its release).
fn host_time(timeline: &Timeline, step: u64) -> (f64, Vec<(String, f64)>) {
    let marks: Vec<_> = timeline.host.iter().filter(|m| m.step == step).collect();
    let at = |prefix: &'static str| marks.iter().filter(move |m| m.name.starts_with(prefix)).map(|m| m.at_s);
    let host_s = match (at("acquire ").reduce(f64::min), at("release ").reduce(f64::max)) {
        (Some(a), Some(b)) if b > a => b - a,
        _ => 0.0,
    };
    let mut host_blocks: Vec<(String, f64)> = Vec::new();
    let mut open: Option<(&str, f64)> = None;
    for m in &marks {
        if let Some(b) = m.name.strip_prefix("acquire ") {
            open = Some((b, m.at_s));
        } else if let (Some(b), Some((o, t0))) = (m.name.strip_prefix("release "), open) {
            if b == o {
                host_blocks.push((b.to_owned(), m.at_s - t0));
                open = None;
            }
        }
    }
    host_blocks.sort_by(|a, b| b.1.total_cmp(&a.1));
    host_blocks.truncate(8);
    (host_s, host_blocks)
}

fn blocks_for(d: &Diagnosis, cause: Cause) -> String {
    let mut named: Vec<(&str, f64)> =
        d.waits.iter().filter_map(|w| w.by_cause.iter().find(|(c, _)| *c == cause).map(|(_, s)| (w.block.as_str(), *s))).collect();
    named.sort_by(|a, b| b.1.total_cmp(&a.1));
    let n = named.len();
    let mut s = named.iter().take(4).map(|(b, t)| format!("{b} {:.2} ms", t * 1e3)).collect::<Vec<_>>().join(", ");
    if n > 4 {
        let _ = write!(s, " and {} more", n - 4);
    }
    s
}

fn summary(d: &Diagnosis, input: &DiagnoseInput<'_>) -> String {
    let mut s = format!(
        "{}: step {:.4} s on the device: blocks computed {:.4} s, {:.4} s between blocks, {:.4} s waiting for copies; \
         {:.1} MiB copied in {:.4} s ({:.1} GB/s link)",
        d.component,
        d.step_s,
        d.compute_s,
        d.between_s,
        d.wait_s,
        d.copy_bytes as f64 / (1u64 << 20) as f64,
        d.copy_s,
        d.link_gbps
    );
    if d.verdict.is_none() {
        s.push_str("\n- no cause: the copies were hidden and the host kept ahead (the step is at its bound)");
    }
    for &(cause, secs) in &d.causes {
        let ms = secs * 1e3;
        let line = match cause {
            Cause::Link => format!(
                "link: {ms:.2} ms: the copies ran back to back at the link's rate and the compute before these blocks was \
                 too short to hide them (a copy-bound step: fewer bytes help: resident blocks, coding, fp8): {}",
                blocks_for(d, cause)
            ),
            Cause::Late => format!(
                "late: {ms:.2} ms: the copy stream sat idle before these copies: issued {} block(s) ahead, too late to \
                 hide behind the blocks before them (a deeper prefetch issues them earlier): {}",
                input.depth,
                blocks_for(d, cause)
            ),
            Cause::Slot => format!(
                "slot: {ms:.2} ms: these copies waited for their slot's previous block to finish computing (a deeper \
                 ring frees a slot earlier): {}",
                blocks_for(d, cause)
            ),
            Cause::SharedLink => format!(
                "shared_link: {ms:.2} ms: these copies ran slower than the link's {:.1} GB/s: something else used the \
                 link at the same time (the model's own host-to-device copies?): {}",
                d.link_gbps,
                blocks_for(d, cause)
            ),
            Cause::Host => {
                let slow = d.host_blocks.iter().take(3).map(|(b, t)| format!("{b} {:.2} ms", t * 1e3)).collect::<Vec<_>>().join(", ");
                match input.compute_on_host {
                    true => format!("host: {ms:.2} ms: the host's time between blocks (the model's own work outside its blocks)"),
                    false => format!(
                        "host: {ms:.2} ms: the host took {:.4} s to issue a step the device ran in {:.4} s, so the device \
                         waited for it (Python time per block, or a host synchronisation inside a block: .item(), .cpu(), \
                         torch.cuda.synchronize()); slowest blocks on the host: {slow}",
                        d.host_s, d.step_s
                    ),
                }
            }
        };
        s.push_str("\n- ");
        s.push_str(&line);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::HostMark;

    fn span(name: &str, stream: &'static str, start_ms: f64, dur_ms: f64) -> Span {
        Span {
            name: name.into(),
            stream,
            component: "t".into(),
            start_s: start_ms / 1e3,
            dur_s: dur_ms / 1e3,
            step: 1,
            bytes: 0,
            after: None,
            backward: false,
        }
    }

    fn copy(block: &str, start_ms: f64, dur_ms: f64, mb: u64, after: Option<&str>) -> Span {
        Span { bytes: mb * 1_000_000, after: after.map(str::to_owned), ..span(&format!("copy {block}"), "copy", start_ms, dur_ms) }
    }

    fn input() -> DiagnoseInput<'static> {
        DiagnoseInput { component: "t", step: 1, link_bytes_per_s: Some(1e12), compute_on_host: false, depth: 1 }
    }

    fn cause(d: &Diagnosis, c: Cause) -> f64 {
        d.causes.iter().find(|(k, _)| *k == c).map_or(0.0, |(_, s)| *s)
    }

    /// A copy that waited for its slot's previous block is charged to `slot`; one
    /// after an idle copy stream to `late`; one running at half the link's rate
    /// to `shared_link`; one queued behind another at full rate to `link`.
    #[test]
    fn each_wait_is_charged_to_what_held_its_copy_back() {
        // 1 GB/ms link: 1 MB copies take 0.001 ms; these copies are 1000 MB = 1 ms.
        let tl = Timeline {
            spans: vec![
                // a: computes 0..4 ms.
                span("compute a", "compute", 0.0, 4.0),
                // b's copy was ordered after a's release (4 ms), started at 0: slot wait 4 ms,
                // transfer 4..5 ms; compute waits 4..5.
                copy("b", 0.0, 5.0, 1000, Some("a")),
                span("wait b", "compute", 4.0, 1.0),
                span("compute b", "compute", 5.0, 0.5),
                // c's copy: stream idle 5..7 ms, copy 7..8; compute waits 5.5..8 (2.5 ms):
                // 2 ms late, 0.5 ms link.
                copy("c", 7.0, 1.0, 1000, None),
                span("wait c", "compute", 5.5, 2.5),
                span("compute c", "compute", 8.0, 0.5),
                // d's copy: right after c's, at half the link's rate (2 ms): 1 ms shared, rest link.
                copy("d", 8.0, 2.0, 1000, None),
                span("wait d", "compute", 8.5, 1.5),
                span("compute d", "compute", 10.0, 1.0),
            ],
            host: vec![],
        };
        // c was issued at 5.0 ms (when the stream went idle): an idle stream later
        // would be traffic ahead of it; issued at 7.0 ms, it was late.
        let mut tl = tl;
        tl.host.push(HostMark { name: "issue copy c".into(), at_s: 7.0e-3, step: 1 });
        let d = diagnose(&tl, &input()).expect("a traced step");
        let w = |b: &str| d.waits.iter().find(|w| w.block == b).expect("a wait");
        assert_eq!(w("b").by_cause, vec![(Cause::Slot, 1e-3)]);
        assert_eq!(w("b").after.as_deref(), Some("a"));
        let c = &w("c").by_cause;
        assert_eq!(c[0].0, Cause::Late);
        assert!((c[0].1 - 2e-3).abs() < 1e-9 && c[1].0 == Cause::Link && (c[1].1 - 0.5e-3).abs() < 1e-9, "{c:?}");
        let dd = &w("d").by_cause;
        assert_eq!(dd[0].0, Cause::SharedLink);
        assert!((dd[0].1 - 1e-3).abs() < 1e-9 && (dd[1].1 - 0.5e-3).abs() < 1e-9, "{dd:?}");
        assert!((w("d").copy_gbps - 500.0).abs() < 1e-6);
        assert_eq!(d.verdict, Some(Cause::Late));
        assert!((cause(&d, Cause::Link) - 1e-3).abs() < 1e-9);
        assert!((d.step_s - 11e-3).abs() < 1e-9 && (d.wait_s - 5e-3).abs() < 1e-9);
        for word in ["slot: 1.00 ms", "late: 2.00 ms", "shared_link: 1.00 ms", "link: 1.00 ms", "c 2.00 ms"] {
            assert!(d.summary.contains(word), "{word:?} not in {}", d.summary);
        }
    }

    /// A copy issued while the copy stream was idle that started only later
    /// queued behind another stream's transfers on the copy engine: `shared_link`,
    /// not `late`; issued just before it started, it was `late`.
    #[test]
    fn a_copy_issued_early_that_started_late_queued_behind_other_traffic() {
        let spans = vec![
            span("compute a", "compute", 0.0, 1.0),
            copy("a", -2.0, 1.0, 1000, None),
            // b's copy began at 10 ms; the stream was idle from -1 ms; compute waited 1..11.
            copy("b", 10.0, 1.0, 1000, None),
            span("wait b", "compute", 1.0, 10.0),
            span("compute b", "compute", 11.0, 1.0),
        ];
        let mark = |at_ms: f64| HostMark { name: "issue copy b".into(), at_s: at_ms / 1e3, step: 1 };
        let early = diagnose(&Timeline { spans: spans.clone(), host: vec![mark(0.0)] }, &input()).expect("traced");
        let w = &early.waits[0];
        assert!((w.queued_s - 10e-3).abs() < 1e-9 && w.by_cause[0].0 == Cause::SharedLink, "{w:?}");
        assert_eq!(early.verdict, Some(Cause::SharedLink), "{}", early.summary);
        let late = diagnose(&Timeline { spans, host: vec![mark(9.99)] }, &input()).expect("traced");
        assert_eq!(late.verdict, Some(Cause::Late), "{}", late.summary);
        assert_eq!(late.waits[0].queued_s, 0.0);
    }

    /// A host that needs the device's whole step is named, with its slowest
    /// block; one far ahead is not; no wait and no host: no verdict.
    #[test]
    fn a_host_as_slow_as_the_device_is_named_and_a_step_at_its_bound_has_no_verdict() {
        let mark = |name: &str, ms: f64| HostMark { name: name.into(), at_s: ms / 1e3, step: 1 };
        let spans = vec![span("compute a", "compute", 0.0, 1.0), span("compute b", "compute", 1.0, 1.0)];
        let slow_host = vec![mark("acquire a", 0.0), mark("release a", 0.3), mark("acquire b", 0.3), mark("release b", 2.0)];
        let d = diagnose(&Timeline { spans: spans.clone(), host: slow_host }, &input()).expect("traced");
        assert_eq!(d.verdict, Some(Cause::Host), "{}", d.summary);
        assert_eq!(d.host_blocks[0].0, "b");
        assert!(d.summary.contains("b 1.70 ms"), "{}", d.summary);
        let fast_host = vec![mark("acquire a", 0.0), mark("release a", 0.01), mark("acquire b", 0.01), mark("release b", 0.02)];
        let d = diagnose(&Timeline { spans, host: fast_host }, &input()).expect("traced");
        assert_eq!(d.verdict, None, "{}", d.summary);
        assert!(d.summary.contains("at its bound"));
        assert!(diagnose(&Timeline::default(), &input()).is_none());
    }
}
