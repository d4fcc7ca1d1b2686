//! A deliberately broken ring must make the case that guards the broken invariant
//! fail: the cases can fail, so their passing means something. (The GPU rows run
//! the same table in the conformance binary: `conformance --sabotage PATH`.)

use offload_core::sabotage::Sabotage;
use offload_tests::cases::all;
use offload_tests::run_sabotage;
use offload_tests::sim_harness::Sim;

#[test]
fn every_breakable_invariant_is_caught() {
    let table = run_sabotage::<Sim>();
    assert_eq!(table.len(), Sabotage::ALL.len());
    for row in &table {
        for (case, why) in &row.by {
            println!("{case} caught {:?}: {why}", row.sabotage);
        }
        assert!(row.caught, "{:?} was not caught (passed: {:?})", row.sabotage, row.missed_by);
        assert!(row.missed_by.is_empty(), "{:?} passed {:?}, which guard it", row.sabotage, row.missed_by);
    }
}

#[test]
fn every_break_is_guarded_by_a_case() {
    for s in Sabotage::ALL {
        assert!(all::<Sim>().iter().any(|c| c.caught.contains(&s)), "no case guards {s:?}");
    }
}

#[test]
fn a_correct_ring_passes_every_case() {
    for case in all::<Sim>() {
        assert_eq!((case.run)(Sabotage::None), Ok(()), "{}", case.name);
    }
}

/// The conformance binary runs each break in a child process: a child that runs
/// past its time is killed and its break counted as not caught (never as caught),
/// and the binary fails; with time enough, every break on sim is caught.
#[test]
fn a_break_whose_process_is_killed_is_not_caught() {
    let exe = env!("CARGO_BIN_EXE_conformance");
    let dir = std::env::temp_dir().join(format!("offload-sabotage-children-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |timeout: &str, json: &std::path::Path| {
        std::process::Command::new(exe)
            .args(["--backend", "sim", "--sabotage"])
            .arg(json)
            .env("OFFLOAD_SABOTAGE_TIMEOUT_S", timeout)
            .output()
            .unwrap()
    };
    let killed = run("0", &dir.join("killed.json"));
    let table: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("killed.json")).unwrap()).unwrap();
    let ok = run("600", &dir.join("ok.json"));
    let caught: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("ok.json")).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!killed.status.success(), "the binary passed with every break's process killed");
    let rows = table["rows"].as_array().unwrap();
    assert_eq!(rows.len(), Sabotage::ALL.len());
    for r in rows {
        assert_eq!(r["caught"], false, "{r}");
        assert!(r["caught_by"][0].as_str().unwrap().contains("killed"), "{r}");
    }
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stdout));
    assert!(caught["rows"].as_array().unwrap().iter().all(|r| r["caught"] == true), "{caught}");
}

/// A break counts as caught only by a case that failed for it: not by a skip,
/// not by a harness that could not build the backend the break needs, and not
/// by a failure of something else.
#[test]
fn a_harness_fault_or_a_skip_does_not_catch_a_break() {
    use offload_core::sabotage::Sabotage::{EarlyRefill, SkipFreeWait, TrustCodedFile};
    use offload_tests::{caught_by, HARNESS_FAULT};
    assert!(caught_by(SkipFreeWait, ["slot 3 overwritten before its last use (invariant 2)"]));
    assert!(!caught_by(SkipFreeWait, ["SKIPPED: n/a: this row copies the file"]));
    let fault = format!("{HARNESS_FAULT} sim: the row builds no backend that refills early");
    assert!(!caught_by(EarlyRefill, [fault.as_str()]));
    assert!(caught_by(EarlyRefill, [fault.as_str(), "d=1 pass 0: result from the disk tier 0x1 differs from the reference 0x2"]));
    assert!(!caught_by(SkipFreeWait, []));
    // Failed for another reason than the break: no catch (the simulator's own
    // decode refusing a forged file before the case's check ran).
    let other = "tensor \"transformer/stack0.1, segment 0\": compressed bytes damaged";
    assert!(!caught_by(TrustCodedFile, [other]));
    assert!(caught_by(TrustCodedFile, [other, "a forged coded file (its hashes rewritten) built a store"]));
}
