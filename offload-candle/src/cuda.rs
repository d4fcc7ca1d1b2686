//! candle on CUDA (feature `cuda`): one slot per ring position wrapped once as a
//! candle CUDA tensor of the block dtype; a block's weights are `narrow`/`reshape`
//! views of it. Copies run on `offload-cuda`'s copy stream, compute on candle's
//! stream of the same context, ordered by the ring's events.

use crate::CandleBlockExt;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{DType as CDType, Device, Storage, Tensor};
use candle_nn::VarBuilder;
use offload_core::{BlockGuard, Error, MemoryInfo, OffloadBackend, Result, StreamKind};
use offload_cuda::cudarc::driver::CudaEvent;
use offload_cuda::{CudaBackend, CudaSlot, PinnedHost};
use std::collections::HashMap;
use std::sync::Arc;

/// candle on a CUDA device: the ring's transfer engine is `offload-cuda`'s, its
/// compute stream is candle's. Cheap to clone.
#[derive(Clone)]
pub struct CandleCudaBackend {
    inner: CudaBackend,
    dev: CudaDevice,
    dtype: CDType,
}

/// A slot: the device memory (owned by `offload-cuda`) and one candle tensor over
/// all of it. The tensor's storage never frees the memory (see [`Drop`]).
pub struct CandleSlot {
    raw: Option<CudaSlot>,
    tensor: Option<Tensor>,
}

impl CandleSlot {
    /// The whole slot as a 1-D tensor of the backend's dtype.
    pub fn tensor(&self) -> Option<&Tensor> {
        self.tensor.as_ref()
    }
}

impl Drop for CandleSlot {
    fn drop(&mut self) {
        // The tensor's `CudaSlice` would free the memory `raw` frees: leak the
        // tensor handle (one small allocation per slot) so only `raw` frees it.
        if let Some(t) = self.tensor.take() {
            std::mem::forget(t);
        }
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
        // SAFETY: called before any tensor exists; the ring orders every use of
        // slot memory with its own events (invariants 1 and 2).
        unsafe { dev.disable_event_tracking() };
        let stream = dev.cuda_stream();
        let inner = CudaBackend::with_compute_stream(stream.context().clone(), stream)?;
        Ok(CandleCudaBackend { inner, dev, dtype })
    }

    /// The candle device tensors are made on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.dev.clone())
    }

    /// The transfer engine (counters, streams).
    pub fn cuda(&self) -> &CudaBackend {
        &self.inner
    }

    fn wrap<T: CudaDType>(&self, raw: &CudaSlot, bytes: usize) -> Tensor {
        let n = bytes / std::mem::size_of::<T>();
        // The slice never frees the memory (`CandleSlot` leaks its handle): `raw`
        // stays the only owner and invariant 2 decides when it is freed.
        // SAFETY: `raw` is a live allocation of `bytes` bytes on this context.
        let slice: CudaSlice<T> = unsafe { self.dev.cuda_stream().upgrade_device_ptr(raw.device_ptr(), n) };
        let storage = CudaStorage::wrap_cuda_slice(slice, self.dev.clone());
        Tensor::from_storage(Storage::Cuda(storage), n, BackpropOp::none(), false)
    }

    /// The tensors of a block in `slot`, laid out as `layout`, named relative to
    /// `prefix`: views of the slot tensor, no copy.
    pub fn tensors(&self, slot: &CandleSlot, layout: &offload_core::BlockLayout, prefix: &str) -> Result<HashMap<String, Tensor>> {
        let whole = slot.tensor().ok_or_else(|| Error::Protocol("candle slot without its tensor".into()))?;
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
    type Event = Arc<CudaEvent>;

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
        let bytes = bytes.next_multiple_of(self.dtype.size_in_bytes());
        let raw = self.inner.alloc_slot(bytes, purpose)?;
        let tensor = match self.dtype {
            CDType::BF16 => self.wrap::<half::bf16>(&raw, bytes),
            CDType::F16 => self.wrap::<half::f16>(&raw, bytes),
            CDType::U8 => self.wrap::<u8>(&raw, bytes),
            _ => self.wrap::<f32>(&raw, bytes),
        };
        Ok(CandleSlot { raw: Some(raw), tensor: Some(tensor) })
    }
    fn free_slot(&self, mut slot: CandleSlot, after: Option<&Arc<CudaEvent>>) -> Result<()> {
        if let Some(t) = slot.tensor.take() {
            std::mem::forget(t);
        }
        match slot.raw.take() {
            Some(raw) => self.inner.free_slot(raw, after),
            None => Ok(()),
        }
    }
    fn copy_to_slot(&self, src: &PinnedHost, dst: &mut CandleSlot, bytes: usize, after: Option<&Arc<CudaEvent>>) -> Result<Arc<CudaEvent>> {
        let raw = dst.raw.as_mut().ok_or_else(|| Error::Protocol("copy into a freed candle slot".into()))?;
        self.inner.copy_to_slot(src, raw, bytes, after)
    }
    fn compute_wait(&self, event: &Arc<CudaEvent>) -> Result<()> {
        self.inner.compute_wait(event)
    }
    fn record_compute(&self) -> Result<Arc<CudaEvent>> {
        self.inner.record_compute()
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn poll_error(&self) -> Result<()> {
        self.inner.poll_error()
    }
    fn record_timing(&self, on: StreamKind) -> Result<Option<Arc<CudaEvent>>> {
        self.inner.record_timing(on)
    }
    fn elapsed_s(&self, from: &Arc<CudaEvent>, to: &Arc<CudaEvent>) -> Result<Option<f64>> {
        self.inner.elapsed_s(from, to)
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        self.inner.memory_info()
    }
}
