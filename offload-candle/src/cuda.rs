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
use offload_core::{BlockGuard, Error, OffloadBackend, Result};
use offload_cuda::protocol_log::CheckedEvent;
use offload_cuda::{CudaBackend, CudaHostBuffer, FrameworkBufferEngine, FrameworkBufferSlot};
use std::collections::HashMap;

/// candle on a CUDA device: the ring's transfer engine is `offload-cuda`'s (with a
/// fresh candle buffer per copy), its compute stream is candle's. Cheap to clone.
#[derive(Clone)]
pub struct CandleCudaBackend {
    engine: FrameworkBufferEngine,
    dev: CudaDevice,
    dtype: CDType,
}

/// A ring slot: the last block copied into it, as one 1-D candle tensor of the
/// backend's dtype that owns its memory ([`FrameworkBufferSlot::buffer`]).
pub type CandleSlot = FrameworkBufferSlot<Tensor>;

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
        Ok(CandleCudaBackend { engine: FrameworkBufferEngine::new(inner, "candle-cuda"), dev, dtype })
    }

    /// The candle device tensors are made on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.dev.clone())
    }

    offload_cuda::fresh_engine_methods!(engine, CandleSlot);

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
        let whole = slot.buffer().ok_or_else(|| Error::Protocol("candle slot read before any copy into it".into()))?;
        self.engine.note_read(slot);
        let elt = self.dtype.size_in_bytes();
        let mut map = HashMap::with_capacity(layout.tensors.len());
        for t in &layout.tensors {
            if crate::candle_dtype(t.spec.dtype) != Some(self.dtype) {
                return Err(Error::BadTensor {
                    tensor: t.spec.name.clone(),
                    fault: format!("dtype {:?}, but this CUDA backend streams {:?} blocks", t.spec.dtype, self.dtype),
                });
            }
            // A placement a layout makes, inside the slot (the offset then a whole
            // number of elements: 256-aligned).
            let range = t.range_in(whole.elem_count() * elt)?;
            let view = whole
                .narrow(0, range.start / elt, range.len() / elt)
                .and_then(|v| v.reshape(t.spec.shape.as_slice()))
                .map_err(|e| Error::BadTensor { tensor: t.spec.name.clone(), fault: e.to_string() })?;
            let name = t.spec.name.strip_prefix(prefix).unwrap_or(&t.spec.name).to_owned();
            crate::insert_once(&mut map, name, view, &t.spec.name)?;
        }
        Ok(map)
    }
}

impl CandleBlockExt for BlockGuard<'_, CandleCudaBackend> {
    fn block_vars(&self) -> Result<(crate::BlockVars, candle_core::Device)> {
        let prefix = format!("{}.", self.id());
        let map = self.backend().tensors(self.slot(), self.layout(), &prefix)?;
        Ok((crate::BlockVars::new(self.id().to_string(), map), self.backend().device()))
    }
}

impl OffloadBackend for CandleCudaBackend {
    /// The transfer engine's host memory, as it is.
    type Host = CudaBackend;
    type Slot = CandleSlot;
    type Event = CheckedEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        "candle-cuda"
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<CandleSlot> {
        // Whole elements: the slot tensor covers every byte the ring may copy.
        self.engine.alloc_slot(bytes.next_multiple_of(self.dtype.size_in_bytes()), purpose)
    }
    fn copy_to_slot(&self, src: &CudaHostBuffer, dst: &mut CandleSlot, bytes: usize, after: Option<&CheckedEvent>) -> Result<CheckedEvent> {
        // `new_buffer` allocates on candle's stream (the engine's compute stream), and
        // candle frees the buffer on that stream when the last reference drops.
        // SAFETY: `new_buffer` returns a candle tensor owning the memory at the address it gives.
        unsafe { self.engine.copy_to_slot(src, dst, bytes, after, |len| self.new_buffer(len)) }
    }
    offload_cuda::forward_to_framework_buffers!(engine);
}
