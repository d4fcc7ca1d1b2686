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
    /// The tensor copied straight into `dst` (on CUDA, one device-to-host copy into
    /// the pinned block buffer): a CPU tensor laid over `dst`, dropped before return.
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let spec = &self.specs[index];
        let name = &spec.name;
        let need = spec.nbytes()?;
        if dst.len() != need {
            return Err(Error::BadTensor { tensor: name.clone(), fault: format!("{} bytes given for a {need}-byte tensor", dst.len()) });
        }
        let kind = kind_of(spec.dtype).ok_or_else(|| Error::BadTensor { tensor: name.clone(), fault: "no tch kind".into() })?;
        let size: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
        if need == 0 {
            return Ok(());
        }
        if dst.as_ptr() as usize % spec.dtype.size() != 0 {
            // Not aligned for the element type: through a CPU copy, as before.
            let t = self.tensors[index]
                .f_to_device(Device::Cpu)
                .and_then(|t| t.f_contiguous())
                .map_err(|e| tch_err(format!("reading {name}"), e))?;
            return t.f_copy_data_u8(dst, t.numel()).map_err(|e| tch_err(format!("reading {name}"), e));
        }
        let strides: Vec<i64> = (0..size.len()).map(|i| size[i + 1..].iter().product()).collect();
        // SAFETY: `dst` is `need` bytes (checked) aligned for `kind` (checked), exclusively borrowed for this call, and the view over it is dropped before return.
        let mut view = unsafe { Tensor::f_from_blob(dst.as_mut_ptr(), &size, &strides, kind, Device::Cpu) }
            .map_err(|e| tch_err(format!("reading {name}"), e))?;
        let copied = view.f_copy_(&self.tensors[index]).map_err(|e| tch_err(format!("reading {name}"), e));
        drop(view);
        copied
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
    use offload_core::{MemoryInfo, StreamKind};
    use offload_cuda::checked::CheckedEvent;
    use offload_cuda::cudarc::driver::CudaContext;
    use offload_cuda::{CudaBackend, CudaCounters, FreshEngine, FreshSlot, PinnedHost};

    /// libtorch on CUDA: compute on libtorch's stream (the legacy default stream
    /// of device `ordinal`'s primary context), copies on a non-blocking stream of
    /// the same context (`offload-cuda`'s transfer engine). Each copy lands in a
    /// fresh tensor from libtorch's caching allocator, and a block's parameters
    /// are views of it: a view, a derived tensor or a tensor autograd saved for
    /// backward keeps its block's bytes alive after the block is released.
    #[derive(Clone)]
    pub struct TchCudaBackend {
        engine: FreshEngine,
        device: Device,
    }

    /// A ring slot: the libtorch buffer (`Uint8`, on the device) holding the last
    /// block copied into it ([`FreshSlot::buffer`]).
    pub type TchSlot = FreshSlot<Tensor>;

    /// The CUDA backend for libtorch on device `ordinal`.
    pub fn cuda_backend(ordinal: usize) -> Result<TchCudaBackend> {
        if !offload_cuda::driver_present() {
            return Err(Error::unsupported(BACKEND, "no CUDA driver library (libcuda.so) on this machine"));
        }
        if !tch::Cuda::is_available() {
            return Err(Error::unsupported(BACKEND, "libtorch sees no CUDA device (is libtorch_cuda linked?)"));
        }
        // cudarc's event tracking stays on: this context is reachable from safe code.
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::device(BACKEND, format!("opening device {ordinal}"), e))?;
        let compute = ctx.default_stream();
        let inner = CudaBackend::with_compute_stream(ctx, compute)?;
        Ok(TchCudaBackend { engine: FreshEngine::new(inner, "tch-cuda"), device: Device::Cuda(ordinal) })
    }

    /// libtorch's device allocator statistics for one device, in bytes: what
    /// `torch.cuda.memory_stats()` calls `allocated_bytes.all.{current,peak}` and
    /// `reserved_bytes.all.{current,peak}`. Every tensor on the device counts,
    /// the ring's slot buffers included (they come from the same allocator).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    pub struct AllocatorStats {
        /// Bytes held by live tensors now.
        pub allocated: u64,
        /// The most bytes held by live tensors since the last [`reset_allocator_peak`].
        pub allocated_peak: u64,
        /// Bytes the allocator holds from the driver now (used and cached).
        pub reserved: u64,
        /// The most bytes reserved since the last [`reset_allocator_peak`].
        pub reserved_peak: u64,
    }

    #[cfg(offload_tch_memory_stats)]
    extern "C" {
        fn offload_tch_memory_stats(device: std::ffi::c_int, out: *mut i64) -> std::ffi::c_int;
        fn offload_tch_reset_peak_stats(device: std::ffi::c_int) -> std::ffi::c_int;
    }

    /// libtorch's allocator statistics for CUDA device `ordinal`.
    pub fn allocator_stats(ordinal: usize) -> Result<AllocatorStats> {
        #[cfg(offload_tch_memory_stats)]
        {
            let mut out = [0i64; 4];
            let device = std::ffi::c_int::try_from(ordinal).map_err(|_| Error::unsupported(BACKEND, format!("device {ordinal}")))?;
            // SAFETY: `out` holds the four values the C++ side writes; it catches every exception.
            let rc = unsafe { offload_tch_memory_stats(device, out.as_mut_ptr()) };
            if rc != 0 {
                return Err(Error::unsupported(BACKEND, format!("libtorch has no allocator statistics for device {ordinal}")));
            }
            let [allocated, allocated_peak, reserved, reserved_peak] = out.map(|v| v.max(0) as u64);
            Ok(AllocatorStats { allocated, allocated_peak, reserved, reserved_peak })
        }
        #[cfg(not(offload_tch_memory_stats))]
        {
            Err(Error::unsupported(BACKEND, format!("allocator statistics for device {ordinal}: built without LIBTORCH's headers")))
        }
    }

    /// Restart libtorch's peak statistics on CUDA device `ordinal` at the current values.
    pub fn reset_allocator_peak(ordinal: usize) -> Result<()> {
        #[cfg(offload_tch_memory_stats)]
        {
            let device = std::ffi::c_int::try_from(ordinal).map_err(|_| Error::unsupported(BACKEND, format!("device {ordinal}")))?;
            // SAFETY: no pointers cross; the C++ side catches every exception.
            if unsafe { offload_tch_reset_peak_stats(device) } != 0 {
                return Err(Error::unsupported(BACKEND, format!("libtorch cannot reset the peak statistics of device {ordinal}")));
            }
            Ok(())
        }
        #[cfg(not(offload_tch_memory_stats))]
        {
            Err(Error::unsupported(BACKEND, format!("allocator statistics for device {ordinal}: built without LIBTORCH's headers")))
        }
    }

    impl TchCudaBackend {
        /// The transfer engine (streams, the checking mode).
        pub fn cuda(&self) -> &CudaBackend {
            self.engine.cuda()
        }

        /// Counters: the transfer engine's, with live and peak bytes those of the
        /// ring's slots (buffers that views keep alive after the ring let them go
        /// are libtorch's).
        pub fn counters(&self) -> CudaCounters {
            self.engine.counters()
        }

        /// Violations of the ring's protocol seen so far (copies land in fresh
        /// buffers ordered after all compute, so a broken ring still computes the
        /// right result here; the log shows the break anyway).
        pub fn violations(&self) -> Vec<String> {
            self.engine.violations()
        }

        /// Record that compute is about to read `slot` other than through a bind
        /// (a kernel over the slot's buffer).
        pub fn note_read(&self, slot: &TchSlot) {
            self.engine.note_read(slot);
        }

        /// Restart the peak at the live bytes.
        pub fn reset_peak(&self) {
            self.engine.reset_peak()
        }

        /// A fresh `Uint8` buffer of `len` bytes from libtorch's caching allocator
        /// (on libtorch's stream), and its device address.
        fn new_buffer(&self, len: usize) -> Result<(Tensor, u64)> {
            let tensor = Tensor::f_empty([len.max(1) as i64], (Kind::Uint8, self.device))
                .map_err(|e| tch_err(format!("allocating a {len}-byte slot buffer"), e))?;
            let ptr = tensor.data_ptr() as u64;
            Ok((tensor, ptr))
        }
    }

    impl OffloadBackend for TchCudaBackend {
        type HostBuffer = PinnedHost;
        type Slot = TchSlot;
        type Event = CheckedEvent;
        type Wait = ();

        fn name(&self) -> &'static str {
            "tch-cuda"
        }
        fn alloc_host(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
            self.cuda().alloc_host(bytes, purpose, fill)
        }
        fn alloc_host_pageable(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
            self.cuda().alloc_host_pageable(bytes, purpose, fill)
        }
        fn refill_host(&self, buffer: &mut PinnedHost, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
            self.cuda().refill_host(buffer, fill)
        }
        fn alloc_host_coded(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
            self.cuda().alloc_host_coded(bytes, purpose, fill)
        }
        fn alloc_host_precoded(
            &self,
            bytes: usize,
            coded_len: usize,
            purpose: &str,
            fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        ) -> Result<PinnedHost> {
            self.cuda().alloc_host_precoded(bytes, coded_len, purpose, fill)
        }
        fn host_in_region(
            &self,
            region: &std::sync::Arc<dyn offload_core::HostRegion>,
            offset: usize,
            bytes: usize,
            purpose: &str,
        ) -> Result<PinnedHost> {
            self.cuda().host_in_region(region, offset, bytes, purpose)
        }
        fn is_pinned(&self, buffer: &PinnedHost) -> bool {
            self.cuda().is_pinned(buffer)
        }
        fn host_held_bytes(&self, buffer: &PinnedHost) -> Option<usize> {
            self.cuda().host_held_bytes(buffer)
        }
        fn host_bytes<'a>(&self, buffer: &'a PinnedHost) -> Result<&'a [u8]> {
            self.cuda().host_bytes(buffer)
        }
        fn host_is_pinned(&self) -> bool {
            true
        }
        fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<TchSlot> {
            self.engine.alloc_slot(bytes, purpose)
        }
        fn free_slot(&self, slot: TchSlot, after: Option<&CheckedEvent>) -> Result<()> {
            self.engine.free_slot(slot, after)
        }
        fn copy_to_slot(&self, src: &PinnedHost, dst: &mut TchSlot, bytes: usize, after: Option<&CheckedEvent>) -> Result<CheckedEvent> {
            // The caching allocator hands memory out in the order of libtorch's stream
            // (the engine's compute stream) and reuses it in that order.
            // SAFETY: `new_buffer` returns a libtorch tensor owning the memory at the address it gives.
            unsafe { self.engine.copy_to_slot(src, dst, bytes, after, |len| self.new_buffer(len)) }
        }
        fn compute_wait(&self, event: &CheckedEvent) -> Result<()> {
            self.engine.compute_wait(event)
        }
        fn record_compute(&self) -> Result<CheckedEvent> {
            self.engine.record_compute()
        }
        fn synchronize(&self) -> Result<()> {
            self.engine.synchronize()
        }
        fn poll_error(&self) -> Result<()> {
            self.cuda().poll_error()
        }
        fn record_timing(&self, on: StreamKind) -> Result<Option<CheckedEvent>> {
            self.engine.record_timing(on)
        }
        fn elapsed_s(&self, from: &CheckedEvent, to: &CheckedEvent) -> Result<Option<f64>> {
            self.engine.elapsed_s(from, to)
        }
        fn memory_info(&self) -> Result<MemoryInfo> {
            self.engine.memory_info()
        }
    }

    /// CUDA: weights are views of the slot's libtorch buffer, on libtorch's stream.
    impl TchSlots for TchCudaBackend {
        fn tch_device(&self) -> Device {
            self.device
        }
        fn bind(&self, slot: &TchSlot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()> {
            let buf = slot.buffer().ok_or_else(|| Error::Protocol("tch slot bound before any copy into it".into()))?;
            self.engine.note_read(slot);
            for t in &layout.tensors {
                let k = kind(&t.spec)?;
                let view = buf
                    .f_narrow(0, t.offset as i64, t.nbytes as i64)
                    .and_then(|v| v.f_view_dtype(k))
                    .and_then(|v| v.f_view(dims(&t.spec).as_slice()))
                    .map_err(|e| tch_err(format!("a view of {} in its slot", t.spec.name), e))?;
                param(params, &t.spec.name)?.f_set_data(&view).map_err(|e| tch_err(format!("pointing {} at its slot", t.spec.name), e))?;
            }
            Ok(())
        }
    }
}
#[cfg(feature = "cuda")]
pub use cuda::{allocator_stats, cuda_backend, reset_allocator_peak, AllocatorStats, TchCudaBackend, TchSlot};

/// A component of a tch model streamed through a [`Ring`]: its block parameters
/// live in the host store and point at the ring's slots only while their block
/// runs.
pub struct TchOffload<B: TchSlots> {
    ring: Ring<B>,
    inventory: offload_core::ComponentInventory,
    binds: Binds,
}

/// The block parameters, their placeholders and which are bound now.
struct Binds {
    params: HashMap<String, Tensor>,
    placeholders: HashMap<String, Tensor>,
    /// Names pointed at a block's weights and not yet pointed back (a forgotten
    /// [`TchBlock`] leaves them here for the next `block` to clear).
    bound: Vec<String>,
}

impl Binds {
    fn unbind(&mut self) -> Result<()> {
        let mut first = None;
        for name in std::mem::take(&mut self.bound) {
            if let (Some(p), Some(e)) = (self.params.get_mut(&name), self.placeholders.get(&name)) {
                if let Err(err) = p.f_set_data(e) {
                    first.get_or_insert(tch_err(format!("pointing {name} back at its placeholder"), err));
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl TchOffload<SimBackend> {
    /// Stream `vs`'s blocks on the CPU (host memory as device).
    pub fn cpu(vs: &VarStore, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        Self::new(SimBackend::new(SimConfig::fast()), vs, component, discovery, plan)
    }
}

#[cfg(feature = "cuda")]
impl TchOffload<TchCudaBackend> {
    /// Stream `vs`'s blocks to CUDA device `ordinal` (libtorch computes on its
    /// default stream; see [`cuda_backend`]).
    pub fn cuda(vs: &VarStore, ordinal: usize, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        Self::new(cuda_backend(ordinal)?, vs, component, discovery, plan)
    }
}

impl<B: TchSlots> TchOffload<B> {
    /// Discover `vs`'s blocks, copy their parameters into the host store of
    /// `backend`, build the ring, then point the parameters at empty placeholders
    /// (so the `VarStore` no longer holds their memory). Non-block variables are
    /// left where they are (move the `VarStore` to the device for them).
    ///
    /// Transactional: on any error the `VarStore` is exactly as it was (every
    /// parameter emptied so far is pointed back at its own data).
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
        // Everything that can fail before the VarStore is touched.
        let mut staged = Vec::new();
        for b in store.blocks() {
            for t in &b.layout.tensors {
                let name = &t.spec.name;
                let p = vars
                    .get(name)
                    .map(Tensor::shallow_clone)
                    .ok_or_else(|| Error::BadTensor { tensor: name.clone(), fault: "discovered but not in the VarStore".into() })?;
                let empty = Tensor::f_empty([0i64], (kind(&t.spec)?, device)).map_err(|e| tch_err(format!("placeholder for {name}"), e))?;
                let original = p.f_detach().map_err(|e| tch_err(format!("keeping {name}'s data"), e))?;
                staged.push((name.clone(), p, empty, original));
            }
        }
        let ring = Ring::new(backend, store, &rc)?;
        let mut params = HashMap::new();
        let mut placeholders = HashMap::new();
        for i in 0..staged.len() {
            let (done, rest) = staged.split_at_mut(i);
            let (name, p, empty, _) = &mut rest[0];
            if let Err(e) = p.f_set_data(empty) {
                // Put back every parameter emptied so far.
                for (_, p, _, original) in done {
                    let _ = p.f_set_data(original);
                }
                return Err(tch_err(format!("emptying {name}"), e));
            }
        }
        for (name, p, empty, _) in staged {
            placeholders.insert(name.clone(), empty);
            params.insert(name, p);
        }
        Ok(TchOffload { ring, inventory, binds: Binds { params, placeholders, bound: Vec::new() } })
    }

    /// Block `index` of `stack`: its parameters point at the streamed weights
    /// until the returned block is finished or dropped. If a previous block was
    /// forgotten (`mem::forget`), its parameters are pointed back first and the
    /// ring records its release (`StepMetrics::forgotten_guards`).
    pub fn block(&mut self, stack: &str, index: usize) -> Result<TchBlock<'_, B>> {
        self.binds.unbind()?;
        let guard = self.ring.block(stack, index)?;
        let block = TchBlock { guard: Some(guard), binds: &mut self.binds };
        let g = block.guard.as_ref().ok_or_else(|| Error::Protocol("block guard missing".into()))?;
        // Marked bound before binding, so a bind that fails part way is undone
        // (every name pointed back) when `block` drops.
        block.binds.bound = g.layout().tensors.iter().map(|t| t.spec.name.clone()).collect();
        g.backend().bind(g.slot(), g.layout(), &mut block.binds.params)?;
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
/// releases the slot after the compute enqueued so far. On CUDA the weights stay
/// valid for whatever still refers to them — views, derived tensors, tensors
/// autograd saved for `backward()` — because each is a view of a libtorch buffer
/// that lives as long as they do.
pub struct TchBlock<'a, B: TchSlots> {
    guard: Option<BlockGuard<'a, B>>,
    binds: &'a mut Binds,
}

impl<B: TchSlots> TchBlock<'_, B> {
    /// The block's guard (id, layout, slot).
    pub fn guard(&self) -> Option<&BlockGuard<'_, B>> {
        self.guard.as_ref()
    }

    /// Point the parameters back at placeholders and release the block.
    pub fn finish(mut self) -> Result<()> {
        let unbound = self.binds.unbind();
        let released = self.guard.take().map_or(Ok(()), BlockGuard::finish);
        unbound.and(released)
    }
}

impl<B: TchSlots> Drop for TchBlock<'_, B> {
    fn drop(&mut self) {
        let _ = self.binds.unbind();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `read_into` writes exactly the tensor's bytes, through the view laid over an
    /// aligned destination and through the CPU copy for a misaligned one.
    #[test]
    fn varstore_tensors_read_the_exact_bytes() {
        tch::manual_seed(3);
        let mut vs = VarStore::new(Device::Cpu);
        let _ = vs.root().var("w", &[3, 5], tch::nn::Init::Randn { mean: 0.0, stdev: 1.0 });
        vs.set_kind(Kind::BFloat16);
        let src = VarStoreTensors::new(&vs).unwrap();
        assert_eq!(src.specs[0].dtype, DType::BF16);
        let t = &src.tensors[0];
        let mut want = vec![0u8; 30];
        t.copy_data_u8(&mut want, t.numel());
        assert!(want.iter().any(|&b| b != 0));
        let mut buf = [0u8; 32];
        let aligned = buf.as_ptr() as usize % 2;
        for off in [aligned, 1 - aligned] {
            buf.fill(0);
            src.read_into(0, &mut buf[off..off + 30]).unwrap();
            assert_eq!(&buf[off..off + 30], &want[..], "destination offset {off}");
        }
        assert!(src.read_into(0, &mut buf[..29]).unwrap_err().to_string().contains("29 bytes"));
    }
}
