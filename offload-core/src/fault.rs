//! A backend wrapper that fails the n-th operation of a kind, for testing that
//! every error path leaves the model intact and releases what it took.

use crate::backend::{MemoryInfo, OffloadBackend};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The operations a [`FaultInjector`] can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// `alloc_host` (pinning host memory).
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
        let c = match kind {
            FaultKind::HostAlloc => &self.counters.host,
            FaultKind::SlotAlloc => &self.counters.slot,
            FaultKind::Copy => &self.counters.copy,
            FaultKind::Event => &self.counters.event,
            FaultKind::Timing => &self.counters.timing,
        };
        let n = c.fetch_add(1, Ordering::SeqCst);
        if *self.counters.fail.lock().unwrap_or_else(|e| e.into_inner()) == Some((kind, n)) {
            return Err(Error::Injected(format!("{kind:?} #{n} ({what})")));
        }
        Ok(())
    }
}

impl<B: OffloadBackend> OffloadBackend for FaultInjector<B> {
    type HostBuffer = B::HostBuffer;
    type Slot = B::Slot;
    type Event = B::Event;
    type Wait = B::Wait;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn alloc_host(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self::HostBuffer> {
        self.tick(FaultKind::HostAlloc, purpose)?;
        self.inner.alloc_host(bytes, purpose, fill)
    }
    fn alloc_host_pageable(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self::HostBuffer> {
        self.inner.alloc_host_pageable(bytes, purpose, fill)
    }
    fn alloc_host_coded(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self::HostBuffer> {
        self.tick(FaultKind::HostAlloc, purpose)?;
        match self.inner.alloc_host_coded(bytes, purpose, fill) {
            // Not an allocation: the store asks `alloc_host` for this block next,
            // which counts it once.
            Err(e @ Error::Unsupported { .. }) => {
                self.counters.host.fetch_sub(1, Ordering::SeqCst);
                Err(e)
            }
            r => r,
        }
    }
    fn alloc_host_precoded(
        &self,
        bytes: usize,
        coded_len: usize,
        purpose: &str,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Self::HostBuffer> {
        self.tick(FaultKind::HostAlloc, purpose)?;
        match self.inner.alloc_host_precoded(bytes, coded_len, purpose, fill) {
            // As for `alloc_host_coded`: the store asks `alloc_host` next.
            Err(e @ Error::Unsupported { .. }) => {
                self.counters.host.fetch_sub(1, Ordering::SeqCst);
                Err(e)
            }
            r => r,
        }
    }
    fn host_in_region(
        &self,
        region: &std::sync::Arc<dyn crate::HostRegion>,
        offset: usize,
        bytes: usize,
        purpose: &str,
    ) -> Result<Self::HostBuffer> {
        self.tick(FaultKind::HostAlloc, purpose)?;
        self.inner.host_in_region(region, offset, bytes, purpose)
    }
    fn refill_host(&self, buffer: &mut Self::HostBuffer, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        self.inner.refill_host(buffer, fill)
    }
    fn is_pinned(&self, buffer: &Self::HostBuffer) -> bool {
        self.inner.is_pinned(buffer)
    }
    fn host_held_bytes(&self, buffer: &Self::HostBuffer) -> Option<usize> {
        self.inner.host_held_bytes(buffer)
    }
    fn record_timing(&self, on: crate::StreamKind) -> Result<Option<Self::Event>> {
        self.tick(FaultKind::Timing, "record_timing")?;
        self.inner.record_timing(on)
    }
    fn elapsed_s(&self, from: &Self::Event, to: &Self::Event) -> Result<Option<f64>> {
        self.inner.elapsed_s(from, to)
    }
    fn host_bytes<'a>(&self, buffer: &'a Self::HostBuffer) -> Result<&'a [u8]> {
        self.inner.host_bytes(buffer)
    }
    fn host_is_pinned(&self) -> bool {
        self.inner.host_is_pinned()
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<Self::Slot> {
        self.tick(FaultKind::SlotAlloc, purpose)?;
        self.inner.alloc_slot(bytes, purpose)
    }
    fn free_slot(&self, slot: Self::Slot, after: Option<&Self::Event>) -> Result<()> {
        self.inner.free_slot(slot, after)
    }
    fn copy_to_slot(&self, src: &Self::HostBuffer, dst: &mut Self::Slot, bytes: usize, after: Option<&Self::Event>) -> Result<Self::Event> {
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
