//! The core every other part of the crate stands on: a context, its copy and
//! compute streams, the counters, and the checking mode's poison before a copy.
//! It imports no other file of the crate but the errors: registration, coding,
//! the relay and the folds are built on it, never into it.

use crate::error::driver;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use offload_core::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, OnceLock};

/// Byte written over a slot by the checking mode before each copy into it.
pub const POISON: u8 = 0xDB;

/// Whether the CUDA driver library can be loaded on this machine: looked
/// for once a process (a failed load is not remembered by cudarc, and every
/// call into the Python package asks: on a machine without the driver each
/// look walks the loader's search path for a dozen library names).
#[cfg(not(feature = "linked"))]
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the driver library; no CUDA call is made.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Whether the CUDA driver library can be loaded on this machine: with cudarc
/// linked at link time (feature `linked`, candle's CUDA build) a binary that runs
/// has it.
#[cfg(feature = "linked")]
pub fn driver_present() -> bool {
    true
}

/// Whether this machine has no CUDA device to run on: no driver library, or a
/// driver that sees no device (`cuInit`'s `CUDA_ERROR_NO_DEVICE`, or none
/// counted). What a GPU test skips on; any other failure is a failure.
pub fn no_device() -> bool {
    if !driver_present() {
        return true;
    }
    match CudaContext::device_count() {
        Ok(n) => n == 0,
        Err(e) => e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE,
    }
}

/// The primary context of device `ordinal`, with cudarc's per-slice event
/// tracking turned off (the engine orders its streams itself).
///
/// # Safety
///
/// cudarc's safe operations on this context's `CudaSlice`s no longer order
/// themselves across streams: the caller must make every use of a slice on one
/// stream wait (by events or a synchronisation) for its uses on other streams.
pub(crate) unsafe fn open_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver_present() {
        return Err(Error::unsupported(crate::error::BACKEND, "no CUDA driver library (libcuda.so) on this machine"));
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| driver(format!("opening device {ordinal}"), e))?;
    // SAFETY: called before anything is allocated on it; the caller orders
    // cross-stream uses (this function's contract).
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

/// A point in one of a backend's streams: [`CudaBackend`](crate::CudaBackend)'s
/// event (`OffloadBackend::Event`), which a stream can wait for. Opaque on
/// purpose: cudarc's `CudaEvent` hands out its context, and the backend's
/// context has cudarc's event tracking off (see `CudaBackend::ctx`), which safe
/// code must not reach.
#[derive(Clone)]
pub struct CudaEvent(Arc<cudarc::driver::CudaEvent>);

impl CudaEvent {
    pub(crate) fn new(event: cudarc::driver::CudaEvent) -> Self {
        CudaEvent(Arc::new(event))
    }

    /// The event, for this crate's own stream waits and timings.
    pub(crate) fn event(&self) -> &cudarc::driver::CudaEvent {
        &self.0
    }
}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CudaEvent")
    }
}

/// The checking mode's spin before each copy (the poison needs nothing).
pub(crate) struct Checking {
    /// A kernel `spin(u64 ns)` that touches no memory.
    pub(crate) spin: CudaFunction,
    pub(crate) copy_spin_ns: u64,
}

/// A context, its streams and counters: what every buffer and slot of one
/// backend instance holds on to (an `Arc`), and compares to refuse another's.
pub(crate) struct Engine {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) copy: Arc<CudaStream>,
    pub(crate) compute: Arc<CudaStream>,
    pub(crate) live_bytes: AtomicU64,
    pub(crate) peak_bytes: AtomicU64,
    pub(crate) pinned_bytes: AtomicU64,
    pub(crate) syncs: AtomicU64,
    pub(crate) copies: AtomicU64,
    pub(crate) bytes_copied: AtomicU64,
    /// The checking mode, once on.
    pub(crate) checking: OnceLock<Checking>,
    /// A deliberate break: refills do not wait for the buffer's last copy
    /// (`CudaBackend::sabotage_refill_early`, feature `sabotage` only).
    pub(crate) refill_early: AtomicBool,
    /// Set once work the engine no longer tracks may still run (a copy enqueued
    /// and then failed, and the stream could not be drained): from then on no
    /// slot or framework buffer a copy might still write is freed; it is leaked.
    pub(crate) lost: AtomicBool,
    /// The largest piece a block's host-to-device copy is enqueued in (0: one
    /// copy). A copy the model issues itself (a pageable `.to(device)` of a small
    /// table inside a block, often followed by torch's stream sync) shares the
    /// host-to-device copy engine with the block copies; queued behind a whole
    /// block's copy it waits for all of it, and the block's compute with it. The
    /// hope was that in pieces it would wait for one piece at most; measured, it
    /// did not ([`DEFAULT_COPY_CHUNK`]).
    pub(crate) copy_chunk: AtomicUsize,
    /// Whether page-locked host buffers are ordinary memory registered after
    /// their fill (`cuMemHostRegister`) rather than `cuMemHostAlloc`'s
    /// ([`pin_by_register_from_env`]).
    pub(crate) pin_by_register: AtomicBool,
    /// Tests only: the `cuMemHostRegister` of `pin_by_register` refused as a
    /// driver would refuse it, to show the fallback (`HostBytes::registered`).
    pub(crate) refuse_pin_register: AtomicBool,
}

/// The default piece of a block copy: none (one copy a block). Pieces of 8 MiB
/// were measured on CogView4 on an H100 (bench/NOTES.md, 2026-12-06): they did
/// not let the model's own copies through sooner, and one process ran 8 %
/// slower with them; `OFFLOAD_COPY_CHUNK_BYTES` sets a piece to measure again.
pub(crate) const DEFAULT_COPY_CHUNK: usize = 0;

/// The copy piece this process starts with: `OFFLOAD_COPY_CHUNK_BYTES`, or
/// [`DEFAULT_COPY_CHUNK`] where it is unset or not a number.
fn copy_chunk_from_env() -> usize {
    std::env::var("OFFLOAD_COPY_CHUNK_BYTES").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(DEFAULT_COPY_CHUNK)
}

/// Whether this process pins host buffers by registering ordinary memory
/// after its fill: `OFFLOAD_PIN_BY_REGISTER=1`. An experiment, off by default:
/// on the H100 runner `cuMemHostAlloc` pins at about 2 GB/s, the fill's bound
/// (bench/NOTES.md, 2026-12-07); memory the fill's threads fault in, then
/// registered, may pin faster. Not measured yet.
fn pin_by_register_from_env() -> bool {
    std::env::var("OFFLOAD_PIN_BY_REGISTER").is_ok_and(|v| v.trim() == "1")
}

impl Engine {
    /// The engine on `ctx`, computing on `compute`, with a new non-blocking copy
    /// stream; the device's default pool keeps freed memory (slots are reused,
    /// never returned to the driver mid-run).
    pub(crate) fn new(ctx: Arc<CudaContext>, compute: Arc<CudaStream>) -> Result<Arc<Self>> {
        let copy = ctx.new_stream().map_err(|e| driver("creating the copy stream", e))?;
        // SAFETY: the device handle comes from a live context; `threshold` outlives the call.
        unsafe {
            let mut pool = std::mem::MaybeUninit::uninit();
            sys::cuDeviceGetDefaultMemPool(pool.as_mut_ptr(), ctx.cu_device())
                .result()
                .map_err(|e| driver("getting the memory pool", e))?;
            let mut threshold = u64::MAX;
            sys::cuMemPoolSetAttribute(
                pool.assume_init(),
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut _,
            )
            .result()
            .map_err(|e| driver("setting the pool's release threshold", e))?;
        }
        Ok(Arc::new(Engine {
            ctx,
            copy,
            compute,
            live_bytes: AtomicU64::new(0),
            peak_bytes: AtomicU64::new(0),
            pinned_bytes: AtomicU64::new(0),
            syncs: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            bytes_copied: AtomicU64::new(0),
            checking: OnceLock::new(),
            refill_early: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            copy_chunk: AtomicUsize::new(copy_chunk_from_env()),
            pin_by_register: AtomicBool::new(pin_by_register_from_env()),
            refuse_pin_register: AtomicBool::new(false),
        }))
    }

    /// Drain the copy stream after a failed copy (its enqueued part must not run
    /// unseen); if that fails too, the engine is lost ([`Engine::lost`]).
    pub(crate) fn drain_copies(&self) {
        if self.copy.synchronize().is_err() {
            self.mark_lost("the copy stream could not be drained after a failed copy");
        }
    }

    /// From now on nothing a copy might write is freed (see [`Engine::lost`]).
    pub(crate) fn mark_lost(&self, why: &str) {
        if !self.lost.swap(true, std::sync::atomic::Ordering::SeqCst) {
            tracing::error!("{why}: work may still run on the device, so slots are leaked from now on");
        }
    }

    /// Whether the engine is lost ([`Engine::lost`]).
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Make the context current on this thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))
    }

    /// The checking mode's poison over `dst .. dst + dst_len` and its spin, on
    /// the copy stream (nothing where the mode is off).
    ///
    /// # Safety
    ///
    /// `dst .. dst + dst_len` is device memory of this context that stays
    /// allocated until the copy stream has passed this work.
    pub(crate) unsafe fn enqueue_checking(&self, dst: sys::CUdeviceptr, dst_len: usize) -> Result<()> {
        let Some(chk) = self.checking.get() else { return Ok(()) };
        if dst_len > 0 {
            // SAFETY: `dst` addresses `dst_len` live bytes (this function's contract).
            unsafe { sys::cuMemsetD8Async(dst, POISON, dst_len, self.copy.cu_stream()) }
                .result()
                .map_err(|e| driver("poisoning a slot (checking mode)", e))?;
        }
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the spin kernel takes one u64 and touches no memory.
        unsafe { self.copy.launch_builder(&chk.spin).arg(&chk.copy_spin_ns).launch(one) }
            .map_err(|e| driver("the checking mode's copy-stream spin", e))?;
        Ok(())
    }
}
