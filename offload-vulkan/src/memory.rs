//! Host buffers (host-visible, coherent, persistently mapped) and device-local
//! slots. Each owns its Vulkan buffer and memory and lets go of them only once no
//! submission can still use them: a host buffer waits for its last copy when it
//! drops (teardown only), a slot goes to the deferred-destroy list.

use crate::context::{lock, vk_err, Inner, SlotTrack, Timeline, VulkanBackend};
use ash::vk;
use offload_core::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Host pages to import as a buffer's memory (`VK_EXT_external_memory_host`).
struct Import {
    ptr: *mut u8,
    /// A multiple of the device's import alignment, as `ptr` is.
    size: usize,
}

impl Import {
    /// # Safety
    ///
    /// `ptr` is a live allocation of `size` bytes, both multiples of the device's
    /// `minImportedHostPointerAlignment`, that stays allocated until the memory
    /// object importing it is freed.
    unsafe fn new(ptr: *mut u8, size: usize) -> Self {
        Import { ptr, size }
    }
}

/// Page-aligned host memory of this process, freed on drop (an error, or a panic
/// in the store's `fill`, before it is imported; after its memory object is
/// freed once imported).
struct Pages {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated with `layout` by `VulkanHostBuffer::imported`; whoever owns the
        // pages drops them only once no memory object imports them.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// A buffer and its memory, made together, destroyed together on failure. With
/// `import`, the memory is those host pages (of a type they allow, `flags` preferred).
fn make_buffer(
    b: &VulkanBackend,
    bytes: usize,
    usage: vk::BufferUsageFlags,
    flags: vk::MemoryPropertyFlags,
    purpose: &str,
    import: Option<&Import>,
) -> Result<(vk::Buffer, vk::DeviceMemory)> {
    let dev = &b.inner.device;
    // Whole 32-bit words (fills and the fold read words), never empty; a size
    // past the address space is an error, not a wrapped, smaller buffer.
    let size = bytes
        .max(4)
        .checked_next_multiple_of(4)
        .ok_or_else(|| Error::device("vulkan", purpose, format!("a buffer of {bytes} bytes overflows the address space")))?
        as u64;
    let families = &b.inner.families;
    let host = vk::ExternalMemoryHandleTypeFlags::HOST_ALLOCATION_EXT;
    let mut external = vk::ExternalMemoryBufferCreateInfo::default().handle_types(host);
    let mut ci = vk::BufferCreateInfo::default().size(size).usage(usage);
    ci = if families.len() > 1 {
        ci.sharing_mode(vk::SharingMode::CONCURRENT).queue_family_indices(families)
    } else {
        ci.sharing_mode(vk::SharingMode::EXCLUSIVE)
    };
    if import.is_some() {
        ci = ci.push_next(&mut external);
    }
    // SAFETY: a plain creation on the live device; destroyed below on failure or by the owner.
    let buffer = unsafe { dev.create_buffer(&ci, None) }.map_err(|e| vk_err("vkCreateBuffer", purpose, e))?;
    // SAFETY: a query of the buffer just made.
    let req = unsafe { dev.get_buffer_memory_requirements(buffer) };
    let destroy = || {
        // SAFETY: the buffer was never used.
        unsafe { dev.destroy_buffer(buffer, None) }
    };
    // Every byte the caller was promised lies in the memory bound below (copies
    // into the buffer are bounded by `bytes`, not by the memory).
    if req.size < size {
        destroy();
        return Err(Error::device("vulkan", purpose, format!("the buffer's memory is {} bytes, {size} asked for", req.size)));
    }
    // The memory types the imported pages can be, and the allocation's size.
    let (bits, alloc_size) = match (import, &b.inner.host_import) {
        (None, _) => (req.memory_type_bits, req.size),
        (Some(im), Some((ext, _))) => {
            let mut props = vk::MemoryHostPointerPropertiesEXT::default();
            // SAFETY: `im.ptr` is a live allocation of `im.size` bytes, aligned as the
            // device asks (`Import::new`'s contract); `props` outlives the call.
            let r = unsafe { (ext.fp().get_memory_host_pointer_properties_ext)(dev.handle(), host, im.ptr.cast(), &mut props) };
            if r != vk::Result::SUCCESS {
                destroy();
                return Err(vk_err("vkGetMemoryHostPointerPropertiesEXT", purpose, r));
            }
            if req.size > im.size as u64 {
                destroy();
                return Err(Error::device("vulkan", purpose, format!("the buffer needs {} bytes, {} imported", req.size, im.size)));
            }
            (req.memory_type_bits & props.memory_type_bits, im.size as u64)
        }
        (Some(_), None) => {
            destroy();
            return Err(Error::unsupported("vulkan", format!("imported host memory for {purpose}: VK_EXT_external_memory_host is off")));
        }
    };
    let Some(ty) = b.memory_type(bits, flags) else {
        destroy();
        return Err(Error::unsupported(
            "vulkan",
            format!("no memory type with {flags:?} for {purpose} (allowed types {bits:#b}, the buffer's {:#b})", req.memory_type_bits),
        ));
    };
    let mut imported = vk::ImportMemoryHostPointerInfoEXT::default().handle_type(host);
    let mut ai = vk::MemoryAllocateInfo::default().allocation_size(alloc_size).memory_type_index(ty);
    if let Some(im) = import {
        imported = imported.host_pointer(im.ptr.cast());
        ai = ai.push_next(&mut imported);
    }
    // SAFETY: as above; an imported pointer stays allocated until the memory is freed
    // (`VulkanHostBuffer`'s drop frees the memory first).
    let memory = match unsafe { dev.allocate_memory(&ai, None) } {
        Ok(m) => m,
        Err(e) => {
            destroy();
            return Err(match e {
                _ if import.is_some() => Error::HostAlloc {
                    backend: "vulkan".into(),
                    requested: alloc_size,
                    purpose: purpose.into(),
                    reason: format!("importing host pages (vkAllocateMemory): {e}"),
                },
                vk::Result::ERROR_OUT_OF_DEVICE_MEMORY | vk::Result::ERROR_OUT_OF_HOST_MEMORY => {
                    let free = offload_core::OffloadBackend::memory_info(b).map(|m| m.free).unwrap_or(0);
                    Error::OutOfDeviceMemory { backend: "vulkan".into(), requested: req.size, free, purpose: purpose.into() }
                }
                e => vk_err("vkAllocateMemory", purpose, e),
            });
        }
    };
    // SAFETY: both are fresh and unbound.
    if let Err(e) = unsafe { dev.bind_buffer_memory(buffer, memory, 0) } {
        destroy();
        // SAFETY: never used.
        unsafe { dev.free_memory(memory, None) };
        return Err(vk_err("vkBindBufferMemory", purpose, e));
    }
    Ok((buffer, memory))
}

/// Host memory for one block: a host-visible, coherent buffer mapped for its whole
/// life (or, with [`HostAllocation::Imported`](crate::HostAllocation), pages of this
/// process imported as the buffer's memory), written once by the store's `fill`,
/// then immutable; the transfer queue copies from it.
pub struct VulkanHostBuffer {
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    ptr: *mut u8,
    len: usize,
    /// The imported pages (freed after the memory object, when the fields drop), if imported.
    pages: Option<Pages>,
    /// The copy-timeline value of the last copy that reads it.
    last_copy: AtomicU64,
    inner: Arc<Inner>,
}

// The mapping is plain bytes owned by this value, written only inside `new` (before
// it is shared) and read afterwards; the handles are used under `Inner`'s lock or in `Drop`.
// SAFETY: nothing here is touched from two threads without that order (just said).
unsafe impl Send for VulkanHostBuffer {}
// SAFETY: as above: immutable after construction.
unsafe impl Sync for VulkanHostBuffer {}

impl VulkanHostBuffer {
    pub(crate) fn new(b: &VulkanBackend, len: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self> {
        if let Some((_, align)) = &b.inner.host_import {
            return Self::imported(b, len, *align, purpose, fill);
        }
        let flags = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let cached = flags | vk::MemoryPropertyFlags::HOST_CACHED;
        let flags = if b.inner.host_cached && b.memory_type(u32::MAX, cached).is_some() { cached } else { flags };
        let (buffer, memory) = make_buffer(b, len, vk::BufferUsageFlags::TRANSFER_SRC, flags, purpose, None)?;
        let dev = &b.inner.device;
        // SAFETY: host-visible memory, not mapped yet.
        let ptr = match unsafe { dev.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()) } {
            Ok(p) => p as *mut u8,
            Err(e) => {
                // SAFETY: never used.
                unsafe {
                    dev.destroy_buffer(buffer, None);
                    dev.free_memory(memory, None);
                }
                return Err(vk_err("vkMapMemory", purpose, e));
            }
        };
        let me = VulkanHostBuffer { buffer, memory, ptr, len, pages: None, last_copy: AtomicU64::new(0), inner: b.inner.clone() };
        // Counted from here: the drop gives it back (or keeps it counted, leaked).
        lock(&b.inner.state).host_bytes += len as u64;
        if len > 0 {
            // SAFETY: the mapping covers at least `len` bytes, owned exclusively here;
            // zeroed first so `fill` sees initialised memory.
            let bytes = unsafe {
                std::ptr::write_bytes(me.ptr, 0, len);
                std::slice::from_raw_parts_mut(me.ptr, len)
            };
            fill(bytes)?;
        }
        Ok(me)
    }

    /// `len` bytes in pages of this process (zeroed, then `fill`ed), aligned and
    /// sized to `align`, imported as the buffer's memory.
    fn imported(b: &VulkanBackend, len: usize, align: usize, purpose: &str, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self> {
        let host_alloc = |size: usize, reason: String| Error::HostAlloc {
            backend: "vulkan".into(),
            requested: size as u64,
            purpose: purpose.into(),
            reason,
        };
        let size = len
            .max(4)
            .checked_next_multiple_of(align)
            .ok_or_else(|| host_alloc(len, format!("{len} bytes in pages of {align} overflow the address space")))?;
        let host_alloc = |reason: String| host_alloc(size, reason);
        let layout = std::alloc::Layout::from_size_align(size, align).map_err(|e| host_alloc(format!("pages aligned to {align}: {e}")))?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(host_alloc("the allocator returned no memory".into()));
        }
        let pages = Pages { ptr, layout };
        if len > 0 {
            // SAFETY: `size` ≥ `len` zeroed bytes, owned here alone until imported.
            fill(unsafe { std::slice::from_raw_parts_mut(ptr, len) })?;
        }
        let flags = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        // `pages` is `size` bytes aligned to `align` (a multiple of the device's
        // import alignment), kept by the `VulkanHostBuffer` made below, whose drop frees
        // the memory object before the pages (or by this function, which frees them
        // on an error, when `make_buffer` has freed what it made).
        // SAFETY: `Import::new`'s contract, as just said.
        let import = unsafe { Import::new(ptr, size) };
        let (buffer, memory) = make_buffer(b, len, vk::BufferUsageFlags::TRANSFER_SRC, flags, purpose, Some(&import))?;
        lock(&b.inner.state).host_bytes += len as u64;
        Ok(VulkanHostBuffer { buffer, memory, ptr, len, pages: Some(pages), last_copy: AtomicU64::new(0), inner: b.inner.clone() })
    }

    /// Whether the bytes are this process's pages imported into Vulkan.
    pub fn is_imported(&self) -> bool {
        self.pages.is_some()
    }

    /// A small host-visible storage buffer, mapped (the fold's accumulator).
    pub(crate) fn new_storage(b: &VulkanBackend, len: usize, purpose: &str) -> Result<(vk::Buffer, vk::DeviceMemory, *mut u32)> {
        let flags = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let (buffer, memory) = make_buffer(b, len, vk::BufferUsageFlags::STORAGE_BUFFER, flags, purpose, None)?;
        let dev = &b.inner.device;
        // SAFETY: host-visible memory, not mapped yet.
        match unsafe { dev.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()) } {
            Ok(p) => Ok((buffer, memory, p as *mut u32)),
            Err(e) => {
                // SAFETY: never used.
                unsafe {
                    dev.destroy_buffer(buffer, None);
                    dev.free_memory(memory, None);
                }
                Err(vk_err("vkMapMemory", purpose, e))
            }
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the mapping covers `len` bytes for as long as `self` lives and is
        // not written after construction.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn buffer(&self) -> vk::Buffer {
        self.buffer
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    pub(crate) fn used_until(&self, copy_value: u64) {
        self.last_copy.fetch_max(copy_value, Ordering::Relaxed);
    }

    /// Write the buffer again (the disk tier's bounce buffers): wait on this thread
    /// for the copy-timeline value of its last copy, then let `fill` write every
    /// byte through the mapping (host-coherent: the next submission sees them).
    pub(crate) fn refill(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        let b = VulkanBackend { inner: self.inner.clone() };
        if self.len == 0 {
            return fill(&mut []);
        }
        // Invariant 2 checked from the protocol log: when the first byte is
        // written, the buffer's last copy must be one the host waited for
        // (`copy_waited`, which only a wait raises); one it did not is a
        // violation, however the race then turns out.
        let (last, inner) = (*self.last_copy.get_mut(), self.inner.clone());
        let fill = &mut |bytes: &mut [u8]| {
            let waited = inner.copy_waited.load(Ordering::Acquire);
            if last > waited {
                lock(&inner.state).violations.push(format!(
                    "a host buffer refilled before the host waited for its last copy (copy value {last}, waited up to \
                     {waited}; invariant 2, the disk tier)"
                ));
            }
            fill(bytes)
        };
        // The deliberate break (`sabotage_refill_early`) does not wait: a copy may
        // still read the bytes, so they are written as a device's memory is, never
        // through a slice (the device then lands torn bytes, which is the break).
        if self.inner.refill_early.load(Ordering::Relaxed) {
            let mut staged = vec![0u8; self.len];
            fill(&mut staged)?;
            for (i, v) in staged.into_iter().enumerate() {
                // SAFETY: `ptr` maps `len` bytes owned by `self` (`i < len`); a volatile
                // write of a byte a copy may be reading, as to memory a device shares.
                unsafe { std::ptr::write_volatile(self.ptr.add(i), v) };
            }
            return Ok(());
        }
        b.wait_value(Timeline::Copy, *self.last_copy.get_mut(), "refilling a host buffer")?;
        // `&mut self` excludes every host view and any `copy_to_slot` still running (it
        // borrows the buffer and raises `last_copy` before it returns); every copy that
        // read the bytes has completed (waited above).
        // SAFETY: `ptr` maps `len` bytes owned by `self`, unborrowed and unread (just said).
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) };
        fill(bytes)
    }
}

impl Drop for VulkanHostBuffer {
    fn drop(&mut self) {
        let b = VulkanBackend { inner: self.inner.clone() };
        let last = self.last_copy.load(Ordering::Relaxed);
        // A copy from this buffer may still be queued: wait for it (teardown only).
        // Once the device is lost a copy may be running that no value covers.
        let waited = match self.inner.is_lost() {
            true => Err(Error::Protocol("the device was lost".into())),
            false => b.wait_value(Timeline::Copy, last, "dropping a host buffer"),
        };
        if let Err(e) = waited {
            tracing::warn!("a {}-byte Vulkan host buffer is leaked: {e}", self.len);
            // A copy may still read imported pages: they are leaked with it.
            std::mem::forget(self.pages.take());
            return;
        }
        let dev = &self.inner.device;
        // Imported pages (`self.pages`) are freed after this body, once the memory
        // object that imported them is gone.
        // SAFETY: no submission can read the buffer any more (waited above).
        unsafe {
            if self.pages.is_none() {
                dev.unmap_memory(self.memory);
            }
            dev.destroy_buffer(self.buffer, None);
            dev.free_memory(self.memory, None);
        }
        lock(&self.inner.state).host_bytes -= self.len as u64;
    }
}

/// Device-local memory for one block. Dropping it (or freeing it through the
/// backend) never blocks: it joins the deferred-destroy list and is destroyed once
/// every submission issued before has completed.
pub struct VulkanSlot {
    pub(crate) id: u64,
    pub(crate) buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    pub(crate) len: usize,
    pub(crate) inner: Arc<Inner>,
}

impl VulkanSlot {
    pub(crate) fn new(b: &VulkanBackend, len: usize, purpose: &str) -> Result<Self> {
        let usage = vk::BufferUsageFlags::TRANSFER_DST | vk::BufferUsageFlags::STORAGE_BUFFER;
        let (buffer, memory) = make_buffer(b, len, usage, vk::MemoryPropertyFlags::DEVICE_LOCAL, purpose, None)?;
        let mut st = lock(&b.inner.state);
        let id = st.next_slot;
        st.next_slot += 1;
        st.slots.insert(id, SlotTrack::default());
        st.live_bytes += len as u64;
        st.peak_bytes = st.peak_bytes.max(st.live_bytes);
        Ok(VulkanSlot { id, buffer, memory, len, inner: b.inner.clone() })
    }

    /// The Vulkan buffer (bind it as a storage buffer; every use needs `unsafe` ash
    /// calls, and a submission that reads it goes through
    /// [`VulkanBackend::submit_compute`] with the block's wait token).
    pub fn buffer(&self) -> vk::Buffer {
        self.buffer
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

impl Drop for VulkanSlot {
    fn drop(&mut self) {
        let mut st = lock(&self.inner.state);
        st.slots.remove(&self.id);
        st.live_bytes -= self.len as u64;
        // Destroyed once every copy and every compute submitted so far has completed.
        let (c, k) = (st.copy_value, st.compute_value);
        st.garbage.push((self.buffer, self.memory, c, k));
    }
}
