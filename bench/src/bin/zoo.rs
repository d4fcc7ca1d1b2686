//! `zoo`: the bench room's driver.
//!
//! ```text
//! zoo registry [--json F] [--size WxH] [--batch N] [--frames F]
//!                                              the registry (names, shapes, references) as JSON; with a
//!                                              user's case, every model that takes it holds it too
//! zoo run --backend tch|candle|cuda --model M [--cases 1024,2048] [--blocks K] [--res R] [--depths 1,2,auto (auto: the planner's depth, candle)] [--steps 5] [--warmup 1] [--commit C] --out F
//!         [--size WxH] [--batch N] [--frames F] [--budgets 8,12,16] [--trace F] [--no-gemm] [--coded]
//!                                              one process run (needs a GPU). --size/--batch/--frames: a user's
//!                                              case (`1344x768 b2 f1`; a size left out is the model's first
//!                                              case's, the batch the model's own, frames 1; video: 4k + 1 frames),
//!                                              the run's only case unless --cases names others; --res R: an
//!                                              extra square case named R, batch 1. cuda and candle: --budgets (per case,
//!                                              the planner's choice under each device budget in GiB, calibrated from
//!                                              resident steps of this process); cuda only: --trace (a Chrome trace of one extra
//!                                              streamed step: first case, first depth), --no-gemm (GEMMs skipped:
//!                                              sanitizer runs; merge refuses them), --coded (weights drawn normal;
//!                                              every case also streamed from a store coded for the device)
//! zoo merge --out F [--min-repeats 3] RUN.json... [--anchors A.json...]
//!                                              medians, spreads, bounds and the comparison, computed from the runs
//! zoo pipeline [--res 1024] [--steps 4] [--budget 8] [--passes 3] [--warmup 1] [--commit C] --out F
//!                                              one process of the pipeline case (tch on CUDA): T5-XXL layer by
//!                                              layer, Flux-dev for --steps steps with the planner's resident blocks,
//!                                              Flux's VAE on demand, under one --budget in GiB; and all resident
//! zoo merge-pipeline --out F [--min-repeats 3] RUN.json...
//!                                              the pipeline runs' medians, spreads, bounds and targets
//! zoo merge-compressed --out F [--min-repeats 3] RUN.json... [--codec C.json...]
//!                                              issue 19's file from --coded runs and codec_speed outputs
//! zoo entropy --model M [--threads N] --out F  the exponent entropy of every block tensor of the coded
//!                                              case's weights (host only), and per tensor name
//! zoo host-tiers --model M --file CKPT [--case 1024] [--depth 1] [--steps 5] [--host-ram-gib G [--disk-steps 2]]
//!                [--only MODE,…] [--group G] [--commit C] --out F
//!                                              one process (cuda): CKPT written if absent, then the mapped
//!                                              and the copying store, each from open to its first streamed step;
//!                                              --only picks modes of mapped, disk, copy, coded (coded at build)
//!                                              and coded-file (from CKPT.offload-coded, written if absent)
//! zoo relay --model M [--case 1024] [--depth 1] [--steps 5] [--helpers 1] [--commit C] --out F
//!                                              issue 18: one link and relay, one process (two GPUs)
//! zoo merge-relay --out F [--min-repeats 3] RUN.json...
//!                                              issue 18's file from relay runs
//! zoo merge-host-tiers --out F [--min-repeats 3] RUN.json...
//!                                              issue 17's file from host-tiers runs of one plan
//!                                              (runs whose plans differ refused, their files named)
//! zoo merge-coded-start --out F [--min-repeats 3] RUN.json...
//!                                              a coded start from a coded file against coding at build,
//!                                              from host-tiers runs with --only coded-file,coded
//! zoo merge-host-tiers-shared --out F [--min-repeats 3] RUN.json...
//!                                              processes run at once on one file (`--only mapped
//!                                              --group G`, a group per pair), at least 3 groups
//! ```

use offload_bench::harness::{merge, AnchorDoc, RunDoc};
use offload_bench::registry;
use serde_json::Value;

fn opt<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str)
}

/// `zoo run`'s options that take a value.
const RUN_OPTIONS: [&str; 16] = [
    "--backend",
    "--model",
    "--out",
    "--blocks",
    "--res",
    "--size",
    "--batch",
    "--frames",
    "--cases",
    "--depths",
    "--steps",
    "--warmup",
    "--commit",
    "--budgets",
    "--trace",
    "--staging-buffers",
];

/// The number after `name`, or `default`.
fn num(args: &[String], name: &str, default: usize) -> Result<usize, String> {
    opt(args, name).map_or(Ok(default), |v| v.parse().map_err(|_| format!("{name}: not a number: {v}")))
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

fn read<T: serde::de::DeserializeOwned>(path: &str) -> Result<T, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))
}

fn read_all<T: serde::de::DeserializeOwned>(paths: &[&str]) -> Result<Vec<T>, String> {
    paths.iter().map(|f| read::<T>(f)).collect()
}

/// A merge's arguments: `--out F`, `--min-repeats N` (3; fewer only with
/// `--probe`), the run files, and the files after `--anchors` (or `--codec`).
type MergeArgs<'a> = (&'a str, usize, Vec<&'a str>, Vec<&'a str>);

fn merge_args<'a>(args: &'a [String], second: &str) -> Result<MergeArgs<'a>, String> {
    let out = opt(args, "--out").ok_or("--out is required")?;
    let min = num(args, "--min-repeats", 3)?;
    // A published figure is a median of at least three processes: fewer only
    // for a diagnostic merge, which says so in its file (`--probe`).
    let probe = args.iter().any(|a| a == "--probe");
    if min < 3 && !probe {
        return Err(format!(
            "--min-repeats {min}: a published figure is a median of at least three processes (give --probe for a \
             diagnostic merge, marked so and never published)"
        ));
    }
    PROBE.store(probe, std::sync::atomic::Ordering::Relaxed);
    let (mut runs, mut anchors) = (Vec::new(), Vec::new());
    let (mut in_anchors, mut skip) = (false, false);
    for a in &args[1..] {
        if skip {
            skip = false;
        } else if a == "--probe" {
        } else if a == "--out" || a == "--min-repeats" {
            skip = true;
        } else if a == second {
            in_anchors = true;
        } else if in_anchors {
            anchors.push(a.as_str());
        } else {
            runs.push(a.as_str());
        }
    }
    Ok((out, min, runs, anchors))
}

/// `zoo merge-…` of runs read as `T` (anchors refused, naming the command
/// `what`): `--out`, and `merge`'s document over them. With `named`, an error
/// names each run's file: the host-tier merges name a run by its number in the
/// order given ("run 2 (pid …)"), which says nothing to whoever has only the files.
fn merge_runs<'a, T: serde::de::DeserializeOwned>(
    args: &'a [String],
    what: &str,
    named: bool,
    merge: impl Fn(&[T], usize) -> Result<Value, String>,
) -> Result<(&'a str, Value), String> {
    let (out, min, files, anchors) = merge_args(args, "--anchors")?;
    if !anchors.is_empty() {
        return Err(format!("{what} takes no --anchors"));
    }
    let doc = merge(&read_all::<T>(&files)?, min).map_err(|e| match named {
        false => e,
        true => {
            let each: Vec<String> = files.iter().enumerate().map(|(i, f)| format!("run {} is {f}", i + 1)).collect();
            format!("{e} ({})", each.join(", "))
        }
    })?;
    Ok((out, doc))
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

fn run(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("registry") => {
            // With a user's case: every model that takes it holds it too (the anchors read it here).
            // The quantized models too: the Python package's bench reads their storage here.
            let mut models = registry::models();
            models.extend(registry::quantized_models());
            for m in &mut models {
                if let Ok(Some(c)) = registry::case_from_args(m, opt(args, "--size"), opt(args, "--batch"), opt(args, "--frames")) {
                    m.cases.push(c);
                }
            }
            let doc = registry::to_json(&models);
            match opt(args, "--json") {
                Some(p) => write(p, &doc),
                None => {
                    for m in models {
                        println!(
                            "{}: {} parameters, {:.2} GiB of bf16 blocks in {} (largest {:.3} GiB), cases {}",
                            m.name,
                            m.params().len(),
                            m.block_bytes(2) as f64 / (1u64 << 30) as f64,
                            m.stacks.iter().map(|s| format!("{} × {}", s.count, s.prefix)).collect::<Vec<_>>().join(" + "),
                            m.largest_block_bytes(2) as f64 / (1u64 << 30) as f64,
                            m.cases.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ")
                        );
                    }
                    Ok(())
                }
            }
        }
        Some("entropy") => {
            let model = registry::model(opt(args, "--model").ok_or("entropy: --model is required")?)?;
            let threads = match opt(args, "--threads") {
                None => std::thread::available_parallelism().map_or(1, |n| n.get()),
                Some(v) => v.parse().map_err(|_| format!("--threads: {v}"))?,
            };
            let out = opt(args, "--out").ok_or("entropy: --out is required")?;
            let doc = offload_bench::compressed::tensor_entropies(&model, threads)?;
            for k in doc["by_name"].as_array().into_iter().flatten() {
                println!(
                    "{:<60} {:>4} tensors, {:.3} [{:.3}, {:.3}] bits",
                    k["name"].as_str().unwrap_or("?"),
                    k["count"],
                    k["bits_median"].as_f64().unwrap_or(f64::NAN),
                    k["bits_min"].as_f64().unwrap_or(f64::NAN),
                    k["bits_max"].as_f64().unwrap_or(f64::NAN)
                );
            }
            write(out, &doc)
        }
        Some("run") => {
            // Every option named: a misspelt one is an error, not a default.
            let mut it = args[1..].iter();
            let mut seen: Vec<&str> = Vec::new();
            while let Some(a) = it.next() {
                if seen.contains(&a.as_str()) {
                    return Err(format!("run: {a} given twice"));
                }
                seen.push(a.as_str());
                match a.as_str() {
                    "--no-gemm" | "--coded" | "--high-priority-decode" | "--high-priority-compute" => {}
                    o if RUN_OPTIONS.contains(&o) => {
                        let v = it.next().ok_or_else(|| format!("{o} needs a value"))?;
                        if v.starts_with("--") {
                            return Err(format!("{o} needs a value, not the option {v}"));
                        }
                    }
                    other => {
                        return Err(format!(
                            "run: unknown argument {other:?} (options: {}, --no-gemm, --coded, --high-priority-decode, --high-priority-compute)",
                            RUN_OPTIONS.join(", ")
                        ))
                    }
                }
            }
            let backend = opt(args, "--backend").unwrap_or("tch");
            // The options only cuda's file implements: refused elsewhere, never ignored.
            let no_gemm = args.iter().any(|a| a == "--no-gemm");
            let coded = args.iter().any(|a| a == "--coded");
            let high_priority_decode = args.iter().any(|a| a == "--high-priority-decode");
            let high_priority_compute = args.iter().any(|a| a == "--high-priority-compute");
            if high_priority_compute && backend != "cuda" {
                return Err(format!("--high-priority-compute: cuda's file only (it sets the reference model's stream), not {backend}"));
            }
            if high_priority_compute && !coded {
                return Err("--high-priority-compute: only with --coded (a coded probe, recorded in the coded store's facts)".into());
            }
            if high_priority_decode && !coded {
                return Err("--high-priority-decode: only with --coded (it sets the decoder's stream)".into());
            }
            let staging_buffers = match opt(args, "--staging-buffers") {
                None => Vec::new(),
                Some(_) if !coded => return Err("--staging-buffers: only with --coded (the decode engine's staging)".into()),
                Some(v) => parsed(v.split(','), "--staging-buffers", "not a positive count", |&n: &usize| n > 0)?,
            };
            if opt(args, "--budgets").is_some() && !matches!(backend, "cuda" | "candle") {
                return Err(format!("--budgets is implemented by the cuda and candle backends only, not by {backend}"));
            }
            for (name, given) in [("--trace", opt(args, "--trace").is_some()), ("--no-gemm", no_gemm), ("--coded", coded)] {
                if given && backend != "cuda" {
                    return Err(format!("{name} is implemented by the cuda backend only, not by {backend}"));
                }
            }
            let mut model = registry::model(opt(args, "--model").ok_or("--model is required")?)?;
            let out = opt(args, "--out").ok_or("--out is required")?;
            // Short runs (a sanitizer's): the first K blocks of each stack, an extra image case.
            if let Some(k) = opt(args, "--blocks") {
                model = registry::first_blocks(&model, k.parse().map_err(|_| format!("--blocks: not a number: {k}"))?);
            }
            let user = registry::case_from_args(&model, opt(args, "--size"), opt(args, "--batch"), opt(args, "--frames"))?;
            if user.is_some() && opt(args, "--res").is_some() {
                return Err("--res is --size RxR --batch 1: give one or the other".into());
            }
            if let Some(r) = opt(args, "--res") {
                let res: usize = r.parse().map_err(|_| format!("--res: not a number: {r}"))?;
                if res == 0 || res % 16 != 0 {
                    return Err(format!("--res {res}: a positive multiple of 16 pixels"));
                }
                let case = registry::extra_image_case(&model, res);
                if model.case(&case.name).is_err() {
                    model.cases.push(case);
                }
            }
            let list = |name: &str, default: &str| -> Vec<String> {
                opt(args, name).unwrap_or(default).split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()
            };
            // A user's case is the run's only case unless --cases names others.
            let cases = match (opt(args, "--cases"), user) {
                (Some(_), u) => {
                    model.cases.extend(u);
                    list("--cases", "")
                }
                (None, Some(u)) => {
                    let name = u.name.clone();
                    model.cases.push(u);
                    vec![name]
                }
                (None, None) => model.cases.iter().map(|c| c.name.clone()).collect(),
            };
            // `auto`: also the depth the planner chooses for a fully streamed ring.
            let depth_args = list("--depths", "1");
            let auto_depth = depth_args.iter().any(|d| d == "auto");
            let depths =
                parsed(depth_args.iter().filter(|d| *d != "auto"), "--depths", "neither a depth of at least 1 nor `auto`", |&n| n >= 1)?;
            if depths.is_empty() && !auto_depth {
                return Err("--depths: no depth given (depths of at least 1, comma-separated, or `auto`)".into());
            }
            if auto_depth && backend != "candle" {
                return Err(format!("--depths auto: only candle's file calibrates a fully streamed ring (not {backend})"));
            }
            let (steps, warmup) = (num(args, "--steps", 5)?, num(args, "--warmup", 1)?);
            if steps < 5 {
                return Err(format!("--steps {steps}: a run times at least 5 steps after warm-up"));
            }
            let commit = opt(args, "--commit").unwrap_or("unknown").to_owned();
            let budgets_gib =
                parsed(list("--budgets", ""), "--budgets", "not a positive number of GiB", |g: &f64| g.is_finite() && *g > 0.0)?;
            if opt(args, "--budgets").is_some() && budgets_gib.is_empty() {
                return Err("--budgets: no budget given (GiB, comma-separated: --budgets 8,12,16)".into());
            }
            let trace = opt(args, "--trace").map(str::to_owned);
            let opts = offload_bench::harness::RunOptions {
                cases,
                depths,
                auto_depth,
                steps,
                warmup,
                commit,
                budgets_gib,
                trace,
                no_gemm,
                coded,
                high_priority_decode,
                high_priority_compute,
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
                    Err(format!(
                        "backend {other:?} is not built into this zoo (features: tch-cuda for tch, candle-cuda for candle, cuda for cuda)"
                    ))
                }
            };
            write(out, &doc?)
        }
        Some("merge") => {
            let (out, min, files, anchor_files) = merge_args(args, "--anchors")?;
            let runs = read_all::<RunDoc>(&files)?;
            let anchors = read_all::<AnchorDoc>(&anchor_files)?;
            let doc = merge(&runs, &anchors, min)?;
            for c in doc["cases"].as_array().into_iter().flatten() {
                let planned = if c["depth_chosen_by"] == "planner" { " (the planner's depth)" } else { "" };
                let judged = if c["judged"] == false { " (not judged: the planner's row of this case is)" } else { "" };
                let streamed = ": streamed {step_streamed_s:.4} s [{step_streamed_s_min:.4}, {step_streamed_s_max:.4}] × {repeats}, \
                                ratio to bound {ratio_to_bound:.4}, anchor best {anchor_best_mode} {anchor_best_step_s}, meets targets {meets_targets}";
                println!("{}{planned}{}{judged}", fill("{model:s} {case:s} d={depth}", c), fill(streamed, c));
            }
            say(&doc, "the file meets its targets: {meets_targets}");
            write(out, &doc)
        }
        Some("pipeline") => {
            const OPTIONS: [&str; 7] = ["--res", "--steps", "--budget", "--passes", "--warmup", "--commit", "--out"];
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                if !OPTIONS.contains(&a.as_str()) {
                    return Err(format!("pipeline: unknown argument {a:?} (options: {})", OPTIONS.join(", ")));
                }
                if it.next().is_none_or(|v| v.starts_with("--")) || args.iter().filter(|x| *x == a).count() > 1 {
                    return Err(format!("pipeline: {a} needs one value, given once"));
                }
            }
            let out = opt(args, "--out").ok_or("--out is required")?;
            let (steps, passes, warmup) = (num(args, "--steps", 4)?, num(args, "--passes", 3)?, num(args, "--warmup", 1)?);
            if steps == 0 || passes == 0 {
                return Err("pipeline: --steps and --passes must be at least 1".into());
            }
            let budget_gib: f64 = opt(args, "--budget").map_or(Ok(8.0), |v| v.parse().map_err(|_| format!("--budget: {v}")))?;
            if !(budget_gib.is_finite() && budget_gib > 0.0) {
                return Err(format!("--budget {budget_gib}: a positive number of GiB"));
            }
            let res = opt(args, "--res").unwrap_or("1024");
            let _ = (out, steps, passes, warmup, budget_gib, res);
            #[cfg(feature = "tch-cuda")]
            {
                let p = offload_bench::tch::Pipeline::flux(res, steps)?;
                let commit = opt(args, "--commit").unwrap_or("unknown").to_owned();
                let o = offload_bench::tch::PipelineOptions { budget_gib, warmup, passes, commit };
                write(out, &offload_bench::tch::run_pipeline(&p, &o)?)
            }
            #[cfg(not(feature = "tch-cuda"))]
            Err("pipeline: tch is not built into this zoo (feature tch-cuda)".into())
        }
        Some("host-tiers") => {
            let model = registry::model(opt(args, "--model").ok_or("host-tiers: --model is required")?)?;
            let out = opt(args, "--out").ok_or("host-tiers: --out is required")?;
            let file = opt(args, "--file").ok_or("host-tiers: --file (the checkpoint, written if absent) is required")?;
            let (depth, steps) = (num(args, "--depth", 1)?, num(args, "--steps", 5)?);
            if depth == 0 || steps == 0 {
                return Err("host-tiers: --depth and --steps must be at least 1".into());
            }
            let case = opt(args, "--case").unwrap_or("1024");
            let commit = opt(args, "--commit").unwrap_or("unknown");
            let host_ram = match opt(args, "--host-ram-gib") {
                None => None,
                Some(v) => match v.parse::<f64>() {
                    Ok(g) if g.is_finite() && g > 0.0 => Some((g * (1u64 << 30) as f64) as u64),
                    _ => return Err(format!("host-tiers: --host-ram-gib {v:?} is not a positive number")),
                },
            };
            let disk_steps = num(args, "--disk-steps", 2)?.max(1);
            #[cfg(feature = "cuda")]
            {
                let mut doc =
                    offload_bench::host_tiers::run(&model, case, depth, steps, file, commit, host_ram, disk_steps, opt(args, "--only"))?;
                doc.group = opt(args, "--group").map(str::to_owned);
                doc.pid = std::process::id();
                write(out, &doc)
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (model, out, file, depth, steps, case, commit, host_ram, disk_steps);
                Err("host-tiers: cuda is not built into this zoo (feature cuda)".into())
            }
        }
        Some("relay") => {
            let model = registry::model(opt(args, "--model").ok_or("relay: --model is required")?)?;
            let out = opt(args, "--out").ok_or("relay: --out is required")?;
            let (depth, steps) = (num(args, "--depth", 1)?, num(args, "--steps", 5)?);
            if depth == 0 || steps == 0 {
                return Err("relay: --depth and --steps must be at least 1".into());
            }
            let helpers: Vec<usize> = parsed(opt(args, "--helpers").unwrap_or("1").split(','), "--helpers", "not a device", |_| true)?;
            let case = opt(args, "--case").unwrap_or("1024");
            let commit = opt(args, "--commit").unwrap_or("unknown");
            #[cfg(feature = "cuda")]
            {
                let doc = offload_bench::relay::run(&model, case, depth, steps, &helpers, commit)?;
                write(out, &doc)
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = (model, out, depth, steps, helpers, case, commit);
                Err("relay: cuda is not built into this zoo (feature cuda)".into())
            }
        }
        Some(what @ "merge-relay") => {
            let (out, doc) = merge_runs(args, what, false, offload_bench::relay::merge)?;
            say(
                &doc["cases"],
                "{model:s} {case:s}: relay {step_relay_s.median:.4} s, {ratio_to_bound.median:.3} × its bound, \
                 {speedup.median:.2} × one link, bitwise {bitwise_equal}, meets {meets_targets}",
            );
            write(out, &doc)
        }
        Some(what @ "merge-host-tiers-shared") => {
            let (out, doc) = merge_runs(args, what, true, offload_bench::host_tiers::merge_shared)?;
            say(
                &doc["groups"],
                "{group:s}: {processes} processes serving together {serving_together_s:.1} s, host RSS ≤ {host_rss_max_bytes:g2} GiB, \
                 file mapped ≥ {file_mapped_share_min:.3}, bitwise {bitwise_equal}, meets {meets_targets}",
            );
            write(out, &doc)
        }
        Some(what @ "merge-coded-start") => {
            let (out, doc) = merge_runs(args, what, true, offload_bench::host_tiers::merge_coded_start)?;
            say(
                &doc["cases"],
                "{mode:s}: start {start_s.median:.2} s (store {store_build_s.median:.2} s), step {step_streamed_s.median:.4} s, \
                 {coded_blocks} buffers coded, bitwise {bitwise_equal}",
            );
            say(&doc, "coded ÷ coded-file start: {start_speedup}, checks pass: {checks_pass}");
            write(out, &doc)
        }
        Some(what @ "merge-host-tiers") => {
            let (out, doc) = merge_runs(args, what, true, offload_bench::host_tiers::merge)?;
            say(
                &doc["cases"],
                "{mode:s}: start {start_s.median:.2} s, host RSS {host_rss_bytes.median:g2} GiB, step {step_streamed_s.median:.4} s, \
                 ratio to bound {ratio_to_bound.median:.4}, to the disk estimate {ratio_to_disk_estimate.median:.4}, \
                 disk stream ÷ read {disk_stream_to_read.median:.3}, bitwise {bitwise_equal}, meets {meets_targets}",
            );
            write(out, &doc)
        }
        Some(what @ "merge-pipeline") => {
            let (out, doc) = merge_runs(args, what, false, offload_bench::pipeline::merge)?;
            say(
                &doc,
                "pipeline {case:s} × {steps} steps: offloaded {whole.offloaded_s:.4} s [{whole.offloaded_s_min:.4}, \
                 {whole.offloaded_s_max:.4}], bound {whole.bound_s:.4} s, ratio {whole.ratio_to_bound:.4}, resident \
                 {whole.resident_s:.4} s, peak {peak_device_bytes:g2} GiB, meets targets {meets_targets}",
            );
            write(out, &doc)
        }
        Some("merge-compressed") => {
            let (out, min, files, codec_files) = merge_args(args, "--codec")?;
            let runs = read_all::<RunDoc>(&files)?;
            let doc = offload_bench::compressed::merge(&runs, &read_all::<Value>(&codec_files)?, min)?;
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
            write(out, &doc)
        }
        _ => Err(
            "usage: zoo registry [--json F] | zoo run --backend tch --model M --out F [...] | zoo merge --out F RUN... [--anchors A...] \
             | zoo pipeline --out F [...] | zoo merge-pipeline --out F RUN... | zoo merge-compressed --out F RUN... [--codec C...]"
                .into(),
        ),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("zoo: {e}");
        std::process::exit(1);
    }
}
