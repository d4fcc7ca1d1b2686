//! candle on CUDA (feature `cuda`): each copy into a ring slot lands in a fresh
//! candle tensor, allocated by candle's own allocator on candle's stream, and a
//! block's weights are `narrow`/`reshape` views of it. Copies run on
//! `offload-cuda`'s copy stream, compute on candle's stream of the same context,
//! ordered by the ring's events.
//!
//! Why a fresh tensor per copy (invariant 10): candle's tensors are reference
//! counted and a `VarBuilder`, a module built from it, or any view made from them
//! may outlive the block guard. Each view keeps its buffer — and so its block's
//! bytes — alive; the ring's slot only lets go of its reference, and candle frees
//! the memory (stream-ordered, after every kernel enqueued before the last view
//! dropped) when nothing holds it. SGLang and vLLM-Omni do the same; the pool
//! reuses the memory at once, so it costs no copy and no host synchronisation.

use crate::CandleBlockExt;
use candle_core::cuda_backend::cudarc;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType as CDType, Device, Storage, Tensor};
use candle_nn::VarBuilder;
use offload_core::{BlockGuard, Error, MemoryInfo, OffloadBackend, Result, StreamKind};
use offload_cuda::checked::{CheckedEvent, ProtocolLog};
use offload_cuda::cudarc::driver::CudaEvent;
use offload_cuda::{CudaBackend, CudaCounters, DeviceSlot, PinnedHost};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// candle on a CUDA device: the ring's transfer engine is `offload-cuda`'s, its
/// compute stream is candle's. Cheap to clone.
#[derive(Clone)]
pub struct CandleCudaBackend {
    inner: CudaBackend,
    dev: CudaDevice,
    dtype: CDType,
    slot_bytes: Arc<SlotBytes>,
    log: Arc<ProtocolLog>,
}

/// Device bytes the ring's slots hold (buffers a user's views keep alive after
/// the ring let them go are candle's, not counted here).
#[derive(Default)]
struct SlotBytes {
    live: AtomicU64,
    peak: AtomicU64,
}

/// A ring slot: the buffer holding the last block copied into it, as one candle
/// tensor that owns its memory.
pub struct CandleSlot {
    id: u64,
    len: usize,
    current: Option<Buffer>,
    slot_bytes: Arc<SlotBytes>,
    /// The transfer engine: its compute stream orders the buffer's release.
    engine: CudaBackend,
}

struct Buffer {
    tensor: Tensor,
    ptr: u64,
    last_copy: Arc<CudaEvent>,
}

impl CandleSlot {
    /// The buffer of the last block copied into this slot, as a 1-D tensor of
    /// the backend's dtype (`None` before the first copy).
    pub fn tensor(&self) -> Option<&Tensor> {
        self.current.as_ref().map(|b| &b.tensor)
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

impl Drop for CandleSlot {
    fn drop(&mut self) {
        self.slot_bytes.live.fetch_sub(self.len as u64, Ordering::Relaxed);
        // Dropped without `free_slot`: still order the buffer's release after its copy.
        if let Some(b) = self.current.take() {
            if let Err(e) = retire(&self.engine, b) {
                tracing::warn!("a {}-byte slot buffer is leaked: {e}", self.len);
            }
        }
    }
}

/// Let go of a slot's reference to a buffer. The framework frees (or caches) it,
/// in its compute stream's order, once no view holds it; first make that stream
/// wait for the copy into it (a prefetched block may never have been waited
/// for). If the wait cannot be enqueued the buffer is leaked, never freed under
/// a running copy.
fn retire(engine: &CudaBackend, b: Buffer) -> Result<()> {
    match engine.compute_wait(&b.last_copy) {
        Ok(()) => Ok(()),
        Err(e) => {
            std::mem::forget(b.tensor);
            Err(e)
        }
    }
}

// SAFETY: the buffer is a candle tensor owning its memory; the borrow of the slot
// keeps `current` (and so the tensor) alive, and candle frees it on its stream — the
// engine's compute stream — so kernels enqueued there while borrowed run first.
unsafe impl DeviceSlot for CandleSlot {
    fn device_range(&self) -> (u64, usize) {
        self.current.as_ref().map_or((0, 0), |b| (b.ptr, self.len))
    }
    fn engine_id(&self) -> usize {
        self.engine.engine_id()
    }
}

impl CandleCudaBackend {
    /// CUDA device `ordinal`, blocks of dtype `dtype` (every streamed tensor must
    /// have it; `U8` serves raw bytes). candle computes on a non-blocking stream of
    /// its own.
    pub fn new(ordinal: usize, dtype: CDType) -> Result<Self> {
        if !matches!(dtype, CDType::BF16 | CDType::F16 | CDType::F32 | CDType::U8) {
            return Err(Error::unsupported("candle", format!("blocks of dtype {dtype:?} on CUDA (bf16, f16, f32 or u8)")));
        }
        let dev = CudaDevice::new_with_stream(ordinal).map_err(crate::candle_error(&format!("opening CUDA device {ordinal}")))?;
        // candle keeps cudarc's event tracking on for its device: its tensors order
        // themselves across streams; the ring's raw copies are ordered by events.
        let stream = dev.cuda_stream();
        let inner = CudaBackend::with_compute_stream(stream.context().clone(), stream)?;
        Ok(CandleCudaBackend { inner, dev, dtype, slot_bytes: Arc::default(), log: Arc::default() })
    }

    /// The candle device tensors are made on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.dev.clone())
    }

    /// The transfer engine (streams, the checking mode).
    pub fn cuda(&self) -> &CudaBackend {
        &self.inner
    }

    /// Counters: the transfer engine's, with live and peak bytes those of the
    /// ring's slots.
    pub fn counters(&self) -> CudaCounters {
        let mut c = self.inner.counters();
        c.live_bytes = self.slot_bytes.live.load(Ordering::Relaxed);
        c.peak_bytes = self.slot_bytes.peak.load(Ordering::Relaxed);
        c
    }

    /// Violations of the ring's protocol seen so far. Copies here land in fresh
    /// buffers ordered after all compute, so a broken ring still computes the right
    /// result; the log (which copy filled a slot, when its tensors were handed out,
    /// which event released it) shows the break anyway.
    pub fn violations(&self) -> Vec<String> {
        self.log.violations()
    }

    /// Record that compute is about to read `slot` other than through
    /// [`tensors`](Self::tensors) (a kernel over the slot's buffer).
    pub fn note_read(&self, slot: &CandleSlot) {
        self.log.read(slot.id);
    }

    /// Restart the peak at the live bytes.
    pub fn reset_peak(&self) {
        self.slot_bytes.peak.store(self.slot_bytes.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// A new buffer of `bytes` (whole elements of the backend's dtype) from
    /// candle's allocator on candle's stream, and its device address.
    fn new_buffer(&self, bytes: usize) -> Result<(Tensor, u64)> {
        fn make<T: CudaDType + cudarc::driver::DeviceRepr>(dev: &CudaDevice, bytes: usize) -> Result<(Tensor, u64)> {
            let n = bytes / std::mem::size_of::<T>();
            let stream = dev.cuda_stream();
            // The buffer is written by a copy before compute may read it (the ring
            // waits for the copy's event); until then it holds old device bytes.
            // SAFETY: a stream-ordered allocation of `n` elements on candle's stream.
            let slice: CudaSlice<T> = unsafe { stream.alloc::<T>(n) }
                .map_err(|e| Error::device("candle-cuda", format!("allocating a {bytes}-byte slot buffer"), e))?;
            let ptr = slice.device_ptr(&stream).0;
            let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
            Ok((Tensor::from_storage(Storage::Cuda(storage), n, BackpropOp::none(), false), ptr))
        }
        match self.dtype {
            CDType::BF16 => make::<half::bf16>(&self.dev, bytes),
            CDType::F16 => make::<half::f16>(&self.dev, bytes),
            CDType::U8 => make::<u8>(&self.dev, bytes),
            _ => make::<f32>(&self.dev, bytes),
        }
    }

    /// The tensors of a block in `slot`, laid out as `layout`, named relative to
    /// `prefix`: views of the slot's buffer, no copy. They keep the buffer alive
    /// after the block is released.
    pub fn tensors(&self, slot: &CandleSlot, layout: &offload_core::BlockLayout, prefix: &str) -> Result<HashMap<String, Tensor>> {
        let whole = slot.tensor().ok_or_else(|| Error::Protocol("candle slot read before any copy into it".into()))?;
        self.log.read(slot.id);
        let elt = self.dtype.size_in_bytes();
        let mut map = HashMap::with_capacity(layout.tensors.len());
        for t in &layout.tensors {
            if crate::candle_dtype(t.spec.dtype) != Some(self.dtype) {
                return Err(Error::BadTensor {
                    tensor: t.spec.name.clone(),
                    fault: format!("dtype {:?}, but this CUDA backend streams {:?} blocks", t.spec.dtype, self.dtype),
                });
            }
            let view = whole
                .narrow(0, t.offset / elt, t.nbytes / elt)
                .and_then(|v| v.reshape(t.spec.shape.as_slice()))
                .map_err(|e| Error::BadTensor { tensor: t.spec.name.clone(), fault: e.to_string() })?;
            map.insert(t.spec.name.strip_prefix(prefix).unwrap_or(&t.spec.name).to_owned(), view);
        }
        Ok(map)
    }
}

impl CandleBlockExt for BlockGuard<'_, CandleCudaBackend> {
    fn var_builder(&self, dtype: CDType) -> Result<VarBuilder<'static>> {
        let prefix = format!("{}.", self.id());
        let map = self.backend().tensors(self.slot(), self.layout(), &prefix)?;
        Ok(crate::BlockVars::new(self.id().to_string(), map).into_var_builder(dtype, &self.backend().device()))
    }
}

impl OffloadBackend for CandleCudaBackend {
    type HostBuffer = PinnedHost;
    type Slot = CandleSlot;
    type Event = CheckedEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        "candle-cuda"
    }
    fn alloc_host(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
        self.inner.alloc_host(bytes, purpose, fill)
    }
    fn alloc_host_pageable(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
        self.inner.alloc_host_pageable(bytes, purpose, fill)
    }
    fn is_pinned(&self, buffer: &PinnedHost) -> bool {
        self.inner.is_pinned(buffer)
    }
    fn host_bytes<'a>(&self, buffer: &'a PinnedHost) -> &'a [u8] {
        self.inner.host_bytes(buffer)
    }
    fn host_is_pinned(&self) -> bool {
        self.inner.host_is_pinned()
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<CandleSlot> {
        // Whole elements: the slot tensor covers every byte the ring may copy.
        let len = bytes.next_multiple_of(self.dtype.size_in_bytes());
        let free = self.inner.memory_info().map(|m| m.free).unwrap_or(u64::MAX);
        if len as u64 > free {
            return Err(Error::OutOfDeviceMemory { backend: "candle-cuda".into(), requested: len as u64, free, purpose: purpose.into() });
        }
        let live = self.slot_bytes.live.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
        self.slot_bytes.peak.fetch_max(live, Ordering::Relaxed);
        Ok(CandleSlot { id: self.log.new_slot(), len, current: None, slot_bytes: self.slot_bytes.clone(), engine: self.inner.clone() })
    }
    fn free_slot(&self, mut slot: CandleSlot, after: Option<&CheckedEvent>) -> Result<()> {
        if !Arc::ptr_eq(&slot.slot_bytes, &self.slot_bytes) {
            return Err(Error::Protocol("freeing a candle slot of another backend instance".into()));
        }
        self.log.free_slot(slot.id, after);
        if let Some(ev) = after {
            self.inner.compute_wait(ev.event())?;
        }
        match slot.current.take() {
            Some(b) => retire(&self.inner, b),
            None => Ok(()),
        }
    }
    fn copy_to_slot(&self, src: &PinnedHost, dst: &mut CandleSlot, bytes: usize, after: Option<&CheckedEvent>) -> Result<CheckedEvent> {
        if !Arc::ptr_eq(&dst.slot_bytes, &self.slot_bytes) {
            return Err(Error::Protocol("copy into a candle slot of another backend instance".into()));
        }
        if bytes > dst.len {
            return Err(Error::Protocol(format!("copy of {bytes} bytes into a {}-byte slot", dst.len)));
        }
        // `after` (the previous block's release) was recorded on candle's stream,
        // so the allocation below, on the same stream, already follows it.
        let _ = after;
        if let Some(old) = dst.current.take() {
            retire(&self.inner, old)?;
        }
        let (tensor, ptr) = self.new_buffer(dst.len)?;
        // The copy waits for candle's stream to reach the allocation: memory the
        // pool hands out may have been read by kernels enqueued just before.
        let allocated = self.inner.record_compute()?;
        // SAFETY: `ptr` addresses `dst.len` bytes owned by `tensor`, which the slot
        // keeps until `retire`, which orders the free after this copy's event.
        let ev = unsafe { self.inner.copy_to_device(src, ptr, dst.len, bytes, Some(&allocated))? };
        dst.current = Some(Buffer { tensor, ptr, last_copy: ev.clone() });
        Ok(self.log.copy(dst.id, after, ev))
    }
    fn compute_wait(&self, event: &CheckedEvent) -> Result<()> {
        self.log.wait(event);
        self.inner.compute_wait(event.event())
    }
    fn record_compute(&self) -> Result<CheckedEvent> {
        Ok(self.log.compute_event(self.inner.record_compute()?))
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()?;
        self.log.synchronized();
        Ok(())
    }
    fn poll_error(&self) -> Result<()> {
        self.inner.poll_error()
    }
    fn record_timing(&self, on: StreamKind) -> Result<Option<CheckedEvent>> {
        Ok(self.inner.record_timing(on)?.map(ProtocolLog::timing_event))
    }
    fn elapsed_s(&self, from: &CheckedEvent, to: &CheckedEvent) -> Result<Option<f64>> {
        self.inner.elapsed_s(from.event(), to.event())
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }
}
