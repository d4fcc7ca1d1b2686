//! The host tiers' tests: the merge of their runs and its targets.

use super::*;

#[test]
fn a_coded_runs_bound_is_its_link_bytes_at_the_links_rate() {
    // 20 GB a step held coded as 15 GB on the link at 50 GB/s: a 0.3 s bound
    // (over the 0.25 s resident step); a run made before link bytes were
    // recorded divides the raw bytes (0.4 s).
    let r = run(0, 1.0, 1, 0);
    let mut m = r.modes[0].clone();
    m.steps_streamed_s = vec![0.31; 3];
    m.link_bytes = 15_000_000_000;
    let bound = |m: &TierRun| per_run(&[(&r, m)], "coded").unwrap().bounds[0];
    assert!((bound(&m) - 0.3).abs() < 1e-12, "{}", bound(&m));
    m.link_bytes = 0;
    assert!((bound(&m) - 0.4).abs() < 1e-12, "{}", bound(&m));
}

fn run(k: u64, start_mapped: f64, rss_mapped: u64, copied: usize) -> HostTierRun {
    let mode = |mode: &str, start_s: f64, host_rss_bytes: u64, copied_blocks: usize| TierRun {
        mode: mode.into(),
        start_s,
        store_build_s: start_s / 2.0,
        host_rss_bytes,
        mapped_blocks: if mode == "mapped" { 57 - copied_blocks } else { 0 },
        copied_blocks,
        copy_reason: None,
        bandwidth: 50e9,
        // 20 GB a step at 50 GB/s: a 0.4 s bound over a 0.25 s resident step.
        steps_streamed_s: vec![0.404 + k as f64 * 0.001, 0.405, 0.406],
        step_bytes: 20_000_000_000,
        link_bytes: 0,
        bitwise_equal: true,
        output_finite_nonconstant: true,
        host_ram_budget_bytes: None,
        disk_bytes_per_step: 0,
        disk_read_bps: 0.0,
        direct: false,
        disk_blocks: 0,
        first_step_unix_s: 100.0 + k as f64,
        end_unix_s: 110.0 + k as f64,
        host_rss_end_bytes: host_rss_bytes,
        host_rss_file_end_bytes: if mode == "mapped" { 1 } else { 0 },
        coded_blocks: 0,
        host_bytes: 0,
    };
    HostTierRun {
        commit: "abc".into(),
        gpu: "H200".into(),
        model: "flux-dev".into(),
        case: "1024".into(),
        depth: 1,
        file_bytes: 1,
        write_s: 0.0,
        steps_resident_s: vec![0.25, 0.25, 0.25],
        modes: vec![mode("mapped", start_mapped, rss_mapped, copied), mode("copy", 17.0 + k as f64, 22 << 30, 57)],
        group: None,
        pid: 1000 + k as u32,
        coded_file_write_s: 0.0,
        coded_file_bytes: 0,
    }
}

/// Run `k` with a disk mode between the two: 14 GB a step read from a disk
/// probed at 1.2 GB/s (an 11.67 s estimate), the step `step` seconds.
fn disk_run(k: u64, step: f64) -> HostTierRun {
    let mut r = run(k, 1.2, 300 << 20, 0);
    let mut d = r.modes[0].clone();
    d.mode = "disk".into();
    d.steps_streamed_s = vec![step, step];
    d.host_ram_budget_bytes = Some(8 << 30);
    d.disk_bytes_per_step = 14_000_000_000;
    d.disk_read_bps = 1.2e9;
    d.direct = true;
    d.disk_blocks = 36;
    (d.mapped_blocks, d.copied_blocks) = (0, 21);
    r.modes.insert(1, d);
    r
}

/// Runs of different plans are refused, naming the run and each field, in
/// every merge of this file.
#[test]
fn runs_whose_plans_differ_are_refused_by_name() {
    let plan = |k: u64, disk: usize, copied: usize, bytes: u64| {
        let mut r = disk_run(k, 9.4);
        let d = &mut r.modes[1];
        (d.disk_blocks, d.copied_blocks, d.disk_bytes_per_step) = (disk, copied, bytes);
        r
    };
    let runs = [plan(0, 48, 9, 17_557_603_328), plan(1, 34, 23, 17_161_343_488), plan(2, 48, 9, 17_557_603_328)];
    let e = merge(&runs, 3).unwrap_err();
    assert!(e.contains("mode disk") && e.contains("run 2 (pid 1001)") && e.contains("run 1 (pid 1000)"), "{e}");
    assert!(e.contains("copied_blocks 23 against 9") && e.contains("disk_blocks 34 against 48"), "{e}");
    assert!(e.contains("disk_bytes_per_step 17161343488 against 17557603328"), "{e}");
    // One plan: merged, each count once, as every run had it.
    let same = [plan(0, 48, 9, 17_557_603_328), plan(1, 48, 9, 17_557_603_328), plan(2, 48, 9, 17_557_603_328)];
    let c = &merge(&same, 3).unwrap()["cases"][1];
    assert_eq!((c["disk_blocks"].as_u64(), c["copied_blocks"].as_u64()), (Some(48), Some(9)), "{c}");
    // Every field of the plan counts, in every mode: the budget, the bytes
    // streamed, reads through the page cache, a block served in place.
    let differs = |f: &dyn Fn(&mut HostTierRun)| {
        let mut r = same.clone();
        f(&mut r[2]);
        merge(&r, 3).unwrap_err()
    };
    assert!(differs(&|r| r.modes[1].host_ram_budget_bytes = Some(4 << 30)).contains("host_ram_budget_bytes 4294967296 against 8589934592"));
    assert!(differs(&|r| r.modes[1].direct = false).contains("direct false against true"));
    assert!(differs(&|r| r.modes[2].step_bytes = 1).contains("mode copy: run 3 (pid 1002)"));
    assert!(differs(&|r| r.modes[0].mapped_blocks = 56).contains("mode mapped: run 3"));
    // Runs on another GPU or of another checkpoint: refused too.
    assert!(differs(&|r| r.gpu = "H100".into()).contains("run 3 (pid 1002) is abc on H100"));
    assert!(differs(&|r| r.file_bytes = 2).contains("a file of 2 bytes"));
    // The coded start: another number of buffers held coded, other host
    // bytes, another coded file.
    let coded: Vec<HostTierRun> = (0..3).map(|k| coded_run(k, 8.0, 56.0)).collect();
    let coded_differs = |f: &dyn Fn(&mut HostTierRun)| {
        let mut r = coded.clone();
        f(&mut r[1]);
        merge_coded_start(&r, 3).unwrap_err()
    };
    let e = coded_differs(&|r| r.modes[1].coded_blocks = 57);
    assert!(e.contains("mode coded: run 2 (pid 1001)") && e.contains("coded_blocks 57 against 58"), "{e}");
    assert!(coded_differs(&|r| r.modes[0].host_bytes = 1).contains("mode coded-file: run 2 (pid 1001)"));
    assert!(coded_differs(&|r| r.coded_file_bytes = 1).contains("run 2 (pid 1001) one of 1 bytes"));
}

/// The disk runs' step beat `bytes from disk ÷ the probed read rate` (0.80 ×
/// at the minimum): that figure is an estimate, `disk_estimate_s`, and
/// `bound_s` is the link's and the compute's, which no step beats.
#[test]
fn the_disk_modes_bound_is_one_and_its_read_rate_an_estimate() {
    // 9.4 s steps against the 11.67 s estimate: 0.81 × it.
    let d = merge(&[disk_run(0, 9.4), disk_run(1, 9.3), disk_run(2, 9.5)], 3).unwrap();
    let c = &d["cases"][1];
    assert_eq!(c["mode"], "disk");
    let (bound, ratio) = (c["bound_s"]["median"].as_f64().unwrap(), c["ratio_to_bound"]["median"].as_f64().unwrap());
    assert!((bound - 0.4).abs() < 1e-12, "20 GB over 50 GB/s, above the 0.25 s resident step: {c}");
    assert!(c["ratio_to_bound"]["min"].as_f64().unwrap() >= 1.0 && (ratio - 9.4 / 0.4).abs() < 1e-9, "{c}");
    assert!((c["disk_estimate_s"]["median"].as_f64().unwrap() - 14.0 / 1.2).abs() < 1e-9, "{c}");
    assert!((c["ratio_to_disk_estimate"]["median"].as_f64().unwrap() - 9.4 * 1.2 / 14.0).abs() < 1e-9, "{c}");
    // The estimate never falls under the bound, and other modes have none.
    let fast = merge(
        &[disk_run(0, 9.4), disk_run(1, 9.3), disk_run(2, 9.5)].map(|mut r| {
            r.modes[1].disk_read_bps = 1e12;
            r
        }),
        3,
    )
    .unwrap();
    assert!((fast["cases"][1]["disk_estimate_s"]["median"].as_f64().unwrap() - 0.4).abs() < 1e-12);
    assert!(d["cases"][0]["disk_estimate_s"].is_null() && d["cases"][2]["ratio_to_disk_estimate"].is_null());
}

/// Run `k` with the two coded modes: from the file in `file_s`, coded at build in `coded_s`.
fn coded_run(k: u64, file_s: f64, coded_s: f64) -> HostTierRun {
    let mut r = run(k, 1.0, 1 << 30, 0);
    r.modes[0].mode = "coded-file".into();
    r.modes[1].mode = "coded".into();
    for (m, start) in r.modes.iter_mut().zip([file_s, coded_s]) {
        (m.start_s, m.coded_blocks, m.host_bytes) = (start, 58, 15 << 30);
    }
    r.coded_file_write_s = if k == 0 { 40.0 } else { 0.0 };
    r.coded_file_bytes = 15 << 30;
    r
}

#[test]
fn the_coded_start_merge_computes_each_runs_speedup_and_checks_both_modes() {
    let runs: Vec<HostTierRun> = (0..3).map(|k| coded_run(k, 8.0 + k as f64, 56.0 + 2.0 * k as f64)).collect();
    let d = merge_coded_start(&runs, 3).unwrap();
    assert_eq!(d["checks_pass"], true, "{d}");
    // Speedups 7, 58/9 and 60/10 = 6: median 58/9.
    let s = &d["start_speedup"];
    assert!((s["median"].as_f64().unwrap() - 58.0 / 9.0).abs() < 1e-12 && s["min"] == 6.0 && s["max"] == 7.0, "{s}");
    assert_eq!(d["cases"][0]["mode"], "coded-file");
    assert_eq!(d["cases"][0]["start_s"]["median"], 9.0);
    assert_eq!(d["coded_file_write_s"], json!([40.0]), "only the process that wrote it");
    // Too few runs, a missing mode, a run not bitwise, another number of coded buffers.
    assert!(merge_coded_start(&runs[..2], 3).is_err());
    let mut missing = runs.clone();
    missing[1].modes.truncate(1);
    assert!(merge_coded_start(&missing, 3).unwrap_err().contains("no coded mode"));
    let mut wrong = runs.clone();
    wrong[2].modes[0].bitwise_equal = false;
    assert_eq!(merge_coded_start(&wrong, 3).unwrap()["checks_pass"], false);
    // Another number of coded buffers in one run is another plan: refused
    // (`runs_whose_plans_differ_are_refused_by_name`); none coded in every run fails.
    let mut fewer = runs.clone();
    fewer[1].modes[1].coded_blocks = 57;
    assert!(merge_coded_start(&fewer, 3).is_err());
    let mut none = runs.clone();
    for r in &mut none {
        r.modes[1].coded_blocks = 0;
    }
    assert_eq!(merge_coded_start(&none, 3).unwrap()["checks_pass"], false);
}

#[test]
fn the_shared_merge_wants_processes_serving_together_without_private_copies() {
    // Three groups of two processes, the second started 3 s after the first.
    let pair = |g: u64| {
        [0, 3].map(|late| {
            let mut r = run(g, 1.2, 300 << 20, 0);
            r.modes.truncate(1);
            r.group = Some(format!("g{g}"));
            r.pid = 2000 + 10 * g as u32 + late;
            r.file_bytes = 22 << 30;
            r.modes[0].host_rss_file_end_bytes = 22 << 30;
            r.modes[0].first_step_unix_s = 1000.0 * g as f64 + late as f64;
            r.modes[0].end_unix_s = 1000.0 * g as f64 + late as f64 + 10.0;
            r
        })
    };
    let runs: Vec<HostTierRun> = (0..3).flat_map(pair).collect();
    let d = merge_shared(&runs, 3).unwrap();
    assert_eq!(d["meets_targets"], true, "{d}");
    assert_eq!(d["groups"][0]["serving_together_s"], 7.0);
    assert_eq!(d["groups"].as_array().unwrap().len(), 3);
    let c = &d["cases"][0];
    assert_eq!((c["resolution"].as_u64(), c["repeats"].as_u64(), c["processes_at_once"].as_u64()), (Some(1024), Some(6), Some(2)));
    assert!((c["bound_s"]["median"].as_f64().unwrap() - 0.4).abs() < 1e-12, "{c}");
    // Each condition can fail: apart in time, a private copy, the file not
    // mapped, a copied block, a wrong output.
    let broken = |f: &dyn Fn(&mut HostTierRun)| {
        let mut r = runs.clone();
        f(&mut r[1]);
        merge_shared(&r, 3).unwrap()["meets_targets"] == false
    };
    assert!(broken(&|r| r.modes[0].first_step_unix_s += 20.0));
    assert!(broken(&|r| r.modes[0].host_rss_end_bytes = 2 << 30));
    assert!(broken(&|r| r.modes[0].host_rss_file_end_bytes = 1 << 30));
    // A copied block in every process: not served in place. In one process
    // only: another plan than the others', refused by name.
    let mut copied = runs.clone();
    for r in &mut copied {
        (r.modes[0].mapped_blocks, r.modes[0].copied_blocks) = (56, 1);
    }
    assert_eq!(merge_shared(&copied, 3).unwrap()["groups"][0]["served_in_place"], false);
    assert_eq!(merge_shared(&copied, 3).unwrap()["meets_targets"], false);
    let mut one = runs.clone();
    one[3].modes[0].copied_blocks = 1;
    assert!(merge_shared(&one, 3)
        .unwrap_err()
        .contains("run 4 (pid 2013) ran another plan than run 1 (pid 2000): copied_blocks 1 against 0"));
    // Groups of two and of three: `processes_at_once` would be a maximum
    // over them, and the pooled steps a mix. Refused.
    let mut three = runs.clone();
    let mut extra = three[1].clone();
    extra.pid = 2099;
    three.push(extra);
    let e = merge_shared(&three, 3).unwrap_err();
    assert!(e.contains("groups of different sizes") && e.contains("has 3"), "{e}");
    assert!(broken(&|r| r.modes[0].bitwise_equal = false));
    assert!(broken(&|r| r.modes[0].host_rss_bytes = 0), "a failed memory reading is not a pass");
    // One process run given twice in a group, or a run of another case: refused.
    let mut twice = runs.clone();
    twice[1] = twice[0].clone();
    assert!(merge_shared(&twice, 3).unwrap_err().contains("one process run twice"));
    let mut other = runs.clone();
    other[3].case = "2048".into();
    assert!(merge_shared(&other, 3).is_err());
    // Too few groups, a lone process, a run without a group: refused.
    assert!(merge_shared(&runs[..4], 3).is_err());
    assert!(merge_shared(&runs[..5], 2).is_err());
    let mut anon = runs.clone();
    anon[0].group = None;
    assert!(merge_shared(&anon, 3).is_err());
}

#[test]
fn the_merge_computes_bounds_and_judges_each_target() {
    let runs = vec![run(0, 1.2, 300 << 20, 0), run(1, 1.5, 310 << 20, 0), run(2, 1.1, 305 << 20, 0)];
    let d = merge(&runs, 3).unwrap();
    let mapped = &d["cases"][0];
    assert_eq!(mapped["mode"], "mapped");
    assert_eq!(mapped["start_s"]["median"], 1.2);
    assert!((mapped["bound_s"]["median"].as_f64().unwrap() - 0.4).abs() < 1e-12);
    assert!((mapped["ratio_to_bound"]["median"].as_f64().unwrap() - 0.405 / 0.4).abs() < 1e-9);
    assert_eq!(mapped["meets_targets"], true);
    // DESIGN's case fields.
    assert_eq!((mapped["resolution"].as_u64(), mapped["batch"].as_u64(), mapped["depth"].as_u64()), (Some(1024), Some(1), Some(1)));
    assert_eq!(mapped["step_resident_s"]["median"], 0.25);
    assert_eq!(mapped["streamed_bytes"], 20_000_000_000u64);
    assert!(mapped["budget_bytes"].is_null() && mapped["peak_device_bytes"].is_null());
    assert_eq!(d["cases"][1]["start_s"]["median"], 18.0);
    assert_eq!(d["meets_targets"], true);
    assert_eq!(d["disk_read_gbps"], Value::Null, "no disk mode, no disk bandwidth");
    // Each target can fail: a slow start, host memory, a copied block, a wrong output.
    let slow = vec![run(0, 1.2, 300 << 20, 0), run(1, 2.5, 300 << 20, 0), run(2, 1.1, 300 << 20, 0)];
    assert_eq!(merge(&slow, 3).unwrap()["cases"][0]["meets_targets"], false);
    let fat = vec![run(0, 1.2, 2 << 30, 0), run(1, 1.2, 300 << 20, 0), run(2, 1.1, 300 << 20, 0)];
    assert_eq!(merge(&fat, 3).unwrap()["cases"][0]["meets_targets"], false);
    let copied = vec![run(0, 1.2, 300 << 20, 1), run(1, 1.2, 300 << 20, 1), run(2, 1.1, 300 << 20, 1)];
    assert_eq!(merge(&copied, 3).unwrap()["meets_targets"], false);
    let once = vec![run(0, 1.2, 300 << 20, 1), run(1, 1.2, 300 << 20, 0), run(2, 1.1, 300 << 20, 0)];
    assert!(merge(&once, 3).unwrap_err().contains("copied_blocks 0 against 1"), "another plan in one run: refused");
    let mut wrong = runs.clone();
    wrong[1].modes[0].bitwise_equal = false;
    assert_eq!(merge(&wrong, 3).unwrap()["cases"][0]["bitwise_equal"], false);
    // A disk mode: 14 GB a step from a disk read at 1.2 GB/s in 12.5 s (0.933 of
    // the read rate; its estimate is the disk's, 11.67 s, its bound the link's,
    // 0.4 s); at 14 s (0.833) it fails.
    let disk = disk_run;
    let d = merge(&[disk(0, 12.5), disk(1, 12.4), disk(2, 12.6)], 3).unwrap();
    let c = &d["cases"][1];
    assert_eq!(c["mode"], "disk");
    assert!((c["disk_stream_to_read"]["median"].as_f64().unwrap() - 14.0 / 12.5 / 1.2).abs() < 1e-9, "{c}");
    assert!((c["disk_estimate_s"]["median"].as_f64().unwrap() - 14.0 / 1.2).abs() < 1e-9, "{c}");
    assert!((c["bound_s"]["median"].as_f64().unwrap() - 0.4).abs() < 1e-9, "{c}");
    assert!((d["disk_read_gbps"]["median"].as_f64().unwrap() - 1.2).abs() < 1e-12);
    assert_eq!(c["meets_targets"], true);
    assert_eq!(d["meets_targets"], true);
    let slow = merge(&[disk(0, 14.0), disk(1, 14.0), disk(2, 12.5)], 3).unwrap();
    assert_eq!(slow["cases"][1]["meets_targets"], false);
    assert_eq!(slow["meets_targets"], false);
    let mut wrong = vec![disk(0, 12.5), disk(1, 12.5), disk(2, 12.5)];
    wrong[0].modes[1].bitwise_equal = false;
    assert_eq!(merge(&wrong, 3).unwrap()["cases"][1]["meets_targets"], false);
    // Host memory beyond the page cache over the budget plus 1 GiB fails.
    let mut fat = vec![disk(0, 12.5), disk(1, 12.5), disk(2, 12.5)];
    fat[2].modes[1].host_rss_bytes = (9 << 30) + 1;
    assert_eq!(merge(&fat, 3).unwrap()["cases"][1]["meets_targets"], false);
    // Also when it grows during the steps, and when the reading failed (0).
    let mut grew = vec![disk(0, 12.5), disk(1, 12.5), disk(2, 12.5)];
    grew[1].modes[1].host_rss_end_bytes = (9 << 30) + 1;
    assert_eq!(merge(&grew, 3).unwrap()["cases"][1]["meets_targets"], false);
    let mut unread = vec![disk(0, 12.5), disk(1, 12.5), disk(2, 12.5)];
    unread[0].modes[1].host_rss_bytes = 0;
    assert_eq!(merge(&unread, 3).unwrap()["cases"][1]["meets_targets"], false);
    // Fewer than three runs, or runs of two commits, are refused.
    assert!(merge(&runs[..2], 3).is_err());
    let mut mixed = runs.clone();
    mixed[2].commit = "def".into();
    assert!(merge(&mixed, 3).is_err());
}
