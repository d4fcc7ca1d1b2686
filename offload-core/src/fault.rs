//! A backend wrapper that fails the n-th operation of a kind, for testing that
//! every error path leaves the model intact and releases what it took.

use crate::backend::HostBufferOf;
use crate::backend::{MemoryInfo, OffloadBackend};
use crate::error::{Error, Result};
use crate::host::{Fill, HostCapabilities, HostKind, HostMemory};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The operations a [`FaultInjector`] can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// A host allocation ([`HostMemory::alloc`], every kind but pageable).
    HostAlloc,
    /// `alloc_slot`.
    SlotAlloc,
    /// `copy_to_slot`.
    Copy,
    /// `record_compute` and `compute_wait`.
    Event,
    /// `record_timing` (the timeline's events).
    Timing,
}

#[derive(Default)]
struct Counters {
    host: AtomicU64,
    slot: AtomicU64,
    copy: AtomicU64,
    event: AtomicU64,
    timing: AtomicU64,
    fail: std::sync::Mutex<Option<(FaultKind, u64)>>,
}

/// Wraps a backend and fails the n-th call of one [`FaultKind`] with
/// [`Error::Injected`]. Counting starts at 0 when armed.
#[derive(Clone)]
pub struct FaultInjector<B> {
    inner: B,
    counters: Arc<Counters>,
}

impl<B: OffloadBackend> FaultInjector<B> {
    /// Wrap `inner`, with no fault armed.
    pub fn new(inner: B) -> Self {
        FaultInjector { inner, counters: Arc::default() }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Fail the `n`-th call of `kind` from now on (and only that one).
    pub fn arm(&self, kind: FaultKind, n: u64) {
        for c in [&self.counters.host, &self.counters.slot, &self.counters.copy, &self.counters.event, &self.counters.timing] {
            c.store(0, Ordering::SeqCst);
        }
        *self.counters.fail.lock().unwrap_or_else(|e| e.into_inner()) = Some((kind, n));
    }

    /// Disarm.
    pub fn disarm(&self) {
        *self.counters.fail.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn tick(&self, kind: FaultKind, what: &str) -> Result<()> {
        tick(&self.counters, kind, what)
    }
}

fn tick(counters: &Counters, kind: FaultKind, what: &str) -> Result<()> {
    let c = match kind {
        FaultKind::HostAlloc => &counters.host,
        FaultKind::SlotAlloc => &counters.slot,
        FaultKind::Copy => &counters.copy,
        FaultKind::Event => &counters.event,
        FaultKind::Timing => &counters.timing,
    };
    let n = c.fetch_add(1, Ordering::SeqCst);
    if *counters.fail.lock().unwrap_or_else(|e| e.into_inner()) == Some((kind, n)) {
        return Err(Error::Injected(format!("{kind:?} #{n} ({what})")));
    }
    Ok(())
}

/// The host memory of a [`FaultInjector`]: the inner backend's, with its
/// allocations counted (and the armed one failed) as [`FaultKind::HostAlloc`].
#[derive(Clone)]
pub struct FaultHost<H> {
    inner: H,
    counters: Arc<Counters>,
}

impl<H: HostMemory> HostMemory for FaultHost<H> {
    type Buffer = H::Buffer;

    fn capabilities(&self) -> HostCapabilities {
        self.inner.capabilities()
    }

    fn decoder_staging_bytes(&self, largest_coded: usize) -> u64 {
        self.inner.decoder_staging_bytes(largest_coded)
    }

    fn alloc(&self, kind: HostKind<'_>, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<H::Buffer> {
        // A pageable buffer is the fallback after a failed pin: not counted.
        if matches!(kind, HostKind::Pageable) {
            return self.inner.alloc(kind, bytes, purpose, fill);
        }
        tick(&self.counters, FaultKind::HostAlloc, purpose)?;
        match self.inner.alloc(kind, bytes, purpose, fill) {
            // Not an allocation: the store asks for a plain buffer for this block
            // next, which counts it once.
            Err(e @ Error::Unsupported { .. }) if matches!(kind, HostKind::Coded | HostKind::Precoded { .. }) => {
                self.counters.host.fetch_sub(1, Ordering::SeqCst);
                Err(e)
            }
            r => r,
        }
    }
}

impl<B: OffloadBackend> OffloadBackend for FaultInjector<B> {
    type Host = FaultHost<B::Host>;
    type Slot = B::Slot;
    type Event = B::Event;
    type Wait = B::Wait;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn host(&self) -> FaultHost<B::Host> {
        FaultHost { inner: self.inner.host(), counters: self.counters.clone() }
    }
    fn record_timing(&self, on: crate::backend::StreamKind) -> Result<Option<Self::Event>> {
        self.tick(FaultKind::Timing, "record_timing")?;
        self.inner.record_timing(on)
    }
    fn elapsed_s(&self, from: &Self::Event, to: &Self::Event) -> Result<Option<f64>> {
        self.inner.elapsed_s(from, to)
    }
    fn compute_on_host(&self) -> bool {
        self.inner.compute_on_host()
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<Self::Slot> {
        self.tick(FaultKind::SlotAlloc, purpose)?;
        self.inner.alloc_slot(bytes, purpose)
    }
    fn free_slot(&self, slot: Self::Slot, after: Option<&Self::Event>) -> Result<()> {
        self.inner.free_slot(slot, after)
    }
    fn copy_to_slot(
        &self,
        src: &HostBufferOf<Self>,
        dst: &mut Self::Slot,
        bytes: usize,
        after: Option<&Self::Event>,
    ) -> Result<Self::Event> {
        self.tick(FaultKind::Copy, "copy")?;
        self.inner.copy_to_slot(src, dst, bytes, after)
    }
    fn compute_wait(&self, event: &Self::Event) -> Result<Self::Wait> {
        self.tick(FaultKind::Event, "compute_wait")?;
        self.inner.compute_wait(event)
    }
    fn record_compute(&self) -> Result<Self::Event> {
        self.tick(FaultKind::Event, "record_compute")?;
        self.inner.record_compute()
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn poll_error(&self) -> Result<()> {
        self.inner.poll_error()
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }
}
