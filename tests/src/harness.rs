//! What a backend provides to be run by the conformance suite.

use offload_core::{OffloadBackend, Result};

/// Why a case did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaseError {
    /// The backend's hardware or library is missing here.
    Skip(String),
    /// The case failed.
    Fail(String),
}

impl<E: std::fmt::Display> From<E> for CaseError {
    fn from(e: E) -> Self {
        CaseError::Fail(e.to_string())
    }
}

/// A case's outcome.
pub type Outcome = std::result::Result<(), CaseError>;

/// Fail with `msg` unless `cond`.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        if !$cond {
            return Err($crate::CaseError::Fail(format!($($fmt)+)));
        }
    };
}

/// A case of one backend only (a real model streamed and compared byte for byte
/// with its resident run, a framework-boundary check): the suite's last rows,
/// `n/a` for backends without them.
pub struct ModelCase {
    /// Row name (`sd3_joint_blocks`).
    pub name: &'static str,
    /// The design invariants it checks.
    pub invariant: &'static str,
    /// Runs the case.
    pub run: fn() -> Outcome,
}

/// A backend as the conformance suite drives it: the backend itself plus a small
/// compute kernel (a fold over a block's bytes into an on-device accumulator) and
/// the counters the cases check.
pub trait Harness: 'static {
    /// The backend under test.
    type B: OffloadBackend;
    /// The on-device accumulator (an activation, read back at the end).
    type Acc;
    /// Row name in the conformance table.
    const NAME: &'static str;

    /// A fresh backend, or [`CaseError::Skip`] saying why there is none here.
    fn backend() -> std::result::Result<Self::B, CaseError>;
    /// A new accumulator holding [`crate::model::SEED`].
    fn new_acc(b: &Self::B) -> Result<Self::Acc>;
    /// Enqueue on the compute stream: `acc = fold_combine(acc, block_hash(slot[..bytes]))`.
    /// `waits` are the block's wait tokens (`BlockGuard::wait_token`): what an
    /// explicit-submission backend's fold submission waits on (stream backends
    /// already waited: their tokens are `()`).
    fn fold(
        b: &Self::B,
        acc: &mut Self::Acc,
        slot: &<Self::B as OffloadBackend>::Slot,
        bytes: usize,
        waits: &[<Self::B as OffloadBackend>::Wait],
    ) -> Result<()>;
    /// The host's fold of `model`'s blocks in `order`, as this backend's kernel
    /// computes it (the 64-bit fold of `model.rs` unless the kernel is another).
    fn reference(model: &crate::model::TestModel, order: &[usize]) -> u64 {
        model.reference(order)
    }
    /// Read the accumulator back to the host (waits for compute).
    fn read(b: &Self::B, acc: &Self::Acc) -> Result<u64>;
    /// Protocol violations the backend detected itself (only the simulated one can).
    fn violations(b: &Self::B) -> Vec<String>;
    /// Device bytes allocated through the backend now.
    fn live_bytes(b: &Self::B) -> u64;
    /// Peak of `live_bytes` since the last [`reset_peak`](Self::reset_peak).
    fn peak_bytes(b: &Self::B) -> u64;
    /// Restart the peak.
    fn reset_peak(b: &Self::B);
    /// Host synchronisations so far.
    fn host_syncs(b: &Self::B) -> u64;
    /// Page-locked host bytes the backend's buffers hold now, by the backend's
    /// own count (`None`: this row does not count them).
    fn host_pinned_bytes(_b: &Self::B) -> Option<u64> {
        None
    }
    /// Cases of this backend alone, after the shared ones: a real model run with
    /// its framework's own block code (candle: candle-transformers' SD3 joint
    /// blocks), what its tensors do after their block is released (invariant 10),
    /// checks of its safe API.
    fn model_cases() -> Vec<ModelCase> {
        Vec::new()
    }
    /// Open a checkpoint for `HostStore::build_mapped` the way this backend serves
    /// it in place (the CUDA rows map it with `offload_cuda::map_checkpoint`);
    /// elsewhere read with positioned reads (the simulator reads each block's range
    /// into its own memory; a backend without `host_in_region` gets copies).
    fn open_mapped(path: &std::path::Path) -> offload_core::Result<offload_core::SafetensorsFile> {
        offload_core::SafetensorsFile::open(path)
    }
    /// How many of a mapped store's buffers this row serves in place: all (`true`)
    /// or none (`false`: a backend that cannot register host memory, or one that
    /// codes every block).
    fn serves_mapped() -> bool {
        false
    }
    /// Whether this row decodes coded host buffers on its device
    /// (`OffloadBackend::alloc_host_coded`, `alloc_host_precoded`): the rows on
    /// the simulator (sim, sim-coded, tch's CPU row) and the CUDA ones (cuda,
    /// cuda-coded, candle-cuda, tch-cuda).
    fn decodes() -> bool {
        false
    }
    /// Whether this row refills host buffers (`OffloadBackend::refill_host`), which
    /// the disk tier's bounce buffers need: not where every buffer is coded, nor on
    /// a backend without it.
    fn refills_host() -> bool {
        true
    }
    /// The disk case's backend: as [`backend`](Self::backend), with copies slow
    /// enough that a bounce buffer's refill can overtake its last copy where the
    /// row can make them so; with `early_refill`, one whose `refill_host` does not
    /// wait for that copy (`Sabotage::EarlyRefill`, a bug in the backend's wait).
    /// A row that refills host buffers must say how to break it: the default
    /// fails the break rather than pass it or call it n/a.
    fn disk_backend(early_refill: bool) -> std::result::Result<Self::B, CaseError> {
        match early_refill {
            false => Self::backend(),
            true => Err(CaseError::Fail(format!(
                "{} {}: the row refills host buffers but its harness builds no backend that refills early (Harness::disk_backend)",
                crate::HARNESS_FAULT,
                Self::NAME
            ))),
        }
    }
}
