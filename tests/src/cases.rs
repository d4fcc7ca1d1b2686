//! The conformance cases, each written once and generic over the [`Harness`].
//! Each names the invariant of `ARCHITECTURE.md` it checks and, where one exists, the
//! deliberate ring break ([`Sabotage`]) that makes it fail.

use crate::ensure;
use crate::harness::{CaseError, Harness, Outcome};
use crate::model::{ModelShape, TestModel};
use offload_core::sabotage::Sabotage;
use offload_core::HostBuffer as _;
use offload_core::{
    resolve, BlockDiscovery, ComponentPlan, FaultInjector, FaultKind, HostStore, NameDiscovery, OffloadBackend, OnDemand, Plan,
    ResolvedComponent, Ring, SafetensorsFile, Strategy, TensorSource,
};
use std::sync::Arc;

/// One conformance case.
pub struct Case {
    /// Short name (`ready_before_read`).
    pub name: &'static str,
    /// The design invariant it checks.
    pub invariant: &'static str,
    /// Runs the case, optionally with the ring broken on purpose.
    pub run: fn(Sabotage) -> Outcome,
    /// The ring breaks this case must catch (none where the ring cannot break the invariant).
    pub caught: &'static [Sabotage],
}

/// Every case, instantiated for harness `H`.
pub fn all<H: Harness>() -> Vec<Case> {
    vec![
        Case { name: "ready_before_read", invariant: "1", run: ready_before_read::<H>, caught: &[Sabotage::SkipComputeWait] },
        Case {
            name: "free_after_last_use",
            invariant: "2",
            run: free_after_last_use::<H>,
            caught: &[Sabotage::SkipFreeWait, Sabotage::NoReleaseEvent, Sabotage::EarlyRelease],
        },
        Case { name: "no_host_sync_steady_state", invariant: "3", run: no_host_sync::<H>, caught: &[Sabotage::SyncEveryBlock] },
        Case { name: "no_weight_copy_back", invariant: "4", run: no_weight_copy_back::<H>, caught: &[] },
        Case { name: "bounded_device_memory", invariant: "5", run: bounded_device_memory::<H>, caught: &[Sabotage::ExtraSlot] },
        Case { name: "bitwise_equal", invariant: "6", run: bitwise_equal::<H>, caught: &[Sabotage::TrustPrediction] },
        Case { name: "order_learned", invariant: "7", run: order_learned::<H>, caught: &[Sabotage::TrustPrediction] },
        Case { name: "transactional", invariant: "8", run: transactional::<H>, caught: &[Sabotage::LeakOnError] },
        Case { name: "one_host_copy", invariant: "9", run: one_host_copy::<H>, caught: &[Sabotage::SecondHostCopy] },
        Case { name: "on_demand_component", invariant: "5,6,8", run: on_demand::<H>, caught: &[] },
        Case { name: "safetensors_source", invariant: "6,9", run: safetensors_source::<H>, caught: &[] },
        Case { name: "mapped_source", invariant: "6,9", run: mapped_source::<H>, caught: &[Sabotage::SkipSourceCheck] },
        Case { name: "disk_source", invariant: "1,2,6", run: disk_source::<H>, caught: &[Sabotage::StaleBounce, Sabotage::EarlyRefill] },
        Case { name: "file_faults", invariant: "8", run: file_faults::<H>, caught: &[] },
        Case { name: "coded_file", invariant: "6,8", run: coded_file::<H>, caught: &[Sabotage::TrustCodedFile] },
    ]
}

type Fi<H> = FaultInjector<<H as Harness>::B>;

struct Setup<H: Harness> {
    backend: Fi<H>,
    model: TestModel,
    store: Arc<HostStore<Fi<H>>>,
}

impl<H: Harness> Setup<H> {
    fn new(shape: &ModelShape, seed: u64) -> Result<Self, CaseError> {
        let backend = FaultInjector::new(H::backend()?);
        let model = TestModel::random(shape, seed);
        let store = Arc::new(HostStore::build(&backend, &model.inventory, &model.tensors)?);
        Ok(Setup { backend, model, store })
    }

    fn plan(&self, plan: &Plan) -> Result<ResolvedComponent, CaseError> {
        Ok(resolve(plan, std::slice::from_ref(&self.model.inventory))?.components.remove(0))
    }

    fn ring(&self, plan: &Plan, sabotage: Sabotage) -> Result<Ring<Fi<H>>, CaseError> {
        let rc = self.plan(plan)?;
        Ok(Ring::with_sabotage(self.backend.clone(), self.store.clone(), &rc, sabotage)?)
    }

    fn inner(&self) -> &H::B {
        self.backend.inner()
    }

    /// Run blocks in `order` through `ring`; the folded result.
    fn run(&self, ring: &mut Ring<Fi<H>>, order: &[usize]) -> Result<u64, CaseError> {
        let b = self.inner();
        let mut acc = H::new_acc(b)?;
        for &p in order {
            let g = ring.block_at(p)?;
            let bytes = g.layout().bytes;
            let waits: Vec<_> = g.wait_token().into_iter().cloned().collect();
            H::fold(b, &mut acc, g.slot(), bytes, &waits)?;
            g.finish()?;
        }
        Ok(H::read(b, &acc)?)
    }

    fn check_equal(&self, ring: &mut Ring<Fi<H>>, order: &[usize], what: &str) -> Outcome {
        let got = self.run(ring, order)?;
        let want = H::reference(&self.model, order);
        ensure!(got == want, "{what}: offloaded result {got:#018x} differs from the resident reference {want:#018x}");
        Ok(())
    }

    fn no_violations(&self) -> Outcome {
        let v = H::violations(self.inner());
        ensure!(v.is_empty(), "{} protocol violation(s), first: {}", v.len(), v[0]);
        Ok(())
    }

    fn declared(&self) -> Vec<usize> {
        (0..self.model.len()).collect()
    }
}

fn ready_before_read<H: Harness>(s: Sabotage) -> Outcome {
    for depth in [1, 2] {
        let su = Setup::<H>::new(&ModelShape::default(), 11 + depth as u64)?;
        let mut ring = su.ring(&Plan::layerwise().prefetch_depth(depth), s)?;
        for step in 0..3 {
            su.check_equal(&mut ring, &su.declared(), &format!("d={depth} step {step}"))?;
        }
        su.no_violations()?;
    }
    Ok(())
}

fn free_after_last_use<H: Harness>(s: Sabotage) -> Outcome {
    for depth in [1, 2, 3] {
        let su = Setup::<H>::new(&ModelShape { stacks: vec![4, 3], ..Default::default() }, 21 + depth as u64)?;
        let mut ring = su.ring(&Plan::layerwise().prefetch_depth(depth), s)?;
        for step in 0..3 {
            su.check_equal(&mut ring, &su.declared(), &format!("d={depth} step {step}"))?;
        }
        su.no_violations()?;
    }
    Ok(())
}

fn no_host_sync<H: Harness>(s: Sabotage) -> Outcome {
    let su = Setup::<H>::new(&ModelShape::default(), 31)?;
    let mut ring = su.ring(&Plan::layerwise().prefetch_depth(2), s)?;
    su.check_equal(&mut ring, &su.declared(), "warm-up step")?;
    ring.end_step()?;
    let syncs = H::host_syncs(su.inner());
    for step in 1..4 {
        su.check_equal(&mut ring, &su.declared(), &format!("step {step}"))?;
        let m = ring.end_step()?;
        ensure!(m.misses == 0, "step {step}: {} misses in the steady state", m.misses);
        ensure!(m.prefetch_hits == su.model.len() as u64, "step {step}: {} of {} blocks prefetched", m.prefetch_hits, su.model.len());
    }
    let after = H::host_syncs(su.inner());
    ensure!(after == syncs, "{} host synchronisations in 3 steady-state steps", after - syncs);
    Ok(())
}

fn no_weight_copy_back<H: Harness>(_: Sabotage) -> Outcome {
    let su = Setup::<H>::new(&ModelShape::default(), 41)?;
    let mut ring = su.ring(&Plan::layerwise(), Sabotage::None)?;
    for _ in 0..2 {
        su.check_equal(&mut ring, &su.declared(), "step")?;
    }
    ring.close()?;
    for (i, b) in su.store.blocks().iter().enumerate() {
        ensure!(
            b.buffer().expect("held in memory").block_bytes()? == su.model.block_bytes(i).as_slice(),
            "host bytes of block {} changed",
            b.id
        );
    }
    Ok(())
}

fn bounded_device_memory<H: Harness>(s: Sabotage) -> Outcome {
    for depth in [1, 2, 3] {
        let su = Setup::<H>::new(&ModelShape::default(), 51 + depth as u64)?;
        let base = H::live_bytes(su.inner());
        H::reset_peak(su.inner());
        let cp = ComponentPlan { prefetch_depth: depth, resident_blocks: vec!["stack1.2".into()], ..Default::default() };
        let plan = Plan::layerwise().component("transformer", cp);
        let rc = su.plan(&plan)?;
        let mut ring = su.ring(&plan, s)?;
        for _ in 0..2 {
            su.check_equal(&mut ring, &su.declared(), "step")?;
        }
        let peak = H::peak_bytes(su.inner()) - base;
        ensure!(
            peak <= rc.device_weight_bound,
            "d={depth}: peak device bytes {peak} above (d+1)·largest + resident = {}",
            rc.device_weight_bound
        );
        let own = ring.metrics().peak_device_weight_bytes;
        ensure!(own <= rc.device_weight_bound, "d={depth}: ring reports {own} device bytes, bound {}", rc.device_weight_bound);
        ring.close()?;
        let live = H::live_bytes(su.inner());
        ensure!(live == base, "d={depth}: {} device bytes still held after close", live - base);
    }
    Ok(())
}

fn bitwise_equal<H: Harness>(s: Sabotage) -> Outcome {
    let su = Setup::<H>::new(&ModelShape { stacks: vec![6, 9], ..Default::default() }, 61)?;
    let order = su.declared();
    let mut resident = su.ring(&Plan::resident(), Sabotage::None)?;
    let r = su.run(&mut resident, &order)?;
    resident.close()?;
    ensure!(r == H::reference(&su.model, &order), "resident run differs from the host reference");
    let cp = ComponentPlan { prefetch_depth: 2, resident_blocks: vec!["stack0.0".into(), "stack1.4".into()], ..Default::default() };
    for plan in [Plan::layerwise(), Plan::layerwise().prefetch_depth(3), Plan::layerwise().component("transformer", cp)] {
        let mut ring = su.ring(&plan, s)?;
        // A first step in a new order (last stack first), the same order learned,
        // then another new one.
        let mut shuffled: Vec<usize> = order.iter().copied().skip(6).chain(order.iter().copied().take(6)).collect();
        for pass in 0..3 {
            let got = su.run(&mut ring, &shuffled)?;
            ensure!(got == H::reference(&su.model, &shuffled), "streamed run differs from the resident run");
            if pass == 1 {
                shuffled.rotate_left(1);
            }
        }
    }
    su.no_violations()
}

fn order_learned<H: Harness>(s: Sabotage) -> Outcome {
    let su = Setup::<H>::new(&ModelShape { stacks: vec![5, 5], ..Default::default() }, 71)?;
    let n = su.model.len();
    let reversed: Vec<usize> = (0..n).rev().collect();
    let skipping: Vec<usize> = (0..n).filter(|i| i % 3 != 1).collect();
    let interleaved: Vec<usize> = (0..5).flat_map(|i| [i, i + 5]).collect();
    let repeated: Vec<usize> = (0..n).flat_map(|i| [i, i]).collect();
    // A cache's hit: only the first block runs, the rest are skipped.
    let cached: Vec<usize> = vec![0];
    for depth in [1, 2] {
        let mut ring = su.ring(&Plan::layerwise().prefetch_depth(depth), s)?;
        su.check_equal(&mut ring, &su.declared(), "declared order")?;
        ring.end_step()?;
        for (name, order, settles) in [
            ("reversed", &reversed, true),
            ("skipping", &skipping, true),
            ("interleaved", &interleaved, true),
            ("repeated", &repeated, false),
            ("cached", &cached, true),
        ] {
            su.check_equal(&mut ring, order, &format!("d={depth} {name}, first pass"))?;
            let first = ring.end_step()?;
            ensure!(first.retraces > 0, "d={depth} {name}: a new order was not counted ({first})");
            ensure!(first.misses > 0 || name == "cached", "d={depth} {name}: a new order was not counted ({first})");
            // Block 1 was copied ahead of block 0 and is skipped: its slot is taken
            // before it ran, a wasted prefetch.
            ensure!(name != "skipping" || first.wasted_prefetches > 0, "d={depth} skipping: no wasted prefetch counted ({first})");
            // The second pass still meets one new transition (from this order's last
            // block back to its first); the third is fully predicted.
            let mut wasted = first.wasted_prefetches;
            for pass in [2, 3] {
                su.check_equal(&mut ring, order, &format!("d={depth} {name}, pass {pass}"))?;
                let m = ring.end_step()?;
                wasted += m.wasted_prefetches;
                if settles && pass == 3 {
                    ensure!(m.misses == 0 && m.retraces == 0, "d={depth} {name}: order not learned after two passes ({m})");
                    ensure!(m.wasted_prefetches == 0, "d={depth} {name}: a learned order still copies blocks it skips ({m})");
                }
            }
            if name == "cached" {
                // One skip decision (block 0 then the next step's block 0): at most
                // the `depth` blocks copied ahead for it are wasted, and once learned
                // the skipped blocks never cross the link.
                ensure!(wasted <= depth as u64, "d={depth} cached: {wasted} prefetches wasted for one skip decision");
                su.check_equal(&mut ring, order, &format!("d={depth} cached, pass 4"))?;
                let m = ring.end_step()?;
                ensure!(m.bytes_copied == 0, "d={depth} cached: skipped blocks still cross the link ({m})");
            }
        }
    }
    su.no_violations()
}

fn transactional<H: Harness>(s: Sabotage) -> Outcome {
    let su = Setup::<H>::new(&ModelShape { stacks: vec![3, 3], ..Default::default() }, 81)?;
    let base = H::live_bytes(su.inner());
    let cp = ComponentPlan { prefetch_depth: 2, resident_blocks: vec!["stack0.1".into()], ..Default::default() };
    let plan = Plan::layerwise().component("transformer", cp);
    let mut faults = 0;
    for kind in [FaultKind::SlotAlloc, FaultKind::Copy, FaultKind::Event] {
        for n in 0.. {
            su.backend.arm(kind, n);
            let attempt = su.ring(&plan, s).and_then(|mut ring| {
                let r = su.run(&mut ring, &su.declared());
                r.map(|_| ring)
            });
            su.backend.disarm();
            match attempt {
                Ok(ring) => {
                    ring.close()?;
                    break;
                }
                Err(e) => {
                    // Only the injected fault counts: a failure for any other reason
                    // is this case's (and would otherwise retry forever).
                    let text = match &e {
                        CaseError::Fail(m) | CaseError::Skip(m) => m,
                    };
                    ensure!(
                        text.contains(&format!("injected fault: {kind:?} #{n}")),
                        "{kind:?} #{n}: the attempt failed for another reason than the injected fault: {text}"
                    );
                    faults += 1;
                    su.backend.synchronize()?;
                    let live = H::live_bytes(su.inner());
                    ensure!(live == base, "{kind:?} #{n}: {} device bytes still held after the failure", live - base);
                }
            }
        }
    }
    ensure!(faults > 5, "only {faults} faults were injected");
    for (i, b) in su.store.blocks().iter().enumerate() {
        ensure!(
            b.buffer().expect("held in memory").block_bytes()? == su.model.block_bytes(i).as_slice(),
            "host bytes of block {} changed",
            b.id
        );
    }
    let mut ring = su.ring(&plan, s)?;
    su.check_equal(&mut ring, &su.declared(), "after every fault")
}

/// One host copy, by the backend's own count of page-locked bytes around the
/// store's build (the store's bookkeeping alone would pass whatever it held):
/// a second copy kept, or staging not given back, counts twice.
fn one_host_copy<H: Harness>(s: Sabotage) -> Outcome {
    let backend = H::backend()?;
    if !offload_core::HostMemory::capabilities(&backend.host()).pinned {
        return Err(CaseError::Skip("n/a: this row's host memory is ordinary memory (nothing page-locked to count)".into()));
    }
    let Some(before) = H::host_pinned_bytes(&backend) else {
        return Err(CaseError::Skip("n/a: this row does not count its page-locked host bytes".into()));
    };
    let model = TestModel::random(&ModelShape::default(), 91);
    offload_core::sabotage::keep_second_copy(s == Sabotage::SecondHostCopy);
    let store = HostStore::build(&backend, &model.inventory, &model.tensors);
    offload_core::sabotage::keep_second_copy(false);
    let store = store?;
    let held = H::host_pinned_bytes(&backend).unwrap_or(0).saturating_sub(before);
    let (host, payload) = (store.host_bytes(), store.payload_bytes());
    ensure!(
        held == store.pinned_bytes(),
        "the backend holds {held} page-locked bytes for the store, which counts {}",
        store.pinned_bytes()
    );
    ensure!(held as f64 <= 1.01 * payload as f64, "the backend holds {held} page-locked bytes for {payload} bytes of tensors");
    ensure!(host as f64 <= 1.01 * payload as f64, "host store holds {host} bytes for {payload} bytes of tensors");
    for (i, b) in store.blocks().iter().enumerate() {
        ensure!(b.bytes() == model.block_bytes(i).len(), "block {} is not exactly sized", b.id);
    }
    drop(store);
    let after = H::host_pinned_bytes(&backend).unwrap_or(0);
    ensure!(after == before, "{} page-locked bytes still held after the store was dropped", after.saturating_sub(before));
    Ok(())
}

fn on_demand<H: Harness>(_: Sabotage) -> Outcome {
    let su = Setup::<H>::new(&ModelShape { stacks: vec![3, 2], ..Default::default() }, 101)?;
    let base = H::live_bytes(su.inner());
    let od = OnDemand::load(su.backend.clone(), su.store.clone())?;
    let b = su.inner();
    let mut acc = H::new_acc(b)?;
    let order = su.declared();
    for &p in &order {
        let id = &su.store.blocks()[p].id;
        let (layout, slot) = od.block(id).ok_or_else(|| CaseError::Fail(format!("block {id} missing")))?;
        H::fold(b, &mut acc, slot, layout.bytes, od.wait_tokens())?;
    }
    let got = H::read(b, &acc)?;
    od.release()?;
    ensure!(got == H::reference(&su.model, &order), "on-demand result differs from the reference");
    su.backend.synchronize()?;
    ensure!(H::live_bytes(b) == base, "on-demand component still holds device memory after release");
    let plan =
        su.plan(&Plan::layerwise().component("transformer", ComponentPlan { strategy: Strategy::OnDemand, ..Default::default() }))?;
    let refused = Ring::new(su.backend.clone(), su.store.clone(), &plan).map(drop);
    ensure!(
        refused.as_ref().is_err_and(|e| e.to_string().contains("planned on demand")),
        "a ring accepted an on-demand plan, or refused it for another reason: {refused:?}"
    );
    su.no_violations()
}

/// The mapped host tier: a checkpoint whose blocks lie in the file as the store
/// lays them out (each tensor at a multiple of 256 from its block's first), opened
/// the way this row serves it in place (`Harness::open_mapped`), built by
/// `HostStore::build_mapped`: every buffer served from the file where the row can
/// (`Harness::serves_mapped`), copied where it cannot, and the streamed result
/// equal to the in-memory reference either way. Then one byte inside block 2
/// is written in place (same file, same length, as `dd conv=notrunc` would):
/// where the row serves the file in place, the step's end is an error naming
/// the file and every later block is refused (`HostStore::check_sources`);
/// where it copied the file, the copies do not depend on it and the ring goes
/// on (and the check's sabotage does not apply: n/a). Closing the ring checks
/// the file again: an error where it serves the file in place.
fn mapped_source<H: Harness>(s: Sabotage) -> Outcome {
    let model = TestModel::random(&ModelShape { stacks: vec![3, 2], ..Default::default() }, 222);
    let dir = case_dir::<H>("offload-conformance-mapped");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.safetensors");
    write_laid_out(&model, &path)?;
    let file = H::open_mapped(&path)?;
    let inventory = NameDiscovery.discover("transformer", file.specs())?;
    let backend = FaultInjector::new(H::backend()?);
    let store = Arc::new(HostStore::build_mapped(&backend, &inventory, &file, offload_core::PinOptions::default())?);
    let tier = store.tier().clone();
    let buffers = store.blocks().len() + usize::from(store.non_block().is_some());
    let want = if H::serves_mapped() { (buffers, 0) } else { (0, buffers) };
    ensure!((tier.mapped, tier.copied) == want, "{} served in place and {} copied, {want:?} expected ({tier:?})", tier.mapped, tier.copied);
    let rc = resolve(&Plan::layerwise(), &[inventory])?.components.remove(0);
    if s == Sabotage::SkipSourceCheck && !H::serves_mapped() {
        return Err(CaseError::Skip("n/a: this row copies the mapped file at build, so a change after it cannot reach a step".into()));
    }
    let su = Setup::<H> { backend: backend.clone(), model, store };
    let mut ring = Ring::with_sabotage(backend, su.store.clone(), &rc, s)?;
    let order: Vec<usize> = su.model.inventory.blocks().map(|b| su.store.position(&b.id).unwrap_or(usize::MAX)).collect();
    let got = su.run(&mut ring, &order)?;
    ring.end_step()?;
    let reference = H::reference(&su.model, &su.declared());
    ensure!(got == reference, "result from the mapped store {got:#018x} differs from the in-memory reference {reference:#018x}");
    // One byte inside block 2 written in place between two steps.
    let b2 = su.model.inventory.blocks().nth(2).ok_or_else(|| CaseError::Fail("the model has no block 2".into()))?;
    let t = file.specs().iter().position(|t| t.name == b2.tensors[0].name).ok_or_else(|| CaseError::Fail("block 2's tensor".into()))?;
    {
        use std::os::unix::fs::FileExt;
        // Past the file system's timestamp granularity of the file's creation.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&path)?;
        let mut byte = [0u8];
        f.read_exact_at(&mut byte, file.data_offset(t) + 1)?;
        f.write_all_at(&[byte[0] ^ 0x5a], file.data_offset(t) + 1)?;
    }
    let next = su.run(&mut ring, &order).and_then(|_| ring.end_step().map_err(CaseError::from));
    let after = ring.block_at(order[0]).map(drop);
    // Closing checks the file once more (a change during the last step's copies).
    let closed = ring.close();
    drop(su);
    let _ = std::fs::remove_dir_all(&dir);
    if H::serves_mapped() {
        ensure!(closed.as_ref().is_err_and(|e| e.to_string().contains("model.safetensors")), "closing over the changed file: {closed:?}");
        let Err(e) = next else {
            return Err(CaseError::Fail("a step over a mapped file written in place (block 2) ended without an error".into()));
        };
        let msg = match &e {
            CaseError::Fail(m) | CaseError::Skip(m) => m.clone(),
        };
        ensure!(msg.contains("model.safetensors") && msg.contains("changed"), "the changed file is not named: {msg}");
        ensure!(
            after.as_ref().is_err_and(|e| e.to_string().contains("unusable") && e.to_string().contains("changed")),
            "a block was served after the mapped file was reported changed, or refused for another reason: {after:?}"
        );
    } else {
        next?;
        after?;
        closed?;
    }
    Ok(())
}

/// The disk tier: the blocks of a checkpoint laid out as the store lays them out,
/// every other one left on disk (`ComponentPlan::disk_blocks`), built by
/// `HostStore::build_tiered` and streamed at d = 1 and d = 2 through the ring's
/// bounce buffers, refilled on reader threads (`OffloadBackend::refill_host`).
/// Three passes, in order and out of it: every result equals the in-memory
/// reference, and each pass read every block on disk once. A row that cannot
/// refill a host buffer (the coded rows: `Harness::refills_host`) must refuse
/// the ring by name.
fn disk_source<H: Harness>(s: Sabotage) -> Outcome {
    if matches!(s, Sabotage::StaleBounce | Sabotage::EarlyRefill) && !H::refills_host() {
        return Err(CaseError::Skip("n/a: this row refuses the disk tier (it cannot refill host buffers)".into()));
    }
    // The same random model each time it is made (a fixed seed).
    let make = || TestModel::random(&ModelShape { stacks: vec![4, 3], ..Default::default() }, 333);
    let model = make();
    let dir = case_dir::<H>("offload-conformance-disk");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.safetensors");
    write_laid_out(&model, &path)?;
    let result = (|| {
        let file = offload_core::SafetensorsFile::open(&path)?;
        let inventory = NameDiscovery.discover("transformer", file.specs())?;
        let disk: Vec<String> = inventory.blocks().step_by(2).map(|b| b.id.to_string()).collect();
        for depth in [1, 2] {
            let cp = ComponentPlan { prefetch_depth: depth, disk_blocks: disk.clone(), ..Default::default() };
            let rc = resolve(&Plan::layerwise().component("transformer", cp), std::slice::from_ref(&inventory))?.components.remove(0);
            let backend = FaultInjector::new(H::disk_backend(s == Sabotage::EarlyRefill)?);
            let store = Arc::new(HostStore::build_tiered(&backend, &inventory, &file, offload_core::PinOptions::default(), &|id| {
                rc.is_on_disk(id)
            })?);
            ensure!(
                store.tier().on_disk == disk.len(),
                "{} blocks on disk, {} planned ({:?})",
                store.tier().on_disk,
                disk.len(),
                store.tier()
            );
            let su = Setup::<H> { backend: backend.clone(), model: make(), store };
            let mut ring = match Ring::with_sabotage(backend, su.store.clone(), &rc, s) {
                Err(e @ offload_core::Error::Unsupported { .. }) if !H::refills_host() => {
                    ensure!(e.to_string().contains("disk tier"), "the refusal does not name the disk tier: {e}");
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
                Ok(_) if !H::refills_host() => {
                    return Err(CaseError::Fail("a row that cannot refill host buffers built a disk ring".into()))
                }
                Ok(ring) => ring,
            };
            let declared: Vec<usize> = su.model.inventory.blocks().map(|b| su.store.position(&b.id).unwrap_or(usize::MAX)).collect();
            let mut shuffled = declared.clone();
            shuffled.reverse();
            shuffled.swap(0, 2);
            let mut read = 0;
            for (pass, order) in [&declared, &shuffled, &declared].into_iter().enumerate() {
                let got = su.run(&mut ring, order)?;
                read += ring.end_step()?.disk_bytes_read;
                let want =
                    H::reference(&su.model, &order.iter().map(|&p| declared.iter().position(|&d| d == p).unwrap_or(0)).collect::<Vec<_>>());
                if got != want {
                    // The cause first, where the backend logged one (a refill under
                    // an in-flight copy): the wrong bytes are its timing's effect.
                    su.no_violations()?;
                }
                ensure!(
                    got == want,
                    "d={depth} pass {pass}: result from the disk tier {got:#018x} differs from the reference {want:#018x}"
                );
            }
            // Each pass reads every block on disk, less those still in a slot from the pass before.
            ensure!(
                read >= 2 * su.store.disk_bytes(),
                "d={depth}: {read} bytes read from disk in three passes, the blocks on disk hold {}",
                su.store.disk_bytes()
            );
            ring.close()?;
            su.no_violations()?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// A checkpoint that changes under the stores is a named error on every row, and
/// nothing is left held:
/// - cut short after it was opened: `HostStore::build_mapped` (over the file as
///   this row maps it, `Harness::open_mapped`) refuses it, naming the file;
/// - replaced after its header was read: `HostStore::build_tiered` refuses it;
/// - a host RAM budget smaller than one block: the plan is refused, naming the bytes;
/// - cut short in the middle of a step under the disk tier (every block on disk):
///   the block whose read fails is an `Error::DiskRead` naming the block and the
///   file, no guard is handed out for it, and once the ring and the store are
///   dropped the device holds what it held before (rows that cannot refill host
///   buffers refuse the disk ring by name instead: `disk_source`).
fn file_faults<H: Harness>(_: Sabotage) -> Outcome {
    let model = TestModel::random(&ModelShape { stacks: vec![4, 2], ..Default::default() }, 444);
    let dir = case_dir::<H>("offload-conformance-faults");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.safetensors");
    let result = (|| {
        let backend = FaultInjector::new(H::backend()?);
        let base = H::live_bytes(backend.inner());
        // Cut short after opening, before the mapped store is built.
        write_laid_out(&model, &path)?;
        let file = H::open_mapped(&path)?;
        let inventory = NameDiscovery.discover("transformer", file.specs())?;
        std::fs::OpenOptions::new().write(true).open(&path)?.set_len(100)?;
        match HostStore::build_mapped(&backend, &inventory, &file, offload_core::PinOptions::default()) {
            Ok(_) => return Err(CaseError::Fail("a mapped store was built over a file cut short after it was opened".into())),
            Err(e) => {
                let msg = e.to_string();
                ensure!(
                    msg.contains("model.safetensors") && msg.contains("truncated or rewritten"),
                    "the refusal of a cut-short file does not name it and why: {msg}"
                );
            }
        }
        drop(file);
        // Replaced (another file renamed over the path) after the header was read.
        write_laid_out(&model, &path)?;
        let file = offload_core::SafetensorsFile::open(&path)?;
        let other = dir.join("other.safetensors");
        write_laid_out(&model, &other)?;
        std::fs::rename(&other, &path)?;
        match HostStore::build_tiered(&backend, &inventory, &file, offload_core::PinOptions::default(), &|_| true) {
            Ok(_) => return Err(CaseError::Fail("a tiered store was built over a file replaced after its header was read".into())),
            Err(e) => {
                ensure!(e.to_string().contains("not the one whose header was read"), "the refusal of a replaced file: {e}");
            }
        }
        drop(file);
        // A host RAM budget smaller than one block.
        let cp = ComponentPlan { host_ram_budget_bytes: Some(1024), ..Default::default() };
        match resolve(&Plan::layerwise().component("transformer", cp), std::slice::from_ref(&inventory)) {
            Ok(_) => return Err(CaseError::Fail("a plan with 1024 bytes of host RAM for the disk tier was accepted".into())),
            Err(e) => {
                ensure!(e.to_string().contains("host RAM budget 1024 bytes"), "the refusal does not name the budget: {e}");
            }
        }
        // Cut short in the middle of a step, every block on disk.
        write_laid_out(&model, &path)?;
        let file = offload_core::SafetensorsFile::open(&path)?;
        let all: Vec<String> = inventory.blocks().map(|b| b.id.to_string()).collect();
        let cp = ComponentPlan { disk_blocks: all, ..Default::default() };
        let rc = resolve(&Plan::layerwise().component("transformer", cp), std::slice::from_ref(&inventory))?.components.remove(0);
        let store =
            Arc::new(HostStore::build_tiered(&backend, &inventory, &file, offload_core::PinOptions::default(), &|id| rc.is_on_disk(id))?);
        match Ring::new(backend.clone(), store.clone(), &rc) {
            // Rows that cannot refill host buffers refuse the disk ring by name; the
            // leak check below still runs for them.
            Err(e @ offload_core::Error::Unsupported { .. }) if !H::refills_host() => {
                ensure!(e.to_string().contains("disk tier"), "the refusal does not name the disk tier: {e}");
            }
            Err(e) => return Err(e.into()),
            Ok(_) if !H::refills_host() => return Err(CaseError::Fail("a row that cannot refill host buffers built a disk ring".into())),
            Ok(mut ring) => {
                let blocks = store.blocks().len();
                drop(ring.block_at(0)?);
                std::fs::OpenOptions::new().write(true).open(&path)?.set_len(100)?;
                let mut failed = None;
                for i in 1..blocks {
                    match ring.block_at(i) {
                        Ok(g) => drop(g),
                        Err(e) => {
                            failed = Some((i, e));
                            break;
                        }
                    }
                }
                let Some((i, e)) = failed else {
                    return Err(CaseError::Fail("every block was served after the file was cut short mid-step".into()));
                };
                let msg = e.to_string();
                ensure!(matches!(e, offload_core::Error::DiskRead { .. }), "position {i}: not a disk read error: {msg}");
                ensure!(
                    msg.contains("transformer/") && msg.contains("model.safetensors"),
                    "position {i}: the error does not name the block and the file: {msg}"
                );
            }
        }
        drop(store);
        backend.synchronize()?;
        let live = H::live_bytes(backend.inner());
        ensure!(live == base, "{} device bytes still held after the failed step", live.saturating_sub(base));
        let v = H::violations(backend.inner());
        ensure!(v.is_empty(), "{} protocol violation(s), first: {}", v.len(), v[0]);
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// A coded file made ahead of time (`CodedFile::write`, 4 KiB segments) builds
/// the store (`HostStore::build_from_coded_file`): on a row that decodes
/// (`Harness::decodes`) every buffer is held coded, elsewhere every one as it is;
/// either way a pass equals the resident reference. On a row that decodes, one
/// byte of the file changed is refused at build by name (`Error::CodedFile`,
/// never a wrong weight); elsewhere the file is not read. The device holds what
/// it held before once the stores are dropped.
fn coded_file<H: Harness>(s: Sabotage) -> Outcome {
    if s == Sabotage::TrustCodedFile && !H::decodes() {
        return Err(CaseError::Skip("n/a: this row does not decode, so it holds a coded file's blocks as they are".into()));
    }
    let shape = ModelShape { stacks: vec![3, 2], ..Default::default() };
    let model = TestModel::random(&shape, 555);
    let dir = case_dir::<H>("offload-conformance-coded");
    std::fs::create_dir_all(&dir)?;
    let path = offload_core::CodedFile::path_for(dir.join("model.safetensors"));
    let result = (|| {
        offload_core::CodedFile::write(&path, &model.inventory, &model.tensors, 64 << 10, 2)?;
        let backend = FaultInjector::new(H::backend()?);
        let base = H::live_bytes(backend.inner());
        let pin = offload_core::PinOptions::default();
        {
            let cf = offload_core::CodedFile::open(&path)?;
            let store = Arc::new(HostStore::build_from_coded_file(&backend, &model.inventory, &model.tensors, pin, &cf)?);
            let buffers = store.blocks().len() + usize::from(store.non_block().is_some());
            // Held coded: every entry coding shrank (the blocks; not the head's
            // uniform bytes, held raw as a build that codes holds them).
            let shrank = cf.entries().iter().filter(|e| e.len < e.raw_bytes).count();
            ensure!(shrank >= store.blocks().len(), "the file's blocks did not shrink ({shrank} of {buffers} entries)");
            let want = if H::decodes() { shrank } else { 0 };
            ensure!(store.coded_blocks() == want, "{} of {buffers} buffers held coded, {want} expected", store.coded_blocks());
            let rc = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&model.inventory))?.components.remove(0);
            let mut ring = Ring::new(backend.clone(), store.clone(), &rc)?;
            let order: Vec<usize> = (0..model.len()).collect();
            let su = Setup::<H> { backend: backend.clone(), model: TestModel::random(&shape, 555), store };
            for pass in 0..2 {
                let got = su.run(&mut ring, &order)?;
                ring.end_step()?;
                let want = H::reference(&su.model, &order);
                ensure!(got == want, "pass {pass}: result {got:#018x} from the coded file's store differs from the reference {want:#018x}");
            }
            ring.close()?;
            su.no_violations()?;
        }
        let good = std::fs::read(&path)?;
        let entry = offload_core::CodedFile::open(&path)?.entries()[1].clone();
        let mut bad = good.clone();
        bad[(entry.at + entry.len / 2) as usize] ^= 0x08;
        std::fs::write(&path, &bad)?;
        let cf = offload_core::CodedFile::open(&path)?;
        match (HostStore::build_from_coded_file(&backend, &model.inventory, &model.tensors, pin, &cf), H::decodes()) {
            (Ok(_), true) => return Err(CaseError::Fail("a coded file with a byte changed built a store".into())),
            (Ok(store), false) => {
                ensure!(store.coded_blocks() == 0, "a row that does not decode held coded buffers");
            }
            (Err(e @ offload_core::Error::CodedFile { .. }), true) => {
                let msg = e.to_string();
                ensure!(
                    msg.contains(&format!("transformer/{}", entry.block)) && msg.contains("damaged"),
                    "the refusal does not name the block and the damage: {msg}"
                );
            }
            (Err(e), _) => return Err(e.into()),
        }
        // Forged: one byte of that block's first coded string changed and the
        // file's own hashes written for the forged bytes; the segments' stored
        // hashes of the weights untouched. Only decoding at load finds it.
        let forged = |block: &str, coded: &mut Vec<u8>| {
            if block == entry.block {
                // A sign-and-mantissa byte of its first coded segment: the
                // structure stays valid, only the decoded bytes differ.
                if let Ok((_, segs)) = offload_core::codec::device_segments(coded, "forge") {
                    if let Some(sg) = segs.iter().find(|sg| sg.coded.is_some()) {
                        let sm_at = sg.coded.as_ref().map_or(0, |c| c.1.sm_at);
                        coded[sg.enc_at + sm_at + 100] ^= 0x08;
                    }
                }
            }
        };
        let piece = offload_core::coded_file::PIECE_BYTES;
        offload_core::CodedFile::write_with(&path, &model.inventory, &model.tensors, 64 << 10, 2, piece, 2, &forged)?;
        let cf = offload_core::CodedFile::open(&path)?;
        offload_core::sabotage::trust_coded(s == Sabotage::TrustCodedFile);
        let built = HostStore::build_from_coded_file(&backend, &model.inventory, &model.tensors, pin, &cf);
        offload_core::sabotage::trust_coded(false);
        match (built, H::decodes()) {
            (Ok(_), true) => return Err(CaseError::Fail("a forged coded file (its hashes rewritten) built a store".into())),
            (Ok(store), false) => {
                ensure!(store.coded_blocks() == 0, "a row that does not decode held coded buffers");
            }
            (Err(e @ offload_core::Error::CodedFile { .. }), true) => {
                let msg = e.to_string();
                ensure!(
                    msg.contains(&format!("transformer/{}", entry.block)) && msg.contains("damaged or altered"),
                    "the refusal of a forged file does not name the block and why: {msg}"
                );
            }
            (Err(e), _) => return Err(e.into()),
        }
        backend.synchronize()?;
        let live = H::live_bytes(backend.inner());
        ensure!(live == base, "{} device bytes still held after the stores were dropped", live.saturating_sub(base));
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// A directory of this case run's own: the row, the process and a counter, so
/// a case run twice at once in one process (a row's test and the same case under
/// a break, `run_sabotage`) never shares a file with itself.
fn case_dir<H: Harness>(what: &str) -> std::path::PathBuf {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!("{what}-{}-{}-{n}", H::NAME, std::process::id()))
}

/// Write `model` to `path` as a safetensors file, block by block in inventory
/// order, every tensor at a multiple of 256 of the data (as the store lays them out).
fn write_laid_out(model: &TestModel, path: &std::path::Path) -> Outcome {
    let names = model.inventory.blocks().flat_map(|b| b.tensors.iter().map(|t| t.name.as_str()));
    let mut tensors = Vec::new();
    for name in names.chain(model.inventory.non_block.iter().map(|t| t.name.as_str())) {
        let bytes = model.tensors.bytes(name).ok_or_else(|| CaseError::Fail(format!("{name}: not in the model")))?;
        tensors.push((name, bytes));
    }
    let shapes: Vec<[usize; 1]> = tensors.iter().map(|(_, b)| [b.len()]).collect();
    let laid: Vec<(&str, &str, &[usize], &[u8])> =
        tensors.iter().zip(&shapes).map(|(&(name, bytes), shape)| (name, "U8", shape.as_slice(), bytes)).collect();
    std::fs::write(path, crate::checkpoint::laid_out_safetensors(&laid))?;
    Ok(())
}

fn safetensors_source<H: Harness>(_: Sabotage) -> Outcome {
    let model = TestModel::random(&ModelShape { stacks: vec![4], ..Default::default() }, 111);
    let dir = case_dir::<H>("offload-conformance");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.safetensors");
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = model
        .tensors
        .specs()
        .iter()
        .map(|s| {
            let v =
                safetensors::tensor::TensorView::new(safetensors::Dtype::U8, s.shape.clone(), model.tensors.bytes(&s.name).unwrap_or(&[]))
                    .map_err(|e| e.to_string());
            v.map(|v| (s.name.clone(), v))
        })
        .collect::<Result<_, _>>()
        .map_err(CaseError::Fail)?;
    safetensors::serialize_to_file(views, &None, &path)?;
    let file = SafetensorsFile::open(&path)?;
    let inventory = NameDiscovery.discover("transformer", file.specs())?;
    let backend = FaultInjector::new(H::backend()?);
    let store = Arc::new(HostStore::build(&backend, &inventory, &file)?);
    let rc = resolve(&Plan::layerwise(), &[inventory])?.components.remove(0);
    let su = Setup::<H> { backend: backend.clone(), model, store };
    // Map positions through names: the file's order is the header's (sorted) order.
    let mut ring = Ring::new(backend, su.store.clone(), &rc)?;
    let order: Vec<usize> = su.model.inventory.blocks().map(|b| su.store.position(&b.id).unwrap_or(usize::MAX)).collect();
    let got = su.run(&mut ring, &order)?;
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(got == H::reference(&su.model, &su.declared()), "result from the safetensors store differs from the in-memory reference");
    Ok(())
}
