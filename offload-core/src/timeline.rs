//! A timeline of the copy and compute streams, written as a Chrome trace event
//! file that Perfetto (ui.perfetto.dev) and chrome://tracing open.

use serde::Serialize;
use std::path::Path;

/// One interval on one stream.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Span {
    /// What ran (`copy double_blocks.3`, `compute single_blocks.0`, `wait double_blocks.1`).
    pub name: String,
    /// `copy` or `compute`.
    pub stream: &'static str,
    /// Component name.
    pub component: String,
    /// Start, seconds since the timeline's origin.
    pub start_s: f64,
    /// Duration, seconds.
    pub dur_s: f64,
    /// The ring's step it was recorded in (0 for the first).
    pub step: u64,
    /// Bytes copied (copy spans; 0 otherwise).
    pub bytes: u64,
    /// A copy's order: the block whose release (the end of its compute) the copy
    /// was ordered after, the last block in its slot. `None` for a free slot.
    pub after: Option<String>,
    /// Recorded in a backward pass ([`Ring::set_backward`](crate::Ring::set_backward)).
    pub backward: bool,
}

/// A moment on the host: when the ring's thread asked for a block or issued a
/// copy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostMark {
    /// What happened (`acquire double_blocks.3`, `issue copy single_blocks.0`).
    pub name: String,
    /// Seconds since the host's clock read when the timeline was enabled. The
    /// device's origin is an event recorded at that moment, so the two clocks
    /// agree where the device was idle then (a bench synchronises first); a
    /// mark is then later than the span it caused by how far the host ran ahead.
    pub at_s: f64,
    /// The ring's step it was recorded in.
    pub step: u64,
}

/// Spans collected over steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// Every span, in the order recorded.
    pub spans: Vec<Span>,
    /// Host marks, in the order recorded.
    pub host: Vec<HostMark>,
}

#[derive(Serialize)]
struct TraceEvent<'a> {
    name: &'a str,
    cat: &'a str,
    ph: &'static str,
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    args: serde_json::Value,
}

impl Timeline {
    /// Where the device reached each block of forward step `step` (its first
    /// span on the compute stream: the wait for its copy, or its compute) and
    /// how long it computed, in the order reached.
    fn reached(&self, step: u64) -> Vec<(&str, f64, f64)> {
        let mut out: Vec<(&str, f64, f64)> = Vec::new();
        for s in self.spans.iter().filter(|s| s.step == step && s.stream == "compute" && !s.backward) {
            let (id, computed) = match (s.name.strip_prefix("wait "), s.name.strip_prefix("compute ")) {
                (Some(id), _) => (id, 0.0),
                (None, Some(id)) => (id, s.dur_s),
                _ => continue,
            };
            match out.iter_mut().find(|(b, _, _)| *b == id) {
                Some(e) => {
                    e.1 = e.1.min(s.start_s);
                    e.2 += computed;
                }
                None => out.push((id, s.start_s, computed)),
            }
        }
        out.sort_by(|a, b| a.1.total_cmp(&b.1));
        out
    }

    /// The blocks forward step `step` ran, in the order the device reached
    /// them, each with its compute seconds: the order a replay of the step
    /// runs them in (the ring's learned order, not the declaration's).
    pub fn step_blocks(&self, step: u64) -> Vec<(String, f64)> {
        self.reached(step).into_iter().map(|(id, _, c)| (id.to_owned(), c)).collect()
    }

    /// Device seconds between the end of step `step - 1`'s last block (a
    /// forward's, or in a training loop the backward's before forward step
    /// `step`) and the moment the device reached forward step `step`'s first
    /// block: the model's own work between two steps (an optimizer step, and
    /// any wait for the host there). `None` where either step is not on the
    /// timeline.
    pub fn step_gap_s(&self, step: u64) -> Option<f64> {
        let before = step.checked_sub(1)?;
        let end = self
            .spans
            .iter()
            .filter(|s| s.step == before && s.stream == "compute" && s.name.starts_with("compute "))
            .map(|s| s.start_s + s.dur_s)
            .reduce(f64::max)?;
        let first = self.reached(step).first()?.1;
        Some((first - end).max(0.0))
    }

    /// For each block of forward step `step`: how long before the device
    /// reached it the host asked for it (its `acquire` mark), at least 0 —
    /// small where the host was not ahead (the first block after a host
    /// synchronisation), by block name.
    pub fn ask_leads(&self, step: u64) -> Vec<(String, f64)> {
        self.reached(step)
            .into_iter()
            .filter_map(|(id, at, _)| {
                let mark = format!("acquire {id}");
                let asked = self.host.iter().filter(|m| m.step == step && m.name == mark).map(|m| m.at_s).reduce(f64::min)?;
                Some((id.to_owned(), (at - asked).max(0.0)))
            })
            .collect()
    }

    /// The Chrome trace event JSON (`{"traceEvents": [...]}`, complete events,
    /// microseconds; one thread per stream).
    pub fn to_chrome_trace(&self) -> String {
        let mut events: Vec<serde_json::Value> = vec![
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "copy stream"}}),
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "compute stream"}}),
            serde_json::json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": 3, "args": {"name": "host (ring thread)"}}),
        ];
        for s in &self.spans {
            let e = TraceEvent {
                name: &s.name,
                cat: s.stream,
                ph: "X",
                ts: s.start_s * 1e6,
                dur: s.dur_s * 1e6,
                pid: 1,
                tid: if s.stream == "copy" { 1 } else { 2 },
                args: serde_json::json!({"component": s.component, "step": s.step, "bytes": s.bytes, "after": s.after}),
            };
            events.push(serde_json::to_value(e).unwrap_or_default());
        }
        for m in &self.host {
            events.push(serde_json::json!({"name": m.name, "cat": "host", "ph": "i", "s": "t", "ts": m.at_s * 1e6, "pid": 1, "tid": 3}));
        }
        serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
    }

    /// Write the Chrome trace to `path`.
    pub fn write_chrome_trace(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        std::fs::write(path, self.to_chrome_trace())
    }

    /// Total duration of spans on `stream` whose name starts with `prefix`.
    pub fn total_s(&self, stream: &str, prefix: &str) -> f64 {
        self.spans.iter().filter(|s| s.stream == stream && s.name.starts_with(prefix)).map(|s| s.dur_s).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, stream: &'static str, start_s: f64, dur_s: f64, step: u64) -> Span {
        Span { name: name.into(), stream, component: "c".into(), start_s, dur_s, step, bytes: 0, after: None, backward: false }
    }

    fn mark(name: &str, at_s: f64, step: u64) -> HostMark {
        HostMark { name: name.into(), at_s, step }
    }

    /// Two steps of blocks declared `b.0, b.1` but run `b.1, b.0`: the order
    /// reached, the gap between the steps and each block's ask lead.
    #[test]
    fn a_steps_order_gap_and_ask_leads_come_from_its_spans_and_marks() {
        let tl = Timeline {
            spans: vec![
                span("compute b.1", "compute", 0.0, 1.0, 0),
                span("compute b.0", "compute", 1.0, 1.0, 0),
                span("copy b.1", "copy", 1.5, 0.5, 1),
                // Step 1: the model's own work from 2.0 to 2.5, then b.1's wait and compute.
                span("wait b.1", "compute", 2.5, 0.25, 1),
                span("compute b.1", "compute", 2.75, 1.0, 1),
                span("wait b.0", "compute", 3.75, 0.0, 1),
                span("compute b.0", "compute", 3.75, 2.0, 1),
            ],
            host: vec![mark("acquire b.1", 2.45, 1), mark("acquire b.0", 1.0, 1), mark("acquire b.0", 0.5, 0)],
        };
        assert_eq!(tl.step_blocks(1), vec![("b.1".to_owned(), 1.0), ("b.0".to_owned(), 2.0)]);
        assert!((tl.step_gap_s(1).unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(tl.step_gap_s(0), None, "no step before the first");
        assert_eq!(tl.step_gap_s(2), None, "no step 2");
        let leads = tl.ask_leads(1);
        assert_eq!(leads.len(), 2);
        assert!((leads[0].1 - 0.05).abs() < 1e-12, "{leads:?}");
        assert!((leads[1].1 - 2.75).abs() < 1e-12, "{leads:?}");
    }

    /// A training loop: forward step 0, its backward step 1, forward step 2.
    /// The gap before step 2 runs from the backward's last block (the
    /// optimizer's step lies there), not from nothing (it was None: a replay
    /// of a training step had no gap).
    #[test]
    fn a_forward_after_a_backward_has_its_gap_from_the_backwards_last_block() {
        let back = |name: &str, start_s, dur_s| Span { backward: true, ..span(name, "compute", start_s, dur_s, 1) };
        let tl = Timeline {
            spans: vec![
                span("compute b.0", "compute", 0.0, 1.0, 0),
                span("compute b.1", "compute", 1.0, 1.0, 0),
                back("compute b.1", 2.5, 2.0),
                back("compute b.0", 4.5, 2.0),
                span("compute b.0", "compute", 7.25, 1.0, 2),
                span("compute b.1", "compute", 8.25, 1.0, 2),
            ],
            host: vec![],
        };
        assert!((tl.step_gap_s(2).unwrap() - 0.75).abs() < 1e-12, "{:?}", tl.step_gap_s(2));
        assert_eq!(tl.step_blocks(1), vec![], "a backward step is not a forward's blocks");
    }
}
