//! torch on CUDA from Python: each copy lands in a fresh `uint8` tensor of torch's
//! caching allocator (through offload-cuda's transfer engine), so a view that
//! outlives its block (a tensor autograd saved, one the user kept) keeps its own
//! block's bytes. Compute is torch's stream; copies run on the engine's own
//! non-blocking stream of the same (primary) context.

use crate::dlpack::{locate, DL_CUDA};
use offload_core::{Error, MemoryInfo, OffloadBackend, Result, StreamKind};
use offload_cuda::checked::CheckedEvent;
use offload_cuda::cudarc::driver::{sys, CudaContext};
use offload_cuda::{CudaBackend, FreshEngine, FreshSlot, PinnedHost};
use pyo3::prelude::*;
use std::sync::Arc;

const BACKEND: &str = "torch-cuda";

/// A ring slot: the torch buffer holding the last block copied into it.
pub type PySlot = FreshSlot<Py<PyAny>>;

/// The backend of the Python package on CUDA device `ordinal`.
#[derive(Clone)]
pub struct PyCuda {
    engine: FreshEngine,
    ordinal: usize,
    /// `alloc(nbytes) -> (tensor, capsule)`: a fresh `uint8` tensor of torch's
    /// allocator on the engine's compute stream, and its DLPack capsule.
    alloc: Arc<Py<PyAny>>,
}

impl PyCuda {
    /// Device `ordinal`, computing on torch's stream `stream` (a `CUstream` of the
    /// device's primary context; 0, the legacy default stream, is torch's own
    /// until the user sets another), allocating through `alloc`.
    pub fn new(ordinal: usize, stream: u64, alloc: Py<PyAny>) -> Result<Self> {
        if !offload_cuda::driver_present() {
            return Err(Error::unsupported(BACKEND, "no CUDA driver library (libcuda.so) on this machine"));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::device(BACKEND, format!("opening device {ordinal}"), e))?;
        let compute = if stream == 0 {
            ctx.default_stream()
        } else {
            let handle = stream as usize as sys::CUstream;
            let mut owner: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: the driver only reads the handle and writes `owner`; an
            // invalid handle is reported as an error, not dereferenced by us.
            let rc = unsafe { sys::cuStreamGetCtx(handle, &mut owner) };
            if rc != sys::CUresult::CUDA_SUCCESS || owner != ctx.cu_ctx() {
                return Err(Error::unsupported(
                    BACKEND,
                    format!("stream {stream:#x} is not a stream of device {ordinal}'s primary context (torch's context) ({rc:?})"),
                ));
            }
            // Torch never destroys its pool streams, and the package holds the Python
            // stream object as long as this backend; the engine orders work on it by events only.
            // SAFETY: the driver just said the handle is a stream of this context, kept alive by torch.
            unsafe { ctx.wrap_borrowed_stream(handle) }
        };
        let inner = CudaBackend::with_compute_stream(ctx, compute)?;
        Ok(PyCuda { engine: FreshEngine::new(inner, BACKEND), ordinal, alloc: Arc::new(alloc) })
    }

    /// The transfer engine.
    pub fn cuda(&self) -> &CudaBackend {
        self.engine.cuda()
    }

    /// Violations of the ring's protocol seen so far.
    pub fn violations(&self) -> Vec<String> {
        self.engine.violations()
    }

    /// The transfer engine's counters, with the slots' live and peak bytes.
    pub fn counters(&self) -> offload_cuda::CudaCounters {
        self.engine.counters()
    }

    /// Record that compute is about to read `slot` (its tensors were handed out).
    pub fn note_read(&self, slot: &PySlot) {
        self.engine.note_read(slot);
    }

    /// A fresh buffer of `len` bytes from torch's caching allocator, checked
    /// through its DLPack capsule: CUDA memory of this device, at least `len` bytes.
    fn new_buffer(&self, len: usize) -> Result<(Py<PyAny>, u64)> {
        Python::attach(|py| {
            let fail = |e: PyErr| Error::device(BACKEND, format!("allocating a {len}-byte slot buffer"), e);
            let pair = self.alloc.call1(py, (len,)).map_err(fail)?;
            let (tensor, capsule): (Py<PyAny>, Py<PyAny>) = pair.extract(py).map_err(|e: PyErr| fail(e))?;
            let at = locate(capsule.bind(py), "a slot buffer").map_err(fail)?;
            if at.device_type != DL_CUDA || at.device_id as usize != self.ordinal || at.nbytes < len {
                return Err(Error::Protocol(format!(
                    "the allocator gave {} bytes on device type {} ordinal {}, not {len} bytes on CUDA device {}",
                    at.nbytes, at.device_type, at.device_id, self.ordinal
                )));
            }
            Ok((tensor, at.addr as u64))
        })
    }
}

impl OffloadBackend for PyCuda {
    type Host = CudaBackend;
    type Slot = PySlot;
    type Event = CheckedEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        BACKEND
    }
    fn host(&self) -> CudaBackend {
        self.cuda().clone()
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<PySlot> {
        self.engine.alloc_slot(bytes, purpose)
    }
    fn free_slot(&self, slot: PySlot, after: Option<&CheckedEvent>) -> Result<()> {
        self.engine.free_slot(slot, after)
    }
    fn copy_to_slot(&self, src: &PinnedHost, dst: &mut PySlot, bytes: usize, after: Option<&CheckedEvent>) -> Result<CheckedEvent> {
        // The package's allocator makes each buffer with `torch.empty` on the engine's
        // compute stream, so torch's caching allocator hands it out and reuses it in that order.
        // SAFETY: `new_buffer` returns a torch tensor owning the checked CUDA memory at its address.
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
