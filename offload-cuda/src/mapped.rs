//! The mapped host tier on CUDA: a safetensors checkpoint mapped read-only
//! (`MAP_SHARED`, `PROT_READ`) and registered with the device once
//! (`cuMemHostRegister`, read-only), so the host store serves every block from
//! the file's page cache ([`HostStore::build_mapped`](offload_core::HostStore::build_mapped)):
//! no second copy of the model in host memory, a start in the time the
//! registration takes, and one copy shared by every process reading the file.
//!
//! Host code never reads through the mapping: [`HostRegion::read_at`] reads the
//! file with positioned reads, so a file truncated under the mapping is an error
//! there, not a `SIGBUS`. Only the device's DMA reads the mapped pages, which the
//! registration keeps locked in memory.

use crate::device::{CudaBackend, Shared};
use crate::error::driver;
use crate::memory::PinnedHost;
use cudarc::driver::sys;
use offload_core::{Error, FileRegion, HostRegion, Result, SafetensorsFile};
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

/// A file mapped read-only into this process, for the device to read by DMA.
pub struct MappedFile {
    region: FileRegion,
    ptr: *mut u8,
    /// The mapping's length: the file's, rounded up to whole pages.
    mapped_len: usize,
    /// How the device registered it, once it has ([`HostRegion::registration`]).
    registered_as: Mutex<Option<&'static str>>,
}

// The mapping is read-only and host code never dereferences it (reads go through
// `FileRegion::read_at`); the pointer is only handed to the driver.
// SAFETY: nothing in this value is touched by two threads without synchronisation.
unsafe impl Send for MappedFile {}
// SAFETY: as above: `&MappedFile` only reads plain fields.
unsafe impl Sync for MappedFile {}

/// The system's page size.
fn page_size() -> usize {
    // SAFETY: sysconf with a valid name has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

impl MappedFile {
    /// Map `region`'s file read-only and shared (its page cache is the store).
    pub fn map(region: FileRegion) -> Result<Self> {
        use std::os::fd::AsRawFd;
        region.check()?;
        let len = region.len();
        if len == 0 {
            return Err(Error::BadCheckpoint { path: region.path().into(), tensor: String::new(), fault: "an empty file".into() });
        }
        let mapped_len = len.next_multiple_of(page_size());
        // SAFETY: a new read-only shared mapping of an open file descriptor; the
        // kernel picks the address; the result is checked against MAP_FAILED.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), mapped_len, libc::PROT_READ, libc::MAP_SHARED, region.file().as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::Io { path: region.path().into(), source: std::io::Error::last_os_error() });
        }
        Ok(MappedFile { region, ptr: p.cast(), mapped_len, registered_as: Mutex::new(None) })
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // Every registration holds an `Arc` of this region and unregisters first.
        // SAFETY: `ptr`, `mapped_len` are the mapping made in `map`; nothing uses it now.
        if unsafe { libc::munmap(self.ptr.cast(), self.mapped_len) } != 0 {
            tracing::warn!("munmap of {}: {}", self.region.origin(), std::io::Error::last_os_error());
        }
    }
}

impl HostRegion for MappedFile {
    fn len(&self) -> usize {
        self.region.len()
    }
    fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.region.read_at(offset, dst)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn origin(&self) -> String {
        self.region.origin()
    }
    fn check(&self) -> Result<()> {
        self.region.check()
    }
    fn file_identity(&self) -> Option<offload_core::FileIdentity> {
        self.region.file_identity()
    }
    fn registered_len(&self) -> usize {
        self.mapped_len
    }
    fn registration(&self) -> Option<String> {
        self.registered_as.lock().unwrap_or_else(|e| e.into_inner()).map(str::to_owned)
    }
}

/// Open the safetensors checkpoint at `path` (header checked) with the whole
/// file mapped read-only, for [`HostStore::build_mapped`](offload_core::HostStore::build_mapped):
/// on a CUDA backend (cuda, candle's and tch's CUDA paths) its blocks are then
/// served from the file's own pages.
pub fn map_checkpoint(path: impl AsRef<Path>) -> Result<SafetensorsFile> {
    let mut file = SafetensorsFile::open(path)?;
    let mapped = MappedFile::map(file.file_region()?)?;
    file.set_region(Arc::new(mapped))?;
    Ok(file)
}

/// A region registered with the device: page-locked, read-only, for DMA. Freed
/// (unregistered) when the last buffer served from it is dropped.
pub(crate) struct Registration {
    region: Arc<dyn HostRegion>,
    base: *mut u8,
    /// Bytes registered (page-locked), counted in the backend's pinned bytes.
    len: usize,
    /// Whether `base` is a private mapping of the file made for this
    /// registration (the second fallback), unmapped after it is unregistered.
    private: bool,
    shared: Arc<Shared>,
}

// SAFETY: `base` is only handed to the driver; the region is `Send + Sync`.
unsafe impl Send for Registration {}
// SAFETY: as above.
unsafe impl Sync for Registration {}

impl Registration {
    pub(crate) fn region(&self) -> &Arc<dyn HostRegion> {
        &self.region
    }

    /// The registered mapping's first byte (for DMA only).
    pub(crate) fn base(&self) -> *mut u8 {
        self.base
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // A copy from the region may still be queued: drain the copy stream. If
        // that fails, leak the registration and the mapping rather than unmap
        // pages a copy may still read.
        if let Err(e) = self.shared.copy.synchronize() {
            tracing::warn!("{} stays registered and mapped: the copy stream could not be drained ({e})", self.region.origin());
            std::mem::forget(self.region.clone());
            return;
        }
        if self.shared.ctx.bind_to_thread().is_err() {
            std::mem::forget(self.region.clone());
            return;
        }
        // SAFETY: `base` was registered in `register` and no copy reads it any more.
        if let Err(e) = unsafe { sys::cuMemHostUnregister(self.base.cast()) }.result() {
            // The driver may still hold the range: leave it mapped and counted
            // rather than let a later mapping reuse registered addresses.
            tracing::warn!("cuMemHostUnregister of {}: {e}; it stays mapped and registered", self.region.origin());
            std::mem::forget(self.region.clone());
            return;
        }
        // SAFETY: a private mapping of `len` bytes made in `register` for this
        // registration alone, unregistered just above; nothing reads it any more.
        if self.private && unsafe { libc::munmap(self.base.cast(), self.len) } != 0 {
            tracing::warn!("munmap of the private mapping of {}: {}", self.region.origin(), std::io::Error::last_os_error());
        }
        self.shared.pinned_bytes.fetch_sub(self.len as u64, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Registrations alive, by region address (found again for each block).
#[derive(Default)]
pub(crate) struct Registrations(Mutex<Vec<Weak<Registration>>>, std::sync::atomic::AtomicU8);

/// The ways a mapped checkpoint is registered, in the order tried: some drivers
/// refuse the read-only flag on a read-only shared mapping; registering it
/// without the flag, or a private copy-on-write mapping of the file, may then
/// work. (The device only reads either way.) Where all three are refused, the
/// store copies the blocks (`HostStore::build_mapped`'s fallback).
pub const REGISTRATIONS: [&str; 3] = ["read-only", "writable", "private mapping"];

impl CudaBackend {
    /// Tests only: refuse the first `n` of [`REGISTRATIONS`] as a driver would
    /// (`n = 3`: every one, so the store copies), for mappings registered from now on.
    #[doc(hidden)]
    pub fn refuse_registrations(&self, n: u8) {
        self.shared().regions.1.store(n, std::sync::atomic::Ordering::Relaxed);
    }
}

impl CudaBackend {
    /// The registration of `region`, made now if none is alive.
    pub(crate) fn register(&self, region: &Arc<dyn HostRegion>, purpose: &str) -> Result<Arc<Registration>> {
        // Only a mapping made here is registered: its address and length are ours.
        let Some(mapped) = region.as_any().downcast_ref::<MappedFile>() else {
            return Err(Error::unsupported(
                "cuda",
                format!("a region not mapped by offload_cuda::map_checkpoint ({}, for {purpose})", region.origin()),
            ));
        };
        let (base, len) = (mapped.ptr, mapped.mapped_len);
        let s = self.shared();
        let mut regs = s.regions.0.lock().unwrap_or_else(|e| e.into_inner());
        regs.retain(|w| w.strong_count() > 0);
        if let Some(r) = regs.iter().filter_map(Weak::upgrade).find(|r| Arc::ptr_eq(&r.region, region)) {
            return Ok(r);
        }
        s.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        let refuse = s.regions.1.load(std::sync::atomic::Ordering::Relaxed) as usize;
        let mut refusals = Vec::new();
        let mut made = None;
        for (i, how) in REGISTRATIONS.iter().enumerate() {
            let (at, private) = if i < 2 {
                (base, false)
            } else {
                use std::os::fd::AsRawFd;
                // Writable, so a driver that pins for writing can: each page it
                // pins becomes a private copy (host memory beyond the page
                // cache, the price of this fallback). Host code never writes it.
                // SAFETY: a new private mapping of the open file, the kernel picks
                // the address; checked against MAP_FAILED.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        len,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE,
                        mapped.region.file().as_raw_fd(),
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    refusals.push(format!("{how}: mmap: {}", std::io::Error::last_os_error()));
                    continue;
                }
                (p.cast::<u8>(), true)
            };
            let flags = if i == 0 {
                sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_PORTABLE
            } else {
                sys::CU_MEMHOSTREGISTER_PORTABLE
            };
            let r = if i < refuse {
                Err(format!("refused on purpose (CudaBackend::refuse_registrations({refuse}))"))
            } else {
                // `at .. at + len` is the `MappedFile`'s own mapping, or a private one made
                // just above (whole pages either way), which lives as long as the
                // registration: it holds the region and unregisters before either is unmapped.
                // SAFETY: the range is mapped in this process for the registration's life (just said).
                unsafe { sys::cuMemHostRegister_v2(at as *mut _, len, flags) }.result().map_err(|e| e.to_string())
            };
            match r {
                Ok(()) => {
                    made = Some((at, private, *how));
                    break;
                }
                // Registered already (another backend in this process, or one
                // being dropped): not a driver's refusal of this way, so no fallback.
                Err(e) if e.contains("ALREADY_REGISTERED") => {
                    // SAFETY: the private mapping made above, registered by nothing.
                    if private && unsafe { libc::munmap(at.cast(), len) } != 0 {
                        tracing::warn!("munmap of a private mapping of {}: {}", region.origin(), std::io::Error::last_os_error());
                    }
                    return Err(Error::HostAlloc {
                        backend: "cuda".into(),
                        requested: len as u64,
                        purpose: purpose.to_owned(),
                        reason: format!("cuMemHostRegister of {} ({how}): {e}", region.origin()),
                    });
                }
                Err(e) => {
                    refusals.push(format!("{how}: {e}"));
                    // SAFETY: the private mapping made above, registered by nothing.
                    if private && unsafe { libc::munmap(at.cast(), len) } != 0 {
                        tracing::warn!("munmap of a private mapping of {}: {}", region.origin(), std::io::Error::last_os_error());
                    }
                }
            }
        }
        let Some((at, private, how)) = made else {
            return Err(Error::HostAlloc {
                backend: "cuda".into(),
                requested: len as u64,
                purpose: purpose.to_owned(),
                reason: format!("cuMemHostRegister of {} refused every way ({})", region.origin(), refusals.join("; ")),
            });
        };
        if !refusals.is_empty() {
            tracing::warn!("{} registered as a {how} after refusals: {}", region.origin(), refusals.join("; "));
        }
        *mapped.registered_as.lock().unwrap_or_else(|e| e.into_inner()) = Some(how);
        // Page-locked from here: counted as the backend's pinned bytes, as the
        // store charges it to its pin budget (`HostRegion::registered_len`).
        s.pinned_bytes.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        let r = Arc::new(Registration { region: region.clone(), base: at, len, private, shared: s.clone() });
        regs.push(Arc::downgrade(&r));
        Ok(r)
    }

    /// [`OffloadBackend::host_in_region`](offload_core::OffloadBackend::host_in_region) on CUDA.
    pub(crate) fn mapped_host(&self, region: &Arc<dyn HostRegion>, offset: usize, bytes: usize, purpose: &str) -> Result<PinnedHost> {
        if self.is_coding() {
            // Every block is held coded (a copy by nature): mixing mapped raw blocks
            // with coded ones would let two streams write one slot.
            return Err(Error::unsupported("cuda", format!("blocks served in place while coding is on (for {purpose})")));
        }
        if offset.checked_add(bytes).is_none_or(|end| end > region.len()) {
            return Err(Error::Protocol(format!(
                "{purpose}: {bytes} bytes at {offset} asked of {} ({} bytes)",
                region.origin(),
                region.len()
            )));
        }
        region.check()?;
        let reg = self.register(region, purpose)?;
        Ok(PinnedHost::in_region(self.shared().clone(), reg, offset, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::{RegionSource, TensorSource};

    /// A safetensors file named `name` of U8 tensors, in the order given, packed.
    fn write(name: &str, tensors: &[(String, Vec<u8>)]) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("offload-cuda-mapped-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("m.safetensors");
        let (mut header, mut data) = (Vec::new(), Vec::new());
        for (t, bytes) in tensors {
            let at = data.len();
            data.extend_from_slice(bytes);
            header.push(format!(r#""{t}":{{"dtype":"U8","shape":[{}],"data_offsets":[{at},{}]}}"#, bytes.len(), data.len()));
        }
        let mut h = format!("{{{}}}", header.join(",")).into_bytes();
        h.resize(h.len().next_multiple_of(8), b' ');
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&data);
        std::fs::write(&p, out).unwrap();
        p
    }

    fn checkpoint(name: &str) -> std::path::PathBuf {
        write(name, &[("w".into(), (0..8192u32).map(|i| (i * 7 + 1) as u8).collect())])
    }

    /// No GPU needed: the mapping is made, reads go through the file, and a
    /// truncated file is an error from `check` and `read_at`, not a SIGBUS.
    #[test]
    fn a_mapped_checkpoint_reads_through_the_file_and_notices_truncation() {
        let p = checkpoint("trunc");
        let f = map_checkpoint(&p).unwrap();
        let r = f.region();
        assert!(r.as_any().downcast_ref::<MappedFile>().is_some(), "mapped");
        let mut w = vec![0u8; 8192];
        f.read_into(0, &mut w).unwrap();
        let mut via = vec![0u8; 8192];
        r.read_at(f.tensor_offset(0), &mut via).unwrap();
        assert_eq!(w, via);
        assert_eq!(w[5], 36);
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(64).unwrap();
        let e = r.check().unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        assert!(r.read_at(f.tensor_offset(0), &mut via).is_err());
    }

    /// A checkpoint of six blocks of random bytes (never zeros) in 256-multiple
    /// tensors, block by block, with one odd-sized tensor first in block 3 (so
    /// that block must be copied).
    fn model(name: &str) -> std::path::PathBuf {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut tensors = Vec::new();
        for b in 0..6 {
            for (t, n) in [("a", if b == 3 { 1_000_001 } else { 1 << 20 }), ("b", 3 << 16)] {
                let bytes = (0..n)
                    .map(|_| {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        ((x >> 33) as u8) | 1
                    })
                    .collect();
                tensors.push((format!("blocks.{b}.{t}"), bytes));
            }
        }
        write(name, &tensors)
    }

    /// On a GPU: a store built from the mapped checkpoint serves five of six
    /// blocks in place (registered, no copy), copies the misaligned one, and a
    /// ring over it puts exactly the copying store's bytes in every slot (read
    /// back after each block's copy event, two steps at depth 1). Without a
    /// device it prints SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
    #[test]
    fn a_ring_over_a_mapped_store_streams_the_files_bytes() {
        use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, OffloadBackend, PinOptions, Plan, Ring};
        let Some(b) = crate::codec::test_backend() else { return };
        let p = model("ring");
        let file = map_checkpoint(&p).unwrap();
        let inv = NameDiscovery.discover("model", file.specs()).unwrap();
        let copied = HostStore::build(&b, &inv, &file).unwrap();
        let pinned_before = b.counters().pinned_bytes;
        let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, PinOptions::default()).unwrap());
        let tier = store.tier().clone();
        assert_eq!((tier.mapped, tier.copied), (5, 1), "{tier:?}");
        assert!(tier.copy_reason.as_deref().unwrap_or("").contains("blocks.3"), "{tier:?}");
        assert!(store.blocks()[0].buffer().unwrap().is_mapped() && !store.blocks()[3].buffer().unwrap().is_mapped());
        // Page-locked: the whole file as registered, and the copied block's own
        // buffer; the store counts the same.
        let registered = std::fs::metadata(&p).unwrap().len().next_multiple_of(page_size() as u64);
        assert_eq!(b.counters().pinned_bytes - pinned_before, registered + store.blocks()[3].bytes() as u64);
        assert_eq!(store.pinned_bytes(), registered + store.blocks()[3].bytes() as u64);
        assert_eq!(tier.registration.as_deref(), Some("read-only"));
        let want: Vec<Vec<u8>> = copied.blocks().iter().map(|blk| b.host_bytes(blk.buffer().unwrap()).unwrap().to_vec()).collect();
        for (m, w) in store.blocks().iter().zip(&want) {
            for t in &m.layout.tensors {
                let c = copied.blocks().iter().find_map(|c| c.layout.get(&t.spec.name)).unwrap();
                let got = &b.host_bytes(m.buffer().unwrap()).unwrap()[t.offset..t.offset + t.nbytes];
                assert!(got == &w[c.offset..c.offset + c.nbytes], "{}: host bytes differ", t.spec.name);
            }
        }
        let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&inv)).unwrap();
        let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
        for step in 0..2 {
            for (i, blk) in store.blocks().iter().enumerate() {
                let g = ring.block_at(i).unwrap();
                let mut got = vec![0u8; blk.bytes()];
                // SAFETY: the slot holds `blk.bytes()` bytes while the guard lives, as `got` does;
                // the compute stream waits for the block's copy and is synchronised before `got` is read.
                unsafe {
                    let s = b.compute_stream();
                    sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), g.slot().device_ptr(), got.len(), s.cu_stream()).result().unwrap();
                    s.synchronize().unwrap();
                }
                for t in &blk.layout.tensors {
                    let c = copied.blocks().iter().find_map(|c| c.layout.get(&t.spec.name)).unwrap();
                    let w = &want[copied.position(&blk.id).unwrap()];
                    assert!(
                        got[t.offset..t.offset + t.nbytes] == w[c.offset..c.offset + c.nbytes],
                        "step {step}, {}: the slot differs",
                        t.spec.name
                    );
                }
                g.finish().unwrap();
            }
            ring.end_step().unwrap();
        }
        ring.close().unwrap();
        drop(store);
        // The registration went with the last buffer served from it, and its bytes with it.
        assert!(b.shared().regions.0.lock().unwrap().iter().all(|w| w.strong_count() == 0));
        assert_eq!(b.counters().pinned_bytes, pinned_before);
    }

    /// Every block's slot after its copy event, over one step of a ring at depth
    /// 1 over `store`, against `copied`'s bytes of the same tensors.
    fn slots_hold(
        b: &CudaBackend,
        inv: &offload_core::ComponentInventory,
        store: &Arc<offload_core::HostStore<CudaBackend>>,
        copied: &offload_core::HostStore<CudaBackend>,
    ) {
        use offload_core::{resolve, OffloadBackend, Plan, Ring};
        let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(inv)).unwrap();
        let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
        for (i, blk) in store.blocks().iter().enumerate() {
            let g = ring.block_at(i).unwrap();
            let mut got = vec![0u8; blk.bytes()];
            // SAFETY: the slot holds `blk.bytes()` bytes while the guard lives, as `got` does;
            // the compute stream waits for the block's copy and is synchronised before `got` is read.
            unsafe {
                let s = b.compute_stream();
                sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), g.slot().device_ptr(), got.len(), s.cu_stream()).result().unwrap();
                s.synchronize().unwrap();
            }
            let c = &copied.blocks()[copied.position(&blk.id).unwrap()];
            let want = b.host_bytes(c.buffer().unwrap()).unwrap();
            for t in &blk.layout.tensors {
                let ct = c.layout.get(&t.spec.name).unwrap();
                assert!(got[t.offset..t.offset + t.nbytes] == want[ct.offset..ct.offset + ct.nbytes], "{}: the slot differs", t.spec.name);
            }
            g.finish().unwrap();
        }
        ring.end_step().unwrap();
        ring.close().unwrap();
    }

    /// On a GPU: serving a block in place page-locks the whole file. A pin
    /// budget of one block on a file of six serves none in place, and what the
    /// device has page-locked stays within the budget; the store's count agrees.
    #[test]
    fn a_pin_budget_of_one_block_keeps_the_registration_within_it() {
        use offload_core::{BlockDiscovery, HostStore, NameDiscovery, PinFallback, PinOptions};
        let Some(b) = crate::codec::test_backend() else { return };
        let p = model("budget");
        let file = map_checkpoint(&p).unwrap();
        let inv = NameDiscovery.discover("model", file.specs()).unwrap();
        let block = HostStore::build(&b, &inv, &file).unwrap().largest_block_bytes() as u64;
        let before = b.counters().pinned_bytes;
        let pin = PinOptions { budget_bytes: Some(block), fallback: PinFallback::Pageable, ..PinOptions::default() };
        let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, pin).unwrap());
        let pinned = b.counters().pinned_bytes - before;
        assert!(pinned <= block, "{pinned} bytes page-locked under a budget of {block}");
        assert_eq!(store.pinned_bytes(), pinned);
        assert_eq!(store.tier().mapped, 0, "{:?}", store.tier());
        assert!(store.tier().copy_reason.as_deref().unwrap_or("").contains("page-locks the whole of"), "{:?}", store.tier());
        let copied = HostStore::build(&b, &inv, &file).unwrap();
        slots_hold(&b, &inv, &store, &copied);
    }

    /// On a GPU: one byte inside block 2 written in place between two steps
    /// (same file, same length) is an error naming the file at the second
    /// step's end, and every later block is refused.
    #[test]
    fn a_mapped_file_written_in_place_between_steps_is_an_error() {
        use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, PinOptions, Plan, Ring};
        use std::os::unix::fs::FileExt;
        let Some(b) = crate::codec::test_backend() else { return };
        let p = model("written");
        let file = map_checkpoint(&p).unwrap();
        let inv = NameDiscovery.discover("model", file.specs()).unwrap();
        let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, PinOptions::default()).unwrap());
        assert_eq!(store.tier().mapped, 5);
        let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&inv)).unwrap();
        let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
        let n = store.blocks().len();
        for i in 0..n {
            ring.block_at(i).unwrap().finish().unwrap();
        }
        ring.end_step().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let t = file.specs().iter().position(|t| t.name == "blocks.2.a").unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
        let mut byte = [0u8];
        f.read_exact_at(&mut byte, file.data_offset(t) + 4242).unwrap();
        f.write_all_at(&[byte[0] ^ 0xa5], file.data_offset(t) + 4242).unwrap();
        for i in 0..n {
            ring.block_at(i).unwrap().finish().unwrap();
        }
        let e = ring.end_step().unwrap_err().to_string();
        assert!(e.contains("m.safetensors") && e.contains("since it was opened"), "{e}");
        let later = ring.block_at(0).err().expect("refused after the change").to_string();
        assert!(later.contains("m.safetensors"), "{later}");
        ring.close().unwrap();
    }

    /// On a GPU: each registration a driver may refuse, refused on purpose in
    /// turn. The store serves the file by the next way that works and says which
    /// (`HostTier::registration`), with the same bytes in every slot; with all
    /// three refused it copies every block and says why.
    #[test]
    fn each_registration_refused_falls_back_to_the_next() {
        use offload_core::{BlockDiscovery, HostStore, NameDiscovery, PinOptions};
        let Some(b) = crate::codec::test_backend() else { return };
        let p = model("fallback");
        let copied = {
            let file = map_checkpoint(&p).unwrap();
            let inv = NameDiscovery.discover("model", file.specs()).unwrap();
            HostStore::build(&b, &inv, &file).unwrap()
        };
        for refuse in 0..=3u8 {
            b.refuse_registrations(refuse);
            let file = map_checkpoint(&p).unwrap();
            let inv = NameDiscovery.discover("model", file.specs()).unwrap();
            let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, PinOptions::default()).unwrap());
            let tier = store.tier().clone();
            println!("refused {refuse}: {tier:?}");
            if refuse < 3 {
                let how = tier.registration.clone().unwrap_or_default();
                let at = REGISTRATIONS.iter().position(|r| *r == how).unwrap_or(usize::MAX);
                assert!(at >= refuse as usize && at < 3, "refused {refuse}: registered as {how:?}");
                assert_eq!(tier.mapped, 5, "{tier:?}");
            } else {
                assert_eq!((tier.mapped, tier.registration.as_deref()), (0, None), "{tier:?}");
                assert!(tier.copy_reason.as_deref().unwrap_or("").contains("refused every way"), "{tier:?}");
            }
            slots_hold(&b, &inv, &store, &copied);
        }
        b.refuse_registrations(0);
    }
}
