//! The Vulkan backend handle: instance, device, a compute queue and a transfer
//! queue (the same queue where the device has only one), two timeline semaphores,
//! and the bookkeeping that makes freeing non-blocking and checks the protocol.

use crate::context::{
    lock, vk_err, HostAllocation, Inner, Queue, Split, State, Timeline, VulkanBackend, VulkanCounters, VulkanEvent, VulkanOptions, BACKEND,
    LIFECYCLE, NEXT_ID,
};
use crate::memory::{VulkanHostBuffer, VulkanSlot};
use ash::vk;
use offload_core::{Error, MemoryInfo, OffloadBackend, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

impl VulkanBackend {
    /// The first Vulkan device with a compute queue, validation off.
    pub fn new() -> Result<Self> {
        Self::with_options(&VulkanOptions::default())
    }

    /// A device chosen and configured by `options`. Returns
    /// [`Error::Unsupported`] where no Vulkan loader or device is installed.
    pub fn with_options(options: &VulkanOptions) -> Result<Self> {
        // SAFETY: loading the system's Vulkan loader library; no Vulkan call yet.
        let entry =
            unsafe { ash::Entry::load() }.map_err(|e| Error::unsupported(BACKEND, format!("no Vulkan loader (libvulkan.so.1): {e}")))?;
        let messages: *mut Mutex<Vec<String>> = Box::into_raw(Box::new(Mutex::new(Vec::new())));
        let built = {
            let _one_at_a_time = lock(&LIFECYCLE);
            Self::build(entry, options, messages)
        };
        if built.is_err() {
            // SAFETY: no messenger was left alive on failure (`build` destroys what it made).
            drop(unsafe { Box::from_raw(messages) });
        }
        built
    }

    fn build(entry: ash::Entry, options: &VulkanOptions, messages: *mut Mutex<Vec<String>>) -> Result<Self> {
        let (instance, debug) = Self::create_instance(&entry, options, messages)?;
        let destroy_instance = |debug: &Option<(ash::ext::debug_utils::Instance, vk::DebugUtilsMessengerEXT)>| {
            // SAFETY: called on error paths before any device exists.
            unsafe {
                if let Some((du, m)) = debug {
                    du.destroy_debug_utils_messenger(*m, None);
                }
                instance.destroy_instance(None);
            }
        };
        let opened = Self::open_device(&instance, options);
        let (phys, compute_family, transfer, compute_queues, name) = match opened {
            Ok(x) => x,
            Err(e) => {
                destroy_instance(&debug);
                return Err(e);
            }
        };
        let (copy_at, second_at) = Self::copy_queues(options, compute_family, transfer, compute_queues);
        let one = [1.0f32];
        let two = [1.0f32, 1.0];
        let mut qcis = vec![vk::DeviceQueueCreateInfo::default()
            .queue_family_index(compute_family)
            .queue_priorities(if copy_at == Some((compute_family, 1)) { &two } else { &one })];
        if let Some((t, _)) = copy_at.filter(|(f, _)| *f != compute_family) {
            qcis.push(vk::DeviceQueueCreateInfo::default().queue_family_index(t).queue_priorities(if second_at.is_some() {
                &two
            } else {
                &one
            }));
        }
        // Host pages imported where asked for and offered.
        let import_align = Self::import_alignment(&instance, phys, options, &name);
        let mut dev_exts = vec![ash::khr::push_descriptor::NAME.as_ptr()];
        if import_align.is_some() {
            dev_exts.push(ash::ext::external_memory_host::NAME.as_ptr());
        }
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default().timeline_semaphore(true);
        let dci = vk::DeviceCreateInfo::default().queue_create_infos(&qcis).enabled_extension_names(&dev_exts).push_next(&mut f12);
        // SAFETY: `phys` is a device of `instance`; the create info lives across the call.
        let device = match unsafe { instance.create_device(phys, &dci, None) } {
            Ok(d) => d,
            Err(e) => {
                destroy_instance(&debug);
                return Err(vk_err("vkCreateDevice", &name, e));
            }
        };
        // What the closure below made, so a failure part-way destroys it before the
        // device (a device's children must go first).
        let (mut made_pools, mut made_sems): (Vec<vk::CommandPool>, Vec<vk::Semaphore>) = (Vec::new(), Vec::new());
        // SAFETY: plain queries and object creation on the live device; every object
        // is destroyed in `Inner::drop`, or here on failure (nothing submitted yet).
        let made = unsafe {
            (|| -> std::result::Result<_, (vk::Result, &'static str)> {
                let mut mk_pool = |family: u32| {
                    let ci = vk::CommandPoolCreateInfo::default()
                        .queue_family_index(family)
                        .flags(vk::CommandPoolCreateFlags::TRANSIENT | vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
                    let p = device.create_command_pool(&ci, None)?;
                    made_pools.push(p);
                    Ok(p)
                };
                let compute_pool = mk_pool(compute_family).map_err(|e| (e, "vkCreateCommandPool"))?;
                let compute = Queue { family: compute_family, queue: device.get_device_queue(compute_family, 0), pool: compute_pool };
                let transfer = match copy_at {
                    Some((t, index)) => {
                        let pool = mk_pool(t).map_err(|e| (e, "vkCreateCommandPool"))?;
                        Some(Queue { family: t, queue: device.get_device_queue(t, index), pool })
                    }
                    None => None,
                };
                let mut ty = vk::SemaphoreTypeCreateInfo::default().semaphore_type(vk::SemaphoreType::TIMELINE).initial_value(0);
                let ci = vk::SemaphoreCreateInfo::default().push_next(&mut ty);
                let mut mk_sem = || {
                    let s = device.create_semaphore(&ci, None).map_err(|e| (e, "vkCreateSemaphore"))?;
                    made_sems.push(s);
                    Ok::<_, (vk::Result, &'static str)>(s)
                };
                let copy_tl = mk_sem()?;
                let compute_tl = mk_sem()?;
                let split = match options.split_copies {
                    false => None,
                    true => {
                        let half_tl = mk_sem()?;
                        let first = transfer.as_ref().unwrap_or(&compute).queue;
                        let queue = second_at.map_or(first, |(f, i)| device.get_device_queue(f, i));
                        Some(Split { queue, other_queue: second_at.is_some(), half_tl })
                    }
                };
                Ok((compute, transfer, copy_tl, compute_tl, split))
            })()
        };
        let (compute, transfer, copy_tl, compute_tl, split) = match made {
            Ok(x) => x,
            Err((e, call)) => {
                // SAFETY: nothing was submitted; the device's children go first, then the device.
                unsafe {
                    made_sems.iter().for_each(|s| device.destroy_semaphore(*s, None));
                    made_pools.iter().for_each(|p| device.destroy_command_pool(*p, None));
                    device.destroy_device(None);
                }
                destroy_instance(&debug);
                return Err(vk_err(call, &name, e));
            }
        };
        let push = ash::khr::push_descriptor::Device::new(&instance, &device);
        let host_import = import_align.map(|a| (ash::ext::external_memory_host::Device::new(&instance, &device), a));
        // SAFETY: a query of a live physical device.
        let mem_props = unsafe { instance.get_physical_device_memory_properties(phys) };
        let mut families = vec![compute.family];
        if let Some(t) = transfer.as_ref().filter(|t| t.family != compute.family) {
            families.push(t.family);
        }
        let state = State::default();
        let inner = Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            lost: std::sync::atomic::AtomicBool::new(false),
            _entry: entry,
            instance,
            debug,
            messages,
            device,
            push,
            mem_props,
            compute,
            transfer,
            families,
            copy_tl,
            compute_tl,
            split,
            state: Mutex::new(state),
            name,
            host_cached: options.host_cached,
            copy_chunk_bytes: options.copy_chunk_bytes.filter(|&c| c > 0),
            host_import,
            refill_early: std::sync::atomic::AtomicBool::new(false),
            copy_waited: AtomicU64::new(0),
        };
        Ok(VulkanBackend { inner: Arc::new(inner) })
    }

    /// The device's name (`"llvmpipe (LLVM 15.0.6, 256 bits)"`, `"NVIDIA H200"`).
    pub fn device_name(&self) -> &str {
        &self.inner.name
    }

    /// Whether copies run on a queue of their own (a transfer-only family's, or a
    /// second queue of the compute family), else on the compute queue.
    pub fn has_transfer_queue(&self) -> bool {
        self.inner.transfer.is_some()
    }

    /// With [`VulkanOptions::split_copies`]: on how many queues a copy's halves
    /// run (2 where the copy queue's family has a second queue, else 1); `None`
    /// with split copies off.
    pub fn split_copy_queues(&self) -> Option<usize> {
        self.inner.split.as_ref().map(|sp| if sp.other_queue { 2 } else { 1 })
    }

    /// Where host buffers live: [`HostAllocation::Imported`] only where it was asked
    /// for and the device offers `VK_EXT_external_memory_host`.
    pub fn host_memory(&self) -> HostAllocation {
        if self.inner.host_import.is_some() {
            HostAllocation::Imported
        } else {
            HostAllocation::Allocated
        }
    }

    /// The queue family copies run on.
    pub fn copy_family(&self) -> u32 {
        self.inner.transfer.as_ref().unwrap_or(&self.inner.compute).family
    }

    /// The checking mode for conformance runs: before every copy into a slot, the
    /// transfer queue fills the whole slot with [`POISON`](crate::context::POISON), so a read
    /// before the copy's point, or a copy not ordered after a read, changes a result.
    /// (The protocol log — which copy filled a slot, which submission read it — is
    /// kept in every mode.)
    pub fn enable_checking(&self) {
        lock(&self.inner.state).checking = true;
    }

    /// A deliberate break for the conformance suite (`Sabotage::EarlyRefill`):
    /// from now on, refilling a host buffer (the disk tier's bounce buffers) does
    /// not wait for the buffer's last copy, so a copy still queued lands the
    /// refill's bytes. Never in production: the feature `sabotage` only.
    #[cfg(feature = "sabotage")]
    #[doc(hidden)]
    pub fn sabotage_refill_early(&self) {
        self.inner.refill_early.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Protocol violations seen so far: a submission that read a slot without
    /// waiting for the copy that filled it (invariant 1), a copy into or release of
    /// a slot not ordered after the last submission that read it (invariant 2).
    pub fn violations(&self) -> Vec<String> {
        lock(&self.inner.state).violations.clone()
    }

    /// Error messages of the validation layer so far (when it is on).
    pub fn validation_messages(&self) -> Vec<String> {
        // SAFETY: `messages` lives as long as `inner`.
        lock(unsafe { &*self.inner.messages }).clone()
    }

    /// Counters so far.
    pub fn counters(&self) -> VulkanCounters {
        let st = lock(&self.inner.state);
        VulkanCounters {
            live_bytes: st.live_bytes,
            host_bytes: st.host_bytes,
            peak_bytes: st.peak_bytes,
            syncs: st.syncs,
            copies: st.copies,
            bytes_copied: st.bytes_copied,
            split_copies: st.split_copies,
        }
    }

    /// Restart the peak at the live bytes.
    pub fn reset_peak(&self) {
        let mut st = lock(&self.inner.state);
        st.peak_bytes = st.live_bytes;
    }

    /// The logical device, for recording command buffers (ash's calls are `unsafe`).
    pub fn device(&self) -> &ash::Device {
        &self.inner.device
    }

    /// The compute queue's family (allocate command buffers for
    /// [`submit_compute`](Self::submit_compute) from a pool of this family).
    pub fn compute_family(&self) -> u32 {
        self.inner.compute.family
    }

    /// Submit `cmd` on the compute queue, waiting (at the compute-shader stage) on
    /// `waits` — the wait tokens of the blocks it reads — and signalling the next
    /// value of the compute timeline, which is returned: pass it to
    /// `BlockGuard::finish_after` to release a block after this submission.
    /// `reads` names the slots `cmd` reads, for the protocol log.
    ///
    /// # Safety
    ///
    /// `cmd` is a primary command buffer of this device, recorded and ended, from a
    /// pool of the compute family, not in use by another submission, and kept
    /// (not freed or reset) until the returned point has completed; every buffer it
    /// uses stays alive until then.
    pub unsafe fn submit_compute(&self, cmd: vk::CommandBuffer, reads: &[&VulkanSlot], waits: &[VulkanEvent]) -> Result<VulkanEvent> {
        // A slot of another instance would rewrite the log entry of this one's
        // slot of the same number.
        if reads.iter().any(|s| !Arc::ptr_eq(&s.inner, &self.inner)) {
            return Err(Error::Protocol("user compute reads a slot of another Vulkan backend instance".into()));
        }
        let mut st = lock(&self.inner.state);
        // SAFETY: this function's contract.
        let point = unsafe { self.submit_locked(&mut st, Timeline::Compute, Some(cmd), waits, "user compute") }?;
        self.check_reads(&mut st, reads, waits, point.value);
        Ok(point)
    }

    /// Log the reads of a compute submission that signals `value` (called once it
    /// is submitted: a refused one read nothing): a read not waiting for its
    /// slot's copy is a violation; each slot's last read becomes `value`.
    pub(crate) fn check_reads(&self, st: &mut State, reads: &[&VulkanSlot], waits: &[VulkanEvent], value: u64) {
        let next = value;
        for s in reads {
            let Some(track) = st.slots.get(&s.id).copied() else {
                st.violations.push(format!("slot {} read after it was freed", s.id));
                continue;
            };
            if let Some(c) = track.last_copy {
                let waited = waits.iter().any(|w| w.timeline == Timeline::Copy && w.value >= c);
                if !waited {
                    st.violations.push(format!("slot {} read by a submission that does not wait for its copy (invariant 1)", s.id));
                }
            }
            if let Some(t) = st.slots.get_mut(&s.id) {
                t.last_read = Some(next);
            }
        }
    }

    /// Whether `after` orders work after the last read `last_read`.
    pub(crate) fn covers(st: &State, last_read: Option<u64>, after: Option<&VulkanEvent>) -> bool {
        match last_read {
            None => true,
            Some(r) => st.synced_compute >= r || after.is_some_and(|a| a.timeline == Timeline::Compute && a.value >= r),
        }
    }

    /// Submit (under the state lock) on the queue of `timeline`: `cmd` (if any),
    /// waiting on `waits`, signalling the timeline's next value.
    ///
    /// # Safety
    ///
    /// `cmd`, if any, is a recorded primary command buffer of the right family.
    pub(crate) unsafe fn submit_locked(
        &self,
        st: &mut State,
        timeline: Timeline,
        cmd: Option<vk::CommandBuffer>,
        waits: &[VulkanEvent],
        purpose: &str,
    ) -> Result<VulkanEvent> {
        let i = &self.inner;
        self.check_waits(st, waits, purpose)?;
        let (queue, sem, value) = match timeline {
            Timeline::Copy => (i.transfer.as_ref().unwrap_or(&i.compute).queue, i.copy_tl, st.copy_value + 1),
            Timeline::Compute => (i.compute.queue, i.compute_tl, st.compute_value + 1),
        };
        let wait_sems: Vec<vk::Semaphore> = waits.iter().map(|w| w.semaphore).collect();
        let wait_values: Vec<u64> = waits.iter().map(|w| w.value).collect();
        let stages = vec![vk::PipelineStageFlags::ALL_COMMANDS; waits.len()];
        let signal = [sem];
        let signal_values = [value];
        let cmds: Vec<vk::CommandBuffer> = cmd.into_iter().collect();
        let mut tl = vk::TimelineSemaphoreSubmitInfo::default().wait_semaphore_values(&wait_values).signal_semaphore_values(&signal_values);
        let submit = vk::SubmitInfo::default()
            .wait_semaphores(&wait_sems)
            .wait_dst_stage_mask(&stages)
            .command_buffers(&cmds)
            .signal_semaphores(&signal)
            .push_next(&mut tl);
        // SAFETY: the queue is externally synchronised by the state lock the caller
        // holds; the semaphores are this device's; `cmd` per this function's contract.
        unsafe { i.device.queue_submit(queue, &[submit], vk::Fence::null()) }.map_err(|e| i.submit_failed(purpose, e))?;
        match timeline {
            Timeline::Copy => st.copy_value = value,
            Timeline::Compute => st.compute_value = value,
        }
        Ok(VulkanEvent { timeline, semaphore: sem, value, owner: self.inner.id })
    }

    /// Refuse waits on points this backend did not issue.
    fn check_waits(&self, st: &State, waits: &[VulkanEvent], purpose: &str) -> Result<()> {
        let i = &self.inner;
        for w in waits {
            let (own, issued) = match w.timeline {
                Timeline::Copy => (i.copy_tl, st.copy_value),
                Timeline::Compute => (i.compute_tl, st.compute_value),
            };
            if w.owner != self.inner.id || w.semaphore != own || w.value > issued {
                return Err(Error::Protocol(format!(
                    "{purpose}: a wait on {:?} value {} that this backend did not issue (issued up to {issued})",
                    w.timeline, w.value
                )));
            }
        }
        Ok(())
    }

    /// Submit (under the state lock) a copy in two halves: `first` on the copy
    /// queue, waiting on `waits` and signalling the next value of the halves'
    /// timeline; `second` on the split queue, waiting on `waits` too (and on the
    /// first half where `first` begins with the checking mode's poison of the
    /// whole slot), then an empty batch on that queue that waits for the first
    /// half and signals the copy timeline's next value — the point returned, after
    /// both halves (a signal also covers everything earlier on its queue). Every
    /// copy-timeline value is signalled from the split queue, in order. On an
    /// error both command buffers are freed (the first after its half completed;
    /// leaked if that cannot be waited for).
    ///
    /// # Safety
    ///
    /// `first` and `second` are recorded and ended primary command buffers of the
    /// copy queue's family.
    unsafe fn submit_split_locked(
        &self,
        st: &mut State,
        first: vk::CommandBuffer,
        second: vk::CommandBuffer,
        waits: &[VulkanEvent],
        after_first: bool,
        purpose: &str,
    ) -> Result<VulkanEvent> {
        let i = &self.inner;
        let pool = i.transfer.as_ref().unwrap_or(&i.compute).pool;
        let free = || {
            // SAFETY: neither was submitted.
            unsafe { i.device.free_command_buffers(pool, &[first, second]) }
        };
        let Some(sp) = i.split.as_ref() else {
            free();
            return Err(Error::Protocol(format!("{purpose}: split copies are off")));
        };
        if let Err(e) = self.check_waits(st, waits, purpose) {
            free();
            return Err(e);
        }
        let (half, value) = (st.half_value + 1, st.copy_value + 1);
        let mut wait_sems: Vec<vk::Semaphore> = waits.iter().map(|w| w.semaphore).collect();
        let mut wait_values: Vec<u64> = waits.iter().map(|w| w.value).collect();
        let stages = vec![vk::PipelineStageFlags::ALL_COMMANDS; waits.len() + 1];
        let (half_sem, half_val, copy_sem, copy_val) = ([sp.half_tl], [half], [i.copy_tl], [value]);
        let first_cmds = [first];
        let mut tl_a = vk::TimelineSemaphoreSubmitInfo::default().wait_semaphore_values(&wait_values).signal_semaphore_values(&half_val);
        let a = vk::SubmitInfo::default()
            .wait_semaphores(&wait_sems)
            .wait_dst_stage_mask(&stages[..waits.len()])
            .command_buffers(&first_cmds)
            .signal_semaphores(&half_sem)
            .push_next(&mut tl_a);
        let queue = i.transfer.as_ref().unwrap_or(&i.compute).queue;
        // SAFETY: queues are externally synchronised by the state lock the caller
        // holds; the semaphores are this device's; the buffers per this function's contract.
        if let Err(e) = unsafe { i.device.queue_submit(queue, &[a], vk::Fence::null()) } {
            free();
            return Err(i.submit_failed(purpose, e));
        }
        st.half_value = half;
        if after_first {
            wait_sems.push(sp.half_tl);
            wait_values.push(half);
        }
        let second_cmds = [second];
        let mut tl_b = vk::TimelineSemaphoreSubmitInfo::default().wait_semaphore_values(&wait_values);
        let b = vk::SubmitInfo::default()
            .wait_semaphores(&wait_sems)
            .wait_dst_stage_mask(&stages[..wait_sems.len()])
            .command_buffers(&second_cmds)
            .push_next(&mut tl_b);
        let mut tl_c = vk::TimelineSemaphoreSubmitInfo::default().wait_semaphore_values(&half_val).signal_semaphore_values(&copy_val);
        let c = vk::SubmitInfo::default()
            .wait_semaphores(&half_sem)
            .wait_dst_stage_mask(&stages[..1])
            .signal_semaphores(&copy_sem)
            .push_next(&mut tl_c);
        // SAFETY: as above.
        if let Err(e) = unsafe { i.device.queue_submit(sp.queue, &[b, c], vk::Fence::null()) } {
            let e = i.submit_failed(purpose, e);
            // The first half is in flight and nothing will signal the copy timeline
            // for it: wait for it here (an error path) so its command buffer can go.
            let wi = vk::SemaphoreWaitInfo::default().semaphores(&half_sem).values(&half_val);
            // SAFETY: a wait on a live semaphore of this device.
            if unsafe { i.device.wait_semaphores(&wi, u64::MAX) }.is_err() {
                // The half may still read the source and write the slot, and no
                // timeline value covers it: neither may be freed, nor anything else.
                i.mark_lost(&format!("{purpose}: the first half could not be waited for"));
                return Err(e);
            }
            // SAFETY: `first` completed (just waited for); `second` was never submitted.
            unsafe { i.device.free_command_buffers(pool, &[first, second]) };
            return Err(e);
        }
        st.copy_value = value;
        st.split_copies += 1;
        Ok(VulkanEvent { timeline: Timeline::Copy, semaphore: i.copy_tl, value, owner: self.inner.id })
    }

    /// The value `timeline`'s semaphore has reached.
    pub(crate) fn reached(&self, timeline: Timeline) -> u64 {
        let sem = match timeline {
            Timeline::Copy => self.inner.copy_tl,
            Timeline::Compute => self.inner.compute_tl,
        };
        // An error (a lost device) reads as "nothing reached", and marks the device
        // lost, so `poll_error` reports it and nothing is freed under work that may
        // still run.
        // SAFETY: a query of a live semaphore of this device.
        unsafe { self.inner.device.get_semaphore_counter_value(sem) }.unwrap_or_else(|e| {
            self.inner.mark_lost(&format!("reading a timeline semaphore: {e}"));
            0
        })
    }

    /// Free command buffers and destroy buffers whose work has completed (never
    /// waits; frees nothing once the device is lost: [`Inner::lost`]).
    pub(crate) fn collect(&self, st: &mut State) {
        if self.inner.is_lost() {
            return;
        }
        let (copy, compute) = (self.reached(Timeline::Copy), self.reached(Timeline::Compute));
        let dev = &self.inner.device;
        st.pending.retain(|&(pool, cmd, tl, v)| {
            let done = match tl {
                Timeline::Copy => copy >= v,
                Timeline::Compute => compute >= v,
            };
            if done {
                // SAFETY: the submission using `cmd` completed; the pool is used under the lock.
                unsafe { dev.free_command_buffers(pool, &[cmd]) };
            }
            !done
        });
        st.garbage.retain(|&(buf, mem, c, k)| {
            let done = copy >= c && compute >= k;
            if done {
                // SAFETY: every submission that could use the buffer completed.
                unsafe {
                    dev.destroy_buffer(buf, None);
                    dev.free_memory(mem, None);
                }
            }
            !done
        });
    }

    /// Allocate a primary command buffer from the pool of `timeline`'s queue and
    /// begin it (under the state lock).
    pub(crate) fn begin(&self, timeline: Timeline, purpose: &str) -> Result<(vk::CommandPool, vk::CommandBuffer)> {
        let i = &self.inner;
        let pool = match timeline {
            Timeline::Copy => i.transfer.as_ref().unwrap_or(&i.compute).pool,
            Timeline::Compute => i.compute.pool,
        };
        let ai = vk::CommandBufferAllocateInfo::default().command_pool(pool).level(vk::CommandBufferLevel::PRIMARY).command_buffer_count(1);
        // SAFETY: the pool is used under the state lock (the caller's).
        let cmd = unsafe { i.device.allocate_command_buffers(&ai) }.map_err(|e| vk_err("vkAllocateCommandBuffers", purpose, e))?[0];
        let bi = vk::CommandBufferBeginInfo::default().flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: a freshly allocated command buffer.
        if let Err(e) = unsafe { i.device.begin_command_buffer(cmd, &bi) } {
            // SAFETY: never submitted.
            unsafe { i.device.free_command_buffers(pool, &[cmd]) };
            return Err(vk_err("vkBeginCommandBuffer", purpose, e));
        }
        Ok((pool, cmd))
    }

    /// End `cmd` and submit it (under the state lock); it is freed once done.
    pub(crate) fn end_and_submit(
        &self,
        st: &mut State,
        timeline: Timeline,
        pool: vk::CommandPool,
        cmd: vk::CommandBuffer,
        waits: &[VulkanEvent],
        purpose: &str,
    ) -> Result<VulkanEvent> {
        let dev = &self.inner.device;
        // SAFETY: `cmd` was begun by `begin` and recorded by the caller.
        let ended = unsafe { dev.end_command_buffer(cmd) }.map_err(|e| vk_err("vkEndCommandBuffer", purpose, e));
        // SAFETY: a recorded command buffer of the queue's family.
        let submitted = ended.and_then(|()| unsafe { self.submit_locked(st, timeline, Some(cmd), waits, purpose) });
        match submitted {
            Ok(p) => {
                st.pending.push((pool, cmd, timeline, p.value));
                Ok(p)
            }
            Err(e) => {
                // SAFETY: not submitted.
                unsafe { dev.free_command_buffers(pool, &[cmd]) };
                Err(e)
            }
        }
    }
}

impl offload_core::HostBuffer for VulkanHostBuffer {
    fn is_pinned(&self) -> bool {
        true
    }

    fn block_bytes(&self) -> Result<&[u8]> {
        Ok(self.as_slice())
    }

    fn refill(&mut self, fill: offload_core::Fill<'_>) -> Result<()> {
        VulkanHostBuffer::refill(self, fill)
    }
}

/// The backend is its own host memory: host-visible, coherent buffers (or
/// imported pages), which the transfer queue copies from.
impl offload_core::HostMemory for VulkanBackend {
    type Buffer = VulkanHostBuffer;

    fn capabilities(&self) -> offload_core::HostCapabilities {
        offload_core::HostCapabilities { pinned: true, refill: true, ..Default::default() }
    }

    fn alloc(
        &self,
        kind: offload_core::HostKind<'_>,
        bytes: usize,
        purpose: &str,
        fill: offload_core::Fill<'_>,
    ) -> Result<VulkanHostBuffer> {
        match kind {
            offload_core::HostKind::Pinned => VulkanHostBuffer::new(self, bytes, purpose, fill),
            kind => Err(offload_core::host::unsupported_kind(BACKEND, kind, purpose)),
        }
    }
}

impl OffloadBackend for VulkanBackend {
    type Host = VulkanBackend;
    type Slot = VulkanSlot;
    type Event = VulkanEvent;
    type Wait = VulkanEvent;

    fn name(&self) -> &'static str {
        BACKEND
    }

    fn host(&self) -> VulkanBackend {
        self.clone()
    }

    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<VulkanSlot> {
        VulkanSlot::new(self, bytes, purpose)
    }

    fn free_slot(&self, slot: VulkanSlot, after: Option<&VulkanEvent>) -> Result<()> {
        if !Arc::ptr_eq(&slot.inner, &self.inner) {
            return Err(Error::Protocol("freeing a Vulkan slot of another backend instance".into()));
        }
        // The slot is destroyed only after every value issued so far, whatever
        // `after` says; `after` is checked for the protocol log alone, and must be
        // a compute point this backend issued (another's, or a copy point, would
        // pass the log's comparison by its number alone).
        let mut st = lock(&self.inner.state);
        let purpose = format!("the release of slot {}", slot.id);
        if let Some(a) = after {
            let foreign = match a.timeline {
                Timeline::Compute => self.check_waits(&st, std::slice::from_ref(a), &purpose).err(),
                Timeline::Copy => Some(Error::Protocol(format!("{purpose}: ordered after a copy point, not a compute point"))),
            };
            if let Some(e) = foreign {
                drop(st);
                // Destroyed by `Drop` all the same, once every value issued so far has passed.
                drop(slot);
                return Err(e);
            }
        }
        let last_read = st.slots.get(&slot.id).and_then(|t| t.last_read);
        if !Self::covers(&st, last_read, after) {
            st.violations.push(format!("slot {} released before its last read (invariant 2)", slot.id));
        }
        drop(st);
        // Destroyed by `Drop` once both timelines pass every value issued so far.
        drop(slot);
        Ok(())
    }

    fn copy_to_slot(&self, src: &VulkanHostBuffer, dst: &mut VulkanSlot, bytes: usize, after: Option<&VulkanEvent>) -> Result<VulkanEvent> {
        if !Arc::ptr_eq(&dst.inner, &self.inner) || !Arc::ptr_eq(src.inner(), &self.inner) {
            return Err(Error::Protocol("copy with a buffer or slot of another Vulkan backend instance".into()));
        }
        if bytes > src.len() || bytes > dst.len {
            return Err(Error::Protocol(format!("copy of {bytes} bytes from a {}-byte buffer into a {}-byte slot", src.len(), dst.len)));
        }
        let purpose = format!("copy of {bytes} bytes into slot {}", dst.id);
        if after.is_some_and(|a| a.timeline != Timeline::Compute) {
            return Err(Error::Protocol(format!("{purpose}: ordered after a copy point, not a compute point (a slot's release)")));
        }
        let mut st = lock(&self.inner.state);
        self.collect(&mut st);
        let last_read = st.slots.get(&dst.id).and_then(|t| t.last_read);
        if !Self::covers(&st, last_read, after) {
            st.violations.push(format!("slot {} overwritten before its last read (invariant 2)", dst.id));
        }
        let dev = &self.inner.device;
        let checking = st.checking;
        let chunk = self.inner.copy_chunk_bytes.unwrap_or(u64::MAX);
        // The copy of [from, to), in regions of at most `chunk` bytes.
        let record_copy = |cmd: vk::CommandBuffer, from: u64, to: u64| {
            let regions: Vec<vk::BufferCopy> = (from..to)
                .step_by(chunk.min(to - from).max(1) as usize)
                .map(|o| vk::BufferCopy { src_offset: o, dst_offset: o, size: chunk.min(to - o) })
                .collect();
            if !regions.is_empty() {
                // Both buffers hold `to` bytes (checked above) and live until the copy's
                // value (host buffers drain on drop, slots go through the garbage list).
                // SAFETY: `cmd` is begun; both buffers are large enough and alive (above).
                unsafe { dev.cmd_copy_buffer(cmd, src.buffer(), dst.buffer, &regions) };
            }
        };
        // The checking mode's poison of the whole slot, before any copy into it.
        let record_poison = |cmd: vk::CommandBuffer| {
            if checking {
                let barrier = vk::MemoryBarrier::default()
                    .src_access_mask(vk::AccessFlags::TRANSFER_WRITE)
                    .dst_access_mask(vk::AccessFlags::TRANSFER_WRITE);
                // SAFETY: `cmd` is begun; the slot lives until the copy's value.
                unsafe {
                    dev.cmd_fill_buffer(cmd, dst.buffer, 0, vk::WHOLE_SIZE, u32::from_ne_bytes([crate::context::POISON; 4]));
                    dev.cmd_pipeline_barrier(
                        cmd,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::PipelineStageFlags::TRANSFER,
                        vk::DependencyFlags::empty(),
                        &[barrier],
                        &[],
                        &[],
                    );
                }
            }
        };
        let mut waits: Vec<VulkanEvent> = after.copied().into_iter().collect();
        // A slot copied into and never read since (a prefetched block evicted
        // unread): the release orders nothing after that copy, and submission
        // order alone orders no two submissions in Vulkan. Wait for it, so two
        // copies never write the slot at once (a value signalled already costs
        // nothing).
        // (A torn slot's `u64::MAX` is no value to wait for: its half copy was
        // waited for, or the device marked lost, when its submit failed.)
        if let (None, Some(c)) = (last_read, st.slots.get(&dst.id).and_then(|t| t.last_copy).filter(|&c| c != u64::MAX)) {
            waits.push(VulkanEvent { timeline: Timeline::Copy, semaphore: self.inner.copy_tl, value: c, owner: self.inner.id });
        }
        let point = match self.inner.split.is_some() {
            false => {
                let (pool, cmd) = self.begin(Timeline::Copy, &purpose)?;
                record_poison(cmd);
                record_copy(cmd, 0, bytes as u64);
                self.end_and_submit(&mut st, Timeline::Copy, pool, cmd, &waits, &purpose)?
            }
            true => {
                let (pool, first) = self.begin(Timeline::Copy, &purpose)?;
                let (_, second) = match self.begin(Timeline::Copy, &purpose) {
                    Ok(x) => x,
                    Err(e) => {
                        // SAFETY: never submitted.
                        unsafe { dev.free_command_buffers(pool, &[first]) };
                        return Err(e);
                    }
                };
                let half = (bytes as u64 / 2) & !3;
                record_poison(first);
                record_copy(first, 0, half);
                record_copy(second, half, bytes as u64);
                // SAFETY: both were begun by `begin` and recorded above.
                let ended = unsafe { dev.end_command_buffer(first).and_then(|()| dev.end_command_buffer(second)) };
                if let Err(e) = ended {
                    // SAFETY: never submitted.
                    unsafe { dev.free_command_buffers(pool, &[first, second]) };
                    return Err(vk_err("vkEndCommandBuffer", &purpose, e));
                }
                // SAFETY: recorded primary command buffers of the copy queue's family.
                let p = match unsafe { self.submit_split_locked(&mut st, first, second, &waits, checking, &purpose) } {
                    Ok(p) => p,
                    Err(e) => {
                        // The first half (and the poison) may have written the slot:
                        // no copy's point covers its bytes now, so the log refuses
                        // every read until a copy fills it again.
                        if let Some(t) = st.slots.get_mut(&dst.id) {
                            t.last_copy = Some(u64::MAX);
                        }
                        return Err(e);
                    }
                };
                st.pending.push((pool, first, Timeline::Copy, p.value));
                st.pending.push((pool, second, Timeline::Copy, p.value));
                p
            }
        };
        src.used_until(point.value);
        if let Some(t) = st.slots.get_mut(&dst.id) {
            t.last_copy = Some(point.value);
            t.last_read = None;
        }
        st.copies += 1;
        st.bytes_copied += bytes as u64;
        Ok(point)
    }

    fn compute_wait(&self, event: &VulkanEvent) -> Result<VulkanEvent> {
        // Explicit submission: nothing to enqueue; the token goes into the user's submission.
        Ok(*event)
    }

    fn record_compute(&self) -> Result<VulkanEvent> {
        let mut st = lock(&self.inner.state);
        // An empty submission: its signal follows every command submitted before it on the queue.
        // SAFETY: no command buffer.
        unsafe { self.submit_locked(&mut st, Timeline::Compute, None, &[], "a block's release") }
    }

    fn synchronize(&self) -> Result<()> {
        let (copy, compute) = {
            let mut st = lock(&self.inner.state);
            st.syncs += 1;
            (st.copy_value, st.compute_value)
        };
        self.wait_value(Timeline::Copy, copy, "synchronize (copies)")?;
        self.wait_value(Timeline::Compute, compute, "synchronize (compute)")?;
        let mut st = lock(&self.inner.state);
        st.synced_compute = st.synced_compute.max(compute);
        self.collect(&mut st);
        Ok(())
    }

    fn poll_error(&self) -> Result<()> {
        let msgs = self.validation_messages();
        if let Some(first) = msgs.first() {
            return Err(Error::device(BACKEND, "validation", format!("{} validation error(s); first: {first}", msgs.len())));
        }
        if self.inner.is_lost() {
            return Err(Error::device(
                BACKEND,
                "the device",
                "lost: a wait failed or a split copy was left half done; its memory is leaked",
            ));
        }
        let mut st = lock(&self.inner.state);
        self.collect(&mut st);
        Ok(())
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        let heaps = &self.inner.mem_props;
        let total = heaps.memory_heaps[..heaps.memory_heap_count as usize]
            .iter()
            .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .max()
            .unwrap_or(0);
        let live = lock(&self.inner.state).live_bytes;
        Ok(MemoryInfo { free: total.saturating_sub(live), total })
    }
}
