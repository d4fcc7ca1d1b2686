//! The harness's tests: merging process runs, the targets, the files it writes.

use super::*;

fn run(streamed: &[f64], resident: f64, bw: f64) -> RunDoc {
    RunDoc {
        backend: "tch".into(),
        commit: "c".into(),
        largest_block_bytes: 100,
        resident_bytes: 10,
        cases: vec![RunCase {
            model: "m".into(),
            case: "1024".into(),
            depth: 1,
            steps_resident_s: vec![resident; 5],
            steps_streamed_s: streamed.to_vec(),
            streamed_bytes: 2_000_000_000,
            bandwidth_gbps: bw,
            weights_device_bytes: 210,
            bitwise_equal: true,
            output_finite: true,
            output_nonconstant: true,
            ..Default::default()
        }],
        ..Default::default()
    }
}

#[test]
fn rss_is_read_from_proc() {
    // Linux: this test process holds at least a megabyte.
    assert!(host_rss_bytes() > 1 << 20);
}

#[test]
fn spread_is_median_min_max() {
    assert_eq!(spread(&[3.0, 1.0, 2.0]), Some(Spread { median: 2.0, min: 1.0, max: 3.0 }));
    assert_eq!(spread(&[4.0, 1.0, 2.0, 3.0]).map(|s| s.median), Some(2.5));
    assert_eq!(spread(&[]), None);
    assert_eq!(spread(&[1.0, f64::NAN]), None);
}

#[test]
fn output_checks_catch_nan_and_constants() {
    assert_eq!(check_output(&[0.1, -0.2]), (true, true));
    assert_eq!(check_output(&[0.1, f32::NAN]), (false, true));
    assert_eq!(check_output(&[0.5; 4]), (true, false));
    assert_eq!(check_output(&[]), (false, false));
}

#[test]
fn merge_computes_medians_bounds_and_the_comparison() {
    // Bound: max(0.1, 2 GB / 50 GB/s = 0.04) = 0.1 s per run.
    let runs = [run(&[0.11, 0.10, 0.12], 0.1, 50.0), run(&[0.10, 0.10, 0.10], 0.1, 50.0), run(&[0.13, 0.13, 0.13], 0.1, 50.0)];
    let anchor = |mode: &str, s: f64| AnchorCase {
        model: "m".into(),
        case: "1024".into(),
        mode: mode.into(),
        steps_s: vec![s; 3],
        model_bytes: 2_000_000_000,
        output_finite: true,
        output_nonconstant: true,
        ..Default::default()
    };
    let anchors: Vec<AnchorDoc> = (0..3)
        .map(|i| AnchorDoc {
            versions: "v".into(),
            cases: vec![anchor("resident", 0.1), anchor("block_stream", 0.2 + i as f64 * 0.01), anchor("leaf_stream", 0.15)],
            gpu: None,
            kernels_profiled: false,
            boot: None,
        })
        .collect();
    // Anchors of a boot none of the model's runs ran on, or files of which
    // some record the boot and some do not, are refused; the runs' boot is taken.
    let (mut booted, mut theirs) = (runs.clone(), anchors.clone());
    booted.iter_mut().for_each(|r| r.boot = Some("a".into()));
    assert!(merge(&booted, &theirs, 3).unwrap_err().contains("some do not"), "anchors of unknown boot taken");
    theirs.iter_mut().for_each(|a| a.boot = Some("a".into()));
    assert!(merge(&booted, &theirs, 3).is_ok(), "anchors of the runs' boot refused");
    theirs[2].boot = Some("b".into());
    assert!(merge(&booted, &theirs, 3).unwrap_err().contains("an anchor ran on boot b"), "anchors of another boot taken");
    // Runs on two GPUs, anchors on another GPU than ours, or profiled, are refused.
    let mut mixed = runs.clone();
    mixed[1].gpu = "NVIDIA H100 80GB HBM3".into();
    assert!(merge(&mixed, &anchors, 3).unwrap_err().contains("two GPUs"), "an H100 run merged with H200 runs");
    let mut other = anchors.clone();
    other[0].gpu = Some("NVIDIA H100 80GB HBM3".into());
    assert!(merge(&runs, &other, 3).unwrap_err().contains("anchors run on"), "anchors of another GPU taken");
    other[0].gpu = Some(runs[0].gpu.clone());
    assert!(merge(&runs, &other, 3).is_ok(), "anchors of our GPU refused");
    other[1].kernels_profiled = true;
    assert!(merge(&runs, &other, 3).unwrap_err().contains("--kernels"), "a profiled anchor taken");
    // Anchors of another case than ours, or with a broken output, are refused.
    let mut other = anchors.clone();
    other[1].cases[2].tokens = 7;
    assert!(merge(&runs, &other, 3).unwrap_err().contains("diffusers leaf_stream ran"), "another shape taken");
    // A height of 0 is a file from before heights were recorded, on either side.
    other = anchors.clone();
    other[0].cases[2].height = 1024;
    assert!(merge(&runs, &other, 3).is_ok(), "an old run refused beside a newer anchor");
    other = anchors.clone();
    other[0].cases[1].output_finite = false;
    assert!(merge(&runs, &other, 3).unwrap_err().contains("not finite"), "a NaN anchor taken");
    // Their resident step is compared with nothing of ours, and is checked all the same.
    other = anchors.clone();
    other[2].cases[0].output_nonconstant = false;
    assert!(merge(&runs, &other, 3).unwrap_err().contains("anchor m 1024 resident"), "a constant resident anchor taken");
    // Faster only where our slowest process beat their fastest: one leaf-stream
    // process at 0.125 s beat our slowest (0.13 s), so not faster, though our
    // median (0.11 s) is under theirs (0.15 s).
    let mut close = anchors.clone();
    close[2].cases[2].steps_s = vec![0.125; 3];
    assert_eq!(merge(&runs, &close, 3).unwrap()["cases"][0]["faster_than_anchor_best"], false);
    let doc = merge(&runs, &anchors, 3).unwrap();
    let c = &doc["cases"][0];
    assert_eq!(c["repeats"], 3);
    assert!((c["step_streamed_s"].as_f64().unwrap() - 0.11).abs() < 1e-12);
    assert!((c["step_streamed_s_min"].as_f64().unwrap() - 0.10).abs() < 1e-12);
    assert!((c["step_streamed_s_max"].as_f64().unwrap() - 0.13).abs() < 1e-12);
    assert!((c["bound_s"].as_f64().unwrap() - 0.1).abs() < 1e-12);
    assert!((c["ratio_to_bound"].as_f64().unwrap() - 1.1).abs() < 1e-9);
    assert_eq!(c["anchor_best_mode"], "leaf_stream");
    assert_eq!(c["faster_than_anchor_best"], true);
    // 1.1 × its bound misses tch's 1.02.
    assert_eq!(c["meets_targets"], false);
    let block = doc["anchors"].as_array().unwrap().iter().find(|a| a["mode"] == "block_stream").unwrap();
    assert!((block["step_streamed_s"].as_f64().unwrap() - 0.21).abs() < 1e-12);
    assert!((block["ratio_to_bound"].as_f64().unwrap() - 2.1).abs() < 1e-9);
    // The anchor command's run of our own package is no diffusers mode: never
    // the best to beat, and no anchor row, however fast.
    let mut with_ours = anchors.clone();
    for a in &mut with_ours {
        a.cases.push(anchor("offload", 0.05));
    }
    let doc = merge(&runs, &with_ours, 3).unwrap();
    assert_eq!(doc["cases"][0]["anchor_best_mode"], "leaf_stream");
    // Like for like: an anchor that timed another number of steps is refused.
    let mut longer = anchors.clone();
    longer[0].cases[1].steps_s = vec![0.2; 5];
    assert!(merge(&runs, &longer, 3).unwrap_err().contains("timed 5 steps, ours 3"));
    assert!(doc["anchors"].as_array().unwrap().iter().all(|a| a["mode"] != "offload"), "{}", doc["anchors"]);
}

#[test]
fn merge_takes_each_models_sizes_and_refuses_bad_runs() {
    let mut runs: Vec<RunDoc> = (0..3).map(|_| run(&[0.1], 0.1, 50.0)).collect();
    for r in &runs.clone() {
        let mut other = r.clone();
        other.cases[0].model = "big".into();
        other.largest_block_bytes = 1000;
        runs.push(other);
    }
    for r in &mut runs {
        r.backend = "cuda".into();
    }
    let doc = merge(&runs, &[], 3).unwrap();
    let limit = |m: &str| doc["cases"].as_array().unwrap().iter().find(|c| c["model"] == m).unwrap()["weights_device_bytes_limit"].clone();
    assert_eq!(limit("m"), 210);
    assert_eq!(limit("big"), 2010);
    let mut zero = runs.clone();
    zero[0].cases[0].bandwidth_gbps = 0.0;
    assert!(merge(&zero, &[], 3).unwrap_err().contains("GB/s"));
    let empty: Vec<RunDoc> = (0..3).map(|_| RunDoc { backend: "cuda".into(), ..Default::default() }).collect();
    assert_eq!(merge(&empty, &[], 3).unwrap()["meets_targets"], false);
}

#[test]
fn merge_takes_one_commit_per_model() {
    let mut runs = vec![run(&[0.1], 0.1, 50.0), run(&[0.1], 0.1, 50.0), run(&[0.1], 0.1, 50.0)];
    runs[2].commit = "d".into();
    let e = merge(&runs, &[], 3).unwrap_err();
    assert!(e.contains("m: runs of different commits"), "{e}");
    // Another model at another commit: both kept, each case naming its commit.
    let mut other: Vec<RunDoc> = (0..3).map(|_| run(&[0.1], 0.1, 50.0)).collect();
    for r in &mut other {
        r.commit = "d".into();
        r.cases[0].model = "n".into();
    }
    runs[2].commit = "c".into();
    runs.extend(other);
    let doc = merge(&runs, &[], 3).unwrap();
    assert_eq!(doc["commit"], "c, d");
    let commit = |m: &str| doc["cases"].as_array().unwrap().iter().find(|c| c["model"] == m).unwrap()["commit"].clone();
    assert_eq!((commit("m"), commit("n")), ("c".into(), "d".into()));
}

#[test]
fn merge_counts_one_process_once() {
    let mut runs = [run(&[0.1], 0.1, 50.0), run(&[0.11], 0.1, 50.0), run(&[0.12], 0.1, 50.0)];
    for (k, r) in runs.iter_mut().enumerate() {
        (r.pid, r.started_unix_s) = (100 + k as u32, 1e9);
    }
    assert!(merge(&runs, &[], 3).is_ok());
    runs[2] = runs[0].clone();
    assert!(merge(&runs, &[], 3).unwrap_err().contains("runs 1 and 3 are one process's run (pid 100)"));
    runs[2].pid = 102;
    runs[1].warmup = Some(0);
    assert!(merge(&runs, &[], 3).unwrap_err().contains("--warmup 0"));
    // A row whose blocks all fit in its ring's slots never streamed.
    runs[1].warmup = Some(1);
    runs[1].cases[0].blocks = runs[1].cases[0].depth + 1;
    assert!(merge(&runs, &[], 3).unwrap_err().contains("never streamed"));
}

#[test]
fn merge_refuses_too_few_runs() {
    let runs = [run(&[0.1], 0.1, 50.0), run(&[0.1], 0.1, 50.0)];
    let e = merge(&runs, &[], 3).unwrap_err();
    assert!(e.contains("2 process runs, at least 3"), "{e}");
}

#[test]
fn merge_meets_targets_only_when_every_check_holds() {
    let runs = [run(&[0.1], 0.1, 50.0), run(&[0.1], 0.1, 50.0), run(&[0.1], 0.1, 50.0)];
    // No anchor: tch needs one to compare with.
    assert_eq!(merge(&runs, &[], 3).unwrap()["cases"][0]["meets_targets"], false);
    let mut odd = runs.clone();
    odd[1].cases[0].output_finite = false;
    let doc = merge(&odd, &[], 3).unwrap();
    assert_eq!(doc["cases"][0]["output_finite"], false);
    let mut cuda = runs.clone();
    for r in &mut cuda {
        r.backend = "cuda".into();
    }
    assert_eq!(merge(&cuda, &[], 3).unwrap()["cases"][0]["meets_targets"], true);
    // One process's output not bitwise equal, not finite or constant: each alone misses.
    type Flip = fn(&mut RunCase);
    let flips: [(&str, Flip); 3] =
        [("bitwise", |c| c.bitwise_equal = false), ("finite", |c| c.output_finite = false), ("constant", |c| c.output_nonconstant = false)];
    for (what, flip) in flips {
        let mut one = cuda.clone();
        flip(&mut one[1].cases[0]);
        assert_eq!(merge(&one, &[], 3).unwrap()["cases"][0]["meets_targets"], false, "{what}");
    }
    // Weights beyond (d + 1) × largest + resident.
    cuda[0].cases[0].weights_device_bytes = 211;
    assert_eq!(merge(&cuda, &[], 3).unwrap()["cases"][0]["meets_targets"], false);
}
#[test]
fn the_planners_depth_is_the_judged_row_where_there_is_one() {
    // candle: a fixed d=1 row over its bound (0.104 ÷ 0.1), and the planner's
    // d=2 row within it (0.101 ÷ 0.1).
    let mut runs: Vec<RunDoc> = (0..3).map(|_| run(&[0.104], 0.1, 50.0)).collect();
    for r in &mut runs {
        r.backend = "candle".into();
        let mut planned = r.cases[0].clone();
        planned.depth = 2;
        planned.steps_streamed_s = vec![0.101];
        planned.planner_depth =
            Some(PlannerDepth { predicted_step_s: 0.1005, replayed_s_by_depth: vec![0.102, 0.1005, 0.1, 0.1], calibrated_bound_s: 0.1 });
        r.cases.push(planned);
    }
    let doc = merge(&runs, &[], 3).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 2);
    let fixed = cases.iter().find(|c| c["depth_chosen_by"] == "command line").unwrap();
    let planned = cases.iter().find(|c| c["depth_chosen_by"] == "planner").unwrap();
    assert_eq!((fixed["meets_targets"].clone(), fixed["judged"].clone()), (false.into(), false.into()));
    assert_eq!((planned["meets_targets"].clone(), planned["judged"].clone()), (true.into(), true.into()));
    assert_eq!(planned["depth"], 2);
    assert_eq!(planned["planner_predicted_step_s"], 0.1005);
    assert_eq!(doc["meets_targets"], true, "the file's verdict is the judged rows'");
    // The planner's row over its bound fails the file, whatever the fixed rows say.
    for r in &mut runs {
        r.cases[1].steps_streamed_s = vec![0.104];
        r.cases[0].steps_streamed_s = vec![0.1];
    }
    let doc = merge(&runs, &[], 3).unwrap();
    assert_eq!(doc["meets_targets"], false);
    // A fixed row at the planner's depth is a row of its own, reported, not judged.
    let mut same = runs.clone();
    for r in &mut same {
        let mut fixed = r.cases[1].clone();
        fixed.planner_depth = None;
        fixed.steps_streamed_s = vec![0.1];
        r.cases.push(fixed);
    }
    let doc = merge(&same, &[], 3).unwrap();
    let d2: Vec<&Value> = doc["cases"].as_array().unwrap().iter().filter(|c| c["depth"] == 2).collect();
    assert_eq!(d2.len(), 2);
    assert!(d2.iter().any(|c| c["judged"] == false && c["meets_targets"] == true && c["depth_chosen_by"] == "command line"));
    assert!(d2.iter().any(|c| c["judged"] == true && c["meets_targets"] == false && c["depth_chosen_by"] == "planner"));
    assert_eq!(doc["meets_targets"], false);
    // A recorded choice its own replay does not give, or a short replay, is refused.
    let mut wrong = runs.clone();
    wrong[2].cases[1].planner_depth.as_mut().unwrap().replayed_s_by_depth = vec![0.1, 0.1, 0.1, 0.1];
    let e = merge(&wrong, &[], 3).unwrap_err();
    assert!(e.contains("gives d=1"), "{e}");
    wrong[2].cases[1].planner_depth.as_mut().unwrap().replayed_s_by_depth = vec![0.102, 0.1005];
    let e = merge(&wrong, &[], 3).unwrap_err();
    assert!(e.contains("its replay at depths 1 to 4"), "{e}");
    // Without a planner's row every row is judged, as before.
    for r in &mut runs {
        r.cases.truncate(1);
    }
    let doc = merge(&runs, &[], 3).unwrap();
    assert_eq!((doc["cases"][0]["judged"].clone(), doc["meets_targets"].clone()), (true.into(), true.into()));
    // Runs whose planner chose different depths are not one row.
    let mut split = runs.clone();
    for (k, r) in split.iter_mut().enumerate() {
        let mut planned = r.cases[0].clone();
        planned.depth = 1 + k % 2;
        let replay = if planned.depth == 1 { vec![0.1; 4] } else { vec![0.2, 0.1, 0.1, 0.1] };
        planned.planner_depth = Some(PlannerDepth { predicted_step_s: 0.1, replayed_s_by_depth: replay, calibrated_bound_s: 0.1 });
        r.cases.push(planned);
    }
    let e = merge(&split, &[], 3).unwrap_err();
    assert!(e.contains("(the planner's depth)") && e.contains("at least 3"), "{e}");
}
