//! Slots whose every copy lands in a fresh buffer of a framework's allocator: the
//! transfer engine of the candle and tch CUDA backends.
//!
//! A framework lends user code tensors that are reference counted (candle's
//! storage, libtorch's caching allocator), so a view may outlive its block. Copying
//! each block into a new buffer the framework owns — and letting the slot drop only
//! its own reference to the previous one — keeps every view reading its own block's
//! bytes (invariant 10). Each copy waits for an event recorded on the compute
//! stream right after the allocation; a buffer the slot lets go of is released in
//! the compute stream's order after the copy into it. The ring's protocol is kept
//! in a [`ProtocolLog`], which reports a broken release order that these buffers
//! make harmless.

use crate::checksum::DeviceSlot;
use crate::device::{CudaBackend, CudaCounters};
use crate::engine::CudaEvent;
use crate::host::CudaHostBuffer;
use crate::protocol_log::{CheckedEvent, ProtocolLog};
use offload_core::{Error, MemoryInfo, OffloadBackend, Result, StreamKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Device bytes the ring's slots hold (buffers that views keep alive after a slot
/// let them go belong to the framework and are not counted).
#[derive(Default)]
struct SlotBytes {
    live: AtomicU64,
    peak: AtomicU64,
}

/// The transfer engine with fresh framework buffers. Cheap to clone.
#[derive(Clone)]
pub struct FrameworkBufferEngine {
    inner: CudaBackend,
    name: &'static str,
    bytes: Arc<SlotBytes>,
    log: Arc<ProtocolLog>,
}

/// A ring slot: the buffer `T` (a framework tensor owning its memory) holding the
/// last block copied into it.
pub struct FrameworkBufferSlot<T> {
    id: u64,
    len: usize,
    current: Option<Held<T>>,
    bytes: Arc<SlotBytes>,
    /// The transfer engine: its compute stream orders the buffer's release.
    engine: CudaBackend,
}

struct Held<T> {
    buffer: T,
    ptr: u64,
    last_copy: CudaEvent,
}

impl<T> FrameworkBufferSlot<T> {
    /// The buffer of the last block copied into this slot (`None` before the first copy).
    pub fn buffer(&self) -> Option<&T> {
        self.current.as_ref().map(|h| &h.buffer)
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slot has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Let go of a slot's reference to a buffer. The framework frees (or caches) it,
/// in its compute stream's order, once no view holds it; first make that stream
/// wait for the copy into it (a prefetched block may never have been waited for).
/// If the wait cannot be enqueued the buffer is leaked, never freed under a copy.
fn retire<T>(engine: &CudaBackend, held: Held<T>) -> Result<()> {
    match engine.compute_wait(&held.last_copy) {
        Ok(()) => Ok(()),
        Err(e) => {
            std::mem::forget(held.buffer);
            Err(e)
        }
    }
}

impl<T> Drop for FrameworkBufferSlot<T> {
    fn drop(&mut self) {
        self.bytes.live.fetch_sub(self.len as u64, Ordering::Relaxed);
        // Dropped without `free_slot`: still order the buffer's release after its copy.
        if let Some(h) = self.current.take() {
            if let Err(e) = retire(&self.engine, h) {
                tracing::warn!("a {}-byte slot buffer is leaked: {e}", self.len);
            }
        }
    }
}

// The buffer owns its memory (`FrameworkBufferEngine::copy_to_slot`'s contract) while nobody
// resizes its storage through a handle to it (libtorch's `resize_`/`set_` on a
// shallow copy, Python's `untyped_storage().resize_(0)` on a lent tensor): the one
// kernel that reads a `DeviceSlot`, the conformance suite's fold, runs on slots
// whose buffers no caller holds.
// SAFETY: the borrow of the slot keeps the buffer alive, and the framework releases
// it in the order of the engine's compute stream, so kernels enqueued there while
// borrowed run first.
unsafe impl<T> DeviceSlot for FrameworkBufferSlot<T> {
    fn device_range(&self) -> (u64, usize) {
        self.current.as_ref().map_or((0, 0), |h| (h.ptr, self.len))
    }
    fn engine_id(&self) -> usize {
        self.engine.engine_id()
    }
}

impl FrameworkBufferEngine {
    /// An engine over `inner` (whose compute stream is the framework's), named
    /// `name` in errors (`"candle-cuda"`, `"tch-cuda"`).
    pub fn new(inner: CudaBackend, name: &'static str) -> Self {
        FrameworkBufferEngine { inner, name, bytes: Arc::default(), log: Arc::default() }
    }

    /// The transfer engine (streams, the checking mode).
    pub fn cuda(&self) -> &CudaBackend {
        &self.inner
    }

    /// Counters: the transfer engine's, with live and peak bytes those of the slots.
    pub fn counters(&self) -> CudaCounters {
        let mut c = self.inner.counters();
        c.live_bytes = self.bytes.live.load(Ordering::Relaxed);
        c.peak_bytes = self.bytes.peak.load(Ordering::Relaxed);
        c
    }

    /// Restart the peak at the live bytes.
    pub fn reset_peak(&self) {
        self.bytes.peak.store(self.bytes.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Violations of the ring's protocol seen so far.
    pub fn violations(&self) -> Vec<String> {
        self.log.violations()
    }

    /// Record that compute is about to read `slot` (its tensors were handed out,
    /// or a kernel over its buffer is enqueued).
    pub fn note_read<T>(&self, slot: &FrameworkBufferSlot<T>) {
        self.log.read(slot.id);
    }

    fn own<T>(&self, slot: &FrameworkBufferSlot<T>, what: &str) -> Result<()> {
        if Arc::ptr_eq(&slot.bytes, &self.bytes) {
            Ok(())
        } else {
            Err(Error::Protocol(format!("{what} a {} slot of another backend instance", self.name)))
        }
    }

    /// A slot of `bytes` (no buffer until the first copy).
    pub fn alloc_slot<T>(&self, bytes: usize, purpose: &str) -> Result<FrameworkBufferSlot<T>> {
        let free = self.inner.memory_info().map(|m| m.free).unwrap_or(u64::MAX);
        if bytes as u64 > free {
            return Err(Error::OutOfDeviceMemory { backend: self.name.into(), requested: bytes as u64, free, purpose: purpose.into() });
        }
        let live = self.bytes.live.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.bytes.peak.fetch_max(live, Ordering::Relaxed);
        Ok(FrameworkBufferSlot {
            id: self.log.new_slot(),
            len: bytes,
            current: None,
            bytes: self.bytes.clone(),
            engine: self.inner.clone(),
        })
    }

    /// Free a slot after `after`; its buffer is released after its copy.
    pub fn free_slot<T>(&self, mut slot: FrameworkBufferSlot<T>, after: Option<&CheckedEvent>) -> Result<()> {
        self.own(&slot, "freeing")?;
        self.log.free_slot(slot.id, after);
        if let Some(ev) = after {
            self.inner.compute_wait(ev.event())?;
        }
        match slot.current.take() {
            Some(h) => retire(&self.inner, h),
            None => Ok(()),
        }
    }

    /// Copy the first `bytes` of `src` into a fresh buffer `alloc(len)` returns,
    /// replacing the slot's previous one. `after` (a release, recorded on the
    /// compute stream) is logged; the allocation already follows it in that order.
    ///
    /// # Safety
    ///
    /// `alloc(len)` returns a buffer that owns `len` bytes of device memory of this
    /// engine's context at the returned address, allocated in the order of the
    /// engine's compute stream, and released (when dropped) in that order too.
    pub unsafe fn copy_to_slot<T>(
        &self,
        src: &CudaHostBuffer,
        dst: &mut FrameworkBufferSlot<T>,
        bytes: usize,
        after: Option<&CheckedEvent>,
        alloc: impl FnOnce(usize) -> Result<(T, u64)>,
    ) -> Result<CheckedEvent> {
        self.own(dst, "copy into")?;
        if bytes > dst.len {
            return Err(Error::Protocol(format!("copy of {bytes} bytes into a {}-byte slot", dst.len)));
        }
        if let Some(old) = dst.current.take() {
            retire(&self.inner, old)?;
        }
        let (buffer, ptr) = alloc(dst.len)?;
        // The copy waits for the compute stream to reach the allocation: the pool
        // may hand out memory that kernels enqueued just before still read.
        let allocated = self.inner.record_compute()?;
        // SAFETY: `ptr` addresses `dst.len` bytes owned by `buffer` (this function's
        // contract), which the slot keeps until `retire` orders its release after this copy.
        let ev = match unsafe { self.inner.copy_to_device(src, ptr, dst.len, bytes, Some(&allocated)) } {
            Ok(ev) => ev,
            Err(e) => {
                if self.inner.engine().is_lost() {
                    // The failed copy may still write the buffer: the framework must
                    // never get it back.
                    std::mem::forget(buffer);
                }
                return Err(e);
            }
        };
        dst.current = Some(Held { buffer, ptr, last_copy: ev.clone() });
        Ok(self.log.copy(dst.id, after, ev))
    }

    /// [`OffloadBackend::compute_wait`].
    pub fn compute_wait(&self, event: &CheckedEvent) -> Result<()> {
        self.log.wait(event);
        self.inner.compute_wait(event.event())
    }

    /// [`OffloadBackend::record_compute`].
    pub fn record_compute(&self) -> Result<CheckedEvent> {
        Ok(self.log.compute_event(self.inner.record_compute()?))
    }

    /// [`OffloadBackend::synchronize`]: every read before it is done.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()?;
        self.log.synchronized();
        Ok(())
    }

    /// [`OffloadBackend::record_timing`].
    pub fn record_timing(&self, on: StreamKind) -> Result<Option<CheckedEvent>> {
        Ok(self.inner.record_timing(on)?.map(ProtocolLog::timing_event))
    }

    /// [`OffloadBackend::elapsed_s`].
    pub fn elapsed_s(&self, from: &CheckedEvent, to: &CheckedEvent) -> Result<Option<f64>> {
        self.inner.elapsed_s(from.event(), to.event())
    }

    /// [`OffloadBackend::memory_info`].
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }
}

/// The inherent methods every backend over a [`FrameworkBufferEngine`] offers as the
/// engine does (the transfer engine, counters, violations, `note_read`,
/// `reset_peak`): write `offload_cuda::fresh_engine_methods!(engine, Slot);`
/// inside the backend's own `impl`, `engine` the field holding the engine and
/// `Slot` its slot type (a [`FrameworkBufferSlot`]).
#[macro_export]
macro_rules! fresh_engine_methods {
    ($engine:ident, $slot:ty) => {
        /// The transfer engine (streams, the checking mode).
        pub fn cuda(&self) -> &$crate::CudaBackend {
            self.$engine.cuda()
        }

        /// Counters: the transfer engine's, with live and peak bytes those of the
        /// ring's slots (buffers that views keep alive after the ring let them go
        /// are the framework's).
        pub fn counters(&self) -> $crate::CudaCounters {
            self.$engine.counters()
        }

        /// Violations of the ring's protocol seen so far. Copies land in fresh
        /// buffers ordered after all compute, so a broken ring still computes the
        /// right result; the log (which copy filled a slot, when its tensors were
        /// handed out, which event released it) shows the break anyway.
        pub fn violations(&self) -> Vec<String> {
            self.$engine.violations()
        }

        /// Record that compute is about to read `slot` other than through the
        /// backend's own views (a kernel over the slot's buffer).
        pub fn note_read(&self, slot: &$slot) {
            self.$engine.note_read(slot);
        }

        /// Restart the peak at the live bytes.
        pub fn reset_peak(&self) {
            self.$engine.reset_peak()
        }
    };
}

/// The [`OffloadBackend`] methods a backend over a [`FrameworkBufferEngine`] forwards as
/// they are (its host memory, freeing slots, waits, events, timing, memory):
/// write `offload_cuda::forward_to_framework_buffers!(engine);` inside its
/// `impl OffloadBackend`, `engine` the field holding the engine, and write
/// `name`, `alloc_slot` and `copy_to_slot` (the framework's buffers) yourself.
#[macro_export]
macro_rules! forward_to_framework_buffers {
    ($engine:ident) => {
        fn host(&self) -> Self::Host {
            self.$engine.cuda().clone()
        }
        fn free_slot(&self, slot: Self::Slot, after: Option<&Self::Event>) -> ::offload_core::Result<()> {
            self.$engine.free_slot(slot, after)
        }
        fn compute_wait(&self, event: &Self::Event) -> ::offload_core::Result<()> {
            self.$engine.compute_wait(event)
        }
        fn record_compute(&self) -> ::offload_core::Result<Self::Event> {
            self.$engine.record_compute()
        }
        fn synchronize(&self) -> ::offload_core::Result<()> {
            self.$engine.synchronize()
        }
        fn poll_error(&self) -> ::offload_core::Result<()> {
            self.$engine.cuda().poll_error()
        }
        fn record_timing(&self, on: ::offload_core::StreamKind) -> ::offload_core::Result<Option<Self::Event>> {
            self.$engine.record_timing(on)
        }
        fn elapsed_s(&self, from: &Self::Event, to: &Self::Event) -> ::offload_core::Result<Option<f64>> {
            self.$engine.elapsed_s(from, to)
        }
        fn memory_info(&self) -> ::offload_core::Result<::offload_core::MemoryInfo> {
            self.$engine.memory_info()
        }
    };
}
