//! The host store: per block one contiguous, exactly sized, immutable buffer
//! (page-locked where the backend can), every tensor at a 256-byte-aligned offset.

use crate::backend::OffloadBackend;
use crate::discovery::{BlockId, ComponentInventory};
use crate::error::{Error, Result};
use crate::plan::{ComponentPlan, PinFallback};
use crate::source::TensorSource;
use crate::tensor::BlockLayout;
use std::collections::HashMap;

/// How the host store page-locks its buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinOptions {
    /// Page-lock at most this many bytes (`None`: no limit).
    pub budget_bytes: Option<u64>,
    /// What to do when pinning fails or the budget is spent.
    pub fallback: PinFallback,
    /// Hold the blocks coded for the device where the backend can
    /// ([`OffloadBackend::alloc_host_coded`]); else as they are, with a warning.
    pub coded: bool,
}

impl PinOptions {
    /// The host settings of a component's plan.
    pub fn from_plan(plan: &ComponentPlan) -> Self {
        PinOptions { budget_bytes: plan.host_pin_budget_bytes, fallback: plan.pin_fallback, coded: plan.coded }
    }
}

/// One block in host memory.
pub struct HostBlock<B: OffloadBackend> {
    /// Where it sits in the model.
    pub id: BlockId,
    /// Where each tensor sits in the buffer.
    pub layout: BlockLayout,
    /// The bytes.
    pub buffer: B::HostBuffer,
}

impl<B: OffloadBackend> HostBlock<B> {
    /// Buffer size in bytes.
    pub fn bytes(&self) -> usize {
        self.layout.bytes
    }
}

/// A component's weights in host memory: its blocks, and its non-block tensors
/// as one more buffer. Built once, immutable after.
pub struct HostStore<B: OffloadBackend> {
    component: String,
    blocks: Vec<HostBlock<B>>,
    non_block: Option<HostBlock<B>>,
    index: HashMap<BlockId, usize>,
    pinned_bytes: u64,
    coded_blocks: usize,
}

impl<B: OffloadBackend> HostStore<B> {
    /// Build the store of `inventory` from `source`, one block at a time: each
    /// block's tensors are read straight into its host buffer.
    pub fn build(backend: &B, inventory: &ComponentInventory, source: &dyn TensorSource) -> Result<Self> {
        Self::build_with(backend, inventory, source, PinOptions::default())
    }

    /// [`build`](Self::build) with a pin budget and a fallback to pageable memory.
    /// On any error, everything built so far is released and nothing is kept.
    pub fn build_with(backend: &B, inventory: &ComponentInventory, source: &dyn TensorSource, pin: PinOptions) -> Result<Self> {
        let pinned_left = std::cell::Cell::new(pin.budget_bytes.unwrap_or(u64::MAX));
        let pinned_bytes = std::cell::Cell::new(0u64);
        // Coded where asked and the backend can: the first refusal turns it off.
        let coding = std::cell::Cell::new(pin.coded);
        let coded_blocks = std::cell::Cell::new(0usize);
        let _span = tracing::info_span!("host_store_build", component = %inventory.name).entered();
        let by_name: HashMap<&str, usize> = source.specs().iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let load = |id: BlockId, specs: &[crate::tensor::TensorSpec]| -> Result<HostBlock<B>> {
            let layout = BlockLayout::new(specs.to_vec())?;
            let mut indices = Vec::with_capacity(specs.len());
            for (t, placed) in specs.iter().zip(&layout.tensors) {
                let i = *by_name.get(t.name.as_str()).ok_or_else(|| Error::BadTensor {
                    tensor: t.name.clone(),
                    fault: format!("the model expects it but {} lacks it", source.origin()),
                })?;
                let have = &source.specs()[i];
                if have.dtype != t.dtype || have.shape != t.shape {
                    return Err(Error::BadTensor {
                        tensor: t.name.clone(),
                        fault: format!("expected {:?} {:?}, {} has {:?} {:?}", t.dtype, t.shape, source.origin(), have.dtype, have.shape),
                    });
                }
                indices.push((i, placed.offset, placed.nbytes));
            }
            let purpose = format!("{}/{}", inventory.name, id);
            let mut fill = |dst: &mut [u8]| {
                let mut end = 0;
                for &(i, off, n) in &indices {
                    dst[end..off].fill(0);
                    source.read_into(i, &mut dst[off..off + n])?;
                    end = off + n;
                }
                Ok(())
            };
            let bytes = layout.bytes as u64;
            let pageable = |why: String, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>| {
                tracing::warn!("{purpose}: {why}; using pageable host memory (slower copies)");
                backend.alloc_host_pageable(layout.bytes, &purpose, fill)
            };
            let buffer = if bytes > pinned_left.get() {
                match pin.fallback {
                    PinFallback::Pageable => pageable(format!("pin budget spent ({} bytes left)", pinned_left.get()), &mut fill)?,
                    PinFallback::Fail => {
                        return Err(Error::HostAlloc {
                            backend: backend.name().into(),
                            requested: bytes,
                            purpose,
                            reason: format!("the plan's pin budget has {} bytes left", pinned_left.get()),
                        })
                    }
                }
            } else {
                let coded = match coding.get() {
                    false => None,
                    true => match backend.alloc_host_coded(layout.bytes, &purpose, &mut fill) {
                        Ok(b) => {
                            coded_blocks.set(coded_blocks.get() + 1);
                            Some(b)
                        }
                        Err(e @ Error::Unsupported { .. }) => {
                            tracing::warn!("{purpose}: {e}; the component's blocks are held as they are");
                            coding.set(false);
                            None
                        }
                        Err(e @ Error::HostAlloc { .. }) if pin.fallback == PinFallback::Pageable => {
                            Some(pageable(e.to_string(), &mut fill)?)
                        }
                        Err(e) => return Err(e),
                    },
                };
                match coded {
                    Some(b) => b,
                    None => match backend.alloc_host(layout.bytes, &purpose, &mut fill) {
                        Ok(b) => b,
                        Err(e @ Error::HostAlloc { .. }) if pin.fallback == PinFallback::Pageable => pageable(e.to_string(), &mut fill)?,
                        Err(e) => return Err(e),
                    },
                }
            };
            if backend.is_pinned(&buffer) {
                pinned_left.set(pinned_left.get() - bytes);
                pinned_bytes.set(pinned_bytes.get() + bytes);
            }
            Ok(HostBlock { id, layout, buffer })
        };
        let mut blocks = Vec::new();
        let mut index = HashMap::new();
        for b in inventory.blocks() {
            index.insert(b.id.clone(), blocks.len());
            blocks.push(load(b.id.clone(), &b.tensors)?);
        }
        let non_block =
            if inventory.non_block.is_empty() { None } else { Some(load(BlockId::new("<non-block>", 0), &inventory.non_block)?) };
        Ok(HostStore {
            component: inventory.name.clone(),
            blocks,
            non_block,
            index,
            pinned_bytes: pinned_bytes.get(),
            coded_blocks: coded_blocks.get(),
        })
    }

    /// Buffers made coded through [`OffloadBackend::alloc_host_coded`]
    /// ([`PinOptions::coded`]); a backend that codes every block by itself (the
    /// simulator's `SimConfig::coded`, `CudaBackend::enable_coding`) is not counted.
    pub fn coded_blocks(&self) -> usize {
        self.coded_blocks
    }

    /// Component name.
    pub fn component(&self) -> &str {
        &self.component
    }

    /// Blocks in inventory order.
    pub fn blocks(&self) -> &[HostBlock<B>] {
        &self.blocks
    }

    /// The non-block tensors, if any.
    pub fn non_block(&self) -> Option<&HostBlock<B>> {
        self.non_block.as_ref()
    }

    /// Position of block `id` in [`blocks`](Self::blocks).
    pub fn position(&self, id: &BlockId) -> Option<usize> {
        self.index.get(id).copied()
    }

    /// Host bytes held (block buffers plus the non-block buffer).
    pub fn host_bytes(&self) -> u64 {
        self.blocks.iter().chain(self.non_block.iter()).map(|b| b.bytes() as u64).sum()
    }

    /// Tensor bytes without alignment padding: the model's own size.
    pub fn payload_bytes(&self) -> u64 {
        self.blocks.iter().chain(self.non_block.iter()).map(|b| b.layout.payload_bytes() as u64).sum()
    }

    /// Whether every buffer is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.pinned_bytes == self.host_bytes()
    }

    /// Page-locked bytes.
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned_bytes
    }

    /// The largest block, in bytes.
    pub fn largest_block_bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.bytes()).max().unwrap_or(0)
    }
}

/// Host-to-device bandwidth through `backend`: every block of `store` copied once
/// into one slot on the copy stream, `passes` times; the best pass, in bytes per
/// second, timed on the host around a synchronisation (for benchmarks: it blocks).
pub fn probe_bandwidth<B: OffloadBackend>(backend: &B, store: &HostStore<B>, passes: usize) -> Result<f64> {
    let total: usize = store.blocks().iter().map(HostBlock::bytes).sum();
    let mut slot = backend.alloc_slot(store.largest_block_bytes(), "bandwidth probe")?;
    let mut best = 0.0f64;
    let result = (|| {
        for _ in 0..passes.max(1) {
            backend.synchronize()?;
            let t = std::time::Instant::now();
            for b in store.blocks() {
                backend.copy_to_slot(&b.buffer, &mut slot, b.bytes(), None)?;
            }
            backend.synchronize()?;
            best = best.max(total as f64 / t.elapsed().as_secs_f64().max(1e-9));
        }
        Ok(())
    })();
    backend.free_slot(slot, None)?;
    result.map(|()| best)
}

#[cfg(all(test, feature = "sim"))]
mod tests {
    use crate::sim::{SimBackend, SimConfig};
    use crate::{probe_bandwidth, BlockDiscovery, DType, HostStore, MemoryTensors, NameDiscovery, TensorSource, TensorSpec};

    #[test]
    fn probe_reports_a_rate_and_frees_its_slot() {
        let mut src = MemoryTensors::new();
        for i in 0..3 {
            src.push(TensorSpec::new(format!("blocks.{i}.w"), DType::U8, [4096 + i]), vec![i as u8 + 1; 4096 + i]).unwrap();
        }
        let inv = NameDiscovery.discover("m", src.specs()).unwrap();
        let be = SimBackend::new(SimConfig::fast());
        let store = HostStore::build(&be, &inv, &src).unwrap();
        let live = be.stats().live_bytes;
        let bw = probe_bandwidth(&be, &store, 2).unwrap();
        assert!(bw.is_finite() && bw > 0.0, "{bw}");
        assert_eq!(be.stats().live_bytes, live);
        assert!(be.stats().violations.is_empty(), "{:?}", be.stats().violations);
    }
}
