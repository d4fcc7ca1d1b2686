//! The host store: per block one contiguous, exactly sized, immutable buffer
//! (page-locked where the backend can), every tensor at a 256-byte-aligned offset.

use crate::backend::HostBufferOf;
use crate::backend::OffloadBackend;
use crate::coded_file::{CodedFile, NON_BLOCK};
use crate::discovery::{BlockId, ComponentInventory};
use crate::disk::DiskFile;
use crate::error::{Error, Result};
use crate::host::{HostBuffer, HostKind, HostMemory};
use crate::plan::{ComponentPlan, PinFallback};
use crate::source::{CheckpointFile, HostRegion, RegionSource, TensorSource};
use crate::tensor::{BlockLayout, PlacedTensor, TENSOR_ALIGN};
use std::collections::HashMap;
use std::sync::Arc;

/// How the host store page-locks its buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinOptions {
    /// Page-lock at most this many bytes (`None`: no limit).
    pub budget_bytes: Option<u64>,
    /// What to do when pinning fails or the budget is spent.
    pub fallback: PinFallback,
    /// Hold the blocks coded for the device where the backend can
    /// ([`HostKind::Coded`]); else as they are, with a warning.
    pub coded: bool,
}

impl PinOptions {
    /// The host settings of a component's plan.
    pub fn from_plan(plan: &ComponentPlan) -> Self {
        PinOptions { budget_bytes: plan.host_pin_budget_bytes, fallback: plan.pin_fallback, coded: plan.coded }
    }
}

/// One block of the store: in host memory, or on disk (the disk tier).
pub struct HostBlock<B: OffloadBackend> {
    /// Where it sits in the model.
    pub id: BlockId,
    /// Where each tensor sits in the buffer.
    pub layout: BlockLayout,
    held: Held<B>,
    /// Host bytes its buffer holds (a coded block's coded bytes; 0 on disk).
    held_bytes: usize,
}

/// Where a block's bytes are held.
enum Held<B: OffloadBackend> {
    /// In a host buffer of its own (or a range of a mapped region).
    Memory(HostBufferOf<B>),
    /// In the store's disk file, from this offset, laid out as `layout` says.
    Disk(u64),
}

impl<B: OffloadBackend> HostBlock<B> {
    /// Buffer size in bytes.
    pub fn bytes(&self) -> usize {
        self.layout.bytes
    }

    /// Its host buffer; `None` for a block on disk, which is read into a bounce
    /// buffer for each copy ([`HostStore::build_tiered`]).
    pub fn buffer(&self) -> Option<&HostBufferOf<B>> {
        match &self.held {
            Held::Memory(b) => Some(b),
            Held::Disk(_) => None,
        }
    }

    /// Bytes a copy of it moves across the link: its coded bytes where it is
    /// held coded, else its own bytes (from a bounce buffer for a block on disk).
    pub fn link_bytes(&self) -> usize {
        self.buffer().and_then(|b| b.held_bytes()).unwrap_or(self.layout.bytes)
    }

    /// Where its bytes start in the store's disk file, for a block on disk.
    pub fn disk_offset(&self) -> Option<u64> {
        match self.held {
            Held::Memory(_) => None,
            Held::Disk(at) => Some(at),
        }
    }
}

/// Where a store's blocks are held: served in place from a mapped checkpoint
/// ([`HostStore::build_mapped`]) or copied into buffers of the store's own.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostTier {
    /// Buffers (blocks and the non-block tensors) served from the region in place.
    pub mapped: usize,
    /// Buffers copied into memory of the store's own.
    pub copied: usize,
    /// Why buffers were copied where mapping was asked for (the first reason
    /// met): a block whose tensors do not lie in the file as the store lays them
    /// out, or a backend that cannot register the region (then every block).
    pub copy_reason: Option<String>,
    /// Seconds the build took (from its call to its return).
    pub build_s: f64,
    /// Blocks left on disk ([`HostStore::build_tiered`]), and their bytes.
    pub on_disk: usize,
    /// See [`on_disk`](Self::on_disk).
    pub disk_bytes: u64,
    /// How the backend registered the region blocks are served from
    /// ([`HostRegion::registration`]: `"read-only"`, or the fallback a driver's
    /// refusal led to); `None` where no block is served in place.
    pub registration: Option<String>,
}

/// A component's weights in host memory: its blocks, and its non-block tensors
/// as one more buffer. Built once, immutable after.
pub struct HostStore<B: OffloadBackend> {
    component: String,
    blocks: Vec<HostBlock<B>>,
    non_block: Option<HostBlock<B>>,
    index: HashMap<BlockId, usize>,
    pinned_bytes: u64,
    /// Buffers in pageable memory (the pin fallback).
    unpinned_buffers: usize,
    coded_blocks: usize,
    tier: HostTier,
    disk: Option<Arc<DiskFile>>,
    /// The region blocks are served from in place, when any is.
    region: Option<Arc<dyn HostRegion>>,
}

/// Where block `specs` would be served from in `region`: the start of its first
/// tensor and its layout relative to it, when every tensor lies at a multiple of
/// [`TENSOR_ALIGN`] from that start and the range holds nothing but the block's
/// tensors and padding (no more bytes than [`BlockLayout::new`] would use); else
/// why not.
fn placement(specs: &[crate::tensor::TensorSpec], at: &[usize]) -> std::result::Result<(usize, BlockLayout), String> {
    let start = at.iter().copied().min().ok_or("no tensors")?;
    let mut tensors = Vec::with_capacity(specs.len());
    for (spec, &a) in specs.iter().zip(at) {
        let nbytes = spec.nbytes().map_err(|e| e.to_string())?;
        let offset = a - start;
        if offset % TENSOR_ALIGN != 0 {
            return Err(format!("{} lies {offset} bytes after the block's first tensor, not a multiple of {TENSOR_ALIGN}", spec.name));
        }
        tensors.push(PlacedTensor { spec: spec.clone(), offset, nbytes });
    }
    let layout = BlockLayout::placed(tensors).map_err(|e| e.to_string())?;
    let packed = BlockLayout::new(specs.to_vec()).map_err(|e| e.to_string())?.bytes;
    if layout.bytes > packed {
        return Err(format!("its tensors span {} bytes of the file, other tensors among them ({packed} would do)", layout.bytes));
    }
    Ok((start, layout))
}

/// A checkpoint region blocks may be served from in place, with each source
/// tensor's offset in it.
type MappedRegion<'a> = (&'a Arc<dyn HostRegion>, &'a dyn Fn(usize) -> Option<usize>);
/// A file blocks may be read from at each step, each source tensor's offset in
/// it, and which blocks stay on disk.
type DiskServed<'a> = (&'a Arc<DiskFile>, &'a dyn Fn(usize) -> Option<usize>, &'a dyn Fn(&BlockId) -> bool);

/// One store build: where each block is served from and what it cost so far.
/// Mapping, coding and the pin budget change as blocks are loaded (the first
/// refusal of a region or a codec turns it off for the blocks after).
struct Build<'a, B: OffloadBackend> {
    backend: &'a B,
    host: B::Host,
    inventory: &'a ComponentInventory,
    source: &'a dyn TensorSource,
    pin: PinOptions,
    mapped: Option<MappedRegion<'a>>,
    disk: Option<DiskServed<'a>>,
    precoded: Option<(&'a CodedFile, &'a (dyn TensorSource + Sync))>,
    by_name: HashMap<&'a str, usize>,
    /// Where every tensor of the source starts in the region, in order (to find
    /// a tensor of another block lying inside a block's range).
    starts: Vec<(usize, usize)>,
    tier: std::cell::RefCell<HostTier>,
    /// Mapping is tried while it works: the first refusal of the region turns it off.
    mapping: std::cell::Cell<bool>,
    pinned_left: std::cell::Cell<u64>,
    pinned_bytes: std::cell::Cell<u64>,
    /// Serving a block in place registers the whole region page-locked
    /// (`HostRegion::registered_len`), whatever share of it the store serves:
    /// charged to the pin budget once, with the first block served.
    region_charged: std::cell::Cell<bool>,
    /// Whether any block is served in place: the store then keeps the region,
    /// to check its file at every step (page-locked or not).
    in_place: std::cell::Cell<bool>,
    unpinned_buffers: std::cell::Cell<usize>,
    /// Coded where asked and the backend can: the first refusal turns it off.
    coding: std::cell::Cell<bool>,
    coded_blocks: std::cell::Cell<usize>,
    /// The coded file's blocks' raw bytes, read to check the coded ones against.
    scratch: std::cell::RefCell<(Vec<u8>, Vec<u8>)>,
    disk_blocks: std::cell::Cell<(usize, u64)>,
}

impl<'a, B: OffloadBackend> Build<'a, B> {
    fn new(
        backend: &'a B,
        inventory: &'a ComponentInventory,
        source: &'a dyn TensorSource,
        pin: PinOptions,
        mapped: Option<MappedRegion<'a>>,
        disk: Option<DiskServed<'a>>,
        precoded: Option<(&'a CodedFile, &'a (dyn TensorSource + Sync))>,
    ) -> Self {
        let mut tier = HostTier::default();
        let mut mapping = mapped.is_some();
        // Coded blocks are held as copies; on a device that cannot decode nothing is
        // coded, and the blocks are served in place as without `coded`.
        if mapped.is_some() && pin.coded && backend.host().capabilities().coded {
            tier.copy_reason = Some("coded blocks are held as copies".into());
            mapping = false;
        }
        let offset_of: Option<&dyn Fn(usize) -> Option<usize>> = mapped.map(|m| m.1).or(disk.map(|d| d.1));
        let mut starts: Vec<(usize, usize)> = match offset_of {
            Some(offset_of) => (0..source.specs().len()).filter_map(|i| offset_of(i).map(|a| (a, i))).collect(),
            None => Vec::new(),
        };
        starts.sort_unstable();
        Build {
            backend,
            host: backend.host(),
            inventory,
            source,
            pin,
            mapped,
            disk,
            precoded,
            by_name: source.specs().iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect(),
            starts,
            tier: std::cell::RefCell::new(tier),
            mapping: std::cell::Cell::new(mapping),
            pinned_left: std::cell::Cell::new(pin.budget_bytes.unwrap_or(u64::MAX)),
            pinned_bytes: std::cell::Cell::new(0),
            region_charged: std::cell::Cell::new(false),
            in_place: std::cell::Cell::new(false),
            unpinned_buffers: std::cell::Cell::new(0),
            coding: std::cell::Cell::new(pin.coded),
            coded_blocks: std::cell::Cell::new(0),
            scratch: std::cell::RefCell::new((Vec::new(), Vec::new())),
            disk_blocks: std::cell::Cell::new((0, 0)),
        }
    }

    fn host(&self) -> &B::Host {
        &self.host
    }

    /// Why the blocks are copied rather than served in place: the first reason kept.
    fn copied(&self, why: String) {
        let mut t = self.tier.borrow_mut();
        if t.copy_reason.is_none() {
            t.copy_reason = Some(why);
        }
    }

    /// Where a block would be served from in the file, if its tensors lie there
    /// as the store lays them out and nothing else lies among them.
    fn place(
        &self,
        specs: &[crate::tensor::TensorSpec],
        indices: &[(usize, usize, usize)],
        offset_of: &dyn Fn(usize) -> Option<usize>,
    ) -> std::result::Result<(usize, BlockLayout), String> {
        let at: Vec<usize> = indices
            .iter()
            .zip(specs)
            .map(|(&(i, _, _), t)| offset_of(i).ok_or_else(|| format!("{}'s bytes are not one range of the file", t.name)))
            .collect::<std::result::Result<_, _>>()?;
        placement(specs, &at).and_then(|(start, layout)| {
            let end = start + layout.bytes;
            let from = self.starts.partition_point(|&(a, _)| a < start);
            match self.starts[from..].iter().take_while(|&&(a, _)| a < end).find(|&&(_, i)| !indices.iter().any(|&(j, _, _)| j == i)) {
                Some(&(_, i)) => Err(format!("{} lies among its tensors in the file", self.source.specs()[i].name)),
                None => Ok((start, layout)),
            }
        })
    }

    /// Block `id` (its tensors `specs`) held for the store: left on disk where the
    /// plan says, served in place from the mapped region, or copied into a host buffer.
    fn load(&self, id: BlockId, specs: &[crate::tensor::TensorSpec], is_block: bool) -> Result<HostBlock<B>> {
        let layout = BlockLayout::new(specs.to_vec())?;
        let mut indices = Vec::with_capacity(specs.len());
        for (t, placed) in specs.iter().zip(&layout.tensors) {
            indices.push((crate::source::source_index(self.source, &self.by_name, t)?, placed.offset, placed.nbytes));
        }
        let purpose = format!("{}/{}", self.inventory.name, id);
        if let (Some((_, offset_of, on_disk)), true) = (self.disk, is_block) {
            if on_disk(&id) {
                match self.place(specs, &indices, offset_of) {
                    Ok((start, layout)) => {
                        let (n, b) = self.disk_blocks.get();
                        self.disk_blocks.set((n + 1, b + layout.bytes as u64));
                        return Ok(HostBlock { id, layout, held: Held::Disk(start as u64), held_bytes: 0 });
                    }
                    // Held in memory instead, it would take host memory the plan
                    // did not count: refuse, naming the block.
                    Err(why) => {
                        return Err(Error::Plan(format!(
                            "{purpose} is planned on disk but cannot be read from {} as the store lays it out: {why} \
                             (re-pack the checkpoint, or keep the block in memory)",
                            self.source.origin()
                        )))
                    }
                }
            }
        }
        if let Some(block) = self.served_in_place(&id, specs, &indices, &purpose)? {
            return Ok(block);
        }
        self.copied_block(id, layout, &indices, purpose, is_block)
    }

    /// The block served in place from the mapped region, or `None` where it is
    /// not (no region, mapping turned off, or the block's bytes do not lie there
    /// as the store lays them out: then the reason is kept and mapping may stop).
    fn served_in_place(
        &self,
        id: &BlockId,
        specs: &[crate::tensor::TensorSpec],
        indices: &[(usize, usize, usize)],
        purpose: &str,
    ) -> Result<Option<HostBlock<B>>> {
        if let (Some((region, _)), true) = (self.mapped, self.mapping.get()) {
            // Charged only where the backend's buffers are page-locked (a CPU
            // device registers the region but locks nothing).
            let cost = if self.region_charged.get() || !self.host().capabilities().pinned { 0 } else { region.registered_len() as u64 };
            if cost > self.pinned_left.get() {
                // Registering it would pass the budget for every block alike.
                self.mapping.set(false);
                self.copied(format!(
                    "serving blocks in place page-locks the whole of {} ({cost} bytes), more than the {} bytes the pin budget has left",
                    region.origin(),
                    self.pinned_left.get()
                ));
            }
        }
        if let (Some((region, offset_of)), true) = (self.mapped, self.mapping.get()) {
            match self.place(specs, indices, offset_of) {
                Ok((start, layout)) => {
                    match self.host().alloc(HostKind::Mapped { region, offset: start }, layout.bytes, purpose, &mut |_| Ok(())) {
                        Ok(buffer) => {
                            self.tier.borrow_mut().mapped += 1;
                            self.in_place.set(true);
                            if !buffer.is_pinned() {
                                self.unpinned_buffers.set(self.unpinned_buffers.get() + 1);
                            } else if !self.region_charged.replace(true) {
                                let cost = region.registered_len() as u64;
                                self.pinned_left.set(self.pinned_left.get().saturating_sub(cost));
                                self.pinned_bytes.set(self.pinned_bytes.get() + cost);
                            }
                            let held_bytes = layout.bytes;
                            return Ok(Some(HostBlock { id: id.clone(), layout, held: Held::Memory(buffer), held_bytes }));
                        }
                        Err(e @ (Error::Unsupported { .. } | Error::HostAlloc { .. })) => {
                            tracing::warn!("{purpose}: {e}; the component's blocks are copied from {}", region.origin());
                            self.mapping.set(false);
                            self.copied(format!("the backend did not register {}: {e}", region.origin()));
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(why) => {
                    tracing::info!("{purpose}: copied, not served from {}: {why}", region.origin());
                    self.copied(format!("{purpose}: {why}"));
                }
            }
        }
        Ok(None)
    }

    /// The block copied into a host buffer: coded where coding is on, page-locked
    /// while the pin budget lasts, pageable after it where the fallback allows.
    fn copied_block(
        &self,
        id: BlockId,
        layout: BlockLayout,
        indices: &[(usize, usize, usize)],
        purpose: String,
        is_block: bool,
    ) -> Result<HostBlock<B>> {
        let mut fill = |dst: &mut [u8]| {
            let mut end = 0;
            for &(i, off, n) in indices {
                dst[end..off].fill(0);
                self.source.read_into(i, &mut dst[off..off + n])?;
                end = off + n;
            }
            Ok(())
        };
        let bytes = layout.bytes as u64;
        let pageable = |why: String, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>| {
            tracing::warn!("{purpose}: {why}; using pageable host memory (slower copies)");
            self.host().alloc(HostKind::Pageable, layout.bytes, &purpose, fill)
        };
        let mut via_coded = false;
        let buffer = if bytes > self.pinned_left.get() {
            match self.pin.fallback {
                PinFallback::Pageable => pageable(format!("pin budget spent ({} bytes left)", self.pinned_left.get()), &mut fill)?,
                PinFallback::Fail => {
                    return Err(Error::HostAlloc {
                        backend: self.backend.name().into(),
                        requested: bytes,
                        purpose,
                        reason: format!("the plan's pin budget has {} bytes left", self.pinned_left.get()),
                    })
                }
            }
        } else {
            // Coded at build, or read coded from the coded file.
            let coded_alloc = |fill: &mut dyn FnMut(&mut [u8]) -> Result<()>| match self.precoded {
                Some((cf, source)) => {
                    let key = if is_block { id.to_string() } else { NON_BLOCK.into() };
                    match cf.entry(&key) {
                        // Coding did not shrink this block: held raw from the
                        // checkpoint, as a build that codes holds it.
                        Some(e) if e.len >= layout.bytes as u64 => self.host().alloc_pinned(layout.bytes, &purpose, fill),
                        _ => precoded_buffer(self.backend, cf, key, &layout, &purpose, source, indices, &self.scratch),
                    }
                }
                None => self.host().alloc(HostKind::Coded, layout.bytes, &purpose, fill),
            };
            let coded = match self.coding.get() {
                false => None,
                true => match coded_alloc(&mut fill) {
                    Ok(b) => {
                        // A block coding would not shrink comes back raw: not counted coded.
                        via_coded = b.held_bytes().is_some();
                        Some(b)
                    }
                    Err(e @ Error::Unsupported { .. }) => {
                        tracing::warn!("{purpose}: {e}; the component's blocks are held as they are");
                        self.coding.set(false);
                        None
                    }
                    Err(e @ Error::HostAlloc { .. }) if self.pin.fallback == PinFallback::Pageable => {
                        Some(pageable(e.to_string(), &mut fill)?)
                    }
                    Err(e) => return Err(e),
                },
            };
            match coded {
                Some(b) => b,
                None => match self.host().alloc_pinned(layout.bytes, &purpose, &mut fill) {
                    Ok(b) => b,
                    Err(e @ Error::HostAlloc { .. }) if self.pin.fallback == PinFallback::Pageable => pageable(e.to_string(), &mut fill)?,
                    Err(e) => return Err(e),
                },
            }
        };
        // A coded block holds its coded bytes: those are what is page-locked. The
        // budget was checked against the block's size; a coded block can hold
        // more (its headers, incompressible strings kept raw): then it is
        // dropped and the block held as the fallback says, so the budget holds.
        if crate::sabotage::keeps_second_copy() && buffer.is_pinned() {
            // The deliberate break: a second page-locked copy of the block, never given back.
            std::mem::forget(self.host().alloc_pinned(layout.bytes, &purpose, &mut |_| Ok(()))?);
        }
        let mut buffer = buffer;
        let mut held_bytes = buffer.held_bytes().unwrap_or(layout.bytes);
        if buffer.is_pinned() && held_bytes as u64 > self.pinned_left.get() {
            let why = format!("coded as {held_bytes} bytes, over the {} the pin budget has left", self.pinned_left.get());
            drop(buffer);
            buffer = match self.pin.fallback {
                PinFallback::Pageable => pageable(why, &mut fill)?,
                PinFallback::Fail => {
                    return Err(Error::HostAlloc {
                        backend: self.backend.name().into(),
                        requested: held_bytes as u64,
                        purpose,
                        reason: why,
                    })
                }
            };
            held_bytes = buffer.held_bytes().unwrap_or(layout.bytes);
            via_coded = false;
        }
        self.coded_blocks.set(self.coded_blocks.get() + usize::from(via_coded));
        if buffer.is_pinned() {
            self.pinned_left.set(self.pinned_left.get() - held_bytes as u64);
            self.pinned_bytes.set(self.pinned_bytes.get() + held_bytes as u64);
        } else {
            self.unpinned_buffers.set(self.unpinned_buffers.get() + 1);
        }
        Ok(HostBlock { id, layout, held: Held::Memory(buffer), held_bytes })
    }
}

/// A coded host buffer of the block laid out as `layout`, its coded bytes read
/// from `cf`'s entry `key` and checked there, then against the block's bytes,
/// read from `source` (tensors at `indices`: source index, offset, length) into
/// `scratch` while the coded bytes are read, each on several threads: first by
/// the hashes the coded segments store of the bytes they were made from (a file
/// made from other weights), then by decoding them on the host, as the device
/// will, and comparing every byte (coded bytes altered with their file's own
/// hashes made to hold: the device's decoder checks no hash).
#[allow(clippy::too_many_arguments)]
fn precoded_buffer<B: OffloadBackend>(
    backend: &B,
    cf: &CodedFile,
    key: String,
    layout: &BlockLayout,
    purpose: &str,
    source: &(dyn TensorSource + Sync),
    indices: &[(usize, usize, usize)],
    scratch: &std::cell::RefCell<(Vec<u8>, Vec<u8>)>,
) -> Result<HostBufferOf<B>> {
    let fault = |f: String| Error::CodedFile { path: cf.path().to_path_buf(), block: purpose.to_owned(), fault: f };
    let entry = cf.entry(&key).ok_or_else(|| fault(format!("no entry {key:?} (written for another model?)")))?;
    if entry.raw_bytes != layout.bytes as u64 {
        return Err(fault(format!("coded from {} bytes; the store lays the block out in {}", entry.raw_bytes, layout.bytes)));
    }
    let coded_len = usize::try_from(entry.len).map_err(|_| fault(format!("{} coded bytes do not fit this machine", entry.len)))?;
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    backend.host().alloc(HostKind::Precoded { coded_len }, layout.bytes, purpose, &mut |dst| {
        let mut scratch = scratch.borrow_mut();
        let (raw, decoded) = &mut *scratch;
        // Kept across blocks: only grown, every byte below written again here.
        if raw.len() < layout.bytes {
            raw.resize(layout.bytes, 0);
            decoded.resize(layout.bytes, 0);
        }
        let (raw, decoded) = (&mut raw[..layout.bytes], &mut decoded[..layout.bytes]);
        let (coded, laid) = std::thread::scope(|scope| {
            let coded = scope.spawn(|| cf.read_entry(entry, dst, threads));
            let laid = read_laid_out(source, indices, raw, threads);
            // A reading thread that panicked takes the caller down with it.
            (coded.join().unwrap_or_else(|e| std::panic::resume_unwind(e)), laid)
        });
        coded?;
        laid?;
        crate::codec::coded_matches(dst, raw, threads, purpose).map_err(|e| {
            fault(format!("{e}: the file was made from other weights than {}, or they changed since (write it again)", source.origin()))
        })?;
        if crate::sabotage::trusts_coded() {
            return Ok(());
        }
        crate::codec::decode_device_block_on(dst, decoded, threads, purpose)
            .map_err(|e| fault(format!("{e}: its coded bytes are damaged or altered (write it again)")))?;
        match decoded.iter().zip(raw.iter()).position(|(d, r)| d != r) {
            Some(at) => Err(fault(format!(
                "its coded bytes decode to other bytes than {}'s (the first at byte {at} of the block): damaged or altered (write it again)",
                source.origin()
            ))),
            None => Ok(()),
        }
    })
}

/// A block's bytes as the store lays them out, into `dst` (its exact size): the
/// tensors at `indices` (source index, offset, length; offsets ascending) read
/// from `source` on up to `threads` threads (the largest first, each to the
/// thread with the fewest bytes so far), the gaps between and after them zeroed.
fn read_laid_out(source: &(dyn TensorSource + Sync), indices: &[(usize, usize, usize)], dst: &mut [u8], threads: usize) -> Result<()> {
    let mut parts: Vec<(usize, &mut [u8])> = Vec::with_capacity(indices.len());
    let (mut rest, mut at) = (dst, 0usize);
    for &(i, off, n) in indices {
        let (gap, tail) = std::mem::take(&mut rest).split_at_mut(off - at);
        gap.fill(0);
        let (tensor, tail) = tail.split_at_mut(n);
        parts.push((i, tensor));
        (rest, at) = (tail, off + n);
    }
    rest.fill(0);
    parts.sort_by_key(|p| std::cmp::Reverse(p.1.len()));
    /// A thread's share: its bytes, and its tensors (source index, destination).
    type Bin<'a> = (usize, Vec<(usize, &'a mut [u8])>);
    let mut bins: Vec<Bin> = (0..threads.clamp(1, parts.len().max(1))).map(|_| (0, Vec::new())).collect();
    for p in parts {
        if let Some(bin) = bins.iter_mut().min_by_key(|b| b.0) {
            bin.0 += p.1.len();
            bin.1.push(p);
        }
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> =
            bins.into_iter().map(|(_, bin)| scope.spawn(move || bin.into_iter().try_for_each(|(i, t)| source.read_into(i, t)))).collect();
        // A reading thread that panicked takes the caller down with it.
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect::<Result<Vec<()>>>().map(|_| ())
    })
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
        Self::build_inner(backend, inventory, source, pin, None, None, None)
    }

    /// Build a coded store of `inventory` from the coded bytes a
    /// [`CodedFile`] holds (written ahead of time by [`CodedFile::write`]),
    /// instead of coding each block at build ([`PinOptions::coded`], which this
    /// implies): a coded start in the time it takes to read and hash the
    /// checkpoint and the coded file, not to code the model. Each block's coded
    /// bytes are checked against the file's own hashes of them, and against the
    /// checkpoint's bytes as the store lays them out ([`crate::codec::coded_matches`]);
    /// a block the file lacks, damaged, or made from other weights is an
    /// [`Error::CodedFile`] naming the file and the block, and nothing is kept.
    /// A backend that cannot decode holds the blocks as they are, as with
    /// [`PinOptions::coded`].
    pub fn build_from_coded_file(
        backend: &B,
        inventory: &ComponentInventory,
        source: &(dyn TensorSource + Sync),
        pin: PinOptions,
        coded: &CodedFile,
    ) -> Result<Self> {
        if coded.component() != inventory.name {
            return Err(Error::CodedFile {
                path: coded.path().to_path_buf(),
                block: String::new(),
                fault: format!("written for component {:?}, not {:?}", coded.component(), inventory.name),
            });
        }
        // Every buffer's entry, checked before any is read, whatever the backend.
        let blocks = inventory.blocks().map(|b| (b.id.to_string(), b.tensors.as_slice()));
        let non_block = (!inventory.non_block.is_empty()).then(|| (NON_BLOCK.to_string(), inventory.non_block.as_slice()));
        for (key, specs) in blocks.chain(non_block) {
            let fault =
                |f: String| Error::CodedFile { path: coded.path().to_path_buf(), block: format!("{}/{key}", inventory.name), fault: f };
            let entry = coded.entry(&key).ok_or_else(|| fault(format!("no entry {key:?} (written for another model?)")))?;
            let bytes = BlockLayout::new(specs.to_vec())?.bytes;
            if entry.raw_bytes != bytes as u64 {
                return Err(fault(format!("coded from {} bytes; the store lays the block out in {bytes}", entry.raw_bytes)));
            }
        }
        Self::build_inner(backend, inventory, source, PinOptions { coded: true, ..pin }, None, None, Some((coded, source)))
    }

    /// Build the store of `inventory` serving each block in place from `source`'s
    /// region (a checkpoint mapped by the backend, e.g.
    /// `offload_cuda::map_checkpoint`): no copy of the model in host memory, a
    /// start in the time it takes to register the region. The region is checked
    /// first (the same file, length and modification time as when opened: a
    /// truncated or replaced file is an error naming it). A block whose tensors do
    /// not lie in the file as the store lays them out (each one range of it, at a
    /// multiple of [`TENSOR_ALIGN`] from the block's first, spanning no more than
    /// the store's layout, nothing the store reads between) is copied,
    /// as [`build_with`](Self::build_with) would; so is every block when the
    /// backend cannot register the region, or when `pin.coded` (coded blocks are
    /// copies by nature). [`tier`](Self::tier) says which and why.
    pub fn build_mapped<S: RegionSource>(backend: &B, inventory: &ComponentInventory, source: &S, pin: PinOptions) -> Result<Self> {
        let region = source.region();
        region.check()?;
        let offset = |i: usize| source.tensor_offset(i);
        Self::build_inner(backend, inventory, source, pin, Some((&region, &offset)), None, None)
    }

    /// Build the store of `inventory` from the checkpoint `file` (safetensors or
    /// GGUF: [`CheckpointFile`]), keeping in host memory only the blocks for which `on_disk` is false (the disk tier: host
    /// memory smaller than the model). A block on disk has no host buffer: a ring
    /// reads it from the file for each copy, into a few page-locked bounce
    /// buffers it holds, on reader threads, ahead of need (`O_DIRECT` where the
    /// file system allows). Its tensors must lie in the file as the store lays
    /// them out (each one range of it, at a multiple of [`TENSOR_ALIGN`] from the
    /// block's first, spanning no more than the store's layout, nothing the store
    /// reads between): a block on disk that does not is an error naming it
    /// (held in memory it would exceed the plan's host memory). The file must be
    /// the one `file`'s header was read from. The non-block tensors are always
    /// held in memory. The plan's choice is [`ResolvedComponent::is_on_disk`](crate::plan::ResolvedComponent::is_on_disk).
    pub fn build_tiered<F: CheckpointFile>(
        backend: &B,
        inventory: &ComponentInventory,
        file: &F,
        pin: PinOptions,
        on_disk: &dyn Fn(&BlockId) -> bool,
    ) -> Result<Self> {
        let disk = Arc::new(DiskFile::open_expecting(file.file_path(), file.opened_identity())?);
        let offset = |i: usize| file.tensor_offset(i);
        Self::build_inner(backend, inventory, file, pin, None, Some((&disk, &offset, on_disk)), None)
    }

    fn build_inner(
        backend: &B,
        inventory: &ComponentInventory,
        source: &dyn TensorSource,
        pin: PinOptions,
        mapped: Option<MappedRegion<'_>>,
        disk: Option<DiskServed<'_>>,
        precoded: Option<(&CodedFile, &(dyn TensorSource + Sync))>,
    ) -> Result<Self> {
        let t0 = std::time::Instant::now();
        let _span = tracing::info_span!("host_store_build", component = %inventory.name).entered();
        let build = Build::new(backend, inventory, source, pin, mapped, disk, precoded);
        let mut blocks = Vec::new();
        let mut index = HashMap::new();
        for b in inventory.blocks() {
            index.insert(b.id.clone(), blocks.len());
            blocks.push(build.load(b.id.clone(), &b.tensors, true)?);
        }
        let non_block = if inventory.non_block.is_empty() {
            None
        } else {
            Some(build.load(BlockId::new("<non-block>", 0), &inventory.non_block, false)?)
        };
        let mut tier = build.tier.into_inner();
        tier.registration = mapped.filter(|_| build.region_charged.get()).and_then(|m| m.0.registration());
        (tier.on_disk, tier.disk_bytes) = build.disk_blocks.get();
        tier.copied = blocks.len() + usize::from(non_block.is_some()) - tier.mapped - tier.on_disk;
        tier.build_s = t0.elapsed().as_secs_f64();
        Ok(HostStore {
            component: inventory.name.clone(),
            blocks,
            non_block,
            index,
            pinned_bytes: build.pinned_bytes.get(),
            unpinned_buffers: build.unpinned_buffers.get(),
            coded_blocks: build.coded_blocks.get(),
            region: mapped.filter(|_| build.in_place.get()).map(|m| m.0.clone()),
            tier,
            disk: disk.map(|d| d.0.clone()),
        })
    }

    /// Whether the files this store reads during a step still hold the bytes it
    /// was built from: the mapped checkpoint blocks are served from in place
    /// ([`build_mapped`](Self::build_mapped)) and the file blocks on disk are
    /// read from ([`build_tiered`](Self::build_tiered)): same file, length,
    /// modification and change times ([`FileIdentity`](crate::source::FileIdentity)).
    /// A mapped checkpoint whose path names another file since (a new file
    /// renamed over it) still serves the opened one, unlinked and unchanged
    /// ([`HostRegion::held`](crate::source::HostRegion::held)), as a resident module
    /// keeps the weights it loaded; one written in place is refused.
    /// A [`Ring`](crate::ring::Ring) asks at every step boundary and refuses every later
    /// step when the answer is an error, which names the file. Blocks copied into
    /// the store's own memory do not depend on the file after the build and are
    /// not checked. Costs a `stat` or two, no reads.
    pub fn check_sources(&self) -> Result<()> {
        if let Some(r) = &self.region {
            r.held()?;
        }
        if let Some(d) = &self.disk {
            d.check()?;
        }
        Ok(())
    }

    /// Where the blocks are held, and how long the build took.
    pub fn tier(&self) -> &HostTier {
        &self.tier
    }

    /// Buffers made coded through [`HostKind::Coded`]
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

    /// Host bytes held (block buffers plus the non-block buffer, a coded block
    /// at its coded size; blocks on disk are not counted).
    pub fn host_bytes(&self) -> u64 {
        self.blocks.iter().chain(self.non_block.iter()).map(|b| b.held_bytes as u64).sum()
    }

    /// The file blocks on disk are read from ([`build_tiered`](Self::build_tiered)).
    pub fn disk_file(&self) -> Option<&Arc<DiskFile>> {
        self.disk.as_ref()
    }

    /// Bytes of the blocks on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.tier.disk_bytes
    }

    /// Run `f` with `block`'s bytes in a host buffer: its own for a block in
    /// memory, else a new one (page-locked where the backend can) read from the
    /// disk file now and dropped after `f`: for a one-off copy (a block kept on
    /// the device, an on-demand load) or a check, never for streaming.
    pub fn with_buffer<T>(&self, backend: &B, block: &HostBlock<B>, f: impl FnOnce(&HostBufferOf<B>) -> Result<T>) -> Result<T> {
        match (&block.held, &self.disk) {
            (Held::Memory(b), _) => f(b),
            (Held::Disk(at), Some(file)) => {
                let what = format!("{}/{}", self.component, block.id);
                let buffer = backend.host().alloc_pinned(block.bytes(), &what, &mut |dst| file.read_block(*at, dst.len(), dst, &what))?;
                f(&buffer)
            }
            (Held::Disk(_), None) => Err(Error::Protocol(format!("{}/{} is on disk but the store has no file", self.component, block.id))),
        }
    }

    /// Bytes of every block and of the non-block tensors as laid out (with their
    /// alignment padding), on disk or in memory, coded or not: what a device copy
    /// of the whole component holds.
    pub fn laid_out_bytes(&self) -> u64 {
        self.blocks.iter().chain(self.non_block.iter()).map(|b| b.bytes() as u64).sum()
    }

    /// Tensor bytes without alignment padding: the model's own size.
    pub fn payload_bytes(&self) -> u64 {
        self.blocks.iter().chain(self.non_block.iter()).map(|b| b.layout.payload_bytes() as u64).sum()
    }

    /// Whether every buffer is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.unpinned_buffers == 0
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

/// Host-to-device bandwidth through `backend`: every block of `store` held in
/// memory copied once into one slot on the copy stream, `passes` times; the
/// best pass, in bytes on the link per second (a coded block counts its coded
/// bytes, [`HostBlock::link_bytes`], so `link bytes / bandwidth` is a copy's
/// time on a coded store too), timed on the host around a synchronisation (for
/// benchmarks: it blocks).
pub fn probe_bandwidth<B: OffloadBackend>(backend: &B, store: &HostStore<B>, passes: usize) -> Result<f64> {
    let total = probe_bytes(store);
    if total == 0 {
        // A rate of 0 would plan every streamed block as taking forever.
        return Err(crate::error::Error::Plan("probing the bandwidth: no block is held in host memory (all on disk, or none)".into()));
    }
    let mut slot = backend.alloc_slot(store.largest_block_bytes(), "bandwidth probe")?;
    let mut best = 0.0f64;
    let result = (|| {
        for _ in 0..passes.max(1) {
            backend.synchronize()?;
            let t = std::time::Instant::now();
            for b in store.blocks() {
                if let Some(buffer) = b.buffer() {
                    backend.copy_to_slot(buffer, &mut slot, b.bytes(), None)?;
                }
            }
            backend.synchronize()?;
            best = best.max(total as f64 / t.elapsed().as_secs_f64().max(1e-9));
        }
        Ok(())
    })();
    backend.free_slot(slot, None)?;
    result.map(|()| best)
}

/// The bytes one pass of [`probe_bandwidth`] moves across the link.
fn probe_bytes<B: OffloadBackend>(store: &HostStore<B>) -> usize {
    store.blocks().iter().filter(|b| b.buffer().is_some()).map(HostBlock::link_bytes).sum()
}

#[cfg(all(test, feature = "sim"))]
mod tests;
