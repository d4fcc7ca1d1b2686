//! The CUDA backend's row: the fold runs as `offload_cuda::checksum::ChecksumKernel` on
//! the compute stream, so reading a slot early or late changes the result. The
//! backend runs in its checking mode (each copy first poisons its slot, then
//! spins, on the copy stream) and every fourth fold spins on the device before it
//! reads, so a missing wait on either side shows up as a wrong fold, not as luck.

use crate::harness::{CaseError, Harness, ModelCase, Outcome};
use crate::model::SEED;
use offload_core::{HostBuffer as _, HostMemory as _};
use offload_core::{OffloadBackend, Result};
use offload_cuda::checksum::ChecksumKernel;
use offload_cuda::{CudaBackend, CudaSlot};

/// Microseconds each copy spins on the copy stream after poisoning its slot.
pub const COPY_SPIN_US: u64 = 100;
/// The same in the disk case (`Harness::disk_backend`): long enough that a reader
/// thread refilling a bounce buffer whose copy is queued (`Sabotage::EarlyRefill`)
/// always writes before the copy reads. At 100 µs tch-cuda's row missed that
/// break in 1 of 3 processes on the H200 (`bench/raw/2026-12-03-gpu-early-refill-9ce4681`).
pub const DISK_COPY_SPIN_US: u64 = 2000;
/// Every `FOLD_SPIN_EVERY`-th fold spins this long before it reads.
pub const FOLD_SPIN_US: u64 = 1000;
/// See [`FOLD_SPIN_US`].
pub const FOLD_SPIN_EVERY: u64 = 4;

/// The row of a framework backend over offload-cuda's `FrameworkBufferEngine` (candle-cuda,
/// tch-cuda): the transfer engine's checking mode, its mapped and coded host
/// memory, the fold on the framework's stream over the slot's buffer. `$open(spin)`
/// opens the backend with each copy spinning `spin` µs; `$cases` are its model cases.
#[cfg(any(feature = "candle-cuda", feature = "tch-cuda"))]
macro_rules! fresh_engine_harness {
    ($row:ident, $name:literal, $backend:ty, $slot:ty, $open:path, $cases:expr) => {
        impl $crate::harness::Harness for $row {
            type B = $backend;
            type Acc = offload_cuda::checksum::ChecksumKernel;
            const NAME: &'static str = $name;

            fn open_mapped(path: &std::path::Path) -> offload_core::Result<offload_core::SafetensorsFile> {
                offload_cuda::map_checkpoint(path)
            }
            fn serves_mapped() -> bool {
                // offload-cuda's transfer engine registers the file in place.
                true
            }
            fn decodes() -> bool {
                // offload-cuda's transfer engine decodes coded buffers.
                true
            }
            fn backend() -> std::result::Result<Self::B, $crate::harness::CaseError> {
                $open($crate::cuda_harness::COPY_SPIN_US)
            }
            fn disk_backend(early_refill: bool) -> std::result::Result<Self::B, $crate::harness::CaseError> {
                // The checking mode's spin before each copy keeps copies queued while
                // the readers refill their buffers.
                let b = $open($crate::cuda_harness::DISK_COPY_SPIN_US)?;
                if early_refill {
                    b.cuda().sabotage_refill_early();
                }
                Ok(b)
            }
            fn new_acc(b: &Self::B) -> offload_core::Result<Self::Acc> {
                $crate::cuda_harness::gpu_fold(b.cuda())
            }
            fn fold(b: &Self::B, acc: &mut Self::Acc, slot: &$slot, bytes: usize, _waits: &[()]) -> offload_core::Result<()> {
                b.note_read(slot);
                acc.fold(b.cuda(), slot, bytes)
            }
            fn read(b: &Self::B, acc: &Self::Acc) -> offload_core::Result<u64> {
                acc.read(b.cuda())
            }
            fn violations(b: &Self::B) -> Vec<String> {
                b.violations()
            }
            fn live_bytes(b: &Self::B) -> u64 {
                b.counters().live_bytes
            }
            fn peak_bytes(b: &Self::B) -> u64 {
                b.counters().peak_bytes
            }
            fn reset_peak(b: &Self::B) {
                b.reset_peak()
            }
            fn host_syncs(b: &Self::B) -> u64 {
                b.counters().syncs
            }
            fn host_pinned_bytes(b: &Self::B) -> Option<u64> {
                Some(b.counters().pinned_bytes)
            }
            fn model_cases() -> Vec<$crate::harness::ModelCase> {
                $cases
            }
        }
    };
}
#[cfg(any(feature = "candle-cuda", feature = "tch-cuda"))]
pub(crate) use fresh_engine_harness;

/// The fold kernel of the GPU rows, with the spin pattern.
pub fn gpu_fold(b: &CudaBackend) -> Result<ChecksumKernel> {
    Ok(ChecksumKernel::new(b, SEED)?.spin_every(FOLD_SPIN_EVERY, FOLD_SPIN_US))
}

/// The raw CUDA backend on device 0; with `CODED`, its host store coded for the
/// device (`CudaBackend::enable_coding`, 64 KiB segments so larger blocks have
/// several; the test model's even tensors are normal bf16, its odd ones uniform
/// bytes: decoded by the kernel and copied raw).
pub struct CudaRow<const MODE: u8>;
/// The `cuda` row.
pub type Cuda = CudaRow<0>;
/// The `cuda-coded` row: every copy moves coded bytes and decodes them on the device.
pub type CudaCoded = CudaRow<1>;
/// The `cuda-relay` row: every copy shared with device 1 (`CudaBackend::enable_relay`:
/// half fetched by device 1 into its staging and pulled over NVLink). Skipped where
/// there is no second device with peer access.
pub type CudaRelay = CudaRow<2>;

/// What a CUDA row's failed construction is: a skip where the machine has no
/// CUDA device ([`offload_cuda::no_device`]), and a failure otherwise (a context, a
/// stream, a library or a framework build that fails on a machine with one).
pub(crate) fn absent_or_failed(what: &str, e: impl std::fmt::Display) -> CaseError {
    match offload_cuda::no_device() {
        true => CaseError::Skip(format!("no CUDA device for {what}: {e}")),
        false => CaseError::Fail(format!("{what} failed on a machine with a CUDA device: {e}")),
    }
}

impl<const MODE: u8> CudaRow<MODE> {
    /// The row's backend on device 0, each copy spinning `copy_spin_us` in the checking mode.
    fn open(copy_spin_us: u64) -> std::result::Result<CudaBackend, CaseError> {
        let b = CudaBackend::new(0).map_err(|e| absent_or_failed("the cuda row", e))?;
        b.enable_checking(copy_spin_us)?;
        if MODE == 1 {
            b.enable_coding(offload_cuda::CodingOptions { threads: 2, segment_bytes: 64 << 10, ..Default::default() })?;
        }
        if MODE == 2 {
            // Every copy relayed, however small: the test model's blocks are kilobytes.
            let o = offload_cuda::RelayOptions { helpers: vec![1], min_relay_bytes: 0, max_copy_bytes: 64 << 20, ..Default::default() };
            match b.enable_relay(o) {
                Ok(_) => {}
                Err(e @ offload_core::Error::Unsupported { .. }) => {
                    return Err(CaseError::Skip(format!("relay needs a second CUDA device with peer access: {e}")))
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(b)
    }
}

impl<const MODE: u8> Harness for CudaRow<MODE> {
    type B = CudaBackend;
    type Acc = ChecksumKernel;
    const NAME: &'static str = match MODE {
        1 => "cuda-coded",
        2 => "cuda-relay",
        _ => "cuda",
    };

    fn backend() -> std::result::Result<CudaBackend, CaseError> {
        Self::open(COPY_SPIN_US)
    }
    fn new_acc(b: &CudaBackend) -> Result<ChecksumKernel> {
        gpu_fold(b)
    }
    fn fold(b: &CudaBackend, acc: &mut ChecksumKernel, slot: &CudaSlot, bytes: usize, _waits: &[()]) -> Result<()> {
        acc.fold(b, slot, bytes)
    }
    fn read(b: &CudaBackend, acc: &ChecksumKernel) -> Result<u64> {
        acc.read(b)
    }
    fn open_mapped(path: &std::path::Path) -> offload_core::Result<offload_core::SafetensorsFile> {
        offload_cuda::map_checkpoint(path)
    }
    fn serves_mapped() -> bool {
        // Registered in place; with coding on every block is a copy.
        MODE != 1
    }
    fn refills_host() -> bool {
        // Every buffer of the coded row is coded, and coded buffers are not refilled.
        MODE != 1
    }
    fn disk_backend(early_refill: bool) -> std::result::Result<CudaBackend, CaseError> {
        // The checking mode's spin before each copy keeps copies queued while
        // the readers refill their buffers.
        let b = Self::open(DISK_COPY_SPIN_US)?;
        if early_refill {
            b.sabotage_refill_early();
        }
        Ok(b)
    }
    fn decodes() -> bool {
        true
    }
    fn violations(_: &CudaBackend) -> Vec<String> {
        Vec::new()
    }
    fn live_bytes(b: &CudaBackend) -> u64 {
        b.counters().live_bytes
    }
    fn peak_bytes(b: &CudaBackend) -> u64 {
        b.counters().peak_bytes
    }
    fn reset_peak(b: &CudaBackend) {
        b.reset_peak()
    }
    fn host_syncs(b: &CudaBackend) -> u64 {
        b.counters().syncs
    }
    fn host_pinned_bytes(b: &CudaBackend) -> Option<u64> {
        Some(b.counters().pinned_bytes)
    }
    fn model_cases() -> Vec<ModelCase> {
        if MODE == 1 {
            return vec![ModelCase { name: "coded_copies_decode", invariant: "6", run: coded_copies_decode }];
        }
        if MODE == 2 {
            return vec![ModelCase { name: "copies_relayed", invariant: "6", run: copies_relayed }];
        }
        vec![
            ModelCase { name: "host_memory_zeroed", invariant: "10", run: host_memory_zeroed },
            ModelCase { name: "fill_error_accounting", invariant: "8", run: fill_error_accounting },
            ModelCase { name: "foreign_buffer_refused", invariant: "10", run: foreign_buffer_refused },
        ]
    }
}

/// `alloc_host` hands its `fill` closure initialised (zeroed) bytes, never
/// whatever `cuMemHostAlloc` returned.
fn host_memory_zeroed() -> Outcome {
    let b = Cuda::backend()?;
    for round in 0..4 {
        // Freed and allocated again: pinned memory recycled from the previous round.
        let mut seen_nonzero = 0usize;
        let buf = b.host().alloc_pinned(32 << 20, "zeroing check", &mut |bytes| {
            seen_nonzero = bytes.iter().filter(|&&x| x != 0).count();
            bytes.fill(0xA5);
            Ok(())
        })?;
        crate::ensure!(seen_nonzero == 0, "round {round}: fill saw {seen_nonzero} non-zero bytes of fresh pinned memory");
        drop(buf);
    }
    Ok(())
}

/// A `fill` that fails leaves the pinned-byte counter where it was (it wrapped).
fn fill_error_accounting() -> Outcome {
    let b = Cuda::backend()?;
    let before = b.counters().pinned_bytes;
    let r = b.host().alloc_pinned(1 << 20, "failing fill", &mut |_| Err(offload_core::Error::Injected("fill".into())));
    crate::ensure!(r.is_err(), "a failing fill returned a buffer");
    let after = b.counters().pinned_bytes;
    crate::ensure!(after == before, "pinned bytes went from {before} to {after} after a failed fill");
    Ok(())
}

/// A host buffer or slot of another backend instance is refused by `copy_to_slot`
/// (its drop would drain another copy stream than the one reading it).
fn foreign_buffer_refused() -> Outcome {
    let (a, b) = (Cuda::backend()?, Cuda::backend()?);
    let host = a.host().alloc_pinned(4096, "foreign", &mut |x| {
        x.fill(7);
        Ok(())
    })?;
    let mut slot_b = b.alloc_slot(4096, "foreign")?;
    let r = b.copy_to_slot(&host, &mut slot_b, 4096, None);
    crate::ensure!(r.is_err(), "backend b copied from a host buffer of backend a");
    let mut slot_a = a.alloc_slot(4096, "foreign")?;
    let host_b = b.host().alloc_pinned(4096, "foreign", &mut |x| {
        x.fill(9);
        Ok(())
    })?;
    let r = b.copy_to_slot(&host_b, &mut slot_a, 4096, None);
    crate::ensure!(r.is_err(), "backend b copied into a slot of backend a");
    let mut fold = gpu_fold(&b)?;
    crate::ensure!(fold.fold(&b, &slot_a, 4096).is_err(), "backend b's fold read a slot of backend a (freed on a's stream)");
    a.free_slot(slot_a, None)?;
    b.free_slot(slot_b, None)?;
    a.synchronize()?;
    b.synchronize()?;
    Ok(())
}

/// With coding on, every block's host buffer is coded and a streamed step's
/// copies go through the decoder: fewer bytes on the wire than the blocks hold,
/// every coded copy counted, no damage reported (the bitwise cases check the
/// bytes themselves).
fn coded_copies_decode() -> Outcome {
    use offload_core::{resolve, HostStore, Plan, Ring};
    let b = CudaCoded::backend()?;
    let model = crate::model::TestModel::random(&crate::model::ModelShape { stacks: vec![3, 2], ..Default::default() }, 41);
    let store = std::sync::Arc::new(HostStore::build(&b, &model.inventory, &model.tensors)?);
    for (i, blk) in store.blocks().iter().enumerate() {
        crate::ensure!(blk.buffer().expect("held in memory").is_coded(), "block {i} ({}) is not coded", blk.id);
        crate::ensure!(
            blk.buffer().expect("held in memory").block_bytes()? == model.block_bytes(i).as_slice(),
            "block {i}: decoded host bytes differ"
        );
    }
    let raw: usize = store.blocks().iter().map(|blk| blk.bytes()).sum();
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory))?;
    let mut ring = Ring::new(b.clone(), store, &plan.components[0])?;
    // The ring copies its first blocks when it is made (its warm-up): count the
    // copies of a whole steady-state step, the second, as the sim row does.
    let step = |ring: &mut Ring<_>| -> offload_core::Result<()> {
        for i in 0..model.len() {
            ring.block_at(i)?.finish()?;
        }
        ring.end_step().map(drop)
    };
    step(&mut ring)?;
    let before = b.counters();
    step(&mut ring)?;
    let c = b.counters();
    ring.close()?;
    b.poll_error()?;
    let (copies, coded, wire) = (c.copies - before.copies, c.coded_copies - before.coded_copies, c.bytes_copied - before.bytes_copied);
    crate::ensure!(copies >= model.len() as u64, "{copies} copies in a step of {} streamed blocks", model.len());
    crate::ensure!(coded == copies, "{coded} of {copies} copies coded");
    crate::ensure!(wire < raw as u64, "{wire} bytes on the wire for {raw} bytes of blocks");
    Ok(())
}

/// The relay row carries shares through device 1: a 4 MiB block of random bytes
/// copied through a relayed backend lands whole (read back, byte for byte), and
/// device 1 carried its share of it.
fn copies_relayed() -> Outcome {
    let b = CudaRelay::backend()?;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let want: Vec<u8> = (0..4usize << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let host = b.host().alloc_pinned(want.len(), "relay check", &mut |d| {
        d.copy_from_slice(&want);
        Ok(())
    })?;
    let before: u64 = b.relayed_bytes().iter().map(|(_, n)| n).sum();
    let mut slot = b.alloc_slot(want.len(), "relay check")?;
    let ready = b.copy_to_slot(&host, &mut slot, want.len(), None)?;
    b.compute_wait(&ready)?;
    // The slot's bytes through the fold kernel (there is no device-to-host copy of
    // weights), against the host's fold of the same bytes.
    let mut acc = gpu_fold(&b)?;
    acc.fold(&b, &slot, want.len())?;
    let got = acc.read(&b)?;
    let carried: u64 = b.relayed_bytes().iter().map(|(_, n)| n).sum::<u64>() - before;
    b.free_slot(slot, Some(&b.record_compute()?))?;
    let expect = crate::model::fold_combine(SEED, crate::model::block_hash(&want));
    crate::ensure!(got == expect, "the relayed block folds to {got:#018x}, the host's bytes to {expect:#018x}");
    crate::ensure!(carried >= (want.len() / 4) as u64, "device 1 carried {carried} of {} bytes", want.len());
    Ok(())
}
