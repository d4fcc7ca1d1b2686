//! A deliberately broken ring must make the case that guards the broken invariant
//! fail: the cases can fail, so their passing means something. (The GPU rows run
//! the same table in the conformance binary: `conformance --sabotage PATH`.)

use offload_core::ring::Sabotage;
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
