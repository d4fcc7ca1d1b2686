//! The Vulkan backend's row: the fold is a compute shader (WGSL → SPIR-V by naga)
//! submitted on the compute queue with the block's wait token; the Khronos
//! validation layer is on (`OFFLOAD_VULKAN_VALIDATION=0` turns it off) and any
//! error it reports fails the row; the backend's protocol log (which copy filled a
//! slot, which submission read it) catches a broken ring even where the device
//! runs every submission in order on one queue (lavapipe).

use crate::harness::{CaseError, Harness, ModelCase, Outcome};
use crate::model::{ModelShape, TestModel, SEED};
use offload_core::{resolve, Error, HostStore, Plan, Result, Ring};
use offload_vulkan::fold::{reference_combine, reference_hash, FoldKernel};
use offload_vulkan::{VulkanBackend, VulkanOptions, VulkanSlot};
use std::sync::Arc;

/// Rounds the fold's spin runs on every fourth fold (a late read).
pub const SPIN_ROUNDS: u32 = 200_000;

/// Vulkan on the first device with a compute queue.
pub struct Vulkan;

fn open() -> std::result::Result<VulkanBackend, CaseError> {
    let validation = std::env::var("OFFLOAD_VULKAN_VALIDATION").map_or(true, |v| v != "0");
    match VulkanBackend::with_options(&VulkanOptions { validation, ..Default::default() }) {
        Ok(b) => {
            b.enable_checking();
            Ok(b)
        }
        Err(e @ Error::Unsupported { .. }) => Err(CaseError::Skip(format!("no Vulkan device: {e}"))),
        Err(e) => Err(CaseError::Fail(format!("opening the Vulkan device: {e}"))),
    }
}

fn validation(b: &VulkanBackend) -> Result<()> {
    let m = b.validation_messages();
    match m.first() {
        None => Ok(()),
        Some(first) => Err(Error::device("vulkan", "validation", format!("{} validation error(s); first: {first}", m.len()))),
    }
}

impl Harness for Vulkan {
    type B = VulkanBackend;
    type Acc = FoldKernel;
    const NAME: &'static str = "vulkan";

    fn backend() -> std::result::Result<VulkanBackend, CaseError> {
        open()
    }
    fn new_acc(b: &VulkanBackend) -> Result<FoldKernel> {
        Ok(FoldKernel::new(b, SEED as u32)?.spin_every(4, SPIN_ROUNDS))
    }
    fn fold(_: &VulkanBackend, acc: &mut FoldKernel, slot: &VulkanSlot, bytes: usize, waits: &[offload_vulkan::VulkanPoint]) -> Result<()> {
        acc.fold(slot, bytes, waits).map(drop)
    }
    fn read(b: &VulkanBackend, acc: &FoldKernel) -> Result<u64> {
        let v = acc.read()?;
        validation(b)?;
        Ok(u64::from(v))
    }
    fn reference(model: &TestModel, order: &[usize]) -> u64 {
        u64::from(order.iter().fold(SEED as u32, |acc, &i| reference_combine(acc, reference_hash(&model.block_bytes(i)))))
    }
    fn violations(b: &VulkanBackend) -> Vec<String> {
        let mut v = b.violations();
        v.extend(b.validation_messages().into_iter().map(|m| format!("validation: {m}")));
        v
    }
    fn live_bytes(b: &VulkanBackend) -> u64 {
        b.counters().live_bytes
    }
    fn peak_bytes(b: &VulkanBackend) -> u64 {
        b.counters().peak_bytes
    }
    fn reset_peak(b: &VulkanBackend) {
        b.reset_peak()
    }
    fn host_syncs(b: &VulkanBackend) -> u64 {
        b.counters().syncs
    }
    fn model_cases() -> Vec<ModelCase> {
        vec![ModelCase { name: "user_signal_release", invariant: "1,2,6", run: user_signal_release }]
    }
}

/// The explicit-submission path end to end: each block's fold waits on the
/// block's wait token, and the block is released after the point the fold's own
/// submission signals (`BlockGuard::finish_after`), not after an event the backend
/// records; three steps at depths 1 and 2 equal the host reference, with no
/// protocol violation and no validation error.
fn user_signal_release() -> Outcome {
    for depth in [1, 2] {
        let b = open()?;
        let model = TestModel::random(&ModelShape { stacks: vec![4, 3], ..Default::default() }, 131 + depth as u64);
        let store = Arc::new(HostStore::build(&b, &model.inventory, &model.tensors)?);
        let plan = resolve(&Plan::layerwise().prefetch_depth(depth), std::slice::from_ref(&model.inventory))?;
        let mut ring = Ring::new(b.clone(), store, &plan.components[0])?;
        let order: Vec<usize> = (0..model.len()).collect();
        for step in 0..3 {
            let mut acc = Vulkan::new_acc(&b)?;
            for &i in &order {
                let g = ring.block_at(i)?;
                let waits: Vec<_> = g.wait_token().into_iter().copied().collect();
                crate::ensure!(!waits.is_empty(), "block {i} came without a wait token");
                let signal = acc.fold(g.slot(), g.layout().bytes, &waits)?;
                g.finish_after(signal)?;
            }
            let got = Vulkan::read(&b, &acc)?;
            let want = Vulkan::reference(&model, &order);
            crate::ensure!(got == want, "d={depth} step {step}: {got:#x} differs from the host reference {want:#x}");
            ring.end_step()?;
        }
        ring.close()?;
        let v = Vulkan::violations(&b);
        crate::ensure!(v.is_empty(), "d={depth}: {} violation(s), first: {}", v.len(), v[0]);
    }
    Ok(())
}
