//! The candle backend of `offload`: stream a model's blocks and run them with
//! candle's own, unmodified block code.
//!
//! Design choices:
//!
//! - **Unmodified blocks.** A block's weights reach candle-nn / candle-transformers
//!   code through a `VarBuilder` ([`CandleBlockExt::var_builder`]): build the block
//!   per call (`Block::new(cfg, vb)` only clones handles) and run its `forward`.
//! - **CPU device: host memory is the device.** On `Device::Cpu` the ring's "device"
//!   is host memory: copies into slots run on a worker thread (the simulated
//!   backend of `offload-core`, whose protocol checks stay on), and candle's CPU
//!   tensors own their storage, so each weight is materialised from the slot with
//!   one copy when the block's `VarBuilder` is built. This is the CI path: the
//!   protocol and the bitwise checks apply as on a GPU.
//! - **CUDA (feature `cuda`): no copy beyond the host-to-device one.**
//!   `CandleCudaBackend` wraps each ring slot once as a candle CUDA tensor (through
//!   candle's own cudarc, event tracking off) and serves a block's weights as
//!   `narrow`/`reshape` views of it; copies run on `offload-cuda`'s copy stream,
//!   candle computes on its own stream, ordered by the ring's events. Blocks must
//!   have one dtype (the backend's).

use candle_core::{DType as CDType, Device, Tensor};
use candle_nn::VarBuilder;
use offload_core::sim::{SimBackend, SimConfig, SimEvent, SimHost, SimSlot};
use offload_core::{BlockGuard, BlockLayout, DType, Error, MemoryInfo, OffloadBackend, Result, StreamKind};
use std::collections::HashMap;

pub mod flux;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
pub use cuda::{CandleCudaBackend, CandleSlot};

/// The candle backend. Cheap to clone.
#[derive(Clone)]
pub struct CandleBackend {
    device: SimBackend,
}

impl CandleBackend {
    /// The CPU device: host memory as device memory, copies on a worker thread.
    pub fn cpu() -> Self {
        CandleBackend { device: SimBackend::new(SimConfig::fast()) }
    }

    /// The candle device tensors are made on.
    pub fn device(&self) -> Device {
        Device::Cpu
    }

    /// The underlying host-memory device (its counters and protocol checks).
    pub fn host_device(&self) -> &SimBackend {
        &self.device
    }

    /// The tensors of a block in `slot`, laid out as `layout`, as candle tensors
    /// named relative to `prefix` (`"double_blocks.3."` is stripped).
    pub fn tensors(&self, slot: &SimSlot, layout: &BlockLayout, prefix: &str) -> Result<HashMap<String, Tensor>> {
        self.device.read_slot(slot, |bytes| {
            let mut map = HashMap::with_capacity(layout.tensors.len());
            for t in &layout.tensors {
                let dtype = candle_dtype(t.spec.dtype).ok_or_else(|| Error::BadTensor {
                    tensor: t.spec.name.clone(),
                    fault: format!("dtype {:?} has no candle equivalent", t.spec.dtype),
                })?;
                let raw = &bytes[t.offset..t.offset + t.nbytes];
                let tensor = Tensor::from_raw_buffer(raw, dtype, &t.spec.shape, &Device::Cpu)
                    .map_err(|e| Error::BadTensor { tensor: t.spec.name.clone(), fault: e.to_string() })?;
                let name = t.spec.name.strip_prefix(prefix).unwrap_or(&t.spec.name).to_owned();
                map.insert(name, tensor);
            }
            Ok(map)
        })
    }
}

/// The candle dtype of an offload dtype.
pub fn candle_dtype(d: DType) -> Option<CDType> {
    Some(match d {
        DType::U8 => CDType::U8,
        DType::U32 => CDType::U32,
        DType::I64 => CDType::I64,
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
        DType::F32 => CDType::F32,
        DType::F64 => CDType::F64,
        _ => return None,
    })
}

/// A streamed block as candle sees it.
pub trait CandleBlockExt {
    /// A `VarBuilder` over the block's weights, named relative to the block
    /// (`attn.qkv.weight` for `joint_blocks.3.x_block.attn.qkv.weight` is
    /// `vb.pp("x_block").pp("attn")…`); `dtype` is the builder's dtype.
    fn var_builder(&self, dtype: CDType) -> Result<VarBuilder<'static>>;
}

impl CandleBlockExt for BlockGuard<'_, CandleBackend> {
    fn var_builder(&self, dtype: CDType) -> Result<VarBuilder<'static>> {
        let prefix = format!("{}.", self.id());
        let map = self.backend().tensors(self.slot(), self.layout(), &prefix)?;
        Ok(VarBuilder::from_tensors(map, dtype, &Device::Cpu))
    }
}

impl OffloadBackend for CandleBackend {
    type HostBuffer = SimHost;
    type Slot = SimSlot;
    type Event = SimEvent;

    fn name(&self) -> &'static str {
        "candle"
    }
    fn alloc_host(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<SimHost> {
        self.device.alloc_host(bytes, purpose, fill)
    }
    fn alloc_host_pageable(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<SimHost> {
        self.device.alloc_host_pageable(bytes, purpose, fill)
    }
    fn is_pinned(&self, _buffer: &SimHost) -> bool {
        // Host memory is the device here: nothing is page-locked.
        false
    }
    fn host_bytes<'a>(&self, buffer: &'a SimHost) -> &'a [u8] {
        self.device.host_bytes(buffer)
    }
    fn host_is_pinned(&self) -> bool {
        false
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<SimSlot> {
        self.device.alloc_slot(bytes, purpose)
    }
    fn free_slot(&self, slot: SimSlot, after: Option<&SimEvent>) -> Result<()> {
        self.device.free_slot(slot, after)
    }
    fn copy_to_slot(&self, src: &SimHost, dst: &mut SimSlot, bytes: usize, after: Option<&SimEvent>) -> Result<SimEvent> {
        self.device.copy_to_slot(src, dst, bytes, after)
    }
    fn compute_wait(&self, event: &SimEvent) -> Result<()> {
        self.device.compute_wait(event)
    }
    fn record_compute(&self) -> Result<SimEvent> {
        self.device.record_compute()
    }
    fn synchronize(&self) -> Result<()> {
        self.device.synchronize()
    }
    fn poll_error(&self) -> Result<()> {
        self.device.check()
    }
    fn record_timing(&self, on: StreamKind) -> Result<Option<SimEvent>> {
        self.device.record_timing(on)
    }
    fn elapsed_s(&self, from: &SimEvent, to: &SimEvent) -> Result<Option<f64>> {
        self.device.elapsed_s(from, to)
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        self.device.memory_info()
    }
}
