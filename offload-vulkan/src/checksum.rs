//! A compute kernel for proving the backend (the conformance suite's fold) and for
//! timing it (the bench's compute of a chosen length), from `shaders/fold.wgsl`,
//! compiled to SPIR-V by naga at build time.
//!
//! The fold is 32-bit (WGSL has no 64-bit integers): per block,
//! `acc = (rotl(acc, 7) ^ Σ mix(word_i, i)) · K`; [`reference_hash`] and
//! [`reference_combine`] compute the same on the host.

use crate::context::{lock, vk_err, Timeline, VulkanBackend, VulkanEvent};
use crate::memory::VulkanSlot;
use ash::vk;
use offload_core::{Error, Result};

static SPIRV: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fold.spv"));

fn mix(w: u32, i: u32) -> u32 {
    let mut x = w.wrapping_add(i.wrapping_mul(0x9E37_79B9)).wrapping_mul(0x85EB_CA6B);
    x ^= x >> 13;
    x.wrapping_mul(0xC2B2_AE35)
}

/// The shader's `block_hash` over `bytes`, on the host.
pub fn reference_hash(bytes: &[u8]) -> u32 {
    bytes.chunks(4).enumerate().fold(0u32, |sum, (i, c)| {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        sum.wrapping_add(mix(u32::from_le_bytes(w), i as u32))
    })
}

/// The shader's `fold_combine`, on the host.
pub fn reference_combine(acc: u32, hash: u32) -> u32 {
    (acc.rotate_left(7) ^ hash).wrapping_mul(0x9E37_79B9)
}

/// The fold pipeline and its on-device accumulator.
pub struct ChecksumKernel {
    backend: VulkanBackend,
    module: vk::ShaderModule,
    set_layout: vk::DescriptorSetLayout,
    layout: vk::PipelineLayout,
    spin: vk::Pipeline,
    hash: vk::Pipeline,
    combine: vk::Pipeline,
    acc: vk::Buffer,
    acc_memory: vk::DeviceMemory,
    acc_ptr: *mut u32,
    /// `(every, rounds)`: fold `n` spins `rounds` first when `n % every == every - 1`.
    spin_every: Option<(u64, u32)>,
    folds: u64,
    last: Option<VulkanEvent>,
}

// SAFETY: the handles are used under the backend's lock or in `Drop`; the mapped
// accumulator is read only after waiting for the submissions that write it.
unsafe impl Send for ChecksumKernel {}

#[repr(C)]
struct Params {
    words: u32,
    bytes: u32,
    spin: u32,
    pad: u32,
}

impl ChecksumKernel {
    /// Build the pipelines; the accumulator starts at `seed`.
    pub fn new(b: &VulkanBackend, seed: u32) -> Result<Self> {
        let dev = b.device();
        let words =
            ash::util::read_spv(&mut std::io::Cursor::new(SPIRV)).map_err(|e| Error::device("vulkan", "reading the fold's SPIR-V", e))?;
        let mut k = ChecksumKernel {
            backend: b.clone(),
            module: vk::ShaderModule::null(),
            set_layout: vk::DescriptorSetLayout::null(),
            layout: vk::PipelineLayout::null(),
            spin: vk::Pipeline::null(),
            hash: vk::Pipeline::null(),
            combine: vk::Pipeline::null(),
            acc: vk::Buffer::null(),
            acc_memory: vk::DeviceMemory::null(),
            acc_ptr: std::ptr::null_mut(),
            spin_every: None,
            folds: 0,
            last: None,
        };
        // SAFETY: object creation on the live device; each handle is stored in `k` at
        // once, so `Drop` destroys whatever was made if a later step fails.
        unsafe {
            k.module = dev
                .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None)
                .map_err(|e| vk_err("vkCreateShaderModule", "the fold shaders", e))?;
            let bindings = [0, 1].map(|i| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(i)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            });
            let sl = vk::DescriptorSetLayoutCreateInfo::default()
                .flags(vk::DescriptorSetLayoutCreateFlags::PUSH_DESCRIPTOR_KHR)
                .bindings(&bindings);
            k.set_layout = dev.create_descriptor_set_layout(&sl, None).map_err(|e| vk_err("vkCreateDescriptorSetLayout", "the fold", e))?;
            let ranges = [vk::PushConstantRange::default().stage_flags(vk::ShaderStageFlags::COMPUTE).offset(0).size(16)];
            let sets = [k.set_layout];
            let pl = vk::PipelineLayoutCreateInfo::default().set_layouts(&sets).push_constant_ranges(&ranges);
            k.layout = dev.create_pipeline_layout(&pl, None).map_err(|e| vk_err("vkCreatePipelineLayout", "the fold", e))?;
            for (name, slot) in [(c"spin", 0), (c"block_hash", 1), (c"fold_combine", 2)] {
                let stage = vk::PipelineShaderStageCreateInfo::default().stage(vk::ShaderStageFlags::COMPUTE).module(k.module).name(name);
                let ci = [vk::ComputePipelineCreateInfo::default().stage(stage).layout(k.layout)];
                let p = dev
                    .create_compute_pipelines(vk::PipelineCache::null(), &ci, None)
                    .map_err(|(_, e)| vk_err("vkCreateComputePipelines", &name.to_string_lossy(), e))?[0];
                match slot {
                    0 => k.spin = p,
                    1 => k.hash = p,
                    _ => k.combine = p,
                }
            }
        }
        let acc = crate::memory::VulkanHostBuffer::new_storage(b, 16, "the fold's accumulator")?;
        (k.acc, k.acc_memory, k.acc_ptr) = acc;
        // SAFETY: the mapping holds four u32 and no submission uses it yet.
        unsafe { std::ptr::copy_nonoverlapping([seed, 0, 0, 0].as_ptr(), k.acc_ptr, 4) };
        Ok(k)
    }

    /// Make every `every`-th fold first run a single invocation for `rounds`
    /// rounds before it reads (the checking mode's late read).
    pub fn spin_every(mut self, every: u64, rounds: u32) -> Self {
        self.spin_every = (every > 0).then_some((every, rounds));
        self
    }

    /// Submit the fold of the first `bytes` of `slot` on the compute queue, waiting
    /// on `waits` (the block's wait token); returns the submission's point.
    pub fn fold(&mut self, slot: &VulkanSlot, bytes: usize, waits: &[VulkanEvent]) -> Result<VulkanEvent> {
        self.run(Some((slot, bytes)), 0, waits)
    }

    /// Submit one invocation spinning for `rounds` rounds (the bench's compute of
    /// a chosen length), reading `slot` first if given.
    pub fn spin(&mut self, slot: Option<(&VulkanSlot, usize)>, rounds: u32, waits: &[VulkanEvent]) -> Result<VulkanEvent> {
        self.run(slot, rounds.max(1), waits)
    }

    fn run(&mut self, slot: Option<(&VulkanSlot, usize)>, spin_rounds: u32, waits: &[VulkanEvent]) -> Result<VulkanEvent> {
        let b = self.backend.clone();
        if let Some((s, bytes)) = slot {
            if !std::sync::Arc::ptr_eq(&s.inner, &b.inner) {
                return Err(Error::Protocol("fold of a slot of another Vulkan backend instance".into()));
            }
            if bytes > s.len {
                return Err(Error::Protocol(format!("fold of {bytes} bytes over a {}-byte slot", s.len)));
            }
        }
        let n = self.folds;
        self.folds += 1;
        let spin = match self.spin_every {
            Some((every, rounds)) if n % every == every - 1 => rounds.max(spin_rounds),
            _ => spin_rounds,
        };
        let mut st = lock(&b.inner.state);
        b.collect(&mut st);
        let (pool, cmd) = b.begin(Timeline::Compute, "the fold")?;
        let dev = b.device();
        let (buf, bytes) = slot.map_or((self.acc, 0), |(s, n)| (s.buffer, n));
        let words = bytes.div_ceil(4) as u32;
        let params = Params { words, bytes: bytes as u32, spin, pad: 0 };
        // SAFETY: plain bytes of a `repr(C)` struct of four u32.
        let pc: [u8; 16] = unsafe { std::mem::transmute(params) };
        let to_shader = vk::MemoryBarrier::default()
            .src_access_mask(vk::AccessFlags::SHADER_WRITE)
            .dst_access_mask(vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE);
        let cs = vk::PipelineStageFlags::COMPUTE_SHADER;
        // The slot outlives the submission by the deferred-destroy list, the
        // accumulator and pipelines by `Drop` waiting for the last fold.
        // SAFETY: a command buffer begun above; every handle outlives the submission.
        unsafe {
            dev.cmd_pipeline_barrier(cmd, cs, cs, vk::DependencyFlags::empty(), &[to_shader], &[], &[]);
            let infos = [
                [vk::DescriptorBufferInfo::default().buffer(buf).offset(0).range(vk::WHOLE_SIZE)],
                [vk::DescriptorBufferInfo::default().buffer(self.acc).offset(0).range(vk::WHOLE_SIZE)],
            ];
            let writes = [0usize, 1].map(|i| {
                vk::WriteDescriptorSet::default()
                    .dst_binding(i as u32)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .buffer_info(&infos[i])
            });
            b.inner.push.cmd_push_descriptor_set(cmd, vk::PipelineBindPoint::COMPUTE, self.layout, 0, &writes);
            dev.cmd_push_constants(cmd, self.layout, vk::ShaderStageFlags::COMPUTE, 0, &pc);
            if spin > 0 {
                dev.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, self.spin);
                dev.cmd_dispatch(cmd, 1, 1, 1);
                dev.cmd_pipeline_barrier(cmd, cs, cs, vk::DependencyFlags::empty(), &[to_shader], &[], &[]);
            }
            if slot.is_some() {
                dev.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, self.hash);
                dev.cmd_dispatch(cmd, words.div_ceil(256).clamp(1, 1024), 1, 1);
                dev.cmd_pipeline_barrier(cmd, cs, cs, vk::DependencyFlags::empty(), &[to_shader], &[], &[]);
                dev.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, self.combine);
                dev.cmd_dispatch(cmd, 1, 1, 1);
            }
            let to_host =
                vk::MemoryBarrier::default().src_access_mask(vk::AccessFlags::SHADER_WRITE).dst_access_mask(vk::AccessFlags::HOST_READ);
            dev.cmd_pipeline_barrier(cmd, cs, vk::PipelineStageFlags::HOST, vk::DependencyFlags::empty(), &[to_host], &[], &[]);
        }
        let point = b.end_and_submit(&mut st, Timeline::Compute, pool, cmd, waits, "the fold")?;
        if let Some((s, _)) = slot {
            b.check_reads(&mut st, &[s], waits, point.value);
        }
        self.last = Some(point);
        Ok(point)
    }

    /// Read the accumulator (waits for the folds submitted so far).
    pub fn read(&self) -> Result<u32> {
        if let Some(p) = self.last {
            self.backend.wait_value(Timeline::Compute, p.value, "reading the fold's accumulator")?;
        }
        // SAFETY: the mapping holds four u32; every submission writing it has completed.
        Ok(unsafe { std::ptr::read_volatile(self.acc_ptr) })
    }
}

impl Drop for ChecksumKernel {
    fn drop(&mut self) {
        if let Some(p) = self.last {
            // A failed wait marks the device lost (`wait_value`).
            let _ = self.backend.wait_value(Timeline::Compute, p.value, "dropping the fold");
        }
        if self.backend.inner.is_lost() {
            // A fold may still run and write the accumulator: leaked.
            return;
        }
        let dev = self.backend.device();
        // SAFETY: no submission uses these any more (waited above, the device not lost); null handles are ignored.
        unsafe {
            for p in [self.spin, self.hash, self.combine] {
                dev.destroy_pipeline(p, None);
            }
            dev.destroy_pipeline_layout(self.layout, None);
            dev.destroy_descriptor_set_layout(self.set_layout, None);
            dev.destroy_shader_module(self.module, None);
            if self.acc_memory != vk::DeviceMemory::null() {
                dev.unmap_memory(self.acc_memory);
            }
            dev.destroy_buffer(self.acc, None);
            dev.free_memory(self.acc_memory, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_reference_masks_a_partial_last_word() {
        let a = reference_hash(&[1, 2, 3, 4, 5]);
        let b = reference_hash(&[1, 2, 3, 4, 5, 0, 0, 0]);
        assert_eq!(a, b);
        assert_ne!(a, reference_hash(&[1, 2, 3, 4, 6]));
        assert_ne!(reference_combine(1, a), reference_combine(2, a));
    }
}
