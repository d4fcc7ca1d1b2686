//! The harness: what one process run writes, the output checks, and the merge of
//! several process runs and the anchors' runs into one results file, every
//! spread, bound, ratio and comparison computed here from the runs' own figures.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// What one process run times (`zoo run`).
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Cases of the model to time.
    pub cases: Vec<String>,
    /// Prefetch depths of the streamed runs.
    pub depths: Vec<usize>,
    /// Also stream each case at the planner's depth for a fully streamed ring
    /// (`--depths …,auto`; candle's file; [`offload_plan::streamed_depth`]).
    pub auto_depth: bool,
    /// Timed steps per case (after `warmup` untimed ones).
    pub steps: usize,
    /// Untimed steps before timing.
    pub warmup: usize,
    /// Commit built.
    pub commit: String,
    /// Device budgets for weights, GiB: per case, the planner's choice under each,
    /// calibrated from the resident run (`--budgets`; cuda's and candle's files).
    pub budgets_gib: Vec<f64>,
    /// Where to write a Chrome trace of one extra streamed step with the ring's
    /// timeline on (`--trace`; cuda's file only).
    pub trace: Option<String>,
    /// Skip the GEMMs (`--no-gemm`: a sanitizer's run over the other kernels;
    /// cuda's file only). Its timings are not a measurement: `merge` refuses it.
    pub no_gemm: bool,
    /// Also stream every case from a store coded for the device (`--coded`;
    /// cuda's file only; weights drawn normal).
    pub coded: bool,
    /// With `coded`: the decoder on a stream of the device's highest priority
    /// (`--high-priority-decode`; `CodingOptions::high_priority_decode`).
    pub high_priority_decode: bool,
    /// The reference model computes on a stream of the device's highest priority
    /// (`--high-priority-compute`; `CudaBackend::new_high_priority_compute`; cuda's file only).
    pub high_priority_compute: bool,
    /// With `coded`: each case and depth streamed again from the coded store
    /// with each of these numbers of staging buffers (`--staging-buffers 4,6`).
    pub staging_buffers: Vec<usize>,
}

/// The tolerance of `--depths auto` ([`offload_plan::streamed_depth`]).
pub const AUTO_DEPTH_TOLERANCE: f64 = 0.01;
/// The deepest ring `--depths auto` tries.
pub const AUTO_DEPTH_MAX: usize = 4;

/// How the planner chose a streamed case's depth (`--depths auto`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PlannerDepth {
    /// Its replayed step at the chosen depth, seconds.
    pub predicted_step_s: f64,
    /// Its replayed step at each depth from 1 to [`AUTO_DEPTH_MAX`], seconds.
    pub replayed_s_by_depth: Vec<f64>,
    /// The bound of the calibration it replayed, seconds.
    pub calibrated_bound_s: f64,
}

/// The coded step with one number of staging buffers (`--staging-buffers`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StagingRun {
    /// Staging buffers the decode engine held.
    pub staging_buffers: usize,
    /// Timed coded steps, seconds.
    pub steps_s: Vec<f64>,
    /// The output byte-identical to the resident output.
    pub bitwise_equal: bool,
    /// The most staging bytes held at once during this process so far.
    pub staging_peak_bytes: u64,
}

/// One timed case of one process run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunCase {
    /// Registry model.
    pub model: String,
    /// Registry case (`1024`).
    pub case: String,
    /// Image width in pixels.
    pub resolution: usize,
    /// Image height in pixels (absent in runs before `--size`: square).
    #[serde(default)]
    pub height: usize,
    /// Latent frames (absent in runs before `--frames`).
    #[serde(default)]
    pub frames: usize,
    /// Tokens per call (image + text).
    pub tokens: usize,
    /// Batch.
    pub batch: usize,
    /// Prefetch depth of the streamed run.
    pub depth: usize,
    /// Every timed resident step, seconds.
    pub steps_resident_s: Vec<f64>,
    /// Every timed streamed step, seconds.
    pub steps_streamed_s: Vec<f64>,
    /// Bytes streamed per step (every block).
    pub streamed_bytes: u64,
    /// Pinned host-to-device bandwidth measured in this process, GB/s.
    pub bandwidth_gbps: f64,
    /// Weights on the device during the streamed step: the most slot bytes live
    /// at once plus the resident (non-block) weights.
    pub weights_device_bytes: u64,
    /// Weights on the device by the method used for the anchors too: streamed
    /// peak allocated − what was allocated before the step other than weights −
    /// the resident step's activations.
    pub weights_device_bytes_derived: u64,
    /// The most bytes a resident step allocated on top of what was allocated
    /// before it (activations, workspaces, the output).
    pub activations_peak_bytes: u64,
    /// Streamed output byte-identical to the resident output.
    pub bitwise_equal: bool,
    /// Every output element finite.
    pub output_finite: bool,
    /// Output not constant (max ≠ min).
    pub output_nonconstant: bool,
    /// Elements of the streamed output (batch × tokens × channels: the case's shape).
    #[serde(default)]
    pub output_elements: usize,
    /// Blocks that were not prefetched in time.
    pub misses: u64,
    /// With `--coded`: every timed step streamed from the coded store, seconds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps_streamed_coded_s: Vec<f64>,
    /// With `--coded`: the coded run's output byte-identical to the resident output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coded_bitwise_equal: Option<bool>,
    /// With `--coded --staging-buffers N,…`: the coded step again with each
    /// number of staging buffers (`CudaBackend::set_staging_buffers`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coded_by_staging: Vec<StagingRun>,
    /// With `--coded`: the planner's coding choice for this case and depth, every
    /// block streamed, from this run's calibration, asked before the timed steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<PlannerCoding>,
    /// With `--depths auto`: this case's depth was the planner's choice, asked
    /// before the timed streamed steps (`None`: a depth given on the command line).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner_depth: Option<PlannerDepth>,
    /// The model's blocks (0 in runs from before it was recorded): a row whose
    /// blocks all fit in its ring's `depth + 1` slots never streamed in steady
    /// state, and a merge refuses it.
    #[serde(default, skip_serializing_if = "is_default")]
    pub blocks: usize,
}

/// The planner's coding choice for one case and depth ([`offload_plan::Choice::with_coding`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PlannerCoding {
    /// Whether it codes the streamed blocks.
    pub coded: bool,
    /// Its replayed step without coding, seconds.
    pub predicted_raw_s: f64,
    /// Its replayed step with every block coded, seconds.
    pub predicted_coded_s: f64,
}

/// What one process run writes.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunDoc {
    /// `BENCH_DATE`.
    pub date: String,
    /// Commit built.
    pub commit: String,
    /// GPU name.
    pub gpu: String,
    /// Backend (`tch`).
    pub backend: String,
    /// Bytes of every block.
    pub block_bytes_total: u64,
    /// Bytes of the largest block.
    pub largest_block_bytes: u64,
    /// Bytes of the non-block weights (kept on the device).
    pub resident_bytes: u64,
    /// Seconds to build the host store (every block copied into page-locked memory).
    #[serde(default)]
    pub store_build_s: f64,
    /// The process's resident set once the store was built, bytes (`VmRSS`).
    #[serde(default)]
    pub host_rss_bytes: u64,
    /// Timed cases.
    pub cases: Vec<RunCase>,
    /// The planner's choice under each `--budgets` budget, run and timed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub budgets: Vec<crate::budgets::BudgetRun>,
    /// The cost model each case's budget runs were planned with.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub calibrations: Vec<crate::budgets::Calibration>,
    /// The extra step traced with `--trace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline_step: Option<TimelineStep>,
    /// Run with `--no-gemm` (a sanitizer's run; not a measurement).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_gemm: bool,
    /// With `--coded`: the coded store's facts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coded: Option<CodedFacts>,
    /// The process that ran it, and when it began (seconds since the epoch): a
    /// merge counts one process once. 0 in runs from before they were recorded.
    #[serde(default, skip_serializing_if = "is_default")]
    pub pid: u32,
    /// When the process made its first run document, seconds since the epoch.
    #[serde(default, skip_serializing_if = "is_default")]
    pub started_unix_s: f64,
    /// Warm-up steps before the timed ones (`None` in runs from before it was
    /// recorded). A merge refuses 0: a cold first step would be timed (the
    /// sanitizer's runs take `--warmup 0`, and are not merged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<usize>,
    /// The machine's boot (`/proc/sys/kernel/random/boot_id`): a merge takes
    /// anchors only from a boot that ran this model's runs too. `None` in runs
    /// from before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
}

/// This machine's boot id (`/proc/sys/kernel/random/boot_id`), if it has one.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

/// A field left out of a results file where it holds its default (what runs from
/// before it was recorded read back as).
fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

/// One extra streamed step with the ring's timeline on, after the timed ones
/// (which it would perturb): where its trace went and what it measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct TimelineStep {
    /// Registry model.
    pub model: String,
    /// Registry case.
    pub case: String,
    /// Prefetch depth.
    pub depth: usize,
    /// The Chrome trace written (`--trace`).
    pub trace: String,
    /// Device seconds the compute stream waited for copies.
    pub exposed_stall_s: Option<f64>,
    /// Device seconds the copy stream was busy.
    pub copy_busy_s: Option<f64>,
    /// Share of the copy time hidden behind compute.
    pub hidden_copy_share: Option<f64>,
    /// Bytes copied in the step.
    pub bytes_copied: u64,
}

impl RunCase {
    /// A case's identity (model, case, resolution, tokens, batch, depth); the
    /// measured fields default, to be filled with struct update syntax.
    pub fn head(model: &crate::registry::Model, case: &crate::registry::Case, depth: usize) -> Self {
        RunCase {
            model: model.name.into(),
            case: case.name.clone(),
            resolution: case.resolution,
            height: case.height,
            frames: case.frames,
            tokens: case.image_tokens + case.text_tokens,
            batch: case.batch,
            depth,
            ..RunCase::default()
        }
    }
}

impl RunDoc {
    /// One process run's document: `BENCH_DATE`, the options' commit, the store's facts.
    pub fn new(opts: &RunOptions, gpu: String, backend: &str, store: &StoreFacts, resident_bytes: u64, cases: Vec<RunCase>) -> Self {
        RunDoc {
            date: std::env::var("BENCH_DATE").unwrap_or_default(),
            commit: opts.commit.clone(),
            gpu,
            backend: backend.into(),
            block_bytes_total: store.total,
            largest_block_bytes: store.largest,
            resident_bytes,
            store_build_s: store.build_s,
            host_rss_bytes: store.rss,
            cases,
            no_gemm: opts.no_gemm,
            pid: std::process::id(),
            warmup: Some(opts.warmup),
            boot: boot_id(),
            started_unix_s: *PROCESS_START
                .get_or_init(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())),
            ..RunDoc::default()
        }
    }
}

/// When this process's first run document was made: with the pid, what tells
/// two processes apart in a merge.
static PROCESS_START: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

/// What a `--coded` run records of its coded store (the weights drawn normal,
/// `RegistrySource::normal`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CodedFacts {
    /// Bytes the coded store holds (what each step copies).
    pub coded_bytes: u64,
    /// The blocks' own bytes.
    pub raw_bytes: u64,
    /// `coded_bytes ÷ raw_bytes`.
    pub compression_ratio: f64,
    /// Shannon entropy of every weight's exponent, bits per value.
    pub exponent_entropy_bits: f64,
    /// The same per tensor: the lowest,
    pub tensor_entropy_bits_min: f64,
    /// the median,
    pub tensor_entropy_bits_median: f64,
    /// and the highest.
    pub tensor_entropy_bits_max: f64,
    /// Host encode speed of the largest block (`code_for_device`), GB/s of raw bytes.
    pub encode_gbps_host: f64,
    /// Host threads it used.
    pub encode_threads: usize,
    /// Seconds to build the coded store (weights made, coded, pinned).
    pub store_build_s: f64,
    /// The most staging bytes the decode engine held at once (two buffers, each
    /// the largest coded block rounded up to 2 MiB).
    pub staging_peak_bytes: u64,
    /// The decoder's speed in this process (the largest block as one coded string,
    /// timed over repeated launches), GB/s of output: the planner's decode cost.
    #[serde(default)]
    pub decode_gbps_in_run: f64,
    /// The decoder ran on a stream of the highest priority (`--high-priority-decode`).
    #[serde(default)]
    pub high_priority_decode: bool,
    /// The compute ran on a stream of the highest priority (`--high-priority-compute`).
    #[serde(default)]
    pub high_priority_compute: bool,
}

/// What a run records of its host store once built, and the pinned bandwidth
/// measured from it: printed on stderr as each backend file's run goes.
#[derive(Clone, Debug)]
pub struct StoreFacts {
    /// Bytes of every block as stored and streamed (each tensor at a 256-byte
    /// aligned offset).
    pub total: u64,
    /// The blocks' tensor bytes without the alignment padding: the registry's size.
    pub payload: u64,
    /// Bytes of the largest block.
    pub largest: u64,
    /// Seconds from `started` (given to [`store_facts`]) to the store built.
    pub build_s: f64,
    /// The process's RSS once the store is built.
    pub rss: u64,
    /// Pinned host-to-device bandwidth, bytes per second (three passes).
    pub bandwidth: f64,
}

/// Bytes in GiB, for the runs' progress lines.
pub fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The median of `v` ([`spread`]'s), NaN when there is none.
pub fn median(v: &[f64]) -> f64 {
    spread(v).map_or(f64::NAN, |s| s.median)
}

/// [`StoreFacts`] of `store`, built since `started`, its bandwidth probed on `be`.
pub fn store_facts<B: offload_core::OffloadBackend>(
    be: &B,
    store: &offload_core::HostStore<B>,
    started: std::time::Instant,
) -> offload_core::Result<StoreFacts> {
    let total: u64 = store.blocks().iter().map(|b| b.bytes() as u64).sum();
    let (build_s, rss) = (started.elapsed().as_secs_f64(), host_rss_bytes());
    eprintln!("host store: {:.2} GiB pinned in {} blocks in {build_s:.1} s, RSS {:.2} GiB", gib(total), store.blocks().len(), gib(rss));
    let bandwidth = offload_core::probe_bandwidth(be, store, 3)?;
    eprintln!("pinned H2D bandwidth: {:.1} GB/s", bandwidth / 1e9);
    let payload = block_payload_bytes(store);
    Ok(StoreFacts { total, payload, largest: store.largest_block_bytes() as u64, build_s, rss, bandwidth })
}

/// This process's resident set size in bytes (`VmRSS` of `/proc/self/status`; 0 where unknown).
pub fn host_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()))
        .map_or(0, |kib| kib * 1024)
}

/// `warmup` untimed calls of `f`, then `steps` timed ones, each between two
/// `sync`s: every timed call's seconds and the last call's result.
pub fn timed<T>(
    (warmup, steps): (usize, usize),
    sync: &dyn Fn() -> Result<(), String>,
    f: &mut dyn FnMut() -> Result<T, String>,
) -> Result<(Vec<f64>, T), String> {
    let mut out = None;
    for _ in 0..warmup {
        out = Some(f()?);
    }
    let mut times = Vec::with_capacity(steps);
    for _ in 0..steps {
        sync()?;
        let t = std::time::Instant::now();
        out = Some(f()?);
        sync()?;
        times.push(t.elapsed().as_secs_f64());
    }
    out.map(|o| (times, o)).ok_or_else(|| "no steps".into())
}

/// What one streamed run of a backend's file measured.
#[derive(Clone, Debug, Default)]
pub struct Streamed {
    /// Every timed step, seconds.
    pub times: Vec<f64>,
    /// The output byte-identical to the resident output.
    pub equal: bool,
    /// The output's values (for [`check_output`]).
    pub values: Vec<f32>,
    /// Weights on the device: the most slot bytes live at once plus the resident weights.
    pub weights: u64,
    /// The same by the anchors' method ([`RunCase::weights_device_bytes_derived`]).
    pub derived: u64,
    /// Blocks not prefetched in time.
    pub misses: u64,
}

/// A streamed run's weights on the device by both methods: the slots' peak plus
/// the non-block weights (`resident_bytes`); and the allocator's peak during the
/// steps (`peak`) less what was allocated before them (`before`) other than the
/// live slots and the non-block weights, less the resident step's `activations`.
pub fn streamed_weights(slots_peak: u64, resident_bytes: u64, (before, live_slots, peak): (u64, u64, u64), activations: u64) -> (u64, u64) {
    let other = before.saturating_sub(live_slots + resident_bytes);
    (slots_peak + resident_bytes, peak.saturating_sub(other).saturating_sub(activations))
}

/// The row of a streamed run of `model`'s case `c` at depth `d`: its checks and
/// progress line, beside the resident steps and `activations` of the same process.
pub fn streamed_row(
    model: &crate::registry::Model,
    c: &crate::registry::Case,
    d: usize,
    (resident_s, activations): (&[f64], u64),
    facts: &StoreFacts,
    s: Streamed,
) -> RunCase {
    let (finite, nonconstant) = check_output(&s.values);
    let step = median(&s.times);
    let bound = median(resident_s).max(facts.total as f64 / facts.bandwidth);
    eprintln!(
        "{} {} d={d}: streamed {step:.4} s, bound {bound:.4} s, ratio {:.4}, weights {:.2} GiB (derived {:.2}), \
         bitwise_equal {}, finite {finite}, nonconstant {nonconstant}, misses {}",
        model.name,
        c.name,
        step / bound,
        gib(s.weights),
        gib(s.derived),
        s.equal,
        s.misses
    );
    RunCase {
        steps_resident_s: resident_s.to_vec(),
        steps_streamed_s: s.times,
        streamed_bytes: facts.total,
        bandwidth_gbps: facts.bandwidth / 1e9,
        weights_device_bytes: s.weights,
        weights_device_bytes_derived: s.derived,
        activations_peak_bytes: activations,
        bitwise_equal: s.equal,
        output_finite: finite,
        output_nonconstant: nonconstant,
        output_elements: s.values.len(),
        misses: s.misses,
        ..RunCase::head(model, c, d)
    }
}

/// One case of one anchor process (`bench/anchors/zoo_anchor.py`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AnchorCase {
    /// Registry model.
    pub model: String,
    /// Registry case.
    pub case: String,
    /// Image width.
    pub resolution: usize,
    /// Image height (absent before `--size`).
    #[serde(default)]
    pub height: usize,
    /// Latent frames (absent before `--frames`).
    #[serde(default)]
    pub frames: usize,
    /// Tokens per call.
    pub tokens: usize,
    /// Batch.
    pub batch: usize,
    /// `resident`, `block_stream` or `leaf_stream`.
    pub mode: String,
    /// Every timed step, seconds.
    pub steps_s: Vec<f64>,
    /// Bytes of the model's parameters.
    pub model_bytes: u64,
    /// Weights on the device (derived: see [`RunCase::weights_device_bytes_derived`]).
    pub weights_device_bytes: u64,
    /// Activations of the resident step at this case.
    pub activations_peak_bytes: u64,
    /// Every output element finite.
    pub output_finite: bool,
    /// Output not constant.
    pub output_nonconstant: bool,
}

/// What one anchor process writes.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AnchorDoc {
    /// `diffusers 0.42.1, torch 2.11.0+cu130`.
    pub versions: String,
    /// Timed cases.
    pub cases: Vec<AnchorCase>,
    /// The GPU it ran on (`torch.cuda.get_device_name()`; absent in anchors from
    /// before it was recorded).
    #[serde(default)]
    pub gpu: Option<String>,
    /// Kernels were profiled between its timed steps (`zoo_anchor.py --kernels`).
    #[serde(default)]
    pub kernels_profiled: bool,
    /// The machine's boot, as [`RunDoc::boot`] (absent in anchors from before it
    /// was recorded).
    #[serde(default)]
    pub boot: Option<String>,
}

/// Tensor bytes of `store`'s blocks, without the alignment padding between them.
pub fn block_payload_bytes<B: offload_core::OffloadBackend>(store: &offload_core::HostStore<B>) -> u64 {
    store.blocks().iter().map(|b| b.layout.payload_bytes() as u64).sum()
}

/// Median, min and max.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    /// Median (the mean of the middle two for an even count).
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

/// The spread of `xs`; `None` when empty or when any is not finite.
pub fn spread(xs: &[f64]) -> Option<Spread> {
    if xs.is_empty() || xs.iter().any(|x| !x.is_finite()) {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
    Some(Spread { median, min: v[0], max: v[n - 1] })
}

/// `{"median", "min", "max"}` of `s`; null when there is none.
pub fn sp(s: Option<Spread>) -> Value {
    s.map_or(Value::Null, |s| json!({"median": s.median, "min": s.min, "max": s.max}))
}

/// [`sp`] of the spread of `xs`.
pub fn spread_of(xs: impl IntoIterator<Item = f64>) -> Value {
    sp(spread(&xs.into_iter().collect::<Vec<_>>()))
}

/// `items` grouped by `key`, the groups and each group's items in first-seen order.
pub fn group_by<T, K: PartialEq>(items: impl IntoIterator<Item = T>, key: impl Fn(&T) -> K) -> Vec<(K, Vec<T>)> {
    let mut groups: Vec<(K, Vec<T>)> = Vec::new();
    for item in items {
        let k = key(&item);
        match groups.iter_mut().find(|(g, _)| *g == k) {
            Some((_, v)) => v.push(item),
            None => groups.push((k, vec![item])),
        }
    }
    groups
}

/// The first of `runs`, where there are at least `min_repeats` (and one); else
/// an error prefixed by the merge `what`.
pub fn enough<'a, T>(what: &str, runs: &'a [T], min_repeats: usize) -> Result<&'a T, String> {
    let first = runs.first().ok_or_else(|| format!("{what}: no runs"))?;
    match runs.len() < min_repeats {
        true => Err(format!("{what}: {} run(s), at least {min_repeats} wanted", runs.len())),
        false => Ok(first),
    }
}

/// Runs of one merge were made on one GPU: a median over two kinds of card (an
/// H100 rerun among H200 runs) is no figure of either. An error naming both.
pub fn one_gpu<'a>(what: &str, gpus: impl IntoIterator<Item = &'a str>) -> Result<(), String> {
    let mut gpus = gpus.into_iter();
    let Some(first) = gpus.next() else { return Ok(()) };
    match gpus.find(|g| *g != first) {
        Some(other) => Err(format!("{what}: runs on two GPUs ({first:?} and {other:?}): merge the runs of one")),
        None => Ok(()),
    }
}

/// `commits` sorted, each once, joined by commas.
pub fn joined<'a>(commits: impl IntoIterator<Item = &'a str>) -> String {
    commits.into_iter().collect::<std::collections::BTreeSet<_>>().into_iter().collect::<Vec<_>>().join(", ")
}

/// `doc`'s fields, then `extra`'s (both JSON objects).
pub fn with_fields(mut doc: Value, extra: Value) -> Value {
    if let (Some(d), Value::Object(e)) = (doc.as_object_mut(), extra) {
        d.extend(e);
    }
    doc
}

/// Output checks on raw values: all finite, and not all equal.
pub fn check_output(values: &[f32]) -> (bool, bool) {
    let finite = !values.is_empty() && values.iter().all(|v| v.is_finite());
    let nonconstant = values.iter().any(|v| *v != values[0]);
    (finite, nonconstant)
}

/// Targets of one backend.
#[derive(Clone, Copy, Debug)]
pub struct Targets {
    /// Streamed step ≤ this × bound.
    pub ratio_to_bound: f64,
    /// Whether the streamed step must also be ≤ the anchors' best offloaded mode.
    pub beat_anchor: bool,
}

/// The targets: tch ≤ 1.02 × and ≤ diffusers' best; others ≤ 1.03 ×.
pub fn targets(backend: &str) -> Targets {
    match backend {
        "tch" => Targets { ratio_to_bound: 1.02, beat_anchor: true },
        _ => Targets { ratio_to_bound: 1.03, beat_anchor: false },
    }
}

/// The mode name under which the anchor command runs this project's Python
/// package (`zoo_anchor.py --mode offload`).
const OURS_IN_ANCHOR: &str = "offload";

/// Whether an anchor `mode` is one of diffusers' offloaded modes (the ones our
/// streamed step must beat): not its resident run, not our own package.
fn offloads(mode: &str) -> bool {
    mode != "resident" && mode != OURS_IN_ANCHOR
}

fn per_run_median(xs: &[f64]) -> Result<f64, String> {
    spread(xs).map(|s| s.median).ok_or_else(|| format!("no finite timings in {xs:?}"))
}

/// Merge process runs of one backend and anchor processes into one results file
/// (DESIGN's schema plus `repeats`, spreads, memory split and the comparison).
///
/// Each figure is the median over the process runs of each run's own median step,
/// with the runs' min and max beside it; the bound of each run is computed from
/// its own resident step and bandwidth, the published bound from the medians.
pub fn merge(runs: &[RunDoc], anchors: &[AnchorDoc], min_repeats: usize) -> Result<Value, String> {
    let first = runs.first().ok_or("no runs to merge")?;
    if let Some(r) = runs.iter().find(|r| r.backend != first.backend) {
        return Err(format!("runs of different backends: {} and {}", first.backend, r.backend));
    }
    one_gpu("merge", runs.iter().map(|r| r.gpu.as_str()))?;
    // The anchors ran beside the runs: on their GPU (anchors from before the GPU
    // was recorded hold none), and timed without a profiler between their steps.
    if let Some(g) = anchors.iter().filter_map(|a| a.gpu.as_deref()).find(|g| *g != first.gpu) {
        return Err(format!("anchors run on {g:?}, the runs on {:?}: anchors run in the same command as ours", first.gpu));
    }
    if anchors.iter().any(|a| a.kernels_profiled) {
        return Err("an anchor run with --kernels (profiled steps ran between its timed ones): not a measurement".into());
    }
    // One process's run given twice would count as two repeats (runs from before
    // processes were recorded hold pid 0: not compared).
    let ids: Vec<(u32, u64)> = runs.iter().map(|r| (r.pid, r.started_unix_s.to_bits())).collect();
    if let Some((i, j)) =
        (0..ids.len()).flat_map(|i| (i + 1..ids.len()).map(move |j| (i, j))).find(|&(i, j)| ids[i].0 != 0 && ids[i] == ids[j])
    {
        return Err(format!("runs {} and {} are one process's run (pid {}) given twice: a process counts once", i + 1, j + 1, ids[i].0));
    }
    if let Some(r) = runs.iter().find(|r| r.warmup == Some(0)) {
        return Err(format!("a {} run at commit {} timed its first, cold step (--warmup 0): not a measurement", r.backend, r.commit));
    }
    if let Some(r) = runs.iter().find(|r| r.no_gemm) {
        return Err(format!(
            "a {} run at commit {} ran with --no-gemm (a sanitizer's run): its timings are not a measurement",
            r.backend, r.commit
        ));
    }
    // One commit per model: each model's figures come from one build (models may
    // have been measured at different commits, each with its anchors).
    let model_of = |r: &RunDoc| r.cases.first().map(|c| c.model.clone()).unwrap_or_default();
    let by_model = group_by(runs, |r| model_of(r));
    for (m, rs) in &by_model {
        if let Some(r) = rs.iter().find(|r| r.commit != rs[0].commit) {
            return Err(format!("{m}: runs of different commits ({} and {})", rs[0].commit, r.commit));
        }
    }
    // Anchors ran in the same command as ours: each model's anchors on a machine
    // boot that ran its runs too. Files from before boots were recorded hold
    // none; a model's files either all say or none does.
    for (m, rs) in &by_model {
        let theirs: Vec<&AnchorDoc> = anchors.iter().filter(|a| a.cases.iter().any(|c| &c.model == m)).collect();
        let known = rs.iter().filter(|r| r.boot.is_some()).count() + theirs.iter().filter(|a| a.boot.is_some()).count();
        if known != 0 && known != rs.len() + theirs.len() {
            return Err(format!("{m}: some runs or anchors record the machine's boot and some do not: files of different commands"));
        }
        if let Some(a) = theirs.iter().find(|a| a.boot.is_some() && !rs.iter().any(|r| r.boot == a.boot)) {
            return Err(format!(
                "{m}: an anchor ran on boot {} of a machine, where none of the runs did: anchors run in the same command as ours",
                a.boot.as_deref().unwrap_or_default()
            ));
        }
    }
    let commit_of = |m: &str| by_model.iter().find(|(cm, _)| cm == m).map(|(_, rs)| rs[0].commit.clone()).unwrap_or_default();
    let target = targets(&first.backend);
    // (model, case, depth, depth chosen by the planner) in first-seen order.
    let keys: Vec<(String, String, usize, bool)> =
        group_by(runs.iter().flat_map(|r| &r.cases), |c| (c.model.clone(), c.case.clone(), c.depth, c.planner_depth.is_some()))
            .into_iter()
            .map(|(k, _)| k)
            .collect();
    // Where the planner chose a case's depth, that row is the case's judged one:
    // rows at depths given on the command line are reported beside it, not judged.
    let planned: Vec<(String, String)> = keys.iter().filter(|k| k.3).map(|k| (k.0.clone(), k.1.clone())).collect();
    let anchor_cases: Vec<&AnchorCase> = anchors.iter().flat_map(|a| &a.cases).collect();
    let mut anchor_rows = Vec::new();
    // Anchor rows: per (model, case, mode), with a bound of their own: their
    // resident step and the bandwidth our runs measured in the same command.
    let anchor_groups = group_by(anchor_cases.iter().copied(), |a| (a.model.clone(), a.case.clone(), a.mode.clone()));
    let mut cases = Vec::new();
    for (model, case, depth, by_planner) in &keys {
        let per: Vec<(&RunDoc, &RunCase)> = runs
            .iter()
            .filter_map(|r| {
                r.cases
                    .iter()
                    .find(|c| &c.model == model && &c.case == case && c.depth == *depth && c.planner_depth.is_some() == *by_planner)
                    .map(|c| (r, c))
            })
            .collect();
        let at = format!("{model} {case} d={depth}{}", if *by_planner { " (the planner's depth)" } else { "" });
        if let Some((_, c)) = per.iter().find(|(_, c)| c.blocks != 0 && c.blocks <= c.depth + 1) {
            return Err(format!("{at}: the model's {} blocks fit in the ring's {} slots: the row never streamed", c.blocks, c.depth + 1));
        }
        if per.len() < min_repeats {
            return Err(format!("{at}: {} process runs, at least {min_repeats} needed", per.len()));
        }
        // A row at the planner's depth is judged in place of the fixed-depth rows, so
        // each run's choice is checked against its own recorded replay by the rule
        // `zoo run --depths auto` applies (`offload_plan::depth_within`).
        for (r, c) in per.iter().filter(|(_, c)| c.planner_depth.is_some()) {
            let p = c.planner_depth.as_ref().expect("filtered");
            if p.replayed_s_by_depth.len() != AUTO_DEPTH_MAX || p.replayed_s_by_depth.iter().any(|s| !s.is_finite()) {
                return Err(format!(
                    "{at}: a run at {} recorded {:?} as its replay at depths 1 to {AUTO_DEPTH_MAX}",
                    r.commit, p.replayed_s_by_depth
                ));
            }
            let want = offload_plan::depth_within(&p.replayed_s_by_depth, p.calibrated_bound_s, AUTO_DEPTH_TOLERANCE);
            if want != c.depth {
                return Err(format!(
                    "{at}: a run at {} streamed d={} as the planner's depth, but its replay {:?} (bound {}) gives d={want}",
                    r.commit, c.depth, p.replayed_s_by_depth, p.calibrated_bound_s
                ));
            }
        }
        let doc0 = per[0].0;
        if let Some((r, _)) = per.iter().find(|(r, c)| {
            r.largest_block_bytes != doc0.largest_block_bytes
                || r.resident_bytes != doc0.resident_bytes
                || c.streamed_bytes != per[0].1.streamed_bytes
        }) {
            return Err(format!(
                "{at}: runs disagree on the model's sizes ({} vs {} largest block bytes)",
                r.largest_block_bytes, doc0.largest_block_bytes
            ));
        }
        let mut streamed = Vec::new();
        let mut resident = Vec::new();
        let mut ratios = Vec::new();
        for (_, c) in &per {
            if !(c.bandwidth_gbps.is_finite() && c.bandwidth_gbps > 0.0) || c.streamed_bytes == 0 {
                return Err(format!("{at}: a run measured {} GB/s for {} streamed bytes", c.bandwidth_gbps, c.streamed_bytes));
            }
            let (s, r) = (per_run_median(&c.steps_streamed_s)?, per_run_median(&c.steps_resident_s)?);
            let bound = r.max(c.streamed_bytes as f64 / (c.bandwidth_gbps * 1e9));
            streamed.push(s);
            resident.push(r);
            ratios.push(s / bound);
        }
        let bw: Vec<f64> = per.iter().map(|(_, c)| c.bandwidth_gbps).collect();
        let (s, r, b, q) =
            (spread(&streamed).ok_or(&at)?, spread(&resident).ok_or(&at)?, spread(&bw).ok_or(&at)?, spread(&ratios).ok_or(&at)?);
        let c0 = per[0].1;
        let bound = r.median.max(c0.streamed_bytes as f64 / (b.median * 1e9));
        let ratio = s.median / bound;
        let weights = per.iter().map(|(_, c)| c.weights_device_bytes).max().unwrap_or(0);
        let weights_limit = (*depth as u64 + 1) * doc0.largest_block_bytes + doc0.resident_bytes;
        let equal = per.iter().all(|(_, c)| c.bitwise_equal);
        let finite = per.iter().all(|(_, c)| c.output_finite);
        let nonconstant = per.iter().all(|(_, c)| c.output_nonconstant);
        // The anchors' best offloaded mode at this case: the lowest median, of
        // anchor processes that ran this very case (shape, tokens, batch) and gave
        // a finite, varied output.
        let mut best: Option<(f64, String, f64)> = None;
        let ours = &per;
        for ((_, _, mode), per) in anchor_groups.iter().filter(|((am, ac, mode), _)| am == model && ac == case && offloads(mode)) {
            // A height or frame count of 0 is a file from before it was recorded.
            let agree = |x: usize, y: usize| x == 0 || y == 0 || x == y;
            for (a, (_, c)) in per.iter().flat_map(|a| ours.iter().map(move |o| (a, o))) {
                let same = (a.resolution, a.tokens, a.batch) == (c.resolution, c.tokens, c.batch)
                    && agree(a.height, c.height)
                    && agree(a.frames, c.frames);
                if !same {
                    return Err(format!(
                        "{at}: diffusers {mode} ran {}x{} f{}, {} tokens, batch {}; ours {}x{} f{}, {} tokens, batch {}",
                        a.resolution, a.height, a.frames, a.tokens, a.batch, c.resolution, c.height, c.frames, c.tokens, c.batch
                    ));
                }
                // Like for like: as many timed steps on both sides.
                if a.steps_s.len() != c.steps_streamed_s.len() {
                    return Err(format!("{at}: diffusers {mode} timed {} steps, ours {}", a.steps_s.len(), c.steps_streamed_s.len()));
                }
            }
            for a in per {
                if !(a.output_finite && a.output_nonconstant) {
                    return Err(format!("{at}: diffusers {mode} gave an output that is not finite or is constant"));
                }
            }
            let xs: Vec<f64> = per.iter().map(|a| per_run_median(&a.steps_s)).collect::<Result<_, _>>()?;
            let sp = spread(&xs).ok_or(&at)?;
            if best.as_ref().is_none_or(|(b, _, _)| sp.median < *b) {
                best = Some((sp.median, mode.clone(), sp.min));
            }
        }
        let meets_ratio = ratio <= target.ratio_to_bound;
        // Faster only where every process of ours beat every process of that mode
        // (ours and theirs ran in separate processes of one command: no pairs).
        let faster = best.as_ref().map(|(_, _, fastest)| s.max < *fastest);
        let meets =
            meets_ratio && equal && finite && nonconstant && weights <= weights_limit && (!target.beat_anchor || faster == Some(true));
        let judged = *by_planner || !planned.contains(&(model.clone(), case.clone()));
        let predicted: Vec<f64> = per.iter().filter_map(|(_, c)| c.planner_depth.as_ref().map(|p| p.predicted_step_s)).collect();
        cases.push(json!({
            "model": model, "commit": commit_of(model), "case": case, "resolution": c0.resolution, "height": c0.height, "frames": c0.frames, "tokens": c0.tokens, "batch": c0.batch, "depth": depth,
            "budget_bytes": null, "repeats": per.len(),
            "step_resident_s": r.median, "step_resident_s_min": r.min, "step_resident_s_max": r.max,
            "step_streamed_s": s.median, "step_streamed_s_min": s.min, "step_streamed_s_max": s.max,
            "bandwidth_gbps": b.median, "bandwidth_gbps_min": b.min, "bandwidth_gbps_max": b.max,
            "streamed_bytes": c0.streamed_bytes, "bound_s": bound, "ratio_to_bound": ratio,
            "ratio_to_bound_min": q.min, "ratio_to_bound_max": q.max,
            "largest_block_bytes": doc0.largest_block_bytes, "resident_bytes": doc0.resident_bytes,
            "weights_device_bytes": weights, "weights_device_bytes_limit": weights_limit,
            "weights_device_bytes_derived": per.iter().map(|(_, c)| c.weights_device_bytes_derived).max(),
            "activations_peak_bytes": per.iter().map(|(_, c)| c.activations_peak_bytes).max(),
            "peak_device_bytes": weights + per.iter().map(|(_, c)| c.activations_peak_bytes).max().unwrap_or(0),
            "bitwise_equal": equal, "output_finite": finite, "output_nonconstant": nonconstant,
            "misses": per.iter().map(|(_, c)| c.misses).sum::<u64>(),
            "anchor_best_mode": best.as_ref().map(|(_, m, _)| m.clone()), "anchor_best_step_s": best.as_ref().map(|(m, _, _)| *m),
            "ratio_to_anchor_best": best.as_ref().map(|(m, _, _)| s.median / m), "faster_than_anchor_best": faster,
            "target_ratio_to_bound": target.ratio_to_bound, "meets_targets": meets,
            "depth_chosen_by": if *by_planner { "planner" } else { "command line" }, "judged": judged,
            "planner_predicted_step_s": spread(&predicted).map(|p| p.median),
            "planner_replayed_s_by_depth": per.iter().filter_map(|(_, c)| c.planner_depth.as_ref().map(|p| p.replayed_s_by_depth.clone())).collect::<Vec<_>>(),
            "runs": per.iter().enumerate().map(|(i, (_, c))| json!({"run": i + 1, "step_streamed_s": streamed[i], "step_resident_s": resident[i],
                "ratio_to_bound": ratios[i], "bandwidth_gbps": c.bandwidth_gbps, "steps_streamed_s": c.steps_streamed_s,
                "steps_resident_s": c.steps_resident_s})).collect::<Vec<_>>(),
            "store_build_s": per.iter().map(|(r, _)| r.store_build_s).collect::<Vec<_>>(),
            "host_rss_bytes": per.iter().map(|(r, _)| r.host_rss_bytes).max(),
        }));
    }
    // The anchor command's run of this project's own Python package (`offload`) is
    // no anchor: `py_merge.py` merges it.
    for ((model, case, mode), per) in anchor_groups.iter().filter(|((_, _, mode), _)| mode != OURS_IN_ANCHOR) {
        let at = format!("anchor {model} {case} {mode}");
        if per.len() < min_repeats {
            return Err(format!("{at}: {} process runs, at least {min_repeats} needed", per.len()));
        }
        // Every anchor row published is checked, not only those compared with ours
        // (their resident step sets their bound; a case we did not run is shown too).
        if per.iter().any(|a| !(a.output_finite && a.output_nonconstant)) {
            return Err(format!("{at}: an output that is not finite or is constant"));
        }
        let xs: Vec<f64> = per.iter().map(|a| per_run_median(&a.steps_s)).collect::<Result<_, _>>()?;
        let s = spread(&xs).ok_or(&at)?;
        // Their own resident step (median over the processes) and our bandwidth.
        let res: Vec<f64> = anchor_cases
            .iter()
            .filter(|a| &a.model == model && &a.case == case && a.mode == "resident")
            .map(|a| per_run_median(&a.steps_s))
            .collect::<Result<_, _>>()?;
        let bw: Vec<f64> =
            runs.iter().flat_map(|r| &r.cases).filter(|c| &c.model == model && &c.case == case).map(|c| c.bandwidth_gbps).collect();
        let (bound, ratio) = match (spread(&res), spread(&bw)) {
            (Some(r), Some(b)) if mode != "resident" => {
                let bound = r.median.max(per[0].model_bytes as f64 / (b.median * 1e9));
                (Some(bound), Some(s.median / bound))
            }
            _ => (None, None),
        };
        anchor_rows.push(json!({
            "name": format!("diffusers {mode}"), "model": model, "case": case, "resolution": per[0].resolution, "height": per[0].height, "frames": per[0].frames, "tokens": per[0].tokens,
            "batch": per[0].batch, "mode": mode, "repeats": per.len(), "versions": anchors.first().map(|a| a.versions.clone()),
            "step_streamed_s": s.median, "step_streamed_s_min": s.min, "step_streamed_s_max": s.max,
            "streamed_bytes": if mode == "resident" { 0 } else { per[0].model_bytes }, "bound_s": bound, "ratio_to_bound": ratio,
            "weights_device_bytes": per.iter().map(|a| a.weights_device_bytes).max(),
            "activations_peak_bytes": per.iter().map(|a| a.activations_peak_bytes).max(),
            "output_finite": per.iter().all(|a| a.output_finite), "output_nonconstant": per.iter().all(|a| a.output_nonconstant),
            "steps_s_per_run": xs,
        }));
    }
    let all_met =
        cases.iter().any(|c| c["judged"] == true) && cases.iter().filter(|c| c["judged"] == true).all(|c| c["meets_targets"] == true);
    let budgets = crate::budgets::merge_budgets(runs, min_repeats)?;
    let mut doc = json!({
        // The newest run's date: a merge of kept runs is as new as its last run.
        "date": runs.iter().map(|r| r.date.as_str()).max().unwrap_or(&first.date), "commit": joined(runs.iter().map(|r| r.commit.as_str())), "gpu": first.gpu, "backend": first.backend,
        "model": keys.iter().map(|k| k.0.clone()).fold(Vec::<String>::new(), |mut v, m| { if !v.contains(&m) { v.push(m) } v }).join(", "),
        "repeats": cases.iter().filter_map(|c| c["repeats"].as_u64()).min().unwrap_or(0), "process_runs": runs.len(),
        "memory_method": "weights_device_bytes: the most slot bytes live at once (the backend's counters) plus the non-block weights; \
            activations_peak_bytes: the resident step's peak allocated bytes above what was allocated before it; \
            weights_device_bytes_derived and the anchors' weights_device_bytes: the streamed step's peak allocated bytes minus \
            what was allocated before it other than weights, minus those activations; \
            peak_device_bytes: weights_device_bytes plus activations_peak_bytes (not a measured streamed peak); \
            ratio_to_bound: the median streamed step over the bound of the medians; its _min and _max: the per-run ratios",
        "meets_targets": all_met, "cases": cases, "anchors": anchor_rows,
    });
    // The planner's budget runs, where the runs have them (not part of the targets).
    if !budgets.is_empty() {
        doc["budgets"] = Value::Array(budgets);
    }
    Ok(doc)
}

#[cfg(test)]
mod tests;
