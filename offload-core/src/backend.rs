//! The device primitives a backend gives the ring.
//!
//! A backend names five things (static dispatch, associated types): the backend
//! handle itself (a cheap `Clone` over an `Arc`), its host memory (a capability
//! of its own, [`crate::host`]), device slots, and events. The ring uses nothing else, so a new backend is this trait
//! plus the conformance suite in `tests/`.
//!
//! The model of execution: one *copy queue* that runs host-to-device copies in
//! order, the *compute* where the model's kernels run, and events between them.
//! Two kinds of API fit it:
//!
//! - **Stream APIs** (CUDA, and the frameworks on it): compute is a stream that is
//!   always there. [`OffloadBackend::compute_wait`] enqueues the wait on that stream
//!   and returns `()`; [`OffloadBackend::record_compute`] records an event after
//!   everything enqueued so far.
//! - **Explicit-submission APIs** (Vulkan, D3D12, Metal): nothing runs until it is
//!   submitted, and a wait only orders the submission that carries it. There
//!   `compute_wait` returns a *wait token* ([`OffloadBackend::Wait`], e.g. a
//!   timeline semaphore and value) that the user's submission reading the block
//!   must wait on ([`BlockGuard::wait_token`](crate::ring::BlockGuard::wait_token)), and
//!   the release is either the event the user's submission signals
//!   ([`BlockGuard::finish_after`](crate::ring::BlockGuard::finish_after)) or one the
//!   backend signals after everything submitted so far (`record_compute`, an empty
//!   submission in queue order).
//!
//! A backend whose compute is synchronous host code (the simulated backend,
//! candle's CPU device) treats the calling thread as its compute stream.

use crate::error::Result;
use crate::host::HostMemory;

/// The host buffer type of backend `B`.
pub type HostBufferOf<B> = <<B as OffloadBackend>::Host as HostMemory>::Buffer;

/// Free and total device memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes free on the device.
    pub free: u64,
    /// Bytes in all.
    pub total: u64,
}

/// The two streams of the execution model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// Where host-to-device copies run.
    Copy,
    /// Where the model computes.
    Compute,
}

/// Device primitives for streaming immutable weights host → device.
///
/// Protocol (the ring keeps it; the simulated backend checks it):
/// 1. a slot is read by compute only after [`compute_wait`](Self::compute_wait) on
///    the event of the copy that filled it;
/// 2. a copy into a slot that compute has read is issued with `after` set to an
///    event recorded by [`record_compute`](Self::record_compute) after the last read;
/// 3. nothing in the steady state blocks the host;
/// 4. there is no device-to-host copy of weights: the trait has none.
///
/// 5. what a framework lends user code for a block (tensors, views, autograd's
///    saved tensors) either cannot outlive the block or keeps the block's bytes
///    alive on its own (invariant 10 of `ARCHITECTURE.md`); a backend whose slots are
///    reused in place documents what the user must not keep.
///
/// Memory safety does not depend on the protocol: a backend keeps every host buffer
/// and slot handed to an asynchronous copy alive until that copy has finished
/// (host buffers are shared `Arc`s; freeing a slot is ordered after its copies).
pub trait OffloadBackend: Clone + Send + Sync + 'static {
    /// Where host buffers come from: a capability of its own ([`HostMemory`]),
    /// which a backend wrapping another hands out as it is.
    type Host: HostMemory;
    /// Device memory holding one block's bytes.
    type Slot: Send + 'static;
    /// A point on a stream that other work can wait for.
    type Event: Clone + Send + Sync + 'static;
    /// What compute must still do before it reads a block, beyond what
    /// [`compute_wait`](Self::compute_wait) already did: `()` on stream APIs (the
    /// wait is enqueued on the compute stream), a wait token for the user's next
    /// submission on explicit-submission APIs.
    type Wait: Clone + Send + Sync + 'static;

    /// Short backend name for errors and metrics (`"sim"`, `"cuda"`, …).
    fn name(&self) -> &'static str;

    /// The backend's host memory: every host buffer the store and the disk tier
    /// use comes from it, and [`copy_to_slot`](Self::copy_to_slot) copies from
    /// its buffers.
    fn host(&self) -> Self::Host;

    /// Allocate a device slot of `bytes`. `purpose` names the block for errors.
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<Self::Slot>;

    /// Release a slot once `after` (an event recorded after its last use) has
    /// completed. Never blocks the host.
    fn free_slot(&self, slot: Self::Slot, after: Option<&Self::Event>) -> Result<()>;

    /// Enqueue on the copy stream: wait for `after` (if any), then copy the first
    /// `bytes` of `src` into `dst`. Returns an event that completes with the copy.
    fn copy_to_slot(
        &self,
        src: &HostBufferOf<Self>,
        dst: &mut Self::Slot,
        bytes: usize,
        after: Option<&Self::Event>,
    ) -> Result<Self::Event>;

    /// Order compute after `event`: on a stream API, make the compute stream wait
    /// for it before any later work and return `()`; on an explicit-submission API,
    /// return the token the next submission that reads the block must wait on.
    /// The host does not wait (except where compute is host code).
    fn compute_wait(&self, event: &Self::Event) -> Result<Self::Wait>;

    /// An event that completes once all compute enqueued (submitted) so far has
    /// run: the release of a block's slot.
    fn record_compute(&self) -> Result<Self::Event>;

    /// Block the host until both streams are idle. Used at teardown and on
    /// errors, never in the steady state.
    fn synchronize(&self) -> Result<()>;

    /// Report an error the device raised asynchronously since the last call
    /// (CUDA's deferred errors). Called at step boundaries; never blocks.
    fn poll_error(&self) -> Result<()> {
        Ok(())
    }

    /// Record a timing event on stream `on` (for the timeline and the stall
    /// metrics, only when they are enabled). `None` where the backend cannot time.
    fn record_timing(&self, _on: StreamKind) -> Result<Option<Self::Event>> {
        Ok(None)
    }

    /// Seconds between two timing events (may wait for both to complete).
    fn elapsed_s(&self, _from: &Self::Event, _to: &Self::Event) -> Result<Option<f64>> {
        Ok(None)
    }

    /// Whether this backend's compute runs on the calling host thread (the
    /// simulated device, a CPU device): its "device" time is the host's.
    fn compute_on_host(&self) -> bool {
        false
    }

    /// Free and total device memory.
    fn memory_info(&self) -> Result<MemoryInfo> {
        Err(crate::error::Error::unsupported(self.name(), "memory_info"))
    }
}
