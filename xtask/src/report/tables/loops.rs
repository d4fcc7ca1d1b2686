//! The tables of the loops users stack on a model: a LoRA training step
//! (`*-train.json`, `bench/anchors/train_merge.py`) and a denoising loop with
//! a cache (`*-cache.json`, `bench/anchors/cache_merge.py`). Every figure is
//! read from the file; the targets are the merge's.

use super::*;

const GIB: f64 = (1u64 << 30) as f64;

/// A mode's figure `key` (a spread: median [min, max]), or the mode's error.
fn mode_span(mode: &Value, key: &str, digits: usize) -> String {
    if mode[key].is_object() {
        span(&mode[key], digits)
    } else if let Some(e) = mode["error"].as_str() {
        format!("error: {}", e.replace('|', "\\|"))
    } else {
        "–".into()
    }
}

/// A row's case, with its card where the file's rows ran on several, and its
/// commit where they ran at several (the merges keep each row to one card and
/// one commit: `bench/anchors/merging.py`).
fn case_on_card(d: &Value, r: &Value) -> String {
    let mut case = r["case"].as_str().unwrap_or("?").to_owned();
    if let (Some(all), Some(own)) = (d["gpu"].as_str(), r["gpu"].as_str()) {
        if all.contains(", ") {
            let _ = write!(case, ", {own}");
        }
    }
    if let (Some(all), Some(own)) = (d["commit"].as_str(), r["commit"].as_str()) {
        if all.contains(", ") {
            let _ = write!(case, ", at `{}`", own.get(..7).unwrap_or(own));
        }
    }
    case
}

/// A spread of bytes as GiB (its median), or "–".
fn gib(v: &Value) -> String {
    if v.is_object() {
        format!("{:.2}", f(&v["median"]) / GIB)
    } else {
        "–".into()
    }
}

/// The targets the merge judged: "yes", or "no (the missed ones)"; "–" where
/// the row has none (a mode failed).
fn targets(row: &Value) -> String {
    let Some(t) = row["targets"].as_object() else { return "–".into() };
    let missed: Vec<&str> = t.iter().filter(|(_, v)| **v == Value::Bool(false)).map(|(k, _)| k.as_str()).collect();
    if missed.is_empty() {
        "yes".into()
    } else {
        format!("**no** ({})", missed.join(", ").replace('_', " "))
    }
}

/// A mode's gradients against the resident step's: bitwise where the
/// resident backward repeats itself, else its largest difference.
fn gradients(row: &Value, mode: &Value) -> String {
    match (row["resident_repeatable"].as_bool(), mode["grads_bitwise_equal"].as_bool()) {
        (Some(true), Some(eq)) => format!("bitwise: {}", if eq { "yes" } else { "**no**" }),
        (Some(false), _) => format!("resident not repeatable; largest difference {:.3e}", f(&mode["max_abs_grad_diff"])),
        _ => "–".into(),
    }
}

fn raw(d: &Value) -> String {
    d["raw"].as_array().into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join(", ")
}

/// The LoRA training step's table, from the newest `*-train.json` in
/// `results`: per model, case and checkpointing, the resident step, the
/// package's and diffusers' block-level offloading's, the ratio to the bound
/// (`max(resident step, bytes crossing the link in a step ÷ bandwidth)`),
/// device memory as weights and activations apart, and the gradients'
/// equality as the merge judged it.
pub fn train_table(results: &Path) -> Result<Option<String>, String> {
    let Some(name) = newest(results, "-train.json")? else { return Ok(None) };
    let d = read_json(&results.join(&name))?;
    // The file's depth (its first process's; "auto": the package's choice).
    let depth = d["depth"].as_str().map_or_else(|| d["depth"].to_string(), str::to_owned);
    let mut md = format!(
        "`bench/results/{name}`: {} on an {} at commit `{}` (torch {}, diffusers {}, peft {}; rank {}, depth {}); {} process \
         files (raw, in `{}/`: `{}`), {} timed steps each; each figure the median of the processes' medians with [min, max]; \
         the bound per process is `max(resident step, bytes the engine copied in the step's two passes ÷ pinned bandwidth \
         probed in the same process)`. Memory: weights on the device (resident: the model's; ours: the engine's peak of \
         streamed weights) and the step's activations (peak allocated above what was allocated before the timed steps), GiB. \
         *verdict*: `Offloaded.diagnose()` of each of ours' passes on a traced step after the timed ones, the verdicts \
         seen over the processes (– where none was traced). *per-pass bound* (where above the bound): the resident step \
         plus each pass's copies not hidden under that pass's own blocks' compute (ours' traced step), what a ring holding \
         only its slots can reach when one pass is copy-bound and the other compute-bound. *ours planned under B GiB*: \
         the package enabled with `budget_gib=B` and the calibration of the ring's traced step (both passes replayed), its \
         weights the slots and the blocks it keeps, its bound counting the bytes it copies.\n\n",
        d["what"].as_str().unwrap_or("a training step"),
        d["gpu"].as_str().unwrap_or("?"),
        d["commit"].as_str().unwrap_or("?"),
        d["torch"].as_str().unwrap_or("?"),
        d["diffusers"].as_str().unwrap_or("?"),
        d["peft"].as_str().unwrap_or("?"),
        d["rank"],
        depth,
        d["processes"],
        d["raw_dir"].as_str().unwrap_or("?"),
        raw(&d),
        d["steps_per_process"],
    );
    md.push_str(
        "| model | case | checkpointing | resident (s) | ours (s) | ratio to bound | verdict: forward / backward | diffusers block-level (s) | weights resident / ours | activations resident / ours | gradients | targets met |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in d["rows"].as_array().into_iter().flatten() {
        let (res, off) = (&r["resident"], &r["offload"]);
        let mut grads = gradients(r, off);
        // The timed steps' losses against the resident steps' (after each optimizer step).
        if let Some(eq) = off["losses_equal_resident"].as_bool() {
            // Judged only where the resident steps repeat themselves.
            let differ = if r["resident_repeatable"] == true { "**differ**" } else { "differ" };
            let _ = write!(grads, "; losses {}", if eq { "equal" } else { differ });
        }
        // Why each of ours' passes was slower than its bound (a traced step per process).
        let pass = |p: &str| {
            let seen: Vec<&str> = r["verdicts"][p].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
            if seen.is_empty() {
                "–".to_owned()
            } else {
                seen.join(", ").replace("None", "at its bound")
            }
        };
        let verdicts = if r["verdicts"].is_object() { format!("{} / {}", pass("forward"), pass("backward")) } else { "–".into() };
        // A mode whose losses stayed the same over its optimizer steps: its updates never reached its forward.
        let mut anchor = mode_span(&r["block_stream"], "step_s", 4);
        if r["block_stream"]["finite_not_constant"] == false {
            anchor.push_str(" (losses constant)");
        }
        let mut ratio = if r["ratio"].is_object() { span(&r["ratio"], 3) } else { "–".into() };
        // Beside it, the ratio to the per-pass bound (each pass's copies not
        // hidden under its own compute added to the resident step), where a
        // pass's copies outlast its compute.
        if r["ratio_to_pass_bound"].is_object() && f(&r["pass_bound_s"]["median"]) > f(&r["bound_s"]["median"]) {
            let _ = write!(ratio, "; {} × the per-pass bound", span(&r["ratio_to_pass_bound"], 3));
        }
        // Every mode of a row ran under one attention backend; torch's default is not named.
        let mut case = match r["attention"].as_str() {
            Some(a) if a != "default" => format!("{}, {a} attention", case_on_card(&d, r)),
            _ => case_on_card(&d, r),
        };
        // A row at another depth than the file's names it, and each process's.
        if let Some(own) = r["depth"].as_str().filter(|own| *own != depth) {
            let ran: Vec<String> = r["depths"].as_array().into_iter().flatten().map(|v| v.to_string()).collect();
            let _ = write!(case, ", depth {own}");
            if !ran.is_empty() && !ran.iter().all(|x| x == own) {
                let _ = write!(case, " ({})", ran.join(", "));
            }
        }
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} | {} |",
            r["model"].as_str().unwrap_or("?"),
            case,
            if r["checkpointing"] == true { "yes" } else { "no" },
            mode_span(res, "step_s", 4),
            mode_span(off, "step_s", 4),
            ratio,
            verdicts,
            anchor,
            gib(&res["weights_bytes"]),
            gib(&off["weights_bytes"]),
            gib(&res["activations_bytes"]),
            gib(&off["activations_bytes"]),
            grads,
            targets(r),
        );
        // The package planned under a device budget (`train_step.py --budget-gib`):
        // a line of its own, its weights the slots and the blocks it kept.
        let planned = &r["planned"];
        if planned.is_object() {
            let p = &r["offload_planned"];
            let kept: Vec<String> = planned["resident_blocks"].as_array().into_iter().flatten().map(|v| v.to_string()).collect();
            let budget: Vec<String> = planned["budget_gib"].as_array().into_iter().flatten().map(|v| format!("{}", f(v))).collect();
            let eq = gradients(r, p);
            let _ = writeln!(
                md,
                "| {} | {case}, ours planned under {} GiB ({} blocks kept) | {} | {} | {} | {} | – | – | {} / {} | {} / {} | {eq} | {} |",
                r["model"].as_str().unwrap_or("?"),
                budget.join(", "),
                kept.join(", "),
                if r["checkpointing"] == true { "yes" } else { "no" },
                mode_span(res, "step_s", 4),
                mode_span(p, "step_s", 4),
                if planned["ratio"].is_object() { span(&planned["ratio"], 3) } else { "–".into() },
                gib(&res["weights_bytes"]),
                gib(&p["weights_bytes"]),
                gib(&res["activations_bytes"]),
                gib(&p["activations_bytes"]),
                targets(planned),
            );
        }
    }
    Ok(Some(md))
}

/// The cached denoising loop's table, from the newest `*-cache.json` in
/// `results`: per model and case, the loop's time resident with the cache,
/// the package's with the same cache, diffusers' block-level offloading's, the
/// steps the cache computed, the bytes the package copied, the ratio to the
/// bound (`max(resident + cache, bytes copied ÷ bandwidth)`), and the
/// equality step by step as the merge judged it.
pub fn cache_table(results: &Path) -> Result<Option<String>, String> {
    let Some(name) = newest(results, "-cache.json")? else { return Ok(None) };
    let d = read_json(&results.join(&name))?;
    let mut md = format!(
        "`bench/results/{name}`: {} on an {} at commit `{}` (torch {}, diffusers {}); {} process files (raw, in `{}/`: \
         `{}`); each figure the median over the processes with [min, max]; the bound per process is `max(resident loop \
         with the cache, bytes the engine copied over the loop ÷ pinned bandwidth probed in the same process)`.\n\n",
        d["what"].as_str().unwrap_or("a cached loop"),
        d["gpu"].as_str().unwrap_or("?"),
        d["commit"].as_str().unwrap_or("?"),
        d["torch"].as_str().unwrap_or("?"),
        d["diffusers"].as_str().unwrap_or("?"),
        d["processes"],
        d["raw_dir"].as_str().unwrap_or("?"),
        raw(&d),
    );
    md.push_str(
        "Ours: the package's defaults (the automatic plan may keep blocks resident where a step is host-bound, as a \
         cached step is); streamed: every block streamed (`auto_resident_gib=0`), the ring's slots alone. Its ratio in \
         parentheses: to each step's own bound summed, `Σ max(resident step, the step's bytes ÷ bandwidth)` (not \
         judged; the loop's bound lets a computed step's copies overlap the cached steps' compute, which a ring of \
         `depth` slots cannot). Warm-up: loops run untimed per mode before the timed one (whole, unless their steps \
         are named). Weights: device memory holding weights (GiB; resident: the model's; ours: the engine's slots \
         and resident blocks, the blocks its automatic plan keeps, and the module's resident parameters).\n\n\
         | model | case | steps (computed) | warm-up | resident + cache (s) | ours + cache (s) | copied (GiB) | \
         ratio to bound | streamed + cache (s) | its ratio (step-wise) | diffusers block-level + cache (s) | \
         weights: resident / ours / streamed | bitwise, same decisions | targets met (ours; streamed) |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in d["rows"].as_array().into_iter().flatten() {
        let (res, off, st) = (&r["resident"], &r["offload"], &r["offload_streamed"]);
        let computed = if res["computed_steps"].is_object() { format!("{:.0}", f(&res["computed_steps"]["median"])) } else { "–".into() };
        let ratio = |row: &Value| if row["ratio"].is_object() { span(&row["ratio"], 3) } else { "–".into() };
        let streamed_ratio = match &r["streamed"]["stepwise_ratio"] {
            w if w.is_object() => format!("{} ({})", ratio(&r["streamed"]), span(w, 3)),
            _ => ratio(&r["streamed"]),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} | {}, {} | {}; {} |",
            r["model"].as_str().unwrap_or("?"),
            case_on_card(&d, r),
            r["steps"],
            computed,
            match (r["warmup"].as_u64(), r["warmup_steps"].as_u64()) {
                (None, _) => "none".to_string(),
                (Some(w), Some(n)) if Some(n) != r["steps"].as_u64() => format!("{w} × {n} steps"),
                (Some(w), _) => w.to_string(),
            },
            mode_span(res, "loop_s", 3),
            mode_span(off, "loop_s", 3),
            gib(&r["bytes_copied"]),
            ratio(r),
            mode_span(st, "loop_s", 3),
            streamed_ratio,
            mode_span(&r["block_stream"], "loop_s", 3),
            gib(&res["weights_bytes"]),
            gib(&off["weights_bytes"]),
            gib(&st["weights_bytes"]),
            yes(&off["bitwise_equal"]),
            yes(&off["same_cache_decisions"]),
            targets(r),
            targets(&r["streamed"]),
        );
    }
    Ok(Some(md))
}

/// The guide pages that carry a loop's table in a generated block of their
/// own (the cache loop's in the Python guide's section on caches, the
/// training step's in the training guide), each with its table: `None` before
/// the table's first results file.
pub fn guide_tables(results: &Path) -> Result<Vec<(&'static str, Option<String>)>, String> {
    Ok(vec![("docs/python.md", cache_table(results)?), ("docs/training.md", train_table(results)?)])
}
