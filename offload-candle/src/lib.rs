//! The candle backend of `offload`: stream a model's blocks and run them with
//! candle's own, unmodified block code.
//!
//! Design choices:
//!
//! - **Unmodified blocks.** A block's weights reach candle-nn / candle-transformers
//!   code through a `VarBuilder` ([`CandleBlockExt::var_builder`], backed by
//!   [`BlockVars`], a candle `SimpleBackend` over the block's slot): build the block
//!   per call (`Block::new(cfg, vb)` only clones handles) and run its `forward`.
//! - **CPU device: host memory is the device.** On `Device::Cpu` the ring's "device"
//!   is host memory: copies into slots run on a worker thread (the simulated
//!   backend of `offload-core`, whose protocol checks stay on), and candle's CPU
//!   tensors own their storage, so each weight is materialised from the slot with
//!   one copy when the block's `VarBuilder` is built. This is the CI path: the
//!   protocol and the bitwise checks apply as on a GPU.
//! - **CUDA (feature `cuda`): no copy beyond the host-to-device one.**
//!   `CandleCudaBackend` copies each block into a fresh candle CUDA tensor (candle's
//!   allocator, candle's stream) and serves its weights as `narrow`/`reshape` views
//!   of it; copies run on `offload-cuda`'s copy stream, candle computes on its own
//!   stream, ordered by the ring's events. Blocks must have one dtype (the
//!   backend's).
//! - **Views cannot outlive their block's bytes.** A `VarBuilder`, a module built
//!   from it or any tensor derived from them keeps its block's buffer alive by
//!   candle's reference count (CUDA) or owns a copy (CPU): used after the guard is
//!   dropped, or after the ring is closed, it still reads that block's weights.

use candle_core::{DType as CDType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use offload_core::sim::{SimBackend, SimConfig, SimEvent, SimHostBuffer, SimSlot};
use offload_core::{BlockGuard, BlockLayout, DType, Error, MemoryInfo, OffloadBackend, Result, StreamKind};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

pub mod flux;
pub mod quantized;
#[cfg(feature = "sd3")]
pub mod sd3;

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
        CandleBackend { device: SimBackend::new(Self::cpu_config()) }
    }

    /// The host-memory device's configuration for the CPU device: no copy
    /// delays, host buffers in ordinary memory (nothing is page-locked: host
    /// memory is the device), no decoder for coded blocks.
    pub fn cpu_config() -> SimConfig {
        SimConfig { page_locked: false, decodes: false, ..SimConfig::fast() }
    }

    /// The CPU device over a host-memory device of the caller's configuration
    /// (the conformance suite's slow copies and deliberate breaks), usually
    /// [`cpu_config`](Self::cpu_config) changed.
    #[doc(hidden)]
    pub fn on_host_device(device: SimBackend) -> Self {
        CandleBackend { device }
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
                let raw = t.bytes_in(bytes)?;
                let tensor = Tensor::from_raw_buffer(raw, dtype, &t.spec.shape, &Device::Cpu)
                    .map_err(|e| Error::BadTensor { tensor: t.spec.name.clone(), fault: e.to_string() })?;
                let name = t.spec.name.strip_prefix(prefix).unwrap_or(&t.spec.name).to_owned();
                crate::insert_once(&mut map, name, tensor, &t.spec.name)?;
            }
            Ok(map)
        })
    }
}

/// A candle error as offload's, saying what was being done:
/// `t.to_vec1().map_err(candle_error("reading the output"))?`.
pub fn candle_error(during: &str) -> impl Fn(candle_core::Error) -> Error + Copy + '_ {
    move |e| Error::device("candle", during, e)
}

/// The candle dtype of an offload dtype.
pub fn candle_dtype(d: DType) -> Option<CDType> {
    Some(match d {
        DType::U8 => CDType::U8,
        DType::U32 => CDType::U32,
        DType::I16 => CDType::I16,
        DType::I32 => CDType::I32,
        DType::I64 => CDType::I64,
        DType::F8_E4M3 => CDType::F8E4M3,
        DType::BF16 => CDType::BF16,
        DType::F16 => CDType::F16,
        DType::F32 => CDType::F32,
        DType::F64 => CDType::F64,
        _ => return None,
    })
}

/// Tensor names for an error, in order: the first 12, then how many more.
fn listed(names: BTreeSet<&str>) -> String {
    let more = names.len().saturating_sub(12);
    let shown: Vec<&str> = names.into_iter().take(12).collect();
    let more = if more > 0 { format!(" and {more} more") } else { String::new() };
    format!("{}{more}", shown.join(", "))
}

/// Put a block's tensor under its short name: two tensors under one name (a
/// discovery whose short names collide) are an error naming the second, not
/// one of them silently lost.
pub(crate) fn insert_once<T>(map: &mut HashMap<String, T>, name: String, value: T, full: &str) -> Result<()> {
    match map.entry(name) {
        std::collections::hash_map::Entry::Occupied(e) => Err(Error::BadTensor {
            tensor: full.to_owned(),
            fault: format!("another tensor of its block has the same name {:?} within the block", e.key()),
        }),
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(value);
            Ok(())
        }
    }
}

/// A streamed block as candle sees it.
pub trait CandleBlockExt {
    /// The block's tensors, named relative to the block, and the device they are on.
    fn block_vars(&self) -> Result<(BlockVars, Device)>;

    /// A `VarBuilder` over the block's weights, named relative to the block
    /// (`attn.qkv.weight` for `joint_blocks.3.x_block.attn.qkv.weight` is
    /// `vb.pp("x_block").pp("attn")…`); `dtype` is the builder's dtype. It does
    /// not check that the module built from it reads every tensor the block
    /// holds: [`build`](Self::build) does.
    fn var_builder(&self, dtype: CDType) -> Result<VarBuilder<'static>> {
        let (vars, device) = self.block_vars()?;
        Ok(vars.into_var_builder(dtype, &device))
    }

    /// The block's module, made by `make` from a `VarBuilder` over its weights
    /// (`guard.build(dtype, |vb| Block::new(&cfg, vb))`), then checked to have
    /// read every tensor the block holds. A tensor no layer read — a checkpoint
    /// of another variant of the model (a norm the configuration leaves out), a
    /// misnamed weight — is an error naming the block and the tensors: the block
    /// would otherwise compute another model than the checkpoint's, and the
    /// resident model built the same way would agree with it. The check runs
    /// when `make` returns: a module that reads a weight only in its `forward`
    /// is refused (build such a module with `var_builder`), and a tensor read
    /// but then ignored is not seen.
    fn build<T>(&self, dtype: CDType, make: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<T>) -> Result<T> {
        let (vars, device) = self.block_vars()?;
        let (block, reads) = (vars.block.clone(), vars.reads.clone());
        let names: Vec<String> = vars.tensors.keys().cloned().collect();
        let module =
            make(vars.into_var_builder(dtype, &device)).map_err(|e| Error::device("candle", format!("building block {block}"), e))?;
        let read = reads.lock().unwrap_or_else(|e| e.into_inner());
        let unread: BTreeSet<&str> = names.iter().map(String::as_str).filter(|n| !read.contains(*n)).collect();
        if !unread.is_empty() {
            let first = unread.iter().next().map_or(String::new(), |n| format!("{block}.{n}"));
            return Err(Error::BadTensor {
                tensor: first,
                fault: format!(
                    "block {block} holds tensors its module never read ({}): the checkpoint is of another variant of the model, or a weight is misnamed",
                    listed(unread)
                ),
            });
        }
        Ok(module)
    }
}

/// The `VarBuilder` backend of one streamed block: its tensors (views of the slot
/// on CUDA, materialised from it on the CPU device), named relative to the block.
/// A missing tensor or a shape mismatch is an error that names the block and the
/// tensor, and lists what the block holds.
pub struct BlockVars {
    block: String,
    tensors: HashMap<String, Tensor>,
    /// The names a module read (`get`, `get_unchecked`), for [`CandleBlockExt::build`].
    reads: Arc<Mutex<BTreeSet<String>>>,
}

impl BlockVars {
    /// `tensors` of block `block` (e.g. `double_blocks.3`).
    pub fn new(block: impl Into<String>, tensors: HashMap<String, Tensor>) -> Self {
        BlockVars { block: block.into(), tensors, reads: Arc::default() }
    }

    /// A `VarBuilder` over these tensors on `device`.
    pub fn into_var_builder(self, dtype: CDType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self), dtype, device.clone())
    }

    /// `name` converted to `dtype`: an fp8 weight whose scale the block holds
    /// (`X.weight_scale`, ComfyUI's `X.scale_weight`, torchao's `X._weight_scale`)
    /// is refused, since the conversion would drop its scale and compute with
    /// unscaled weights.
    fn converted(&self, name: &str, t: &Tensor, dtype: CDType, dev: &Device) -> candle_core::Result<Tensor> {
        if t.dtype() == CDType::F8E4M3 && dtype != CDType::F8E4M3 {
            let scales = match (name.strip_suffix(".weight"), name.strip_suffix("._weight_qdata")) {
                (Some(stem), _) => vec![format!("{stem}.weight_scale"), format!("{stem}.scale_weight")],
                (_, Some(stem)) => vec![format!("{stem}._weight_scale")],
                _ => Vec::new(),
            };
            if let Some(scale) = scales.iter().find(|s| self.tensors.contains_key(s.as_str())) {
                return Err(candle_core::Error::Msg(format!(
                    "block {}: tensor `{name}` is fp8 with a scale `{scale}`: read as {dtype:?} it would lose the scale \
                     (read it as F8E4M3 and apply the scale, as offload_formats::fp8::dequantize_to_bf16 does)",
                    self.block
                )));
            }
        }
        t.to_device(dev)?.to_dtype(dtype)
    }

    fn find(&self, name: &str) -> candle_core::Result<&Tensor> {
        if self.tensors.contains_key(name) {
            self.reads.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_owned());
        }
        self.tensors.get(name).ok_or_else(|| {
            let have: BTreeSet<&str> = self.tensors.keys().map(String::as_str).collect();
            candle_core::Error::Msg(format!("block {} has no tensor `{name}` (it has: {})", self.block, listed(have)))
        })
    }
}

impl SimpleBackend for BlockVars {
    fn get(&self, s: Shape, name: &str, _: Init, dtype: CDType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.find(name)?;
        if t.shape() != &s {
            return Err(candle_core::Error::Msg(format!(
                "block {}: tensor `{name}` has shape {:?}, the model asks for {:?}",
                self.block,
                t.dims(),
                s.dims()
            )));
        }
        self.converted(name, t, dtype, dev)
    }
    fn get_unchecked(&self, name: &str, dtype: CDType, dev: &Device) -> candle_core::Result<Tensor> {
        self.converted(name, self.find(name)?, dtype, dev)
    }
    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

impl CandleBlockExt for BlockGuard<'_, CandleBackend> {
    fn block_vars(&self) -> Result<(BlockVars, Device)> {
        let prefix = format!("{}.", self.id());
        let map = self.backend().tensors(self.slot(), self.layout(), &prefix)?;
        Ok((BlockVars::new(self.id().to_string(), map), Device::Cpu))
    }
}

impl OffloadBackend for CandleBackend {
    /// Host memory is the device's own: the simulated device's, whose
    /// "page-locked" buffers are ordinary memory here ([`cpu_config`](Self::cpu_config)).
    type Host = SimBackend;
    type Slot = SimSlot;
    type Event = SimEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        "candle"
    }
    fn host(&self) -> SimBackend {
        self.device.clone()
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<SimSlot> {
        self.device.alloc_slot(bytes, purpose)
    }
    fn free_slot(&self, slot: SimSlot, after: Option<&SimEvent>) -> Result<()> {
        self.device.free_slot(slot, after)
    }
    fn copy_to_slot(&self, src: &SimHostBuffer, dst: &mut SimSlot, bytes: usize, after: Option<&SimEvent>) -> Result<SimEvent> {
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
    fn compute_on_host(&self) -> bool {
        true
    }
    fn memory_info(&self) -> Result<MemoryInfo> {
        self.device.memory_info()
    }
}

#[cfg(test)]
mod tests {
    /// Two tensors of a block under one short name: the second is an error
    /// naming it, the first kept (a `HashMap::insert` dropped one unseen).
    #[test]
    fn two_tensors_under_one_short_name_are_an_error() {
        let mut map = std::collections::HashMap::new();
        super::insert_once(&mut map, "w".to_string(), 1, "blocks.0.w").unwrap();
        let e = super::insert_once(&mut map, "w".to_string(), 2, "w").unwrap_err().to_string();
        assert!(e.contains("\"w\"") && e.contains("same name"), "{e}");
        assert_eq!(map["w"], 1);
    }
}
