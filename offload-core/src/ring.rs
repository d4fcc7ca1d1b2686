//! The ring scheduler, generic over the backend.
//!
//! `d + 1` slots, each the size of the largest streamed block. When block `b` is
//! asked for, the ring makes sure `b` is in a slot (a prefetch hit, or a miss
//! fetched on demand), issues copies of the next `d` blocks of the learned order
//! into the other slots — each copy waiting on the event recorded after the slot's
//! previous block ran — and makes the compute stream wait for `b`'s copy. Dropping
//! the [`BlockGuard`] records the event that frees `b`'s slot. A guard that is
//! never dropped (`mem::forget`) is released by the ring itself at the next
//! `block`, `end_step` or `close`, and counted (`StepMetrics::forgotten_guards`).
//!
//! The order is learned: for every block the ring remembers which block was asked
//! for after it last time (initially the declaration order, wrapping from the last
//! block to the first). A request the order did not predict is a miss: served
//! correctly, counted, and the order updated (a retrace). Each pass (forward,
//! backward) learns its own order, and which pass follows it (where the same
//! one did twice in a row): at the turn of a training step the blocks copied
//! ahead are the next pass's.

use crate::backend::{OffloadBackend, StreamKind};
use crate::discovery::BlockId;
use crate::error::{Error, Result};
use crate::hook::{BlockContext, BlockSource, Hook};
use crate::host::{HostBuffer, HostMemory};
use crate::metrics::StepMetrics;
use crate::plan::{ResolvedComponent, Strategy};
use crate::sabotage::Sabotage;
use crate::store::HostStore;
use crate::tensor::BlockLayout;

mod depth;
mod guard;
mod passes;
mod trace;

pub use guard::BlockGuard;
use std::sync::Arc;
use std::time::Instant;
use trace::{PendingSpan, TimelineState};

struct SlotState<B: OffloadBackend> {
    slot: B::Slot,
    holds: Option<usize>,
    ready: Option<B::Event>,
    free_after: Option<B::Event>,
    stamp: u64,
    /// Bytes read from disk for the block it holds, not yet counted: a step
    /// counts them when it first serves that block.
    unserved_read: u64,
    /// Whether the block it holds was served since its copy: one overwritten
    /// unserved was a wasted prefetch (a block the model skipped).
    served: bool,
    /// The block whose release `free_after` is (for the timeline).
    released_by: Option<usize>,
}

/// The block handed out and not yet released.
#[derive(Clone, Copy)]
struct Lent {
    block: usize,
    loc: Loc,
    source: BlockSource,
}

#[derive(Clone, Copy)]
enum Loc {
    Stream(usize),
    Resident(usize),
}

/// A component's blocks streaming through `d + 1` device slots.
pub struct Ring<B: OffloadBackend> {
    backend: B,
    store: Arc<HostStore<B>>,
    depth: usize,
    slots: Vec<SlotState<B>>,
    resident: Vec<(usize, B::Slot, B::Wait)>,
    resident_of: Vec<Option<usize>>,
    /// Blocks the caller holds on the device itself from now on
    /// ([`hold_outside`](Self::hold_outside)): never prefetched again.
    outside: Vec<bool>,
    /// A block is lent to be kept ([`Ring::lend_to_keep`]): nothing is copied ahead of it.
    keeping: bool,
    non_block: Option<(B::Slot, B::Wait)>,
    lent: Option<Lent>,
    /// A block a refused request fetched on demand before failing: still in its
    /// slot and counted as the miss it was, so its retry counts no prefetch hit.
    fetched_on_demand: Option<usize>,
    broken: Option<String>,
    next: Vec<usize>,
    /// The order of the other pass (the backward's while the forward runs, and
    /// the other way round): each pass learns its own ([`Ring::set_backward`]).
    other_next: Vec<usize>,
    /// Whether the blocks are asked for by a backward pass now.
    backward: bool,
    /// The first block each pass asked for last time (forward, backward).
    first: [Option<usize>; 2],
    /// For each pass (forward, backward), the pass that follows its end,
    /// where the last two ends were followed by the same one (`Some(true)`: a
    /// backward); `None` before that, or while they alternate (gradient
    /// accumulation's forward, forward, backward): at a pass's last block the
    /// ring then copies ahead the blocks of the pass that comes next (a
    /// training step turns from the forward's last block to the backward's,
    /// which are still in their slots).
    follows: [Option<bool>; 2],
    /// The pass that followed each pass's last end.
    followed: [Option<bool>; 2],
    /// The block each pass ended with last time.
    last: [Option<usize>; 2],
    /// The pass whose step just ended, until the next pass shows itself.
    ended: Option<bool>,
    prev: Option<usize>,
    clock: u64,
    hooks: Vec<Box<dyn Hook>>,
    step: StepMetrics,
    total: StepMetrics,
    sticky: Option<Error>,
    sabotage: Sabotage,
    closed: bool,
    timeline: Option<TimelineState<B>>,
    step_started: Instant,
    /// Reads of the blocks on disk (a store built by `HostStore::build_tiered`).
    disk: Option<crate::disk::DiskStream<B>>,
    /// The plan the ring was built from ([`Ring::at_depth`] builds another from it).
    plan: ResolvedComponent,
}

/// A plan that leaves blocks on disk, or has a host RAM budget, counts its host
/// memory with exactly its blocks on disk there: a store that holds them
/// otherwise would pass the budget unseen. (Without either, the store's tiers
/// are the caller's to choose.)
pub(crate) fn check_disk_split<B: OffloadBackend>(store: &HostStore<B>, plan: &ResolvedComponent) -> Result<()> {
    if plan.on_disk.is_empty() && plan.host_ram_budget.is_none() {
        return Ok(());
    }
    let Some(b) = store.blocks().iter().find(|b| plan.is_on_disk(&b.id) != b.disk_offset().is_some()) else { return Ok(()) };
    let (plan_has, store_has) = match plan.is_on_disk(&b.id) {
        true => ("on disk", "in memory"),
        false => ("in memory", "on disk"),
    };
    Err(Error::Plan(format!(
        "component {:?}: the plan holds block {} {plan_has}, the store {store_has} (build the store with \
         HostStore::build_tiered and the plan's is_on_disk)",
        plan.name, b.id
    )))
}

/// A plan's page-locked host budget, with what the ring page-locks beside the
/// store: the disk tier's bounce buffers (`d + 2` of the largest streamed block
/// on disk), or before them the one-off buffer a resident block on disk is
/// loaded through. The store charged its own buffers at build.
fn check_pin_budget<B: OffloadBackend>(store: &HostStore<B>, plan: &ResolvedComponent) -> Result<()> {
    let Some(budget) = plan.pin_budget else { return Ok(()) };
    let on_disk = store.blocks().iter().filter(|b| b.disk_offset().is_some());
    let (mut streamed, mut once) = (None::<usize>, 0);
    for b in on_disk {
        match plan.is_resident(&b.id) {
            true => once = once.max(b.bytes()),
            false => streamed = streamed.max(Some(b.bytes())),
        }
    }
    let bounce = streamed.map_or(0, |b| ((plan.depth + 2) * crate::disk::DiskFile::span(b)) as u64);
    let need = store.pinned_bytes().saturating_add(bounce.max(once as u64));
    if need > budget {
        return Err(Error::Plan(format!(
            "component {:?}: host pin budget {budget} bytes is below what the ring page-locks: {need} bytes \
             (the store's {} + the disk tier's {})",
            plan.name,
            store.pinned_bytes(),
            match bounce >= once as u64 {
                true => format!("{} bounce buffers, {bounce} bytes", plan.depth + 2),
                false => format!("one-off buffer for a resident block, {once} bytes"),
            }
        )));
    }
    Ok(())
}

/// A plan's device budget against what this store makes the ring hold. The
/// plan bounds the slots, resident blocks and non-block tensors from the
/// inventory it was resolved against; the store adds what its blocks and
/// non-block tensors outgrew (a plan resolved against another inventory with
/// the same block names, a file's layout padding a block more) and, where it
/// holds blocks coded for the device, the decoder's staging buffers (resident
/// blocks go through them too). The error names what outgrew the plan, or the
/// staging.
pub(crate) fn check_device_budget<B: OffloadBackend>(backend: &B, store: &HostStore<B>, plan: &ResolvedComponent) -> Result<()> {
    let Some(budget) = plan.budget else { return Ok(()) };
    let planned: std::collections::HashMap<&BlockId, usize> = plan.blocks.iter().map(|(id, b)| (id, *b)).collect();
    let bound = |size: &dyn Fn(&BlockId, usize) -> usize| -> u64 {
        let sizes = store.blocks().iter().map(|b| (&b.id, size(&b.id, b.bytes())));
        let (resident, streamed): (Vec<_>, Vec<_>) = sizes.partition(|(id, _)| plan.is_resident(id));
        let resident: u64 = resident.iter().map(|(_, b)| *b as u64).sum();
        let largest = streamed.iter().map(|(_, b)| *b as u64).max().unwrap_or(0);
        match plan.strategy {
            Strategy::Layerwise => (plan.depth as u64 + 1).saturating_mul(largest).saturating_add(resident),
            _ => resident + streamed.iter().map(|(_, b)| *b as u64).sum::<u64>(),
        }
    };
    let held = bound(&|_, bytes| bytes);
    let was = bound(&|id, bytes| planned.get(id).copied().unwrap_or(bytes));
    let non_block = store.non_block().map_or(0, |b| b.bytes() as u64);
    let grown = held.saturating_sub(was).saturating_add(non_block.saturating_sub(plan.non_block_bytes));
    let coded = store.blocks().iter().chain(store.non_block()).filter_map(|b| b.buffer().and_then(|buf| buf.held_bytes()));
    let largest_coded = coded.max();
    let staging = largest_coded.map_or(0, |c| backend.host().decoder_staging_bytes(c));
    let need = plan.device_weight_bound.saturating_add(grown).saturating_add(staging);
    if need <= budget {
        return Ok(());
    }
    let with_staging = match largest_coded {
        Some(c) => format!(" + {staging} for the decoder's staging buffers, for coded blocks of up to {c} bytes"),
        None => String::new(),
    };
    if grown == 0 {
        return Err(Error::Plan(format!(
            "component {:?}: device budget {budget} bytes is below what the plan needs{}: {need} bytes ({} for the weights{with_staging})",
            plan.name,
            if largest_coded.is_some() { " with its blocks coded" } else { "" },
            plan.device_weight_bound
        )));
    }
    // What outgrew the plan: the first larger block, else the non-block tensors.
    let larger = store.blocks().iter().find(|b| planned.get(&b.id).is_some_and(|&p| b.bytes() > p));
    let what = match larger {
        Some(b) => format!("block {} holds {} bytes, planned {}", b.id, b.bytes(), planned[&b.id]),
        None => format!("its non-block tensors hold {non_block} bytes, planned {}", plan.non_block_bytes),
    };
    Err(Error::Plan(format!(
        "component {:?}: the store is larger than what the plan was resolved against ({what}): the ring would hold \
         {need} device bytes ({} planned + {grown} grown{with_staging}), over the budget of {budget} (resolve the plan \
         against the store's own inventory)",
        plan.name, plan.device_weight_bound
    )))
}

impl<B: OffloadBackend> Ring<B> {
    /// Build the ring of one component: allocate its slots, copy its resident
    /// blocks and non-block tensors, and start prefetching the first blocks.
    ///
    /// Transactional: on any error every slot allocated so far is released and the
    /// host store is untouched.
    pub fn new(backend: B, store: Arc<HostStore<B>>, plan: &ResolvedComponent) -> Result<Self> {
        Self::build(backend, store, plan, Sabotage::None)
    }

    /// [`Ring::new`] with a deliberate protocol break (tests only).
    #[cfg(feature = "sabotage")]
    #[doc(hidden)]
    pub fn with_sabotage(backend: B, store: Arc<HostStore<B>>, plan: &ResolvedComponent, sabotage: Sabotage) -> Result<Self> {
        Self::build(backend, store, plan, sabotage)
    }

    /// Whether break `s` is set: always `false` without the `sabotage` feature.
    #[inline]
    fn breaks(&self, s: Sabotage) -> bool {
        cfg!(feature = "sabotage") && self.sabotage == s
    }

    fn build(backend: B, store: Arc<HostStore<B>>, plan: &ResolvedComponent, sabotage: Sabotage) -> Result<Self> {
        let _span = tracing::info_span!("ring_new", component = %plan.name, depth = plan.depth).entered();
        if plan.strategy == Strategy::OnDemand {
            return Err(Error::Plan(format!("component {:?} is planned on demand: load it with OnDemand, not a Ring", plan.name)));
        }
        if plan.name != store.component() {
            return Err(Error::Plan(format!("plan is for component {:?}, store holds {:?}", plan.name, store.component())));
        }
        if !(1..=crate::plan::MAX_PREFETCH_DEPTH).contains(&plan.depth) {
            // A plan resolves only depths in range; one deserialized or built by hand may not.
            return Err(Error::Plan(format!(
                "component {:?}: prefetch depth {} must be 1 to {}",
                plan.name,
                plan.depth,
                crate::plan::MAX_PREFETCH_DEPTH
            )));
        }
        // The plan was resolved against these blocks, not another inventory's (a
        // resident block the store lacks would otherwise be streamed, silently).
        let held: std::collections::HashSet<&BlockId> = store.blocks().iter().map(|b| &b.id).collect();
        let planned: std::collections::HashSet<&BlockId> = plan.blocks.iter().map(|(id, _)| id).collect();
        if let Some(id) = plan.resident.iter().chain(&plan.on_disk).chain(planned.iter().copied()).find(|id| !held.contains(id)) {
            return Err(Error::Plan(format!("component {:?}: the plan names block {id}, which the store does not hold", plan.name)));
        }
        if let Some(id) = held.iter().find(|id| !planned.contains(*id)) {
            return Err(Error::Plan(format!("component {:?}: the store holds block {id}, which the plan does not name", plan.name)));
        }
        check_device_budget(&backend, &store, plan)?;
        check_disk_split(&store, plan)?;
        check_pin_budget(&store, plan)?;
        let n = store.blocks().len();
        let mut resident_of = vec![None; n];
        let mut ring = Ring {
            backend,
            store: store.clone(),
            depth: plan.depth,
            slots: Vec::new(),
            resident: Vec::new(),
            resident_of: Vec::new(),
            outside: Vec::new(),
            keeping: false,
            non_block: None,
            lent: None,
            fetched_on_demand: None,
            broken: None,
            next: (0..n).map(|i| (i + 1) % n.max(1)).collect(),
            other_next: (0..n).map(|i| (i + n.max(1) - 1) % n.max(1)).collect(),
            backward: false,
            first: [None, None],
            follows: [None, None],
            followed: [None, None],
            last: [None, None],
            ended: None,
            prev: None,
            clock: 0,
            hooks: Vec::new(),
            step: StepMetrics { component: plan.name.clone(), host_bytes: store.host_bytes(), ..Default::default() },
            total: StepMetrics::default(),
            sticky: None,
            sabotage,
            closed: false,
            timeline: None,
            step_started: Instant::now(),
            disk: None,
            plan: plan.clone(),
        };
        ring.step.host_pinned_bytes = store.pinned_bytes();
        let result = (|| {
            for (i, b) in store.blocks().iter().enumerate() {
                if plan.is_resident(&b.id) {
                    let purpose = format!("{}/{} (resident)", plan.name, b.id);
                    let be = ring.backend.clone();
                    let (slot, wait) = store.with_buffer(&be, b, |buffer| ring.load_whole(buffer, b.bytes(), &purpose))?;
                    resident_of[i] = Some(ring.resident.len());
                    ring.resident.push((i, slot, wait));
                }
            }
            if let Some(nb) = store.non_block() {
                let be = ring.backend.clone();
                let purpose = format!("{}/non-block tensors", plan.name);
                ring.non_block = Some(store.with_buffer(&be, nb, |buffer| ring.load_whole(buffer, nb.bytes(), &purpose))?);
            }
            ring.resident_of = resident_of;
            let streamed = ring.resident_of.iter().filter(|r| r.is_none()).count();
            let largest = store
                .blocks()
                .iter()
                .enumerate()
                .filter(|(i, _)| ring.resident_of[*i].is_none())
                .map(|(_, b)| b.bytes())
                .max()
                .unwrap_or(0);
            let mut count = (ring.depth + 1).min(streamed);
            if ring.breaks(Sabotage::ExtraSlot) {
                count += 1;
            }
            for k in 0..count {
                let slot = ring.alloc(largest, &format!("{}/slot {k}", plan.name))?;
                ring.slots.push(SlotState {
                    slot,
                    holds: None,
                    ready: None,
                    free_after: None,
                    stamp: 0,
                    unserved_read: 0,
                    served: false,
                    released_by: None,
                });
            }
            let on_disk = store
                .blocks()
                .iter()
                .enumerate()
                .filter(|(i, b)| ring.resident_of[*i].is_none() && b.disk_offset().is_some())
                .map(|(_, b)| b.bytes())
                .max();
            if let (Some(bytes), Some(file)) = (on_disk, store.disk_file()) {
                // A bounce buffer for each block in flight, one being read ahead, one
                // being copied from: d + 2, read by DISK_READERS threads.
                let count = ring.depth + 2;
                let span = crate::disk::DiskFile::span(bytes);
                ring.disk =
                    Some(crate::disk::DiskStream::new(&ring.backend, file.clone(), count, span, crate::disk::DISK_READERS, &plan.name)?);
                ring.step.host_bounce_bytes = (count * span) as u64;
            }
            ring.warm()
        })();
        match result {
            Ok(()) => Ok(ring),
            Err(e) => {
                if ring.breaks(Sabotage::LeakOnError) {
                    std::mem::forget(ring);
                } else {
                    ring.release_all();
                    ring.closed = true;
                }
                Err(e)
            }
        }
    }

    fn alloc(&mut self, bytes: usize, purpose: &str) -> Result<B::Slot> {
        let slot = self.backend.alloc_slot(bytes, purpose)?;
        self.step.device_weight_bytes += bytes as u64;
        self.step.peak_device_weight_bytes = self.step.peak_device_weight_bytes.max(self.step.device_weight_bytes);
        Ok(slot)
    }

    fn load_whole(&mut self, buffer: &crate::backend::HostBufferOf<B>, bytes: usize, purpose: &str) -> Result<(B::Slot, B::Wait)> {
        let mut slot = self.alloc(bytes, purpose)?;
        let copied = self.backend.copy_to_slot(buffer, &mut slot, bytes, None).and_then(|ready| self.backend.compute_wait(&ready));
        match copied {
            Ok(wait) => {
                self.step.bytes_copied += bytes as u64;
                self.step.link_bytes += crate::host::HostBuffer::held_bytes(buffer).unwrap_or(bytes) as u64;
                self.step.copies += 1;
                Ok((slot, wait))
            }
            Err(e) => {
                let _ = self.backend.synchronize();
                let _ = self.backend.free_slot(slot, None);
                Err(e)
            }
        }
    }

    fn warm(&mut self) -> Result<()> {
        let Some(first) = (0..self.next.len()).find(|&i| self.streams(i)) else {
            return Ok(());
        };
        let s = self.victim(&[]);
        self.load(s, first)?;
        self.prefetch(first, s)
    }

    /// Whether block `b` streams through the slots: not resident in the ring,
    /// not held by the caller.
    pub(crate) fn streams(&self, b: usize) -> bool {
        self.resident_of[b].is_none() && !self.outside.get(b).copied().unwrap_or(false)
    }

    /// Blocks the caller holds on the device itself from now on (`(stack,
    /// index)` each; a framework that kept a lent copy of each for good, as the
    /// Python package's automatic plan does for a host-bound step): none of
    /// them is prefetched again, and the current pass's first streamed blocks
    /// are copied ahead now (the slots may hold blocks just kept; a pass that
    /// starts next is copied ahead by [`set_backward`](Self::set_backward)).
    /// Asked for all the same, a held block is served from a slot that still
    /// holds it, else fetched as any block the order did not predict (a miss).
    /// Call it between blocks.
    pub fn hold_outside(&mut self, blocks: &[(String, usize)]) -> Result<()> {
        let held = blocks.iter().map(|(stack, index)| self.position(stack, *index)).collect::<Result<Vec<_>>>()?;
        if self.lent.is_some() {
            return Err(Error::Protocol(format!(
                "component {:?}: a block is held outside between blocks, not while one is lent",
                self.plan.name
            )));
        }
        if self.outside.len() < self.next.len() {
            self.outside.resize(self.next.len(), false);
        }
        for b in held {
            self.outside[b] = true;
        }
        self.warm_pass(Some(0))
    }

    /// The next `count` streamed blocks after `from` in the learned order.
    fn chain(&self, from: usize, count: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(count);
        let mut b = from;
        for _ in 0..self.next.len() {
            if out.len() == count {
                break;
            }
            b = self.next[b];
            if b == from {
                break;
            }
            if self.streams(b) && !out.contains(&b) {
                out.push(b);
            }
        }
        out
    }

    /// The `count` streamed blocks expected after `from`: [`chain`](Self::chain)
    /// within this pass; where the other pass follows this one
    /// ([`follows`](Self::follows)), past the block this pass ended with last
    /// time the other pass's blocks, from its first, in its learned order,
    /// instead of this pass's first ones again (`from`, in its slot, left out).
    fn ahead(&self, from: usize, count: usize) -> Vec<usize> {
        let (this, other) = (usize::from(self.backward), usize::from(!self.backward));
        let start = self.first[other].filter(|&s| s < self.other_next.len());
        let (true, Some(end), Some(start)) = (self.follows[this] == Some(!self.backward), self.last[this], start) else {
            return self.chain(from, count);
        };
        let mut out = Vec::with_capacity(count);
        // This pass, up to its end.
        let mut b = from;
        let mut ended = from == end;
        for _ in 0..self.next.len() {
            if ended || out.len() == count {
                break;
            }
            b = self.next[b];
            if b == from {
                return out; // the order loops back to `from` before the pass ends
            }
            if self.streams(b) && !out.contains(&b) {
                out.push(b);
            }
            ended = b == end;
        }
        if !ended {
            return out;
        }
        // Then the other pass, from its first block.
        let mut c = start;
        for _ in 0..self.other_next.len() {
            if out.len() == count {
                break;
            }
            if c != from && self.streams(c) && !out.contains(&c) {
                out.push(c);
            }
            c = self.other_next[c];
            if c == start {
                break;
            }
        }
        out
    }

    /// The least recently used slot holding none of `keep`, not `except`.
    fn victim_except(&self, keep: &[usize], except: Option<usize>) -> usize {
        let candidates = self.slots.iter().enumerate().filter(|(i, s)| Some(*i) != except && s.holds.is_none_or(|b| !keep.contains(&b)));
        candidates.min_by_key(|(_, s)| (s.holds.is_some(), s.stamp)).map(|(i, _)| i).unwrap_or(0)
    }

    fn victim(&self, keep: &[usize]) -> usize {
        self.victim_except(keep, None)
    }

    fn load(&mut self, s: usize, b: usize) -> Result<()> {
        let store = self.store.clone();
        let block = &store.blocks()[b];
        let after = if self.breaks(Sabotage::SkipFreeWait) { None } else { self.slots[s].free_after.clone() };
        let after_block = match (&after, self.timeline.is_some()) {
            (Some(_), true) => self.slots[s].released_by.map(|p| store.blocks()[p].id.to_string()),
            _ => None,
        };
        let st = &mut self.slots[s];
        if st.holds.is_some() && !st.served {
            // Copied ahead and never asked for: the model skipped it (a cache
            // returned its output), or went elsewhere.
            self.step.wasted_prefetches += 1;
        }
        st.holds = None;
        st.ready = None;
        st.unserved_read = 0;
        st.served = false;
        // The copy's span and host mark start once its bytes are in host memory
        // (after a block on disk was read), so the span is the copy's alone.
        let mut read = 0;
        let (ready, t0) = match block.buffer() {
            Some(buffer) => {
                self.host_mark(|| format!("issue copy {}", block.id));
                let t0 = self.timing(StreamKind::Copy)?;
                let st = &mut self.slots[s];
                (self.backend.copy_to_slot(buffer, &mut st.slot, block.bytes(), after.as_ref())?, t0)
            }
            None => {
                // On disk: wait here for its read (issued ahead where predicted),
                // copy from the bounce buffer, give the buffer back to read ahead.
                let upcoming = self.disk_reads_after(b);
                let want = self.disk_read(b);
                let stale = self.breaks(Sabotage::StaleBounce);
                let disk =
                    self.disk.as_mut().ok_or_else(|| Error::Protocol(format!("{} is on disk but the ring has no reader", want.name)))?;
                let bounce = disk.take(&want, &upcoming, stale)?;
                read = want.len as u64;
                self.host_mark(|| format!("issue copy {}", block.id));
                let t0 = match self.timing(StreamKind::Copy) {
                    Ok(t0) => t0,
                    Err(e) => {
                        let disk = self.disk.as_mut().expect("taken from above");
                        disk.put_back(bounce, &upcoming)?;
                        return Err(e);
                    }
                };
                let st = &mut self.slots[s];
                let copied = self.backend.copy_to_slot(&bounce, &mut st.slot, block.bytes(), after.as_ref());
                let disk = self.disk.as_mut().expect("taken from above");
                disk.put_back(bounce, &upcoming)?;
                (copied?, t0)
            }
        };
        if let Some(start) = t0 {
            let end = self.backend.record_timing(StreamKind::Copy)?;
            if let (Some(tl), Some(end)) = (&mut self.timeline, end) {
                let (name, bytes) = (format!("copy {}", block.id), block.link_bytes() as u64);
                let step = tl.step;
                tl.pending.push(PendingSpan { name, stream: "copy", start, end, bytes, after: after_block, step, backward: self.backward });
            }
        }
        let st = &mut self.slots[s];
        st.holds = Some(b);
        st.ready = Some(ready);
        st.unserved_read = read;
        self.clock += 1;
        st.stamp = self.clock;
        self.step.bytes_copied += block.bytes() as u64;
        self.step.link_bytes += block.link_bytes() as u64;
        self.step.copies += 1;
        Ok(())
    }

    /// The read of block `b` (on disk) from the store's file.
    fn disk_read(&self, b: usize) -> crate::disk::Read {
        let block = &self.store.blocks()[b];
        crate::disk::Read {
            block: b,
            offset: block.disk_offset().unwrap_or(0),
            len: block.bytes(),
            name: format!("{}/{}", self.store.component(), block.id),
        }
    }

    /// The reads of the streamed blocks on disk after `b` in the learned order, as
    /// many as the bounce buffers can hold.
    fn disk_reads_after(&self, b: usize) -> Vec<crate::disk::Read> {
        let Some(disk) = &self.disk else { return Vec::new() };
        let blocks = self.store.blocks();
        self.ahead(b, self.next.len())
            .into_iter()
            .filter(|&c| blocks[c].disk_offset().is_some())
            .take(disk.bounces)
            .map(|c| self.disk_read(c))
            .collect()
    }

    fn prefetch(&mut self, b: usize, current: usize) -> Result<()> {
        let chain = self.ahead(b, self.depth);
        for &c in &chain {
            if self.slots.iter().any(|s| s.holds == Some(c)) {
                continue;
            }
            // A block on disk is copied ahead only once its read is done: the thread
            // that computes never waits for a read it does not need yet (its read is
            // issued, and the next `block` tries again).
            if self.store.blocks()[c].disk_offset().is_some() {
                let upcoming = self.disk_reads_after(b);
                if let Some(disk) = self.disk.as_mut() {
                    disk.top_up(&upcoming)?;
                    if !disk.is_ready(c) {
                        break;
                    }
                }
            }
            let mut keep = chain.clone();
            keep.push(b);
            let s = self.victim_except(&keep, Some(current));
            if s == current || self.slots[s].holds.is_some_and(|h| keep.contains(&h)) {
                break;
            }
            match self.load(s, c) {
                // A read that failed ahead of need is reported when its block is
                // asked for (read again then), not here, where another block is.
                Err(e @ Error::DiskRead { .. }) => {
                    tracing::warn!("{e}; read again when the block is asked for");
                    break;
                }
                r => r?,
            }
        }
        Ok(())
    }

    /// Number of blocks in the component.
    pub fn len(&self) -> usize {
        self.next.len()
    }

    /// Whether the component has no blocks.
    pub fn is_empty(&self) -> bool {
        self.next.is_empty()
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The host store.
    pub fn store(&self) -> &Arc<HostStore<B>> {
        &self.store
    }

    /// The prefetch depth.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The resident non-block tensors: their layout and slot.
    pub fn non_block(&self) -> Option<(&BlockLayout, &B::Slot)> {
        Some((&self.store.non_block()?.layout, &self.non_block.as_ref()?.0))
    }

    /// What compute must wait on before it reads the non-block tensors the first
    /// time (`()` on stream APIs; see [`OffloadBackend::Wait`]).
    pub fn non_block_wait(&self) -> Option<&B::Wait> {
        self.non_block.as_ref().map(|(_, w)| w)
    }

    /// Add a hook, called around every block.
    pub fn add_hook(&mut self, hook: Box<dyn Hook>) {
        self.hooks.push(hook);
    }

    /// The block `index` of `stack`, on the device, ready for compute.
    pub fn block(&mut self, stack: &str, index: usize) -> Result<BlockGuard<'_, B>> {
        let b = self.position(stack, index)?;
        self.block_at(b)
    }

    /// The store position of block `index` of `stack`, or an error naming it.
    fn position(&self, stack: &str, index: usize) -> Result<usize> {
        self.store.position(&BlockId::new(stack, index)).ok_or_else(|| Error::UnknownBlock {
            component: self.store.component().to_owned(),
            stack: stack.to_owned(),
            index,
        })
    }

    /// The block at position `b` of the store's block list.
    pub fn block_at(&mut self, b: usize) -> Result<BlockGuard<'_, B>> {
        let (loc, source, wait) = self.acquire(b)?;
        Ok(BlockGuard { ring: self, block: b, loc, source, wait, done: false })
    }

    /// Lend the block `index` of `stack` without a guard, for callers that cannot
    /// hold a borrow across calls (a binding's pre- and post-forward hooks, as in
    /// the Python package): ready for compute on a stream API, as after
    /// [`block`](Self::block); [`lent`](Self::lent) shows it and
    /// [`give_back`](Self::give_back) releases it. A block never given back is
    /// released at the next `block`, `lend`, `end_step` or `close`, and counted as a
    /// forgotten guard. Backends whose compute waits through a token
    /// (`OffloadBackend::Wait` other than `()`) need the guard's
    /// [`wait_token`](BlockGuard::wait_token): use [`block`](Self::block) there.
    pub fn lend(&mut self, stack: &str, index: usize) -> Result<()> {
        let b = self.position(stack, index)?;
        self.acquire(b).map(drop)
    }

    /// Lend a block the caller is about to keep on the device for good
    /// ([`hold_outside`](Self::hold_outside) follows): served as by
    /// [`lend`](Self::lend), but the learned order is left as it was (a burst of
    /// such lends between steps would otherwise be learned as the next step's
    /// order, and that step would fetch its blocks on demand).
    pub fn lend_to_keep(&mut self, stack: &str, index: usize) -> Result<()> {
        let b = self.position(stack, index)?;
        let (prev, first, retraces) = (self.prev, self.first, self.step.retraces);
        let (ended, follows, followed) = (self.ended, self.follows, self.followed);
        let next = prev.and_then(|p| self.next.get(p).copied());
        // Nothing copied ahead of it: the blocks after a kept one are not asked
        // for now.
        self.keeping = true;
        let served = self.acquire(b).map(drop);
        self.keeping = false;
        (self.prev, self.first, self.step.retraces) = (prev, first, retraces);
        (self.ended, self.follows, self.followed) = (ended, follows, followed);
        if let (Some(p), Some(n)) = (prev, next) {
            self.next[p] = n;
        }
        served
    }

    /// Every slot the ring holds now: its streaming slots, then its resident
    /// blocks' (a backend whose slots hold framework buffers tells from these
    /// which buffers are the ring's own and which something else keeps alive).
    pub fn slots(&self) -> impl Iterator<Item = &B::Slot> + '_ {
        self.slots.iter().map(|s| &s.slot).chain(self.resident.iter().map(|r| &r.1))
    }

    /// The block [`lend`](Self::lend) lent and not yet given back: its id, layout and slot.
    pub fn lent(&self) -> Option<(&BlockId, &BlockLayout, &B::Slot)> {
        let l = self.lent.as_ref()?;
        let hb = &self.store.blocks()[l.block];
        let slot = match l.loc {
            Loc::Stream(s) => &self.slots[s].slot,
            Loc::Resident(r) => &self.resident[r].1,
        };
        Some((&hb.id, &hb.layout, slot))
    }

    /// Release the lent block after the compute submitted so far (a no-op when
    /// none is lent), as dropping a guard does.
    pub fn give_back(&mut self) -> Result<()> {
        match self.lent.take() {
            Some(l) => self.release(l.block, l.loc, l.source, None),
            None => Ok(()),
        }
    }

    fn acquire(&mut self, b: usize) -> Result<(Loc, BlockSource, Option<B::Wait>)> {
        // A refused request serves nothing: the learned order and the step's
        // counts of what was served go back to what they were (the bytes of copies
        // it issued before failing stay counted: those copies ran).
        let (prev, first) = (self.prev, self.first);
        let next = prev.and_then(|p| self.next.get(p).copied());
        let s = &self.step;
        let counts = (s.blocks, s.retraces, s.resident_hits, s.prefetch_hits, s.misses);
        let served = self.acquire_checked(b);
        if served.is_err() {
            // Fetched on demand before the failure, the block stays in its slot:
            // that fetch stays counted, once, as the miss it was.
            let fetched = self.step.misses > counts.4 && self.slots.iter().any(|s| s.holds == Some(b));
            (self.prev, self.first) = (prev, first);
            if let (Some(p), Some(n)) = (prev, next) {
                self.next[p] = n;
            }
            let s = &mut self.step;
            (s.blocks, s.retraces, s.resident_hits, s.prefetch_hits, s.misses) = counts;
            if fetched {
                s.misses += 1;
                self.fetched_on_demand = Some(b);
            }
        }
        served
    }

    fn acquire_checked(&mut self, b: usize) -> Result<(Loc, BlockSource, Option<B::Wait>)> {
        if let Some(e) = self.sticky.take() {
            return Err(e);
        }
        if self.closed {
            return Err(Error::Protocol(format!("ring of {:?} is closed", self.store.component())));
        }
        if let Some(why) = &self.broken {
            return Err(Error::Protocol(format!("ring of {:?} is unusable: {why}", self.store.component())));
        }
        self.release_forgotten()?;
        if self.timeline.is_some() {
            if let Some(name) = self.store.blocks().get(b).map(|block| format!("acquire {}", block.id)) {
                self.host_mark(|| name);
            }
        }
        if b >= self.next.len() {
            return Err(Error::Protocol(format!(
                "component {:?} has {} blocks, asked for position {b}",
                self.store.component(),
                self.next.len()
            )));
        }
        if self.breaks(Sabotage::SyncEveryBlock) {
            self.backend.synchronize()?;
        }
        if let Some(p) = self.ended.take() {
            let p = usize::from(p);
            let now = Some(self.backward);
            self.follows[p] = if self.followed[p] == now { now } else { None };
            self.followed[p] = now;
        }
        match self.prev.replace(b) {
            Some(p) if self.next[p] != b => {
                self.next[p] = b;
                self.step.retraces += 1;
            }
            Some(_) => {}
            None => self.first[usize::from(self.backward)] = Some(b),
        }
        self.step.blocks += 1;
        let (loc, source, wait) = if let Some(r) = self.resident_of[b] {
            self.step.resident_hits += 1;
            (Loc::Resident(r), BlockSource::Resident, Some(self.resident[r].2.clone()))
        } else {
            let retried = self.fetched_on_demand.take() == Some(b);
            let (s, source) = match self.slots.iter().position(|s| s.holds == Some(b)) {
                Some(s) if retried => (s, BlockSource::OnDemand),
                Some(s) => {
                    self.step.prefetch_hits += 1;
                    (s, BlockSource::Prefetched)
                }
                None => {
                    self.step.misses += 1;
                    tracing::debug!(component = %self.store.component(), block = %self.store.blocks()[b].id, "miss: block fetched on demand");
                    let keep = self.ahead(b, self.depth);
                    let s = self.victim(&keep);
                    if self.breaks(Sabotage::TrustPrediction) && self.slots[s].holds.is_some() {
                        (s, BlockSource::OnDemand)
                    } else {
                        self.load(s, b)?;
                        (s, BlockSource::OnDemand)
                    }
                }
            };
            self.clock += 1;
            self.slots[s].stamp = self.clock;
            self.slots[s].served = true;
            // Its read from disk (if any) counts in the step that serves it, once.
            self.step.disk_bytes_read += std::mem::take(&mut self.slots[s].unserved_read);
            if !self.keeping {
                self.prefetch(b, s)?;
            }
            let mut wait = None;
            if !self.breaks(Sabotage::SkipComputeWait) {
                if let Some(ready) = self.slots[s].ready.clone() {
                    let w0 = self.timing(StreamKind::Compute)?;
                    let t = Instant::now();
                    wait = Some(self.backend.compute_wait(&ready)?);
                    self.step.host_wait_s += t.elapsed().as_secs_f64();
                    if let Some(start) = w0 {
                        let id = self.store.blocks()[b].id.clone();
                        self.push_span(format!("wait {id}"), "compute", start, StreamKind::Compute)?;
                    }
                }
            }
            if self.breaks(Sabotage::EarlyRelease) {
                self.slots[s].free_after = Some(self.backend.record_compute()?);
            }
            (Loc::Stream(s), source, wait)
        };
        if self.timeline.is_some() {
            let start = self.timing(StreamKind::Compute)?;
            if let Some(tl) = &mut self.timeline {
                tl.block_start = start;
            }
        }
        let store = self.store.clone();
        let hb = &store.blocks()[b];
        let ctx = BlockContext { component: store.component(), block: &hb.id, bytes: hb.bytes(), source };
        for h in &mut self.hooks {
            h.pre_forward(&ctx);
        }
        self.lent = Some(Lent { block: b, loc, source });
        Ok((loc, source, wait))
    }

    /// Release the block a forgotten guard (`mem::forget`) left lent: its event is
    /// recorded now, after every kernel enqueued so far, so no copy overwrites the
    /// slot while that block's kernels may still read it.
    fn release_forgotten(&mut self) -> Result<()> {
        let Some(l) = self.lent.take() else {
            return Ok(());
        };
        self.step.forgotten_guards += 1;
        tracing::warn!(
            component = %self.store.component(),
            block = %self.store.blocks()[l.block].id,
            "a block guard was never dropped: the ring records its release now"
        );
        self.release(l.block, l.loc, l.source, None)
    }

    fn release(&mut self, b: usize, loc: Loc, source: BlockSource, signal: Option<B::Event>) -> Result<()> {
        self.lent = None;
        // The slot's release event first: nothing below may leave it unrecorded.
        let recorded = match loc {
            Loc::Stream(s) => {
                self.slots[s].released_by = Some(b);
                self.record_release(s, signal)
            }
            Loc::Resident(_) => Ok(()),
        };
        let store = self.store.clone();
        let hb = &store.blocks()[b];
        if self.timeline.is_some() {
            self.host_mark(|| format!("release {}", hb.id));
        }
        let ctx = BlockContext { component: store.component(), block: &hb.id, bytes: hb.bytes(), source };
        for h in self.hooks.iter_mut().rev() {
            h.post_forward(&ctx);
        }
        let span = match self.timeline.as_mut().and_then(|tl| tl.block_start.take()) {
            Some(start) => self.push_span(format!("compute {}", hb.id), "compute", start, StreamKind::Compute),
            None => Ok(()),
        };
        recorded.and(span)
    }

    fn record_release(&mut self, s: usize, signal: Option<B::Event>) -> Result<()> {
        if self.breaks(Sabotage::NoReleaseEvent) || self.breaks(Sabotage::EarlyRelease) {
            return Ok(());
        }
        let event = match signal {
            Some(ev) => Ok(ev),
            None => self.backend.record_compute(),
        };
        match event {
            Ok(ev) => {
                self.slots[s].free_after = Some(ev);
                Ok(())
            }
            Err(e) => {
                // Without the event the slot's last use is unknown: wait for
                // everything (an error path, so a host sync is acceptable). If even
                // that fails, no later copy can be ordered safely: the ring stops.
                self.slots[s].free_after = None;
                if let Err(sync) = self.backend.synchronize() {
                    self.broken = Some(format!("the release of slot {s} could not be ordered ({e}; then {sync})"));
                }
                Err(e)
            }
        }
    }

    /// Close the current step: return its metrics and add them to the total.
    /// Reports any error the device raised asynchronously during the step.
    ///
    /// Checks that the files the store reads during a step (a mapped
    /// checkpoint served in place, the disk tier's file) still hold the bytes
    /// it was built from ([`HostStore::check_sources`]). A changed file is an
    /// error naming it, and every later block and step of this ring is refused.
    /// The step that reports it may have used changed bytes, and so may the one
    /// before it, whose last copies can still have been queued when its own
    /// check passed; no earlier step did (a change moves the file's times before
    /// its bytes).
    ///
    /// A step whose `end_step` returns an error is closed all the same: its
    /// counts are in [`metrics`](Self::metrics), and the next step counts only
    /// its own.
    pub fn end_step(&mut self) -> Result<StepMetrics> {
        // A step whose checks fail is closed all the same (its counts go to the
        // totals, none into the next step), and the error returned.
        let checked = self.end_step_checks();
        let closed = self.close_step();
        checked.and(closed)
    }

    /// What `end_step` reports before closing the step: an error held from a
    /// dropped guard, a broken ring, the device's deferred errors, a changed file.
    fn end_step_checks(&mut self) -> Result<()> {
        if let Some(e) = self.sticky.take() {
            return Err(e);
        }
        if let Some(why) = &self.broken {
            return Err(Error::Protocol(format!("ring of {:?} is unusable: {why}", self.store.component())));
        }
        self.release_forgotten()?;
        self.backend.poll_error()?;
        if let Err(e) = self.sabotage_checked_sources() {
            self.broken = Some(format!("a file it streams from changed: {e}"));
            return Err(e);
        }
        Ok(())
    }

    /// Close the open step: its metrics (with the timeline's spans, where
    /// collected) moved into the totals, a new step begun.
    fn close_step(&mut self) -> Result<StepMetrics> {
        self.ended = Some(self.backward);
        if let Some(p) = self.prev {
            self.last[usize::from(self.backward)] = Some(p);
        }
        self.step.step_wall_s = self.step_started.elapsed().as_secs_f64();
        self.step_started = Instant::now();
        if let Some(disk) = &mut self.disk {
            self.step.disk_wait_s = disk.take_waited();
        }
        let spans = self.collect_spans();
        let step = self.step.clone();
        self.total.component = step.component.clone();
        self.total.accumulate(&step);
        tracing::info!(metrics = %step, "offload step");
        self.step = StepMetrics {
            component: step.component.clone(),
            backward: self.backward,
            device_weight_bytes: step.device_weight_bytes,
            peak_device_weight_bytes: step.device_weight_bytes,
            host_bytes: step.host_bytes,
            host_pinned_bytes: step.host_pinned_bytes,
            host_bounce_bytes: step.host_bounce_bytes,
            ..Default::default()
        };
        spans.map(|()| step)
    }

    /// The store's files checked, unless the sabotage skips it.
    fn sabotage_checked_sources(&self) -> Result<()> {
        if self.breaks(Sabotage::SkipSourceCheck) {
            return Ok(());
        }
        self.store.check_sources()
    }

    /// Metrics of every closed step, plus the open one.
    pub fn metrics(&self) -> StepMetrics {
        let mut t = self.total.clone();
        t.component = self.step.component.clone();
        t.accumulate(&self.step);
        // The open step's wait for disk reads, which `end_step` moves into its metrics.
        if let Some(disk) = &self.disk {
            t.disk_wait_s += disk.waited();
        }
        t
    }

    fn release_all(&mut self) {
        let _ = self.backend.synchronize();
        for s in self.slots.drain(..) {
            let _ = self.backend.free_slot(s.slot, None);
        }
        for (_, s, _) in self.resident.drain(..) {
            let _ = self.backend.free_slot(s, None);
        }
        if let Some((s, _)) = self.non_block.take() {
            let _ = self.backend.free_slot(s, None);
        }
        self.step.device_weight_bytes = 0;
    }

    /// Wait for outstanding work and release every slot. The host store is
    /// untouched; a new ring can be built from it.
    ///
    /// Once the device has drained, the store's files are checked again: a
    /// change made while the last step's copies were still queued (after its
    /// `end_step` checked) is an error naming the file, so the last step of a
    /// run is covered as every other is.
    pub fn close(mut self) -> Result<()> {
        let forgotten = self.release_forgotten();
        let r = self.backend.synchronize().and(forgotten).and_then(|()| self.sabotage_checked_sources());
        self.release_all();
        self.closed = true;
        r
    }
}

impl<B: OffloadBackend> Drop for Ring<B> {
    fn drop(&mut self) {
        if !self.closed {
            self.release_all();
        }
    }
}
