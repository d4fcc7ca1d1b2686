//! Metrics and the timeline: the Chrome trace a ring writes parses, has one
//! compute span per block served on the compute thread and one copy span per
//! copy on the copy thread, host marks for every acquire and every copy issued,
//! and the stall metrics agree with the spans.

use offload_core::sim::{SimBackend, SimConfig};
use offload_core::{resolve, HostStore, Plan, ResolvedComponent, Ring, StepMetrics};
use offload_tests::model::{ModelShape, TestModel};
use std::sync::Arc;

#[test]
fn chrome_trace_parses_and_matches_the_metrics() {
    let model = TestModel::random(&ModelShape { stacks: vec![4, 4], ..Default::default() }, 5);
    let backend = SimBackend::new(SimConfig { max_copy_delay_us: 400, ..Default::default() });
    let store = Arc::new(HostStore::build(&backend, &model.inventory, &model.tensors).unwrap());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(backend.clone(), store, &rc).unwrap();
    ring.enable_timeline().unwrap();
    let copies_before = ring.metrics().copies;
    let mut last = None;
    for _ in 0..2 {
        for b in 0..model.len() {
            let g = ring.block_at(b).unwrap();
            backend.read_slot(g.slot(), |m| std::hint::black_box(m.len()));
            std::thread::sleep(std::time::Duration::from_micros(100));
            g.finish().unwrap();
        }
        last = Some(ring.end_step().unwrap());
    }
    let m = last.unwrap();
    let stall = m.exposed_stall_s.expect("stall measured");
    let busy = m.copy_busy_s.expect("copy time measured");
    assert!(busy > 0.0 && (0.0..=m.step_wall_s).contains(&stall), "stall {stall} s in a step of {} s", m.step_wall_s);
    let share = m.hidden_copy_share().unwrap();
    assert!((0.0..=1.0).contains(&share));
    assert!(m.achieved_gbps() > 0.0 && m.step_wall_s > 0.0);
    assert!(m.to_string().contains("of copy time hidden"), "{m}");

    let tl = ring.timeline().unwrap();
    let path = std::env::temp_dir().join(format!("offload-trace-{}.json", std::process::id()));
    tl.write_chrome_trace(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&path);
    let events = v["traceEvents"].as_array().unwrap();
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    let computes = complete.iter().filter(|e| e["tid"] == 2 && e["name"].as_str().unwrap().starts_with("compute ")).count();
    let copies = complete.iter().filter(|e| e["tid"] == 1 && e["name"].as_str().unwrap().starts_with("copy ")).count();
    assert_eq!(computes, 2 * model.len(), "one compute span per block served");
    assert_eq!(copies as u64, ring.metrics().copies - copies_before, "one copy span per copy after enabling");
    for e in &complete {
        assert!(e["ts"].as_f64().unwrap() >= 0.0 && e["dur"].as_f64().unwrap() >= 0.0);
    }
    // The host's marks: one acquire per block asked for, one issue per copy, in
    // the host's order (times never decreasing), on their own thread.
    let marks: Vec<_> = events.iter().filter(|e| e["ph"] == "i").collect();
    let acquires = marks.iter().filter(|e| e["tid"] == 3 && e["name"].as_str().unwrap().starts_with("acquire ")).count();
    let issues = marks.iter().filter(|e| e["tid"] == 3 && e["name"].as_str().unwrap().starts_with("issue copy ")).count();
    assert_eq!(acquires, 2 * model.len(), "one acquire mark per block asked for");
    assert_eq!(issues, copies, "one issue mark per copy span");
    assert!(tl.host.windows(2).all(|w| w[0].at_s <= w[1].at_s), "host marks in the host's order");
    assert!(tl.host.first().is_some_and(|m| m.name.starts_with("acquire ")), "the first mark is the first acquire");
    // The wait spans of both steps add up to at least the last step's stall.
    let all_stall: f64 = tl.spans.iter().filter(|s| s.name.starts_with("wait ")).map(|s| s.dur_s).sum();
    assert!(all_stall >= stall - 1e-9 && (tl.total_s("copy", "copy ") - ring.metrics().copy_busy_s.unwrap()).abs() < 1e-9);
}

#[test]
fn timeline_off_records_nothing() {
    let model = TestModel::random(&ModelShape { stacks: vec![3], ..Default::default() }, 6);
    let backend = SimBackend::new(SimConfig::fast());
    let store = Arc::new(HostStore::build(&backend, &model.inventory, &model.tensors).unwrap());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(backend, store, &rc).unwrap();
    drop(ring.block_at(0).unwrap());
    let m = ring.end_step().unwrap();
    assert!(ring.timeline().is_none() && m.exposed_stall_s.is_none() && m.hidden_copy_share().is_none());
}

/// A ring of six 1 MB blocks on a simulated link of 0.1 GB/s (10 ms a copy) at
/// `depth`, each block computing `compute_ms[b]` on the host thread with
/// `between_ms` of host work after it; `share` makes the link shared (copies
/// at half rate) from block 2 of the last step on. The last of three steps
/// diagnosed against the link's rate when `tell_link`.
fn diagnosed(depth: usize, compute_ms: [f64; 6], between_ms: f64, share: bool, tell_link: bool) -> offload_core::Diagnosis {
    use std::time::Duration;
    let shape = ModelShape { stacks: vec![6], tensors_per_block: 1, min_bytes: 1_000_000, max_bytes: 1_000_000, non_block: 0 };
    let model = TestModel::random(&shape, 7);
    let backend = SimBackend::new(SimConfig { link_bytes_per_s: Some(1e8), ..SimConfig::fast() });
    let store = Arc::new(HostStore::build(&backend, &model.inventory, &model.tensors).unwrap());
    let rc = resolve(&Plan::layerwise().prefetch_depth(depth), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(backend.clone(), store, &rc).unwrap();
    ring.enable_timeline().unwrap();
    for step in 0..3 {
        for (b, ms) in compute_ms.iter().enumerate() {
            if share && step == 2 && b == 2 {
                backend.share_link(Duration::from_secs(1));
            }
            let g = ring.block_at(b).unwrap();
            backend.read_slot(g.slot(), |m| std::hint::black_box(m.len()));
            std::thread::sleep(Duration::from_secs_f64(ms / 1e3));
            g.finish().unwrap();
            std::thread::sleep(Duration::from_secs_f64(between_ms / 1e3));
        }
        ring.end_step().unwrap();
    }
    ring.diagnose(tell_link.then_some(1e8)).expect("a traced step")
}

fn charged(d: &offload_core::Diagnosis, cause: offload_core::Cause) -> f64 {
    d.causes.iter().find(|(c, _)| *c == cause).map_or(0.0, |(_, s)| *s)
}

/// Each cause, provoked on the simulated device, is the one the diagnosis
/// names, in its seconds and its words: a copy-bound step (the link), copies
/// issued too late behind an uneven block (and not at depth 2), copies slowed
/// by other traffic on the link, and the host's own time between blocks.
#[test]
fn the_diagnosis_names_each_cause_provoked_on_the_simulated_device() {
    use offload_core::Cause;
    // The link: 10 ms copies behind 2 ms blocks, back to back.
    let d = diagnosed(1, [2.0; 6], 0.0, false, false);
    assert_eq!(d.verdict, Some(Cause::Link), "{}", d.summary);
    assert!(charged(&d, Cause::Link) > 30e-3 && d.link_gbps > 0.05 && d.link_gbps < 0.11, "{}", d.summary);
    assert!(d.summary.contains("\n- link: ") && d.summary.contains("copy-bound"), "{}", d.summary);

    // Late: a 0.5 ms block after each 40 ms one; at depth 1 the copy of the block
    // after the short one is issued only when the short one starts.
    let uneven = [40.0, 0.5, 40.0, 0.5, 40.0, 0.5];
    let d = diagnosed(1, uneven, 0.0, false, false);
    assert_eq!(d.verdict, Some(Cause::Late), "{}", d.summary);
    let late = charged(&d, Cause::Late);
    assert!(late > 15e-3, "{}", d.summary);
    assert!(d.waits.iter().any(|w| w.block == "stack0.2" && w.idle_before_s > 10e-3), "{:?}", d.waits);
    assert!(d.summary.contains("\n- late: ") && d.summary.contains("1 block(s) ahead"), "{}", d.summary);
    let deeper = diagnosed(2, uneven, 0.0, false, false);
    assert!(charged(&deeper, Cause::Late) < late / 4.0 && deeper.wait_s < d.wait_s / 4.0, "{}\n{}", d.summary, deeper.summary);

    // A shared link: 15 ms blocks hide 10 ms copies, not the 20 ms ones the
    // shared link gives from block 2 on.
    let d = diagnosed(1, [15.0; 6], 0.0, true, true);
    assert_eq!(d.verdict, Some(Cause::SharedLink), "{}", d.summary);
    assert!(d.waits.iter().any(|w| w.copy_gbps < 0.07), "{:?}", d.waits);
    assert!(d.summary.contains("\n- shared_link: ") && d.summary.contains("something else used the link"), "{}", d.summary);
    let alone = diagnosed(1, [15.0; 6], 0.0, false, true);
    assert!(charged(&alone, Cause::SharedLink) < 1e-3 && alone.wait_s < 10e-3, "{}", alone.summary);

    // The host: 30 ms of host work between 15 ms blocks whose copies are hidden.
    let d = diagnosed(1, [15.0; 6], 30.0, false, false);
    assert_eq!(d.verdict, Some(Cause::Host), "{}", d.summary);
    assert!(charged(&d, Cause::Host) > 120e-3 && d.between_s > 120e-3, "{}", d.summary);
    assert!(d.summary.contains("\n- host: "), "{}", d.summary);
}

/// A ring rebuilt at another depth serves the same bytes from `depth + 1`
/// slots, keeps the order it learned (no retrace), its totals and nothing of
/// the old slots; a depth over the plan's budget is refused before the ring is
/// touched.
#[test]
fn a_ring_rebuilt_at_another_depth_serves_the_same_bytes_with_its_learned_order() {
    let model = TestModel::random(&ModelShape { stacks: vec![6], non_block: 0, ..Default::default() }, 8);
    let backend = SimBackend::new(SimConfig::default());
    let store = Arc::new(HostStore::build(&backend, &model.inventory, &model.tensors).unwrap());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(backend.clone(), store.clone(), &rc).unwrap();
    // A learned order other than the inventory's: 0, 2, 4, 1, 3, 5.
    let order = [0, 2, 4, 1, 3, 5];
    let step = |ring: &mut Ring<SimBackend>| {
        for &b in &order {
            let g = ring.block_at(b).unwrap();
            assert_eq!(backend.read_slot(g.slot(), |m| m[..model.block_bytes(b).len()].to_vec()), model.block_bytes(b), "block {b}");
            g.finish().unwrap();
        }
        ring.end_step().unwrap()
    };
    step(&mut ring);
    let copies = ring.metrics().copies;
    assert_eq!(backend.stats().live_slots, 2);
    let mut ring = ring.at_depth(3).unwrap();
    assert_eq!((ring.depth(), backend.stats().live_slots), (3, 4));
    let m = step(&mut ring);
    assert_eq!((m.retraces, m.misses), (0, 0), "the learned order is kept: {m}");
    assert!(ring.metrics().copies > copies, "the totals are kept");
    let ring = ring.at_depth(1).unwrap();
    assert_eq!((ring.depth(), backend.stats().live_slots), (1, 2));
    ring.close().unwrap();
    assert_eq!(backend.stats().live_slots, 0);
    assert!(backend.stats().violations.is_empty(), "{:?}", backend.stats().violations);

    // Under a budget of two slots, depth 2 is refused and the ring still serves.
    let budget = 2 * rc.largest_streamed_bytes as u64;
    let mut plan = Plan::layerwise();
    plan.default.device_budget_bytes = Some(budget);
    let planned = resolve(&plan, std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let ring = Ring::new(backend.clone(), store, &planned).unwrap();
    let e = ring.at_depth(2).err().expect("over the budget");
    assert!(e.to_string().contains("over the budget"), "{e}");
}

/// A random model of `blocks` blocks in one stack (`seed`), its store on the
/// simulated device and its plan at depth 2.
fn depth_two(blocks: usize, seed: u64) -> (TestModel, SimBackend, Arc<HostStore<SimBackend>>, ResolvedComponent) {
    let model = TestModel::random(&ModelShape { stacks: vec![blocks], non_block: 0, ..Default::default() }, seed);
    let backend = SimBackend::new(SimConfig::default());
    let store = Arc::new(HostStore::build(&backend, &model.inventory, &model.tensors).unwrap());
    let rc = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    (model, backend, store, rc)
}

/// One pass over `model`'s blocks (a forward in order, a backward in
/// reverse), each lent block's bytes checked, then the step's metrics.
fn one_pass(ring: &mut Ring<SimBackend>, backend: &SimBackend, model: &TestModel, backward: bool) -> StepMetrics {
    ring.set_backward(backward).unwrap();
    let n = ring.len();
    let order: Vec<usize> = if backward { (0..n).rev().collect() } else { (0..n).collect() };
    for b in order {
        let g = ring.block_at(b).unwrap();
        assert_eq!(backend.read_slot(g.slot(), |m| m[..model.block_bytes(b).len()].to_vec()), model.block_bytes(b), "block {b}");
        g.finish().unwrap();
    }
    ring.end_step().unwrap()
}

/// A training step turns at the forward's last block into the backward, which
/// asks for the same blocks in reverse, and at the backward's last into the
/// next forward: once the ring has seen each turn twice, it copies ahead the blocks
/// the next pass asks for, not its own pass's first ones again. No prefetch is
/// wasted, and the blocks still in their slots at a turn (`depth + 1` of them)
/// are not copied again. A ring that only ever runs forwards keeps wrapping to
/// its first block.
#[test]
fn at_a_pass_turn_the_ring_copies_ahead_the_next_passs_blocks() {
    let (model, backend, store, rc) = depth_two(8, 11);
    let mut ring = Ring::new(backend.clone(), store.clone(), &rc).unwrap();
    let pass = |ring: &mut Ring<SimBackend>, backward: bool| one_pass(ring, &backend, &model, backward);
    for iteration in 0..5 {
        let f = pass(&mut ring, false);
        let b = pass(&mut ring, true);
        // A turn is predicted once the same pass followed twice in a row.
        if iteration > 2 {
            for m in [&f, &b] {
                // Three slots: the last three blocks of one pass are the first
                // three of the next, served from their slots.
                assert_eq!((m.misses, m.wasted_prefetches, m.copies), (0, 0, 5), "iteration {iteration}:\n{m}");
            }
        }
    }
    assert!(backend.stats().violations.is_empty(), "{:?}", backend.stats().violations);
    ring.close().unwrap();
    // Gradient accumulation (two forwards, then a backward): the pass after a
    // forward alternates, so no turn is predicted, and no pass misses.
    let mut ring = Ring::new(backend.clone(), store.clone(), &rc).unwrap();
    for cycle in 0..4 {
        let (f1, f2, b) = (pass(&mut ring, false), pass(&mut ring, false), pass(&mut ring, true));
        if cycle > 1 {
            assert_eq!((f1.misses, f2.misses, b.misses), (0, 0, 0), "cycle {cycle}:\n{f1}\n{f2}\n{b}");
        }
    }
    ring.close().unwrap();
    // Forwards alone: each step's first blocks copied ahead at the last, as before.
    let mut ring = Ring::new(backend.clone(), store, &rc).unwrap();
    for step in 0..3 {
        let m = pass(&mut ring, false);
        if step > 0 {
            assert_eq!((m.misses, m.wasted_prefetches, m.prefetch_hits), (0, 0, 8), "{m}");
        }
    }
    ring.close().unwrap();
}

/// A backward pass asks for the blocks in reverse: it learns its own order, so
/// after the first iteration neither pass retraces or misses, each serves its
/// blocks' bytes, and each step's metrics say which pass it was.
#[test]
fn a_backward_pass_learns_its_own_reverse_order_beside_the_forward() {
    let (model, backend, store, rc) = depth_two(6, 9);
    let mut ring = Ring::new(backend.clone(), store, &rc).unwrap();
    let pass = |ring: &mut Ring<SimBackend>, backward: bool| one_pass(ring, &backend, &model, backward);
    for iteration in 0..3 {
        let f = pass(&mut ring, false);
        let b = pass(&mut ring, true);
        assert!(!f.backward && b.backward, "{f}\n{b}");
        assert_eq!((b.blocks, b.retraces), (6, 0), "the backward's first order is the reverse: {b}");
        if iteration > 0 {
            assert_eq!((f.retraces, f.misses, b.misses), (0, 0, 0), "iteration {iteration}:\n{f}\n{b}");
            assert_eq!(f.prefetch_hits + b.prefetch_hits, 12);
        }
    }
    assert!(backend.stats().violations.is_empty(), "{:?}", backend.stats().violations);
}
