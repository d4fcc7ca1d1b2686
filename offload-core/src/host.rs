//! Host memory, a capability of its own: what a host buffer can be, apart from
//! the ring's device primitives ([`OffloadBackend`](crate::backend::OffloadBackend)).
//!
//! A backend hands out one [`HostMemory`] ([`OffloadBackend::host`](crate::backend::OffloadBackend::host)).
//! It makes every kind of host buffer through one call, [`HostMemory::alloc`]
//! with a [`HostKind`], and says up front which kinds it makes
//! ([`HostMemory::capabilities`]). What can be done with a buffer once it exists
//! (read its block's bytes, refill it, ask whether it is page-locked) belongs to
//! the buffer ([`HostBuffer`]). So a backend that wraps another (candle and tch on
//! CUDA, the fault injector) hands out the inner backend's host memory as it is,
//! or interposes on the one allocation call, and forwards nothing else.

use crate::error::{Error, Result};
use crate::source::HostRegion;
use std::sync::Arc;

/// What `fill` is: a closure that writes every byte of a new buffer once.
pub type Fill<'a> = &'a mut dyn FnMut(&mut [u8]) -> Result<()>;

/// A kind of host buffer a caller can ask [`HostMemory::alloc`] for.
#[derive(Clone, Copy)]
pub enum HostKind<'a> {
    /// The backend's usual buffer: page-locked where it can be, written once by
    /// `fill`, then immutable. A backend that codes every block (CUDA's
    /// `enable_coding`, the simulator's `coded`) hands it out coded.
    Pinned,
    /// Ordinary pageable memory: the fallback when page-locking fails or the pin
    /// budget is spent (copies from it are slower and may not overlap).
    Pageable,
    /// The block coded for the device ([`crate::codec::code_for_device`]): every
    /// copy from it moves the coded bytes and decodes them on the device, so the
    /// slot receives the block's exact bytes and [`HostBuffer::block_bytes`]
    /// still gives them. `fill` writes the block's plain bytes.
    Coded,
    /// Like [`Coded`](Self::Coded), but the block comes coded already (made ahead
    /// of time, e.g. read from a [`CodedFile`](crate::coded_file::CodedFile)): `fill` writes
    /// `coded_len` coded bytes, which must decode to the requested length. Their
    /// structure ([`crate::codec::device_segments`]) is checked before the buffer
    /// is handed out, a named error otherwise; their content is the caller's to
    /// check ([`HostStore::build_from_coded_file`](crate::store::HostStore::build_from_coded_file) does).
    Precoded {
        /// Length of the coded bytes `fill` writes.
        coded_len: usize,
    },
    /// The requested bytes of `region` from `offset`, served without a copy (the
    /// mapped host tier): the backend registers the region with its device
    /// (read-only, page-locked) on first use and keeps it registered while any
    /// buffer from it lives; copies read it by DMA, and
    /// [`HostBuffer::block_bytes`] reads it through [`HostRegion::read_at`].
    /// `fill` is not called.
    Mapped {
        /// The mapped file.
        region: &'a Arc<dyn HostRegion>,
        /// Where the block starts in it.
        offset: usize,
    },
}

impl HostKind<'_> {
    /// A short name for errors (`"pinned"`, `"coded"`, …).
    pub fn name(&self) -> &'static str {
        match self {
            HostKind::Pinned => "pinned",
            HostKind::Pageable => "pageable",
            HostKind::Coded => "coded",
            HostKind::Precoded { .. } => "precoded",
            HostKind::Mapped { .. } => "mapped",
        }
    }
}

/// Which kinds of host buffer a [`HostMemory`] makes, and what its buffers can do.
///
/// A kind marked here may still be refused at run time with
/// [`Error::Unsupported`] where what it needs is missing on this machine (CUDA's
/// decoder without libnvrtc, a region that is not a mapping); a kind not marked
/// is always refused that way. Callers fall back as the store does: a refused
/// coded block is held as it is, a refused mapped block is copied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostCapabilities {
    /// [`HostKind::Pinned`] buffers are page-locked (false where "pinned" is
    /// ordinary memory, as on a CPU device).
    pub pinned: bool,
    /// [`HostKind::Pageable`].
    pub pageable: bool,
    /// [`HostKind::Coded`] and [`HostKind::Precoded`]: the device decodes.
    pub coded: bool,
    /// [`HostKind::Mapped`]: the device reads a registered mapping.
    pub mapped: bool,
    /// [`HostBuffer::refill`] on plain buffers (the disk tier's bounce buffers).
    pub refill: bool,
}

/// A frozen host buffer: one block's bytes (or what stands for them), immutable
/// except through [`refill`](Self::refill).
///
/// The buffer keeps whatever it needs alive on its own (its backend's context,
/// a registration), so a copy from it stays sound however long the caller holds it.
pub trait HostBuffer: Send + Sync + 'static {
    /// Whether the buffer is page-locked.
    fn is_pinned(&self) -> bool;

    /// Host bytes the buffer holds in place of its block's bytes, where they
    /// differ (a block held coded for the device: its coded bytes); `None` (the
    /// default) where it holds the block's bytes as they are. The store counts
    /// its host and page-locked bytes with it.
    fn held_bytes(&self) -> Option<usize> {
        None
    }

    /// The block's bytes (for resident reference runs and checks, never on the
    /// streaming path). An error where they can no longer be read: a buffer
    /// served from a mapped file that was cut short or replaced since, a coded
    /// buffer that no longer decodes.
    fn block_bytes(&self) -> Result<&[u8]>;

    /// Write the buffer again: wait on the calling thread until every copy from
    /// it has finished, then let `fill` write its bytes (the disk tier's bounce
    /// buffers, refilled on reader threads, never on the thread that computes).
    /// The `&mut` borrow means no view of the old bytes is alive; the wait means
    /// no copy still reads them. [`Error::Unsupported`] by default, and for
    /// buffers that are not plain bytes (coded, or served from a mapped region).
    fn refill(&mut self, fill: Fill<'_>) -> Result<()> {
        let _ = fill;
        Err(Error::unsupported("host memory", "refilling this host buffer (the disk tier's bounce buffers)"))
    }
}

/// A backend's host memory: it makes host buffers.
///
/// Cheap to clone (an `Arc` inside). One required call makes every kind, so a
/// wrapper that counts or fails allocations interposes once.
pub trait HostMemory: Clone + Send + Sync + 'static {
    /// The buffers it makes.
    type Buffer: HostBuffer;

    /// Which kinds it makes.
    fn capabilities(&self) -> HostCapabilities;

    /// A host buffer of `kind` holding a block of `bytes`; `fill` writes it once
    /// (see [`HostKind`] for what it writes), `purpose` names the block for
    /// errors. [`Error::Unsupported`], returned before `fill` is called, for a
    /// kind it does not make.
    fn alloc(&self, kind: HostKind<'_>, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<Self::Buffer>;

    /// [`alloc`](Self::alloc) of a [`HostKind::Pinned`] buffer.
    fn alloc_pinned(&self, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<Self::Buffer> {
        self.alloc(HostKind::Pinned, bytes, purpose, fill)
    }

    /// Device bytes the decoder holds, beside the ring's slots, to copy coded
    /// blocks of at most `largest_coded` bytes through (offload-cuda's staging
    /// buffers: a number of them, each [`staging_buffer_bytes`](crate::codec::staging_buffer_bytes)).
    /// 0 (the default) where coded blocks decode straight into the slot, or are
    /// not made. The ring counts them against a plan's device budget.
    fn decoder_staging_bytes(&self, largest_coded: usize) -> u64 {
        let _ = largest_coded;
        0
    }
}

/// `len` zeroed bytes of ordinary memory, or an [`Error::HostAlloc`] naming
/// `purpose` where the allocator has none (a size past what it can give is an
/// error, not `vec!`'s capacity-overflow panic or an abort).
pub fn zeroed(backend: &str, len: usize, purpose: &str) -> crate::error::Result<Vec<u8>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|e| Error::HostAlloc {
        backend: backend.into(),
        requested: len as u64,
        purpose: purpose.into(),
        reason: format!("ordinary memory: {e}"),
    })?;
    v.resize(len, 0);
    Ok(v)
}

/// A thread's share of a host copy or zeroing: one thread per 16 MiB, so work
/// under 32 MiB stays on the calling thread (a thread's start, tens of µs,
/// costs more than it saves on less).
const PARALLEL_MIN_BYTES: usize = 16 << 20;

/// Threads for a host copy of `len` bytes: one per 16 MiB, at most the
/// machine's cores and at most 8 (a few threads reach the memory's bandwidth;
/// one reads pageable memory at a fraction of it).
fn copy_threads(len: usize) -> usize {
    if len < 2 * PARALLEL_MIN_BYTES {
        return 1;
    }
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    (len / PARALLEL_MIN_BYTES).clamp(1, cores.min(8))
}

/// Threads a test makes the system refuse (`on_threads`' fallback under test).
#[cfg(test)]
static REFUSE_THREADS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A thread builder; under test, where [`REFUSE_THREADS`] is set, one whose
/// every spawn the system refuses (a stack no machine can map).
fn thread_builder() -> std::thread::Builder {
    #[cfg(test)]
    if REFUSE_THREADS.load(std::sync::atomic::Ordering::Relaxed) {
        return std::thread::Builder::new().stack_size(1 << 62);
    }
    std::thread::Builder::new()
}

/// `work` run on each of `parts`, each on a thread of its own where the
/// system gives one, else on the calling thread: a refused thread (a
/// process's thread limit) is no error and loses no part.
fn on_threads<P: Send>(parts: impl Iterator<Item = P>, work: impl Fn(P) + Sync) {
    let slots: Vec<std::sync::Mutex<Option<P>>> = parts.map(|p| std::sync::Mutex::new(Some(p))).collect();
    let work = &work;
    std::thread::scope(|scope| {
        for slot in &slots {
            // Captures two shared references: a `Copy` closure, so the calling
            // thread can run it where the spawn was refused.
            let run = move || {
                if let Some(p) = slot.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    work(p)
                }
            };
            if thread_builder().spawn_scoped(scope, run).is_err() {
                run();
            }
        }
    });
}

/// `src` copied into `dst` (the same length, else a panic, as
/// [`slice::copy_from_slice`]), split over several threads where it is 32 MiB
/// or more. offload-py's DLPack read copies each tensor into the host store
/// through this.
pub fn copy_parallel(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_parallel: destination and source lengths differ");
    let threads = copy_threads(dst.len());
    if threads == 1 {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = dst.len().div_ceil(threads);
    on_threads(dst.chunks_mut(chunk).zip(src.chunks(chunk)), |(d, s): (&mut [u8], &[u8])| d.copy_from_slice(s));
}

/// Every element of `dst` set to `value` (every one: a backend relies on it),
/// split over several threads where it is 32 MiB or more: a backend zeroes
/// memory it allocated uninitialised this way (`MaybeUninit<u8>`), before it
/// is read as bytes.
pub fn fill_parallel<T: Copy + Send + Sync>(dst: &mut [T], value: T) {
    let bytes = std::mem::size_of_val(dst);
    let threads = copy_threads(bytes);
    if threads == 1 {
        dst.fill(value);
        return;
    }
    let chunk = dst.len().div_ceil(threads);
    on_threads(dst.chunks_mut(chunk), |d: &mut [T]| d.fill(value));
}

/// The [`Error::Unsupported`] a [`HostMemory`] returns for a kind it does not make.
pub fn unsupported_kind(backend: &str, kind: HostKind<'_>, purpose: &str) -> Error {
    let what = match kind {
        HostKind::Pinned => "page-locked host memory",
        HostKind::Pageable => "pageable host memory",
        HostKind::Coded | HostKind::Precoded { .. } => "host buffers coded for the device",
        HostKind::Mapped { .. } => "host buffers in a mapped region",
    };
    Error::unsupported(backend, format!("{what} (for {purpose})"))
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use super::*;
    use crate::sim::{SimBackend, SimConfig};
    use crate::{backend::OffloadBackend, fault::FaultInjector, fault::FaultKind};

    /// `len` bytes, none zero, their pattern (period 251) shifting across any
    /// power-of-two chunk: a chunk copied to the wrong place or left out shows.
    fn varied(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8 | 1).collect()
    }

    /// A copy and a zeroing split over threads cover every byte, the last
    /// uneven chunk too: 40 MiB and 13 varied bytes (two threads or more
    /// wherever the machine has two cores), and one small copy.
    #[test]
    fn parallel_copy_and_zero_cover_every_byte() {
        let len = (40 << 20) + 13;
        let src = varied(len);
        let mut dst = vec![0u8; len];
        copy_parallel(&mut dst, &src);
        assert!(dst == src, "a byte not copied");
        let mut small = [0u8; 5];
        copy_parallel(&mut small, &src[len - 5..]);
        assert_eq!(small, src[len - 5..]);
        let mut raw = src;
        fill_parallel(&mut raw, 0u8);
        assert!(raw.iter().all(|&b| b == 0), "a byte not zeroed");
    }

    /// Where the system refuses every thread, a split copy and zeroing still
    /// cover every byte, each part run on the calling thread.
    #[test]
    fn parallel_copy_and_zero_run_on_the_caller_where_threads_are_refused() {
        let len = 40 << 20;
        let src = varied(len);
        REFUSE_THREADS.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(thread_builder().spawn(|| ()).is_err(), "a refused thread was given");
        let mut dst = vec![0u8; len];
        copy_parallel(&mut dst, &src);
        let mut zeroed = src.clone();
        fill_parallel(&mut zeroed, 0u8);
        REFUSE_THREADS.store(false, std::sync::atomic::Ordering::Relaxed);
        assert!(dst == src, "a part not copied");
        assert!(zeroed.iter().all(|&b| b == 0), "a part not zeroed");
    }

    /// What a host memory says it makes is what it makes: a kind it does not is
    /// refused before `fill` runs; the buffers say what they are.
    #[test]
    fn capabilities_match_what_is_made() {
        let plain = SimBackend::new(SimConfig { decodes: false, page_locked: false, ..SimConfig::fast() });
        let caps = plain.host().capabilities();
        assert!(!caps.coded && !caps.pinned && caps.refill, "{caps:?}");
        let mut called = false;
        let e = plain.host().alloc(HostKind::Coded, 64, "blocks.0", &mut |_| {
            called = true;
            Ok(())
        });
        assert!(matches!(e, Err(Error::Unsupported { .. })) && !called, "refused before fill");
        let b = plain.host().alloc_pinned(64, "blocks.0", &mut |d| {
            d.fill(7);
            Ok(())
        });
        let b = b.expect("a plain buffer");
        assert!(!b.is_pinned() && b.held_bytes().is_none() && b.block_bytes().expect("bytes") == [7u8; 64]);
        let coding = SimBackend::new(SimConfig::fast());
        assert!(coding.host().capabilities().coded && coding.host().capabilities().pinned);
        let c = coding.host().alloc(HostKind::Coded, 64 << 10, "blocks.1", &mut |d| {
            d.iter_mut().enumerate().for_each(|(i, x)| *x = (i % 3) as u8);
            Ok(())
        });
        let c = c.expect("a coded buffer");
        assert!(c.is_pinned() && c.held_bytes().is_some() && c.block_bytes().expect("bytes")[..3] == [0, 1, 2]);
    }

    /// A host buffer larger than the allocator can give is an error naming it,
    /// not `vec!`'s capacity-overflow panic (candle's CPU device allocates here).
    #[test]
    fn a_host_buffer_past_what_memory_holds_is_an_error_not_a_panic() {
        for page_locked in [false, true] {
            let sim = SimBackend::new(SimConfig { page_locked, ..SimConfig::fast() });
            for kind in [HostKind::Pinned, HostKind::Pageable] {
                let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    sim.host().alloc(kind, usize::MAX, "blocks.9", &mut |_| Ok(())).map(drop)
                }));
                match got {
                    Ok(Err(Error::HostAlloc { purpose, .. })) => assert_eq!(purpose, "blocks.9"),
                    other => panic!("page_locked {page_locked}, {}: {:?}", kind.name(), other.map(|r| r.map_err(|e| e.to_string()))),
                }
            }
            assert_eq!(sim.stats().pinned_bytes, 0, "nothing counted for the refused buffer");
        }
    }

    /// The fault injector interposes on the one allocation call of the inner
    /// host memory, for every kind but the pageable fallback, and hands the
    /// inner buffers out as they are.
    #[test]
    fn the_fault_injector_fails_any_kind_of_host_allocation() {
        let fi = FaultInjector::new(SimBackend::new(SimConfig::fast()));
        for kind in [HostKind::Pinned, HostKind::Coded] {
            fi.arm(FaultKind::HostAlloc, 0);
            let e = fi.host().alloc(kind, 16, "blocks.0", &mut |_| Ok(()));
            assert!(matches!(e, Err(Error::Injected(_))), "{} not failed", kind.name());
        }
        fi.arm(FaultKind::HostAlloc, 0);
        assert!(fi.host().alloc(HostKind::Pageable, 16, "blocks.0", &mut |_| Ok(())).is_ok(), "the fallback is not counted");
        assert!(matches!(fi.host().alloc_pinned(16, "blocks.0", &mut |_| Ok(())), Err(Error::Injected(_))));
        fi.disarm();
        assert_eq!(fi.host().capabilities(), fi.inner().host().capabilities());
    }
}
