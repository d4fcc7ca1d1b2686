//! The Vulkan backend's shared state: the device handle and its queues, the
//! timeline semaphores, the protocol's bookkeeping (`Inner`), the options, and
//! the few device calls the host buffers and slots need (`memory.rs`). The
//! backend's operations are in `device.rs`.

use ash::vk;
use offload_core::{Error, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The next backend instance's [`Inner::id`].
pub(crate) static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// Held while an instance and its device are made or destroyed: loaders and
/// drivers have crashed on concurrent `vkCreateInstance` / `vkCreateDevice` /
/// `vkDestroyDevice` from several threads (Vulkan-Loader#200, wgpu#5930 and
/// #10010, whisper.cpp#3638), as tests running in parallel do. Opening a device
/// is rare and slow anyway; nothing else takes this lock.
pub(crate) static LIFECYCLE: Mutex<()> = Mutex::new(());

/// Byte the checking mode writes over a slot before each copy into it.
pub const POISON: u8 = 0xDB;

pub(crate) const BACKEND: &str = "vulkan";

/// A Vulkan call's error, naming the call and what it was for.
pub(crate) fn vk_err(call: &str, purpose: &str, e: vk::Result) -> Error {
    Error::device(BACKEND, format!("{call} ({purpose})"), e)
}

/// Which timeline a point is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Timeline {
    /// Signalled by copies on the transfer queue.
    Copy,
    /// Signalled by submissions on the compute queue.
    Compute,
}

/// A value of one of the backend's timeline semaphores: the ring's event, and the
/// wait token a user's compute submission carries (`OffloadBackend::Wait`). Only
/// the backend makes them, and it refuses points of another instance or values
/// it has not issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VulkanEvent {
    pub(crate) timeline: Timeline,
    pub(crate) semaphore: vk::Semaphore,
    pub(crate) value: u64,
    /// The backend instance that issued it (handles of two devices may be equal):
    /// its [`Inner::id`], never reused in the process (an address would be).
    pub(crate) owner: usize,
}

impl VulkanEvent {
    /// The timeline.
    pub fn timeline(&self) -> Timeline {
        self.timeline
    }
    /// The semaphore (for a `VkSubmitInfo`'s waits in the user's own submissions).
    pub fn semaphore(&self) -> vk::Semaphore {
        self.semaphore
    }
    /// The value to wait for.
    pub fn value(&self) -> u64 {
        self.value
    }
}

/// How to open the device.
#[derive(Clone, Debug)]
pub struct VulkanOptions {
    /// Index among the physical devices that have a compute queue.
    pub device_index: usize,
    /// Turn on the Khronos validation layer; its errors are collected
    /// ([`VulkanBackend::validation_messages`]) and fail [`OffloadBackend::poll_error`].
    /// An error if the layer is not installed.
    pub validation: bool,
    /// Which queue copies run on.
    pub copy_queue: CopyQueue,
    /// Host buffers in host-cached memory (`HOST_CACHED` as well as visible and
    /// coherent) where the device offers it.
    pub host_cached: bool,
    /// Split each copy into regions of at most this many bytes (`None`: one region).
    pub copy_chunk_bytes: Option<u64>,
    /// Where host buffers live.
    pub host_memory: HostAllocation,
    /// Split each copy in two halves submitted on two queues of the copy queue's
    /// family, where it has a second queue (two copy engines at once), else both
    /// on the copy queue (the same protocol, one engine). The slot's copy point is
    /// signalled once both halves are done. On by default: on the H200's NVIDIA
    /// driver it took the transfer bandwidth from 0.894 × cudarc's to 0.924 ×
    /// (`bench/results/2026-12-01-vulkan-h200-e366cc3.json`); with one queue in
    /// the family (lavapipe) it costs an empty submission per copy.
    pub split_copies: bool,
}

/// Where the store's host buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostAllocation {
    /// Host-visible, coherent memory the driver allocates (`vkAllocateMemory`).
    Allocated,
    /// Pages this process allocates (aligned to the device's
    /// `minImportedHostPointerAlignment`), imported with `VK_EXT_external_memory_host`.
    /// Falls back to [`Allocated`](Self::Allocated) on a device without the
    /// extension ([`VulkanBackend::host_memory`] says which is in use).
    Imported,
}

impl Default for VulkanOptions {
    fn default() -> Self {
        VulkanOptions {
            device_index: 0,
            validation: false,
            copy_queue: CopyQueue::Transfer,
            host_cached: false,
            copy_chunk_bytes: None,
            host_memory: HostAllocation::Allocated,
            split_copies: true,
        }
    }
}

/// Which queue copies run on. Whatever is asked for, a device without it falls
/// back to the next: a second compute-family queue, then the compute queue itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyQueue {
    /// A queue of a transfer-only family (NVIDIA's copy engines), where the device has one.
    Transfer,
    /// A second queue of the compute family, where it has two.
    SecondCompute,
    /// The compute queue itself (copies and compute then run one after another).
    Compute,
}

/// Per-slot protocol bookkeeping (the checking the simulated backend does, here on
/// the submission API: which copy filled the slot, which submission read it last).
#[derive(Default, Clone, Copy)]
pub(crate) struct SlotTrack {
    pub(crate) last_copy: Option<u64>,
    pub(crate) last_read: Option<u64>,
}

/// The backend's bookkeeping, under `Inner::state`'s lock (all zero and empty at first).
#[derive(Default)]
pub(crate) struct State {
    /// Last value submitted for signalling on each timeline.
    pub(crate) copy_value: u64,
    pub(crate) compute_value: u64,
    /// Last value submitted on the split copies' first-half semaphore.
    pub(crate) half_value: u64,
    pub(crate) split_copies: u64,
    /// Values the host has waited for (a synchronisation covers everything before).
    pub(crate) synced_compute: u64,
    /// Command buffers in flight: freed once their timeline passes the value.
    pub(crate) pending: Vec<(vk::CommandPool, vk::CommandBuffer, Timeline, u64)>,
    /// Buffers to destroy once both timelines pass the values.
    pub(crate) garbage: Vec<(vk::Buffer, vk::DeviceMemory, u64, u64)>,
    pub(crate) slots: HashMap<u64, SlotTrack>,
    pub(crate) next_slot: u64,
    pub(crate) violations: Vec<String>,
    pub(crate) checking: bool,
    pub(crate) live_bytes: u64,
    pub(crate) peak_bytes: u64,
    /// Bytes of host buffers alive (a leaked one stays counted).
    pub(crate) host_bytes: u64,
    pub(crate) syncs: u64,
    pub(crate) copies: u64,
    pub(crate) bytes_copied: u64,
}

pub(crate) struct Queue {
    pub(crate) family: u32,
    pub(crate) queue: vk::Queue,
    pub(crate) pool: vk::CommandPool,
}

pub(crate) struct Split {
    pub(crate) queue: vk::Queue,
    pub(crate) other_queue: bool,
    pub(crate) half_tl: vk::Semaphore,
}

pub(crate) struct Inner {
    /// This instance's number in the process (the owner of its points).
    pub(crate) id: usize,
    /// Set once the device may still run work the backend no longer tracks (a
    /// failed wait, a split copy half submitted when the other half failed): from
    /// then on nothing the device might read or write is freed; it is leaked.
    pub(crate) lost: std::sync::atomic::AtomicBool,
    pub(crate) _entry: ash::Entry,
    pub(crate) instance: ash::Instance,
    pub(crate) debug: Option<(ash::ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>,
    pub(crate) messages: *mut Mutex<Vec<String>>,
    pub(crate) device: ash::Device,
    pub(crate) push: ash::khr::push_descriptor::Device,
    pub(crate) mem_props: vk::PhysicalDeviceMemoryProperties,
    pub(crate) compute: Queue,
    /// `None`: copies go to the compute queue (lavapipe has one queue).
    pub(crate) transfer: Option<Queue>,
    pub(crate) families: Vec<u32>,
    pub(crate) copy_tl: vk::Semaphore,
    pub(crate) compute_tl: vk::Semaphore,
    /// With split copies: the queue of the second halves (the copy queue's
    /// family; the copy queue itself where the family has one queue), whether it
    /// is another queue, and the timeline the first halves signal.
    pub(crate) split: Option<Split>,
    pub(crate) state: Mutex<State>,
    pub(crate) name: String,
    pub(crate) host_cached: bool,
    pub(crate) copy_chunk_bytes: Option<u64>,
    /// `VK_EXT_external_memory_host` and the alignment of an imported pointer
    /// (and of its size), where host buffers are imported.
    pub(crate) host_import: Option<(ash::ext::external_memory_host::Device, usize)>,
    /// A deliberate break: refills do not wait for the buffer's last copy
    /// (`VulkanBackend::sabotage_refill_early`, feature `sabotage` only).
    pub(crate) refill_early: std::sync::atomic::AtomicBool,
    /// The highest copy-timeline value the host has waited for and seen
    /// signalled ([`VulkanBackend::wait_value`] alone raises it): a host buffer
    /// refilled while its last copy's value is above it was written without the
    /// wait invariant 2 asks for (logged, whether or not the copy had landed).
    pub(crate) copy_waited: AtomicU64,
}

// Every Vulkan object here is used under `state`'s lock where the API asks for
// external synchronisation (queues, command pools); `messages` is a leaked `Mutex`,
// freed only in `Drop` after the messenger is gone.
// SAFETY: no object needing external synchronisation is used without the lock.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) unsafe extern "system" fn debug_callback(
    severity: vk::DebugUtilsMessageSeverityFlagsEXT,
    _ty: vk::DebugUtilsMessageTypeFlagsEXT,
    data: *const vk::DebugUtilsMessengerCallbackDataEXT<'_>,
    user: *mut c_void,
) -> vk::Bool32 {
    if severity.contains(vk::DebugUtilsMessageSeverityFlagsEXT::ERROR) && !data.is_null() && !user.is_null() {
        // SAFETY: the layer passes a valid callback-data struct; `user` is the
        // `Mutex` leaked in `VulkanBackend::with_options`, alive while the messenger is.
        let (msg, sink) = unsafe { ((*data).message_as_c_str(), &*(user as *const Mutex<Vec<String>>)) };
        let text = msg.map(|m| m.to_string_lossy().into_owned()).unwrap_or_else(|| "(no message)".into());
        tracing::error!("vulkan validation: {text}");
        lock(sink).push(text);
    }
    vk::FALSE
}

/// The Vulkan backend. Cheap to clone (an `Arc`).
///
/// Copies run on the transfer queue (a dedicated transfer family where the device
/// has one) and signal the copy timeline; the user's compute is submitted on the
/// compute queue through [`submit_compute`](Self::submit_compute), waiting on the
/// blocks' wait tokens and signalling the compute timeline. A block's release is an
/// empty submission on the compute queue that signals after everything submitted
/// before it, or the value the user's own submission signals
/// (`BlockGuard::finish_after`).
#[derive(Clone)]
pub struct VulkanBackend {
    pub(crate) inner: Arc<Inner>,
}

/// Counters of a [`VulkanBackend`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VulkanCounters {
    /// Slot bytes allocated now.
    pub live_bytes: u64,
    /// Peak of `live_bytes` since the last reset.
    pub peak_bytes: u64,
    /// Host-visible bytes held by this backend's host buffers now (the
    /// store's; one leaked under a lost device stays counted).
    pub host_bytes: u64,
    /// Host synchronisations through [`OffloadBackend::synchronize`].
    pub syncs: u64,
    /// Copies submitted.
    pub copies: u64,
    /// Bytes copied host to device.
    pub bytes_copied: u64,
    /// Copies submitted in two halves ([`VulkanOptions::split_copies`]).
    pub split_copies: u64,
}

impl VulkanBackend {
    pub(crate) fn wait_value(&self, timeline: Timeline, value: u64, purpose: &str) -> Result<()> {
        let sem = match timeline {
            Timeline::Copy => self.inner.copy_tl,
            Timeline::Compute => self.inner.compute_tl,
        };
        let sems = [sem];
        let values = [value];
        let wi = vk::SemaphoreWaitInfo::default().semaphores(&sems).values(&values);
        // SAFETY: waits on a live semaphore of this device.
        unsafe { self.inner.device.wait_semaphores(&wi, u64::MAX) }.map_err(|e| {
            // Without a timeout a wait fails only when the device is lost (or out of
            // memory): what it waited for may still run, so nothing is freed from now on.
            self.inner.mark_lost(purpose);
            vk_err("vkWaitSemaphores", purpose, e)
        })?;
        if timeline == Timeline::Copy {
            self.inner.copy_waited.fetch_max(value, Ordering::AcqRel);
        }
        Ok(())
    }

    pub(crate) fn memory_type(&self, bits: u32, flags: vk::MemoryPropertyFlags) -> Option<u32> {
        find_memory_type(&self.inner.mem_props, bits, flags)
    }
}

impl Inner {
    /// Whether the device may run work the backend no longer tracks ([`Inner::lost`]).
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// From now on nothing the device might use is freed (see [`Inner::lost`]).
    /// A failed `vkQueueSubmit` as an error; a lost device is marked so
    /// (`poll_error` then reports it, and nothing is freed from now on).
    pub(crate) fn submit_failed(&self, purpose: &str, e: vk::Result) -> Error {
        if e == vk::Result::ERROR_DEVICE_LOST {
            self.mark_lost(&format!("{purpose}: vkQueueSubmit: {e}"));
        }
        vk_err("vkQueueSubmit", purpose, e)
    }

    pub(crate) fn mark_lost(&self, why: &str) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            tracing::error!("{}: {why}; the device may still run untracked work, so its memory is leaked from now on", self.name);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _one_at_a_time = lock(&LIFECYCLE);
        // SAFETY: a wait on the live device.
        if unsafe { self.device.device_wait_idle() }.is_err() || self.is_lost() {
            // Work may still run on the device: every object is leaked (the
            // messenger's sink with it, as the layer may still call it).
            tracing::error!("{}: the device did not go idle or was lost; the backend's objects are leaked", self.name);
            return;
        }
        // SAFETY: the last handle is gone and the device is idle: destroy every
        // object in reverse order of creation.
        unsafe {
            let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
            for (pool, cmd, _, _) in st.pending.drain(..) {
                self.device.free_command_buffers(pool, &[cmd]);
            }
            for (buf, mem, _, _) in st.garbage.drain(..) {
                self.device.destroy_buffer(buf, None);
                self.device.free_memory(mem, None);
            }
            self.device.destroy_semaphore(self.copy_tl, None);
            self.device.destroy_semaphore(self.compute_tl, None);
            if let Some(sp) = &self.split {
                self.device.destroy_semaphore(sp.half_tl, None);
            }
            self.device.destroy_command_pool(self.compute.pool, None);
            if let Some(t) = &self.transfer {
                self.device.destroy_command_pool(t.pool, None);
            }
            self.device.destroy_device(None);
            if let Some((du, m)) = &self.debug {
                du.destroy_debug_utils_messenger(*m, None);
            }
            self.instance.destroy_instance(None);
            drop(Box::from_raw(self.messages));
        }
    }
}

/// The first memory type among `bits` with all of `flags`.
pub(crate) fn find_memory_type(props: &vk::PhysicalDeviceMemoryProperties, bits: u32, flags: vk::MemoryPropertyFlags) -> Option<u32> {
    (0..props.memory_type_count).find(|&i| bits & (1 << i) != 0 && props.memory_types[i as usize].property_flags.contains(flags))
}
