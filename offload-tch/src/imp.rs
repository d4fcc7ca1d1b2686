//! The tch backend proper (feature `libtorch`).

use offload_core::sim::{SimBackend, SimConfig, SimSlot};
use offload_core::{
    resolve, BlockDiscovery, BlockGuard, BlockLayout, DType, Error, HostStore, OffloadBackend, Plan, Result, Ring, StepMetrics,
    TensorSource, TensorSpec,
};
use std::collections::HashMap;
use std::sync::Arc;
pub use tch;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

const BACKEND: &str = "tch";

fn tch_err(during: impl Into<String>, e: tch::TchError) -> Error {
    Error::device(BACKEND, during, e)
}

/// The tch kind of an offload dtype.
pub fn kind_of(d: DType) -> Option<Kind> {
    Some(match d {
        DType::BOOL => Kind::Bool,
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I32 => Kind::Int,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::I64 => Kind::Int64,
        _ => return None,
    })
}

/// The offload dtype of a tch kind.
pub fn dtype_of(k: Kind) -> Option<DType> {
    Some(match k {
        Kind::Bool => DType::BOOL,
        Kind::Uint8 => DType::U8,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Int => DType::I32,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Int64 => DType::I64,
        _ => return None,
    })
}

/// The variables of a `VarStore` as a [`TensorSource`]: names, dtypes and shapes
/// up front, bytes read (through the host) when the host store asks.
pub struct VarStoreTensors {
    specs: Vec<TensorSpec>,
    tensors: Vec<Tensor>,
}

impl VarStoreTensors {
    /// Every variable of `vs`, sorted by name.
    pub fn new(vs: &VarStore) -> Result<Self> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut specs = Vec::with_capacity(vars.len());
        let mut tensors = Vec::with_capacity(vars.len());
        for (name, t) in vars {
            let kind = t.f_kind().map_err(|e| tch_err(format!("reading the kind of {name}"), e))?;
            let dtype = dtype_of(kind)
                .ok_or_else(|| Error::BadTensor { tensor: name.clone(), fault: format!("kind {kind:?} has no offload dtype") })?;
            let shape = t.size().into_iter().map(|d| d as usize).collect::<Vec<_>>();
            specs.push(TensorSpec::new(name, dtype, shape));
            tensors.push(t);
        }
        Ok(VarStoreTensors { specs, tensors })
    }
}

impl TensorSource for VarStoreTensors {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let name = &self.specs[index].name;
        let t = self.tensors[index]
            .f_to_device(Device::Cpu)
            .and_then(|t| t.f_contiguous())
            .map_err(|e| tch_err(format!("reading {name}"), e))?;
        t.f_copy_data_u8(dst, t.numel()).map_err(|e| tch_err(format!("reading {name}"), e))
    }
    fn origin(&self) -> String {
        "the VarStore".into()
    }
}

/// A backend whose slots libtorch can use as tensors.
pub trait TchSlots: OffloadBackend {
    /// The libtorch device the block tensors live on.
    fn tch_device(&self) -> Device;
    /// Point every parameter of `layout` (found in `params` by full name) at its
    /// bytes in `slot`.
    fn bind(&self, slot: &Self::Slot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()>;
}

fn param<'a>(params: &'a mut HashMap<String, Tensor>, name: &str) -> Result<&'a mut Tensor> {
    params.get_mut(name).ok_or_else(|| Error::BadTensor { tensor: name.to_owned(), fault: "not a parameter of the VarStore".into() })
}

fn kind(spec: &TensorSpec) -> Result<Kind> {
    kind_of(spec.dtype)
        .ok_or_else(|| Error::BadTensor { tensor: spec.name.clone(), fault: format!("dtype {:?} has no tch kind", spec.dtype) })
}

fn dims(spec: &TensorSpec) -> Vec<i64> {
    spec.shape.iter().map(|&d| d as i64).collect()
}

/// CPU: host memory is the device (the simulated backend's worker thread copies);
/// each weight is materialised once from the slot.
impl TchSlots for SimBackend {
    fn tch_device(&self) -> Device {
        Device::Cpu
    }
    fn bind(&self, slot: &SimSlot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()> {
        self.read_slot(slot, |bytes| {
            for t in &layout.tensors {
                let raw = &bytes[t.offset..t.offset + t.nbytes];
                let v = Tensor::f_from_data_size(raw, &dims(&t.spec), kind(&t.spec)?)
                    .map_err(|e| tch_err(format!("materialising {}", t.spec.name), e))?;
                param(params, &t.spec.name)?.f_set_data(&v).map_err(|e| tch_err(format!("pointing {} at its slot", t.spec.name), e))?;
            }
            Ok(())
        })
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use offload_cuda::{CudaBackend, CudaSlot};

    /// A CUDA backend for libtorch: compute on libtorch's stream (the legacy
    /// default stream of device `ordinal`'s primary context), copies on a
    /// non-blocking stream of the same context.
    pub fn cuda_backend(ordinal: usize) -> Result<CudaBackend> {
        if !tch::Cuda::is_available() {
            return Err(Error::unsupported(BACKEND, "libtorch sees no CUDA device (is libtorch_cuda linked?)"));
        }
        let ctx = CudaBackend::context(ordinal)?;
        let compute = ctx.default_stream();
        CudaBackend::with_compute_stream(ctx, compute)
    }

    /// CUDA: weights are `from_blob` views of the slot, on libtorch's stream.
    impl TchSlots for CudaBackend {
        fn tch_device(&self) -> Device {
            Device::Cuda(self.ctx().ordinal())
        }
        fn bind(&self, slot: &CudaSlot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()> {
            let device = self.tch_device();
            for t in &layout.tensors {
                let size = dims(&t.spec);
                let mut strides = vec![1i64; size.len()];
                for i in (0..size.len().saturating_sub(1)).rev() {
                    strides[i] = strides[i + 1] * size[i + 1];
                }
                let ptr = (slot.device_ptr() + t.offset as u64) as *const u8;
                // The view lives only while the parameter points at it: `TchBlock` points
                // every parameter back at a placeholder before the ring releases the slot.
                // SAFETY: `ptr` addresses `t.nbytes` bytes of the live slot (invariant 2).
                let view = unsafe { Tensor::from_blob(ptr, &size, &strides, kind(&t.spec)?, device) };
                param(params, &t.spec.name)?.f_set_data(&view).map_err(|e| tch_err(format!("pointing {} at its slot", t.spec.name), e))?;
            }
            Ok(())
        }
    }
}
#[cfg(feature = "cuda")]
pub use cuda::cuda_backend;

/// A component of a tch model streamed through a [`Ring`]: its block parameters
/// live in the host store and point at the ring's slots only while their block
/// runs.
pub struct TchOffload<B: TchSlots> {
    ring: Ring<B>,
    inventory: offload_core::ComponentInventory,
    params: HashMap<String, Tensor>,
    placeholders: HashMap<String, Tensor>,
}

impl TchOffload<SimBackend> {
    /// Stream `vs`'s blocks on the CPU (host memory as device).
    pub fn cpu(vs: &VarStore, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        Self::new(SimBackend::new(SimConfig::fast()), vs, component, discovery, plan)
    }
}

#[cfg(feature = "cuda")]
impl TchOffload<offload_cuda::CudaBackend> {
    /// Stream `vs`'s blocks to CUDA device `ordinal` (libtorch computes on its
    /// default stream; see [`cuda_backend`]).
    pub fn cuda(vs: &VarStore, ordinal: usize, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        Self::new(cuda_backend(ordinal)?, vs, component, discovery, plan)
    }
}

impl<B: TchSlots> TchOffload<B> {
    /// Discover `vs`'s blocks, copy their parameters into the host store of
    /// `backend`, point them at empty placeholders (so the `VarStore` no longer
    /// holds their memory) and build the ring. Non-block variables are left where
    /// they are (move the `VarStore` to the device for them).
    pub fn new(backend: B, vs: &VarStore, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        let source = VarStoreTensors::new(vs)?;
        let mut inventory = discovery.discover(component, source.specs())?;
        inventory.non_block.clear();
        if inventory.stacks.is_empty() {
            return Err(Error::Plan(format!("component {component:?}: no block stacks among the VarStore's variables")));
        }
        let store = Arc::new(HostStore::build(&backend, &inventory, &source)?);
        let rc = resolve(plan, std::slice::from_ref(&inventory))?.components.remove(0);
        let device = backend.tch_device();
        let vars = vs.variables();
        let mut params = HashMap::new();
        let mut placeholders = HashMap::new();
        for b in store.blocks() {
            for t in &b.layout.tensors {
                let name = &t.spec.name;
                let mut p = vars
                    .get(name)
                    .map(Tensor::shallow_clone)
                    .ok_or_else(|| Error::BadTensor { tensor: name.clone(), fault: "discovered but not in the VarStore".into() })?;
                let empty = Tensor::f_empty([0i64], (kind(&t.spec)?, device)).map_err(|e| tch_err(format!("placeholder for {name}"), e))?;
                p.f_set_data(&empty).map_err(|e| tch_err(format!("emptying {name}"), e))?;
                placeholders.insert(name.clone(), empty);
                params.insert(name.clone(), p);
            }
        }
        let ring = Ring::new(backend, store, &rc)?;
        Ok(TchOffload { ring, inventory, params, placeholders })
    }

    /// Block `index` of `stack`: its parameters point at the streamed weights
    /// until the returned block is finished or dropped.
    pub fn block(&mut self, stack: &str, index: usize) -> Result<TchBlock<'_, B>> {
        let guard = self.ring.block(stack, index)?;
        let names: Vec<String> = guard.layout().tensors.iter().map(|t| t.spec.name.clone()).collect();
        let mut block = TchBlock { guard: Some(guard), params: &mut self.params, placeholders: &self.placeholders, names, bound: false };
        let g = block.guard.as_ref().ok_or_else(|| Error::Protocol("block guard missing".into()))?;
        g.backend().bind(g.slot(), g.layout(), block.params)?;
        block.bound = true;
        Ok(block)
    }

    /// Run the same host store under another plan (another depth, resident set).
    /// The new ring is built before the old one is closed, so both hold slots
    /// for a moment; on error the old ring stays in place.
    pub fn replan(&mut self, plan: &Plan) -> Result<()> {
        let rc = resolve(plan, std::slice::from_ref(&self.inventory))?.components.remove(0);
        let (backend, store) = (self.ring.backend().clone(), self.ring.store().clone());
        let old = std::mem::replace(&mut self.ring, Ring::new(backend, store, &rc)?);
        old.close()
    }

    /// End a step: metrics of the step, and errors deferred by the device.
    pub fn end_step(&mut self) -> Result<StepMetrics> {
        self.ring.end_step()
    }

    /// The ring (metrics, timeline, backend).
    pub fn ring(&mut self) -> &mut Ring<B> {
        &mut self.ring
    }

    /// Release every slot; the host store stays until the last handle drops.
    pub fn close(self) -> Result<()> {
        self.ring.close()
    }
}

/// A block whose parameters point at its slot. Finish it (or drop it) before the
/// next block: its parameters then point at placeholders again and the ring
/// releases the slot after the compute enqueued so far.
pub struct TchBlock<'a, B: TchSlots> {
    guard: Option<BlockGuard<'a, B>>,
    params: &'a mut HashMap<String, Tensor>,
    placeholders: &'a HashMap<String, Tensor>,
    names: Vec<String>,
    bound: bool,
}

impl<B: TchSlots> TchBlock<'_, B> {
    /// The block's guard (id, layout, slot).
    pub fn guard(&self) -> Option<&BlockGuard<'_, B>> {
        self.guard.as_ref()
    }

    fn unbind(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.bound) {
            return Ok(());
        }
        let mut first = None;
        for name in &self.names {
            if let (Some(p), Some(e)) = (self.params.get_mut(name), self.placeholders.get(name)) {
                if let Err(err) = p.f_set_data(e) {
                    first.get_or_insert(tch_err(format!("pointing {name} back at its placeholder"), err));
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Point the parameters back at placeholders and release the block.
    pub fn finish(mut self) -> Result<()> {
        let unbound = self.unbind();
        let released = self.guard.take().map_or(Ok(()), BlockGuard::finish);
        unbound.and(released)
    }
}

impl<B: TchSlots> Drop for TchBlock<'_, B> {
    fn drop(&mut self) {
        let _ = self.unbind();
    }
}
