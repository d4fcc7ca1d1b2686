//! Host tiers: one Flux-dev-shaped checkpoint file served by the
//! copying store (`copy`), the mapped store (`mapped`: blocks served from the page
//! cache), with `--host-ram-gib` from disk past a host RAM budget (`disk`), and
//! coded (`coded`, `coded-file`); each timed from opening the file to the end of
//! the first streamed step, with host memory beyond the page cache, then streamed
//! steps against `max(resident step, streamed bytes ÷ bandwidth)`, bitwise against
//! the resident output. `run` (feature `cuda`) is one process; the merges make the
//! published files from several.

use crate::harness::{enough, sp, spread, spread_of, with_fields};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One mode of one process run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TierRun {
    /// `copy` or `mapped`.
    pub mode: String,
    /// Seconds from opening the file to the end of the first streamed step.
    pub start_s: f64,
    /// Seconds of that spent building the store.
    pub store_build_s: f64,
    /// Resident memory beyond the page cache at the first streamed step (`RssAnon + RssShmem`).
    pub host_rss_bytes: u64,
    /// Buffers served in place and copied, and why any was copied.
    pub mapped_blocks: usize,
    /// Buffers copied.
    pub copied_blocks: usize,
    /// Why (the store's first reason), if any was.
    pub copy_reason: Option<String>,
    /// Host-to-device bandwidth from this store's buffers (bytes/s, best of three passes).
    pub bandwidth: f64,
    /// Timed streamed steps (after the first).
    pub steps_streamed_s: Vec<f64>,
    /// Bytes streamed per step.
    pub step_bytes: u64,
    /// Bytes a step moved across the link: fewer than `step_bytes` where the
    /// blocks are held coded. 0 in runs made before it was recorded, whose
    /// `bandwidth` counted a coded copy's raw bytes too (the bound then divides
    /// `step_bytes` by it).
    #[serde(default)]
    pub link_bytes: u64,
    /// The streamed output equals the resident one, bit for bit.
    pub bitwise_equal: bool,
    /// The output is finite and not constant.
    pub output_finite_nonconstant: bool,
    /// `disk` mode: the host RAM budget, in bytes.
    #[serde(default)]
    pub host_ram_budget_bytes: Option<u64>,
    /// `disk` mode: bytes read from disk per streamed step (the ring's count).
    #[serde(default)]
    pub disk_bytes_per_step: u64,
    /// `disk` mode: the file's read bandwidth in the same process (bytes/s).
    #[serde(default)]
    pub disk_read_bps: f64,
    /// `disk` mode: whether reads bypassed the page cache (`O_DIRECT`).
    #[serde(default)]
    pub direct: bool,
    /// `disk` mode: blocks left on disk.
    #[serde(default)]
    pub disk_blocks: usize,
    /// Wall-clock time (Unix seconds) at the end of the first streamed step.
    #[serde(default)]
    pub first_step_unix_s: f64,
    /// Wall-clock time (Unix seconds) at the end of the last timed step.
    #[serde(default)]
    pub end_unix_s: f64,
    /// Resident memory beyond the page cache at the end of the last timed step.
    #[serde(default)]
    pub host_rss_end_bytes: u64,
    /// The file's pages resident in this process's mappings (`RssFile`: page
    /// cache pages, shared with every process mapping them) at the end of the
    /// last timed step.
    #[serde(default)]
    pub host_rss_file_end_bytes: u64,
    /// `coded` and `coded-file` modes: buffers held coded, and the host bytes
    /// the store's buffers hold.
    #[serde(default)]
    pub coded_blocks: usize,
    /// See [`coded_blocks`](Self::coded_blocks).
    #[serde(default)]
    pub host_bytes: u64,
}

/// One process run of the host-tier bench.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct HostTierRun {
    /// Commit built.
    pub commit: String,
    /// GPU name.
    pub gpu: String,
    /// Registry model and case.
    pub model: String,
    /// Registry case.
    pub case: String,
    /// Prefetch depth of the streamed steps.
    pub depth: usize,
    /// The checkpoint's size in bytes, and whether this process wrote it (else an
    /// earlier process of the same command did, so it is in the page cache).
    pub file_bytes: u64,
    /// Seconds this process spent writing it (0 when it was there).
    pub write_s: f64,
    /// The resident step (every block loaded once), timed steps.
    pub steps_resident_s: Vec<f64>,
    /// `mapped` first (the file warm from the writer or the last process), then `copy`.
    pub modes: Vec<TierRun>,
    /// The processes run at once on one file (`--group`): see [`merge_shared`].
    #[serde(default)]
    pub group: Option<String>,
    /// The process's id (0 in files written before it was recorded).
    #[serde(default)]
    pub pid: u32,
    /// `coded-file` mode: seconds this process spent writing the coded file
    /// (0 when it was there), and its size.
    #[serde(default)]
    pub coded_file_write_s: f64,
    /// See [`coded_file_write_s`](Self::coded_file_write_s).
    #[serde(default)]
    pub coded_file_bytes: u64,
}

/// `merge`'s targets: a warm start from the mapped store within 2 s,
/// host memory beyond the page cache within 1 GiB, the streamed step within
/// 1.03 × its bound, bitwise equal.
pub const START_TARGET_S: f64 = 2.0;
/// See [`START_TARGET_S`].
pub const RSS_TARGET_BYTES: u64 = 1 << 30;
/// See [`START_TARGET_S`].
pub const RATIO_TARGET: f64 = 1.03;
/// The disk tier's target: bytes from disk per streamed second at least this
/// share of the file's read bandwidth measured in the same run.
pub const DISK_TARGET: f64 = 0.9;
/// The disk tier's host memory beyond the page cache may exceed its budget by
/// at most this (the process's own: CUDA's context, the bench's buffers).
pub const DISK_RSS_SLACK_BYTES: u64 = 1 << 30;
/// `merge_shared`: each process of a group holds at least this share of the
/// file's bytes in its mappings while the others serve it too.
pub const SHARED_FILE_SHARE: f64 = 0.9;

/// Two or more processes serving one mapped file at once (`zoo host-tiers
/// --only mapped --group G`, started together), at least `min_groups` groups:
/// the "two processes serving the same file share its page cache". For
/// each group it checks that the processes' streamed steps overlap in time, that
/// at the end of its steps each process maps at least [`SHARED_FILE_SHARE`] of
/// the file (`RssFile`: page-cache pages, one copy whoever maps them) while
/// holding at most [`RSS_TARGET_BYTES`] beyond the page cache, that every
/// block was served in place and that every output is bitwise equal to its
/// process's resident one.
pub fn merge_shared(runs: &[HostTierRun], min_groups: usize) -> Result<Value, String> {
    let mut groups: std::collections::BTreeMap<&str, Vec<(&HostTierRun, &TierRun)>> = Default::default();
    for r in runs {
        let g = r.group.as_deref().ok_or_else(|| format!("merge-host-tiers-shared: a run at {} has no --group", r.commit))?;
        let m = r
            .modes
            .iter()
            .find(|m| m.mode == "mapped")
            .ok_or_else(|| format!("merge-host-tiers-shared: group {g}: a run without mode mapped"))?;
        groups.entry(g).or_default().push((r, m));
    }
    let first = runs.first().ok_or("merge-host-tiers-shared: no runs")?;
    same_head("merge-host-tiers-shared", runs)?;
    for (g, per) in &groups {
        // One process given twice would overlap itself: each must be its own.
        let mut seen: Vec<(u32, u64)> = per.iter().map(|(r, m)| (r.pid, m.first_step_unix_s.to_bits())).collect();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(format!("merge-host-tiers-shared: group {g} holds one process run twice"));
        }
    }
    if groups.len() < min_groups {
        return Err(format!("merge-host-tiers-shared: {} group(s), at least {min_groups} wanted", groups.len()));
    }
    // Every process of every group is pooled into one case below, and
    // `processes_at_once` is one number: groups of different sizes shared the
    // link and the page cache with different numbers of others, and processes
    // of different plans streamed different things, so neither is merged.
    let sizes: std::collections::BTreeMap<usize, &str> = groups.iter().map(|(g, per)| (per.len(), *g)).collect();
    if sizes.len() > 1 {
        let each: Vec<String> = sizes.iter().map(|(n, g)| format!("group {g} has {n}")).collect();
        return Err(format!("merge-host-tiers-shared: groups of different sizes ({}): merge each size on its own", each.join(", ")));
    }
    let every: Vec<(&HostTierRun, &TierRun)> = groups.values().flatten().copied().collect();
    same_plan("merge-host-tiers-shared", "mapped", runs, &every)?;
    let mut out = Vec::new();
    let mut meets_all = true;
    let (mut overlaps, mut rss, mut shares, mut starts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (g, per) in &groups {
        if per.len() < 2 {
            return Err(format!("merge-host-tiers-shared: group {g} has one process"));
        }
        let together = per.iter().map(|(_, m)| m.end_unix_s).fold(f64::INFINITY, f64::min)
            - per.iter().map(|(_, m)| m.first_step_unix_s).fold(f64::NEG_INFINITY, f64::max);
        let rss_max = per.iter().map(|(_, m)| m.host_rss_bytes.max(m.host_rss_end_bytes)).max().unwrap_or(0);
        // A memory reading of 0 is one that failed (`/proc` unreadable): not a pass.
        let rss_read = per.iter().all(|(_, m)| m.host_rss_bytes > 0 && m.host_rss_end_bytes > 0);
        let share_min =
            per.iter().map(|(r, m)| m.host_rss_file_end_bytes as f64 / r.file_bytes.max(1) as f64).fold(f64::INFINITY, f64::min);
        let bitwise = per.iter().all(|(_, m)| m.bitwise_equal && m.output_finite_nonconstant);
        let in_place = per.iter().all(|(_, m)| m.copied_blocks == 0 && m.mapped_blocks > 0);
        let meets = together > 0.0 && rss_read && rss_max <= RSS_TARGET_BYTES && share_min >= SHARED_FILE_SHARE && bitwise && in_place;
        meets_all &= meets;
        overlaps.push(together);
        shares.push(share_min);
        rss.extend(per.iter().map(|(_, m)| m.host_rss_bytes.max(m.host_rss_end_bytes) as f64));
        starts.extend(per.iter().map(|(_, m)| m.start_s));
        out.push(json!({
            "group": g,
            "processes": per.len(),
            "serving_together_s": together,
            "host_rss_max_bytes": rss_max,
            "file_mapped_share_min": share_min,
            "start_s": per.iter().map(|(_, m)| m.start_s).collect::<Vec<_>>(),
            "bandwidth_gbps": per.iter().map(|(_, m)| m.bandwidth / 1e9).collect::<Vec<_>>(),
            "bitwise_equal": bitwise,
            "served_in_place": in_place,
            "meets_targets": meets,
        }));
    }
    // DESIGN's case fields over every process of every group. Not judged: each
    // process shared the link with the other while it streamed.
    let case = with_fields(
        design_case(first, &every, "mapped")?,
        json!({
            "mode": "mapped",
            "repeats": every.len(),
            "processes_at_once": every.len() / groups.len(),
            "ratio_note": "each process streamed while the other of its group did: the ratio is reported, not judged",
        }),
    );
    Ok(with_head(
        first,
        json!({
            "cases": [case],
            "groups": out,
            "serving_together_s": sp(spread(&overlaps)),
            "host_rss_bytes": sp(spread(&rss)),
            "file_mapped_share": sp(spread(&shares)),
            "start_s": sp(spread(&starts)),
            "targets": {"host_rss_bytes": RSS_TARGET_BYTES, "file_mapped_share": SHARED_FILE_SHARE},
            "meets_targets": meets_all,
        }),
    ))
}

/// A merged file: what every host-tier file begins with (date, commit, GPU,
/// backend, model, file size), then `rest`'s fields.
fn with_head(first: &HostTierRun, rest: Value) -> Value {
    with_fields(
        json!({
            "date": std::env::var("BENCH_DATE").unwrap_or_default(),
            "commit": first.commit,
            "gpu": first.gpu,
            "backend": "cuda",
            "model": first.model,
            "file_bytes": first.file_bytes,
        }),
        rest,
    )
}

/// What a run records of its plan for one mode, before anything is timed: the
/// blocks served in place, copied, left on disk and held coded, the bytes a step
/// streams and reads from disk, the host RAM budget, the host bytes the store
/// holds and whether disk reads bypassed the page cache. Runs of one mode merged
/// into one case must agree on all of it: a median over different plans
/// measures none of them.
fn plan_of(m: &TierRun) -> [(&'static str, String); 9] {
    [
        ("mapped_blocks", m.mapped_blocks.to_string()),
        ("copied_blocks", m.copied_blocks.to_string()),
        ("disk_blocks", m.disk_blocks.to_string()),
        ("coded_blocks", m.coded_blocks.to_string()),
        ("step_bytes", m.step_bytes.to_string()),
        ("disk_bytes_per_step", m.disk_bytes_per_step.to_string()),
        ("host_ram_budget_bytes", m.host_ram_budget_bytes.map_or("none".into(), |b| b.to_string())),
        ("host_bytes", m.host_bytes.to_string()),
        ("direct", m.direct.to_string()),
    ]
}

/// The number (1-based, in the order given) and process id by which an error
/// names `r`, one of `runs`; `zoo` adds each number's file. Files from before the
/// id was recorded hold 0: no id is named then.
fn run_name(runs: &[HostTierRun], r: &HostTierRun) -> String {
    let pid = if r.pid > 0 { format!(" (pid {})", r.pid) } else { String::new() };
    match runs.iter().position(|x| std::ptr::eq(x, r)) {
        Some(i) => format!("run {}{pid}", i + 1),
        None => format!("a run{pid}"),
    }
}

/// Refuses `per` (one mode's runs, each one of `runs`) unless every run's plan
/// ([`plan_of`]) is the first's; the error, prefixed by `what`, names both runs
/// and every field that differs.
fn same_plan(what: &str, mode: &str, runs: &[HostTierRun], per: &[(&HostTierRun, &TierRun)]) -> Result<(), String> {
    let Some((r0, m0)) = per.first() else { return Ok(()) };
    let want = plan_of(m0);
    for (r, m) in &per[1..] {
        let differs: Vec<String> = plan_of(m)
            .iter()
            .zip(&want)
            .filter(|(got, want)| got.1 != want.1)
            .map(|((name, got), (_, want))| format!("{name} {got} against {want}"))
            .collect();
        if !differs.is_empty() {
            return Err(format!(
                "{what}: mode {mode}: {} ran another plan than {}: {}; merge runs of one plan only",
                run_name(runs, r),
                run_name(runs, r0),
                differs.join(", ")
            ));
        }
    }
    Ok(())
}

/// Each run's `mode`, refused (prefixed by `what`) where a run lacks it or where
/// the runs' plans for it differ ([`same_plan`]).
fn runs_of_mode<'a>(what: &str, mode: &str, runs: &'a [HostTierRun]) -> Result<Vec<(&'a HostTierRun, &'a TierRun)>, String> {
    let of = |r: &'a HostTierRun| r.modes.iter().find(|m| m.mode == mode).map(|m| (r, m));
    let per = runs
        .iter()
        .map(|r| of(r).ok_or_else(|| format!("{what}: {} has no {mode} mode", run_name(runs, r))))
        .collect::<Result<Vec<_>, _>>()?;
    same_plan(what, mode, runs, &per)?;
    Ok(per)
}

/// Refuses `runs` unless they share one commit, GPU, model, case, depth and
/// checkpoint size (what [`with_head`] writes once for all); the error, prefixed
/// by `what`, names the first run that differs.
fn same_head(what: &str, runs: &[HostTierRun]) -> Result<(), String> {
    let Some(first) = runs.first() else { return Ok(()) };
    let head =
        |r: &HostTierRun| format!("{} on {}, {} {} d={}, a file of {} bytes", r.commit, r.gpu, r.model, r.case, r.depth, r.file_bytes);
    match runs.iter().find(|r| head(r) != head(first)) {
        Some(r) => Err(format!("{what}: {} is {}, {} is {}", run_name(runs, first), head(first), run_name(runs, r), head(r))),
        None => Ok(()),
    }
}

/// Per process run of one mode: its resident and streamed step (medians of its
/// timed steps), its bound `max(resident, bytes ÷ bandwidth)` and the ratio of
/// the two; on disk also the disk estimate (see [`disk_estimate_s`]) and the
/// step's ratio to it.
#[derive(Default)]
struct PerRun {
    resident: Vec<f64>,
    steps: Vec<f64>,
    bounds: Vec<f64>,
    ratios: Vec<f64>,
    estimates: Vec<f64>,
    estimate_ratios: Vec<f64>,
}

/// The disk mode's estimate of its step: the slower of its bound and the bytes
/// it reads from disk at the file's read rate probed in the same process. Not a
/// bound: the probe is one sample of a varying rate over the file's first 4 GiB,
/// so a step can beat it. The link and the compute bound the step: `bound_s`.
fn disk_estimate_s(bound: f64, m: &TierRun) -> f64 {
    match m.disk_read_bps > 0.0 {
        true => bound.max(m.disk_bytes_per_step as f64 / m.disk_read_bps),
        false => bound,
    }
}

fn per_run(per: &[(&HostTierRun, &TierRun)], mode: &str) -> Result<PerRun, String> {
    let mut out = PerRun::default();
    for (r, m) in per {
        let resident = spread(&r.steps_resident_s).ok_or_else(|| format!("{mode}: no resident steps"))?.median;
        let step = spread(&m.steps_streamed_s).ok_or_else(|| format!("{mode}: no streamed steps"))?.median;
        if m.bandwidth <= 0.0 || !m.bandwidth.is_finite() {
            return Err(format!("{mode}: bandwidth {} is not a measurement", m.bandwidth));
        }
        // Every streamed byte crosses the link and every block computes, in every
        // mode: that bounds the step. The disk's share is an estimate, kept apart.
        // The bytes that crossed the link at the link's rate (`bandwidth` counts
        // link bytes; before `link_bytes` was recorded it counted raw bytes, as
        // `step_bytes` does).
        let crossed = if m.link_bytes > 0 { m.link_bytes } else { m.step_bytes };
        let bound = resident.max(crossed as f64 / m.bandwidth);
        out.resident.push(resident);
        out.bounds.push(bound);
        out.steps.push(step);
        out.ratios.push(step / bound);
        if mode == "disk" {
            let estimate = disk_estimate_s(bound, m);
            out.estimates.push(estimate);
            out.estimate_ratios.push(step / estimate);
        }
    }
    Ok(out)
}

/// The fields `DESIGN.md` asks of every case (resolution, batch, depth, device
/// budget, resident and streamed step, bandwidth, bytes, bound, ratio, peak
/// device bytes, bitwise), medians with min and max over `per`. These runs keep
/// no device budget and do not record the device's peak: both are null.
fn design_case(first: &HostTierRun, per: &[(&HostTierRun, &TierRun)], mode: &str) -> Result<Value, String> {
    let case = crate::registry::model(&first.model)?.case(&first.case)?.clone();
    let p = per_run(per, mode)?;
    let col = |f: &dyn Fn(&TierRun) -> f64| spread_of(per.iter().map(|(_, m)| f(m)));
    Ok(json!({
        "model": first.model,
        "case": first.case,
        "resolution": case.resolution,
        "batch": case.batch,
        "depth": first.depth,
        "budget_bytes": Value::Null,
        "step_resident_s": sp(spread(&p.resident)),
        "step_streamed_s": sp(spread(&p.steps)),
        "bandwidth_gbps": col(&|m| m.bandwidth / 1e9),
        // One number: the callers refuse runs whose plans (these bytes among them) differ.
        "streamed_bytes": per.first().map(|(_, m)| m.step_bytes),
        "bound_s": sp(spread(&p.bounds)),
        "ratio_to_bound": sp(spread(&p.ratios)),
        "peak_device_bytes": Value::Null,
        "bitwise_equal": per.iter().all(|(_, m)| m.bitwise_equal && m.output_finite_nonconstant),
    }))
}

/// Medians with min and max over `runs` (at least `min_repeats`, one commit,
/// GPU, model, case, depth and checkpoint) per mode: the file. Runs
/// whose plans for a mode differ (blocks in place, copied, on disk or coded,
/// bytes streamed or read from disk, the host RAM budget: [`plan_of`]) are
/// refused, each named. Every mode's `bound_s` is `max(resident step, streamed
/// bytes ÷ bandwidth)`; the disk mode adds `disk_estimate_s` and
/// `ratio_to_disk_estimate` ([`disk_estimate_s`]), reported, not judged.
pub fn merge(runs: &[HostTierRun], min_repeats: usize) -> Result<Value, String> {
    let first = enough("merge-host-tiers", runs, min_repeats)?;
    same_head("merge-host-tiers", runs)?;
    let mut cases = Vec::new();
    let mut meets_all = true;
    let with_disk = runs.iter().any(|r| r.modes.iter().any(|m| m.mode == "disk"));
    let modes: &[&str] = if with_disk { &["mapped", "disk", "copy"] } else { &["mapped", "copy"] };
    let mut disk_read = None;
    for &mode in modes {
        let per = runs_of_mode("merge-host-tiers", mode, runs)?;
        let PerRun { steps, ratios, estimates, estimate_ratios, .. } = per_run(&per, mode)?;
        let col = |f: &dyn Fn(&TierRun) -> f64| spread_of(per.iter().map(|(_, m)| f(m)));
        let start = spread(&per.iter().map(|(_, m)| m.start_s).collect::<Vec<_>>());
        let rss = spread(&per.iter().map(|(_, m)| m.host_rss_bytes as f64).collect::<Vec<_>>());
        let ratio = spread(&ratios);
        let bitwise = per.iter().all(|(_, m)| m.bitwise_equal && m.output_finite_nonconstant);
        // Bytes from disk per second of streamed step, and that over the read bandwidth.
        let streams: Vec<f64> = per.iter().zip(&steps).map(|((_, m), step)| m.disk_bytes_per_step as f64 / step / 1e9).collect();
        let reads: Vec<f64> = per.iter().map(|(_, m)| m.disk_read_bps / 1e9).collect();
        let shares: Vec<f64> = streams.iter().zip(&reads).map(|(s, r)| s / r).collect();
        let (disk_stream, disk_share, estimate, estimate_ratio) = match mode {
            "disk" => {
                if reads.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
                    return Err("disk: a run has no disk read bandwidth".into());
                }
                disk_read = spread(&reads);
                (sp(spread(&streams)), sp(spread(&shares)), sp(spread(&estimates)), sp(spread(&estimate_ratios)))
            }
            _ => (Value::Null, Value::Null, Value::Null, Value::Null),
        };
        let meets = match mode {
            "disk" => {
                spread(&shares).is_some_and(|s| s.median >= DISK_TARGET)
                    && bitwise
                    && per.iter().all(|(_, m)| m.disk_blocks > 0 && m.host_ram_budget_bytes.is_some())
                    && per.iter().all(|(_, m)| {
                        // After the first step and after the last (files from before the
                        // second reading have 0 there); a reading of 0 failed: not a pass.
                        m.host_rss_bytes > 0
                            && m.host_rss_bytes.max(m.host_rss_end_bytes) <= m.host_ram_budget_bytes.unwrap_or(0) + DISK_RSS_SLACK_BYTES
                    })
            }
            "mapped" => {
                start.is_some_and(|s| s.max <= START_TARGET_S)
                    && rss.is_some_and(|s| s.min > 0.0 && s.max <= RSS_TARGET_BYTES as f64)
                    && ratio.is_some_and(|s| s.median <= RATIO_TARGET)
                    && bitwise
                    && per.iter().all(|(_, m)| m.copied_blocks == 0)
            }
            _ => ratio.is_some_and(|s| s.median <= RATIO_TARGET) && bitwise,
        };
        meets_all &= meets;
        let extra = json!({
            "mode": mode,
            "repeats": per.len(),
            "start_s": sp(start),
            "store_build_s": col(&|m| m.store_build_s),
            "host_rss_bytes": sp(rss),
            // The plan's fields once: `same_plan` refused runs where they differ.
            "host_ram_budget_bytes": per[0].1.host_ram_budget_bytes,
            "disk_blocks": per[0].1.disk_blocks,
            "disk_direct": per[0].1.direct,
            "disk_stream_gbps": disk_stream,
            "disk_stream_to_read": disk_share,
            "disk_estimate_s": estimate,
            "ratio_to_disk_estimate": estimate_ratio,
            "mapped_blocks": per[0].1.mapped_blocks,
            "copied_blocks": per[0].1.copied_blocks,
            "copy_reason": per.iter().find_map(|(_, m)| m.copy_reason.clone()),
            "meets_targets": meets,
        });
        cases.push(with_fields(design_case(first, &per, mode)?, extra));
    }
    Ok(with_head(
        first,
        json!({
            "process_runs": runs.len(),
            "disk_read_gbps": sp(disk_read),
            "targets": {
                "mapped_start_s": START_TARGET_S,
                "mapped_host_rss_bytes": RSS_TARGET_BYTES,
                "ratio_to_bound": RATIO_TARGET,
                "disk_stream_to_read": DISK_TARGET,
            },
            "cases": cases,
            "meets_targets": meets_all,
        }),
    ))
}

/// A coded start from a coded file made ahead of time (`zoo host-tiers --only
/// coded-file,coded`): per mode (`coded-file`: `HostStore::build_from_coded_file`;
/// `coded`: every block coded at build, `PinOptions::coded`) the start from
/// opening the checkpoint to the end of the first streamed step, the store's
/// build, the streamed step, medians with min and max over at least
/// `min_repeats` process runs of one commit, model, case and depth; per run the
/// `coded` start over the `coded-file` one (`start_speedup`). Runs whose plans
/// for a mode differ (buffers held coded, host bytes, … : [`plan_of`]) or whose
/// coded files differ in size are refused, each named. `checks_pass`: both modes
/// bitwise equal to the resident output, finite and not constant, with at least
/// one buffer held coded and the same host bytes in both modes. No target: the
/// issue asked for the file, not for a time.
pub fn merge_coded_start(runs: &[HostTierRun], min_repeats: usize) -> Result<Value, String> {
    let first = enough("merge-coded-start", runs, min_repeats)?;
    same_head("merge-coded-start", runs)?;
    // One coded file for every run: `coded_file_bytes` is written once.
    if let Some(r) = runs.iter().find(|r| r.coded_file_bytes != first.coded_file_bytes) {
        return Err(format!(
            "merge-coded-start: {} read a coded file of {} bytes, {} one of {} bytes: merge runs of one file only",
            run_name(runs, first),
            first.coded_file_bytes,
            run_name(runs, r),
            r.coded_file_bytes
        ));
    }
    let mut cases = Vec::new();
    let mut checks = true;
    let mut starts: Vec<Vec<f64>> = Vec::new();
    for mode in ["coded-file", "coded"] {
        let per = runs_of_mode("merge-coded-start", mode, runs)?;
        let col = |f: &dyn Fn(&TierRun) -> f64| spread_of(per.iter().map(|(_, m)| f(m)));
        let bitwise = per.iter().all(|(_, m)| m.bitwise_equal && m.output_finite_nonconstant);
        let coded = per[0].1.coded_blocks;
        checks &= bitwise && coded > 0;
        starts.push(per.iter().map(|(_, m)| m.start_s).collect());
        let extra = json!({
            "mode": mode,
            "repeats": per.len(),
            "start_s": col(&|m| m.start_s),
            "store_build_s": col(&|m| m.store_build_s),
            "host_rss_bytes": col(&|m| m.host_rss_bytes as f64),
            "coded_blocks": coded,
            "host_bytes": per[0].1.host_bytes,
        });
        cases.push(with_fields(design_case(first, &per, mode)?, extra));
    }
    // Same shapes in both modes (the bound fields of `design_case` aside).
    if cases.iter().any(|c| c["host_bytes"] != cases[0]["host_bytes"]) {
        checks = false;
    }
    let speedups: Vec<f64> = starts[1].iter().zip(&starts[0]).map(|(coded, file)| coded / file).collect();
    let writes: Vec<f64> = runs.iter().map(|r| r.coded_file_write_s).filter(|&w| w > 0.0).collect();
    Ok(with_head(
        first,
        json!({
            "process_runs": runs.len(),
            "page_cache": "warm: the checkpoint and the coded file were written or read by an earlier process of the same command",
            "coded_file_bytes": first.coded_file_bytes,
            "coded_file_write_s": writes,
            "start_speedup": sp(spread(&speedups)),
            "cases": cases,
            "checks_pass": checks,
        }),
    ))
}

#[cfg(feature = "cuda")]
pub use run::run;

#[cfg(feature = "cuda")]
mod run {
    use super::{HostTierRun, TierRun};
    use crate::registry::Model;
    use crate::source::{bf16_to_f32, block_inventory, resolved, RegistrySource};
    use offload_core::{host_rss_beyond_page_cache, HostStore, OffloadBackend, PinOptions, Plan, Ring, SafetensorsFile, TensorSource};
    use offload_core::{HostBuffer as _, HostMemory as _};
    use offload_cuda::reference::RefNet;
    use offload_cuda::CudaBackend;
    use std::io::Write;
    use std::sync::Arc;
    use std::time::Instant;

    fn err(what: impl std::fmt::Display) -> String {
        format!("host-tiers: {what}")
    }

    /// Write `model`'s weights (random bf16, seed 0, as the store reads them) to
    /// `path` as a safetensors file, block by block in the inventory's order.
    fn write_checkpoint(model: &Model, path: &str) -> Result<u64, String> {
        let src = RegistrySource::new(model, 0);
        let inv = block_inventory(model, src.specs()).map_err(err)?;
        let index: std::collections::HashMap<&str, usize> = src.specs().iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let order: Vec<usize> = inv.blocks().flat_map(|b| b.tensors.iter().map(|t| index[t.name.as_str()])).collect();
        let mut header = serde_json::Map::new();
        let mut at = 0u64;
        for &i in &order {
            let s = &src.specs()[i];
            let n = s.nbytes().map_err(err)? as u64;
            header.insert(s.name.clone(), serde_json::json!({"dtype": "BF16", "shape": s.shape, "data_offsets": [at, at + n]}));
            at += n;
        }
        let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).map_err(err)?;
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let tmp = format!("{path}.part");
        let mut f = std::io::BufWriter::with_capacity(64 << 20, std::fs::File::create(&tmp).map_err(|e| err(format!("{tmp}: {e}")))?);
        f.write_all(&(h.len() as u64).to_le_bytes()).and_then(|()| f.write_all(&h)).map_err(|e| err(format!("{tmp}: {e}")))?;
        let mut buf = Vec::new();
        for &i in &order {
            buf.resize(src.specs()[i].nbytes().map_err(err)?, 0);
            src.read_into(i, &mut buf).map_err(err)?;
            f.write_all(&buf).map_err(|e| err(format!("{tmp}: {e}")))?;
        }
        f.flush().map_err(|e| err(format!("{tmp}: {e}")))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| err(format!("{path}: {e}")))?;
        Ok(8 + h.len() as u64 + at)
    }

    /// The file's read bandwidth through the disk tier's reader (`O_DIRECT` where
    /// the file system allows), with as many reads in flight as a ring's disk
    /// stream keeps ([`offload_core::disk::DISK_READERS`] threads, each reading
    /// every n-th 256 MiB chunk into its own page-locked buffer), over the first
    /// `bytes` of the file. Bytes/s, and whether the reads were direct.
    fn disk_read_bps(be: &CudaBackend, file: &str, bytes: u64) -> Result<(f64, bool), String> {
        let f = offload_core::DiskFile::open(file).map_err(err)?;
        let chunk = 256usize << 20;
        let end = bytes.min(f.len());
        let readers = offload_core::disk::DISK_READERS;
        let mut bufs = (0..readers)
            .map(|_| be.host().alloc_pinned(offload_core::DiskFile::span(chunk), "disk read probe", &mut |_| Ok(())).map_err(err))
            .collect::<Result<Vec<_>, _>>()?;
        let t = Instant::now();
        std::thread::scope(|s| {
            let handles: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, buf)| {
                    let f = &f;
                    s.spawn(move || -> Result<(), String> {
                        let mut at = (i * chunk) as u64;
                        while at < end {
                            let n = chunk.min((end - at) as usize);
                            buf.refill(&mut |dst| f.read_block(at, n, dst, "disk read probe")).map_err(err)?;
                            at += (readers * chunk) as u64;
                        }
                        Ok(())
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().map_err(|_| err("a disk probe thread panicked"))?)
        })?;
        Ok((end as f64 / t.elapsed().as_secs_f64().max(1e-9), f.is_direct()))
    }

    fn unix_s() -> f64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
    }

    /// One process: write the checkpoint if it is not there, then per mode
    /// (mapped, then disk with `host_ram` bytes of host RAM when given, then copy;
    /// only `only` when given) open → store → first streamed step, timed steps
    /// (`disk_steps` of them on disk).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        model: &Model,
        case: &str,
        depth: usize,
        steps: usize,
        file: &str,
        commit: &str,
        host_ram: Option<u64>,
        disk_steps: usize,
        only: Option<&str>,
    ) -> Result<HostTierRun, String> {
        use crate::harness::gib;
        let be = CudaBackend::new(0).map_err(err)?;
        let gpu = be.device_name().unwrap_or_default();
        let c = model.case(case)?;
        let t = Instant::now();
        let (file_bytes, write_s) = match std::fs::metadata(file) {
            Ok(m) => (m.len(), 0.0),
            Err(_) => (write_checkpoint(model, file)?, t.elapsed().as_secs_f64()),
        };
        eprintln!(
            "checkpoint {file}: {:.2} GiB{}",
            gib(file_bytes),
            if write_s > 0.0 { format!(", written in {write_s:.1} s") } else { String::new() }
        );
        let dims = crate::cuda::dims(model, c)?;
        let mut doc = HostTierRun {
            commit: commit.into(),
            gpu,
            model: model.name.into(),
            case: case.into(),
            depth,
            file_bytes,
            write_s,
            ..Default::default()
        };
        // Each mode's output, compared after the loop with a reference that no tier
        // made: the file's weights copied into a plain store.
        let mut outs: Vec<Vec<u16>> = Vec::new();
        let all: &[&str] = if host_ram.is_some() { &["mapped", "disk", "copy"] } else { &["mapped", "copy"] };
        // The coded modes run only when named.
        let named: &[&str] = &["mapped", "disk", "copy", "coded", "coded-file"];
        let modes: Vec<&str> = match only {
            None => all.to_vec(),
            Some(list) => list.split(',').map(str::trim).collect(),
        };
        if let Some(bad) = modes.iter().find(|m| !named.contains(m) || (**m == "disk" && host_ram.is_none())) {
            return Err(err(format!("--only {}: {bad:?} is not one of {named:?} (disk needs --host-ram-gib)", only.unwrap_or_default())));
        }
        if modes.is_empty() || modes.iter().enumerate().any(|(i, m)| modes[..i].contains(m)) {
            return Err(err(format!("--only {}: no mode, or one named twice", only.unwrap_or_default())));
        }
        // The coded file, beside the checkpoint, written before any clock starts.
        let coded_path = offload_core::CodedFile::path_for(file);
        if modes.contains(&"coded-file") {
            if !coded_path.exists() {
                let src = SafetensorsFile::open(file).map_err(err)?;
                let inv = block_inventory(model, src.specs()).map_err(err)?;
                let o = offload_cuda::CodingOptions::default();
                let stats = offload_core::CodedFile::write(&coded_path, &inv, &src, o.segment_bytes, o.threads).map_err(err)?;
                doc.coded_file_write_s = stats.write_s;
                eprintln!(
                    "coded file {}: {:.2} GiB of {:.2} GiB, written in {:.1} s",
                    coded_path.display(),
                    gib(stats.coded_bytes),
                    gib(stats.raw_bytes),
                    stats.write_s
                );
            }
            doc.coded_file_bytes = std::fs::metadata(&coded_path).map_err(|e| err(format!("{}: {e}", coded_path.display())))?.len();
        }
        for mode in modes {
            be.synchronize().map_err(err)?;
            // The disk's read bandwidth, measured before the clock starts.
            let (disk_bps, direct) = match mode {
                "disk" => disk_read_bps(&be, file, 4 << 30)?,
                _ => (0.0, false),
            };
            if mode == "disk" {
                eprintln!("disk: the file reads at {:.2} GB/s (O_DIRECT {direct})", disk_bps / 1e9);
            }
            let t0 = Instant::now();
            let src: SafetensorsFile = match mode {
                "mapped" => offload_cuda::map_checkpoint(file).map_err(err)?,
                _ => SafetensorsFile::open(file).map_err(err)?,
            };
            let inv = block_inventory(model, src.specs()).map_err(err)?;
            let mut cp = offload_core::ComponentPlan { prefetch_depth: depth, ..Default::default() };
            if let ("disk", Some(budget)) = (mode, host_ram) {
                if doc.steps_resident_s.is_empty() {
                    return Err(
                        "the disk mode plans from this process's resident step: run it after another mode (--only mapped,disk)".into()
                    );
                }
                // The planner's choice: compute per block from this process's resident
                // step, shared out by bytes; the link and the disk as measured here.
                let mut cm = offload_plan::CostModel::from_inventory(&inv, 55e9).map_err(err)?;
                let resident = crate::harness::median(&doc.steps_resident_s);
                let total = cm.total_bytes().max(1) as f64;
                for b in &mut cm.blocks {
                    b.compute_s = resident * b.bytes as f64 / total;
                }
                let choice = offload_plan::plan_host_tier(&cm, &vec![false; cm.blocks.len()], depth, budget, disk_bps).map_err(err)?;
                eprintln!(
                    "disk: {} of {} blocks on disk ({:.2} GiB a step; host {:.2} GiB of which bounce {:.2} GiB), predicted step {:.2} s",
                    choice.on_disk.iter().filter(|d| **d).count(),
                    cm.blocks.len(),
                    gib(choice.disk_bytes_per_step),
                    gib(choice.host_bytes),
                    gib(choice.bounce_bytes),
                    choice.predicted_step_s
                );
                cp.disk_blocks = choice.disk_ids(&cm);
                cp.host_ram_budget_bytes = Some(budget);
            }
            let rc = resolved(&Plan::layerwise().component("transformer", cp), &inv).map_err(err)?;
            let store = Arc::new(match mode {
                "mapped" => HostStore::build_mapped(&be, &inv, &src, PinOptions::default()).map_err(err)?,
                "disk" => HostStore::build_tiered(&be, &inv, &src, PinOptions::default(), &|id| rc.is_on_disk(id)).map_err(err)?,
                "coded" => HostStore::build_with(&be, &inv, &src, PinOptions { coded: true, ..Default::default() }).map_err(err)?,
                "coded-file" => {
                    let cf = offload_core::CodedFile::open(&coded_path).map_err(err)?;
                    HostStore::build_from_coded_file(&be, &inv, &src, PinOptions::default(), &cf).map_err(err)?
                }
                _ => HostStore::build(&be, &inv, &src).map_err(err)?,
            });
            let store_build_s = store.tier().build_s;
            let mut net = RefNet::new(&be, dims, c.resolution as u64).map_err(err)?;
            let mut ring = Ring::new(be.clone(), store.clone(), &rc).map_err(err)?;
            crate::cuda::step(&be, model, &mut net, &mut ring, None).map_err(err)?;
            be.synchronize().map_err(err)?;
            let start_s = t0.elapsed().as_secs_f64();
            let first_step_unix_s = unix_s();
            let rss = host_rss_beyond_page_cache().unwrap_or(0);
            eprintln!(
                "{mode}: open → first streamed step {start_s:.2} s (store {store_build_s:.2} s; {} served in place, {} copied{}), host RSS beyond the page cache {:.2} GiB",
                store.tier().mapped,
                store.tier().copied,
                store.tier().copy_reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default(),
                gib(rss)
            );
            let n = if mode == "disk" { disk_steps } else { steps };
            let (times, moved) = crate::cuda::timed_steps(&be, model, &mut net, &mut ring, (0, n))?;
            let (step_bytes, disk_bytes, link_bytes) = (moved.copied, moved.disk, moved.link);
            let (end_unix_s, rss_end, rss_file_end) =
                (unix_s(), host_rss_beyond_page_cache().unwrap_or(0), offload_core::host_rss_file_bytes().unwrap_or(0));
            let out = net.output().map_err(err)?;
            ring.close().map_err(err)?;
            // The resident step's time: every block loaded once, from the first store
            // (where the blocks came from does not change the resident step).
            if doc.steps_resident_s.is_empty() {
                doc.steps_resident_s = crate::cuda::ring_steps(&be, model, (&store, &Plan::resident(), &inv), &mut net, (1, steps))?.0;
            }
            let bandwidth = offload_core::probe_bandwidth(&be, &store, 3).map_err(err)?;
            let (finite, nonconstant) = crate::harness::check_output(&bf16_to_f32(&out));
            let median = crate::harness::median(&times);
            eprintln!(
                "{mode}: streamed {median:.4} s at d={depth}, {:.2} GiB a step at {:.1} GB/s, finite {finite}, nonconstant {nonconstant}",
                gib(step_bytes),
                bandwidth / 1e9
            );
            outs.push(out);
            doc.modes.push(TierRun {
                mode: mode.into(),
                start_s,
                store_build_s,
                host_rss_bytes: rss,
                mapped_blocks: store.tier().mapped,
                copied_blocks: store.tier().copied,
                copy_reason: store.tier().copy_reason.clone(),
                bandwidth,
                steps_streamed_s: times,
                step_bytes,
                link_bytes,
                // Set below, against the reference.
                bitwise_equal: false,
                output_finite_nonconstant: finite && nonconstant,
                host_ram_budget_bytes: if mode == "disk" { host_ram } else { None },
                disk_bytes_per_step: disk_bytes,
                disk_read_bps: disk_bps,
                direct,
                disk_blocks: store.tier().on_disk,
                first_step_unix_s,
                end_unix_s,
                host_rss_end_bytes: rss_end,
                host_rss_file_end_bytes: rss_file_end,
                coded_blocks: store.coded_blocks(),
                host_bytes: store.host_bytes(),
            });
            drop(net);
            drop(store);
            be.synchronize().map_err(err)?;
            let _ = be.name();
        }
        // The reference: the file's weights copied into a plain store (no tier's
        // own path: a mode judged against its own store would pass whatever its
        // store held), one resident step, after every mode has been measured.
        let reference = {
            let src = SafetensorsFile::open(file).map_err(err)?;
            let inv = block_inventory(model, src.specs()).map_err(err)?;
            let plain = Arc::new(HostStore::build(&be, &inv, &src).map_err(err)?);
            let mut net = RefNet::new(&be, dims, c.resolution as u64).map_err(err)?;
            crate::cuda::ring_steps(&be, model, (&plain, &Plan::resident(), &inv), &mut net, (0, 1))?.2
        };
        for (m, out) in doc.modes.iter_mut().zip(&outs) {
            m.bitwise_equal = *out == reference;
            eprintln!("{}: bitwise_equal {} (against the file's weights in a plain store)", m.mode, m.bitwise_equal);
        }
        Ok(doc)
    }
}

#[cfg(test)]
mod tests;
