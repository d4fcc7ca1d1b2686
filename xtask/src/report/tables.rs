//! The README's and docs/results.md's generated tables, each computed from the
//! newest committed results file of its kind; nothing in them typed by hand.

use super::*;

/// The README's generated block: the headline table and its plot, then the
/// Python package's table where a results file holds one.
pub fn readme_headline(table: &str) -> String {
    format!("{table}\n![per model: our streamed step beside diffusers' offloaded modes and the resident step](bench/plots/headline.png)\n")
}

pub(super) fn span(v: &Value, digits: usize) -> String {
    format!("{:.digits$} [{:.digits$}, {:.digits$}]", f(&v["median"]), f(&v["min"]), f(&v["max"]))
}

/// The Python package's table, from the newest `*-python-package.json` in
/// `results` (`bench/anchors/py_merge.py`'s output): per model and case, the
/// package's step beside resident and diffusers' modes on the same model object,
/// every figure read from the file.
pub fn python_table(results: &Path) -> Result<Option<String>, String> {
    let Some(name) = newest(results, "-python-package.json")? else { return Ok(None) };
    let d = read_json(&results.join(&name))?;
    let gpu = gpu_of(&d, &name)?;
    let mut md = format!(
        "The Python package (`offload.enable`) on the real diffusers and transformers classes, one {gpu}, bf16 (rows `MODEL-fp8`: \
         diffusers' layerwise casting, fp8 storage and bf16 compute, in every mode; `-fp8-linears`: every Linear of the blocks \
         fp8; `MODEL-gguf-q8_0` and `-gguf-q4_k`: the blocks' Linears as diffusers' GGUF layers, dequantised per layer in every \
         mode; `-budgetB`: the package planned under B GiB from a traced step), medians of the processes named with \
         [min, max]; resident, the package and diffusers' group offloading ran on the same model object in each process; `d=` \
         is the package's prefetch depth (`bench/results/{name}`, commits `{}`, {}, {}):\n\n",
        d["commit"].as_str().unwrap_or("?"),
        d["date"].as_str().unwrap_or("?"),
        d["versions"].as_array().into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join("; ")
    );
    md.push_str("| model | case | package (s) | ratio to bound | resident (s) | diffusers' best offloaded (s) | package ÷ diffusers | weights on device, package (GiB) | bitwise equal | host syncs a step | targets met | commit |\n");
    md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for r in d["cases"].as_array().into_iter().flatten() {
        let best = r["diffusers_best_mode"].as_str().unwrap_or("");
        let diff = match (best.is_empty(), r["diffusers_failed"].is_object()) {
            (true, true) => "failed (below)".into(),
            (true, false) => "–".into(),
            (false, _) => format!("{} ({})", span(&r["diffusers_s"][best], 3), best.replace('_', " ")),
        };
        let targets = r["targets"].as_object().is_some_and(|t| t.values().all(|v| v.as_bool() == Some(true)));
        // Runs before the engine's slots were counted report no weights (`py_merge.py`).
        let weights = match &r["weights_device_gib"]["offload"]["median"] {
            Value::Null => "not measured¹".to_owned(),
            v => format!("{:.2}", f(v)),
        };
        let planned = match r["budget_gib"].as_f64() {
            Some(b) => format!(", {b:.1} GiB budget, {} blocks resident", r["resident_blocks"].as_array().map_or(0, Vec::len)),
            None => String::new(),
        };
        let _ = writeln!(
            md,
            "| {} | {} d={}{planned} | {} | {} | {} | {diff} | {} | {} | {} | {} | {} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["case"].as_str().unwrap_or("?"),
            r["depth"],
            span(&r["offload_s"], 3),
            span(&r["ratio_to_bound"], 3),
            span(&r["resident_s"], 3),
            r["vs_diffusers_best"].get("median").map_or("–".into(), |v| format!("{:.3}", f(v))),
            weights,
            yes(&r["bitwise_equal"]),
            r["host_syncs_in_timed_steps"],
            if targets { "yes" } else { "no" },
            r["commit"].as_str().unwrap_or(d["commit"].as_str().unwrap_or("?"))
        );
    }
    // Cases measured again: one line for all of them, each with its count of earlier runs.
    let mut again = Vec::new();
    for r in d["cases"].as_array().into_iter().flatten() {
        for (mode, why) in r["diffusers_failed"].as_object().into_iter().flatten() {
            let _ = writeln!(
                md,
                "\n{} {}: diffusers' {} failed on this model: `{}`.",
                r["model"].as_str().unwrap_or("?"),
                r["case"].as_str().unwrap_or("?"),
                mode.replace('_', " "),
                why.as_str().unwrap_or("?")
            );
        }
        let gone = r["superseded_runs"].as_array().map_or(0, Vec::len);
        if gone > 0 {
            let (model, case, commit) =
                (r["model"].as_str().unwrap_or("?"), r["case"].as_str().unwrap_or("?"), r["commit"].as_str().unwrap_or("?"));
            again.push(format!("{model} {case} ({gone}, now from `{commit}`)"));
        }
    }
    if !again.is_empty() {
        let _ = writeln!(
            md,
            "\nMeasured again, each merged from its newest runs only; the earlier runs (how many in brackets) are kept and \
             named in the file (`superseded_runs`), and `bench/NOTES.md` says why: {}.",
            again.join(", ")
        );
    }
    if d["cases"].as_array().into_iter().flatten().any(|r| r["weights_device_gib"]["offload"].is_null()) {
        md.push_str(
            "\n¹ Runs before 2026-12-04 counted the package's weights on the device without its slots and resident blocks \
             (allocated when it is enabled, before the step whose peak was read): too low, so not reported until run again.\n",
        );
    }
    for n in d["not_merged"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "\nNot merged: {} {} ({}).",
            n["model"].as_str().unwrap_or("?"),
            n["case"].as_str().unwrap_or("?"),
            n["why"].as_str().unwrap_or("?")
        );
    }
    if let Some(runs) = python_runs(results)? {
        md.push('\n');
        md.push_str(&runs);
    }
    Ok(Some(md))
}

/// The name of the newest file in `results` whose name ends with `suffix`.
pub(super) fn newest(results: &Path, suffix: &str) -> Result<Option<String>, String> {
    let names = std::fs::read_dir(results).map_err(|e| format!("{}: {e}", results.display()))?;
    newest_of(names.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(suffix)), suffix)
}

/// The newest of `names` (results files, named `YYYY-MM-DD-…`): the latest
/// date. Two files of that date are no order (the name's rest would decide it
/// by its letters): an error naming both, until the superseded one leaves
/// `bench/results/` (its raw runs stay in `bench/raw.tar.gz` while a published file cites them).
pub(super) fn newest_of(names: impl IntoIterator<Item = String>, what: &str) -> Result<Option<String>, String> {
    let mut names: Vec<String> = names.into_iter().collect();
    names.sort();
    let Some(last) = names.last() else { return Ok(None) };
    let date = last.get(..10).unwrap_or(last);
    let same: Vec<&String> = names.iter().filter(|n| n.get(..10) == Some(date)).collect();
    if same.len() > 1 {
        return Err(format!(
            "results files {} are all the newest {what} ({date}): which one is published is no file name's order; remove the \
             superseded ones from bench/results/ (git keeps them)",
            same.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(Some(last.clone()))
}

/// The Python package's whole pipeline call and its start from a checkpoint,
/// from the newest `*-python-pipeline.json` and `*-python-start.json`
/// (`bench/anchors/py_pipeline.py` and `py_start.py` merges), every figure and
/// verdict read from the files.
pub fn python_runs(results: &Path) -> Result<Option<String>, String> {
    let mut md = String::new();
    if let Some(name) = newest(results, "-python-pipeline.json")? {
        let d = read_json(&results.join(&name))?;
        let c = &d["case"];
        let budget = f(&d["budget_gib"]);
        let _ = writeln!(
            md,
            "A whole `{}` call ({}'s transformer and the VAE, random weights, prompt embeddings passed in; {} steps at {}², batch {}), \
             the package enabled on the pipeline under {budget:.0} GiB beside diffusers' offloading, {} processes, medians with \
             [min, max] (`bench/results/{name}`, commit `{}`, {}):\n",
            c["pipeline"].as_str().unwrap_or("?"),
            c["transformer"].as_str().unwrap_or("?"),
            c["steps"],
            c["res"],
            c["batch"],
            d["processes"],
            d["commit"].as_str().unwrap_or("?"),
            d["versions"].as_str().unwrap_or("?")
        );
        md.push_str(&format!(
            "| mode | call (s) | peak device memory (GiB) | weights on device (GiB) | within {budget:.0} GiB | bitwise equal to resident |\n"
        ));
        md.push_str("| --- | --- | --- | --- | --- | --- |\n");
        // Resident and the package first, then diffusers' modes as the file names them.
        let modes = d["modes"].as_object().into_iter().flatten();
        let mut modes: Vec<(&String, &Value)> = modes.collect();
        modes.sort_by_key(|(m, _)| (["resident", "offload"].iter().position(|k| k == m).unwrap_or(2), m.to_string()));
        for (mode, r) in modes {
            let label = if mode == "offload" { "the package (`enable_pipeline`)".to_owned() } else { mode.replace('_', " ") };
            let _ = writeln!(
                md,
                "| {label} | {} | {:.2} | {:.2} | {} | {} |",
                span(&r["call_s"], 3),
                gib(&r["peak_device_bytes"]),
                gib(&r["weights_device_bytes"]),
                yes(&r["fits_budget"]),
                yes(&r["bitwise_equal_to_resident"])
            );
        }
        let _ = writeln!(
            md,
            "\nThe package's call is {:.3} × diffusers' fastest mode within the budget ({}) and {:.3} × all resident; targets met: {}.",
            f(&d["offload_vs_diffusers_best"]),
            d["diffusers_best_within_budget"].as_str().unwrap_or("none").replace('_', " "),
            f(&d["offload_vs_resident"]),
            yes(&d["meets_targets"])
        );
    }
    if let Some(name) = newest(results, "-python-start.json")? {
        let d = read_json(&results.join(&name))?;
        let gib_span = |v: &Value| format!("{:.2} [{:.2}, {:.2}]", gib(&v["median"]), gib(&v["min"]), gib(&v["max"]));
        let _ = writeln!(
            md,
            "{}A model built on the meta device and enabled with `checkpoint=` on {}'s {:.2} GiB file, {} processes \
             (`bench/results/{name}`, commit `{}`): {} s from `enable` to the end of the first streamed step (target ≤ 2 s); \
             host memory beyond the page cache {} GiB then, {} GiB of it before `enable` (target ≤ 1 GiB); {} blocks served \
             in place, {} copied; streamed step {} s, {} × its bound; bitwise equal to the resident model: {}; targets met: {}.",
            if md.is_empty() { "" } else { "\n" },
            d["model"].as_str().unwrap_or("?"),
            gib(&d["file_bytes"]),
            d["processes"],
            d["commit"].as_str().unwrap_or("?"),
            span(&d["start_s"], 2),
            gib_span(&d["host_rss_first_step_bytes"]),
            gib_span(&d["host_rss_before_enable_bytes"]),
            d["in_place"],
            d["copied"],
            span(&d["step_streamed_s"], 3),
            span(&d["ratio_to_bound"], 3),
            yes(&d["bitwise_equal"]),
            yes(&d["meets_targets"])
        );
    }
    Ok((!md.is_empty()).then_some(md))
}

/// The first line of the README's generated block.
pub const README_START: &str =
    "<!-- Generated by `cargo xtask bench --report` from the files it names under bench/results/; edit those, not this. -->";
/// The last line of the README's generated block.
pub const README_END: &str = "<!-- End of the generated block. -->";

pub(super) fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

pub(super) fn yes(v: &Value) -> &'static str {
    match v.as_bool() {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => "–",
    }
}

pub(super) fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if v["probe"] == true {
        return Err(format!("{}: a --probe merge (fewer than three processes, or a probe's own settings): not published", path.display()));
    }
    Ok(v)
}

/// A row's case: [`case_label`] where the file names its cases, else the side.
pub(super) fn row_case(c: &Value) -> String {
    if c["case"].is_string() {
        case_label(c)
    } else {
        match c["resolution"].as_u64() {
            Some(r) if r > 0 => format!("{r}²"),
            _ => "–".into(),
        }
    }
}

/// A streamed case's depth: `d=2`, or `d=2 (the planner's)` where the planner
/// chose it (`zoo run --depths auto`).
pub(super) fn depth_label(c: &Value) -> String {
    match c["depth_chosen_by"].as_str() {
        Some("planner") => format!("d={} (the planner's)", c["depth"]),
        _ => format!("d={}", c["depth"]),
    }
}

/// A zoo row's verdict: yes or **no**, or, for a row at a depth given on the
/// command line beside the planner's row of the same case, not judged.
pub(super) fn verdict(c: &Value) -> String {
    match c["judged"] == false {
        true => format!("not judged ({}; the planner's row is)", if c["meets_targets"] == true { "within" } else { "over" }),
        false => yes(&c["meets_targets"]).to_owned(),
    }
}

/// A case as the tables name it: an image side (`1024²`), a video case's name as
/// it is, or a text encoder's tokens (resolution 0).
pub(super) fn case_label(c: &Value) -> String {
    let name = c["case"].as_str().unwrap_or("?");
    match (c["resolution"].as_u64(), c["tokens"].as_u64()) {
        (Some(0), Some(t)) => format!("{t} tokens"),
        _ if name.chars().all(|ch| ch.is_ascii_digit()) => format!("{name}²"),
        _ => name.to_owned(),
    }
}

/// The README's measured tables, from the bench room's results (`*-zoo-*.json`),
/// the planner's budget run, the compressed case (`*-compressed-*.json`), the
/// pipeline case (`*-pipeline-*.json`) and the Vulkan run in `results`: every
/// figure read or computed here, each table naming its file.
pub fn readme_tables(results: &Path) -> Result<String, String> {
    let mut names: Vec<String> = std::fs::read_dir(results)
        .map_err(|e| format!("{}: {e}", results.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut md = String::new();
    let mut printed: Vec<String> = Vec::new();
    for name in names.iter().filter(|n| n.contains("-zoo-") && n.ends_with(".json")) {
        let d = read_json(&results.join(name))?;
        let _ = writeln!(
            md,
            "`bench/results/{name}`: backend `{}` at {} on an {}, {}; each figure is the median of {} process runs with [min, max] \
             (for the ratio: the per-run ratios); the bound is `max(resident step, streamed bytes ÷ pinned bandwidth measured in the same run)`{}.\n",
            d["backend"].as_str().unwrap_or("?"),
            match d["commit"].as_str().unwrap_or("?") {
                one if !one.contains(", ") => format!("commit `{one}`"),
                many => format!("commits `{}` (each model's runs at one, named per case in the file)", many.replace(", ", "`, `")),
            },
            d["gpu"].as_str().unwrap_or("?"),
            d["date"].as_str().unwrap_or("?"),
            d["repeats"],
            if d["anchors"].as_array().is_some_and(|a| !a.is_empty()) { "; diffusers' processes ran interleaved with ours on the same machine (`bench/NOTES.md` names the device command of each)" } else { "" }
        );
        md.push_str("| model | case | streamed step (s) | ratio to bound | resident step (s) | diffusers' best offloaded (s) | ours ÷ diffusers | weights on device (GiB) | activations (GiB) | bitwise equal | finite, not constant | targets met |\n");
        md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for c in d["cases"].as_array().into_iter().flatten() {
            let anchor = match (c["anchor_best_mode"].as_str(), c["anchor_best_step_s"].as_f64()) {
                (Some(m), Some(s)) => format!("{s:.3} ({})", m.replace('_', " ")),
                _ => "–".into(),
            };
            let _ = writeln!(
                md,
                "| {} | {} {} | {:.3} [{:.3}, {:.3}] | {:.3} [{:.3}, {:.3}] | {:.3} | {anchor} | {} | {:.2} | {:.2} | {} | {} | {} |",
                c["model"].as_str().unwrap_or("?"),
                case_label(c),
                depth_label(c),
                f(&c["step_streamed_s"]),
                f(&c["step_streamed_s_min"]),
                f(&c["step_streamed_s_max"]),
                f(&c["ratio_to_bound"]),
                f(&c["ratio_to_bound_min"]),
                f(&c["ratio_to_bound_max"]),
                f(&c["step_resident_s"]),
                c["ratio_to_anchor_best"].as_f64().map_or("–".into(), |r| format!("{r:.3}")),
                gib(&c["weights_device_bytes"]),
                gib(&c["activations_peak_bytes"]),
                yes(&c["bitwise_equal"]),
                yes(&Value::Bool(c["output_finite"] == true && c["output_nonconstant"] == true)),
                verdict(c),
            );
        }
        // diffusers' rows, each once: a later file merged with the same anchor runs
        // (another backend of the same command) names them without repeating them.
        let fresh: Vec<&Value> = d["anchors"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| {
                let key = format!("{}|{}|{}|{}", a["model"], a["case"], a["mode"], a["step_streamed_s"]);
                !printed.contains(&key) && {
                    printed.push(key);
                    true
                }
            })
            .collect();
        if d["anchors"].as_array().is_some_and(|a| !a.is_empty()) && fresh.is_empty() {
            md.push_str("\ndiffusers' rows for these cases: the table above (the same anchor runs).\n");
        }
        if !fresh.is_empty() {
            md.push_str("\n| model | case | diffusers | step (s) | ratio to its bound | weights on device (GiB) | activations (GiB) |\n| --- | --- | --- | --- | --- | --- | --- |\n");
        }
        for a in fresh {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.3} [{:.3}, {:.3}] | {} | {:.2} | {:.2} |",
                a["model"].as_str().unwrap_or("?"),
                case_label(a),
                a["mode"].as_str().unwrap_or("?").replace('_', " "),
                f(&a["step_streamed_s"]),
                f(&a["step_streamed_s_min"]),
                f(&a["step_streamed_s_max"]),
                a["ratio_to_bound"].as_f64().map_or("–".into(), |r| format!("{r:.3}")),
                gib(&a["weights_device_bytes"]),
                gib(&a["activations_peak_bytes"]),
            );
        }
        md.push('\n');
    }
    // Host tiers (`zoo merge-host-tiers`): the mapped and the copying store, the newest file.
    let shared = |n: &&String| n.contains("-host-tiers-shared-");
    if let Some(name) =
        newest_of(names.iter().filter(|n| n.contains("-host-tiers-") && !shared(n) && n.ends_with(".json")).cloned(), "host-tiers file")?
    {
        let d = read_json(&results.join(&name))?;
        let modes: Vec<String> = d["cases"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let disk = match c["mode"].as_str() {
                    Some("disk") => format!(
                        " (host RAM budget {:.1} GiB, {} blocks read from disk at {:.2} GB/s, {:.3} × the file's read rate)",
                        f(&c["host_ram_budget_bytes"]) / (1u64 << 30) as f64,
                        c["disk_blocks"],
                        f(&c["disk_stream_gbps"]["median"]),
                        f(&c["disk_stream_to_read"]["median"]),
                    ),
                    _ => String::new(),
                };
                // The disk mode's figure against the file's read rate is an estimate the
                // steps can beat, not a bound: files merged before `disk_estimate_s` existed
                // hold it under `ratio_to_bound`, newer ones beside a true bound.
                let ratio = match (c["mode"].as_str(), c["disk_estimate_s"].is_null()) {
                    (Some("disk"), true) => format!(
                        "{:.3} × the disk estimate (bytes read ÷ the file's read rate: an estimate the steps beat, not a bound)",
                        f(&c["ratio_to_bound"]["median"])
                    ),
                    (Some("disk"), false) => format!(
                        "{:.3} × its bound, {:.3} × the disk estimate (bytes read ÷ the file's read rate: an estimate, not a bound)",
                        f(&c["ratio_to_bound"]["median"]),
                        f(&c["ratio_to_disk_estimate"]["median"])
                    ),
                    _ => format!("{:.3} × its bound", f(&c["ratio_to_bound"]["median"])),
                };
                format!(
                    "{} store{disk}: open → first streamed step {:.2} s [{:.2}, {:.2}], host memory beyond the page cache {:.2} GiB, \
                     streamed step {:.3} s, {ratio}, bitwise equal: {}, targets met: {}",
                    c["mode"].as_str().unwrap_or("?"),
                    f(&c["start_s"]["median"]),
                    f(&c["start_s"]["min"]),
                    f(&c["start_s"]["max"]),
                    f(&c["host_rss_bytes"]["median"]) / (1u64 << 30) as f64,
                    f(&c["step_streamed_s"]["median"]),
                    if c["bitwise_equal"] == true { "yes" } else { "**no**" },
                    if c["meets_targets"] == true { "yes" } else { "**no**" },
                )
            })
            .collect();
        let _ = writeln!(
            md,
            "Host tiers (`bench/results/{name}`, backend `{}` at {} on an {}, {} process runs, a {:.2} GiB {} checkpoint in the page cache, \
             medians with [min, max]): {}. Disk tier: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            d["process_runs"],
            f(&d["file_bytes"]) / (1u64 << 30) as f64,
            d["model"].as_str().unwrap_or("?"),
            modes.join("; "),
            match (d["disk_tier"].as_str(), d["disk_read_gbps"]["median"].as_f64()) {
                (Some(why), _) => why.to_owned(),
                (None, Some(gbps)) => format!(
                    "the file read at {gbps:.2} GB/s [{:.2}, {:.2}] in the same runs, {}",
                    f(&d["disk_read_gbps"]["min"]),
                    f(&d["disk_read_gbps"]["max"]),
                    if d["cases"].as_array().into_iter().flatten().any(|c| c["disk_direct"] == true) {
                        "bypassing the page cache (O_DIRECT)"
                    } else {
                        "through the page cache (no O_DIRECT on that file system)"
                    }
                ),
                (None, None) => "not measured".to_owned(),
            },
        );
    }
    // A coded start from a coded file (`zoo merge-coded-start`), the newest file.
    if let Some(name) =
        newest_of(names.iter().filter(|n| n.contains("-coded-start-") && n.ends_with(".json")).cloned(), "coded-start file")?
    {
        let d = read_json(&results.join(&name))?;
        let modes: Vec<String> = d["cases"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                format!(
                    "{}: open → first streamed step {:.2} s [{:.2}, {:.2}] (store {:.2} s), {} buffers coded, {:.2} GiB held, \
                     streamed step {:.3} s, bitwise equal: {}",
                    match c["mode"].as_str() {
                        Some("coded-file") => "from the coded file",
                        Some("coded") => "coded at build",
                        _ => "?",
                    },
                    f(&c["start_s"]["median"]),
                    f(&c["start_s"]["min"]),
                    f(&c["start_s"]["max"]),
                    f(&c["store_build_s"]["median"]),
                    c["coded_blocks"],
                    f(&c["host_bytes"]) / (1u64 << 30) as f64,
                    f(&c["step_streamed_s"]["median"]),
                    if c["bitwise_equal"] == true { "yes" } else { "**no**" },
                )
            })
            .collect();
        let writes: Vec<String> = d["coded_file_write_s"].as_array().into_iter().flatten().map(|w| format!("{:.1} s", f(w))).collect();
        let _ = writeln!(
            md,
            "Coded start (`bench/results/{name}`, backend `{}` at {} on an {}, {} process runs, a {:.2} GiB {} checkpoint and its \
             {:.2} GiB coded file in the page cache, medians with [min, max]): {}. Coded at build ÷ from the file: {:.1} × [{:.1}, {:.1}]; \
             the file written once in {}; checks pass: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            d["process_runs"],
            f(&d["file_bytes"]) / (1u64 << 30) as f64,
            d["model"].as_str().unwrap_or("?"),
            f(&d["coded_file_bytes"]) / (1u64 << 30) as f64,
            modes.join("; "),
            f(&d["start_speedup"]["median"]),
            f(&d["start_speedup"]["min"]),
            f(&d["start_speedup"]["max"]),
            if writes.is_empty() { "an earlier command".to_owned() } else { writes.join(", ") },
            if d["checks_pass"] == true { "yes" } else { "**no**" },
        );
    }
    // Processes serving one mapped file at once (`zoo merge-host-tiers-shared`), the newest file.
    if let Some(name) = newest_of(names.iter().filter(|n| shared(n) && n.ends_with(".json")).cloned(), "shared host-tiers file")? {
        let d = read_json(&results.join(&name))?;
        let groups = d["groups"].as_array().map_or(0, Vec::len);
        let procs = d["groups"].as_array().into_iter().flatten().map(|g| g["processes"].as_u64().unwrap_or(0)).max().unwrap_or(0);
        let all = |key: &str| d["groups"].as_array().into_iter().flatten().all(|g| g[key] == true);
        let _ = writeln!(
            md,
            "Processes sharing one checkpoint (`bench/results/{name}`, backend `{}` at {} on an {}, {groups} groups of {procs} processes \
             started together on the same {:.2} GiB {} file, medians with [min, max]): serving at the same time for {:.1} s [{:.1}, {:.1}], \
             each holding at most {:.2} GiB beyond the page cache, with file-backed resident memory of at least {:.3} × the file's size \
             (page-cache pages, one copy for all; the count includes the process's libraries), every block served in place: {}, \
             bitwise equal: {}, targets met: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            f(&d["file_bytes"]) / (1u64 << 30) as f64,
            d["model"].as_str().unwrap_or("?"),
            f(&d["serving_together_s"]["median"]),
            f(&d["serving_together_s"]["min"]),
            f(&d["serving_together_s"]["max"]),
            f(&d["host_rss_bytes"]["max"]) / (1u64 << 30) as f64,
            f(&d["file_mapped_share"]["min"]),
            if all("served_in_place") { "yes" } else { "**no**" },
            if all("bitwise_equal") { "yes" } else { "**no**" },
            if d["meets_targets"] == true { "yes" } else { "**no**" },
        );
    }
    // Compressed streaming (`zoo merge-compressed`): raw and coded steps of one process.
    for name in names.iter().filter(|n| n.contains("-compressed-") && n.ends_with(".json")) {
        let d = read_json(&results.join(name))?;
        let sp = |v: &Value| format!("{:.3} [{:.3}, {:.3}]", f(&v["median"]), f(&v["min"]), f(&v["max"]));
        let _ = writeln!(
            md,
            "Compressed streaming (`bench/results/{name}`, backend `{}` at {} on an {}, {} process runs; weights {}): coded size {:.3} × raw (exponent entropy {:.2} bits), host encode {:.2} GB/s on {} threads, device decode {} GB/s{}, pinned bandwidth {:.1} GB/s; targets (a transfer-bound case: coded ÷ bound ≤ 0.78; a compute-bound one: the step the planner chooses within 1.01 × the raw one) met: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            d["process_runs"],
            d["weights"].as_str().unwrap_or("?"),
            f(&d["compression_ratio"]),
            f(&d["exponent_entropy_bits"]),
            f(&d["encode_gbps_host"]),
            d["encode_threads"],
            d["decode_gbps"].as_f64().map_or("–".into(), |g| format!("{g:.0}")),
            match d["decode_gbps_by_mib"].as_array() {
                Some(sizes) if !sizes.is_empty() => {
                    let runs: Vec<String> = sizes.iter().map(|z| format!("{} MiB: {} run(s)", z["mib"], z["runs"])).collect();
                    format!(" (the slowest buffer size; {})", runs.join(", "))
                }
                _ => String::new(),
            },
            f(&d["bandwidth_gbps"]),
            yes(&d["meets_targets"]),
        );
        md.push_str(
            "| case | raw step | resident (s) | streamed raw (s) | streamed coded (s) | uncompressed bound (s) | coded ÷ bound | coded ÷ raw streamed | planner | bitwise equal | targets met |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for c in d["cases"].as_array().into_iter().flatten() {
            let _ = writeln!(
                md,
                "| {} d={} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                row_case(c),
                c["depth"],
                c["raw_step"].as_str().unwrap_or("?"),
                sp(&c["step_resident_s"]),
                sp(&c["step_streamed_raw_s"]),
                sp(&c["step_streamed_compressed_s"]),
                sp(&c["bound_uncompressed_s"]),
                sp(&c["ratio_to_uncompressed_bound"]),
                sp(&c["compressed_over_raw_streamed"]),
                match c["planner_codes"].as_bool() {
                    Some(true) => "codes",
                    Some(false) => "leaves raw",
                    None => "–",
                },
                yes(&c["bitwise_equal"]),
                yes(&c["meets_targets"]),
            );
        }
        md.push('\n');
    }
    // The pipeline case (`zoo merge-pipeline`): per component and whole.
    for name in names.iter().filter(|n| n.contains("-pipeline-") && n.ends_with(".json")) {
        let d = read_json(&results.join(name))?;
        let w = &d["whole"];
        let _ = writeln!(
            md,
            "Pipeline (`bench/results/{name}`, backend `{}` at {}, {} process runs): {}² with {} denoising steps under one device \
             budget of {:.1} GiB (peak {:.2} GiB allocated); whole pass {:.3} s [{:.3}, {:.3}], {:.3} × the sum of its components' \
             bounds, against {:.3} s all resident; targets met: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["repeats"],
            d["case"].as_str().unwrap_or("?"),
            d["steps"],
            d["budget_bytes"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
            d["peak_device_bytes"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
            f(&w["offloaded_s"]),
            f(&w["offloaded_s_min"]),
            f(&w["offloaded_s_max"]),
            f(&w["ratio_to_bound"]),
            f(&w["resident_s"]),
            yes(&d["meets_targets"]),
        );
        md.push_str("| component | model | held | offloaded (s) | bound (s) | resident (s) | bitwise equal |\n| --- | --- | --- | --- | --- | --- | --- |\n");
        for c in d["components"].as_array().into_iter().flatten() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.3} [{:.3}, {:.3}] | {:.3} | {:.3} | {} |",
                c["component"].as_str().unwrap_or("?").replace('_', " "),
                c["model"].as_str().unwrap_or("?"),
                c["mode"].as_str().unwrap_or("?").replace('_', " "),
                f(&c["offloaded_s"]),
                f(&c["offloaded_s_min"]),
                f(&c["offloaded_s_max"]),
                f(&c["bound_s"]),
                f(&c["resident_s"]),
                yes(&c["bitwise_equal"]),
            );
        }
        md.push('\n');
    }
    // The planner under device budgets: every bench-room file with merged budget
    // runs (medians over process runs), else the older one-run planner file.
    let zoo_budgets: Vec<(String, Value)> = names
        .iter()
        .filter(|n| n.contains("-zoo-") && n.ends_with(".json"))
        .filter_map(|n| {
            let d = read_json(&results.join(n)).ok()?;
            let has = d["budgets"].as_array().is_some_and(|b| !b.is_empty());
            has.then(|| (n.clone(), d))
        })
        .collect();
    for (name, d) in &zoo_budgets {
        let backend = d["backend"].as_str().unwrap_or("?");
        let runs: Vec<&Value> = d["budgets"].as_array().into_iter().flatten().collect();
        // One sentence per (model, case): each against its own resident step.
        let mut groups: Vec<(String, String)> = Vec::new();
        for c in &runs {
            let k = (c["model"].as_str().unwrap_or("").to_string(), c["case"].as_str().unwrap_or("").to_string());
            if !groups.contains(&k) {
                groups.push(k);
            }
        }
        for (model, case) in groups {
            let group: Vec<&&Value> = runs.iter().filter(|c| c["model"] == model.as_str() && c["case"] == case.as_str()).collect();
            let errors: Vec<f64> = group.iter().map(|c| f(&c["prediction_error"])).collect();
            let worst = match errors.iter().all(|e| e.is_finite()) {
                true => format!(
                    "the worst step is {:.1} % off the planner's prediction",
                    errors.iter().map(|e| e.abs()).fold(0.0, f64::max) * 100.0
                ),
                false => "a prediction error is missing (not finite) in the file".to_string(),
            };
            let steps: Vec<String> = group
                .iter()
                .map(|c| {
                    let counts: Vec<u64> =
                        c["resident_block_count_per_run"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
                    // Each process planned from its own calibration: where the choices
                    // differ (blocks or depth), the figure is over different plans, said.
                    let same = c["same_choice_every_run"].as_bool() != Some(false);
                    let resident = match (counts.iter().min(), counts.iter().max()) {
                        (Some(a), Some(b)) if a != b => format!("{a}–{b} blocks resident, the choice differing between runs"),
                        _ if !same => format!(
                            "{} blocks resident, the choice (blocks or depth) differing between runs",
                            c["resident_blocks"].as_array().map_or(0, Vec::len)
                        ),
                        _ => format!("{} blocks resident", c["resident_blocks"].as_array().map_or(0, Vec::len)),
                    };
                    // Merged files since the candle budget runs carry each row's
                    // ratio to its bound (a spread); older ones do not.
                    let bound = match c["ratio_to_bound"]["median"].as_f64() {
                        Some(r) => format!(", {r:.3} × its bound"),
                        None => String::new(),
                    };
                    format!(
                        "{:.1} GiB → {:.3} s [{:.3}, {:.3}]{bound} (d={}, {resident}, predicted {:.3} s, {:+.1} %{})",
                        c["budget_bytes"].as_u64().unwrap_or(0) as f64 / (1u64 << 30) as f64,
                        f(&c["step_streamed_s"]),
                        f(&c["step_streamed_s_min"]),
                        f(&c["step_streamed_s_max"]),
                        c["depth"],
                        f(&c["predicted_step_s"]),
                        f(&c["prediction_error"]) * 100.0,
                        match (c["bitwise_equal"] == true, c["weights_within_budget"] == true) {
                            (true, true) => "",
                            (false, _) => "; OUTPUT DIFFERS FROM RESIDENT",
                            (true, false) => "; OVER ITS BUDGET",
                        }
                    )
                })
                .collect();
            let _ = writeln!(
                md,
                "Under a device budget (the planner, `{backend}`, {model} {case}², medians of {} process runs with [min, max]; `bench/results/{name}`): \
                 {}, against {:.3} s all resident; {worst}.\n",
                group.first().map_or(0, |c| c["repeats"].as_u64().unwrap_or(0)),
                steps.join(", "),
                group.first().map_or(f64::NAN, |c| f(&c["step_resident_s"])),
            );
        }
    }
    let planner_file = names.iter().filter(|n| n.contains("planner") && n.ends_with(".json") && n.contains("cuda")).max();
    if let (true, Some(name)) = (zoo_budgets.is_empty(), planner_file) {
        let d = read_json(&results.join(name))?;
        let cases: Vec<&Value> = d["cases"].as_array().into_iter().flatten().filter(|c| c["budget_bytes"].is_u64()).collect();
        let worst = cases.iter().map(|c| (f(&c["step_streamed_s"]) / f(&c["predicted_step_s"]) - 1.0).abs()).fold(0.0, f64::max);
        let steps: Vec<String> = cases
            .iter()
            .map(|c| {
                let bound = f(&c["bound_s"]).max(f(&c["step_resident_s"]));
                format!(
                    "{} GiB → {:.3} s ({:.3} × its bound)",
                    c["budget_bytes"].as_u64().unwrap_or(0) >> 30,
                    f(&c["step_streamed_s"]),
                    f(&c["step_streamed_s"]) / bound
                )
            })
            .collect();
        let _ = writeln!(
            md,
            "Under a device budget (planner, `cuda`, Flux-dev-shaped at 1024², one process run, not yet repeated in the bench room; `bench/results/{name}`): \
             {}, against {:.3} s all resident; every step within {:.2} % of the planner's prediction.\n",
            steps.join(", "),
            cases.first().map_or(f64::NAN, |c| f(&c["step_resident_s"])),
            worst * 100.0
        );
    }
    if let Some(name) = newest_of(names.iter().filter(|n| n.contains("vulkan") && n.ends_with(".json")).cloned(), "Vulkan file")? {
        let d = read_json(&results.join(&name))?;
        let ratios: Vec<f64> = d["cases"].as_array().into_iter().flatten().map(|c| f(&c["ratio_to_bound"])).collect();
        let _ = writeln!(
            md,
            "Vulkan (`bench/results/{name}`, {} process runs{}): pinned bandwidth {:.1} GB/s [{:.1}, {:.1}], {:.3} × cudarc's in the same runs \
             (target 0.9: {}); streamed steps {:.3}–{:.3} × their bound.",
            d["runs"].as_array().map_or(0, Vec::len),
            match d["options"]["split_copy_queues"].as_u64() {
                Some(n) if n > 1 => format!(", each copy split over {n} transfer queues"),
                _ => String::new(),
            },
            f(&d["bandwidth_gbps"]),
            f(&d["bandwidth_gbps_min"]),
            f(&d["bandwidth_gbps_max"]),
            f(&d["bandwidth_ratio_to_cuda"]),
            if d["meets_bandwidth_target"] == true { "met" } else { "missed" },
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max)
        );
    }
    if let Some(py) = python_table(results)? {
        md.push('\n');
        md.push_str(&py);
    }
    if let Some(sweep) = sweep_table(results)? {
        md.push('\n');
        md.push_str(&sweep);
    }
    for table in [train_table(results)?, cache_table(results)?].into_iter().flatten() {
        md.push('\n');
        md.push_str(&table);
    }
    Ok(md)
}

/// The sweep of classes beyond the registry, from the newest `*-sweep.json`
/// (`bench/anchors/sweep_merge.py`): per model its figures over the processes
/// (median [min, max]), the ratio to its bound, diffusers' best offloaded mode,
/// the diagnosis's verdicts and the targets as the merge judged them.
pub fn sweep_table(results: &Path) -> Result<Option<String>, String> {
    let Some(name) = newest(results, "-sweep.json")? else { return Ok(None) };
    let d = read_json(&results.join(&name))?;
    let list = |v: &Value| v.as_array().into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join(", ");
    let mut md = format!(
        "`bench/results/{name}`: the package with defaults (`offload.enable(model, device=\"cuda\")`) on diffusers' and \
         transformers' classes beyond the registry (`bench/anchors/sweep.py`: random bf16 weights at the class's size, built \
         and measured in one process with resident and diffusers' group offloading on the same object) on an {} at commit \
         `{}`; {} process files (raw, in `{}/`: `{}`), each model in 3 of them; each figure the median of the processes' medians \
         with [min, max]; the bound is `max(resident step, streamed bytes ÷ pinned bandwidth probed in the same process)`, \
         the ratio the median of the per-process ratios. *depth*: the depth each process's automatic plan chose, and the \
         blocks it kept resident where it kept any. *verdict*: `Offloaded.diagnose()` on a traced step after the timed \
         ones.\n\n",
        d["gpu"].as_str().unwrap_or("?"),
        d["commit"].as_str().unwrap_or("?"),
        d["processes"],
        d["raw_dir"].as_str().unwrap_or("?"),
        list(&d["raw"])
    );
    md.push_str(
        "| model | class | case | resident (s) | ours (s) | ratio to bound | diffusers' best (s) | ours ÷ diffusers | depth | verdict | bitwise | targets met |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in d["rows"].as_array().into_iter().flatten() {
        // A class that could not be built or measured, or that the package
        // refused in every process (a block layout it does not recognise):
        // a row naming the error, never figures.
        let failure = r["error"].as_str().map(str::to_owned).or_else(|| r["offload_error"].as_str().map(|e| format!("the package: {e}")));
        if let Some(e) = failure.filter(|_| r["offload_s"].is_null()) {
            let _ = writeln!(md, "| {} | – | – | – | – | {e} | – | – | – | – | – | no |", r["model"].as_str().unwrap_or("?"));
            continue;
        }
        let best = match (r["diffusers_best_mode"].as_str(), r["diffusers_best_s"].is_object()) {
            (Some(m), true) => format!("{:.4} ({})", f(&r["diffusers_best_s"]["median"]), m.replace('_', " ")),
            _ => "–".into(),
        };
        let failed: Vec<&str> =
            r["targets"].as_object().into_iter().flatten().filter(|(_, v)| **v == Value::Bool(false)).map(|(k, _)| k.as_str()).collect();
        let _ = writeln!(
            md,
            "| {} | `{}` | {} | {:.4} | {} | {} | {} | {:.3} | {} | {} | {} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["class"].as_str().unwrap_or("?"),
            r["case"].as_str().unwrap_or("?"),
            f(&r["resident_s"]["median"]),
            span(&r["offload_s"], 4),
            span(&r["ratio"], 3),
            best,
            f(&r["ours_over_diffusers"]["median"]),
            plans(r),
            list(&r["verdicts"]).replace("None", "at its bound"),
            yes(&r["bitwise_equal"]),
            if failed.is_empty() { "yes".to_owned() } else { format!("no ({})", failed.join(", ").replace('_', " ")) }
        );
    }
    Ok(Some(md))
}

/// A sweep row's depth cell: the depth its processes chose ("1", or "1, 2, 1"
/// where they differ), then the blocks they kept resident where any kept
/// ("kept 28", or "kept 0, 20, 20"); files merged before the per-process
/// fields existed give the first process's depth.
fn plans(r: &Value) -> String {
    let all = |v: &Value| -> Vec<u64> { v.as_array().into_iter().flatten().filter_map(Value::as_u64).collect() };
    let same = |xs: &[u64]| xs.windows(2).all(|w| w[0] == w[1]);
    let join = |xs: &[u64]| if same(xs) { xs[0].to_string() } else { xs.iter().map(u64::to_string).collect::<Vec<_>>().join(", ") };
    let depths = all(&r["depths"]);
    if depths.is_empty() {
        return r["plan"]["depth"].to_string();
    }
    let kept = all(&r["kept_blocks"]);
    match kept.iter().any(|&k| k > 0) {
        true => format!("{}; kept {}", join(&depths), join(&kept)),
        false => join(&depths),
    }
}

/// `README.md` with its generated block replaced by `tables`.
pub fn splice_readme(readme: &str, tables: &str) -> Result<String, String> {
    let start = readme.find(README_START).ok_or("README.md has no generated block start marker")?;
    let end = readme.find(README_END).ok_or("README.md has no generated block end marker")?;
    if end < start {
        return Err("README.md's generated block markers are out of order".into());
    }
    Ok(format!("{}{README_START}\n\n{tables}\n{}", &readme[..start], &readme[end..]))
}

mod loops;
pub use loops::*;

#[cfg(test)]
mod readme_tests;
