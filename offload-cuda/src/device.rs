//! The CUDA backend: the core engine ([`crate::engine`]) with the features
//! built on it — registration of mapped checkpoints, coded streaming, the
//! relay — wired together, as the ring's [`OffloadBackend`] and its
//! [`HostMemory`]. Nothing below imports this file.

use crate::coded::{Coding, CodingOptions};
use crate::engine::CudaEvent;
use crate::engine::{open_context, Engine};
use crate::error::{driver, BACKEND};
use crate::host::CudaHostBuffer;
use crate::mapped::Registrations;
use crate::memory::CudaSlot;
use crate::relay::{Relay, RelayInfo, RelayOptions};
use cudarc::driver::{sys, CudaContext, CudaStream};
use offload_core::{
    Error, Fill, HostBufferOf, HostCapabilities, HostKind, HostMemory, HostRegion, MemoryInfo, OffloadBackend, Result, StreamKind,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

/// One backend instance: its engine and the features turned on over it.
pub(crate) struct Shared {
    pub(crate) engine: Arc<Engine>,
    /// The decode engine of coded streaming, once a coded buffer is asked for.
    pub(crate) coding: OnceLock<Coding>,
    /// Every pinned buffer is made coded ([`CudaBackend::enable_coding`]).
    pub(crate) code_all: AtomicBool,
    /// Mapped regions registered with the device (the mapped host tier).
    pub(crate) regions: Registrations,
    /// Helper GPUs carrying shares of each copy ([`CudaBackend::enable_relay`]).
    pub(crate) relay: OnceLock<Relay>,
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
        // SAFETY: this function's contract, passed on.
        unsafe { open_context(ordinal) }
    }

    /// The backend on `ctx`, computing on `compute` (for frameworks that own
    /// their compute stream). A new non-blocking copy stream is created. A
    /// stream of another context is refused: slots are freed on it.
    pub fn with_compute_stream(ctx: Arc<CudaContext>, compute: Arc<CudaStream>) -> Result<Self> {
        if compute.context().cu_ctx() != ctx.cu_ctx() {
            return Err(Error::Protocol(format!(
                "a compute stream of device {}'s context given with device {}'s",
                compute.context().ordinal(),
                ctx.ordinal()
            )));
        }
        let shared = Shared {
            engine: Engine::new(ctx, compute)?,
            coding: OnceLock::new(),
            code_all: AtomicBool::new(false),
            regions: Registrations::default(),
            relay: OnceLock::new(),
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
        &self.engine().ctx
    }

    /// The stream the model computes on.
    ///
    /// # Safety
    ///
    /// As for [`ctx`](Self::ctx): cudarc memory used on this stream and another
    /// must be ordered by the caller.
    pub unsafe fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.engine().compute
    }

    /// The stream copies run on.
    ///
    /// # Safety
    ///
    /// As for [`ctx`](Self::ctx); besides, work the caller enqueues here delays
    /// the ring's copies.
    pub unsafe fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.engine().copy
    }

    /// The device's name (`"NVIDIA H200"`).
    pub fn device_name(&self) -> Result<String> {
        self.engine().ctx.name().map_err(|e| driver("reading the device name", e))
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
        self.engine().bind()?;
        let mut pool = std::mem::MaybeUninit::uninit();
        // SAFETY: the device handle comes from a live context; `pool` is written on success.
        unsafe {
            sys::cuDeviceGetMemPool(pool.as_mut_ptr(), self.engine().ctx.cu_device())
                .result()
                .map_err(|e| driver("getting the memory pool", e))?;
            Ok(pool.assume_init())
        }
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.engine().ctx.ordinal()
    }

    /// The identity of this transfer engine (equal for clones, different for
    /// every [`new`](Self::new) or [`with_compute_stream`](Self::with_compute_stream)):
    /// what a [`DeviceSlot`](crate::DeviceSlot) names as the engine whose compute
    /// stream orders its free.
    pub fn engine_id(&self) -> usize {
        Arc::as_ptr(self.engine()) as usize
    }

    /// A deliberate break for the conformance suite (`Sabotage::EarlyRefill`):
    /// from now on, refilling a host buffer (the disk tier's bounce buffers) does
    /// not wait for the buffer's last copy, so a copy still queued lands the
    /// refill's bytes. Never in production: the feature `sabotage` only.
    #[cfg(feature = "sabotage")]
    #[doc(hidden)]
    pub fn sabotage_refill_early(&self) {
        self.engine().refill_early.store(true, Ordering::Relaxed);
    }

    /// Relay: from now on, each copy of a plain page-locked host buffer
    /// of at least [`RelayOptions::min_relay_bytes`] is split in shares, one fetched
    /// by this device, one by each helper GPU over its own host link into its
    /// staging and pulled into the slot over NVLink (see [`crate::relay`]). The
    /// copy's event completes when every share has landed; nothing blocks the host.
    ///
    /// [`Error::Unsupported`] (and nothing changed) where a helper cannot be opened
    /// or this device has no peer access to it: copies then stay direct, as the
    /// caller should say. Once on, relay stays on for every clone of this backend.
    pub fn enable_relay(&self, options: RelayOptions) -> Result<RelayInfo> {
        if self.shared.relay.get().is_some() {
            return Err(Error::Plan("relay is already on for this backend".into()));
        }
        let (relay, info) = Relay::new(self.engine(), &options)?;
        self.shared.relay.set(relay).map_err(|_| Error::Plan("relay was turned on twice at once".into()))?;
        Ok(info)
    }

    /// Bytes each helper device has carried (relay on), by ordinal.
    pub fn relayed_bytes(&self) -> Vec<(usize, u64)> {
        self.shared.relay.get().map_or(Vec::new(), |r| r.relayed())
    }

    /// Whether the checking mode is on.
    pub fn is_checking(&self) -> bool {
        self.engine().checking.get().is_some()
    }

    /// The core engine (context, streams, counters).
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.shared.engine
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
        src: &CudaHostBuffer,
        dst: sys::CUdeviceptr,
        dst_len: usize,
        bytes: usize,
        after: Option<&CudaEvent>,
    ) -> Result<CudaEvent> {
        let s = self.engine();
        let bytes_src = src.bytes();
        if !Arc::ptr_eq(bytes_src.engine(), s) {
            return Err(Error::Protocol(
                "copy from a host buffer of another CUDA backend instance (its drop would not wait for this copy)".into(),
            ));
        }
        if let Some(ch) = src.coded() {
            let Some(c) = self.shared.coding.get() else {
                return Err(Error::Protocol(format!("{}: a coded host buffer on a backend with coding off", ch.purpose)));
            };
            // SAFETY: this function's contract, passed on.
            return unsafe { c.copy(bytes_src, ch, dst, dst_len, bytes, after) };
        }
        if bytes > src.len() || bytes > dst_len {
            return Err(Error::Protocol(format!("copy of {bytes} bytes from a {}-byte buffer into a {dst_len}-byte slot", src.len())));
        }
        s.bind()?;
        if let Some(ev) = after {
            s.copy.wait(ev.event()).map_err(|e| driver("copy stream waiting for a slot's last use", e))?;
        }
        // Once anything is enqueued, an error must not leave it running unseen: the
        // caller gets no event to order the destination's free after, so drain.
        let drained = |e: Error| {
            s.drain_copies();
            e
        };
        match self.shared.relay.get().filter(|r| src.is_plain_pinned() && r.takes(bytes)) {
            // SAFETY: `dst .. dst + dst_len` stays allocated until the copy stream
            // passes the copy (this function's contract); `bytes ≤ dst_len` (above).
            None => unsafe { bytes_src.enqueue_copy(dst, dst_len, bytes) }.map_err(drained)?,
            Some(relay) => {
                // The checking mode's poison and spin first, then the shares.
                // SAFETY: as just said.
                unsafe { s.enqueue_checking(dst, dst_len) }.map_err(drained)?;
                // `dst` holds `bytes ≤ dst_len` live bytes until the copy stream passes this
                // copy (this function's contract); `src` drains the copy stream before it is
                // freed (it belongs to this backend: checked above).
                // SAFETY: relay.copy's contract holds, as just said.
                if let Err(e) = unsafe { relay.copy(&s.ctx, &s.copy, bytes_src, dst, bytes) } {
                    let _ = relay.synchronize();
                    return Err(drained(e));
                }
            }
        }
        let ev = bytes_src.record_copy(|| match s.copy.record_event(None) {
            Ok(ev) => Ok(CudaEvent::new(ev)),
            Err(e) => Err(drained(driver("recording a copy event", e))),
        })?;
        s.copies.fetch_add(1, Ordering::Relaxed);
        s.bytes_copied.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(ev)
    }

    /// Counters so far.
    pub fn counters(&self) -> CudaCounters {
        let s = self.engine();
        let coding = self.shared.coding.get();
        CudaCounters {
            live_bytes: s.live_bytes.load(Ordering::Relaxed),
            peak_bytes: s.peak_bytes.load(Ordering::Relaxed),
            pinned_bytes: s.pinned_bytes.load(Ordering::Relaxed),
            syncs: s.syncs.load(Ordering::Relaxed),
            copies: s.copies.load(Ordering::Relaxed),
            bytes_copied: s.bytes_copied.load(Ordering::Relaxed),
            coded_copies: coding.map_or(0, |c| c.coded_copies.load(Ordering::Relaxed)),
            staging_peak_bytes: coding.map_or(0, |c| c.staging_peak.load(Ordering::Relaxed)),
        }
    }

    /// Restart the peak at the current live bytes.
    pub fn reset_peak(&self) {
        let s = self.engine();
        s.peak_bytes.store(s.live_bytes.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn bind(&self) -> Result<()> {
        self.engine().bind()
    }
}

impl CudaBackend {
    /// Turn coded streaming on: every page-locked host buffer allocated from now
    /// on ([`HostKind::Pinned`]) holds its block coded (`options`), and every
    /// copy from such a buffer moves the coded bytes and decodes them on the
    /// device into the slot (see the module [`coded`](crate::coded)). Buffers
    /// allocated before stay as they are. The decode engine holds
    /// [`CodingOptions::staging_buffers`] staging buffers from the device's memory
    /// pool, each at least as large as the largest coded block copied so far:
    /// count them in the device budget ([`CudaCounters::staging_peak_bytes`]).
    /// Once on, it stays on; a second call with other options is an error.
    pub fn enable_coding(&self, options: CodingOptions) -> Result<()> {
        let c = self.coding_engine(options)?;
        if c.options != options {
            return Err(Error::Protocol(format!("coding is on with {:?}; asked for {options:?}", c.options)));
        }
        self.shared.code_all.store(true, Ordering::Release);
        Ok(())
    }

    /// Set how many staging buffers coded copies take in turn from now on
    /// ([`CodingOptions::staging_buffers`]), with coding on. Buffers beyond `n`
    /// are freed in the decode stream's order, after the decodes that read them;
    /// new ones are allocated at their first use. Errors if coding is off or `n`
    /// is 0. [`enable_coding`](Self::enable_coding) still compares against the
    /// options the engine was made with.
    pub fn set_staging_buffers(&self, n: usize) -> Result<()> {
        let Some(c) = self.shared.coding.get() else {
            return Err(Error::Protocol("set_staging_buffers: coding is off".into()));
        };
        c.set_staging_buffers(n)
    }

    /// Whether every host buffer allocated now is coded ([`enable_coding`](Self::enable_coding)).
    pub fn is_coding(&self) -> bool {
        self.shared.code_all.load(Ordering::Acquire)
    }

    /// The decode engine, made with `options` if there is none yet (a coded
    /// buffer asked for through [`HostKind::Coded`] makes it with the defaults).
    pub(crate) fn coding_engine(&self, options: CodingOptions) -> Result<&Coding> {
        if self.shared.coding.get().is_none() {
            let coding = Coding::new(self.engine(), options)?;
            // Another thread may have made it meanwhile: its options stand.
            let _ = self.shared.coding.set(coding);
        }
        self.shared.coding.get().ok_or_else(|| Error::Protocol("the decode engine could not be made".into()))
    }

    /// Tests only: refuse the first `n` of [`REGISTRATIONS`](crate::mapped::REGISTRATIONS)
    /// as a driver would (`n = 3`: every one, so the store copies), for mappings
    /// registered from now on.
    #[doc(hidden)]
    pub fn refuse_registrations(&self, n: u8) {
        self.shared.regions.refuse(n);
    }

    /// `bytes` at `offset` of `region`, served in place from its registration.
    fn mapped_host(&self, region: &Arc<dyn HostRegion>, offset: usize, bytes: usize, purpose: &str) -> Result<CudaHostBuffer> {
        if self.is_coding() {
            // Every block is held coded (a copy by nature): mixing mapped raw blocks
            // with coded ones would let two streams write one slot.
            return Err(Error::unsupported(BACKEND, format!("blocks served in place while coding is on (for {purpose})")));
        }
        if offset.checked_add(bytes).is_none_or(|end| end > region.len()) {
            return Err(Error::Protocol(format!(
                "{purpose}: {bytes} bytes at {offset} asked of {} ({} bytes)",
                region.origin(),
                region.len()
            )));
        }
        region.check()?;
        let reg = self.shared.regions.register(self.engine(), region, purpose)?;
        CudaHostBuffer::in_region(reg, offset, bytes)
    }

    /// The decode engine for a coded buffer, or why there is none.
    fn decoder_for(&self, purpose: &str) -> Result<&Coding> {
        // Without a decode engine (no libnvrtc, say) the store holds the block as it is.
        self.coding_engine(CodingOptions::default())
            .map_err(|e| Error::unsupported(BACKEND, format!("decoding coded blocks on the device (for {purpose}): {e}")))
    }
}

/// The backend is its own host memory: page-locked and pageable buffers,
/// buffers coded for the device (where NVRTC builds the decoder), ranges of
/// mapped checkpoints (registered once), and refills of plain buffers.
impl HostMemory for CudaBackend {
    type Buffer = CudaHostBuffer;

    fn capabilities(&self) -> HostCapabilities {
        HostCapabilities { pinned: true, pageable: true, coded: true, mapped: !self.is_coding(), refill: !self.is_coding() }
    }

    /// The decode engine's staging buffers ([`CodingOptions::staging_buffers`]
    /// of them, [`STAGING_BUFFERS`](crate::coded::STAGING_BUFFERS) before it is made),
    /// each grown to the largest coded block copied.
    fn decoder_staging_bytes(&self, largest_coded: usize) -> u64 {
        let n = self.shared.coding.get().map_or(crate::coded::STAGING_BUFFERS, |c| c.staging_buffers());
        offload_core::codec::staging_bytes(n, largest_coded as u64)
    }

    fn alloc(&self, kind: HostKind<'_>, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<CudaHostBuffer> {
        let engine = self.engine().clone();
        match kind {
            HostKind::Pinned => match self.shared.coding.get().filter(|_| self.is_coding()) {
                Some(c) => CudaHostBuffer::new_coded(engine, c, bytes, fill, purpose),
                None => CudaHostBuffer::new(engine, bytes, fill, purpose),
            },
            HostKind::Pageable => CudaHostBuffer::new_pageable(engine, bytes, fill),
            HostKind::Coded => CudaHostBuffer::new_coded(engine, self.decoder_for(purpose)?, bytes, fill, purpose),
            HostKind::Precoded { coded_len } => {
                CudaHostBuffer::new_precoded(engine, self.decoder_for(purpose)?, bytes, coded_len, fill, purpose)
            }
            HostKind::Mapped { region, offset } => self.mapped_host(region, offset, bytes, purpose),
        }
    }
}

impl OffloadBackend for CudaBackend {
    type Host = CudaBackend;
    type Slot = CudaSlot;
    type Event = CudaEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        BACKEND
    }

    fn host(&self) -> CudaBackend {
        self.clone()
    }

    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<CudaSlot> {
        CudaSlot::alloc(self.engine(), bytes, purpose)
    }

    fn free_slot(&self, slot: CudaSlot, after: Option<&CudaEvent>) -> Result<()> {
        if !Arc::ptr_eq(&slot.engine, self.engine()) {
            return Err(Error::Protocol("freeing a slot of another CUDA backend instance".into()));
        }
        if let Some(ev) = after {
            self.bind()?;
            self.engine().compute.wait(ev.event()).map_err(|e| driver("ordering a slot's release", e))?;
        }
        drop(slot);
        Ok(())
    }

    fn copy_to_slot(&self, src: &HostBufferOf<Self>, dst: &mut CudaSlot, bytes: usize, after: Option<&CudaEvent>) -> Result<CudaEvent> {
        if !Arc::ptr_eq(&dst.engine, self.engine()) {
            return Err(Error::Protocol("copy into a slot of another CUDA backend instance".into()));
        }
        // A coded copy into this slot finishes on the decode stream: a later copy
        // (coded or not) must not overtake it, even where no read of the slot came
        // between (a prefetched block evicted unread). Within the copy stream the
        // wait is already in order.
        if let Some(prev) = &dst.last_copy {
            self.bind()?;
            self.engine().copy.wait(prev.event()).map_err(|e| driver("ordering a copy after the slot's previous copy", e))?;
        }
        // SAFETY: the slot owns `len` bytes of this context; its Drop orders the
        // free after `last_copy`, set to this copy's event below.
        let ev = unsafe { self.copy_to_device(src, dst.ptr, dst.len, bytes, after)? };
        dst.last_copy = Some(ev.clone());
        Ok(ev)
    }

    fn compute_wait(&self, event: &CudaEvent) -> Result<()> {
        self.engine().compute.wait(event.event()).map_err(|e| driver("compute stream waiting for a copy", e))
    }

    fn record_compute(&self) -> Result<CudaEvent> {
        Ok(CudaEvent::new(self.engine().compute.record_event(None).map_err(|e| driver("recording a compute event", e))?))
    }

    fn synchronize(&self) -> Result<()> {
        self.engine().syncs.fetch_add(1, Ordering::Relaxed);
        self.engine().copy.synchronize().map_err(|e| driver("synchronizing the copy stream", e))?;
        if let Some(c) = self.shared.coding.get() {
            c.decode.synchronize().map_err(|e| driver("synchronizing the decode stream", e))?;
        }
        self.engine().compute.synchronize().map_err(|e| driver("synchronizing the compute stream", e))
    }

    fn poll_error(&self) -> Result<()> {
        if self.engine().is_lost() {
            return Err(Error::device(BACKEND, "a failed copy", "the copy stream could not be drained; slots are leaked"));
        }
        if let Some(c) = self.shared.coding.get() {
            c.poll()?;
        }
        if let Some(r) = self.shared.relay.get() {
            r.poll()?;
        }
        // The streams may be the legacy default stream (tch): query in this context.
        self.bind()?;
        self.engine().ctx.check_err().map_err(|e| driver("a deferred driver error", e))?;
        // Ask the device too: a query never blocks, and returns a sticky error (an
        // illegal address in a kernel, say) that no call has reported yet.
        let decode = self.shared.coding.get().map(|c| ("decode", &c.decode));
        for (name, stream) in [("copy", &self.engine().copy), ("compute", &self.engine().compute)].into_iter().chain(decode) {
            // SAFETY: a query of a live stream handle.
            match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
                sys::cudaError_enum::CUDA_SUCCESS | sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                e => return Err(driver(format!("the {name} stream reported an asynchronous error"), cudarc::driver::DriverError(e))),
            }
        }
        Ok(())
    }

    fn record_timing(&self, on: StreamKind) -> Result<Option<CudaEvent>> {
        let stream = match on {
            StreamKind::Copy => &self.engine().copy,
            StreamKind::Compute => &self.engine().compute,
        };
        let ev = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| driver("recording a timing event", e))?;
        Ok(Some(CudaEvent::new(ev)))
    }

    fn elapsed_s(&self, from: &CudaEvent, to: &CudaEvent) -> Result<Option<f64>> {
        Ok(Some(from.event().elapsed_ms(to.event()).map_err(|e| driver("reading a timing event", e))? as f64 / 1e3))
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        let (free, total) = self.engine().ctx.mem_get_info().map_err(|e| driver("cuMemGetInfo", e))?;
        Ok(MemoryInfo { free: free as u64, total: total as u64 })
    }
}
