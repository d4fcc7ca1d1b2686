//! `zoo run`'s argument checks, before any GPU work: a misspelt, repeated or
//! value-less option is an error naming it, never a default.

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zoo")).arg("run").args(args).output().expect("zoo runs");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_run_arguments_are_named_errors() {
    for (args, says) in [
        (&["--model", "flux-dev", "--budget", "8", "--out", "x"][..], "unexpected argument '--budget'"),
        (&["--model", "flux-dev", "--model", "qwen-image", "--out", "x"][..], "'--model <MODEL>' cannot be used multiple times"),
        (
            &["--backend", "cuda", "--model", "flux-dev", "--trace", "--no-gemm", "--out", "x"][..],
            "a value is required for '--trace <TRACE>'",
        ),
        (
            &["--backend", "tch", "--model", "flux-dev", "--budgets", "8", "--out", "x"][..],
            "--budgets is implemented by the cuda and candle backends only, not by tch",
        ),
        (&["--model", "flux-dev", "--out"][..], "a value is required for '--out <OUT>'"),
        (
            &["--backend", "tch", "--model", "flux-dev", "--high-priority-compute", "--out", "x"][..],
            "--high-priority-compute: cuda's file only",
        ),
        (&["--backend", "tch", "--model", "flux-dev", "--depths", "1,auto", "--out", "x"][..], "--depths auto: only candle's file"),
        (&["--backend", "candle", "--model", "flux-dev", "--depths", "0", "--out", "x"][..], "--depths: \"0\" is neither"),
        (&["--backend", "candle", "--model", "flux-dev", "--depths", ",", "--out", "x"][..], "--depths: no depth given"),
        (&["--backend", "cuda", "--model", "flux-dev", "--high-priority-compute", "--out", "x"][..], "only with --coded"),
    ] {
        let (ok, err) = run(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// Every command refuses an option it does not take (a misspelt
/// `--host-ram-gb` once ran the host tiers without their disk mode), and a
/// count of zero.
#[test]
fn every_command_names_a_misspelt_option_or_a_zero_count() {
    for (args, says) in [
        (
            &["host-tiers", "--model", "flux-dev", "--file", "f", "--out", "x", "--host-ram-gb", "8"][..],
            "unexpected argument '--host-ram-gb'",
        ),
        (&["host-tiers", "--model", "flux-dev", "--file", "f", "--out", "x", "--steps", "0"][..], "\"0\" is not a count of at least 1"),
        (&["relay", "--model", "flux-dev", "--out", "x", "--helper", "1"][..], "unexpected argument '--helper'"),
        (&["merge-relay", "--out", "x", "--anchors", "a.json"][..], "unexpected argument '--anchors'"),
        (&["entropy", "--model", "flux-dev", "--out", "x", "--thread", "2"][..], "unexpected argument '--thread'"),
        (&["registry", "--sizes", "512x512"][..], "unexpected argument '--sizes'"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_zoo")).args(args).output().expect("zoo runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// `zoo merge-host-tiers` refuses runs whose plans differ, and its error names
/// each run's file (the merge itself knows runs only by number and pid).
#[test]
fn a_host_tier_merge_of_differing_plans_names_the_files() {
    use offload_bench::host_tiers::{HostTierRun, TierRun};
    let dir = std::env::temp_dir().join(format!("zoo-cli-host-tiers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let files: Vec<String> = [(48, 9), (34, 23)]
        .iter()
        .enumerate()
        .map(|(k, &(disk_blocks, copied_blocks))| {
            // Runs that would merge but for their plans.
            let mode = |mode: &str| TierRun {
                mode: mode.into(),
                disk_blocks,
                copied_blocks,
                bandwidth: 50e9,
                steps_streamed_s: vec![0.4],
                ..TierRun::default()
            };
            let run = HostTierRun {
                model: "flux-dev".into(),
                case: "1024".into(),
                steps_resident_s: vec![0.25],
                pid: 7 + k as u32,
                modes: vec![mode("mapped"), mode("copy")],
                ..HostTierRun::default()
            };
            let path = dir.join(format!("run{k}.json"));
            std::fs::write(&path, serde_json::to_string(&run).unwrap()).unwrap();
            path.to_string_lossy().into_owned()
        })
        .collect();
    let out = dir.join("merged.json");
    let res = Command::new(env!("CARGO_BIN_EXE_zoo"))
        .args(["merge-host-tiers", "--probe", "--min-repeats", "2", "--out", &out.to_string_lossy(), &files[0], &files[1]])
        .output()
        .expect("zoo runs");
    let err = String::from_utf8_lossy(&res.stderr).into_owned();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!res.status.success(), "{err}");
    assert!(
        err.contains("run 2 (pid 8) ran another plan than run 1 (pid 7): copied_blocks 23 against 9, disk_blocks 34 against 48"),
        "{err}"
    );
    assert!(err.contains(&format!("run 1 is {}, run 2 is {}", files[0], files[1])), "{err}");
    assert!(!out.exists(), "no merged file written");
}

/// `zoo registry --size --batch --frames` writes the user's case into every model
/// that takes it (what the anchors read), and `zoo run` refuses a bad one by name.
#[test]
fn a_users_case_reaches_the_registry_file_and_bad_ones_are_named() {
    let dir = std::env::temp_dir().join(format!("zoo-cli-case-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("registry.json");
    let out = Command::new(env!("CARGO_BIN_EXE_zoo"))
        .args(["registry", "--json", path.to_str().unwrap(), "--size", "1344x768", "--batch", "2"])
        .output()
        .expect("zoo runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let cases = |m: &str| doc.as_array().unwrap().iter().find(|x| x["name"] == m).unwrap()["cases"].as_array().unwrap().clone();
    let flux = cases("flux-dev");
    let c = flux.iter().find(|c| c["name"] == "1344x768 b2 f1").expect("the user's case");
    assert_eq!((c["resolution"].as_u64(), c["height"].as_u64(), c["batch"].as_u64()), (Some(1344), Some(768), Some(2)));
    assert_eq!(c["image_tokens"].as_u64(), Some(48 * 84));
    assert_eq!(flux.len(), 3, "the registry's own cases stay");
    assert!(cases("t5-xxl").iter().all(|c| c["name"] == "512"), "a text encoder takes no image size");
    std::fs::remove_dir_all(&dir).unwrap();
    for (args, says) in [
        (&["--model", "flux-dev", "--size", "1344x760", "--out", "x"][..], "multiples of 16"),
        (&["--model", "flux-dev", "--frames", "9", "--out", "x"][..], "makes images"),
        (&["--model", "flux-dev", "--size", "512x512", "--res", "512", "--out", "x"][..], "give one or the other"),
    ] {
        let (ok, err) = run(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// A merge of fewer than three processes is refused unless asked as a probe,
/// and a probe's file says so (the report refuses to publish it).
#[test]
fn a_merge_of_fewer_than_three_processes_is_a_marked_probe_or_refused() {
    use offload_bench::host_tiers::{HostTierRun, TierRun};
    let dir = std::env::temp_dir().join(format!("offload-zoo-probe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mode = |mode: &str| TierRun { mode: mode.into(), bandwidth: 50e9, steps_streamed_s: vec![0.4], ..TierRun::default() };
    let run = HostTierRun {
        model: "flux-dev".into(),
        case: "1024".into(),
        steps_resident_s: vec![0.25],
        pid: 7,
        modes: vec![mode("mapped"), mode("copy")],
        ..HostTierRun::default()
    };
    let file = dir.join("run1.json");
    std::fs::write(&file, serde_json::to_string(&run).unwrap()).unwrap();
    let out = dir.join("merged.json");
    let zoo = |extra: &[&str]| {
        let mut args = vec!["merge-host-tiers", "--min-repeats", "1", "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        args.push(file.to_str().unwrap());
        Command::new(env!("CARGO_BIN_EXE_zoo")).args(&args).output().expect("zoo runs")
    };
    let refused = zoo(&[]);
    let err = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(!refused.status.success() && err.contains("at least three processes") && err.contains("--probe"), "{err}");
    assert!(!out.exists());
    let probe = zoo(&["--probe"]);
    assert!(probe.status.success(), "{}", String::from_utf8_lossy(&probe.stderr));
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(doc["probe"], true, "{doc}");
    let _ = std::fs::remove_dir_all(&dir);
}
