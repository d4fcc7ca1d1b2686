//! Property tests: random stacks, block sizes, depths, resident sets and request
//! patterns (skips, reorders, repeats) through the simulated backend. On every
//! schedule: no protocol violation (invariants 1, 2), results bitwise equal to the
//! reference (6, 7), device memory within `(d + 1) ×` largest + resident (5), host
//! store unchanged (4).

use offload_core::sim::{SimBackend, SimConfig};
use offload_core::HostBuffer as _;
use offload_core::{resolve, ComponentPlan, HostStore, Plan, Ring};
use offload_tests::model::{block_hash, fold_combine, ModelShape, TestModel, SEED};
use proptest::prelude::*;
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Scenario {
    stacks: Vec<usize>,
    max_bytes: usize,
    depth: usize,
    resident_mask: u64,
    steps: Vec<Vec<usize>>,
    seed: u64,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (prop::collection::vec(1usize..6, 1..4), 1usize..4096, 1usize..5, any::<u64>(), any::<u64>())
        .prop_flat_map(|(stacks, max_bytes, depth, resident_mask, seed)| {
            let n: usize = stacks.iter().sum();
            // Each step: a random sequence of block positions (skips, repeats, reorders).
            let step = prop::collection::vec(0..n, 0..(2 * n + 1));
            (Just(stacks), Just(max_bytes), Just(depth), Just(resident_mask), prop::collection::vec(step, 1..5), Just(seed))
        })
        .prop_map(|(stacks, max_bytes, depth, resident_mask, steps, seed)| Scenario {
            stacks,
            max_bytes,
            depth,
            resident_mask,
            steps,
            seed,
        })
}

fn run(s: &Scenario) -> Result<(), TestCaseError> {
    // Stacks of one block are not discovered as stacks: give each at least two.
    let stacks: Vec<usize> = s.stacks.iter().map(|&n| n.max(2)).collect();
    let shape = ModelShape { stacks, tensors_per_block: 2, min_bytes: 1, max_bytes: s.max_bytes, non_block: 1 };
    let model = TestModel::random(&shape, s.seed);
    let n = model.len();
    let backend = SimBackend::new(SimConfig { max_copy_delay_us: 30, seed: s.seed, ..Default::default() });
    let store = Arc::new(HostStore::build(&backend, &model.inventory, &model.tensors).map_err(|e| TestCaseError::fail(e.to_string()))?);
    let resident: Vec<String> = store
        .blocks()
        .iter()
        .enumerate()
        .filter(|(i, _)| s.resident_mask >> (i % 64) & 1 == 1 && *i % 3 == 0)
        .map(|(_, b)| b.id.to_string())
        .collect();
    let plan = Plan::layerwise()
        .component("transformer", ComponentPlan { prefetch_depth: s.depth, resident_blocks: resident, ..Default::default() });
    let rc = resolve(&plan, std::slice::from_ref(&model.inventory)).map_err(|e| TestCaseError::fail(e.to_string()))?.components.remove(0);
    let mut ring = Ring::new(backend.clone(), store.clone(), &rc).map_err(|e| TestCaseError::fail(e.to_string()))?;
    for order in &s.steps {
        let order: Vec<usize> = order.iter().map(|&b| b % n).collect();
        let mut acc = SEED;
        for &b in &order {
            let g = ring.block_at(b).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let bytes = g.layout().bytes;
            acc = fold_combine(acc, backend.read_slot(g.slot(), |m| block_hash(&m[..bytes])));
        }
        prop_assert_eq!(acc, model.reference(&order), "order {:?}", order);
        ring.end_step().map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    let stats = backend.stats();
    prop_assert!(stats.violations.is_empty(), "{:?}", stats.violations);
    prop_assert!(stats.peak_bytes <= rc.device_weight_bound, "peak {} bound {}", stats.peak_bytes, rc.device_weight_bound);
    ring.close().map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(backend.stats().live_bytes, 0);
    for (i, b) in store.blocks().iter().enumerate() {
        let want = model.block_bytes(i);
        prop_assert_eq!(b.buffer().unwrap().block_bytes().unwrap(), want.as_slice());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn every_schedule_keeps_the_protocol(s in scenario()) {
        run(&s)?;
    }
}
