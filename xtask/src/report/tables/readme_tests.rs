//! The generated tables against the committed results and docs.

use super::*;

#[test]
fn the_readme_tables_are_the_generated_ones() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("root");
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let (_, table, cases) = headline(&root.join("bench/results")).expect("headline");
    let want = splice_readme(&readme, &readme_headline(&table)).expect("markers");
    let lines = readme.lines().count();
    assert!(lines <= 100, "README.md is {lines} lines: the front door is one screen; tables beyond the headline go to docs/results.md");
    assert!(readme == want, "README.md's headline differs from `cargo xtask bench --report`'s; run it");
    // Every registry model of the tch file, each with diffusers beside it.
    assert!(cases.len() >= 8 && cases.iter().all(|c| !c.diffusers.is_empty()), "{} cases", cases.len());
    let page = std::fs::read_to_string(root.join("docs/results.md")).expect("docs/results.md");
    let want = splice_readme(&page, &readme_tables(&root.join("bench/results")).expect("tables")).expect("markers");
    assert!(page == want, "docs/results.md's measured tables differ from `cargo xtask bench --report`'s; run it");
    // The guide pages' own tables, where a results file has them.
    for (name, table) in guide_tables(&root.join("bench/results")).expect("guide tables") {
        let Some(table) = table else { continue };
        let page = std::fs::read_to_string(root.join(name)).expect(name);
        assert!(page.contains(README_START), "{name} has no generated block for its measured table");
        assert!(
            page == splice_readme(&page, &table).expect("markers"),
            "{name}'s measured table differs from `cargo xtask bench --report`'s; run it"
        );
    }
}

/// Of two results files of the newest date none is picked by its name's
/// letters (`synced-python-start` after `python-start`): an error naming both.
#[test]
fn two_results_files_of_the_newest_date_are_an_error_not_a_pick() {
    let names = |v: &[&str]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let e = newest_of(names(&["2026-12-05-python-start.json", "2026-12-05-synced-python-start.json"]), "start").unwrap_err();
    assert!(e.contains("`2026-12-05-python-start.json`") && e.contains("superseded"), "{e}");
    let one = newest_of(names(&["2026-12-04-python-start.json", "2026-12-05-synced-python-start.json"]), "start").unwrap();
    assert_eq!(one.as_deref(), Some("2026-12-05-synced-python-start.json"));
    assert_eq!(newest_of(Vec::new(), "start").unwrap(), None);
}

/// A `--probe` merge (fewer than three processes) in bench/results is refused,
/// not published as a figure.
#[test]
fn a_probe_merge_is_not_published() {
    let doc = serde_json::json!({"backend": "tch", "gpu": "NVIDIA H200", "repeats": 1, "cases": [], "probe": true});
    assert!(headline_of("probe", &doc).err().is_some_and(|e| e.contains("--probe merge")), "a probe merge published");
}

/// `headline` over a results folder holding `doc` alone (as `x-zoo-tch.json`).
fn headline_of(tag: &str, doc: &serde_json::Value) -> Result<(String, String, Vec<Headline>), String> {
    let dir = std::env::temp_dir().join(format!("offload-headline-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("x-zoo-tch.json"), doc.to_string()).unwrap();
    let got = headline(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    got
}

/// The headline names the card the file's runs were measured on, and a file
/// that does not say is an error, not "H200" by default.
#[test]
fn the_headline_names_the_files_gpu() {
    let mut doc = serde_json::json!({"backend": "tch", "gpu": "NVIDIA H100 80GB HBM3", "repeats": 3, "cases": []});
    let (_, table, _) = headline_of("gpu", &doc).expect("headline");
    assert!(table.contains("one NVIDIA H100 80GB HBM3, bf16"), "{table}");
    doc.as_object_mut().unwrap().remove("gpu");
    assert!(headline_of("gpu", &doc).err().is_some_and(|e| e.contains("no \"gpu\"")), "a file without its GPU taken");
}

#[test]
fn the_tables_show_every_case_and_anchor_of_a_zoo_file() {
    let dir = std::env::temp_dir().join(format!("offload-zoo-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = serde_json::json!({"backend": "tch", "commit": "c0", "gpu": "G", "date": "d", "repeats": 3,
        "cases": [{"model": "m", "case": "1024", "depth": 1, "step_streamed_s": 0.5, "step_streamed_s_min": 0.4, "step_streamed_s_max": 0.6,
                   "ratio_to_bound": 1.01, "ratio_to_bound_min": 1.0, "ratio_to_bound_max": 1.02, "step_resident_s": 0.2,
                   "anchor_best_mode": "leaf_stream", "anchor_best_step_s": 0.55, "ratio_to_anchor_best": 0.909,
                   "weights_device_bytes": 1u64 << 30, "activations_peak_bytes": 1u64 << 29, "bitwise_equal": true,
                   "output_finite": true, "output_nonconstant": false, "meets_targets": false}],
        "anchors": [{"model": "m", "case": "1024", "mode": "block_stream", "step_streamed_s": 0.7, "step_streamed_s_min": 0.69,
                     "step_streamed_s_max": 0.71, "ratio_to_bound": 1.3, "weights_device_bytes": 1u64 << 31, "activations_peak_bytes": 0}]});
    std::fs::write(dir.join("x-zoo-tch.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    assert!(md.contains("| m | 1024² d=1 | 0.500 [0.400, 0.600] | 1.010 [1.000, 1.020] | 0.200 | 0.550 (leaf stream) | 0.909 | 1.00 | 0.50 | yes | **no** | **no** |"), "{md}");
    assert!(md.contains("| m | 1024² | block stream | 0.700 [0.690, 0.710] | 1.300 | 2.00 | 0.00 |"), "{md}");
    assert!(md.contains("`bench/results/x-zoo-tch.json`"), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
    let spliced = splice_readme(&format!("a\n{README_START}\nold\n{README_END}\nb"), "new\n").unwrap();
    assert_eq!(spliced, format!("a\n{README_START}\n\nnew\n\n{README_END}\nb"));
    assert!(splice_readme("no markers", "x").is_err());
}

#[test]
fn a_planners_depth_row_is_named_and_a_fixed_row_beside_it_not_judged() {
    let dir = std::env::temp_dir().join(format!("offload-zoo-planner-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let row = |depth: u64, by: &str, judged: bool, met: bool| {
        serde_json::json!({"model": "m", "case": "1024", "depth": depth, "depth_chosen_by": by, "judged": judged,
            "step_streamed_s": 0.5, "step_streamed_s_min": 0.5, "step_streamed_s_max": 0.5, "ratio_to_bound": 1.0,
            "ratio_to_bound_min": 1.0, "ratio_to_bound_max": 1.0, "step_resident_s": 0.5, "weights_device_bytes": 1u64 << 30,
            "activations_peak_bytes": 1u64 << 29, "bitwise_equal": true, "output_finite": true, "output_nonconstant": true,
            "meets_targets": met})
    };
    let doc = serde_json::json!({"backend": "candle", "commit": "c0", "gpu": "G", "date": "d", "repeats": 3,
        "cases": [row(1, "command line", false, false), row(2, "planner", true, true)], "anchors": []});
    std::fs::write(dir.join("x-zoo-candle.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    assert!(md.contains("| m | 1024² d=1 | 0.500") && md.contains("| not judged (over; the planner's row is) |"), "{md}");
    assert!(md.contains("| m | 1024² d=2 (the planner's) | 0.500") && md.contains("| yes | yes | yes |"), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_python_row_names_its_depth_and_the_diffusers_modes_that_failed() {
    let dir = std::env::temp_dir().join(format!("offload-python-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let s = |v: f64| serde_json::json!({"median": v, "min": v, "max": v, "n": 3});
    let row = serde_json::json!({"model": "flux-dev-gguf-q4_k", "case": "1024", "commit": "c0", "depth": 2, "superseded_runs": [],
        "offload_s": s(0.2), "ratio_to_bound": s(1.0), "resident_s": s(0.15), "diffusers_s": {}, "vs_diffusers_best": {},
        "weights_device_gib": {"offload": s(0.1)}, "bitwise_equal": true, "host_syncs_in_timed_steps": 0,
        "diffusers_failed": {"block_stream": "RuntimeError: boom", "leaf_stream": "TypeError: no"},
        "targets": {"within_1_02_of_bound": true, "faster_than_diffusers_best": null}});
    // A run planned under a budget, and one whose weights on the device were not measured.
    let mut planned = row.clone();
    planned["model"] = "flux-dev-fp8-linears-budget2.5".into();
    planned["budget_gib"] = 2.5.into();
    planned["resident_blocks"] = serde_json::json!(["a", "b", "c", "d"]);
    let mut unmeasured = row.clone();
    unmeasured["model"] = "flux-dev".into();
    unmeasured["weights_device_gib"]["offload"] = serde_json::Value::Null;
    let doc = serde_json::json!({"commit": "c0", "date": "2026-12-03", "gpu": "NVIDIA H200", "versions": ["v"], "cases": [row, planned, unmeasured]});
    std::fs::write(dir.join("2026-12-03-python-package.json"), doc.to_string()).unwrap();
    let md = python_table(&dir).unwrap().expect("a table");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("| flux-dev-fp8-linears-budget2.5 | 1024 d=2, 2.5 GiB budget, 4 blocks resident |"), "{md}");
    assert!(md.contains("| flux-dev | 1024 d=2 |") && md.contains("| not measured¹ |") && md.contains("\n¹ Runs before"), "{md}");
    assert_eq!(md.matches("| 0.10 |").count(), 2, "the measured rows keep their figure\n{md}");
    assert!(md.contains("| flux-dev-gguf-q4_k | 1024 d=2 |") && md.contains("| failed (below) |"), "{md}");
    assert!(md.contains("flux-dev-gguf-q4_k 1024: diffusers' block stream failed on this model: `RuntimeError: boom`."), "{md}");
    assert!(md.contains("diffusers' leaf stream failed") && md.contains("| no | c0 |"), "no anchor ran: not a met target\n{md}");
}

#[test]
fn a_pipeline_file_becomes_its_sentence_and_table() {
    let dir = std::env::temp_dir().join(format!("offload-pipeline-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let comp = |name: &str, mode: &str, off: f64| {
        serde_json::json!({"component": name, "model": "m", "mode": mode, "offloaded_s": off, "offloaded_s_min": off, "offloaded_s_max": off,
                           "bound_s": off, "resident_s": 0.1, "bitwise_equal": true})
    };
    let doc = serde_json::json!({"backend": "tch", "commit": "c0", "repeats": 3, "case": "1024", "steps": 4, "budget_bytes": 8u64 << 30,
        "peak_device_bytes": 7u64 << 30, "meets_targets": false,
        "whole": {"offloaded_s": 1.5, "offloaded_s_min": 1.4, "offloaded_s_max": 1.6, "ratio_to_bound": 1.05, "resident_s": 0.8},
        "components": [comp("text_encoder", "layerwise", 0.2), comp("transformer", "layerwise+resident", 1.2), comp("vae", "on_demand", 0.1)]});
    std::fs::write(dir.join("x-pipeline-tch.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("`bench/results/x-pipeline-tch.json`") && md.contains("whole pass 1.500 s [1.400, 1.600], 1.050 ×"), "{md}");
    assert!(md.contains("targets met: **no**"), "{md}");
    assert!(md.contains("| vae | m | on demand | 0.100 [0.100, 0.100] | 0.100 | 0.100 | yes |"), "{md}");
}

#[test]
fn a_host_tiers_file_becomes_its_sentence() {
    let dir = std::env::temp_dir().join(format!("offload-host-tiers-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sp = |m: f64| serde_json::json!({"median": m, "min": m - 0.01, "max": m + 0.01});
    let mode = |m: &str, start: f64, rss: f64, ok: bool| {
        serde_json::json!({"mode": m, "start_s": sp(start), "host_rss_bytes": sp(rss), "step_streamed_s": sp(0.43),
            "ratio_to_bound": sp(1.001), "bitwise_equal": true, "meets_targets": ok})
    };
    let doc = serde_json::json!({"backend": "cuda", "commit": "c0", "gpu": "NVIDIA H200", "process_runs": 3, "model": "flux-dev",
        "file_bytes": 23_676_000_000u64, "disk_tier": "not built yet: no disk case",
        "cases": [mode("mapped", 1.2, 0.32 * (1u64 << 30) as f64, true), mode("copy", 16.1, 22.45 * (1u64 << 30) as f64, false)]});
    std::fs::write(dir.join("x-host-tiers-h200.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("`bench/results/x-host-tiers-h200.json`") && md.contains("a 22.05 GiB flux-dev checkpoint"), "{md}");
    assert!(
        md.contains("mapped store: open → first streamed step 1.20 s [1.19, 1.21], host memory beyond the page cache 0.32 GiB"),
        "{md}"
    );
    assert!(md.contains("copy store: open → first streamed step 16.10 s") && md.contains("targets met: **no**"), "{md}");
    assert!(md.contains("Disk tier: not built yet"), "{md}");
    // With a disk case: its budget and rate, and the file's read rate.
    let mut disk = mode("disk", 13.0, 8.4 * (1u64 << 30) as f64, true);
    disk["host_ram_budget_bytes"] = serde_json::json!(8u64 << 30);
    disk["disk_blocks"] = serde_json::json!(36);
    disk["disk_stream_gbps"] = sp(1.15);
    disk["disk_stream_to_read"] = sp(0.95);
    disk["disk_direct"] = serde_json::json!(true);
    let doc = serde_json::json!({"backend": "cuda", "commit": "c1", "gpu": "NVIDIA H200", "process_runs": 3, "model": "flux-dev",
        "file_bytes": 23_676_000_000u64, "disk_read_gbps": sp(1.21), "cases": [disk]});
    let dir = std::env::temp_dir().join(format!("offload-host-tiers-report-disk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("y-host-tiers-h200.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        md.contains("disk store (host RAM budget 8.0 GiB, 36 blocks read from disk at 1.15 GB/s, 0.950 × the file's read rate)"),
        "{md}"
    );
    assert!(
        md.contains("Disk tier: the file read at 1.21 GB/s [1.20, 1.22] in the same runs, bypassing the page cache (O_DIRECT)"),
        "{md}"
    );
    // A file from before the disk estimate had its own name: its ratio is called the estimate, not a bound.
    assert!(md.contains("× the disk estimate (bytes read ÷ the file's read rate: an estimate the steps beat, not a bound)"), "{md}");
    // A newer file: its bound and the estimate beside it.
    let mut disk = doc["cases"][0].clone();
    disk["disk_estimate_s"] = sp(9.0);
    disk["ratio_to_bound"] = sp(21.3);
    disk["ratio_to_disk_estimate"] = sp(0.986);
    let mut newer = doc.clone();
    newer["cases"] = serde_json::json!([disk]);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("y-host-tiers-h200.json"), newer.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("21.300 × its bound, 0.986 × the disk estimate"), "{md}");
    // A shared file beside it: its own sentence, and the tiers' sentence still
    // from the tiers' file (the shared file's name sorts after it).
    let group =
        |g: &str| serde_json::json!({"group": g, "processes": 2, "served_in_place": true, "bitwise_equal": true, "meets_targets": true});
    let shared = serde_json::json!({"backend": "cuda", "commit": "c2", "gpu": "NVIDIA H200", "model": "flux-dev",
        "file_bytes": 23_676_000_000u64, "groups": [group("pair1"), group("pair2"), group("pair3")],
        "serving_together_s": sp(20.0), "host_rss_bytes": sp(0.33 * (1u64 << 30) as f64), "file_mapped_share": sp(1.0),
        "meets_targets": true});
    let dir = std::env::temp_dir().join(format!("offload-host-tiers-report-shared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("y-host-tiers-h200.json"), doc.to_string()).unwrap();
    std::fs::write(dir.join("y-host-tiers-shared-h200.json"), shared.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("Host tiers (`bench/results/y-host-tiers-h200.json`"), "{md}");
    assert!(md.contains("(`bench/results/y-host-tiers-shared-h200.json`, backend `cuda` at c2 on an NVIDIA H200, 3 groups of 2"), "{md}");
    assert!(
        md.contains("serving at the same time for 20.0 s [20.0, 20.0]")
            && md.contains("resident memory of at least 0.990 × the file's size"),
        "{md}"
    );
}

#[test]
fn a_coded_start_file_becomes_its_sentence() {
    let dir = std::env::temp_dir().join(format!("offload-coded-start-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let case = |mode: &str, start: f64| {
        serde_json::json!({"mode": mode, "start_s": {"median": start, "min": start - 1.0, "max": start + 1.0},
            "store_build_s": {"median": start - 0.5}, "coded_blocks": 57, "host_bytes": 16u64 << 30,
            "step_streamed_s": {"median": 0.335}, "bitwise_equal": true})
    };
    let doc = serde_json::json!({"backend": "cuda", "commit": "c3", "gpu": "NVIDIA H200", "process_runs": 3, "model": "flux-dev",
        "file_bytes": 24u64 << 30, "coded_file_bytes": 16u64 << 30, "coded_file_write_s": [41.5],
        "start_speedup": {"median": 6.5, "min": 6.0, "max": 7.0}, "checks_pass": true,
        "cases": [case("coded-file", 9.0), case("coded", 58.0)]});
    std::fs::write(dir.join("z-coded-start-h200.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(md.contains("Coded start (`bench/results/z-coded-start-h200.json`, backend `cuda` at c3"), "{md}");
    assert!(md.contains("from the coded file: open → first streamed step 9.00 s [8.00, 10.00] (store 8.50 s), 57 buffers coded"), "{md}");
    assert!(md.contains("Coded at build ÷ from the file: 6.5 × [6.0, 7.0]; the file written once in 41.5 s; checks pass: yes"), "{md}");
}

/// Each process plans from its own calibration: a budget row whose runs chose
/// differently says so, also where they kept as many blocks (other ones, or
/// another depth), not only where the counts differ.
#[test]
fn a_budget_row_over_different_choices_says_so() {
    let dir = std::env::temp_dir().join(format!("offload-budget-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let row = |gib: u64, counts: [u64; 3], same: bool| {
        serde_json::json!({"model": "flux-dev", "case": "1024", "budget_bytes": gib << 30, "depth": 1,
            "resident_blocks": vec!["b"; counts[0] as usize], "resident_block_count_per_run": counts, "same_choice_every_run": same,
            "step_streamed_s": 0.3, "step_streamed_s_min": 0.29, "step_streamed_s_max": 0.31, "predicted_step_s": 0.3,
            "prediction_error": 0.01, "step_resident_s": 0.2})
    };
    let doc = serde_json::json!({"backend": "cuda", "commit": "c0", "gpu": "NVIDIA H200",
        "budgets": [row(8, [5, 5, 5], true), row(12, [9, 9, 9], false), row(16, [12, 13, 13], false)]});
    std::fs::write(dir.join("y-zoo-cuda.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("8.0 GiB → 0.300 s [0.290, 0.310] (d=1, 5 blocks resident, predicted"), "{md}");
    assert!(md.contains("9 blocks resident, the choice (blocks or depth) differing between runs"), "{md}");
    assert!(md.contains("12–13 blocks resident, the choice differing between runs"), "{md}");
}

#[test]
fn a_compressed_file_becomes_its_sentence_and_table() {
    let dir = std::env::temp_dir().join(format!("offload-compressed-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sp = |m: f64| serde_json::json!({"median": m, "min": m - 0.01, "max": m + 0.01});
    let case = serde_json::json!({"case": "1024", "resolution": 1024, "tokens": 4608, "depth": 1, "raw_step": "transfer-bound",
        "step_resident_s": sp(0.17), "step_streamed_raw_s": sp(0.4), "step_streamed_compressed_s": sp(0.29),
        "bound_uncompressed_s": sp(0.4), "ratio_to_uncompressed_bound": sp(0.725), "compressed_over_raw_streamed": sp(0.725),
        "planner_codes": true, "bitwise_equal": true, "meets_targets": true});
    let doc = serde_json::json!({"backend": "cuda", "commit": "c0", "gpu": "NVIDIA H200", "process_runs": 3, "weights": "normal",
        "compression_ratio": 0.665, "exponent_entropy_bits": 2.55, "encode_gbps_host": 3.1, "encode_threads": 16, "decode_gbps": 512.0,
        "bandwidth_gbps": 55.2, "meets_targets": false, "cases": [case]});
    std::fs::write(dir.join("x-compressed-h200.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("`bench/results/x-compressed-h200.json`") && md.contains("coded size 0.665 × raw"), "{md}");
    assert!(
        md.contains("device decode 512 GB/s")
            && md.contains("compute-bound one: the step the planner chooses within 1.01 × the raw one) met: **no**"),
        "{md}"
    );
    assert!(md.contains("| 1024² d=1 | transfer-bound | 0.170 [0.160, 0.180] | 0.400 [0.390, 0.410] | 0.290 [0.280, 0.300]"), "{md}");
    assert!(md.contains("| 0.725 [0.715, 0.735] | codes | yes | yes |"), "the planner's choice in its column: {md}");
}

#[test]
fn cases_are_named_by_side_tokens_or_name() {
    let c = |case: &str, res: u64, tokens: u64| serde_json::json!({"case": case, "resolution": res, "tokens": tokens});
    assert_eq!(case_label(&c("1024", 1024, 4608)), "1024²");
    assert_eq!(case_label(&c("512", 0, 512)), "512 tokens");
    assert_eq!(case_label(&c("480x832x21", 480, 32760)), "480x832x21");
}

fn spread_of(m: f64) -> serde_json::Value {
    serde_json::json!({"median": m, "min": m - 0.001, "max": m + 0.001, "runs": [m - 0.001, m, m + 0.001]})
}

#[test]
fn a_training_file_becomes_its_table_with_memory_apart_and_the_failed_mode_named() {
    let dir = std::env::temp_dir().join(format!("offload-train-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gib = |g: f64| serde_json::json!({"median": g * (1u64 << 30) as f64, "min": 0, "max": 0});
    let row = |model: &str, repeatable: bool, equal: bool| {
        serde_json::json!({"model": model, "case": "1024", "checkpointing": true, "processes": 3,
            "resident": {"processes": 3, "step_s": spread_of(1.2), "weights_bytes": gib(22.0), "activations_bytes": gib(9.5)},
            "offload": {"processes": 3, "step_s": spread_of(1.25), "weights_bytes": gib(0.7), "activations_bytes": gib(9.6),
                        "grads_bitwise_equal": equal, "max_abs_grad_diff": 0.0, "losses_equal_resident": equal},
            "block_stream": {"processes": 0, "error": "RuntimeError: hooks | not supported"},
            "bound_s": spread_of(1.2), "ratio": spread_of(1.04), "resident_repeatable": repeatable,
            "targets": {"ratio_at_most_1.05": true, "gradients_equal": equal, "finite_not_constant": true}, "targets_met": equal})
    };
    let mut doc = serde_json::json!({"what": "a LoRA training step (bench/anchors/train_step.py)", "date": "2026-12-07", "commit": "c0",
        "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "diffusers": "0.42.1", "peft": "0.21.2", "rank": 16, "depth": 1,
        "steps_per_process": 5, "processes": 3, "raw_dir": "bench/raw/x", "raw": ["a.json", "b.json", "c.json"],
        "rows": [row("flux-dev", true, true), row("wan", false, false), row("qwen", true, true)]});
    // A row run under another attention backend than torch's default says so.
    doc["rows"][1]["attention"] = "math".into();
    // A row at another depth than the file's (the package's own choice) says
    // so, with each process's depth where they differ; one at the file's, not.
    doc["rows"][0]["depth"] = "1".into();
    doc["rows"][2]["depth"] = "auto".into();
    doc["rows"][2]["depths"] = serde_json::json!([4, 4, 3]);
    // The verdicts of ours' traced passes ("None": at its bound); a row with none traced shows "–".
    doc["rows"][0]["verdicts"] = serde_json::json!({"forward": ["late", "link"], "backward": ["None"]});
    // Rows on two kinds of card (each row on one): a row names its card.
    doc["gpu"] = "NVIDIA H100 80GB HBM3, NVIDIA H200".into();
    doc["rows"][2]["gpu"] = "NVIDIA H200".into();
    // Rows at two commits (each row at one): a row names its commit.
    doc["commit"] = "c0, c1abcdef99".into();
    doc["rows"][2]["commit"] = "c1abcdef99".into();
    // A mode whose losses stayed constant over its optimizer steps says so.
    doc["rows"][2]["block_stream"] = serde_json::json!({"processes": 3, "step_s": spread_of(1.3), "finite_not_constant": false});
    // Losses that differ are marked where the resident steps repeat themselves.
    doc["rows"][2]["offload"]["losses_equal_resident"] = false.into();
    // The per-pass bound beside the bound, where it is above it.
    doc["rows"][1]["pass_bound_s"] = spread_of(1.22);
    doc["rows"][1]["ratio_to_pass_bound"] = spread_of(1.025);
    // The package planned under a budget: a line of its own.
    doc["rows"][0]["planned"] = serde_json::json!({"budget_gib": [10.0], "resident_blocks": [17, 17, 16], "ratio": spread_of(1.02),
        "targets": {"ratio_at_most_1.05": true, "weights_within_budget": true}, "targets_met": true});
    doc["rows"][0]["offload_planned"] = serde_json::json!({"processes": 3, "step_s": spread_of(1.22), "weights_bytes": gib(9.5),
        "activations_bytes": gib(9.6), "grads_bitwise_equal": true});
    std::fs::write(dir.join("2026-12-07-train.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("`bench/results/2026-12-07-train.json`: a LoRA training step") && md.contains("NVIDIA H100"), "{md}");
    assert!(
        md.contains(
            "| flux-dev | 1024 | yes | 1.2000 [1.1990, 1.2010] | 1.2500 [1.2490, 1.2510] | 1.040 [1.039, 1.041] | \
             late, link / at its bound | error: RuntimeError: hooks \\| not supported | 22.00 / 0.70 | 9.50 / 9.60 | bitwise: yes; losses equal | yes |"
        ),
        "{md}"
    );
    assert!(
        md.contains("depth 1); 3 process") && md.contains("| qwen | 1024, NVIDIA H200, at `c1abcde`, depth auto (4, 4, 3) | yes |"),
        "{md}"
    );
    assert!(
        md.contains("| 1.040 [1.039, 1.041] | – | 1.3000 [1.2990, 1.3010] (losses constant) |")
            && md.contains("bitwise: yes; losses **differ** | yes |")
            && md.contains("largest difference 0.000e0; losses differ |"),
        "{md}"
    );
    assert!(md.contains("| 1.040 [1.039, 1.041]; 1.025 [1.024, 1.026] × the per-pass bound | – |"), "{md}");
    assert!(
        md.contains(
            "| flux-dev | 1024, ours planned under 10 GiB (17, 17, 16 blocks kept) | yes | 1.2000 [1.1990, 1.2010] | \
             1.2200 [1.2190, 1.2210] | 1.020 [1.019, 1.021] | – | – | 22.00 / 9.50 | 9.50 / 9.60 | bitwise: yes | yes |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| wan | 1024, math attention | yes |")
            && md.contains("resident not repeatable")
            && md.contains("**no** (gradients equal)"),
        "{md}"
    );
}

#[test]
fn a_cache_loop_file_becomes_its_table() {
    let dir = std::env::temp_dir().join(format!("offload-cache-report-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = serde_json::json!({"what": "a denoising loop with FirstBlockCache (bench/anchors/cache_loop.py)", "date": "2026-12-07",
        "commit": "c0", "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "diffusers": "0.42.1", "processes": 3,
        "raw_dir": "bench/raw/x", "raw": ["a.json"],
        "rows": [{"model": "flux-dev", "case": "1024", "processes": 3, "steps": 28, "threshold": 0.05, "warmup": 1, "warmup_steps": 28,
            "resident": {"processes": 3, "loop_s": spread_of(0.9), "computed_steps": spread_of(9.0)},
            "offload": {"processes": 3, "loop_s": spread_of(1.1), "bitwise_equal": true, "same_cache_decisions": true,
                "weights_bytes": spread_of(20.0 * (1u64 << 30) as f64)},
            "offload_streamed": {"processes": 3, "loop_s": spread_of(1.6), "weights_bytes": spread_of(1.5 * (1u64 << 30) as f64)},
            "block_stream": {"processes": 3, "loop_s": spread_of(2.5)},
            "bytes_copied": {"median": 32.0 * (1u64 << 30) as f64, "min": 0, "max": 0},
            "bound_s": spread_of(1.05), "ratio": spread_of(1.048),
            "targets": {"ratio_at_most_1.05": true, "bitwise_equal": true, "same_cache_decisions": true, "finite_not_constant": true},
            "targets_met": true,
            "streamed": {"ratio": spread_of(1.2), "stepwise_ratio": spread_of(1.01),
                "targets": {"ratio_at_most_1.05": false, "bitwise_equal": true}}}]});
    std::fs::write(dir.join("2026-12-07-cache.json"), doc.to_string()).unwrap();
    let md = readme_tables(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(md.contains("`bench/results/2026-12-07-cache.json`: a denoising loop with FirstBlockCache"), "{md}");
    assert!(
        md.contains(
            "| flux-dev | 1024 | 28 (9) | 1 | 0.900 [0.899, 0.901] | 1.100 [1.099, 1.101] | 32.00 | 1.048 [1.047, 1.049] | \
             1.600 [1.599, 1.601] | 1.200 [1.199, 1.201] (1.010 [1.009, 1.011]) | 2.500 [2.499, 2.501] | – / 20.00 / 1.50 | yes, yes | \
             yes; **no** (ratio at most 1.05) |"
        ),
        "{md}"
    );
}

#[test]
fn a_sweep_rows_depth_cell_names_each_processs_depth_and_kept_blocks() {
    let row = |depths: serde_json::Value, kept: serde_json::Value| serde_json::json!({"plan": {"depth": 1}, "depths": depths, "kept_blocks": kept});
    assert_eq!(plans(&row(serde_json::json!([1, 1, 1]), serde_json::json!([0, 0, 0]))), "1");
    assert_eq!(plans(&row(serde_json::json!([1, 2, 1]), serde_json::json!([0, 0, 0]))), "1, 2, 1");
    assert_eq!(plans(&row(serde_json::json!([1, 1, 1]), serde_json::json!([28, 28, 28]))), "1; kept 28");
    assert_eq!(plans(&row(serde_json::json!([1, 1, 1]), serde_json::json!([0, 20, 20]))), "1; kept 0, 20, 20");
    // A file merged before the per-process fields: the first process's depth.
    assert_eq!(plans(&serde_json::json!({"plan": {"depth": 2}})), "2");
}

#[test]
fn a_probe_sweep_is_not_published() {
    let dir = std::env::temp_dir().join(format!("offload-sweep-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = serde_json::json!({"what": "the sweep", "probe": true, "probe_args": {"depth": 3}, "rows": []});
    std::fs::write(dir.join("2026-12-07-python-sweep.json"), doc.to_string()).unwrap();
    let e = sweep_table(&dir).err();
    let _ = std::fs::remove_dir_all(&dir);
    // Refused as every results file marked a probe is (`read_json`).
    assert!(e.as_ref().is_some_and(|e| e.contains("--probe merge")), "a probe sweep published: {e:?}");
}

#[test]
fn a_sweep_row_the_package_refused_names_its_error_and_fails() {
    let dir = std::env::temp_dir().join(format!("offload-sweep-refused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let doc = serde_json::json!({"what": "the sweep", "gpu": "G", "commit": "c", "processes": 3, "raw_dir": "r", "raw": ["a.json"],
        "rows": [
            {"model": "odd-unet", "processes": 3, "class": "OddUNet", "case": "1024²", "resident_s": {"median": 0.1, "min": 0.1, "max": 0.1},
             "offload_error": "OffloadError: component 'OddUNet': OddUNet has no block list (no ModuleList of two or more blocks)"},
            {"model": "broken", "processes": 3, "error": "RuntimeError: CUDA out of memory"}]});
    std::fs::write(dir.join("2026-12-07-python-sweep.json"), doc.to_string()).unwrap();
    let md = sweep_table(&dir).unwrap().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        md.contains("| odd-unet | – | – | – | – | the package: OffloadError: component 'OddUNet': OddUNet has no block list (no ModuleList of two or more blocks) | – | – | – | – | – | no |"),
        "{md}"
    );
    assert!(md.contains("| broken | – | – | – | – | RuntimeError: CUDA out of memory | – | – | – | – | – | no |"), "{md}");
}
