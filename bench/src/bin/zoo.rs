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

fn write(path: &str, v: &impl serde::Serialize) -> Result<(), String> {
    let text = serde_json::to_string_pretty(v).map_err(|e| format!("{path}: {e}"))?;
    std::fs::write(path, text + "\n").map_err(|e| format!("{path}: {e}"))
}

fn read<T: serde::de::DeserializeOwned>(path: &str) -> Result<T, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))
}

/// A merge's arguments: `--out F`, `--min-repeats N` (3), the run files, and the
/// files after `--anchors`.
type MergeArgs<'a> = (&'a str, usize, Vec<&'a str>, Vec<&'a str>);

/// `merge_args` of a merge without anchors: `--out`, `--min-repeats` and the
/// run files read as `T`; anchors given are an error naming the command `what`.
fn runs_only<'a, T: serde::de::DeserializeOwned>(args: &'a [String], what: &str) -> Result<(&'a str, usize, Vec<T>), String> {
    runs_named(args, what).map(|(out, min, runs, _)| (out, min, runs))
}

/// What [`runs_named`] gives: `--out`, `--min-repeats`, the runs read as `T`
/// and their files, in the order given.
type NamedRuns<'a, T> = (&'a str, usize, Vec<T>, Vec<&'a str>);

/// [`runs_only`] with the run files' paths, in the order given, for
/// [`naming_files`].
fn runs_named<'a, T: serde::de::DeserializeOwned>(args: &'a [String], what: &str) -> Result<NamedRuns<'a, T>, String> {
    let (out, min, files, anchors) = merge_args(args, "--anchors")?;
    if !anchors.is_empty() {
        return Err(format!("{what} takes no --anchors"));
    }
    let runs = files.iter().map(|f| read::<T>(f)).collect::<Result<Vec<_>, _>>()?;
    Ok((out, min, runs, files))
}

/// A host-tier merge's error with each run's file: those merges name a run by
/// its number in the order given ("run 2 (pid …)"), which says nothing to whoever
/// has only the files.
fn naming_files(e: String, files: &[&str]) -> String {
    let each: Vec<String> = files.iter().enumerate().map(|(i, f)| format!("run {} is {f}", i + 1)).collect();
    format!("{e} ({})", each.join(", "))
}

fn merge_args<'a>(args: &'a [String], second: &str) -> Result<MergeArgs<'a>, String> {
    let out = opt(args, "--out").ok_or("--out is required")?;
    let min = num(args, "--min-repeats", 3)?;
    let (mut runs, mut anchors) = (Vec::new(), Vec::new());
    let (mut in_anchors, mut skip) = (false, false);
    for a in &args[1..] {
        if skip {
            skip = false;
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

fn run(args: &[String]) -> Result<(), String> {
    match args.first().map(String::as_str) {
        Some("registry") => {
            // With a user's case: every model that takes it holds it too (the anchors read it here).
            let mut models = registry::models();
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
            let runs = files.iter().map(|f| read::<RunDoc>(f)).collect::<Result<Vec<_>, _>>()?;
            let anchors = anchor_files.iter().map(|f| read::<AnchorDoc>(f)).collect::<Result<Vec<_>, _>>()?;
            let doc = merge(&runs, &anchors, min)?;
            for c in doc["cases"].as_array().into_iter().flatten() {
                println!(
                    "{} {} d={}{}: streamed {:.4} s [{:.4}, {:.4}] × {}, ratio to bound {:.4}, anchor best {} {}, meets targets {}{}",
                    c["model"].as_str().unwrap_or(""),
                    c["case"].as_str().unwrap_or(""),
                    c["depth"],
                    if c["depth_chosen_by"] == "planner" { " (the planner's depth)" } else { "" },
                    c["step_streamed_s"].as_f64().unwrap_or(f64::NAN),
                    c["step_streamed_s_min"].as_f64().unwrap_or(f64::NAN),
                    c["step_streamed_s_max"].as_f64().unwrap_or(f64::NAN),
                    c["repeats"],
                    c["ratio_to_bound"].as_f64().unwrap_or(f64::NAN),
                    c["anchor_best_mode"],
                    c["anchor_best_step_s"],
                    c["meets_targets"],
                    if c["judged"] == false { " (not judged: the planner's row of this case is)" } else { "" }
                );
            }
            println!("the file meets its targets: {}", doc["meets_targets"]);
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
        Some("merge-relay") => {
            let (out, min, runs) = runs_only::<offload_bench::relay::RelayRun>(args, "merge-relay")?;
            let doc = offload_bench::relay::merge(&runs, min)?;
            for c in doc["cases"].as_array().into_iter().flatten() {
                println!(
                    "{} {}: relay {:.4} s, {:.3} × its bound, {:.2} × one link, bitwise {}, meets {}",
                    c["model"].as_str().unwrap_or(""),
                    c["case"].as_str().unwrap_or(""),
                    c["step_relay_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["ratio_to_bound"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["speedup"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["bitwise_equal"],
                    c["meets_targets"]
                );
            }
            write(out, &doc)
        }
        Some("merge-host-tiers-shared") => {
            let (out, min, runs, files) = runs_named::<offload_bench::host_tiers::HostTierRun>(args, "merge-host-tiers-shared")?;
            let doc = offload_bench::host_tiers::merge_shared(&runs, min).map_err(|e| naming_files(e, &files))?;
            for g in doc["groups"].as_array().into_iter().flatten() {
                println!(
                    "{}: {} processes serving together {:.1} s, host RSS ≤ {:.2} GiB, file mapped ≥ {:.3}, bitwise {}, meets {}",
                    g["group"].as_str().unwrap_or(""),
                    g["processes"],
                    g["serving_together_s"].as_f64().unwrap_or(f64::NAN),
                    g["host_rss_max_bytes"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
                    g["file_mapped_share_min"].as_f64().unwrap_or(f64::NAN),
                    g["bitwise_equal"],
                    g["meets_targets"]
                );
            }
            write(out, &doc)
        }
        Some("merge-coded-start") => {
            let (out, min, runs, files) = runs_named::<offload_bench::host_tiers::HostTierRun>(args, "merge-coded-start")?;
            let doc = offload_bench::host_tiers::merge_coded_start(&runs, min).map_err(|e| naming_files(e, &files))?;
            for c in doc["cases"].as_array().into_iter().flatten() {
                println!(
                    "{}: start {:.2} s (store {:.2} s), step {:.4} s, {} buffers coded, bitwise {}",
                    c["mode"].as_str().unwrap_or(""),
                    c["start_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["store_build_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["step_streamed_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["coded_blocks"],
                    c["bitwise_equal"],
                );
            }
            println!("coded ÷ coded-file start: {}, checks pass: {}", doc["start_speedup"], doc["checks_pass"]);
            write(out, &doc)
        }
        Some("merge-host-tiers") => {
            let (out, min, runs, files) = runs_named::<offload_bench::host_tiers::HostTierRun>(args, "merge-host-tiers")?;
            let doc = offload_bench::host_tiers::merge(&runs, min).map_err(|e| naming_files(e, &files))?;
            for c in doc["cases"].as_array().into_iter().flatten() {
                println!(
                    "{}: start {:.2} s, host RSS {:.2} GiB, step {:.4} s, ratio to bound {:.4}, to the disk estimate {:.4}, disk stream ÷ read {:.3}, bitwise {}, meets {}",
                    c["mode"].as_str().unwrap_or(""),
                    c["start_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["host_rss_bytes"]["median"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
                    c["step_streamed_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["ratio_to_bound"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["ratio_to_disk_estimate"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["disk_stream_to_read"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["bitwise_equal"],
                    c["meets_targets"]
                );
            }
            write(out, &doc)
        }
        Some("merge-pipeline") => {
            let (out, min, runs) = runs_only::<offload_bench::pipeline::PipelineRun>(args, "merge-pipeline")?;
            let doc = offload_bench::pipeline::merge(&runs, min)?;
            let w = &doc["whole"];
            println!(
                "pipeline {} × {} steps: offloaded {:.4} s [{:.4}, {:.4}], bound {:.4} s, ratio {:.4}, resident {:.4} s, peak {:.2} GiB, meets targets {}",
                doc["case"].as_str().unwrap_or(""),
                doc["steps"],
                w["offloaded_s"].as_f64().unwrap_or(f64::NAN),
                w["offloaded_s_min"].as_f64().unwrap_or(f64::NAN),
                w["offloaded_s_max"].as_f64().unwrap_or(f64::NAN),
                w["bound_s"].as_f64().unwrap_or(f64::NAN),
                w["ratio_to_bound"].as_f64().unwrap_or(f64::NAN),
                w["resident_s"].as_f64().unwrap_or(f64::NAN),
                doc["peak_device_bytes"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
                doc["meets_targets"]
            );
            write(out, &doc)
        }
        Some("merge-compressed") => {
            let (out, min, files, codec_files) = merge_args(args, "--codec")?;
            let runs = files.iter().map(|f| read::<RunDoc>(f)).collect::<Result<Vec<_>, _>>()?;
            let codec = codec_files.iter().map(|f| read::<serde_json::Value>(f)).collect::<Result<Vec<_>, _>>()?;
            let doc = offload_bench::compressed::merge(&runs, &codec, min)?;
            println!(
                "compressed: ratio {:.4}, entropy {:.3} bits, encode {:.2} GB/s, decode {} GB/s, meets targets {}",
                doc["compression_ratio"].as_f64().unwrap_or(f64::NAN),
                doc["exponent_entropy_bits"].as_f64().unwrap_or(f64::NAN),
                doc["encode_gbps_host"].as_f64().unwrap_or(f64::NAN),
                doc["decode_gbps"],
                doc["meets_targets"]
            );
            for c in doc["cases"].as_array().into_iter().flatten() {
                println!(
                    "  {} d={} ({}): raw {:.4} s, coded {:.4} s, bound {:.4} s, coded ÷ bound {:.4}, planner {}, chosen ÷ declined {:.4}, bitwise {}, meets {}",
                    c["case"].as_str().unwrap_or(""),
                    c["depth"],
                    c["raw_step"].as_str().unwrap_or(""),
                    c["step_streamed_raw_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["step_streamed_compressed_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["bound_uncompressed_s"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["ratio_to_uncompressed_bound"]["median"].as_f64().unwrap_or(f64::NAN),
                    match c["planner_codes"].as_bool() {
                        Some(true) => "codes",
                        Some(false) => "leaves raw",
                        None => "not asked",
                    },
                    c["planned_over_declined"]["median"].as_f64().unwrap_or(f64::NAN),
                    c["bitwise_equal"],
                    c["meets_targets"]
                );
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
