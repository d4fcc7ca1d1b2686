//! Coded streaming (issue 19's first ring path): with coding on
//! ([`CudaBackend::enable_coding`]), every host buffer the backend allocates
//! holds its block coded for the device ([`offload_core::codec::code_for_device`]:
//! sign and mantissa bytes as they are, exponents entropy-coded in chunks). A copy
//! into a slot then moves only the coded bytes: the copy stream brings them into
//! one of two staging buffers the decode engine holds (taken in turn, each after
//! the decode that last read it), a decode stream of its own waits for that copy
//! and for the slot's last use, and writes the block's exact bytes into the slot
//! with the exponent decoder (raw segments by a device-to-device copy); the event
//! it records last is the copy's event the ring waits for. No host
//! synchronisation; the slot holds the same bytes as an uncoded copy would have
//! put there. Copy k + 1 never waits for decode k (a buffer taken fresh from the
//! stream-ordered pool for each copy did: the pool reuses memory freed on the
//! decode stream by making the copy stream wait for it), and with the checking
//! mode off the copy into staging does not wait for the slot either: only the
//! decode, which writes the slot, does.
//!
//! Damage the kernel sees (there should be none: every block is parsed at build,
//! [`offload_core::codec::device_segments`]) is written to a flag in mapped host
//! memory, tagged with the block, and reported by `poll_error` at the next step
//! boundary, naming the block.

use crate::codec::{launches, BLOCK_THREADS};
use crate::device::{CudaBackend, Shared};
use crate::error::driver;
use cudarc::driver::{result, sys, CudaEvent, CudaFunction, CudaStream};
use offload_core::codec::{device_segments, DeviceSegment};
use offload_core::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How blocks are coded at store build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodingOptions {
    /// Host threads that encode one block's segments.
    pub threads: usize,
    /// Raw bytes per independently coded segment (a multiple of 4 is used).
    pub segment_bytes: usize,
    /// Run the decoder on a stream of the device's highest priority, so that its
    /// blocks are scheduled ahead of the compute kernels' waiting blocks (off by
    /// default; `bench/NOTES.md` has what it changed on the H200).
    pub high_priority_decode: bool,
    /// Staging buffers the copies take in turn, at least 1 (default
    /// [`STAGING_BUFFERS`]). A copy into a buffer waits for the decode that last
    /// read it, and a decode waits for its slot's last use, so the copies can run
    /// at most this many blocks ahead of the decodes: more buffers let the copy
    /// stream bank time during blocks whose compute is longer than their copy,
    /// at the cost of one largest coded block of device memory each (set
    /// `offload_plan::CostModel::staging_buffers` to the same number, so the
    /// planner counts them in the budget; it counts two when a calibration does
    /// not say). On the H200
    /// more than two moved nothing (`bench/NOTES.md`).
    pub staging_buffers: usize,
}

impl Default for CodingOptions {
    fn default() -> Self {
        CodingOptions {
            threads: std::thread::available_parallelism().map_or(4, |n| n.get()),
            segment_bytes: 32 << 20,
            high_priority_decode: false,
            staging_buffers: STAGING_BUFFERS,
        }
    }
}

/// The decode engine of a backend with coding on.
pub(crate) struct Coding {
    pub(crate) options: CodingOptions,
    pub(crate) decode: Arc<CudaStream>,
    kernel: CudaFunction,
    /// The checking mode's hash check of a decoded segment (`seg_verify`).
    verify: CudaFunction,
    /// Mapped host memory the kernel writes damage to, and its device address.
    flag: *mut u32,
    flag_dev: sys::CUdeviceptr,
    /// Block names by tag − 1 (the tag a block's decode writes on damage).
    names: Mutex<Vec<String>>,
    /// The most staging bytes held at once so far.
    pub(crate) staging_peak: AtomicU64,
    pub(crate) coded_copies: AtomicU64,
    /// The staging buffers, taken in turn (see the module).
    staging: Mutex<StagingRing>,
    /// The copy stream (drained before the staging buffers are freed).
    copy: Arc<CudaStream>,
}

/// How many staging buffers the decode engine holds by default: two let copy
/// k + 1 fill one while decode k reads the other.
pub const STAGING_BUFFERS: usize = 2;

/// Staging buffers that coded copies take in turn: copy k fills buffer
/// k mod n once the decode that last read it has run.
struct StagingRing {
    bufs: Vec<Option<Staging>>,
    next: usize,
}

/// One staging buffer: device memory from the pool, and the event of the last
/// decode that read it.
struct Staging {
    ptr: sys::CUdeviceptr,
    len: usize,
    last_read: Option<Arc<CudaEvent>>,
}

// `flag` is page-locked host memory owned by this value, accessed by the host only
// as an `AtomicU32` (so threads calling `poll` do not race), otherwise written only
// by kernels; everything else is `Send + Sync` or behind a mutex.
// SAFETY: no unsynchronised access to `flag` from any thread (just said).
unsafe impl Send for Coding {}
// SAFETY: as above.
unsafe impl Sync for Coding {}

impl Coding {
    pub(crate) fn new(shared: &Shared, options: CodingOptions) -> Result<Self> {
        if options.staging_buffers == 0 {
            return Err(Error::Protocol("coding options: staging_buffers is 0; the decode engine needs at least one".into()));
        }
        shared.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        let decode = match options.high_priority_decode {
            false => shared.ctx.new_stream(),
            true => result::stream::get_priority_range().and_then(|(_, highest)| shared.ctx.new_stream_with_priority(highest)),
        }
        .map_err(|e| driver("creating the decode stream", e))?;
        let ptx = crate::codec::ptx().map_err(|e| crate::dev("compiling the exponent decoder", e))?;
        let module = shared.ctx.load_module(ptx.clone()).map_err(|e| driver("loading the exponent decoder", e))?;
        let kernel = module.load_function("exp_decode_segs").map_err(|e| driver("exp_decode_segs", e))?;
        let verify = module.load_function("seg_verify").map_err(|e| driver("seg_verify", e))?;
        // SAFETY: a 4-byte page-locked allocation, mapped into the device's address
        // space; freed in `Drop` after the decode stream is drained.
        let flag = unsafe { result::malloc_host(4, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| driver("allocating the decode damage flag", e))? as *mut u32;
        // SAFETY: `flag` points to 4 writable bytes owned here.
        unsafe { flag.write_volatile(0) };
        let mut flag_dev: sys::CUdeviceptr = 0;
        // SAFETY: `flag` is a mapped allocation of this context; `flag_dev` outlives the call.
        if let Err(e) = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut flag_dev, flag.cast(), 0) }.result() {
            // SAFETY: nothing uses the flag yet.
            let _ = unsafe { result::free_host(flag.cast()) };
            return Err(driver("mapping the decode damage flag", e));
        }
        Ok(Coding {
            options,
            decode,
            kernel,
            verify,
            flag,
            flag_dev,
            names: Mutex::new(Vec::new()),
            staging_peak: AtomicU64::new(0),
            coded_copies: AtomicU64::new(0),
            staging: Mutex::new(StagingRing { bufs: (0..options.staging_buffers).map(|_| None).collect(), next: 0 }),
            copy: shared.copy.clone(),
        })
    }

    /// A tag for block `purpose`'s decodes (non-zero).
    pub(crate) fn tag(&self, purpose: &str) -> u32 {
        let mut n = self.names.lock().unwrap_or_else(|e| e.into_inner());
        n.push(purpose.to_owned());
        // Tags past 2^30 wrap into 1..: a name is then reported approximately, never wrongly silent.
        ((n.len() - 1) % ((1 << 30) - 1)) as u32 + 1
    }

    /// Damage a decode reported since the last call, as an error naming the block.
    pub(crate) fn poll(&self) -> Result<()> {
        // Cleared so the error is reported once.
        // SAFETY: `flag` is live, 4-aligned (page-locked) and host-accessed only atomically.
        let f = unsafe { std::sync::atomic::AtomicU32::from_ptr(self.flag) }.swap(0, Ordering::AcqRel);
        if f == 0 {
            return Ok(());
        }
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        let block = names.get((f >> 2) as usize - 1).cloned().unwrap_or_else(|| format!("block tag {}", f >> 2));
        let fault = match f & 3 {
            1 => "no code matches a chunk's next bits",
            3 => "the decoded bytes do not hash to what their string stores of the weights (checking mode)",
            _ => "a chunk's codes do not fill its bytes",
        };
        Err(Error::BadTensor { tensor: block, fault: format!("compressed bytes damaged on the device: {fault}") })
    }
}

impl Drop for Coding {
    fn drop(&mut self) {
        // Kernels may still write the flag, and copies and kernels still use the
        // staging buffers: drain both streams first, and leak them if that fails.
        if let Err(e) = self.copy.synchronize().and_then(|()| self.decode.synchronize()) {
            tracing::warn!("the copy or decode stream could not be drained ({e}); the damage flag and staging buffers are leaked");
            return;
        }
        let ring = self.staging.get_mut().unwrap_or_else(|e| e.into_inner());
        for b in ring.bufs.iter_mut().filter_map(Option::take) {
            // SAFETY: allocated from this context's pool by `coded_copy`; both streams are drained.
            if let Err(e) = unsafe { result::free_sync(b.ptr) } {
                tracing::warn!("freeing a {}-byte staging buffer: {e}", b.len);
            }
        }
        // SAFETY: allocated by `malloc_host` in `new`; no kernel can write it any more.
        if let Err(e) = unsafe { result::free_host(self.flag.cast()) } {
            tracing::warn!("cuMemFreeHost (decode damage flag): {e}");
        }
    }
}

/// What a coded host buffer knows besides its bytes.
pub(crate) struct CodedHost {
    pub(crate) raw_len: usize,
    pub(crate) segments: Vec<DeviceSegment>,
    pub(crate) tag: u32,
    pub(crate) purpose: String,
    /// The block's bytes decoded on the host, each with the hash of the coded
    /// bytes it came from; appended to, never changed, while the buffer lives.
    pub(crate) decoded: Mutex<Vec<(u64, Box<[u8]>)>>,
}

impl CodedHost {
    /// Parse `coded` (a block from `code_for_device` of `raw_len` bytes).
    pub(crate) fn new(coding: &Coding, coded: &[u8], raw_len: usize, purpose: &str) -> Result<Self> {
        let (len, segments) = device_segments(coded, purpose)?;
        if len != raw_len {
            return Err(Error::BadTensor { tensor: purpose.into(), fault: format!("{len} bytes coded for a {raw_len}-byte block") });
        }
        Ok(CodedHost { raw_len, segments, tag: coding.tag(purpose), purpose: purpose.to_owned(), decoded: Mutex::new(Vec::new()) })
    }
}

impl CudaBackend {
    /// Turn coded streaming on: every host buffer allocated from now on through
    /// [`OffloadBackend::alloc_host`](offload_core::OffloadBackend::alloc_host)
    /// holds its block coded (`options`), and every copy from such a buffer moves
    /// the coded bytes and decodes them on the device into the slot (see the
    /// module [`coded`](crate::coded)). Buffers allocated before stay as they are.
    /// The decode engine holds [`CodingOptions::staging_buffers`] staging buffers from the
    /// device's memory pool, each at least as large as the largest coded block
    /// copied so far: count them in the device budget
    /// ([`CudaCounters::staging_peak_bytes`](crate::CudaCounters::staging_peak_bytes)).
    /// Once on, it stays on; a second call with other options is an error.
    pub fn enable_coding(&self, options: CodingOptions) -> Result<()> {
        let c = self.coding_engine(options)?;
        if c.options != options {
            return Err(Error::Protocol(format!("coding is on with {:?}; asked for {options:?}", c.options)));
        }
        self.shared().code_all.store(true, Ordering::Release);
        Ok(())
    }

    /// Set how many staging buffers coded copies take in turn from now on
    /// ([`CodingOptions::staging_buffers`]), with coding on. Buffers beyond `n`
    /// are freed in the decode stream's order, after the decodes that read them;
    /// new ones are allocated at their first use. Errors if coding is off or `n`
    /// is 0. [`enable_coding`](Self::enable_coding) still compares against the
    /// options the engine was made with.
    pub fn set_staging_buffers(&self, n: usize) -> Result<()> {
        let Some(c) = self.shared().coding.get() else {
            return Err(Error::Protocol("set_staging_buffers: coding is off".into()));
        };
        if n == 0 {
            return Err(Error::Protocol("set_staging_buffers: at least one staging buffer is needed".into()));
        }
        self.shared().ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        // Under the ring's lock no coded copy is half issued: every copy into a
        // buffer has its decode enqueued on the decode stream already.
        let mut ring = c.staging.lock().unwrap_or_else(|e| e.into_inner());
        // The ring takes its new size first, so that a failed free below leaves it whole.
        let keep = n.min(ring.bufs.len());
        let extra: Vec<Staging> = ring.bufs.drain(keep..).flatten().collect();
        ring.bufs.resize_with(n, || None);
        ring.next %= n;
        let mut first_error = None;
        for b in extra {
            // Every copy into `b` and every decode reading it were enqueued before
            // this free (the lock above); the decodes run on the decode stream and
            // wait for their copies, so the free follows every use.
            // SAFETY: allocated from this context's pool by `coded_copy`; no longer in the ring.
            if let Err(e) = unsafe { result::free_async(b.ptr, c.decode.cu_stream()) } {
                tracing::warn!("a {}-byte staging buffer is leaked: {e}", b.len);
                first_error.get_or_insert(driver("freeing a staging buffer", e));
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Whether every host buffer allocated now is coded ([`enable_coding`](Self::enable_coding)).
    pub fn is_coding(&self) -> bool {
        self.shared().code_all.load(Ordering::Acquire)
    }

    /// The decode engine, made with `options` if there is none yet (a coded
    /// buffer asked for through `alloc_host_coded` makes it with the defaults).
    pub(crate) fn coding_engine(&self, options: CodingOptions) -> Result<&Coding> {
        if self.shared().coding.get().is_none() {
            let coding = Coding::new(self.shared(), options)?;
            // Another thread may have made it meanwhile: its options stand.
            let _ = self.shared().coding.set(coding);
        }
        self.shared().coding.get().ok_or_else(|| Error::Protocol("the decode engine could not be made".into()))
    }

    /// The coded path of `copy_to_device`: the coded bytes of `src` into a staging
    /// buffer on the copy stream, decoded into `dst` on the decode stream. The
    /// returned event is the decode's.
    ///
    /// # Safety
    ///
    /// As `copy_to_device`'s: `dst .. dst + dst_len` stays allocated until the
    /// returned event has completed.
    pub(crate) unsafe fn coded_copy(
        &self,
        src: &crate::PinnedHost,
        ch: &CodedHost,
        dst: sys::CUdeviceptr,
        dst_len: usize,
        bytes: usize,
        after: Option<&Arc<cudarc::driver::CudaEvent>>,
    ) -> Result<Arc<cudarc::driver::CudaEvent>> {
        let s = self.shared();
        let Some(c) = s.coding.get() else {
            return Err(Error::Protocol(format!("{}: a coded host buffer on a backend with coding off", ch.purpose)));
        };
        if bytes != ch.raw_len || bytes > dst_len {
            return Err(Error::Protocol(format!(
                "{}: a coded block of {} bytes copied as {bytes} bytes into a {dst_len}-byte slot",
                ch.purpose, ch.raw_len
            )));
        }
        if dst % 4 != 0 {
            // The decoder writes two values per 4-byte store.
            return Err(Error::Protocol(format!("{}: a coded copy into device address {dst:#x}, not 4-byte aligned", ch.purpose)));
        }
        s.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        // The checking mode poisons the slot on the copy stream: there the copy
        // stream waits for the slot's last use. Otherwise only the decode, the
        // slot's one writer, waits for it, and the coded bytes cross the link early.
        let checking = s.checking.get().is_some();
        if let (Some(ev), true) = (after, checking) {
            s.copy.wait(ev).map_err(|e| driver("copy stream waiting for a slot's last use", e))?;
        }
        let len = src.len();
        // Once anything is enqueued, an error must not leave it running unseen:
        // drain both streams; a staging buffer goes back to the ring only if both drained.
        let drain = || s.copy.synchronize().is_ok() & c.decode.synchronize().is_ok();
        let drained = |e: Error| {
            drain();
            e
        };
        // The checking mode's poison and spin (no bytes copied by it), only when
        // `checking` said so above (the mode read once: the wait above matches it).
        if checking {
            self.enqueue_copy(src, dst, dst_len, 0).map_err(drained)?;
        }
        let mut ring = c.staging.lock().unwrap_or_else(|e| e.into_inner());
        let i = ring.next;
        ring.next = (i + 1) % ring.bufs.len();
        let (staging, staging_len) = match ring.bufs[i].take() {
            Some(b) if b.len >= len.max(4) => {
                if let Some(ev) = &b.last_read {
                    if let Err(e) = s.copy.wait(ev) {
                        ring.bufs[i] = Some(b);
                        return Err(drained(driver("copy stream waiting for a staging buffer's last decode", e)));
                    }
                }
                (b.ptr, b.len)
            }
            small => {
                if let Some(b) = small {
                    // Too small: freed in the decode stream's order, after the decode that read it last.
                    // SAFETY: allocated from this context's pool below; nothing enqueued after uses it.
                    unsafe { result::free_async(b.ptr, c.decode.cu_stream()) }
                        .map_err(|e| drained(driver("freeing a staging buffer too small", e)))?;
                }
                // Rounded up to 2 MiB so that blocks of nearly one size share a buffer.
                let want = len.max(4).next_multiple_of(2 << 20);
                // SAFETY: a stream-ordered allocation on the copy stream, held by the ring
                // until `Drop` (or a larger block) frees it once nothing uses it.
                let p = unsafe { result::malloc_async(s.copy.cu_stream(), want) }
                    .map_err(|e| drained(driver(format!("a {want}-byte staging buffer for {}", ch.purpose), e)))?;
                let held: usize = ring.bufs.iter().flatten().map(|b| b.len).sum::<usize>() + want;
                c.staging_peak.fetch_max(held as u64, Ordering::Relaxed);
                (p, want)
            }
        };
        let issued = (|| -> Result<Arc<cudarc::driver::CudaEvent>> {
            if staging % 4 != 0 {
                // The kernel reads the strings' offset tables and streams as aligned words.
                return Err(Error::Protocol(format!("a staging buffer at {staging:#x}, not 4-byte aligned")));
            }
            if len > 0 {
                // `src` holds `len` bytes and outlives the copy (its drop drains the copy
                // stream); the copy stream waited for the last decode that read `staging`.
                // SAFETY: `staging` holds at least `len` bytes and nothing else uses it now.
                unsafe { sys::cuMemcpyHtoDAsync_v2(staging, src.ptr().cast(), len, s.copy.cu_stream()) }
                    .result()
                    .map_err(|e| driver(format!("copying {len} coded bytes of {}", ch.purpose), e))?;
            }
            let copied = s.copy.record_event(None).map_err(|e| driver("recording a coded copy's event", e))?;
            c.decode.wait(&copied).map_err(|e| driver("decode stream waiting for a coded copy", e))?;
            if let (Some(ev), false) = (after, checking) {
                c.decode.wait(ev).map_err(|e| driver("decode stream waiting for a slot's last use", e))?;
            }
            // Raw strings are device-to-device copies on the decode stream; the coded
            // ones go to the decoder in launches of up to SEGS strings each (one
            // launch per 32 MiB string would leave most of the GPU idle). Each
            // writes its own range of `dst`, so their order does not matter.
            for sg in ch.segments.iter().filter(|sg| sg.coded.is_none()) {
                let (out, enc) = (dst + sg.out_at as u64, staging + sg.enc_at as u64);
                // A raw string: its bytes follow the 24-byte header. `device_segments`
                // checked the string holds its header and `out_len` bytes inside the
                // block; segments tile [0, raw_len) and raw_len ≤ dst_len (checked above).
                // SAFETY: both ranges are in bounds (just said), ordered as the kernels are.
                unsafe { sys::cuMemcpyDtoDAsync_v2(out, enc + 24, sg.out_len, c.decode.cu_stream()) }
                    .result()
                    .map_err(|e| driver(format!("copying a raw segment of {}", ch.purpose), e))?;
            }
            for (batch, blocks) in launches(&ch.segments) {
                let cfg = cudarc::driver::LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 };
                use cudarc::driver::PushKernelArg;
                // What the kernel touches: for each string of `batch`, `device_segments`
                // checked its layout (offsets monotone in its stream, `n` sign-mantissa
                // bytes, `chunks` = ⌈n / 1024⌉) and its stored table (2^12 u16s) inside
                // the block, the string at a multiple of 256 of the 4-aligned staging
                // buffer (checked above) and padded to whole words (so the kernel's word
                // reads stay inside it, its offset table and stream 4-aligned); its
                // output (2n bytes at a multiple of 4 of `dst`, 4-aligned: checked above)
                // lies in `dst`; a launch block decodes the string whose
                // [first_block, next first_block) holds it (`launches`, tested on the
                // CPU against the kernel's lookup); the flag is mapped host memory of
                // this context. Every buffer outlives the kernel: staging is freed only
                // after this stream drains (or after it on this stream), `dst` by the
                // caller's contract; the next copy into this staging buffer waits for
                // the event recorded after these kernels.
                // SAFETY: every access in bounds and aligned, every buffer alive (above).
                unsafe { c.decode.launch_builder(&c.kernel).arg(&staging).arg(&dst).arg(&batch).arg(&c.flag_dev).arg(&ch.tag).launch(cfg) }
                    .map_err(|e| driver(format!("decoding {}", ch.purpose), e))?;
            }
            if checking {
                // What the device decoded, checked against the hashes the strings store
                // of the weights they were made from (the decoder itself checks none):
                // coded bytes altered with their file's own hashes rewritten raise the flag.
                for sg in &ch.segments {
                    let cfg = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
                    let (out, stored, len) = (dst + sg.out_at as u64, staging + sg.enc_at as u64 + 16, sg.out_len as u64);
                    use cudarc::driver::PushKernelArg;
                    // `out .. out + len` is the segment's range of `dst` (segments tile
                    // [0, raw_len), raw_len ≤ dst_len: checked above); `stored` is the
                    // 8 bytes at 16 of the string's 24-byte header inside the staging
                    // buffer (`device_segments` checked the string holds its header),
                    // read byte by byte; the flag is this context's mapped host memory;
                    // every buffer outlives the kernel as the decode's do (above), and it
                    // runs after the decode and raw copies on this stream.
                    // SAFETY: every access in bounds, every buffer alive (above).
                    unsafe {
                        c.decode.launch_builder(&c.verify).arg(&out).arg(&len).arg(&stored).arg(&c.flag_dev).arg(&ch.tag).launch(cfg)
                    }
                    .map_err(|e| driver(format!("checking the decoded bytes of {}", ch.purpose), e))?;
                }
            }
            Ok(Arc::new(c.decode.record_event(None).map_err(|e| driver("recording a decode event", e))?))
        })();
        // The buffer goes back to its place in the ring with the decode that read it;
        // after an error both streams are drained, so nothing uses it.
        let ev = match issued {
            Ok(ev) => {
                ring.bufs[i] = Some(Staging { ptr: staging, len: staging_len, last_read: Some(ev.clone()) });
                ev
            }
            Err(e) => {
                match drain() {
                    true => ring.bufs[i] = Some(Staging { ptr: staging, len: staging_len, last_read: None }),
                    false => tracing::warn!("a {staging_len}-byte staging buffer is leaked: the streams could not be drained"),
                }
                return Err(e);
            }
        };
        drop(ring);
        s.copies.fetch_add(1, Ordering::Relaxed);
        s.bytes_copied.fetch_add(len as u64, Ordering::Relaxed);
        c.coded_copies.fetch_add(1, Ordering::Relaxed);
        Ok(ev)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::{resolve, BlockDiscovery, DType, HostStore, MemoryTensors, NameDiscovery, OffloadBackend, Plan, Ring, TensorSpec};

    /// On a GPU: a ring over a store built with coding on puts every block's exact
    /// bytes in its slot (read back after the block's copy event, four steps at
    /// depth 2, with 2, 1, 4 and 3 staging buffers), moves fewer bytes than the blocks hold, and reports no damage.
    /// Blocks mix coded bf16 matrices, a raw (incompressible) tensor and an odd
    /// tail, in 80 KiB strings (≈ 38 a block: two decoder launches, SEGS = 32
    /// strings and the rest; one launch block a string). Without a device it prints
    /// SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
    #[test]
    fn coded_ring_streams_exact_bytes() {
        coded_ring_exact(80 << 10, 1_500_000);
    }

    /// The same with 512 KiB strings (256 chunks: two launch blocks each) in
    /// ≈ 19 MB blocks (≈ 37 strings: two launches).
    #[test]
    fn coded_ring_streams_exact_bytes_in_multi_block_strings() {
        coded_ring_exact(512 << 10, 9_500_000);
    }

    /// One step of `ring` in order, each block's slot read back after its copy
    /// event and compared with `raw`'s bytes for it.
    fn one_step_exact(b: &CudaBackend, ring: &mut Ring<CudaBackend>, raw: &[Vec<u8>], step: usize) {
        for (i, want) in raw.iter().enumerate() {
            let g = ring.block_at(i).unwrap();
            let mut got = vec![0u8; want.len()];
            // The guard ordered the compute stream after the block's copy (decode)
            // event; the stream is synchronised before `got` is read.
            // SAFETY: the slot holds `want.len()` bytes while the guard lives, as `got` does.
            unsafe {
                let s = b.compute_stream();
                sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), g.slot().device_ptr(), got.len(), s.cu_stream()).result().unwrap();
                s.synchronize().unwrap();
            }
            assert!(got == *want, "step {step}, block {i}: the slot's bytes differ from the block's");
            g.finish().unwrap();
        }
        ring.end_step().unwrap();
    }

    fn coded_ring_exact(segment_bytes: usize, values: usize) {
        let Some(b) = crate::codec::test_backend() else { return };
        b.enable_coding(CodingOptions { threads: 4, segment_bytes, ..Default::default() }).unwrap();
        let mut t = MemoryTensors::new();
        let mut x = 3u64;
        for i in 0..6u64 {
            let w = crate::codec::sample_normal_bf16(values + 1000 * i as usize, 0.02, 10 + i);
            t.push(TensorSpec::new(format!("blocks.{i}.w"), DType::BF16, [w.len() / 2]), w).unwrap();
            let noise: Vec<u8> = (0..100_003)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (x >> 33) as u8
                })
                .collect();
            t.push(TensorSpec::new(format!("blocks.{i}.noise"), DType::U8, [noise.len()]), noise).unwrap();
        }
        let inv = NameDiscovery.discover("model", offload_core::TensorSource::specs(&t)).unwrap();
        let store = Arc::new(HostStore::build(&b, &inv, &t).unwrap());
        assert!(store.blocks().iter().all(|blk| blk.buffer().unwrap().is_coded()), "every block coded");
        let raw: Vec<Vec<u8>> = store.blocks().iter().map(|blk| b.host_bytes(blk.buffer().unwrap()).unwrap().to_vec()).collect();
        let held: usize = store.blocks().iter().map(|blk| blk.buffer().unwrap().len()).sum();
        let plan = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&inv)).unwrap();
        let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
        let before = b.counters();
        // Steps with 2 (the default), 1, 4 (grown) and 3 (shrunk) staging buffers.
        assert!(b.set_staging_buffers(0).is_err(), "zero staging buffers refused");
        for (step, staging) in [2, 1, 4, 3].into_iter().enumerate() {
            b.set_staging_buffers(staging).unwrap();
            one_step_exact(&b, &mut ring, &raw, step);
        }
        ring.close().unwrap();
        b.poll_error().unwrap();
        let c = b.counters();
        let raw_total: usize = raw.iter().map(Vec::len).sum();
        assert!(c.coded_copies > before.coded_copies, "coded copies counted");
        // Each string carries its 8 KiB table: ≈ 0.79 of raw at 80 KiB, under 0.9.
        assert!(held < raw_total * 9 / 10, "coded {held} of {raw_total} bytes");
        let launches = store.blocks()[0].buffer().unwrap().coded().map_or(Vec::new(), |c| crate::codec::launches(&c.segments));
        assert!(launches.len() > 1, "{} launch(es) for block 0: one would decode it all", launches.len());
        if segment_bytes > 256 << 10 {
            let widest = launches.iter().flat_map(|(l, _)| l.s[..l.count as usize].iter().map(|g| g.chunks)).max().unwrap_or(0);
            assert!(widest > crate::codec::BLOCK_THREADS, "every string in one launch block ({widest} chunks at most)");
        }
        assert!(c.staging_peak_bytes > 0, "staging counted");
        // A plan's `coded` on a backend with coding off codes that store alone.
        let b2 = CudaBackend::new(0).unwrap();
        let pin = offload_core::PinOptions { coded: true, ..Default::default() };
        let s2 = HostStore::build_with(&b2, &inv, &t, pin).unwrap();
        assert_eq!(s2.coded_blocks(), s2.blocks().len(), "every block coded through alloc_host_coded");
        assert!(!b2.is_coding(), "other stores stay as they are");
        for (blk, want) in s2.blocks().iter().zip(&raw) {
            assert!(b2.host_bytes(blk.buffer().unwrap()).unwrap() == want.as_slice());
        }
    }

    /// On a GPU: a store read from a coded file made ahead of time
    /// (`HostStore::build_from_coded_file`, coding off on the backend) holds
    /// every block coded, and a ring over it puts each block's exact bytes in its
    /// slot; a coded file damaged in an incompressible tensor's raw string (which
    /// the device copies without a check) is refused at build by name. Without a
    /// device it prints SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
    #[test]
    fn a_coded_file_streams_exact_bytes() {
        let Some(b) = crate::codec::test_backend() else { return };
        let mut t = MemoryTensors::new();
        let mut x = 5u64;
        for i in 0..4u64 {
            let w = crate::codec::sample_normal_bf16(700_000 + 999 * i as usize, 0.02, 30 + i);
            t.push(TensorSpec::new(format!("blocks.{i}.w"), DType::BF16, [w.len() / 2]), w).unwrap();
            let noise: Vec<u8> = (0..600_001)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (x >> 33) as u8
                })
                .collect();
            t.push(TensorSpec::new(format!("blocks.{i}.noise"), DType::U8, [noise.len()]), noise).unwrap();
        }
        let inv = NameDiscovery.discover("model", offload_core::TensorSource::specs(&t)).unwrap();
        let dir = std::env::temp_dir().join(format!("offload-cuda-coded-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = offload_core::CodedFile::path_for(dir.join("model.safetensors"));
        offload_core::CodedFile::write(&path, &inv, &t, 256 << 10, 4).unwrap();
        let cf = offload_core::CodedFile::open(&path).unwrap();
        let plain = HostStore::build(&b, &inv, &t).unwrap();
        let raw: Vec<Vec<u8>> = plain.blocks().iter().map(|blk| b.host_bytes(blk.buffer().unwrap()).unwrap().to_vec()).collect();
        let store = Arc::new(HostStore::build_from_coded_file(&b, &inv, &t, offload_core::PinOptions::default(), &cf).unwrap());
        // The model's tensors all lie in blocks: no non-block buffer.
        assert!(store.non_block().is_none());
        assert_eq!(store.coded_blocks(), store.blocks().len(), "every buffer coded from the file");
        assert!(!b.is_coding(), "the backend's own coding stays off");
        let plan = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&inv)).unwrap();
        // Counted from before the ring's first copies: a block still in a slot
        // from the step before is not copied again, so two steps copy each block
        // at least once, not twice (the H200 at 3b6a55d: fewer than 8).
        let before = b.counters();
        let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
        for step in 0..2 {
            one_step_exact(&b, &mut ring, &raw, step);
        }
        ring.close().unwrap();
        b.poll_error().unwrap();
        let copies = b.counters().coded_copies - before.coded_copies;
        assert!(copies >= 4, "each block's copy decoded on the device: {copies} coded copies for 4 blocks");
        // One byte of block 2's noise (a raw string) changed in the file.
        let entry = cf.entry("blocks.2").unwrap().clone();
        let (_, segs) =
            offload_core::codec::device_segments(&std::fs::read(&path).unwrap()[entry.at as usize..(entry.at + entry.len) as usize], "b")
                .unwrap();
        let raw_seg = segs.iter().find(|s| s.coded.is_none()).expect("the noise stays raw");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[entry.at as usize + raw_seg.enc_at + 24 + 100] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let cf = offload_core::CodedFile::open(&path).unwrap();
        let e =
            HostStore::build_from_coded_file(&b, &inv, &t, offload_core::PinOptions::default(), &cf).err().expect("refused").to_string();
        assert!(e.contains("model/blocks.2") && e.contains("damaged"), "{e}");
        // Forged: two equal-length exponent codes of block 1 swapped and the
        // file's own hashes written for the forged bytes. The device's decoder
        // checks no hash; the load decodes every block and compares it.
        let swapped = std::sync::atomic::AtomicBool::new(false);
        offload_core::CodedFile::write_with(&path, &inv, &t, 256 << 10, 4, offload_core::coded_file::PIECE_BYTES, 2, &|block, coded| {
            if block == "blocks.1" {
                swapped.store(offload_core::codec::swap_equal_length_codes(coded), std::sync::atomic::Ordering::Relaxed);
            }
        })
        .unwrap();
        assert!(swapped.load(std::sync::atomic::Ordering::Relaxed));
        let cf = offload_core::CodedFile::open(&path).unwrap();
        let e =
            HostStore::build_from_coded_file(&b, &inv, &t, offload_core::PinOptions::default(), &cf).err().expect("refused").to_string();
        assert!(e.contains("model/blocks.1") && e.contains("damaged or altered"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// On a GPU: a coded block with two equal-length exponent codes swapped (its
    /// structure intact, so the backend takes it and the decoder flags nothing)
    /// decodes to wrong bytes silently without the checking mode; with it, the
    /// decoded bytes are hashed on the device against what the strings store of
    /// the weights, and the next poll names the block. Without a device it
    /// prints SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
    #[test]
    fn the_checking_mode_refuses_decoded_bytes_that_do_not_hash_to_their_weights() {
        if crate::codec::test_backend().is_none() {
            return;
        }
        let raw = crate::codec::sample_normal_bf16(300_000, 0.02, 77);
        let mut coded = offload_core::codec::code_for_device(&raw, 256 << 10, 4);
        assert!(offload_core::codec::swap_equal_length_codes(&mut coded), "two equal-length codes swapped");
        for checking in [false, true] {
            let b = crate::codec::test_backend().expect("a device (found above)");
            if checking {
                b.enable_checking(0).unwrap();
            }
            let host = b
                .alloc_host_precoded(raw.len(), coded.len(), "forged/blocks.0", &mut |d| {
                    d.copy_from_slice(&coded);
                    Ok(())
                })
                .unwrap();
            let mut slot = b.alloc_slot(raw.len(), "forged/blocks.0").unwrap();
            let ev = b.copy_to_slot(&host, &mut slot, raw.len(), None).unwrap();
            b.compute_wait(&ev).unwrap();
            b.synchronize().unwrap();
            let mut got = vec![0u8; raw.len()];
            // SAFETY: the slot holds `raw.len()` bytes, as `got` does; both streams were synchronised above.
            unsafe {
                let s = b.compute_stream();
                sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), slot.device_ptr(), got.len(), s.cu_stream()).result().unwrap();
                s.synchronize().unwrap();
            }
            assert!(got != raw, "the forged block decodes to other bytes");
            match (b.poll_error(), checking) {
                (Ok(()), false) => {}
                (Err(e), true) => {
                    let e = e.to_string();
                    assert!(e.contains("forged/blocks.0") && e.contains("checking mode"), "{e}");
                }
                (r, _) => panic!("checking mode {checking}: {r:?}"),
            }
            b.free_slot(slot, None).unwrap();
        }
    }
}
