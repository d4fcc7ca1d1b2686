//! A deliberately broken ring must make the case that guards the broken invariant
//! fail: the cases can fail, so their passing means something.

use offload_core::ring::Sabotage;
use offload_tests::cases::all;
use offload_tests::sim_harness::Sim;
use offload_tests::CaseError;

#[test]
fn every_breakable_invariant_is_caught() {
    let mut caught = Vec::new();
    for case in all::<Sim>() {
        let Some(sabotage) = case.caught else { continue };
        assert_ne!(sabotage, Sabotage::None);
        match (case.run)(sabotage) {
            Err(CaseError::Fail(why)) => caught.push(format!("{} caught {sabotage:?}: {why}", case.name)),
            other => panic!("case {} did not catch {sabotage:?}: {other:?}", case.name),
        }
    }
    for c in &caught {
        println!("{c}");
    }
    assert_eq!(caught.len(), 7);
}

#[test]
fn a_correct_ring_passes_every_case() {
    for case in all::<Sim>() {
        assert_eq!((case.run)(Sabotage::None), Ok(()), "{}", case.name);
    }
}
