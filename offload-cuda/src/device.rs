//! The CUDA backend handle: a context, a copy stream and a compute stream.

use crate::error::{driver, is_oom, BACKEND};
use crate::memory::{CudaSlot, PinnedHost};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use offload_core::{Error, MemoryInfo, OffloadBackend, Result, StreamKind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Byte written over a slot by the checking mode before each copy into it.
pub const POISON: u8 = 0xDB;

/// The checking mode ([`CudaBackend::enable_checking`]).
pub(crate) struct Checking {
    spin: CudaFunction,
    copy_spin_ns: u64,
}

pub(crate) struct Shared {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) copy: Arc<CudaStream>,
    pub(crate) compute: Arc<CudaStream>,
    pub(crate) live_bytes: AtomicU64,
    pub(crate) peak_bytes: AtomicU64,
    pub(crate) pinned_bytes: AtomicU64,
    pub(crate) syncs: AtomicU64,
    pub(crate) copies: AtomicU64,
    pub(crate) bytes_copied: AtomicU64,
    pub(crate) checking: OnceLock<Checking>,
    /// The decode engine of coded streaming, once a coded buffer is asked for.
    pub(crate) coding: OnceLock<crate::coded::Coding>,
    /// Every `alloc_host` codes its block ([`CudaBackend::enable_coding`]).
    pub(crate) code_all: std::sync::atomic::AtomicBool,
    /// Mapped regions registered with the device (the mapped host tier).
    pub(crate) regions: crate::mapped::Registrations,
    /// Helper GPUs carrying shares of each copy ([`CudaBackend::enable_relay`]).
    pub(crate) relay: OnceLock<crate::relay::Relay>,
    /// A deliberate break: refills do not wait for the buffer's last copy
    /// (`CudaBackend::sabotage_refill_early`, feature `sabotage` only).
    pub(crate) refill_early: std::sync::atomic::AtomicBool,
}

/// Counters of a [`CudaBackend`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaCounters {
    /// Slot bytes allocated now.
    pub live_bytes: u64,
    /// Peak of `live_bytes` since the last reset.
    pub peak_bytes: u64,
    /// Page-locked host bytes held by this backend's buffers.
    pub pinned_bytes: u64,
    /// Host synchronisations through [`OffloadBackend::synchronize`].
    pub syncs: u64,
    /// Host-to-device copies issued.
    pub copies: u64,
    /// Bytes copied host to device (coded bytes for coded blocks: the wire's).
    pub bytes_copied: u64,
    /// Copies of coded blocks (decoded on the device).
    pub coded_copies: u64,
    /// The most staging bytes the decode engine held at once: its
    /// [`staging_buffers`](crate::CodingOptions::staging_buffers) buffers, each at least the
    /// largest coded block copied so far (rounded up to 2 MiB). Count it in a budget.
    pub staging_peak_bytes: u64,
}

/// The raw CUDA backend. Cheap to clone (an `Arc`).
///
/// Copies run on a non-blocking copy stream; the model computes on the compute
/// stream ([`compute_stream`](Self::compute_stream)): enqueue every kernel that
/// reads a block there.
///
/// Slots are reused in place: a device address taken from a block
/// ([`CudaBlockExt`](crate::CudaBlockExt)) is valid for kernels enqueued while its
/// guard lives. Using it later needs `unsafe` (a kernel launch) and reads whatever
/// the slot holds then; the framework backends (candle, tch) lend tensors instead,
/// which keep their block's bytes alive on their own.
#[derive(Clone)]
pub struct CudaBackend {
    pub(crate) shared: Arc<Shared>,
}

/// Whether the CUDA driver library can be loaded on this machine.
#[cfg(not(feature = "linked"))]
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the driver library; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// Whether the CUDA driver library can be loaded on this machine: with cudarc
/// linked at link time (feature `linked`, candle's CUDA build) a binary that runs
/// has it.
#[cfg(feature = "linked")]
pub fn driver_present() -> bool {
    true
}

impl CudaBackend {
    /// The backend on device `ordinal`, computing on a new non-blocking stream.
    ///
    /// Returns [`Error::Unsupported`] where no CUDA driver is installed, and a
    /// device error where there is no such device.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: the context is only reachable through `CudaBackend`'s unsafe
        // accessors, whose callers take on ordering across streams.
        let ctx = unsafe { Self::context(ordinal)? };
        let compute = ctx.new_stream().map_err(|e| driver("creating the compute stream", e))?;
        Self::with_compute_stream(ctx, compute)
    }

    /// The backend on device `ordinal`, computing on a new non-blocking stream of
    /// the device's highest priority. The ring's other streams (copies, and the
    /// decoder with [`enable_coding`](Self::enable_coding)) keep the default,
    /// lowest priority, so the block scheduler dispatches their waiting kernels'
    /// blocks only after compute's. On the H200 this did not shorten a coded
    /// compute-bound step (Flux-dev at 2048², +1.5 % over raw either way:
    /// `bench/NOTES.md`), so [`new`](Self::new) stays the default. Errors as
    /// [`new`](Self::new).
    pub fn new_high_priority_compute(ordinal: usize) -> Result<Self> {
        // SAFETY: as in `new`.
        let ctx = unsafe { Self::context(ordinal)? };
        let (_, highest) =
            cudarc::driver::result::stream::get_priority_range().map_err(|e| driver("reading the stream priority range", e))?;
        let compute = ctx.new_stream_with_priority(highest).map_err(|e| driver("creating the compute stream", e))?;
        Self::with_compute_stream(ctx, compute)
    }

    /// The primary context of device `ordinal`, with cudarc's per-slice event
    /// tracking turned off (the ring orders its streams itself).
    ///
    /// # Safety
    ///
    /// cudarc's safe operations on this context's `CudaSlice`s no longer order
    /// themselves across streams: the caller must make every use of a slice on one
    /// stream wait (by events or a synchronisation) for its uses on other streams.
    pub unsafe fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
        if !driver_present() {
            return Err(Error::unsupported(BACKEND, "no CUDA driver library (libcuda.so) on this machine"));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver(format!("opening device {ordinal}"), e))?;
        // SAFETY: called before this backend allocates anything; the caller orders
        // cross-stream uses (this function's contract).
        unsafe { ctx.disable_event_tracking() };
        Ok(ctx)
    }

    /// The backend on `ctx`, computing on `compute` (for frameworks that own
    /// their compute stream). A new non-blocking copy stream is created.
    pub fn with_compute_stream(ctx: Arc<CudaContext>, compute: Arc<CudaStream>) -> Result<Self> {
        let copy = ctx.new_stream().map_err(|e| driver("creating the copy stream", e))?;
        // Keep freed slots in the pool instead of returning them to the driver.
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
        let shared = Shared {
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
            coding: OnceLock::new(),
            code_all: std::sync::atomic::AtomicBool::new(false),
            regions: Default::default(),
            relay: OnceLock::new(),
            refill_early: std::sync::atomic::AtomicBool::new(false),
        };
        Ok(CudaBackend { shared: Arc::new(shared) })
    }

    /// The context.
    ///
    /// # Safety
    ///
    /// Where the backend made it ([`new`](Self::new)) cudarc's event tracking is off
    /// on it: the caller orders every cross-stream use of cudarc memory on it (see
    /// [`context`](Self::context)). Safe code cannot reach it:
    ///
    /// ```compile_fail,E0133
    /// fn name(b: &offload_cuda::CudaBackend) -> String {
    ///     b.ctx().name().unwrap_or_default() // error: call to unsafe function
    /// }
    /// ```
    pub unsafe fn ctx(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The stream the model computes on.
    ///
    /// # Safety
    ///
    /// As for [`ctx`](Self::ctx): cudarc memory used on this stream and another
    /// must be ordered by the caller.
    pub unsafe fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.shared.compute
    }

    /// The stream copies run on.
    ///
    /// # Safety
    ///
    /// As for [`ctx`](Self::ctx); besides, work the caller enqueues here delays
    /// the ring's copies.
    pub unsafe fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.shared.copy
    }

    /// The device's name (`"NVIDIA H200"`).
    pub fn device_name(&self) -> Result<String> {
        self.shared.ctx.name().map_err(|e| driver("reading the device name", e))
    }

    /// Bytes in use in the device's current memory pool, now and at most since
    /// the last [`reset_pool_peak`](Self::reset_pool_peak): what stream-ordered
    /// allocations hold (frameworks on cudarc, such as candle, and slots), not
    /// what the pool keeps cached.
    pub fn pool_used_bytes(&self) -> Result<(u64, u64)> {
        let pool = self.current_pool()?;
        let (mut now, mut high) = (0u64, 0u64);
        // SAFETY: `pool` is the live context's current pool; each attribute is a
        // cuuint64_t written into the u64 given, which outlives the call.
        unsafe {
            sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &mut now as *mut u64 as *mut _)
                .result()
                .map_err(|e| driver("reading the pool's used bytes", e))?;
            sys::cuMemPoolGetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut high as *mut u64 as *mut _)
                .result()
                .map_err(|e| driver("reading the pool's peak used bytes", e))?;
        }
        Ok((now, high))
    }

    /// Restart the current pool's peak at the bytes in use now.
    pub fn reset_pool_peak(&self) -> Result<()> {
        let pool = self.current_pool()?;
        let mut zero = 0u64;
        // SAFETY: as in `pool_used_bytes`; the driver only accepts 0 for this attribute.
        unsafe {
            sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut zero as *mut u64 as *mut _)
                .result()
                .map_err(|e| driver("resetting the pool's peak", e))
        }
    }

    /// The device's current memory pool (where `cuMemAllocAsync` allocates).
    fn current_pool(&self) -> Result<sys::CUmemoryPool> {
        self.shared.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        let mut pool = std::mem::MaybeUninit::uninit();
        // SAFETY: the device handle comes from a live context; `pool` is written on success.
        unsafe {
            sys::cuDeviceGetMemPool(pool.as_mut_ptr(), self.shared.ctx.cu_device())
                .result()
                .map_err(|e| driver("getting the memory pool", e))?;
            Ok(pool.assume_init())
        }
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.shared.ctx.ordinal()
    }

    /// The identity of this transfer engine (equal for clones, different for
    /// every [`new`](Self::new) or [`with_compute_stream`](Self::with_compute_stream)):
    /// what a [`DeviceSlot`](crate::DeviceSlot) names as the engine whose compute
    /// stream orders its free.
    pub fn engine_id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    /// The checking mode, for conformance runs on a real device: before every
    /// copy into a slot the copy stream overwrites the whole slot with [`POISON`]
    /// and then spins for `copy_spin_us` before it writes the block. A read
    /// before the copy's event (invariant 1) then sees poison rather than the
    /// block, and a copy not ordered after the slot's last read (invariant 2)
    /// poisons bytes a kernel is still reading — a wrong result instead of a lucky
    /// timing. Costs a memset and a spin per copy: never on in a measured run.
    /// Once on, it stays on for every clone of this backend.
    pub fn enable_checking(&self, copy_spin_us: u64) -> Result<()> {
        if self.shared.checking.get().is_some() {
            return Ok(());
        }
        let spin = crate::fold::spin_function(self)?;
        let _ = self.shared.checking.set(Checking { spin, copy_spin_ns: copy_spin_us * 1000 });
        Ok(())
    }

    /// A deliberate break for the conformance suite (`Sabotage::EarlyRefill`):
    /// from now on, refilling a host buffer (the disk tier's bounce buffers) does
    /// not wait for the buffer's last copy, so a copy still queued lands the
    /// refill's bytes. Never in production: the feature `sabotage` only.
    #[cfg(feature = "sabotage")]
    #[doc(hidden)]
    pub fn sabotage_refill_early(&self) {
        self.shared.refill_early.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Relay (issue 18): from now on, each copy of a plain page-locked host buffer
    /// of at least [`RelayOptions::min_relay_bytes`] is split in shares, one fetched
    /// by this device, one by each helper GPU over its own host link into its
    /// staging and pulled into the slot over NVLink (see [`crate::relay`]). The
    /// copy's event completes when every share has landed; nothing blocks the host.
    ///
    /// [`Error::Unsupported`] (and nothing changed) where a helper cannot be opened
    /// or this device has no peer access to it: copies then stay direct, as the
    /// caller should say. Once on, relay stays on for every clone of this backend.
    pub fn enable_relay(&self, options: crate::RelayOptions) -> Result<crate::RelayInfo> {
        if self.shared.relay.get().is_some() {
            return Err(Error::Plan("relay is already on for this backend".into()));
        }
        let (relay, info) = crate::relay::Relay::new(&self.shared, &options)?;
        self.shared.relay.set(relay).map_err(|_| Error::Plan("relay was turned on twice at once".into()))?;
        Ok(info)
    }

    /// Bytes each helper device has carried (relay on), by ordinal.
    pub fn relayed_bytes(&self) -> Vec<(usize, u64)> {
        self.shared.relay.get().map_or(Vec::new(), |r| r.relayed())
    }

    /// Whether the checking mode is on.
    pub fn is_checking(&self) -> bool {
        self.shared.checking.get().is_some()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Enqueue on the copy stream: wait for `after` (if any), then copy the first
    /// `bytes` of `src` to device address `dst` (`dst_len` bytes of device
    /// memory). Returns the copy's event. Host buffers of another backend
    /// instance are refused (their drop drains another copy stream). A coded
    /// buffer ([`enable_coding`](Self::enable_coding)) is copied whole to a staging
    /// buffer and decoded into `dst` (which must then be 4-byte aligned, as every
    /// CUDA allocation is, and `bytes` the block's own length); the event returned
    /// is the decode's.
    ///
    /// # Safety
    ///
    /// `dst .. dst + dst_len` is device memory of this backend's context that
    /// stays allocated, and is not freed or reused, until the returned event has
    /// completed (order its free after the event).
    pub unsafe fn copy_to_device(
        &self,
        src: &PinnedHost,
        dst: sys::CUdeviceptr,
        dst_len: usize,
        bytes: usize,
        after: Option<&Arc<CudaEvent>>,
    ) -> Result<Arc<CudaEvent>> {
        if !Arc::ptr_eq(src.shared(), &self.shared) {
            return Err(Error::Protocol(
                "copy from a host buffer of another CUDA backend instance (its drop would not wait for this copy)".into(),
            ));
        }
        if let Some(ch) = src.coded() {
            // SAFETY: this function's contract, passed on.
            return unsafe { self.coded_copy(src, ch, dst, dst_len, bytes, after) };
        }
        if bytes > src.len() || bytes > dst_len {
            return Err(Error::Protocol(format!("copy of {bytes} bytes from a {}-byte buffer into a {dst_len}-byte slot", src.len())));
        }
        self.bind()?;
        let s = &self.shared;
        if let Some(ev) = after {
            s.copy.wait(ev).map_err(|e| driver("copy stream waiting for a slot's last use", e))?;
        }
        // Once anything is enqueued, an error must not leave it running unseen: the
        // caller gets no event to order the destination's free after, so drain.
        let drained = |e: Error| {
            let _ = s.copy.synchronize();
            e
        };
        match s.relay.get().filter(|r| r.takes(src, bytes)) {
            None => self.enqueue_copy(src, dst, dst_len, bytes).map_err(drained)?,
            Some(relay) => {
                // The checking mode's poison and spin first, then the shares.
                self.enqueue_copy(src, dst, dst_len, 0).map_err(drained)?;
                // `dst` holds `bytes ≤ dst_len` live bytes until the copy stream passes this
                // copy (this function's contract); `src` drains the copy stream before it is
                // freed (it belongs to this backend: checked above).
                // SAFETY: relay.copy's contract holds, as just said.
                if let Err(e) = unsafe { relay.copy(&s.ctx, &s.copy, src, dst, bytes) } {
                    let _ = relay.synchronize();
                    return Err(drained(e));
                }
            }
        }
        let ev = src.record_copy(|| match s.copy.record_event(None) {
            Ok(ev) => Ok(Arc::new(ev)),
            Err(e) => Err(drained(driver("recording a copy event", e))),
        })?;
        s.copies.fetch_add(1, Ordering::Relaxed);
        s.bytes_copied.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(ev)
    }

    /// The checking mode's poison and spin, then the copy, on the copy stream.
    pub(crate) fn enqueue_copy(&self, src: &PinnedHost, dst: sys::CUdeviceptr, dst_len: usize, bytes: usize) -> Result<()> {
        let s = &self.shared;
        if let Some(chk) = s.checking.get() {
            if dst_len > 0 {
                // SAFETY: `dst` addresses `dst_len` live bytes (`copy_to_device`'s contract),
                // ordered after the slot's last use by its wait.
                unsafe { sys::cuMemsetD8Async(dst, POISON, dst_len, s.copy.cu_stream()) }
                    .result()
                    .map_err(|e| driver("poisoning a slot (checking mode)", e))?;
            }
            let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the spin kernel takes one u64 and touches no memory.
            unsafe { s.copy.launch_builder(&chk.spin).arg(&chk.copy_spin_ns).launch(one) }
                .map_err(|e| driver("the checking mode's copy-stream spin", e))?;
        }
        if bytes > 0 {
            // The host buffer (pinned, or pageable as a fallback) outlives the copy: its Drop
            // drains the copy stream (it belongs to this backend: checked by `copy_to_device`).
            // SAFETY: `src` stays valid until the copy completes (above); `dst` by
            // `copy_to_device`'s contract; `bytes` fits both (checked there).
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.ptr() as *const _, bytes, s.copy.cu_stream()) }
                .result()
                .map_err(|e| driver(format!("copying {bytes} bytes to the device"), e))?;
        }
        Ok(())
    }

    /// Counters so far.
    pub fn counters(&self) -> CudaCounters {
        let s = &self.shared;
        CudaCounters {
            live_bytes: s.live_bytes.load(Ordering::Relaxed),
            peak_bytes: s.peak_bytes.load(Ordering::Relaxed),
            pinned_bytes: s.pinned_bytes.load(Ordering::Relaxed),
            syncs: s.syncs.load(Ordering::Relaxed),
            copies: s.copies.load(Ordering::Relaxed),
            bytes_copied: s.bytes_copied.load(Ordering::Relaxed),
            coded_copies: s.coding.get().map_or(0, |c| c.coded_copies.load(Ordering::Relaxed)),
            staging_peak_bytes: s.coding.get().map_or(0, |c| c.staging_peak.load(Ordering::Relaxed)),
        }
    }

    /// Restart the peak at the current live bytes.
    pub fn reset_peak(&self) {
        let s = &self.shared;
        s.peak_bytes.store(s.live_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn bind(&self) -> Result<()> {
        self.shared.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))
    }
}

impl OffloadBackend for CudaBackend {
    type HostBuffer = PinnedHost;
    type Slot = CudaSlot;
    type Event = Arc<CudaEvent>;
    type Wait = ();

    fn name(&self) -> &'static str {
        BACKEND
    }

    fn alloc_host(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
        match self.shared.coding.get().filter(|_| self.shared.code_all.load(Ordering::Acquire)) {
            Some(c) => PinnedHost::new_coded(self.shared.clone(), c, bytes, fill, purpose),
            None => PinnedHost::new(self.shared.clone(), bytes, fill, purpose),
        }
    }

    fn host_in_region(&self, region: &Arc<dyn offload_core::HostRegion>, offset: usize, bytes: usize, purpose: &str) -> Result<PinnedHost> {
        self.mapped_host(region, offset, bytes, purpose)
    }

    fn alloc_host_coded(&self, bytes: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
        // Without a decode engine (no libnvrtc, say) the store holds the block as it is.
        let c = self
            .coding_engine(crate::CodingOptions::default())
            .map_err(|e| Error::unsupported(BACKEND, format!("decoding coded blocks on the device (for {purpose}): {e}")))?;
        PinnedHost::new_coded(self.shared.clone(), c, bytes, fill, purpose)
    }

    fn alloc_host_precoded(
        &self,
        bytes: usize,
        coded_len: usize,
        purpose: &str,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<PinnedHost> {
        let c = self
            .coding_engine(crate::CodingOptions::default())
            .map_err(|e| Error::unsupported(BACKEND, format!("decoding coded blocks on the device (for {purpose}): {e}")))?;
        PinnedHost::new_precoded(self.shared.clone(), c, bytes, coded_len, fill, purpose)
    }

    fn alloc_host_pageable(&self, bytes: usize, _purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<PinnedHost> {
        PinnedHost::new_pageable(self.shared.clone(), bytes, fill)
    }

    fn refill_host(&self, buffer: &mut PinnedHost, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        if !Arc::ptr_eq(buffer.shared(), &self.shared) {
            return Err(Error::Protocol("refilling a host buffer of another CUDA backend instance".into()));
        }
        buffer.refill(fill)
    }

    fn is_pinned(&self, buffer: &PinnedHost) -> bool {
        buffer.is_pinned()
    }

    fn host_held_bytes(&self, buffer: &PinnedHost) -> Option<usize> {
        buffer.is_coded().then(|| buffer.len())
    }

    fn host_bytes<'a>(&self, buffer: &'a PinnedHost) -> Result<&'a [u8]> {
        buffer.block_bytes()
    }

    fn host_is_pinned(&self) -> bool {
        true
    }

    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<CudaSlot> {
        self.bind()?;
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: allocation on a live stream; the slot frees it (stream-ordered) on drop.
            match unsafe { result::malloc_async(self.shared.copy.cu_stream(), bytes) } {
                Ok(p) => p,
                Err(e) if is_oom(&e) => {
                    let free = self.shared.ctx.mem_get_info().map(|(f, _)| f as u64).unwrap_or(0);
                    return Err(Error::OutOfDeviceMemory {
                        backend: BACKEND.into(),
                        requested: bytes as u64,
                        free,
                        purpose: purpose.into(),
                    });
                }
                Err(e) => return Err(driver(format!("allocating {bytes} bytes for {purpose}"), e)),
            }
        };
        let s = &self.shared;
        let live = s.live_bytes.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        s.peak_bytes.fetch_max(live, Ordering::Relaxed);
        Ok(CudaSlot { ptr, len: bytes, last_copy: None, shared: s.clone() })
    }

    fn free_slot(&self, slot: CudaSlot, after: Option<&Arc<CudaEvent>>) -> Result<()> {
        if !Arc::ptr_eq(&slot.shared, &self.shared) {
            return Err(Error::Protocol("freeing a slot of another CUDA backend instance".into()));
        }
        if let Some(ev) = after {
            self.bind()?;
            self.shared.compute.wait(ev).map_err(|e| driver("ordering a slot's release", e))?;
        }
        drop(slot);
        Ok(())
    }

    fn copy_to_slot(&self, src: &PinnedHost, dst: &mut CudaSlot, bytes: usize, after: Option<&Arc<CudaEvent>>) -> Result<Arc<CudaEvent>> {
        if !Arc::ptr_eq(&dst.shared, &self.shared) {
            return Err(Error::Protocol("copy into a slot of another CUDA backend instance".into()));
        }
        // A coded copy into this slot finishes on the decode stream: a later copy
        // (coded or not) must not overtake it, even where no read of the slot came
        // between (a prefetched block evicted unread). Within the copy stream the
        // wait is already in order.
        if let Some(prev) = &dst.last_copy {
            self.bind()?;
            self.shared.copy.wait(prev).map_err(|e| driver("ordering a copy after the slot's previous copy", e))?;
        }
        // SAFETY: the slot owns `len` bytes of this context; its Drop orders the
        // free after `last_copy`, set to this copy's event below.
        let ev = unsafe { self.copy_to_device(src, dst.ptr, dst.len, bytes, after)? };
        dst.last_copy = Some(ev.clone());
        Ok(ev)
    }

    fn compute_wait(&self, event: &Arc<CudaEvent>) -> Result<()> {
        self.shared.compute.wait(event).map_err(|e| driver("compute stream waiting for a copy", e))
    }

    fn record_compute(&self) -> Result<Arc<CudaEvent>> {
        Ok(Arc::new(self.shared.compute.record_event(None).map_err(|e| driver("recording a compute event", e))?))
    }

    fn synchronize(&self) -> Result<()> {
        self.shared.syncs.fetch_add(1, Ordering::Relaxed);
        self.shared.copy.synchronize().map_err(|e| driver("synchronizing the copy stream", e))?;
        if let Some(c) = self.shared.coding.get() {
            c.decode.synchronize().map_err(|e| driver("synchronizing the decode stream", e))?;
        }
        self.shared.compute.synchronize().map_err(|e| driver("synchronizing the compute stream", e))
    }

    fn poll_error(&self) -> Result<()> {
        if let Some(c) = self.shared.coding.get() {
            c.poll()?;
        }
        if let Some(r) = self.shared.relay.get() {
            r.poll()?;
        }
        // The streams may be the legacy default stream (tch): query in this context.
        self.bind()?;
        self.shared.ctx.check_err().map_err(|e| driver("a deferred driver error", e))?;
        // Ask the device too: a query never blocks, and returns a sticky error (an
        // illegal address in a kernel, say) that no call has reported yet.
        let decode = self.shared.coding.get().map(|c| ("decode", &c.decode));
        for (name, stream) in [("copy", &self.shared.copy), ("compute", &self.shared.compute)].into_iter().chain(decode) {
            // SAFETY: a query of a live stream handle.
            match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
                sys::cudaError_enum::CUDA_SUCCESS | sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                e => return Err(driver(format!("the {name} stream reported an asynchronous error"), cudarc::driver::DriverError(e))),
            }
        }
        Ok(())
    }

    fn record_timing(&self, on: StreamKind) -> Result<Option<Arc<CudaEvent>>> {
        let stream = match on {
            StreamKind::Copy => &self.shared.copy,
            StreamKind::Compute => &self.shared.compute,
        };
        let ev = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| driver("recording a timing event", e))?;
        Ok(Some(Arc::new(ev)))
    }

    fn elapsed_s(&self, from: &Arc<CudaEvent>, to: &Arc<CudaEvent>) -> Result<Option<f64>> {
        Ok(Some(from.elapsed_ms(to).map_err(|e| driver("reading a timing event", e))? as f64 / 1e3))
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        let (free, total) = self.shared.ctx.mem_get_info().map_err(|e| driver("cuMemGetInfo", e))?;
        Ok(MemoryInfo { free: free as u64, total: total as u64 })
    }
}
