//! `zoo`: the bench room's driver. `zoo --help` and `zoo <command> --help` say
//! what each command takes; a misspelt, repeated or value-less option is an
//! error naming it, never a default.

use clap::{Args, Parser};
use offload_bench::harness::{merge, AnchorDoc, RunDoc};
use offload_bench::registry;
use serde_json::Value;

#[derive(Parser)]
#[command(name = "zoo", about = "The bench room's driver: registry models run resident and streamed, and the merges that publish them")]
enum Zoo {
    /// The registry (names, shapes, references) as JSON; with a user's case,
    /// every model that takes it holds it too.
    Registry {
        /// Write the registry here (else a summary is printed).
        #[arg(long)]
        json: Option<String>,
        #[command(flatten)]
        case: UserCase,
    },
    /// One process run (needs a GPU): each case resident, then streamed at each depth.
    Run(RunArgs),
    /// Medians, spreads, bounds and the comparison with the anchors, computed from the runs.
    Merge {
        #[command(flatten)]
        merge: MergeArgs,
        /// The anchors' files (diffusers, transformers) of the same command.
        #[arg(long, num_args = 1..)]
        anchors: Vec<String>,
    },
    /// One process of the pipeline case (tch on CUDA): T5-XXL layer by layer,
    /// Flux-dev for --steps steps with the planner's resident blocks, Flux's VAE
    /// on demand, under one --budget in GiB; and all resident.
    Pipeline {
        /// The image case.
        #[arg(long, default_value = "1024")]
        res: String,
        /// Transformer steps.
        #[arg(long, default_value_t = 4, value_parser = at_least_one)]
        steps: usize,
        /// The device budget in GiB.
        #[arg(long, default_value_t = 8.0)]
        budget: f64,
        /// Timed passes.
        #[arg(long, default_value_t = 3, value_parser = at_least_one)]
        passes: usize,
        #[arg(long, default_value_t = 1)]
        warmup: usize,
        #[arg(long, default_value = "unknown")]
        commit: String,
        #[arg(long)]
        out: String,
    },
    /// The pipeline runs' medians, spreads, bounds and targets.
    MergePipeline(MergeArgs),
    /// The compressed results file from --coded runs and codec_speed outputs.
    MergeCompressed {
        #[command(flatten)]
        merge: MergeArgs,
        /// codec_speed's outputs.
        #[arg(long, num_args = 1..)]
        codec: Vec<String>,
    },
    /// The exponent entropy of every block tensor of the coded case's weights
    /// (host only), and per tensor name.
    Entropy {
        #[arg(long)]
        model: String,
        /// Threads (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long)]
        out: String,
    },
    /// One process (cuda): the checkpoint written if absent, then the mapped and
    /// the copying store, each from open to its first streamed step.
    HostTiers(HostTierArgs),
    /// The relay: one link and the relay, one process (two GPUs).
    Relay {
        #[command(flatten)]
        one: OneCase,
        /// The helper devices, comma-separated.
        #[arg(long, default_value = "1", value_delimiter = ',')]
        helpers: Vec<usize>,
    },
    /// The relay's results file from relay runs.
    MergeRelay(MergeArgs),
    /// The host tiers' results file from host-tiers runs of one plan (runs whose plans differ
    /// refused, their files named).
    MergeHostTiers(MergeArgs),
    /// A coded start from a coded file against coding at build, from host-tiers
    /// runs with --only coded-file,coded.
    MergeCodedStart(MergeArgs),
    /// Processes run at once on one file (`--only mapped --group G`, a group
    /// per pair), at least 3 groups.
    MergeHostTiersShared(MergeArgs),
}

/// A user's case: `1344x768 b2 f1`. A size left out is the model's first
/// case's, the batch the model's own, frames 1 (video: 4k + 1 frames).
#[derive(Args)]
struct UserCase {
    /// WxH pixels, multiples of 16.
    #[arg(long)]
    size: Option<String>,
    #[arg(long)]
    batch: Option<String>,
    #[arg(long)]
    frames: Option<String>,
}

#[derive(Args)]
struct RunArgs {
    /// tch, candle or cuda (each built in by its feature).
    #[arg(long, default_value = "tch")]
    backend: String,
    #[arg(long)]
    model: String,
    #[arg(long)]
    out: String,
    /// Short runs (a sanitizer's): the first K blocks of each stack.
    #[arg(long)]
    blocks: Option<usize>,
    /// An extra square case named R, batch 1.
    #[arg(long)]
    res: Option<usize>,
    #[command(flatten)]
    case: UserCase,
    /// The cases run (a user's case is the only one unless this names others).
    #[arg(long, value_delimiter = ',')]
    cases: Option<Vec<String>>,
    /// Depths of at least 1, comma-separated; `auto` (candle): the planner's depth too.
    #[arg(long, default_value = "1")]
    depths: String,
    /// Timed steps (at least 5) after the warm-up.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    #[arg(long, default_value = "unknown")]
    commit: String,
    /// cuda and candle: per case, the planner's choice under each device budget
    /// in GiB, calibrated from resident steps of this process.
    #[arg(long)]
    budgets: Option<String>,
    /// cuda: a Chrome trace of one extra streamed step (first case, first depth).
    #[arg(long)]
    trace: Option<String>,
    /// cuda: GEMMs skipped (sanitizer runs; merge refuses them).
    #[arg(long)]
    no_gemm: bool,
    /// cuda: weights drawn normal; every case also streamed from a store coded for the device.
    #[arg(long)]
    coded: bool,
    /// cuda --coded: the decode engine's staging buffer counts, comma-separated.
    #[arg(long)]
    staging_buffers: Option<String>,
    /// cuda --coded: the decoder's stream at high priority.
    #[arg(long)]
    high_priority_decode: bool,
    /// cuda --coded: the reference model's stream at high priority.
    #[arg(long)]
    high_priority_compute: bool,
}

/// The model, case and loop of a one-case bench.
#[derive(Args)]
struct OneCase {
    #[arg(long)]
    model: String,
    #[arg(long)]
    out: String,
    #[arg(long, default_value = "1024")]
    case: String,
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    depth: usize,
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    steps: usize,
    #[arg(long, default_value = "unknown")]
    commit: String,
}

#[derive(Args)]
struct HostTierArgs {
    #[command(flatten)]
    one: OneCase,
    /// The checkpoint, written if absent.
    #[arg(long)]
    file: String,
    /// The disk tier's host RAM budget in GiB.
    #[arg(long)]
    host_ram_gib: Option<f64>,
    /// The disk tier's timed steps.
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    disk_steps: usize,
    /// Modes, comma-separated, of mapped, disk, copy, coded (coded at build) and
    /// coded-file (from CKPT.offload-coded, written if absent).
    #[arg(long)]
    only: Option<String>,
    /// The processes run at once on one file.
    #[arg(long)]
    group: Option<String>,
}

/// A merge's arguments.
#[derive(Args)]
struct MergeArgs {
    #[arg(long)]
    out: String,
    /// At least 3 (a published figure is a median of three processes); fewer only with --probe.
    #[arg(long, default_value_t = 3)]
    min_repeats: usize,
    /// A diagnostic merge of fewer processes, marked so and never published.
    #[arg(long)]
    probe: bool,
    /// The runs' files.
    runs: Vec<String>,
}

/// A count of at least 1.
fn at_least_one(v: &str) -> Result<usize, String> {
    v.parse().ok().filter(|&n| n >= 1).ok_or_else(|| format!("{v:?} is not a count of at least 1"))
}

/// Each of `items` parsed and `ok`; else an error: `{name}: "{item}" is {is}`.
fn parsed<T: std::str::FromStr>(
    items: impl IntoIterator<Item = impl AsRef<str>>,
    name: &str,
    is: &str,
    ok: impl Fn(&T) -> bool,
) -> Result<Vec<T>, String> {
    let each = |v: &str| v.parse::<T>().ok().filter(&ok).ok_or_else(|| format!("{name}: {v:?} is {is}"));
    items.into_iter().map(|v| each(v.as_ref())).collect()
}

/// The comma-separated items of `v`, empty ones dropped.
fn list(v: &str) -> Vec<String> {
    v.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()
}

/// Set by a merge given `--probe`: what it writes is marked `"probe": true`.
static PROBE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn write(path: &str, v: &impl serde::Serialize) -> Result<(), String> {
    let mut v = serde_json::to_value(v).map_err(|e| format!("{path}: {e}"))?;
    if let (true, Some(o)) = (PROBE.load(std::sync::atomic::Ordering::Relaxed), v.as_object_mut()) {
        // A diagnostic merge of fewer than three processes: `cargo xtask bench
        // --report` refuses to publish a file so marked.
        o.insert("probe".into(), Value::Bool(true));
    }
    let text = serde_json::to_string_pretty(&v).map_err(|e| format!("{path}: {e}"))?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{path}: {e}"))
}

fn read_all<T: serde::de::DeserializeOwned>(paths: &[String]) -> Result<Vec<T>, String> {
    let read = |path: &String| {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))
    };
    paths.iter().map(read).collect()
}

impl MergeArgs {
    /// The runs read as `T`, after the floor of three processes is checked.
    fn runs<T: serde::de::DeserializeOwned>(&self) -> Result<Vec<T>, String> {
        // A published figure is a median of at least three processes: fewer only
        // for a diagnostic merge, which says so in its file (`--probe`).
        if self.min_repeats < 3 && !self.probe {
            return Err(format!(
                "--min-repeats {}: a published figure is a median of at least three processes (give --probe for a \
                 diagnostic merge, marked so and never published)",
                self.min_repeats
            ));
        }
        PROBE.store(self.probe, std::sync::atomic::Ordering::Relaxed);
        read_all(&self.runs)
    }

    /// `merge`'s document over the runs read as `T`, its errors naming each
    /// run's file: the host-tier merges name a run by its number in the order
    /// given ("run 2 (pid …)"), which says nothing to whoever has only the files.
    fn named<T: serde::de::DeserializeOwned>(&self, merge: impl Fn(&[T], usize) -> Result<Value, String>) -> Result<Value, String> {
        merge(&self.runs::<T>()?, self.min_repeats).map_err(|e| {
            let each: Vec<String> = self.runs.iter().enumerate().map(|(i, f)| format!("run {} is {f}", i + 1)).collect();
            format!("{e} ({})", each.join(", "))
        })
    }
}

/// `template` [`fill`]ed from each row of `v` (an array) or from `v`, printed.
fn say(v: &Value, template: &str) {
    match v.as_array() {
        Some(rows) => rows.iter().for_each(|r| println!("{}", fill(template, r))),
        None => println!("{}", fill(template, v)),
    }
}

/// `template` filled from `v`: each `{path}` (keys joined by dots) becomes the
/// value there as JSON, `{path:s}` its string bare, `{path:.N}` its number with
/// `N` decimals and `{path:gN}` its bytes in GiB with `N` decimals (NaN where
/// there is no number).
fn fill(template: &str, v: &Value) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some((head, tail)) = rest.split_once('{') {
        let (field, after) = tail.split_once('}').expect("a closed placeholder");
        let (path, how) = field.split_once(':').unwrap_or((field, ""));
        let x = path.split('.').fold(v, |x, k| &x[k]);
        let (kind, decimals) = how.split_at(how.len().min(1));
        let (n, decimals) = (x.as_f64().unwrap_or(f64::NAN), decimals.parse().unwrap_or(0));
        out.push_str(head);
        out.push_str(&match kind {
            "" => x.to_string(),
            "s" => x.as_str().unwrap_or("").to_owned(),
            "g" => format!("{:.*}", decimals, n / (1u64 << 30) as f64),
            _ => format!("{n:.decimals$}"),
        });
        rest = after;
    }
    out + rest
}

/// The registry, with a user's case in every model that takes it (the anchors
/// read it here) and the quantized models (the Python package's bench reads
/// their storage here).
fn registry_cmd(json: Option<String>, case: &UserCase) -> Result<(), String> {
    let mut models = registry::models();
    models.extend(registry::quantized_models());
    for m in &mut models {
        if let Ok(Some(c)) = registry::case_from_args(m, case.size.as_deref(), case.batch.as_deref(), case.frames.as_deref()) {
            m.cases.push(c);
        }
    }
    if let Some(p) = json {
        return write(&p, &registry::to_json(&models));
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for m in models {
        let stacks: Vec<String> = m.stacks.iter().map(|s| format!("{} × {}", s.count, s.prefix)).collect();
        let cases: Vec<&str> = m.cases.iter().map(|c| c.name.as_str()).collect();
        println!(
            "{}: {} parameters, {:.2} GiB of bf16 blocks in {} (largest {:.3} GiB), cases {}",
            m.name,
            m.params().len(),
            gib(m.block_bytes(2)),
            stacks.join(" + "),
            gib(m.largest_block_bytes(2)),
            cases.join(", ")
        );
    }
    Ok(())
}

fn entropy(model: &str, threads: Option<usize>, out: &str) -> Result<(), String> {
    let model = registry::model(model)?;
    let threads = threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let doc = offload_bench::compressed::tensor_entropies(&model, threads)?;
    say(&doc["by_name"], "{name:s} {count} tensors, {bits_median:.3} [{bits_min:.3}, {bits_max:.3}] bits");
    write(out, &doc)
}

/// `zoo run`: the options checked against each other and the backend, then one
/// process run. The options only one backend's file implements are refused
/// elsewhere, never ignored.
fn run(a: RunArgs) -> Result<(), String> {
    let backend = a.backend.as_str();
    if a.high_priority_compute && backend != "cuda" {
        return Err(format!("--high-priority-compute: cuda's file only (it sets the reference model's stream), not {backend}"));
    }
    if a.high_priority_compute && !a.coded {
        return Err("--high-priority-compute: only with --coded (a coded probe, recorded in the coded store's facts)".into());
    }
    if a.high_priority_decode && !a.coded {
        return Err("--high-priority-decode: only with --coded (it sets the decoder's stream)".into());
    }
    let staging_buffers = match &a.staging_buffers {
        None => Vec::new(),
        Some(_) if !a.coded => return Err("--staging-buffers: only with --coded (the decode engine's staging)".into()),
        Some(v) => parsed(v.split(','), "--staging-buffers", "not a positive count", |&n: &usize| n > 0)?,
    };
    if a.budgets.is_some() && !matches!(backend, "cuda" | "candle") {
        return Err(format!("--budgets is implemented by the cuda and candle backends only, not by {backend}"));
    }
    for (name, given) in [("--trace", a.trace.is_some()), ("--no-gemm", a.no_gemm), ("--coded", a.coded)] {
        if given && backend != "cuda" {
            return Err(format!("{name} is implemented by the cuda backend only, not by {backend}"));
        }
    }
    let mut model = registry::model(&a.model)?;
    if let Some(k) = a.blocks {
        model = registry::first_blocks(&model, k);
    }
    let user = registry::case_from_args(&model, a.case.size.as_deref(), a.case.batch.as_deref(), a.case.frames.as_deref())?;
    if let Some(res) = a.res {
        if user.is_some() {
            return Err("--res is --size RxR --batch 1: give one or the other".into());
        }
        if res == 0 || res % 16 != 0 {
            return Err(format!("--res {res}: a positive multiple of 16 pixels"));
        }
        let case = registry::extra_image_case(&model, res);
        if model.case(&case.name).is_err() {
            model.cases.push(case);
        }
    }
    // A user's case is the run's only case unless --cases names others.
    let cases = match (a.cases, user) {
        (Some(named), u) => {
            model.cases.extend(u);
            named.into_iter().filter(|s| !s.is_empty()).collect()
        }
        (None, Some(u)) => {
            let name = u.name.clone();
            model.cases.push(u);
            vec![name]
        }
        (None, None) => model.cases.iter().map(|c| c.name.clone()).collect(),
    };
    // `auto`: also the depth the planner chooses for a fully streamed ring.
    let depth_args = list(&a.depths);
    let auto_depth = depth_args.iter().any(|d| d == "auto");
    let depths = parsed(depth_args.iter().filter(|d| *d != "auto"), "--depths", "neither a depth of at least 1 nor `auto`", |&n| n >= 1)?;
    if depths.is_empty() && !auto_depth {
        return Err("--depths: no depth given (depths of at least 1, comma-separated, or `auto`)".into());
    }
    if auto_depth && backend != "candle" {
        return Err(format!("--depths auto: only candle's file calibrates a fully streamed ring (not {backend})"));
    }
    if a.steps < 5 {
        return Err(format!("--steps {}: a run times at least 5 steps after warm-up", a.steps));
    }
    let budgets_gib = match &a.budgets {
        None => Vec::new(),
        Some(v) => parsed(list(v), "--budgets", "not a positive number of GiB", |g: &f64| g.is_finite() && *g > 0.0)?,
    };
    if a.budgets.is_some() && budgets_gib.is_empty() {
        return Err("--budgets: no budget given (GiB, comma-separated: --budgets 8,12,16)".into());
    }
    let opts = offload_bench::harness::RunOptions {
        cases,
        depths,
        auto_depth,
        steps: a.steps,
        warmup: a.warmup,
        commit: a.commit,
        budgets_gib,
        trace: a.trace,
        no_gemm: a.no_gemm,
        coded: a.coded,
        high_priority_decode: a.high_priority_decode,
        high_priority_compute: a.high_priority_compute,
        staging_buffers,
    };
    let doc: Result<RunDoc, String> = match backend {
        #[cfg(feature = "tch-cuda")]
        "tch" => offload_bench::tch::run(&model, &opts),
        #[cfg(feature = "candle-cuda")]
        "candle" => offload_bench::candle::run(&model, &opts),
        #[cfg(feature = "cuda")]
        "cuda" => offload_bench::cuda::run(&model, &opts),
        other => {
            let _ = opts;
            Err(format!("backend {other:?} is not built into this zoo (features: tch-cuda for tch, candle-cuda for candle, cuda for cuda)"))
        }
    };
    write(&a.out, &doc?)
}

#[cfg_attr(not(feature = "tch-cuda"), allow(unused_variables))]
fn pipeline(res: &str, steps: usize, budget_gib: f64, passes: usize, warmup: usize, commit: String, out: &str) -> Result<(), String> {
    if !(budget_gib.is_finite() && budget_gib > 0.0) {
        return Err(format!("--budget {budget_gib}: a positive number of GiB"));
    }
    #[cfg(feature = "tch-cuda")]
    {
        let p = offload_bench::tch::Pipeline::flux(res, steps)?;
        let o = offload_bench::tch::PipelineOptions { budget_gib, warmup, passes, commit };
        write(out, &offload_bench::tch::run_pipeline(&p, &o)?)
    }
    #[cfg(not(feature = "tch-cuda"))]
    Err("pipeline: tch is not built into this zoo (feature tch-cuda)".into())
}

#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn host_tiers(a: HostTierArgs) -> Result<(), String> {
    let model = registry::model(&a.one.model)?;
    let host_ram = match a.host_ram_gib {
        None => None,
        Some(g) if g.is_finite() && g > 0.0 => Some((g * (1u64 << 30) as f64) as u64),
        Some(g) => return Err(format!("host-tiers: --host-ram-gib {g} is not a positive number")),
    };
    #[cfg(feature = "cuda")]
    {
        let o = &a.one;
        let mut doc = offload_bench::host_tiers::run(
            &model,
            &o.case,
            o.depth,
            o.steps,
            &a.file,
            &o.commit,
            host_ram,
            a.disk_steps,
            a.only.as_deref(),
        )?;
        doc.group = a.group;
        doc.pid = std::process::id();
        write(&o.out, &doc)
    }
    #[cfg(not(feature = "cuda"))]
    Err("host-tiers: cuda is not built into this zoo (feature cuda)".into())
}

#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn relay(o: OneCase, helpers: &[usize]) -> Result<(), String> {
    let model = registry::model(&o.model)?;
    #[cfg(feature = "cuda")]
    return write(&o.out, &offload_bench::relay::run(&model, &o.case, o.depth, o.steps, helpers, &o.commit)?);
    #[cfg(not(feature = "cuda"))]
    Err("relay: cuda is not built into this zoo (feature cuda)".into())
}

fn merge_zoo(m: &MergeArgs, anchor_files: &[String]) -> Result<(), String> {
    let anchors = read_all::<AnchorDoc>(anchor_files)?;
    let doc = merge(&m.runs::<RunDoc>()?, &anchors, m.min_repeats)?;
    for c in doc["cases"].as_array().into_iter().flatten() {
        let planned = if c["depth_chosen_by"] == "planner" { " (the planner's depth)" } else { "" };
        let judged = if c["judged"] == false { " (not judged: the planner's row of this case is)" } else { "" };
        let streamed = ": streamed {step_streamed_s:.4} s [{step_streamed_s_min:.4}, {step_streamed_s_max:.4}] × {repeats}, \
                        ratio to bound {ratio_to_bound:.4}, anchor best {anchor_best_mode} {anchor_best_step_s}, meets targets {meets_targets}";
        println!("{}{planned}{}{judged}", fill("{model:s} {case:s} d={depth}", c), fill(streamed, c));
    }
    say(&doc, "the file meets its targets: {meets_targets}");
    write(&m.out, &doc)
}

fn merge_compressed(m: &MergeArgs, codec_files: &[String]) -> Result<(), String> {
    let doc = offload_bench::compressed::merge(&m.runs::<RunDoc>()?, &read_all::<Value>(codec_files)?, m.min_repeats)?;
    let header = "compressed: ratio {compression_ratio:.4}, entropy {exponent_entropy_bits:.3} bits, \
                  encode {encode_gbps_host:.2} GB/s, decode {decode_gbps} GB/s, meets targets {meets_targets}";
    say(&doc, header);
    for c in doc["cases"].as_array().into_iter().flatten() {
        let planner = match c["planner_codes"].as_bool() {
            Some(true) => "codes",
            Some(false) => "leaves raw",
            None => "not asked",
        };
        let steps = "{case:s} d={depth} ({raw_step:s}): raw {step_streamed_raw_s.median:.4} s, coded \
                     {step_streamed_compressed_s.median:.4} s, bound {bound_uncompressed_s.median:.4} s, coded ÷ bound \
                     {ratio_to_uncompressed_bound.median:.4}, planner ";
        let checks = ", chosen ÷ declined {planned_over_declined.median:.4}, bitwise {bitwise_equal}, meets {meets_targets}";
        println!("  {}{planner}{}", fill(steps, c), fill(checks, c));
    }
    write(&m.out, &doc)
}

fn main_of(zoo: Zoo) -> Result<(), String> {
    use offload_bench::{host_tiers as tiers, pipeline as pipe, relay as rel};
    // A merge's lines printed from its document, then the document written.
    let merged = |m: &MergeArgs, doc: Value, lines: &[(&str, &str)]| {
        lines.iter().for_each(|(at, template)| say(if at.is_empty() { &doc } else { &doc[*at] }, template));
        write(&m.out, &doc)
    };
    match zoo {
        Zoo::Registry { json, case } => registry_cmd(json, &case),
        Zoo::Run(a) => run(a),
        Zoo::Merge { merge, anchors } => merge_zoo(&merge, &anchors),
        Zoo::Pipeline { res, steps, budget, passes, warmup, commit, out } => pipeline(&res, steps, budget, passes, warmup, commit, &out),
        Zoo::MergePipeline(m) => {
            let doc = pipe::merge(&m.runs::<pipe::PipelineRun>()?, m.min_repeats)?;
            let line = "pipeline {case:s} × {steps} steps: offloaded {whole.offloaded_s:.4} s [{whole.offloaded_s_min:.4}, \
                        {whole.offloaded_s_max:.4}], bound {whole.bound_s:.4} s, ratio {whole.ratio_to_bound:.4}, resident \
                        {whole.resident_s:.4} s, peak {peak_device_bytes:g2} GiB, meets targets {meets_targets}";
            merged(&m, doc, &[("", line)])
        }
        Zoo::MergeCompressed { merge, codec } => merge_compressed(&merge, &codec),
        Zoo::Entropy { model, threads, out } => entropy(&model, threads, &out),
        Zoo::HostTiers(a) => host_tiers(a),
        Zoo::Relay { one, helpers } => relay(one, &helpers),
        Zoo::MergeRelay(m) => {
            let doc = rel::merge(&m.runs::<rel::RelayRun>()?, m.min_repeats)?;
            let line = "{model:s} {case:s}: relay {step_relay_s.median:.4} s, {ratio_to_bound.median:.3} × its bound, \
                        {speedup.median:.2} × one link, bitwise {bitwise_equal}, meets {meets_targets}";
            merged(&m, doc, &[("cases", line)])
        }
        Zoo::MergeHostTiersShared(m) => {
            let line =
                "{group:s}: {processes} processes serving together {serving_together_s:.1} s, host RSS ≤ {host_rss_max_bytes:g2} GiB, \
                        file mapped ≥ {file_mapped_share_min:.3}, bitwise {bitwise_equal}, meets {meets_targets}";
            merged(&m, m.named(tiers::merge_shared)?, &[("groups", line)])
        }
        Zoo::MergeCodedStart(m) => {
            let line = "{mode:s}: start {start_s.median:.2} s (store {store_build_s.median:.2} s), step {step_streamed_s.median:.4} s, \
                        {coded_blocks} buffers coded, bitwise {bitwise_equal}";
            merged(
                &m,
                m.named(tiers::merge_coded_start)?,
                &[("cases", line), ("", "coded ÷ coded-file start: {start_speedup}, checks pass: {checks_pass}")],
            )
        }
        Zoo::MergeHostTiers(m) => {
            let line =
                "{mode:s}: start {start_s.median:.2} s, host RSS {host_rss_bytes.median:g2} GiB, step {step_streamed_s.median:.4} s, \
                        ratio to bound {ratio_to_bound.median:.4}, to the disk estimate {ratio_to_disk_estimate.median:.4}, \
                        disk stream ÷ read {disk_stream_to_read.median:.3}, bitwise {bitwise_equal}, meets {meets_targets}";
            merged(&m, m.named(tiers::merge)?, &[("cases", line)])
        }
    }
}

fn main() {
    if let Err(e) = main_of(Zoo::parse()) {
        eprintln!("zoo: {e}");
        std::process::exit(1);
    }
}
