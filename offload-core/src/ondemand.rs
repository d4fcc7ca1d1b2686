//! On-demand components (a VAE, a text encoder used once per prompt): copied whole
//! to the device before use and released after, through the same primitives.

use crate::backend::OffloadBackend;
use crate::discovery::BlockId;
use crate::error::{Error, Result};
use crate::plan::ResolvedComponent;
use crate::store::HostStore;
use crate::tensor::BlockLayout;
use std::sync::Arc;

/// A component loaded whole onto the device. Dropping it (or
/// [`release`](Self::release)) frees its slots after an event recorded on the
/// compute stream, so kernels already enqueued finish first.
pub struct OnDemand<B: OffloadBackend> {
    backend: B,
    store: Arc<HostStore<B>>,
    slots: Vec<B::Slot>,
    non_block: Option<B::Slot>,
    waits: Vec<B::Wait>,
}

impl<B: OffloadBackend> OnDemand<B> {
    /// Copy every block of `store` to the device and make compute wait for the
    /// copies. Transactional: on error everything allocated is released. The
    /// files the store serves from are checked first ([`HostStore::check_sources`]):
    /// a mapped checkpoint changed since the build is an error naming it.
    pub fn load(backend: B, store: Arc<HostStore<B>>) -> Result<Self> {
        let _span = tracing::info_span!("on_demand_load", component = %store.component()).entered();
        store.check_sources()?;
        let mut me = OnDemand { backend, store: store.clone(), slots: Vec::new(), non_block: None, waits: Vec::new() };
        let all = store.blocks().iter().chain(store.non_block());
        for (i, b) in all.enumerate() {
            let mut slot = me.backend.alloc_slot(b.bytes(), &format!("{}/{} (on demand)", store.component(), b.id))?;
            let be = me.backend.clone();
            let copied =
                store.with_buffer(&be, b, |buffer| be.copy_to_slot(buffer, &mut slot, b.bytes(), None).and_then(|ev| be.compute_wait(&ev)));
            if i < store.blocks().len() {
                me.slots.push(slot);
            } else {
                me.non_block = Some(slot);
            }
            me.waits.push(copied?);
        }
        Ok(me)
    }

    /// [`load`](Self::load) under a resolved plan: its device budget checked
    /// against what this store makes the load hold (its own block sizes and, for
    /// blocks coded for the device, the decoder's staging buffers), and its
    /// blocks on disk against the plan's, as [`Ring::new`](crate::ring::Ring::new)
    /// checks a streamed component's. Over the budget is an error naming the
    /// component, before anything is allocated.
    pub fn load_planned(backend: B, store: Arc<HostStore<B>>, plan: &ResolvedComponent) -> Result<Self> {
        if plan.name != store.component() {
            return Err(Error::Plan(format!("a plan of component {:?} for the store of {:?}", plan.name, store.component())));
        }
        crate::ring::check_device_budget(&backend, &store, plan)?;
        crate::ring::check_disk_split(&store, plan)?;
        Self::load(backend, store)
    }

    /// Block `id`: its layout and slot.
    pub fn block(&self, id: &BlockId) -> Option<(&BlockLayout, &B::Slot)> {
        let i = self.store.position(id)?;
        Some((&self.store.blocks()[i].layout, &self.slots[i]))
    }

    /// The non-block tensors: their layout and slot.
    pub fn non_block(&self) -> Option<(&BlockLayout, &B::Slot)> {
        Some((&self.store.non_block()?.layout, self.non_block.as_ref()?))
    }

    /// What compute must wait on before it first reads the component: one token
    /// per copy (`()` on stream APIs; see [`OffloadBackend::Wait`]).
    pub fn wait_tokens(&self) -> &[B::Wait] {
        &self.waits
    }

    /// Device bytes held: the whole component as laid out.
    pub fn device_bytes(&self) -> u64 {
        self.store.laid_out_bytes()
    }

    fn free_all(&mut self) -> Result<()> {
        let after = self.backend.record_compute();
        let ev = after.as_ref().ok();
        if ev.is_none() {
            let _ = self.backend.synchronize();
        }
        let mut first_err = None;
        for s in self.slots.drain(..).chain(self.non_block.take()) {
            if let Err(e) = self.backend.free_slot(s, ev) {
                first_err.get_or_insert(e);
            }
        }
        after.map(drop)?;
        first_err.map_or(Ok(()), Err)
    }

    /// Release the device copy once the kernels enqueued so far have run, and
    /// check the store's files again ([`HostStore::check_sources`]): a mapped
    /// checkpoint changed since the load is an error naming it (the copies may
    /// have read changed bytes; without a host synchronisation a change made
    /// while a copy is still queued after this check is not seen).
    pub fn release(mut self) -> Result<()> {
        let freed = self.free_all();
        freed.and_then(|()| self.store.check_sources())
    }
}

impl<B: OffloadBackend> Drop for OnDemand<B> {
    fn drop(&mut self) {
        if let Err(e) = self.free_all() {
            tracing::warn!("releasing on-demand component {:?}: {e}", self.store.component());
        }
    }
}
