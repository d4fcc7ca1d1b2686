//! The simulated backend's row: compute is host code reading the slot.

use crate::harness::{CaseError, Harness};
use crate::model::{block_hash, fold_combine, SEED};
use offload_core::sim::{SimBackend, SimConfig, SimSlot};
use offload_core::{OffloadBackend, Result, Ring};

/// The simulated backend with random copy delays; with `CODED`, every block held
/// coded for the device and decoded by the copy thread (`SimConfig::coded`).
pub struct SimRow<const CODED: bool>;
/// The `sim` row.
pub type Sim = SimRow<false>;
/// The `sim-coded` row: every case and break with blocks coded on the wire.
pub type SimCoded = SimRow<true>;

impl<const CODED: bool> Harness for SimRow<CODED> {
    type B = SimBackend;
    type Acc = u64;
    const NAME: &'static str = if CODED { "sim-coded" } else { "sim" };

    fn backend() -> std::result::Result<SimBackend, CaseError> {
        Ok(SimBackend::new(SimConfig { coded: CODED, ..SimConfig::default() }))
    }
    fn host_pinned_bytes(b: &SimBackend) -> Option<u64> {
        Some(b.stats().pinned_bytes)
    }
    fn new_acc(_: &SimBackend) -> Result<u64> {
        Ok(SEED)
    }
    fn fold(b: &SimBackend, acc: &mut u64, slot: &SimSlot, bytes: usize, _waits: &[()]) -> Result<()> {
        *acc = fold_combine(*acc, b.read_slot(slot, |m| block_hash(&m[..bytes])));
        Ok(())
    }
    fn read(_: &SimBackend, acc: &u64) -> Result<u64> {
        Ok(*acc)
    }
    fn serves_mapped() -> bool {
        // The simulator reads each range into its own memory; a coded one copies.
        !CODED
    }
    fn refills_host() -> bool {
        // Every buffer of the coded row is coded, and coded buffers are not refilled.
        !CODED
    }
    fn disk_backend(early_refill: bool) -> std::result::Result<SimBackend, CaseError> {
        Ok(SimBackend::new(disk_config(SimConfig { coded: CODED, ..SimConfig::default() }, early_refill)))
    }
    fn decodes() -> bool {
        true
    }
    fn violations(b: &SimBackend) -> Vec<String> {
        b.stats().violations
    }
    fn live_bytes(b: &SimBackend) -> u64 {
        b.stats().live_bytes
    }
    fn peak_bytes(b: &SimBackend) -> u64 {
        b.stats().peak_bytes
    }
    fn reset_peak(b: &SimBackend) {
        b.reset_counters()
    }
    fn host_syncs(b: &SimBackend) -> u64 {
        b.stats().syncs
    }
    fn model_cases() -> Vec<crate::harness::ModelCase> {
        match CODED {
            false => Vec::new(),
            true => vec![crate::harness::ModelCase { name: "coded_copies_decode", invariant: "6", run: coded_copies_decode }],
        }
    }
}

/// On the coded row every copy moves a coded block and the copy thread decodes
/// it: all copies of a step coded, fewer bytes than the blocks hold, the
/// reference result.
fn coded_copies_decode() -> crate::harness::Outcome {
    use offload_core::{resolve, HostStore, Plan};
    let b = SimCoded::backend()?;
    let model = crate::model::TestModel::random(&crate::model::ModelShape { stacks: vec![3, 2], ..Default::default() }, 43);
    let store = std::sync::Arc::new(HostStore::build(&b, &model.inventory, &model.tensors)?);
    let raw: u64 = store.blocks().iter().map(|blk| blk.bytes() as u64).sum();
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory))?;
    let mut ring = Ring::new(b.clone(), store, &plan.components[0])?;
    let order: Vec<usize> = (0..model.len()).collect();
    sim_step(&mut ring, &b, &order)?;
    let before = b.stats();
    let got = sim_step(&mut ring, &b, &order)?;
    let st = b.stats();
    crate::ensure!(got == model.reference(&order), "the coded step's result differs from the reference");
    let (copies, coded) = (st.copies - before.copies, st.coded_copies - before.coded_copies);
    crate::ensure!(copies > 0 && coded == copies, "{coded} of {copies} copies coded");
    crate::ensure!(st.bytes_copied - before.bytes_copied < raw, "{} bytes on the wire for {raw}", st.bytes_copied - before.bytes_copied);
    Ok(())
}

/// One step through `ring` over blocks in `order`, each folded by host code
/// reading its slot on `sim`; the step is closed and the folded result returned.
/// For rings on the simulated device, possibly wrapped (a `FaultInjector`).
pub fn sim_step<B: OffloadBackend<Slot = SimSlot>>(ring: &mut Ring<B>, sim: &SimBackend, order: &[usize]) -> Result<u64> {
    let mut acc = SEED;
    for &b in order {
        let g = ring.block_at(b)?;
        let bytes = g.layout().bytes;
        acc = fold_combine(acc, sim.read_slot(g.slot(), |m| block_hash(&m[..bytes])));
        g.finish()?;
    }
    ring.end_step()?;
    Ok(acc)
}

/// The disk case's simulated device: copies slow enough (up to 3 ms) that the
/// readers refill bounce buffers while copies from them are queued, and with
/// `early_refill` a `refill_host` that does not wait for them
/// (`SimConfig::refill_waits`), which the simulator logs as a violation.
pub fn disk_config(base: SimConfig, early_refill: bool) -> SimConfig {
    SimConfig { max_copy_delay_us: 3000, refill_waits: !early_refill, ..base }
}
