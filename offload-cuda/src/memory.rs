//! Host bytes and device slots, the core's memory: each owns its memory (or
//! holds what owns it) and frees it only once no asynchronous copy can still
//! touch it. What a buffer's bytes mean (a block as it is, coded, a range of a
//! mapped file) is for the layers above ([`crate::host`]).

use crate::engine::CudaEvent;
use crate::engine::Engine;
use crate::error::{driver, is_oom, BACKEND};
use cudarc::driver::{result, sys};
use offload_core::{Error, Result};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Who owns a [`HostBytes`]' memory.
enum Owner {
    /// `cuMemHostAlloc` memory, counted in the engine's pinned bytes.
    Pinned,
    /// A `Box<[u8]>` given up into the pointer (`Box::into_raw`), rebuilt in `Drop`.
    Pageable,
    /// Memory someone else owns and keeps page-locked (a registered mapping),
    /// kept alive by this handle; host code never reads it.
    Lent(#[allow(dead_code)] Arc<dyn Send + Sync>),
    /// An anonymous private mapping of `map_len` bytes (whole pages), filled,
    /// then page-locked by `cuMemHostRegister` (`registered`, and only then
    /// counted in the engine's pinned bytes) ([`HostBytes::registered`]).
    Mapped { map_len: usize, registered: bool },
}

/// Host memory a copy reads: page-locked (not write-combined: `cuMemHostAlloc`'s,
/// or a mapping of its own registered after its fill), pageable as a fallback,
/// or lent by a registration; immutable after it is filled, except through
/// [`refill`](Self::refill).
pub(crate) struct HostBytes {
    ptr: *mut u8,
    len: usize,
    owner: Owner,
    /// The last copy from the buffer, waited for before it is refilled.
    last_copy: std::sync::Mutex<Option<CudaEvent>>,
    engine: Arc<Engine>,
}

// SAFETY: the bytes are owned by this value (or lent to it for its life); after
// `fill` they are written only through `&mut self` (`refill`), so shared
// references from several threads only read them.
unsafe impl Send for HostBytes {}
// SAFETY: as above: immutable behind `&HostBytes`.
unsafe impl Sync for HostBytes {}

impl HostBytes {
    /// `len` page-locked bytes (portable), zeroed, then written by `fill`.
    pub(crate) fn pinned(engine: Arc<Engine>, len: usize, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>, purpose: &str) -> Result<Self> {
        engine.bind()?;
        if len > 0 && engine.pin_by_register.load(Ordering::Relaxed) {
            return Self::registered(engine, len, fill, purpose);
        }
        let ptr = if len == 0 {
            std::ptr::null_mut()
        } else {
            // SAFETY: a plain allocation of `len` bytes; the pointer is checked by the driver's result.
            let p = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) };
            p.map_err(|e| Error::HostAlloc {
                backend: BACKEND.into(),
                requested: len as u64,
                purpose: purpose.to_owned(),
                reason: format!("cuMemHostAlloc: {e}"),
            })? as *mut u8
        };
        // Counted from here: `Drop` subtracts it, whatever happens to `fill`.
        engine.pinned_bytes.fetch_add(len as u64, Ordering::Relaxed);
        let me = HostBytes { ptr, len, owner: Owner::Pinned, last_copy: Default::default(), engine };
        if len > 0 {
            // cuMemHostAlloc's memory is uninitialised: zero it (on several threads
            // where it is large) before safe code sees it as bytes.
            // SAFETY: `ptr` points to `len` writable bytes we own exclusively; as
            // `MaybeUninit<u8>` they need no initialisation to be referenced.
            let raw = unsafe { std::slice::from_raw_parts_mut(me.ptr.cast::<std::mem::MaybeUninit<u8>>(), me.len) };
            offload_core::host::fill_parallel(raw, std::mem::MaybeUninit::new(0));
            // SAFETY: `ptr` points to `len` bytes we own exclusively until `me` is
            // returned, every one written just above (`fill_parallel` sets every element).
            let bytes = unsafe { std::slice::from_raw_parts_mut(me.ptr, me.len) };
            fill(bytes)?;
        }
        Ok(me)
    }

    /// `len` page-locked bytes made another way (`Engine::pin_by_register`): an
    /// anonymous private mapping (zeroed by the kernel, huge pages advised, not
    /// inherited by a child process), written by `fill` (whose threads fault in
    /// the pages of the large tensors they copy), then registered with
    /// `cuMemHostRegister`. Where the mapping, the advice against forking or the
    /// registration is refused, the way is given up for the engine (one
    /// warning) and the buffer made by `cuMemHostAlloc`, from the bytes already
    /// filled where the fill ran (never read twice).
    fn registered(engine: Arc<Engine>, len: usize, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>, purpose: &str) -> Result<Self> {
        let give_up = |why: String| {
            if engine.pin_by_register.swap(false, Ordering::Relaxed) {
                tracing::warn!("OFFLOAD_PIN_BY_REGISTER: {why}; page-locked host buffers come from cuMemHostAlloc from now on");
            }
        };
        let Some(map_len) = len.checked_next_multiple_of(crate::mapped::page_size()) else {
            give_up(format!("{len} bytes do not round up to whole pages"));
            return Self::pinned(engine, len, fill, purpose);
        };
        // SAFETY: a new anonymous private mapping; the kernel picks the address;
        // checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            give_up(format!("mmap of {map_len} bytes: {}", std::io::Error::last_os_error()));
            return Self::pinned(engine, len, fill, purpose);
        }
        // From here `Drop` unmaps it, whatever happens to `fill` or the registration.
        let mut me = HostBytes {
            ptr: p.cast(),
            len,
            owner: Owner::Mapped { map_len, registered: false },
            last_copy: Default::default(),
            engine: engine.clone(),
        };
        // Huge pages: fewer pages to fault in and pin (advice; a refusal changes
        // nothing). Not inherited by a child process, as cuMemHostAlloc's memory
        // is not: a child's copy-on-write would move the pages the device reads.
        // SAFETY: advice on the whole mapping made just above, which `me` owns.
        let no_fork = unsafe {
            libc::madvise(p, map_len, libc::MADV_HUGEPAGE);
            libc::madvise(p, map_len, libc::MADV_DONTFORK)
        };
        if no_fork != 0 {
            give_up(format!("madvise(MADV_DONTFORK): {}", std::io::Error::last_os_error()));
            drop(me);
            return Self::pinned(engine, len, fill, purpose);
        }
        // A fresh anonymous mapping, which the kernel zero-fills; `bytes` is used
        // only while `me` lives (below).
        // SAFETY: `ptr` points to `map_len ≥ len` initialised bytes owned by `me` alone.
        let bytes = unsafe { std::slice::from_raw_parts_mut(me.ptr, me.len) };
        fill(bytes)?;
        let registered = if engine.refuse_pin_register.load(Ordering::Relaxed) {
            Err("refused on purpose (Engine::refuse_pin_register)".to_owned())
        } else {
            // SAFETY: the range is mapped for `me`'s life; `Drop` unregisters it
            // before it unmaps it.
            unsafe { sys::cuMemHostRegister_v2(me.ptr.cast(), map_len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
                .result()
                .map_err(|e| e.to_string())
        };
        match registered {
            Ok(()) => {
                me.owner = Owner::Mapped { map_len, registered: true };
                engine.pinned_bytes.fetch_add(len as u64, Ordering::Relaxed);
                Ok(me)
            }
            Err(e) => {
                give_up(format!("cuMemHostRegister of {map_len} bytes: {e}"));
                let filled: &[u8] = bytes;
                let made = Self::pinned(
                    engine,
                    len,
                    &mut |dst| {
                        offload_core::host::copy_parallel(dst, filled);
                        Ok(())
                    },
                    purpose,
                );
                drop(me);
                made
            }
        }
    }

    /// `len` bytes of ordinary pageable memory written by `fill`.
    pub(crate) fn pageable(engine: Arc<Engine>, len: usize, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self> {
        let mut bytes = offload_core::host::zeroed(BACKEND, len, "pageable host memory")?.into_boxed_slice();
        fill(&mut bytes)?;
        // The pointer is the box's own, taken as it is given up (no later move of
        // the box invalidates it); `Drop` rebuilds the box from it.
        let ptr = Box::into_raw(bytes).cast::<u8>();
        Ok(HostBytes { ptr, len, owner: Owner::Pageable, last_copy: Default::default(), engine })
    }

    /// `len` bytes at `ptr` that `keep` owns and keeps page-locked for this
    /// engine's device (a registered mapping), read only by copies.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + len` stays mapped, registered with `engine`'s context and
    /// unchanged while `keep` lives; `keep`'s own drop drains `engine`'s copy
    /// stream before it gives the range up.
    pub(crate) unsafe fn lent(engine: Arc<Engine>, ptr: *mut u8, len: usize, keep: Arc<dyn Send + Sync>) -> Self {
        HostBytes { ptr, len, owner: Owner::Lent(keep), last_copy: Default::default(), engine }
    }

    /// Record a copy's event with `record` and remember it as the last copy from
    /// this buffer, under one lock: of copies enqueued from several threads, the
    /// event kept is the one recorded last on the stream, which every earlier
    /// enqueued copy precedes.
    pub(crate) fn record_copy(&self, record: impl FnOnce() -> Result<CudaEvent>) -> Result<CudaEvent> {
        let mut last = self.last_copy.lock().unwrap_or_else(|e| e.into_inner());
        let ev = record()?;
        *last = Some(ev.clone());
        Ok(ev)
    }

    /// Write the buffer again: wait (on this thread) for its last copy, then let
    /// `fill` write every byte. Not for lent bytes.
    pub(crate) fn refill(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        if let Owner::Lent(_) = self.owner {
            return Err(Error::unsupported(BACKEND, "refilling host bytes lent by a registration"));
        }
        // Once the engine is lost a copy no event covers may still read the bytes:
        // nothing is written under it.
        if self.engine.is_lost() {
            return Err(Error::device(BACKEND, "refilling a host buffer", "the device was lost: a copy may still read it"));
        }
        // The deliberate break (`sabotage_refill_early`) does not wait for the last
        // copy: it may still read the bytes, so they are written as a device's memory
        // is, never through a slice (the device then lands torn bytes, which is the break).
        if self.engine.refill_early.load(Ordering::Relaxed) && self.len > 0 {
            let mut staged = vec![0u8; self.len];
            fill(&mut staged)?;
            for (i, v) in staged.into_iter().enumerate() {
                // SAFETY: `ptr` is `len` bytes owned by `self` (`i < len`), not lent
                // (refused above); a volatile write of a byte a copy may be reading.
                unsafe { std::ptr::write_volatile(self.ptr.add(i), v) };
            }
            return Ok(());
        }
        let last = self.last_copy.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(ev) = last {
            self.engine.bind()?;
            if let Err(e) = ev.event().synchronize() {
                // The copy's fate is unknown: keep waiting for it on the next refill.
                *self.last_copy.get_mut().unwrap_or_else(|e| e.into_inner()) = Some(ev);
                return Err(driver("waiting for a host buffer's last copy before refilling it", e));
            }
        }
        if self.len == 0 {
            return fill(&mut []);
        }
        // `ptr` is `len` bytes owned by `self` (cuMemHostAlloc memory, a mapping
        // of its own registered in `registered`, or the pageable box given up in
        // `pageable`); `&mut self` excludes every host
        // view of it; every copy records itself in `last_copy` (waited above).
        // SAFETY: exclusive (just said), and the last copy that read it has completed.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) };
        fill(bytes)
    }

    /// The bytes, for host code: empty for lent bytes, which only the device reads.
    pub(crate) fn own_bytes(&self) -> &[u8] {
        if self.len == 0 || matches!(self.owner, Owner::Lent(_)) {
            return &[];
        }
        // SAFETY: `ptr` is valid for `len` bytes for as long as `self` lives and is
        // written only through `&mut self` (not lent: checked above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The first byte, for copies only.
    pub(crate) fn ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the bytes are a mapping of their own registered after their
    /// fill ([`registered`](Self::registered)).
    #[cfg(test)]
    pub(crate) fn is_registered_mapping(&self) -> bool {
        matches!(self.owner, Owner::Mapped { registered: true, .. })
    }

    /// Whether the bytes are page-locked (allocated so, registered after their
    /// fill, or lent by a registration).
    pub(crate) fn is_pinned(&self) -> bool {
        !matches!(self.owner, Owner::Pageable)
    }

    /// The engine whose copy stream reads them.
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Enqueue on the copy stream the checking mode's poison and spin, then a
    /// copy of the first `bytes` to `dst`.
    ///
    /// # Safety
    ///
    /// `dst .. dst + dst_len` is device memory of the engine's context that stays
    /// allocated until the copy stream has passed this copy; `bytes ≤ dst_len`.
    pub(crate) unsafe fn enqueue_copy(&self, dst: sys::CUdeviceptr, dst_len: usize, bytes: usize) -> Result<()> {
        if bytes > self.len || bytes > dst_len {
            return Err(Error::Protocol(format!("copy of {bytes} bytes from a {}-byte buffer into a {dst_len}-byte slot", self.len)));
        }
        // SAFETY: this function's contract, passed on.
        unsafe { self.engine.enqueue_checking(dst, dst_len)? };
        // In pieces (`Engine::copy_chunk`): a copy the model enqueues on the same
        // copy engine waits for one piece, not the whole block.
        let piece = match self.engine.copy_chunk.load(std::sync::atomic::Ordering::Relaxed) {
            0 => bytes.max(1),
            n => n,
        };
        let mut at = 0;
        while at < bytes {
            let n = piece.min(bytes - at);
            // The buffer outlives the copy (its `Drop` drains the copy stream);
            // `dst .. dst + dst_len` with `dst_len ≥ bytes` by this function's contract.
            // SAFETY: `ptr` holds `len ≥ bytes ≥ at + n` bytes while `self` lives.
            unsafe { sys::cuMemcpyHtoDAsync_v2(dst + at as u64, self.ptr.add(at) as *const _, n, self.engine.copy.cu_stream()) }
                .result()
                .map_err(|e| driver(format!("copying {n} of {bytes} bytes to the device"), e))?;
            at += n;
        }
        Ok(())
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        if let Owner::Mapped { map_len, registered: false } = self.owner {
            // Never registered, so never read by a copy: unmapped at once.
            // SAFETY: the mapping made in `registered`, unmapped once, here.
            if unsafe { libc::munmap(self.ptr.cast(), map_len) } != 0 {
                tracing::warn!("munmap of a {map_len}-byte host buffer: {}", std::io::Error::last_os_error());
            }
            return;
        }
        // A copy from this buffer may still be queued: wait for the copy stream
        // (teardown only, never on the streaming path). If the drain fails, a copy
        // may still read the bytes: leak them rather than free them under it.
        if let Err(e) = self.engine.copy.synchronize() {
            tracing::warn!("a {}-byte host buffer is leaked: the copy stream could not be drained ({e})", self.len);
            if let Owner::Lent(keep) = &self.owner {
                std::mem::forget(keep.clone());
            }
            return;
        }
        match self.owner {
            // SAFETY: `ptr` and `len` are the `Box<[u8]>` given up in `pageable`,
            // rebuilt once, here; no copy can read it any more (drained above).
            Owner::Pageable => drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) }),
            // The lender's, released with the handle.
            Owner::Lent(_) => {}
            Owner::Pinned => {
                // SAFETY: `ptr` came from cuMemHostAlloc and no copy can read it any more.
                if let Err(e) = unsafe { result::free_host(self.ptr as *mut _) } {
                    tracing::warn!("cuMemFreeHost: {e}");
                }
                self.engine.pinned_bytes.fetch_sub(self.len as u64, Ordering::Relaxed);
            }
            // Registered (an unregistered one went above).
            Owner::Mapped { map_len, .. } => {
                // A registration the driver would not end may still be read by the
                // device: the mapping is leaked rather than unmapped under it.
                // SAFETY: registered over `ptr` in `registered`; no copy can read it any more.
                if let Err(e) = unsafe { sys::cuMemHostUnregister(self.ptr.cast()) }.result() {
                    tracing::warn!("a {map_len}-byte registered host buffer is leaked: cuMemHostUnregister: {e}");
                    return;
                }
                self.engine.pinned_bytes.fetch_sub(self.len as u64, Ordering::Relaxed);
                // SAFETY: the mapping made in `registered`, unmapped once, here, no
                // longer registered (just above) and read by no copy (drained above).
                if unsafe { libc::munmap(self.ptr.cast(), map_len) } != 0 {
                    tracing::warn!("munmap of a {map_len}-byte host buffer: {}", std::io::Error::last_os_error());
                }
            }
        }
    }
}

impl CudaSlot {
    /// A slot of `bytes` from the device's stream-ordered pool, allocated on the
    /// engine's copy stream. `purpose` names the block for errors.
    pub(crate) fn alloc(engine: &Arc<Engine>, bytes: usize, purpose: &str) -> Result<Self> {
        engine.bind()?;
        let ptr = if bytes == 0 {
            0
        } else {
            // SAFETY: allocation on a live stream; the slot frees it (stream-ordered) on drop.
            match unsafe { result::malloc_async(engine.copy.cu_stream(), bytes) } {
                Ok(p) => p,
                Err(e) if is_oom(&e) => {
                    let free = engine.ctx.mem_get_info().map(|(f, _)| f as u64).unwrap_or(0);
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
        let live = engine.live_bytes.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        engine.peak_bytes.fetch_max(live, Ordering::Relaxed);
        let mut slot = CudaSlot { ptr, len: bytes, last_copy: None, engine: engine.clone() };
        if bytes > 0 {
            // The free runs on the compute stream: order it after this allocation on
            // the copy stream even if no copy into the slot ever comes (`Drop`
            // waits for `last_copy`). A failure here frees the slot through `Drop`.
            let ev = engine.copy.record_event(None).map_err(|e| driver("recording a slot's allocation", e))?;
            slot.last_copy = Some(CudaEvent::new(ev));
        }
        Ok(slot)
    }
}

/// Device memory for one block, from the stream-ordered pool. Dropping it frees
/// the memory on the compute stream after the last copy into it.
pub struct CudaSlot {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) last_copy: Option<CudaEvent>,
    pub(crate) engine: Arc<Engine>,
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

impl CudaSlot {
    /// The device address of tensor `name` of `layout` in this slot, checked to lie
    /// inside it (a kernel given it may read every byte of the tensor).
    pub(crate) fn tensor_ptr(&self, layout: &offload_core::BlockLayout, name: &str) -> Result<u64> {
        let t = layout.get(name).ok_or_else(|| Error::BadTensor { tensor: name.to_owned(), fault: "not in this block".into() })?;
        Ok(self.ptr + t.range_in(self.len)?.start as u64)
    }
}

impl Drop for CudaSlot {
    fn drop(&mut self) {
        let sh = &self.engine;
        sh.live_bytes.fetch_sub(self.len as u64, Ordering::Relaxed);
        if sh.is_lost() {
            // A failed copy may still write it, and no event covers that copy.
            tracing::warn!("a {}-byte slot is leaked: its backend lost track of a copy", self.len);
            return;
        }
        let r = sh.ctx.bind_to_thread().and_then(|()| {
            if let Some(ev) = &self.last_copy {
                sh.compute.wait(ev.event())?;
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
    }
}
