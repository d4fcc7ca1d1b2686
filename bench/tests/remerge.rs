//! Every published file of the bench room's merges is what today's merges
//! rebuild from the committed raw runs, byte for byte: no figure in one was
//! typed or merged by hand, and a change to a merge that would alter a
//! published figure fails here. (`bench/remerge.sh` also compares every other
//! merge, and the argument errors, before and after a change.)

use std::process::Command;

/// `zoo ARGS… --out F` from `bench/raw/` with `BENCH_DATE` set, F's text.
fn merged(date: &str, args: &[&str]) -> String {
    let raw = offload_bench::raw_dir();
    let out = std::env::temp_dir().join(format!("zoo-remerge-{}-{}.json", std::process::id(), args[0]));
    let res = Command::new(env!("CARGO_BIN_EXE_zoo"))
        .current_dir(raw)
        .env("BENCH_DATE", date)
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("zoo runs");
    assert!(res.status.success(), "{args:?}: {}", String::from_utf8_lossy(&res.stderr));
    let text = std::fs::read_to_string(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    text
}

/// The files of `bench/raw/DIR` whose names match `pattern`, sorted, as paths
/// relative to `bench/raw/` (as the shell's glob in `bench/remerge.sh` gives them).
fn glob(dir: &str, pattern: &str) -> Vec<String> {
    let raw = offload_bench::raw_dir();
    let names: Vec<String> = glob::glob(&format!("{}/{dir}/{pattern}", raw.display()))
        .unwrap()
        .map(|p| format!("{dir}/{}", p.unwrap().file_name().unwrap().to_string_lossy()))
        .collect();
    assert!(!names.is_empty(), "nothing in {dir} matches {pattern}");
    names
}

fn committed(name: &str) -> String {
    std::fs::read_to_string(format!("{}/results/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

#[test]
fn the_pipeline_and_host_tier_files_are_rebuilt_byte_for_byte() {
    let runs = |dir: &str, stem: &str, n: usize| (1..=n).map(|k| format!("{dir}/{stem}{k}.json")).collect::<Vec<_>>();
    let pipeline = runs("2026-11-30-zoo-6bf93c4", "pipeline-run", 3);
    let tiers = runs("2026-12-03-host-tiers-975d863", "host-tiers-run", 3);
    let pairs: Vec<String> =
        (1..=3).flat_map(|k| ["a", "b"].map(|p| format!("2026-12-01-host-tiers-741599f/shared-pair{k}-{p}.json"))).collect();
    for (date, sub, files, name) in [
        ("", "merge-pipeline", &pipeline, "2026-11-30-pipeline-tch.json"),
        ("2026-12-03", "merge-host-tiers", &tiers, "2026-12-03-host-tiers-h200.json"),
        ("2026-12-01", "merge-host-tiers-shared", &pairs, "2026-12-01-host-tiers-shared-h200.json"),
    ] {
        let args: Vec<&str> = std::iter::once(sub).chain(files.iter().map(String::as_str)).collect();
        assert!(merged(date, &args) == committed(name), "{sub} no longer rebuilds {name}");
    }
}

#[test]
fn the_zoo_and_compressed_files_are_rebuilt_byte_for_byte() {
    let z = |commit: &str| format!("2026-11-30-zoo-{commit}");
    let n = "2026-12-02-zoo-56ceb12";
    let all = |parts: &[(String, &str)]| parts.iter().flat_map(|(d, p)| glob(d, p)).collect::<Vec<_>>();
    // tch's runs and the anchors of their commands, model by model (`""`: all in the directory).
    let tch_parts = [
        (z("9c9881b"), "flux-dev"),
        (z("6bf93c4"), "wan"),
        (z("54bafd4"), "qwen-image"),
        (z("54bafd4"), "qwen2.5"),
        (z("54bafd4"), "sd3.5"),
        (n.to_owned(), ""),
    ];
    let of = |who: &str| tch_parts.iter().flat_map(|(d, m)| glob(d, &format!("{who}-{m}*-run*.json"))).collect::<Vec<_>>();
    let (tch, tch_anchors) = (of("tch"), of("diffusers"));
    let candle = all(&[
        (z("07aeb66"), "candle-*-run*.json"),
        (z("6bf93c4"), "candle-qwen2.5*-run*.json"),
        (z("6bf93c4"), "candle-sd3.5*-run*.json"),
        (z("6bf93c4"), "candle-t5*-run*.json"),
        (n.into(), "candle-*-run*.json"),
    ]);
    // candle's flux-dev anchors are the ones run in its own command.
    let candle_anchors = glob(&z("07aeb66"), "diffusers-*-run*.json");
    // The cuda file: the reference model's runs and the anchors of their command.
    let (cuda, cuda_anchors) = (glob(&z("07aeb66"), "cuda-*.json"), glob(&z("07aeb66"), "diffusers-*.json"));
    let c = "2026-12-01-compressed-3980ca5";
    let (coded, codec) = (glob(c, "coded-run*.json"), glob(c, "codec-speed-*.json"));
    let args = |sub: &str, runs: &[String], flag: &str, more: &[String]| -> Vec<String> {
        let head = [sub.to_owned(), "--min-repeats".into(), "3".into()];
        head.into_iter().chain(runs.iter().cloned()).chain(std::iter::once(flag.to_owned())).chain(more.iter().cloned()).collect()
    };
    for (a, name) in [
        (args("merge", &tch, "--anchors", &tch_anchors), "2026-12-02-zoo-tch.json"),
        (args("merge", &candle, "--anchors", &candle_anchors), "2026-12-02-zoo-candle.json"),
        (args("merge", &cuda, "--anchors", &cuda_anchors), "2026-11-30-zoo-cuda.json"),
        (args("merge-compressed", &coded, "--codec", &codec), "2026-12-01-compressed-h200.json"),
    ] {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        assert!(merged("2026-12-01", &a) == committed(name), "{} no longer rebuilds {name}", a[0]);
    }
}
