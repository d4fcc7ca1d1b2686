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

use crate::engine::Engine;
use crate::error::driver;
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
pub(crate) fn page_size() -> usize {
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
    fn held(&self) -> Result<()> {
        self.region.held()
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
    engine: Arc<Engine>,
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

    /// The engine whose device it is registered with.
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Bytes registered from [`base`](Self::base) (whole pages).
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // A copy from the region may still be queued: drain the copy stream. If
        // that fails, leak the registration and the mapping rather than unmap
        // pages a copy may still read.
        if let Err(e) = self.engine.copy.synchronize() {
            tracing::warn!("{} stays registered and mapped: the copy stream could not be drained ({e})", self.region.origin());
            std::mem::forget(self.region.clone());
            return;
        }
        if self.engine.ctx.bind_to_thread().is_err() {
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
        self.engine.pinned_bytes.fetch_sub(self.len as u64, std::sync::atomic::Ordering::Relaxed);
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

impl Registrations {
    /// Whether no registration is alive.
    #[cfg(test)]
    pub(crate) fn none_alive(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).iter().all(|w| w.strong_count() == 0)
    }

    /// Refuse the first `n` of [`REGISTRATIONS`] as a driver would (tests only).
    pub(crate) fn refuse(&self, n: u8) {
        self.1.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The registration of `region` with `engine`'s device, made now if none is alive.
    pub(crate) fn register(&self, engine: &Arc<Engine>, region: &Arc<dyn HostRegion>, purpose: &str) -> Result<Arc<Registration>> {
        // Only a mapping made here is registered: its address and length are ours.
        let Some(mapped) = region.as_any().downcast_ref::<MappedFile>() else {
            return Err(Error::unsupported(
                "cuda",
                format!("a region not mapped by offload_cuda::map_checkpoint ({}, for {purpose})", region.origin()),
            ));
        };
        let (base, len) = (mapped.ptr, mapped.mapped_len);
        let s = engine;
        let mut regs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        regs.retain(|w| w.strong_count() > 0);
        if let Some(r) = regs.iter().filter_map(Weak::upgrade).find(|r| Arc::ptr_eq(&r.region, region) && Arc::ptr_eq(&r.engine, engine)) {
            return Ok(r);
        }
        s.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))?;
        let refuse = self.1.load(std::sync::atomic::Ordering::Relaxed) as usize;
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
        let r = Arc::new(Registration { region: region.clone(), base: at, len, private, engine: s.clone() });
        regs.push(Arc::downgrade(&r));
        Ok(r)
    }
}
