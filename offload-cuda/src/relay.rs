//! Relay: one GPU's copies over several GPUs' host links.
//!
//! With relay on ([`CudaBackend::enable_relay`]), a copy of a plain page-locked
//! host buffer into this backend's device is split in shares. This device fetches
//! the first share itself, on its copy stream. Each helper GPU fetches its share
//! over its own host link into one of a few staging buffers in its memory (the
//! helper's load stream), then copies it peer to peer into this device's slot (the
//! helper's forward stream, `cuMemcpyPeerAsync`). Events order every step across
//! the devices; the copy stream waits for every share's forward, so the copy's
//! event, the one the ring hands compute, completes when the whole block has
//! landed. No host synchronisation on the way.
//!
//! Ordering, per share: the load waits for the last forward out of its staging
//! buffer; the forward waits for its load and for an event recorded on the copy
//! stream after the copy's own waits (the slot's last use, its previous copy, and
//! in the checking mode the poison and spin); the copy stream waits for the forward.
//! So a share is written into the slot only after the slot is free, a staging
//! buffer is loaded only after its last forward has read it, and the host buffer is
//! read by a helper only while the copy stream (whose drain every host buffer's
//! drop waits for) has not passed the share's forward.
//!
//! Mapped (registered) and pageable buffers, coded buffers, and copies smaller
//! than [`RelayOptions::min_relay_bytes`] go direct, as without relay.

use crate::engine::CudaEvent;
use crate::engine::{open_context, Engine};
use crate::error::driver;
use crate::memory::HostBytes;
use cudarc::driver::{sys, CudaContext, CudaStream};
use offload_core::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What [`CudaBackend::enable_relay`](crate::CudaBackend::enable_relay) sets up.
#[derive(Clone, Debug)]
pub struct RelayOptions {
    /// Helper devices (ordinals), each carrying a share of every relayed copy.
    pub helpers: Vec<usize>,
    /// Share of each copy each helper carries; `None`: equal shares over this
    /// device and the helpers (`1 / (helpers + 1)` each).
    pub helper_share: Option<f64>,
    /// Staging buffers per helper (at least 2: one loading while one forwards).
    pub staging_buffers: usize,
    /// The largest copy relayed: sizes the staging buffers (a larger one goes direct).
    pub max_copy_bytes: usize,
    /// Copies smaller than this go direct.
    pub min_relay_bytes: usize,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions { helpers: vec![1], helper_share: None, staging_buffers: 3, max_copy_bytes: 512 << 20, min_relay_bytes: 1 << 20 }
    }
}

/// What relay was set up with.
#[derive(Clone, Debug, PartialEq)]
pub struct RelayInfo {
    /// Helper devices.
    pub helpers: Vec<usize>,
    /// Share of each relayed copy each helper carries.
    pub helper_share: f64,
    /// Staging bytes held on each helper.
    pub staging_bytes_per_helper: u64,
}

/// One helper GPU: its context and load stream, the forward stream (on this
/// device) that pulls its shares, its staging buffers.
struct Helper {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    load: Arc<CudaStream>,
    forward: Arc<CudaStream>,
    staging: Vec<sys::CUdeviceptr>,
    staging_bytes: usize,
    /// The next staging buffer, and each buffer's last forward.
    ring: Mutex<(usize, Vec<Option<CudaEvent>>)>,
    relayed: AtomicU64,
}

/// The relay engine of a backend.
pub(crate) struct Relay {
    helpers: Vec<Helper>,
    share: f64,
    min_bytes: usize,
}

// SAFETY: the staging pointers are device addresses owned by this value, used only
// under `ring`'s lock (to pick one) and in `Drop`; the rest is cudarc's `Send + Sync` handles.
unsafe impl Send for Relay {}
// SAFETY: as above.
unsafe impl Sync for Relay {}

fn peer_access(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<()> {
    from.bind_to_thread().map_err(|e| driver("binding a context", e))?;
    // SAFETY: both contexts are live; enabling access twice is reported and ignored.
    match unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) } {
        sys::cudaError_enum::CUDA_SUCCESS | sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => Err(driver(
            format!("enabling peer access from device {} to device {}", from.ordinal(), to.ordinal()),
            cudarc::driver::DriverError(e),
        )),
    }
}

impl Relay {
    pub(crate) fn new(shared: &Engine, o: &RelayOptions) -> Result<(Self, RelayInfo)> {
        let r = Self::open(shared, o);
        // Whatever happened, leave this device's context current on the thread.
        let _ = shared.ctx.bind_to_thread();
        r
    }

    fn open(shared: &Engine, o: &RelayOptions) -> Result<(Self, RelayInfo)> {
        let me = shared.ctx.ordinal();
        if o.helpers.is_empty() {
            return Err(Error::unsupported("cuda", "relay with no helper device"));
        }
        if o.staging_buffers < 2 {
            return Err(Error::Plan(format!("relay: {} staging buffers per helper, at least 2 are needed", o.staging_buffers)));
        }
        let share = o.helper_share.unwrap_or(1.0 / (o.helpers.len() + 1) as f64);
        if !(share > 0.0 && share * o.helpers.len() as f64 <= 1.0) {
            return Err(Error::Plan(format!("relay: a helper share of {share} for {} helpers", o.helpers.len())));
        }
        let staging_bytes = ((o.max_copy_bytes as f64 * share).ceil() as usize).next_multiple_of(256);
        let mut helpers = Vec::new();
        let dev0 = shared.ctx.cu_device();
        for &h in &o.helpers {
            if h == me || helpers.iter().any(|x: &Helper| x.ordinal == h) {
                return Err(Error::Plan(format!("relay: helper device {h} is this device or named twice")));
            }
            // SAFETY: the helper's context is used only here, on streams the relay orders.
            let ctx = unsafe { open_context(h) }
                .map_err(|e| Error::unsupported("cuda", format!("relay: helper device {h} cannot be opened: {e}")))?;
            let mut can = 0i32;
            // SAFETY: two live device handles; `can` is written on success.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), dev0) }
                .result()
                .map_err(|e| driver("asking for peer access", e))?;
            if can == 0 {
                return Err(Error::unsupported(
                    "cuda",
                    format!("relay: device {h} cannot write into device {me}'s memory (no P2P access)"),
                ));
            }
            peer_access(&ctx, &shared.ctx)?;
            peer_access(&shared.ctx, &ctx)?;
            ctx.bind_to_thread().map_err(|e| driver("binding a helper's context", e))?;
            let load = ctx.new_stream().map_err(|e| driver("creating a helper's load stream", e))?;
            // The forward pulls the share on this device's side: its slots come from the
            // stream-ordered pool, which peers cannot write without pool access rights,
            // while the helper's staging (`cuMemAlloc`) is readable once peer access is on.
            let forward = shared.ctx.new_stream().map_err(|e| driver("creating a forward stream", e))?;
            ctx.bind_to_thread().map_err(|e| driver("binding a helper's context", e))?;
            let mut helper = Helper {
                ordinal: h,
                ctx,
                load,
                forward,
                staging: Vec::new(),
                staging_bytes,
                ring: Mutex::new((0, vec![None; o.staging_buffers])),
                relayed: AtomicU64::new(0),
            };
            for _ in 0..o.staging_buffers {
                // SAFETY: a plain allocation in the helper's context (bound above), freed in `Drop`.
                let p = unsafe { cudarc::driver::result::malloc_sync(staging_bytes) }
                    .map_err(|e| driver(format!("allocating {staging_bytes} bytes of staging on helper device {h}"), e))?;
                helper.staging.push(p);
            }
            helpers.push(helper);
        }
        shared.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        let info = RelayInfo {
            helpers: o.helpers.clone(),
            helper_share: share,
            staging_bytes_per_helper: (staging_bytes * o.staging_buffers) as u64,
        };
        Ok((Relay { helpers, share, min_bytes: o.min_relay_bytes }, info))
    }

    /// Whether a copy of `bytes` from a plain page-locked buffer (not mapped,
    /// not coded: the caller's to say) is relayed.
    pub(crate) fn takes(&self, bytes: usize) -> bool {
        bytes >= self.min_bytes.max(1) && self.helpers.iter().all(|h| ((bytes as f64 * self.share) as usize) <= h.staging_bytes)
    }

    /// Bytes each helper has carried.
    pub(crate) fn relayed(&self) -> Vec<(usize, u64)> {
        self.helpers.iter().map(|h| (h.ordinal, h.relayed.load(Ordering::Relaxed))).collect()
    }

    /// Enqueue the copy of `bytes` of `src` to `dst` in shares: this device's on
    /// `copy` (already ordered after the copy's waits), each helper's through its
    /// staging, and make `copy` wait for every forward.
    ///
    /// # Safety
    ///
    /// `dst .. dst + bytes` is device memory of `copy`'s context that stays
    /// allocated until `copy` has passed the work enqueued here; `src` stays alive
    /// until then (its drop drains `copy`).
    pub(crate) unsafe fn copy(
        &self,
        ctx0: &Arc<CudaContext>,
        copy: &Arc<CudaStream>,
        src: &HostBytes,
        dst: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        let shares: Vec<usize> = self.helpers.iter().map(|_| ((bytes as f64 * self.share) as usize) / 256 * 256).collect();
        let direct = bytes - shares.iter().sum::<usize>();
        let start = copy.record_event(None).map_err(|e| driver("recording the relay's start", e))?;
        if direct > 0 {
            // SAFETY: `src` holds `bytes` (checked by the caller) and outlives the copy;
            // `dst` by this function's contract.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.ptr() as *const _, direct, copy.cu_stream()) }
                .result()
                .map_err(|e| driver(format!("copying {direct} bytes to the device (relay, direct share)"), e))?;
        }
        let mut offset = direct;
        for (h, &n) in self.helpers.iter().zip(&shares) {
            if n == 0 {
                continue;
            }
            let mut ring = h.ring.lock().unwrap_or_else(|e| e.into_inner());
            let k = ring.0;
            ring.0 = (k + 1) % h.staging.len();
            let fail = |what: &str, e: cudarc::driver::DriverError| driver(format!("relay through device {}: {what}", h.ordinal), e);
            // The load touches only the host buffer (immutable while copies from it
            // run) and the staging buffer: it need not wait for the slot, the forward does.
            if let Some(last) = &ring.1[k] {
                h.load.wait(last.event()).map_err(|e| fail("waiting for the staging buffer's last forward", e))?;
            }
            // The staging buffer holds `staging_bytes ≥ n` (`takes`) and is free (its last
            // forward waited for above); `src + offset .. + n` lies in `src`, page-locked
            // portable memory alive until `copy` passes this share.
            // SAFETY: both ranges valid and unshared for this copy, as just said.
            unsafe { sys::cuMemcpyHtoDAsync_v2(h.staging[k], src.ptr().add(offset) as *const _, n, h.load.cu_stream()) }
                .result()
                .map_err(|e| fail("loading a share into staging", e))?;
            let loaded = h.load.record_event(None).map_err(|e| fail("recording a load", e))?;
            h.forward.wait(&start).map_err(|e| fail("ordering a forward after the copy's waits", e))?;
            h.forward.wait(&loaded).map_err(|e| fail("ordering a forward after its load", e))?;
            // The forward waits for `start` (the copy's own waits) and for its load.
            // SAFETY: `dst + offset .. + n` lies in the live slot (contract), ordered as just
            // said; the staging was loaded above; this device has peer access to it.
            unsafe { sys::cuMemcpyPeerAsync(dst + offset as u64, ctx0.cu_ctx(), h.staging[k], h.ctx.cu_ctx(), n, h.forward.cu_stream()) }
                .result()
                .map_err(|e| fail("forwarding a share peer to peer", e))?;
            let done = CudaEvent::new(h.forward.record_event(None).map_err(|e| fail("recording a forward", e))?);
            ring.1[k] = Some(done.clone());
            drop(ring);
            copy.wait(done.event()).map_err(|e| fail("the copy stream waiting for a forward", e))?;
            h.relayed.fetch_add(n as u64, Ordering::Relaxed);
            offset += n;
        }
        ctx0.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        Ok(())
    }

    /// Report an asynchronous error on a helper's streams (never blocks).
    pub(crate) fn poll(&self) -> Result<()> {
        for h in &self.helpers {
            for (name, s) in [("load", &h.load), ("forward", &h.forward)] {
                s.context().bind_to_thread().map_err(|e| driver("binding a context", e))?;
                // SAFETY: a query of a live stream handle.
                match unsafe { sys::cuStreamQuery(s.cu_stream()) } {
                    sys::cudaError_enum::CUDA_SUCCESS | sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                    e => {
                        return Err(driver(
                            format!("helper device {}'s {name} stream reported an asynchronous error", h.ordinal),
                            cudarc::driver::DriverError(e),
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    /// Wait for every helper stream (teardown, errors).
    pub(crate) fn synchronize(&self) -> Result<()> {
        // Drain every helper, then report the first failure.
        let mut first = Ok(());
        for h in &self.helpers {
            let r = h.load.synchronize().map_err(|e| driver(format!("synchronizing helper device {}'s load stream", h.ordinal), e));
            let f = h.forward.synchronize().map_err(|e| driver(format!("synchronizing the forward stream of helper {}", h.ordinal), e));
            if first.is_ok() {
                first = r.and(f);
            }
        }
        first
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        // A forward may still read staging: free only after both streams drained
        // (also when `Relay::new` failed part-way: nothing was enqueued then).
        if self.load.synchronize().and_then(|()| self.forward.synchronize()).is_err() {
            tracing::warn!("relay: helper device {}'s streams could not be drained; its staging is leaked", self.ordinal);
            return;
        }
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        for &p in &self.staging {
            // SAFETY: allocated by `malloc_sync` in this context; nothing reads it any more.
            if let Err(e) = unsafe { cudarc::driver::result::free_sync(p) } {
                tracing::warn!("relay: freeing staging on device {}: {e}", self.ordinal);
            }
        }
    }
}
