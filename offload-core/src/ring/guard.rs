//! `BlockGuard`: a block on the device for as long as compute reads it; its drop
//! records the event after which the block's slot may take another copy.

use super::{Loc, Ring};
use crate::backend::OffloadBackend;
use crate::discovery::BlockId;
use crate::error::Result;
use crate::hook::BlockSource;
use crate::tensor::BlockLayout;

/// A block on the device, ready for compute. Dropping it (or [`finish`](Self::finish))
/// records the event after which its slot may be reused; enqueue every kernel
/// that reads the block before that. A guard that is never dropped is released
/// by the ring at its next `block`, `end_step` or `close` (and counted).
pub struct BlockGuard<'r, B: OffloadBackend> {
    pub(super) ring: &'r mut Ring<B>,
    pub(super) block: usize,
    pub(super) loc: Loc,
    pub(super) source: BlockSource,
    pub(super) wait: Option<B::Wait>,
    pub(super) done: bool,
}

impl<B: OffloadBackend> BlockGuard<'_, B> {
    /// The block's id.
    pub fn id(&self) -> &BlockId {
        &self.ring.store.blocks()[self.block].id
    }

    /// Where each tensor sits in the slot.
    pub fn layout(&self) -> &BlockLayout {
        &self.ring.store.blocks()[self.block].layout
    }

    /// The device slot holding the block.
    pub fn slot(&self) -> &B::Slot {
        match self.loc {
            Loc::Stream(s) => &self.ring.slots[s].slot,
            Loc::Resident(r) => &self.ring.resident[r].1,
        }
    }

    /// How the block reached the device.
    pub fn source(&self) -> BlockSource {
        self.source
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.ring.backend
    }

    /// What the compute reading this block must wait on: `()` on stream APIs
    /// (the wait is already on the compute stream), a wait token for the user's
    /// submission on explicit-submission APIs ([`OffloadBackend::Wait`]).
    pub fn wait_token(&self) -> Option<&B::Wait> {
        self.wait.as_ref()
    }

    /// Release the block, reporting an error (dropping stores it for the next call).
    pub fn finish(mut self) -> Result<()> {
        self.done = true;
        self.ring.release(self.block, self.loc, self.source, None)
    }

    /// Release the block after `signal`, an event the user's own compute signals
    /// after its last read of the block (an explicit-submission API's signal
    /// semaphore value), instead of an event the backend records. The ring trusts
    /// it: an event that does not follow the last read lets the next copy into the
    /// slot race that read (a wrong result, which the backends' protocol logs
    /// report); the Vulkan backend refuses points it did not issue.
    pub fn finish_after(mut self, signal: B::Event) -> Result<()> {
        self.done = true;
        self.ring.release(self.block, self.loc, self.source, Some(signal))
    }
}

impl<B: OffloadBackend> Drop for BlockGuard<'_, B> {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.ring.release(self.block, self.loc, self.source, None) {
                self.ring.sticky = Some(e);
            }
        }
    }
}
