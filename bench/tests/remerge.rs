//! The published files that today's merges rebuild from the committed raw runs,
//! byte for byte: a refactor of a merge must leave them so. (The other published
//! files were merged by older code, before fields were added; `bench/remerge.sh`
//! compares every merge before and after a change instead.)

use std::process::Command;

/// `zoo ARGS… --out F` from `bench/raw/` with `BENCH_DATE` set, F's text.
fn merged(date: &str, args: &[&str]) -> String {
    let raw = concat!(env!("CARGO_MANIFEST_DIR"), "/raw");
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
