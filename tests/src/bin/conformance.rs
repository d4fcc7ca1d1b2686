//! `conformance [--backend sim|cuda|candle|tch|all] [--json PATH] [--sabotage PATH]`:
//! run the conformance suite and print a table of cases × backends; with
//! `--sabotage`, also run every deliberate ring break on every row and write
//! whether each was caught (each break in a child process of its own) (`{"commit", "gpu", "rows": [{"backend", "sabotage", "caught"}]}`;
//! `--commit` and `--gpu` fill those fields).

use offload_core::sabotage::Sabotage;
use offload_tests::{break_in_child, run_sabotage_one, run_suite, BreakRow, SabotageOutcome, Verdict, ROW_MARK};
use std::collections::BTreeMap;

type Row = Vec<(&'static str, &'static str, Verdict)>;

/// What this binary can run on one row: its suite, and one sabotage break.
struct RowFns {
    suite: fn() -> Row,
    sabotage: fn(Sabotage) -> SabotageOutcome,
}

/// The row named `backend`, if it is built into this binary.
fn row(backend: &str) -> Option<RowFns> {
    fn fns<H: offload_tests::Harness>() -> Option<RowFns> {
        Some(RowFns { suite: run_suite::<H>, sabotage: run_sabotage_one::<H> })
    }
    match backend {
        "sim" => fns::<offload_tests::sim_harness::Sim>(),
        "sim-coded" => fns::<offload_tests::sim_harness::SimCoded>(),
        #[cfg(feature = "cuda")]
        "cuda" => fns::<offload_tests::cuda_harness::Cuda>(),
        #[cfg(feature = "cuda")]
        "cuda-coded" => fns::<offload_tests::cuda_harness::CudaCoded>(),
        #[cfg(feature = "cuda")]
        "cuda-relay" => fns::<offload_tests::cuda_harness::CudaRelay>(),
        #[cfg(feature = "candle")]
        "candle" => fns::<offload_tests::candle_harness::Candle>(),
        #[cfg(feature = "candle-cuda")]
        "candle-cuda" => fns::<offload_tests::candle_harness::CandleCuda>(),
        #[cfg(feature = "tch")]
        "tch" => fns::<offload_tests::tch_harness::Tch>(),
        #[cfg(feature = "tch-cuda")]
        "tch-cuda" => fns::<offload_tests::tch_harness::TchCuda>(),
        #[cfg(feature = "vulkan")]
        "vulkan" => fns::<offload_tests::vulkan_harness::Vulkan>(),
        #[cfg(feature = "vulkan")]
        "vulkan-import" => fns::<offload_tests::vulkan_harness::VulkanImport>(),
        #[cfg(feature = "vulkan")]
        "vulkan-split" => fns::<offload_tests::vulkan_harness::VulkanSplit>(),
        _ => None,
    }
}

/// Run every break on every backend, each break in a process of its own, print
/// it, write the JSON; the number of breaks not caught.
fn sabotage_table(backends: &[String], path: &str, commit: &str, gpu: &str) -> usize {
    let mut rows = Vec::new();
    let mut missed = 0;
    println!("{:<14} {:<18} {:<7} by", "backend", "sabotage", "caught");
    for b in backends {
        if row(b).is_none() {
            println!("{b:<14} (not built into this binary)");
            missed += 1;
            continue;
        }
        let exe = match std::env::current_exe() {
            Ok(e) => e,
            Err(e) => {
                println!("{b:<14} (this binary's path: {e})");
                missed += 1;
                continue;
            }
        };
        let table: Vec<BreakRow> = Sabotage::ALL.iter().map(|&s| break_in_child(&exe, b, s)).collect();
        for o in table {
            // A break not caught because its guarding cases skipped is a skip
            // (unless a device is required), judged break by break: the row's
            // other breaks still count.
            // A break whose every guarding case does not apply to the row is n/a,
            // device or not.
            let na = format!("SKIPPED: {}", offload_tests::NOT_APPLICABLE);
            if !o.caught && o.missed_by.is_empty() && !o.by.is_empty() && o.by.iter().all(|(_, w)| w.starts_with(&na)) {
                let (case, why) = &o.by[0];
                println!("{b:<14} {:<18} n/a     {case}: {why}", o.sabotage);
                rows.push(serde_json::json!({
                    "backend": b, "sabotage": o.sabotage, "caught": "n/a",
                    "caught_by": [format!("{case}: {why}")], "passed_anyway": o.missed_by,
                }));
                continue;
            }
            let skipped = o.by.iter().find(|(_, w)| w.starts_with("SKIPPED"));
            if let (false, Some((case, why)), false) = (o.caught, skipped, offload_tests::device_required()) {
                println!("{b:<14} {:<18} skipped {case}: {why}", o.sabotage);
                continue;
            }
            let by: Vec<String> = o.by.iter().map(|(c, w)| format!("{c}: {w}")).collect();
            let note = by.first().cloned().unwrap_or_else(|| "-".into());
            println!("{b:<14} {:<18} {:<7} {note}", o.sabotage, o.caught);
            // A guarding case that passed under the break is a check blind to it,
            // even where another case caught it.
            if !o.caught || !o.missed_by.is_empty() {
                missed += 1;
            }
            rows.push(serde_json::json!({
                "backend": b, "sabotage": o.sabotage, "caught": o.caught,
                "caught_by": by, "passed_anyway": o.missed_by,
            }));
        }
    }
    let doc = serde_json::json!({"commit": commit, "gpu": gpu, "rows": rows});
    if let Err(e) = std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n") {
        eprintln!("writing {path}: {e}");
        missed += 1;
    }
    println!("sabotage: {missed} break(s) not caught (or passed by a case that guards them)");
    missed
}

/// `--sabotage-one BACKEND BREAK`: the child's side of [`break_in_child`].
fn sabotage_child(backend: &str, name: &str) -> ! {
    let Some(&s) = Sabotage::ALL.iter().find(|s| format!("{s:?}") == name) else {
        eprintln!("--sabotage-one: no break named {name}");
        std::process::exit(2);
    };
    let Some(o) = row(backend).map(|r| (r.sabotage)(s)) else {
        eprintln!("--sabotage-one: backend {backend} is not built into this binary");
        std::process::exit(2);
    };
    println!("{ROW_MARK}{}", BreakRow::from(o).to_json());
    let _ = std::io::Write::flush(&mut std::io::stdout());
    std::process::exit(0)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, backend, name] = args.as_slice() {
        if flag == "--sabotage-one" {
            sabotage_child(backend, name);
        }
    }
    let mut backends = vec!["sim".to_owned()];
    let mut json = None;
    let mut sabotage_json = None;
    let mut commit = String::new();
    let mut gpu = "none".to_owned();
    let mut i = 0;
    while i < args.len() {
        match (args[i].as_str(), args.get(i + 1)) {
            ("--backend", Some(b)) if b == "all" => {
                backends = ["sim", "sim-coded", "cuda", "cuda-coded", "candle", "tch", "vulkan", "vulkan-import", "vulkan-split"]
                    .map(String::from)
                    .to_vec()
            }
            ("--backend", Some(b)) => backends = b.split(',').map(String::from).collect(),
            ("--json", Some(p)) => json = Some(p.clone()),
            ("--sabotage", Some(p)) => sabotage_json = Some(p.clone()),
            ("--commit", Some(c)) => commit = c.clone(),
            ("--gpu", Some(g)) => gpu = g.clone(),
            _ => {
                eprintln!(
                    "usage: conformance [--backend sim|cuda|candle|tch|all|a,b] [--json PATH] [--sabotage PATH --commit C --gpu NAME]"
                );
                std::process::exit(2);
            }
        }
        i += 2;
    }
    let mut columns: Vec<(String, Row)> = Vec::new();
    let mut built = Vec::new();
    for b in &backends {
        let ran = row(b).map(|r| (r.suite)());
        built.push(ran.is_some());
        let row = ran.unwrap_or_else(|| {
            let why = format!("backend {b} not built into this binary (build with --features {b})");
            let required = offload_tests::device_required();
            offload_tests::cases::all::<offload_tests::sim_harness::Sim>()
                .into_iter()
                .map(|c| (c.name, c.invariant, if required { Verdict::Fail(why.clone()) } else { Verdict::Skipped(why.clone()) }))
                .collect()
        });
        columns.push((b.clone(), row));
    }
    // Every row any backend ran, in order; a backend without a row shows `n/a`
    // (`skipped` when the backend is not built into this binary).
    let mut names: Vec<(&str, &str)> = Vec::new();
    for (n, inv, _) in columns.iter().flat_map(|(_, r)| r) {
        if !names.iter().any(|(m, _)| m == n) {
            names.push((*n, *inv));
        }
    }
    print!("{:<28} {:>5}", "case", "inv.");
    // Each column as wide as its backend's name (at least a verdict's).
    let widths: Vec<usize> = columns.iter().map(|(b, _)| b.len().max(8)).collect();
    for (b, _) in &columns {
        print!("  {b:<8}");
    }
    println!();
    let mut failed = 0;
    let mut notes = Vec::new();
    let mut out = BTreeMap::new();
    for (name, inv) in &names {
        print!("{name:<28} {inv:>5}");
        for (((b, row), w), built) in columns.iter().zip(&widths).zip(&built) {
            let Some(case) = row.iter().find(|c| c.0 == *name) else {
                let (cell, note) =
                    if *built { ("n/a", "the backend has no such case") } else { ("skipped", "the backend is not built into this binary") };
                print!("  {cell:<w$}");
                out.insert(format!("{b}/{name}"), serde_json::json!({"verdict": cell, "note": note}));
                continue;
            };
            let (cell, note) = match &case.2 {
                Verdict::Pass => ("pass", None),
                Verdict::Fail(m) => {
                    failed += 1;
                    ("FAIL", Some(m.clone()))
                }
                Verdict::Skipped(w) => ("skipped", Some(w.clone())),
            };
            print!("  {cell:<w$}");
            if let Some(n) = note {
                let line = format!("{b}: {n}");
                if !notes.contains(&line) {
                    notes.push(line);
                }
            }
            out.insert(format!("{b}/{name}"), serde_json::json!({"verdict": cell, "note": format!("{:?}", case.2)}));
        }
        println!();
    }
    for n in &notes {
        println!("  {n}");
    }
    let total: usize = columns.iter().map(|(_, r)| r.len()).sum();
    let passed = columns.iter().flat_map(|(_, r)| r).filter(|c| c.2 == Verdict::Pass).count();
    let skipped = total - passed - failed;
    println!("conformance: {passed} passed, {failed} failed, {skipped} skipped");
    if let Some(p) = json {
        let doc = serde_json::json!({"backends": backends, "cases": out, "passed": passed, "failed": failed, "skipped": skipped});
        if let Err(e) = std::fs::write(&p, serde_json::to_string_pretty(&doc).unwrap_or_default()) {
            eprintln!("writing {p}: {e}");
        }
    }
    let missed = sabotage_json.map_or(0, |p| sabotage_table(&backends, &p, &commit, &gpu));
    if failed > 0 || missed > 0 {
        std::process::exit(1);
    }
}
