//! Soundness of the ring where user code holds the block: a forgotten guard
//! (`mem::forget`) is released by the ring itself, and a release whose timeline
//! event fails still records the slot's release event. Both are checked on the
//! simulated device, whose violation log sees any copy into a slot not ordered
//! after its last read.

use offload_core::sim::{SimBackend, SimConfig};
use offload_core::{resolve, FaultInjector, FaultKind, HostStore, Plan, Ring};
use offload_tests::model::{block_hash, fold_combine, ModelShape, TestModel, SEED};
use std::sync::Arc;

fn setup(seed: u64) -> (SimBackend, TestModel, Arc<HostStore<SimBackend>>) {
    let sim = SimBackend::new(SimConfig { max_copy_delay_us: 50, seed, ..Default::default() });
    let model =
        TestModel::random(&ModelShape { stacks: vec![6], tensors_per_block: 2, min_bytes: 256, max_bytes: 4096, non_block: 0 }, seed);
    let store = Arc::new(HostStore::build(&sim, &model.inventory, &model.tensors).expect("store"));
    (sim, model, store)
}

/// Where the forgotten guard is noticed.
#[derive(Clone, Copy, Debug)]
enum Then {
    NextBlock,
    EndStep,
    Close,
}

fn forget_one(then: Then, depth: usize) {
    let (sim, model, store) = setup(7 + depth as u64);
    let plan = resolve(&Plan::layerwise().prefetch_depth(depth), std::slice::from_ref(&model.inventory)).expect("plan");
    let mut ring = Ring::new(sim.clone(), store, &plan.components[0]).expect("ring");
    let order: Vec<usize> = (0..model.len()).collect();
    let mut forgotten = 0;
    for step in 0..3 {
        let mut acc = SEED;
        for &b in &order {
            let g = ring.block_at(b).expect("block");
            let bytes = g.layout().bytes;
            acc = fold_combine(acc, sim.read_slot(g.slot(), |m| block_hash(&m[..bytes])));
            let last = b + 1 == order.len();
            match then {
                Then::NextBlock if b == 2 => {
                    std::mem::forget(g);
                    forgotten += 1;
                }
                Then::EndStep | Then::Close if last => {
                    std::mem::forget(g);
                    forgotten += 1;
                }
                _ => g.finish().expect("release"),
            }
        }
        assert_eq!(acc, model.reference(&order), "{then:?} d={depth} step {step}: wrong result");
        sim.check().unwrap_or_else(|e| panic!("{then:?} d={depth} step {step}: {e}"));
        if matches!(then, Then::Close) && step == 2 {
            break;
        }
        let m = ring.end_step().expect("end step");
        assert_eq!(m.forgotten_guards, 1, "{then:?} d={depth} step {step}: {m}");
    }
    ring.close().expect("close");
    assert_eq!(forgotten, 3);
    sim.check().unwrap_or_else(|e| panic!("{then:?} d={depth}: {e}"));
}

#[test]
fn a_forgotten_guard_is_released_at_the_next_block() {
    for d in [1, 2, 3] {
        forget_one(Then::NextBlock, d);
    }
}

#[test]
fn a_forgotten_guard_is_released_at_end_step() {
    for d in [1, 2] {
        forget_one(Then::EndStep, d);
    }
}

#[test]
fn a_forgotten_guard_is_released_at_close() {
    for d in [1, 2] {
        forget_one(Then::Close, d);
    }
}

/// Fail the n-th timeline event, for every n that lands in a step: whatever
/// call fails, the slot's release is still recorded (no violation afterwards)
/// and a later step gives the right result.
#[test]
fn a_failing_timeline_event_still_records_the_release() {
    let mut release_errors = 0;
    for n in 0..40 {
        let (sim, model, _) = setup(100 + n);
        let fi = FaultInjector::new(sim.clone());
        let store = Arc::new(HostStore::build(&fi, &model.inventory, &model.tensors).expect("store"));
        let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&model.inventory)).expect("plan");
        let mut ring = Ring::new(fi.clone(), store, &plan.components[0]).expect("ring");
        ring.enable_timeline().expect("timeline");
        let order: Vec<usize> = (0..model.len()).collect();
        fi.arm(FaultKind::Timing, n);
        for _ in 0..2 {
            for &b in &order {
                let Ok(g) = ring.block_at(b) else { continue };
                let bytes = g.layout().bytes;
                sim.read_slot(g.slot(), |m| block_hash(&m[..bytes]));
                if g.finish().is_err() {
                    release_errors += 1;
                }
            }
            let _ = ring.end_step();
        }
        fi.disarm();
        let mut acc = SEED;
        for &b in &order {
            let g = ring.block_at(b).expect("block after the fault");
            let bytes = g.layout().bytes;
            acc = fold_combine(acc, sim.read_slot(g.slot(), |m| block_hash(&m[..bytes])));
            g.finish().expect("release after the fault");
        }
        assert_eq!(acc, model.reference(&order), "timing fault #{n}: wrong result afterwards");
        ring.close().expect("close");
        sim.check().unwrap_or_else(|e| panic!("timing fault #{n}: {e}"));
    }
    assert!(release_errors > 0, "no fault landed in a release");
}

/// A binding's lend and give-back (the Python package's hooks): the right bytes
/// lent, every slot reuse ordered after the lent block's reads, no forgotten
/// guard when each block is given back; a block lent and never given back is
/// released at the next lend and counted, as a forgotten guard is.
#[test]
fn lent_blocks_are_ordered_and_a_block_never_given_back_is_counted() {
    for depth in [1, 2] {
        let (sim, model, store) = setup(40 + depth as u64);
        let plan = resolve(&Plan::layerwise().prefetch_depth(depth), std::slice::from_ref(&model.inventory)).expect("plan");
        let mut ring = Ring::new(sim.clone(), store, &plan.components[0]).expect("ring");
        let stack = model.inventory.stacks[0].name.clone();
        let order: Vec<usize> = (0..model.len()).collect();
        for step in 0..3 {
            let mut acc = SEED;
            for &b in &order {
                ring.lend(&stack, b).expect("lend");
                let (id, layout, slot) = ring.lent().expect("a lent block");
                assert_eq!(id.index, b);
                acc = fold_combine(acc, sim.read_slot(slot, |m| block_hash(&m[..layout.bytes])));
                if !(step == 1 && b == 2) {
                    ring.give_back().expect("give back");
                    assert!(ring.lent().is_none());
                }
            }
            assert_eq!(acc, model.reference(&order), "d={depth} step {step}: wrong result");
            sim.check().unwrap_or_else(|e| panic!("d={depth} step {step}: {e}"));
            let m = ring.end_step().expect("end step");
            assert_eq!(m.forgotten_guards, u64::from(step == 1), "d={depth} step {step}: {m}");
        }
        ring.give_back().expect("nothing lent: a no-op");
        assert!(ring.lend(&stack, model.len()).is_err(), "a block past the stack is an error");
        ring.close().expect("close");
        sim.check().unwrap_or_else(|e| panic!("d={depth}: {e}"));
    }
}

/// Blocks a binding keeps on the device for good (the Python package's
/// automatic plan, for a host-bound step): lent with `lend_to_keep` between
/// steps, then held outside. The next steps lend only the streamed blocks, each
/// copied ahead (no miss), with the right bytes, and from the second on copy
/// each streamed block once and no kept one. Lent with a plain `lend`, the
/// burst teaches the order and the next step fetches a block on demand: the
/// property this test holds.
#[test]
fn blocks_lent_to_keep_do_not_teach_the_order_and_are_never_copied_again() {
    for keep_lend in [true, false] {
        let (sim, model, store) = setup(60);
        let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&model.inventory)).expect("plan");
        let mut ring = Ring::new(sim.clone(), store, &plan.components[0]).expect("ring");
        let stack = model.inventory.stacks[0].name.clone();
        let all: Vec<usize> = (0..model.len()).collect();
        for _ in 0..2 {
            for &b in &all {
                ring.lend(&stack, b).expect("lend");
                ring.give_back().expect("give back");
            }
            ring.end_step().expect("end step");
        }
        let kept = [0usize, 2];
        let mut kept_bytes = 0u64;
        for &b in &kept {
            if keep_lend { ring.lend_to_keep(&stack, b) } else { ring.lend(&stack, b) }.expect("lend to keep");
            kept_bytes += ring.lent().expect("a lent block").1.bytes as u64;
            ring.give_back().expect("give back");
        }
        let m = ring.end_step().expect("the keeping step");
        if keep_lend {
            // No retrace counted (the order is as it was), and nothing copied
            // ahead of a kept block: at most the kept blocks themselves.
            assert_eq!(m.retraces, 0, "{m}");
            assert!(m.bytes_copied <= kept_bytes, "blocks after a kept one copied ahead: {m}");
        }
        ring.hold_outside(&kept.iter().map(|&b| (stack.clone(), b)).collect::<Vec<_>>()).expect("hold outside");
        let streamed: Vec<usize> = all.iter().copied().filter(|b| !kept.contains(b)).collect();
        let mut misses = Vec::new();
        for step in 0..2 {
            let (mut acc, mut bytes) = (SEED, 0u64);
            for &b in &streamed {
                ring.lend(&stack, b).expect("lend");
                let (_, layout, slot) = ring.lent().expect("a lent block");
                acc = fold_combine(acc, sim.read_slot(slot, |m| block_hash(&m[..layout.bytes])));
                bytes += layout.bytes as u64;
                ring.give_back().expect("give back");
            }
            assert_eq!(acc, model.reference(&streamed), "keep_lend={keep_lend} step {step}: wrong bytes");
            let m = ring.end_step().expect("end step");
            misses.push(m.misses);
            if keep_lend && step == 1 {
                assert_eq!(m.bytes_copied, bytes, "a kept block copied again, or a streamed one twice: {m}");
            }
        }
        if keep_lend {
            assert_eq!(misses, [0, 0], "a step after keeping fetched a block on demand");
        } else {
            assert!(misses[0] > 0, "plain lends between steps should teach the order (the test's premise)");
        }
        ring.close().expect("close");
        sim.check().unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A training loop whose forward's last block is kept between a forward and
/// its backward (the automatic plan chooses at a forward step's end): the
/// backward, whose first block that was, starts from the first block it
/// streams, copied ahead when the pass switches — no block fetched on demand,
/// the right bytes in both passes.
#[test]
fn a_backward_after_its_first_block_is_kept_starts_copied_ahead() {
    let (sim, model, store) = setup(61);
    let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&model.inventory)).expect("plan");
    let mut ring = Ring::new(sim.clone(), store, &plan.components[0]).expect("ring");
    let stack = model.inventory.stacks[0].name.clone();
    let n = model.len();
    let pass = |ring: &mut Ring<SimBackend>, order: &[usize]| {
        let mut acc = SEED;
        for &b in order {
            ring.lend(&stack, b).expect("lend");
            let (_, layout, slot) = ring.lent().expect("a lent block");
            acc = fold_combine(acc, sim.read_slot(slot, |m| block_hash(&m[..layout.bytes])));
            ring.give_back().expect("give back");
        }
        assert_eq!(acc, model.reference(order), "wrong bytes in {order:?}");
        ring.end_step().expect("end step")
    };
    let forward: Vec<usize> = (0..n).collect();
    let backward: Vec<usize> = forward.iter().rev().copied().collect();
    for _ in 0..2 {
        pass(&mut ring, &forward);
        ring.set_backward(true).expect("backward");
        pass(&mut ring, &backward);
        ring.set_backward(false).expect("forward");
    }
    pass(&mut ring, &forward);
    // The forward's last block kept, at the forward's end.
    ring.lend_to_keep(&stack, n - 1).expect("lend to keep");
    ring.give_back().expect("give back");
    ring.end_step().expect("the keeping step");
    ring.hold_outside(&[(stack.clone(), n - 1)]).expect("hold outside");
    ring.set_backward(true).expect("backward");
    let m = pass(&mut ring, &backward[1..]);
    assert_eq!(m.misses, 0, "the backward's first streamed block was not copied ahead: {m}");
    ring.set_backward(false).expect("forward");
    let m = pass(&mut ring, &forward[..n - 1]);
    assert_eq!(m.misses, 0, "{m}");
    ring.close().expect("close");
    sim.check().unwrap_or_else(|e| panic!("{e}"));
}
