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
        Ok(MappedFile { region, ptr: p.cast(), mapped_len })
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
            tracing::warn!("cuMemHostUnregister of {}: {e}", self.region.origin());
        }
    }
}

/// Registrations alive, by region address (found again for each block).
#[derive(Default)]
pub(crate) struct Registrations(Mutex<Vec<Weak<Registration>>>);

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
        if let Some(r) = regs.iter().filter_map(Weak::upgrade).find(|r| std::ptr::eq(r.base, base)) {
            return Ok(r);
        }
        s.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // `base .. base + len` is the `MappedFile`'s own mapping (whole pages), which
        // lives as long as the registration: it holds the region, unregisters first.
        // SAFETY: the range is mapped in this process for the registration's life (just said).
        unsafe { sys::cuMemHostRegister_v2(base as *mut _, len, flags) }.result().map_err(|e| Error::HostAlloc {
            backend: "cuda".into(),
            requested: len as u64,
            purpose: purpose.to_owned(),
            reason: format!("cuMemHostRegister (read-only) of {}: {e}", region.origin()),
        })?;
        let r = Arc::new(Registration { region: region.clone(), base, shared: s.clone() });
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
        // Only the copied block took page-locked memory of its own.
        assert_eq!(b.counters().pinned_bytes - pinned_before, store.blocks()[3].bytes() as u64);
        let want: Vec<Vec<u8>> = copied.blocks().iter().map(|blk| b.host_bytes(blk.buffer().unwrap()).to_vec()).collect();
        for (m, w) in store.blocks().iter().zip(&want) {
            for t in &m.layout.tensors {
                let c = copied.blocks().iter().find_map(|c| c.layout.get(&t.spec.name)).unwrap();
                let got = &b.host_bytes(m.buffer().unwrap())[t.offset..t.offset + t.nbytes];
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
        // The registration went with the last buffer served from it.
        assert!(b.shared().regions.0.lock().unwrap().iter().all(|w| w.strong_count() == 0));
    }
}
