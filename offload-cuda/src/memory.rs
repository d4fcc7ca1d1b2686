//! Page-locked host buffers and device slots. Each owns its memory and frees it
//! only once no asynchronous copy can still touch it.

use crate::coded::{CodedHost, Coding};
use crate::device::Shared;
use crate::error::driver;
use cudarc::driver::{result, sys, CudaEvent};
use offload_core::Result;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Page-locked (not write-combined) host memory holding one block, immutable
/// after it is filled; or, as the plan's fallback, ordinary pageable memory; or,
/// with coding on ([`CudaBackend::enable_coding`](crate::CudaBackend::enable_coding)),
/// page-locked memory holding the block coded for the device.
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    /// Whether the buffer is pageable: then `ptr` is a `Box<[u8]>` of `len`
    /// bytes released into a raw pointer (`Box::into_raw`), freed by `Drop`.
    pageable: bool,
    /// `Some` when the bytes are the block coded for the device.
    coded: Option<CodedHost>,
    /// `Some` when the bytes are a range of a registered region (the mapped host
    /// tier): `ptr` points into the mapping, which only the device reads.
    mapped: Option<MappedHost>,
    /// The last copy from the buffer, waited for before it is refilled
    /// ([`refill`](Self::refill), the disk tier's bounce buffers).
    last_copy: std::sync::Mutex<Option<Arc<CudaEvent>>>,
    shared: Arc<Shared>,
}

/// A buffer's range of a registered region, and its bytes as host code reads
/// them (through the file, on first use).
struct MappedHost {
    reg: Arc<crate::mapped::Registration>,
    offset: usize,
    read: std::sync::OnceLock<Box<[u8]>>,
}

// SAFETY: the buffer is plain bytes owned by this value; after `fill` it is never
// written again, so shared references from several threads only read it.
unsafe impl Send for PinnedHost {}
// SAFETY: as above: immutable after construction, so `&PinnedHost` is safe to share.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    pub(crate) fn new(shared: Arc<Shared>, len: usize, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>, purpose: &str) -> Result<Self> {
        shared.ctx.bind_to_thread().map_err(|e| driver("bind context", e))?;
        let ptr = if len == 0 {
            std::ptr::null_mut()
        } else {
            // SAFETY: a plain allocation of `len` bytes; the pointer is checked by the driver's result.
            let p = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) };
            p.map_err(|e| offload_core::Error::HostAlloc {
                backend: "cuda".into(),
                requested: len as u64,
                purpose: purpose.to_owned(),
                reason: format!("cuMemHostAlloc: {e}"),
            })? as *mut u8
        };
        // Counted from here: `Drop` subtracts it, whatever happens to `fill`.
        shared.pinned_bytes.fetch_add(len as u64, Ordering::Relaxed);
        let me = PinnedHost { ptr, len, pageable: false, coded: None, mapped: None, last_copy: Default::default(), shared };
        if len > 0 {
            // cuMemHostAlloc's memory is uninitialised: zero it before safe code sees it.
            // SAFETY: `ptr` points to `len` writable bytes we own exclusively.
            unsafe { std::ptr::write_bytes(me.ptr, 0, me.len) };
            // SAFETY: `ptr` points to `len` initialised bytes we own exclusively until `me` is returned.
            let bytes = unsafe { std::slice::from_raw_parts_mut(me.ptr, me.len) };
            fill(bytes)?;
        }
        Ok(me)
    }

    pub(crate) fn new_pageable(shared: Arc<Shared>, len: usize, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self> {
        let mut bytes = vec![0u8; len].into_boxed_slice();
        fill(&mut bytes)?;
        // The pointer is the box's own, taken as it is given up (no later move of
        // the box invalidates it); `Drop` rebuilds the box from it.
        let ptr = Box::into_raw(bytes).cast::<u8>();
        Ok(PinnedHost { ptr, len, pageable: true, coded: None, mapped: None, last_copy: Default::default(), shared })
    }

    /// The block of `len` bytes `fill` writes, coded for the device
    /// (`code_for_device` with `coding`'s options) into page-locked memory; the
    /// raw bytes are held only while coding.
    pub(crate) fn new_coded(
        shared: Arc<Shared>,
        coding: &Coding,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        purpose: &str,
    ) -> Result<Self> {
        let mut raw = vec![0u8; len];
        fill(&mut raw)?;
        let o = coding.options;
        let coded = offload_core::codec::code_for_device(&raw, o.segment_bytes, o.threads);
        drop(raw);
        let info = CodedHost::new(coding, &coded, len, purpose)?;
        let mut me = PinnedHost::new(
            shared,
            coded.len(),
            &mut |dst| {
                dst.copy_from_slice(&coded);
                Ok(())
            },
            purpose,
        )?;
        me.coded = Some(info);
        Ok(me)
    }

    /// A coded buffer of a `len`-byte block whose `coded_len` coded bytes
    /// `fill` writes (made ahead of time), parsed before it is handed out.
    pub(crate) fn new_precoded(
        shared: Arc<Shared>,
        coding: &Coding,
        len: usize,
        coded_len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        purpose: &str,
    ) -> Result<Self> {
        let mut me = PinnedHost::new(shared, coded_len, fill, purpose)?;
        me.coded = Some(CodedHost::new(coding, me.own_bytes(), len, purpose)?);
        Ok(me)
    }

    /// `len` bytes at `offset` of a registered region, served in place.
    pub(crate) fn in_region(shared: Arc<Shared>, reg: Arc<crate::mapped::Registration>, offset: usize, len: usize) -> Self {
        // `mapped_host` checked `offset + len` lies in the region.
        let ptr = reg.base().wrapping_add(offset);
        let mapped = Some(MappedHost { reg, offset, read: Default::default() });
        PinnedHost { ptr, len, pageable: false, coded: None, mapped, last_copy: Default::default(), shared }
    }

    /// Record a copy's event with `record` and remember it as the last copy from
    /// this buffer, under one lock: of copies enqueued from several threads, the
    /// event kept is the one recorded last on the stream, which every earlier
    /// enqueued copy precedes.
    pub(crate) fn record_copy(&self, record: impl FnOnce() -> Result<Arc<CudaEvent>>) -> Result<Arc<CudaEvent>> {
        let mut last = self.last_copy.lock().unwrap_or_else(|e| e.into_inner());
        let ev = record()?;
        *last = Some(ev.clone());
        Ok(ev)
    }

    /// Write the buffer again: wait (on this thread) for its last copy, then let
    /// `fill` write every byte. Not for coded or mapped buffers.
    pub(crate) fn refill(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        if self.coded.is_some() || self.mapped.is_some() {
            return Err(offload_core::Error::unsupported("cuda", "refilling a coded or mapped host buffer"));
        }
        let last = self.last_copy.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        // The deliberate break (`sabotage_refill_early`) forgets the copy instead.
        let last = last.filter(|_| !self.shared.refill_early.load(Ordering::Relaxed));
        if let Some(ev) = last {
            self.shared.ctx.bind_to_thread().map_err(|e| driver("bind context", e))?;
            if let Err(e) = ev.synchronize() {
                // The copy's fate is unknown: keep waiting for it on the next refill.
                *self.last_copy.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(ev);
                return Err(driver("waiting for a host buffer's last copy before refilling it", e));
            }
        }
        if self.len == 0 {
            return fill(&mut []);
        }
        // `ptr` is `len` bytes owned by `self` (cuMemHostAlloc memory, or the
        // pageable box given up in `new_pageable`); `&mut self`
        // excludes every host view of it; every copy records itself in `last_copy`.
        // (Under the deliberate break a copy may still be reading it: the device
        // then lands torn bytes, which no host code reads through this slice.)
        // SAFETY: exclusive (just said), and the last copy that read it has completed.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) };
        fill(bytes)
    }

    /// Whether the bytes are served in place from a mapped checkpoint.
    pub fn is_mapped(&self) -> bool {
        self.mapped.is_some()
    }

    pub(crate) fn coded(&self) -> Option<&CodedHost> {
        self.coded.as_ref()
    }

    /// Whether the buffer holds its block coded for the device.
    pub fn is_coded(&self) -> bool {
        self.coded.is_some()
    }

    /// The block's own bytes: [`as_slice`](Self::as_slice) for a plain buffer;
    /// for a coded one, decoded on the host (for reference runs and checks, never
    /// on the streaming path). A decode is kept while the coded bytes hash the
    /// same, so asking again costs a hash; if they changed, they are decoded
    /// afresh (and the earlier decode kept too, for the references handed out).
    ///
    /// An error where they cannot be had: a coded buffer that does not decode
    /// (its memory damaged after it was checked at build: decoding verifies every
    /// segment's hash), or a mapped one whose file can no longer be read
    /// ([`as_slice`](Self::as_slice)).
    pub fn block_bytes(&self) -> Result<&[u8]> {
        let Some(c) = &self.coded else { return self.as_slice() };
        let h = offload_core::codec::hash64(self.own_bytes());
        let mut d = c.decoded.lock().unwrap_or_else(|e| e.into_inner());
        if d.last().is_none_or(|(last, _)| *last != h) {
            let mut out = vec![0u8; c.raw_len].into_boxed_slice();
            offload_core::codec::decode_device_block(self.own_bytes(), &mut out, &c.purpose).map_err(|e| {
                offload_core::Error::Protocol(format!(
                    "{}: a coded host buffer no longer decodes ({e}): host memory damaged since it was built",
                    c.purpose
                ))
            })?;
            d.push((h, out));
        }
        let b = &d[d.len() - 1].1;
        // `decoded` is only appended to, and moving a `Box` within the vector does
        // not move its heap bytes.
        // SAFETY: the boxed bytes are never freed or written while `self` lives.
        Ok(unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) })
    }

    /// Whether the buffer is page-locked.
    pub fn is_pinned(&self) -> bool {
        !self.pageable
    }

    /// The bytes held (for a coded buffer, the coded bytes; see
    /// [`block_bytes`](Self::block_bytes)). A buffer served from a mapped
    /// checkpoint is read from the file on first use (never through the mapping):
    /// an error naming the file if it can no longer be read (cut short, replaced
    /// or written since the store was built).
    pub fn as_slice(&self) -> Result<&[u8]> {
        let Some(m) = &self.mapped else { return Ok(self.own_bytes()) };
        if self.len == 0 {
            return Ok(&[]);
        }
        if let Some(b) = m.read.get() {
            return Ok(b);
        }
        let mut b = vec![0u8; self.len].into_boxed_slice();
        m.reg.region().read_at(m.offset, &mut b)?;
        Ok(m.read.get_or_init(|| b))
    }

    /// The bytes of a buffer that is not served from a mapped region (its own
    /// memory); empty for a mapped one, which host code reads only through its
    /// file ([`as_slice`](Self::as_slice)).
    fn own_bytes(&self) -> &[u8] {
        if self.len == 0 || self.mapped.is_some() {
            return &[];
        }
        // SAFETY: `ptr` is valid for `len` bytes for as long as `self` lives and is
        // never written after construction (not a mapped range: checked above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(crate) fn ptr(&self) -> *const u8 {
        self.ptr
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        // A copy from this buffer may still be queued: wait for the copy stream
        // (teardown only, never on the streaming path). If the drain fails, a copy
        // may still read the bytes: leak them rather than free them under it.
        if let Err(e) = self.shared.copy.synchronize() {
            tracing::warn!("a {}-byte host buffer is leaked: the copy stream could not be drained ({e})", self.len);
            // (A pageable buffer's box is simply never rebuilt: leaked.)
            return;
        }
        if self.pageable {
            // SAFETY: `ptr` and `len` are the `Box<[u8]>` given up in `new_pageable`,
            // rebuilt once, here; no copy can read it any more (drained above).
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
            return;
        }
        if self.mapped.is_some() {
            // A mapped range is the registration's.
            return;
        }
        // SAFETY: `ptr` came from cuMemHostAlloc and no copy can read it any more.
        if let Err(e) = unsafe { result::free_host(self.ptr as *mut _) } {
            tracing::warn!("cuMemFreeHost: {e}");
        }
        self.shared.pinned_bytes.fetch_sub(self.len as u64, Ordering::Relaxed);
    }
}

/// Device memory for one block, from the stream-ordered pool. Dropping it frees
/// the memory on the compute stream after the last copy into it.
pub struct CudaSlot {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) last_copy: Option<Arc<CudaEvent>>,
    pub(crate) shared: Arc<Shared>,
}

impl CudaSlot {
    /// Device address of the slot's first byte.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slot has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for CudaSlot {
    fn drop(&mut self) {
        let sh = &self.shared;
        let r = sh.ctx.bind_to_thread().and_then(|()| {
            if let Some(ev) = &self.last_copy {
                sh.compute.wait(ev)?;
            }
            if self.len > 0 {
                // The free is ordered on the compute stream after its reads (the ring's
                // protocol) and after the last copy into it (the wait above).
                // SAFETY: `ptr` came from cuMemAllocAsync and nothing enqueued after this uses it.
                unsafe { result::free_async(self.ptr, sh.compute.cu_stream()) }?;
            }
            Ok(())
        });
        if let Err(e) = r {
            tracing::warn!("freeing a {}-byte slot: {e}", self.len);
        }
        sh.live_bytes.fetch_sub(self.len as u64, Ordering::Relaxed);
    }
}
