//! Coded streaming: with coding on
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
use crate::engine::CudaEvent;
use crate::engine::Engine;
use crate::error::{dev, driver};
use crate::memory::HostBytes;
use cudarc::driver::{result, sys, CudaFunction, CudaStream};
use offload_core::codec::{device_segments, Code, DeviceSegment};
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
    /// Code fp8 e4m3 bytes with fp8's own code where it is shorter than bf16's
    /// (`offload_core::codec::DeviceCodes`; ≈ 0.83 of fp8 weights against 0.94).
    /// On by default (decoded bitwise on the H200: `gpu_tests/coded.rs`). Off,
    /// blocks are coded with bf16's code only and a block holding fp8's is refused.
    pub fp8_code: bool,
}

impl Default for CodingOptions {
    fn default() -> Self {
        CodingOptions {
            threads: std::thread::available_parallelism().map_or(4, |n| n.get()),
            segment_bytes: 32 << 20,
            high_priority_decode: false,
            staging_buffers: STAGING_BUFFERS,
            fp8_code: true,
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
    /// The engine it was made on: its copy stream fills the staging buffers
    /// (drained before they are freed), its context holds the kernels and flag.
    engine: Arc<Engine>,
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
    last_read: Option<CudaEvent>,
}

// `flag` is page-locked host memory owned by this value, accessed by the host only
// as an `AtomicU32` (so threads calling `poll` do not race), otherwise written only
// by kernels; everything else is `Send + Sync` or behind a mutex.
// SAFETY: no unsynchronised access to `flag` from any thread (just said).
unsafe impl Send for Coding {}
// SAFETY: as above.
unsafe impl Sync for Coding {}

impl Coding {
    pub(crate) fn new(shared: &Arc<Engine>, options: CodingOptions) -> Result<Self> {
        if options.staging_buffers == 0 {
            return Err(Error::Protocol("coding options: staging_buffers is 0; the decode engine needs at least one".into()));
        }
        shared.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        let decode = match options.high_priority_decode {
            false => shared.ctx.new_stream(),
            true => result::stream::get_priority_range().and_then(|(_, highest)| shared.ctx.new_stream_with_priority(highest)),
        }
        .map_err(|e| driver("creating the decode stream", e))?;
        let ptx = crate::codec::ptx().map_err(|e| dev("compiling the exponent decoder", e))?;
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
            engine: shared.clone(),
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
        if let Err(e) = self.engine.copy.synchronize().and_then(|()| self.decode.synchronize()) {
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

/// Refuses a block holding a segment in a code the decoder is not set to read:
/// bf16's always, fp8 e4m3's with [`CodingOptions::fp8_code`]. Decoded under
/// the wrong code a segment would come out as wrong weights.
fn codes_read(segments: &[DeviceSegment], options: &CodingOptions, purpose: &str) -> Result<()> {
    let read = |c: Code| c == Code::Bf16 || (c == Code::Fp8E4M3 && options.fp8_code);
    let other = segments.iter().enumerate().find_map(|(i, sg)| sg.coded.as_ref().filter(|(_, l)| !read(l.code)).map(|(_, l)| (i, l.code)));
    match other {
        Some((i, code)) => Err(Error::BadTensor {
            tensor: purpose.into(),
            fault: format!("segment {i} is coded as {code:?}, which this device's decoder is not set to read (CodingOptions::fp8_code)"),
        }),
        None => Ok(()),
    }
}

impl CodedHost {
    /// Parse `coded` (a block from `code_for_device` of `raw_len` bytes).
    pub(crate) fn new(coding: &Coding, coded: &[u8], raw_len: usize, purpose: &str) -> Result<Self> {
        let (len, segments) = device_segments(coded, purpose)?;
        if len != raw_len {
            return Err(Error::BadTensor { tensor: purpose.into(), fault: format!("{len} bytes coded for a {raw_len}-byte block") });
        }
        codes_read(&segments, &coding.options, purpose)?;
        Ok(CodedHost { raw_len, segments, tag: coding.tag(purpose), purpose: purpose.to_owned(), decoded: Mutex::new(Vec::new()) })
    }
}

impl Coding {
    /// How many staging buffers coded copies take in turn now.
    pub(crate) fn staging_buffers(&self) -> usize {
        self.staging.lock().unwrap_or_else(|e| e.into_inner()).bufs.len()
    }

    /// Set how many staging buffers coded copies take in turn from now on
    /// ([`CodingOptions::staging_buffers`]), with coding on. Buffers beyond `n`
    /// are freed in the decode stream's order, after the decodes that read them;
    /// new ones are allocated at their first use. Errors if coding is off or `n`
    /// is 0. [`enable_coding`](Self::enable_coding) still compares against the
    /// options the engine was made with.
    pub(crate) fn set_staging_buffers(&self, n: usize) -> Result<()> {
        let engine = &self.engine;
        let c = self;
        if n == 0 {
            return Err(Error::Protocol("set_staging_buffers: at least one staging buffer is needed".into()));
        }
        engine.bind()?;
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

    /// The coded path of `copy_to_device`: the coded bytes of `src` into a staging
    /// buffer on the copy stream, decoded into `dst` on the decode stream. The
    /// returned event is the decode's. A buffer of another engine, or whose
    /// coding does not fit its bytes, is refused before anything is enqueued.
    ///
    /// # Safety
    ///
    /// `dst .. dst + dst_len` is device memory of this engine's context that
    /// stays allocated until the returned event has completed; `ch` was parsed
    /// from `src`'s own bytes (`CodedHost::new`, as `CudaHostBuffer` makes them).
    pub(crate) unsafe fn copy(
        &self,
        src: &HostBytes,
        ch: &CodedHost,
        dst: sys::CUdeviceptr,
        dst_len: usize,
        bytes: usize,
        after: Option<&CudaEvent>,
    ) -> Result<CudaEvent> {
        let s = &self.engine;
        if !Arc::ptr_eq(src.engine(), s) {
            return Err(Error::Protocol(format!("{}: a coded buffer of another backend instance", ch.purpose)));
        }
        let c = self;
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
            s.copy.wait(ev.event()).map_err(|e| driver("copy stream waiting for a slot's last use", e))?;
        }
        let len = src.len();
        // Once anything is enqueued, an error must not leave it running unseen:
        // drain both streams; a staging buffer goes back to the ring only if both drained.
        let drain = || {
            let drained = s.copy.synchronize().is_ok() & c.decode.synchronize().is_ok();
            if !drained {
                s.mark_lost("the copy or decode stream could not be drained after a failed coded copy");
            }
            drained
        };
        let drained = |e: Error| {
            drain();
            e
        };
        // The checking mode's poison and spin (no bytes copied by it), only when
        // `checking` said so above (the mode read once: the wait above matches it).
        if checking {
            // SAFETY: `dst .. dst + dst_len` stays allocated until the copy stream
            // passes this (this function's contract).
            unsafe { s.enqueue_checking(dst, dst_len) }.map_err(drained)?;
        }
        let mut ring = c.staging.lock().unwrap_or_else(|e| e.into_inner());
        let i = ring.next;
        ring.next = (i + 1) % ring.bufs.len();
        let (staging, staging_len) = match ring.bufs[i].take() {
            Some(b) if b.len >= len.max(4) => {
                if let Some(ev) = &b.last_read {
                    if let Err(e) = s.copy.wait(ev.event()) {
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
                let want = offload_core::codec::staging_buffer_bytes(len as u64) as usize;
                // SAFETY: a stream-ordered allocation on the copy stream, held by the ring
                // until `Drop` (or a larger block) frees it once nothing uses it.
                let p = unsafe { result::malloc_async(s.copy.cu_stream(), want) }
                    .map_err(|e| drained(driver(format!("a {want}-byte staging buffer for {}", ch.purpose), e)))?;
                let held: usize = ring.bufs.iter().flatten().map(|b| b.len).sum::<usize>() + want;
                c.staging_peak.fetch_max(held as u64, Ordering::Relaxed);
                (p, want)
            }
        };
        let issued = (|| -> Result<CudaEvent> {
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
                c.decode.wait(ev.event()).map_err(|e| driver("decode stream waiting for a slot's last use", e))?;
            }
            // `dst` holds `raw_len` bytes, 4-aligned, alive until the decode stream
            // passes these kernels (this function's contract, checked above).
            // SAFETY: `dst` as just said; `staging` holds `ch`'s coded bytes (the decode
            // stream waits for their copy), 4-aligned, reused only after the event below.
            unsafe { c.enqueue_decode(ch, dst, staging) }?;
            if checking {
                // SAFETY: as for the decode, which these kernels follow on its stream.
                unsafe { c.enqueue_verify(ch, dst, staging) }?;
            }
            Ok(CudaEvent::new(c.decode.record_event(None).map_err(|e| driver("recording a decode event", e))?))
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

    /// The decode of `ch` on the decode stream: its raw strings copied device to
    /// device, its coded ones decoded in launches of up to `SEGS` strings each
    /// (one launch per 32 MiB string would leave most of the GPU idle). Each
    /// writes its own range of `dst`, so their order does not matter.
    ///
    /// # Safety
    ///
    /// `dst` is 4-aligned device memory of this context holding `ch.raw_len`
    /// bytes; `staging` is 4-aligned and holds `ch`'s coded bytes, the decode
    /// stream ordered after their copy; both stay allocated until the decode
    /// stream passes what this enqueues.
    unsafe fn enqueue_decode(&self, ch: &CodedHost, dst: sys::CUdeviceptr, staging: sys::CUdeviceptr) -> Result<()> {
        for sg in ch.segments.iter().filter(|sg| sg.coded.is_none()) {
            let (out, enc) = (dst + sg.out_at as u64, staging + sg.enc_at as u64);
            // A raw string: its bytes follow the 24-byte header. `device_segments`
            // checked the string holds its header and `out_len` bytes inside the
            // block; segments tile [0, raw_len) and `dst` holds raw_len bytes (this function's contract).
            // SAFETY: both ranges are in bounds (just said), ordered as the kernels are.
            unsafe { sys::cuMemcpyDtoDAsync_v2(out, enc + 24, sg.out_len, self.decode.cu_stream()) }
                .result()
                .map_err(|e| driver(format!("copying a raw segment of {}", ch.purpose), e))?;
        }
        for (batch, blocks) in launches(&ch.segments) {
            let cfg = cudarc::driver::LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK_THREADS, 1, 1), shared_mem_bytes: 0 };
            use cudarc::driver::PushKernelArg;
            // What the kernel touches: for each string of `batch`, `device_segments`
            // checked its layout (offsets monotone in its stream, `n` sign-mantissa
            // bytes for bf16 or ⌈n / 2⌉ for fp8, the launch's code its strings' own
            // (`launches`), `chunks` = ⌈n / 1024⌉) and its stored table (2^12 u16s) inside
            // the block, the string at a multiple of 256 of the 4-aligned staging
            // buffer (this function's contract) and padded to whole words (so the kernel's word
            // reads stay inside it, its offset table and stream 4-aligned); its
            // output (2n bytes for bf16, n for fp8, at a multiple of 4 of `dst`, 4-aligned: this function's contract)
            // lies in `dst`; a launch block decodes the string whose
            // [first_block, next first_block) holds it (`launches`, tested on the
            // CPU against the kernel's lookup); the flag is mapped host memory of
            // this context. Every buffer outlives the kernel: staging is freed only
            // after this stream drains (or after it on this stream), `dst` by the
            // caller's contract; the next copy into this staging buffer waits for
            // the event recorded after these kernels.
            // SAFETY: every access in bounds and aligned, every buffer alive (above).
            unsafe {
                self.decode.launch_builder(&self.kernel).arg(&staging).arg(&dst).arg(&batch).arg(&self.flag_dev).arg(&ch.tag).launch(cfg)
            }
            .map_err(|e| driver(format!("decoding {}", ch.purpose), e))?;
        }
        Ok(())
    }

    /// What the device decoded, checked against the hashes the strings store of
    /// the weights they were made from (the decoder itself checks none): coded
    /// bytes altered with their file's own hashes rewritten raise the flag.
    ///
    /// # Safety
    ///
    /// As for [`enqueue_decode`](Self::enqueue_decode), whose kernels these follow on the decode stream.
    unsafe fn enqueue_verify(&self, ch: &CodedHost, dst: sys::CUdeviceptr, staging: sys::CUdeviceptr) -> Result<()> {
        // What the device decoded, checked against the hashes the strings store
        // of the weights they were made from (the decoder itself checks none):
        // coded bytes altered with their file's own hashes rewritten raise the flag.
        for sg in &ch.segments {
            let cfg = cudarc::driver::LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
            let (out, stored, len) = (dst + sg.out_at as u64, staging + sg.enc_at as u64 + 16, sg.out_len as u64);
            use cudarc::driver::PushKernelArg;
            // `out .. out + len` is the segment's range of `dst` (segments tile
            // [0, raw_len), `dst` holds raw_len bytes: this function's contract); `stored` is the
            // 8 bytes at 16 of the string's 24-byte header inside the staging
            // buffer (`device_segments` checked the string holds its header),
            // read byte by byte; the flag is this context's mapped host memory;
            // every buffer outlives the kernel as the decode's do (above), and it
            // runs after the decode and raw copies on this stream.
            // SAFETY: every access in bounds, every buffer alive (above).
            unsafe {
                self.decode.launch_builder(&self.verify).arg(&out).arg(&len).arg(&stored).arg(&self.flag_dev).arg(&ch.tag).launch(cfg)
            }
            .map_err(|e| driver(format!("checking the decoded bytes of {}", ch.purpose), e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use offload_core::codec::{code_for_device, code_for_device_with, device_segments, DeviceCodes};

    #[test]
    fn a_block_in_a_code_the_kernels_do_not_read_is_refused_by_name() {
        // fp8 e4m3 bytes (exponent fields skewed as a scaled checkpoint's are), then bf16 ones.
        let mut x = 1u64;
        let mut raw: Vec<u8> = (0..1 << 17)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let r = (x >> 33) as u8;
                (r & 0x80) | [7u8, 8, 8, 9, 9, 9, 10, 10][usize::from(r & 7)] << 3 | (r >> 3) & 7
            })
            .collect();
        raw.extend((0..1u32 << 17).map(|i| if i % 2 == 1 { 0x3c } else { i.wrapping_mul(97) as u8 }));
        let (_, fp8) = device_segments(&code_for_device_with(&raw, 64 << 10, 2, DeviceCodes { fp8_e4m3: true }), "b").unwrap();
        let on = super::CodingOptions::default();
        assert!(on.fp8_code, "on by default");
        let off = super::CodingOptions { fp8_code: false, ..on };
        let e = super::codes_read(&fp8, &off, "transformer_blocks.4").unwrap_err().to_string();
        assert!(e.contains("transformer_blocks.4") && e.contains("segment 0") && e.contains("Fp8E4M3"), "{e}");
        super::codes_read(&fp8, &on, "transformer_blocks.4").unwrap();
        let (_, plain) = device_segments(&code_for_device(&raw, 64 << 10, 2), "b").unwrap();
        assert!(plain.iter().any(|s| s.coded.is_some()), "the bf16 half codes");
        super::codes_read(&plain, &off, "transformer_blocks.4").unwrap();
    }
}
