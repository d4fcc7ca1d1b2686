//! libtorch on CUDA: `TchCudaBackend`, each copy into a fresh tensor of libtorch's caching allocator through offload-cuda's transfer engine.

use crate::slots::{dims, kind, param, TchSlots};
use crate::tensors::{tch_err, BACKEND};
use offload_core::{BlockLayout, Error, OffloadBackend, Result};
use offload_cuda::cudarc::driver::CudaContext;
use offload_cuda::protocol_log::CheckedEvent;
use offload_cuda::{CudaBackend, CudaHostBuffer, FrameworkBufferEngine, FrameworkBufferSlot};
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

/// libtorch on CUDA: compute on libtorch's stream (the legacy default stream
/// of device `ordinal`'s primary context), copies on a non-blocking stream of
/// the same context (`offload-cuda`'s transfer engine). Each copy lands in a
/// fresh tensor from libtorch's caching allocator, and a block's parameters
/// are views of it: a view or a tensor derived from a weight (autograd's saved
/// transposed weight of a `Linear`, say) keeps its block's bytes alive after the
/// block is released. A parameter autograd saved itself does not: see
/// [`TchBlock`](crate::TchBlock).
#[derive(Clone)]
pub struct TchCudaBackend {
    engine: FrameworkBufferEngine,
    device: Device,
}

/// A ring slot: the libtorch buffer (`Uint8`, on the device) holding the last
/// block copied into it ([`FrameworkBufferSlot::buffer`]).
pub type TchSlot = FrameworkBufferSlot<Tensor>;

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
    Ok(TchCudaBackend { engine: FrameworkBufferEngine::new(inner, "tch-cuda"), device: Device::Cuda(ordinal) })
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
    offload_cuda::fresh_engine_methods!(engine, TchSlot);

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
    /// The transfer engine's host memory, as it is.
    type Host = CudaBackend;
    type Slot = TchSlot;
    type Event = CheckedEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        "tch-cuda"
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<TchSlot> {
        self.engine.alloc_slot(bytes, purpose)
    }
    fn copy_to_slot(&self, src: &CudaHostBuffer, dst: &mut TchSlot, bytes: usize, after: Option<&CheckedEvent>) -> Result<CheckedEvent> {
        // The caching allocator hands memory out in the order of libtorch's stream
        // (the engine's compute stream) and reuses it in that order.
        // SAFETY: `new_buffer` returns a libtorch tensor owning the memory at the address it gives.
        unsafe { self.engine.copy_to_slot(src, dst, bytes, after, |len| self.new_buffer(len)) }
    }
    offload_cuda::forward_to_framework_buffers!(engine);
}

/// CUDA: weights are views of the slot's libtorch buffer, on libtorch's stream.
impl TchSlots for TchCudaBackend {
    fn tch_device(&self) -> Device {
        self.device
    }
    fn bind(&self, slot: &TchSlot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()> {
        let buf = slot.buffer().ok_or_else(|| Error::Protocol("tch slot bound before any copy into it".into()))?;
        self.engine.note_read(slot);
        let len = buf.numel();
        for t in &layout.tensors {
            let k = kind(&t.spec)?;
            // A placement a layout makes, inside the slot (offsets then fit an i64).
            let range = t.range_in(len)?;
            let view = buf
                .f_narrow(0, range.start as i64, range.len() as i64)
                .and_then(|v| v.f_view_dtype(k))
                .and_then(|v| v.f_view(dims(&t.spec).as_slice()))
                .map_err(|e| tch_err(format!("a view of {} in its slot", t.spec.name), e))?;
            param(params, &t.spec.name)?.f_set_data(&view).map_err(|e| tch_err(format!("pointing {} at its slot", t.spec.name), e))?;
        }
        Ok(())
    }
}
