//! torch on CUDA from Python: each copy lands in a fresh `uint8` tensor of torch's
//! caching allocator (through offload-cuda's transfer engine), so a view that
//! outlives its block (a tensor autograd saved, one the user kept) keeps its own
//! block's bytes. Compute is torch's stream; copies run on the engine's own
//! non-blocking stream of the same (primary) context.

use crate::dlpack::{locate, DL_CUDA};
use offload_core::{Error, OffloadBackend, Result};
use offload_cuda::cudarc::driver::{sys, CudaContext};
use offload_cuda::protocol_log::CheckedEvent;
use offload_cuda::{CudaBackend, CudaHostBuffer, FrameworkBufferEngine, FrameworkBufferSlot};
use pyo3::prelude::*;
use std::sync::Arc;

const BACKEND: &str = "torch-cuda";

/// A ring slot: the torch buffer holding the last block copied into it.
pub type PySlot = FrameworkBufferSlot<Py<PyAny>>;

/// The backend of the Python package on CUDA device `ordinal`.
#[derive(Clone)]
pub struct PyCuda {
    engine: FrameworkBufferEngine,
    ordinal: usize,
    /// torch's stream the engine computes on (a `torch.cuda.Stream`), held for
    /// the backend's life: slot buffers are allocated on it.
    stream: Arc<Py<PyAny>>,
    /// What making a slot buffer calls, looked up once (it runs for every
    /// block copied: host time on every block of every step).
    alloc: Arc<Alloc>,
}

/// torch's functions a slot buffer is made with.
struct Alloc {
    /// The compute stream's raw handle (`cudaStream_t`).
    handle: u64,
    /// `torch.empty`, with its keywords (`dtype=torch.uint8, device="cuda:N"`).
    empty: Py<PyAny>,
    kwargs: Py<pyo3::types::PyDict>,
    /// `torch._C._cuda_getCurrentRawStream` where this torch has it: when torch's
    /// current stream already is the compute stream, the buffer is made without
    /// entering `torch.cuda.stream` (two Python calls a block).
    current_raw: Option<Py<PyAny>>,
    to_dlpack: Py<PyAny>,
    stream_guard: Py<PyAny>,
    /// `torch._C._is_torch_function_mode_enabled`,
    /// `torch._C._len_torch_dispatch_stack` and
    /// `torch._C._functorch.peek_interpreter_stack`, where this torch has them:
    /// while a mode or one of torch.func's transforms is active (or where they
    /// are missing) the buffer is made by `guarded`, which none of them can
    /// answer for torch (inside `torch.func.grad` a plain `torch.empty` gives a
    /// wrapper without storage).
    modes: Option<(Py<PyAny>, Py<PyAny>, Py<PyAny>)>,
    /// `offload._alloc.make`: the buffer made with every mode off, and checked
    /// to own exactly its memory (a mode could answer `torch.empty` with a view
    /// of a live tensor, which the engine's copy would then write into).
    guarded: Py<PyAny>,
}

impl PyCuda {
    /// Device `ordinal`, computing on `stream`, a `torch.cuda.Stream` of that
    /// device (torch's current stream; its legacy default stream, handle 0,
    /// unless the user set another). An `ExternalStream` is refused: its owner,
    /// not torch, decides when it is destroyed.
    pub fn new(ordinal: usize, stream: Bound<'_, PyAny>) -> Result<Self> {
        if !offload_cuda::driver_present() {
            return Err(Error::unsupported(BACKEND, "no CUDA driver library (libcuda.so) on this machine"));
        }
        let bad = |why: String| Error::unsupported(BACKEND, why);
        // torch's own class, by identity: an object that only looks like one (its
        // class named `Stream`, a `cuda_stream` of any number) would hand the engine
        // a handle no stream stands behind.
        let class: String = stream.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        let torch_stream =
            stream.py().import("torch.cuda").and_then(|m| m.getattr("Stream")).map_err(|e| bad(format!("torch.cuda.Stream: {e}")))?;
        if !stream.get_type().is(&torch_stream) {
            return Err(bad(format!("the compute stream must be a torch.cuda.Stream, not {class}")));
        }
        // `torch.cuda.current_stream()` under `torch.cuda.stream(ExternalStream(p))` is
        // a plain `Stream` over `p`, which its owner may destroy while the engine
        // still computes on it: refused by its id (c10 since torch 2.1: an external
        // stream's id is its handle, even; torch's own are 0 or odd).
        let id: i64 = stream.getattr("stream_id").and_then(|i| i.extract()).map_err(|e| bad(format!("the stream's id: {e}")))?;
        if id != 0 && id & 1 == 0 && torch_at_least(stream.py(), (2, 1)) {
            return Err(bad("the compute stream is an external stream (torch.cuda.ExternalStream), whose owner may destroy it while \
                            the module is offloaded: enable on one of torch's streams"
                .into()));
        }
        let handle: u64 = stream.getattr("cuda_stream").and_then(|h| h.extract()).map_err(|e| bad(format!("the stream's handle: {e}")))?;
        let index: Option<usize> =
            stream.getattr("device_index").and_then(|i| i.extract()).map_err(|e| bad(format!("the stream's device: {e}")))?;
        if index.is_some_and(|i| i != ordinal) {
            return Err(bad(format!("the compute stream is on device {index:?}, not {ordinal}")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| Error::device(BACKEND, format!("opening device {ordinal}"), e))?;
        let compute = if handle == 0 {
            ctx.default_stream()
        } else {
            let raw = handle as usize as sys::CUstream;
            // torch made this handle for a `torch.cuda.Stream` (not an external one), and
            // torch never destroys the streams of its pools; the backend holds the object too.
            // SAFETY: a live stream of torch's, which computes in device `ordinal`'s primary context.
            unsafe { ctx.wrap_borrowed_stream(raw) }
        };
        let inner = CudaBackend::with_compute_stream(ctx, compute)?;
        let py = stream.py();
        let alloc = (|| -> PyResult<Alloc> {
            let torch = py.import("torch")?;
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("dtype", torch.getattr("uint8")?)?;
            kwargs.set_item("device", format!("cuda:{ordinal}"))?;
            Ok(Alloc {
                handle,
                empty: torch.getattr("empty")?.unbind(),
                kwargs: kwargs.unbind(),
                current_raw: torch.getattr("_C")?.getattr("_cuda_getCurrentRawStream").ok().map(Bound::unbind),
                to_dlpack: torch.getattr("utils")?.getattr("dlpack")?.getattr("to_dlpack")?.unbind(),
                stream_guard: torch.getattr("cuda")?.getattr("stream")?.unbind(),
                modes: torch
                    .getattr("_C")
                    .and_then(|c| {
                        Ok((
                            c.getattr("_is_torch_function_mode_enabled")?.unbind(),
                            c.getattr("_len_torch_dispatch_stack")?.unbind(),
                            c.getattr("_functorch")?.getattr("peek_interpreter_stack")?.unbind(),
                        ))
                    })
                    .ok(),
                guarded: py.import("offload._alloc")?.getattr("make")?.unbind(),
            })
        })()
        .map_err(|e| bad(format!("torch's allocation functions: {e}")))?;
        Ok(PyCuda {
            engine: FrameworkBufferEngine::new(inner, BACKEND),
            ordinal,
            stream: Arc::new(stream.unbind()),
            alloc: Arc::new(alloc),
        })
    }

    offload_cuda::fresh_engine_methods!(engine, PySlot);

    /// A fresh `uint8` tensor of `len` bytes from torch's caching allocator, made
    /// here on the compute stream (`torch.empty` with the compute stream current:
    /// it already is, or `torch.cuda.stream` makes it so), its address read from
    /// its own DLPack capsule: nobody else holds it.
    fn new_buffer(&self, len: usize) -> Result<(Py<PyAny>, u64)> {
        Python::attach(|py| {
            let fail = |e: PyErr| Error::device(BACKEND, format!("allocating a {len}-byte slot buffer"), e);
            let a = &*self.alloc;
            let made = (|| -> PyResult<(Py<PyAny>, crate::dlpack::Located)> {
                // A probe that fails (another torch's signature) takes the guarded path.
                let current = a.current_raw.as_ref().and_then(|f| f.bind(py).call1((self.ordinal,)).and_then(|h| h.extract::<u64>()).ok());
                let moded = a.modes.as_ref().is_none_or(|(function, dispatch, transforms)| {
                    function.bind(py).call0().and_then(|b| b.extract::<bool>()).unwrap_or(true)
                        || dispatch.bind(py).call0().and_then(|n| n.extract::<usize>()).unwrap_or(1) > 0
                        || transforms.bind(py).call0().map(|t| !t.is_none()).unwrap_or(true)
                });
                // A fresh keywords dict each call: a `__torch_function__` mode may change the one it is given.
                let empty = || a.empty.bind(py).call((len.max(1),), Some(&a.kwargs.bind(py).copy()?));
                let t = if moded {
                    let device = format!("cuda:{}", self.ordinal);
                    a.guarded.bind(py).call1((len.max(1), device, self.stream.bind(py)))?
                } else if current == Some(a.handle) {
                    empty()?
                } else {
                    let guard = a.stream_guard.bind(py).call1((self.stream.bind(py),))?;
                    guard.call_method0("__enter__")?;
                    let t = empty();
                    guard.call_method1("__exit__", (py.None(), py.None(), py.None()))?;
                    t?
                };
                let capsule = a.to_dlpack.bind(py).call1((&t,))?;
                Ok((t.unbind(), locate(&capsule, "a slot buffer")?))
            })();
            let (tensor, at) = made.map_err(|e| fail(crate::keep_interrupt(py, e)))?;
            if at.device_type != DL_CUDA || at.device_id as usize != self.ordinal || at.nbytes < len {
                return Err(Error::Protocol(format!(
                    "torch gave {} bytes on device type {} ordinal {}, not {len} bytes on CUDA device {}",
                    at.nbytes, at.device_type, at.device_id, self.ordinal
                )));
            }
            Ok((tensor, at.addr as u64))
        })
    }
}

impl PyCuda {
    /// An error while the compute stream is being captured into a CUDA graph
    /// (`torch.cuda.graph`, `torch.compile(mode="reduce-overhead")`): the graph
    /// would hold the engine's copies and events and replay them later, from host
    /// memory and into buffers the engine has let go of by then.
    pub fn refuse_capture(&self) -> Result<()> {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the compute stream is only queried, in its own context.
        let stream = unsafe { self.cuda().compute_stream() };
        stream.context().bind_to_thread().map_err(|e| Error::device(BACKEND, "binding the device", e))?;
        // SAFETY: a query of a live stream handle (torch's, held for the backend's life), writing one enum.
        unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) }
            .result()
            .map_err(|e| Error::device(BACKEND, "asking whether the compute stream is being captured", e))?;
        match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(()),
            _ => Err(Error::unsupported(
                BACKEND,
                "the compute stream is being captured into a CUDA graph (torch.cuda.graph, torch.compile's \"reduce-overhead\"): \
                 a replay would repeat the engine's copies from host memory it no longer holds; run the offloaded module outside capture",
            )),
        }
    }
}

/// The CUDA context current on this thread when made, made current again when
/// dropped. The engine binds its device's primary context to the calling thread
/// (cudarc binds before its calls); without this, a call for `cuda:1` made while
/// torch's current device is 0 would leave device 1 current, and the caller's
/// next `torch.empty(device="cuda")` would land on the other GPU.
pub struct KeepContext(Option<sys::CUcontext>);

impl KeepContext {
    /// The context current now (none is made where the driver library is missing).
    pub fn new() -> Self {
        if !offload_cuda::driver_present() {
            return KeepContext(None);
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle; the driver library is present (checked above).
        let got = unsafe { sys::cuCtxGetCurrent(&mut ctx) }.result();
        KeepContext(got.ok().map(|()| ctx))
    }
}

impl Drop for KeepContext {
    fn drop(&mut self) {
        if let Some(ctx) = self.0 {
            // The context that was current (torch's primary context of its device,
            // or none) is still alive: the call in between released no context it
            // did not retain itself.
            // SAFETY: sets this thread's current context to a live one, or to none.
            // A failure leaves the engine's context current: nothing in a drop to report it to.
            let _ = unsafe { sys::cuCtxSetCurrent(ctx) };
        }
    }
}

/// Whether the imported torch's version is at least `(major, minor)`.
fn torch_at_least(py: Python<'_>, want: (u32, u32)) -> bool {
    let v: String = py.import("torch").and_then(|t| t.getattr("__version__")?.extract()).unwrap_or_default();
    let mut parts = v.split(['.', '+']).map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= want
}

impl OffloadBackend for PyCuda {
    type Host = CudaBackend;
    type Slot = PySlot;
    type Event = CheckedEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        BACKEND
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<PySlot> {
        self.engine.alloc_slot(bytes, purpose)
    }
    fn copy_to_slot(&self, src: &CudaHostBuffer, dst: &mut PySlot, bytes: usize, after: Option<&CheckedEvent>) -> Result<CheckedEvent> {
        // `new_buffer` makes each buffer itself with `torch.empty` on the engine's compute
        // stream, so torch's caching allocator hands it out and reuses it in that order.
        // SAFETY: `new_buffer` returns a torch tensor owning the checked CUDA memory at its address.
        unsafe { self.engine.copy_to_slot(src, dst, bytes, after, |len| self.new_buffer(len)) }
    }
    offload_cuda::forward_to_framework_buffers!(engine);
}
