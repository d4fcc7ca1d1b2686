//! Hooks around each block's forward. The ring calls every hook registered on it;
//! a trace recorder is one, a metrics recorder another.

use crate::discovery::BlockId;
use std::sync::{Arc, Mutex};

/// What a hook learns about a block.
#[derive(Debug)]
pub struct BlockContext<'a> {
    /// Component name.
    pub component: &'a str,
    /// The block.
    pub block: &'a BlockId,
    /// Block size in bytes.
    pub bytes: usize,
    /// Whether the block was resident, prefetched in time, or fetched on demand.
    pub source: BlockSource,
}

/// How a block reached the device for this forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSource {
    /// Resident for good.
    Resident,
    /// Prefetched ahead as the learned order predicted.
    Prefetched,
    /// Not predicted: fetched on demand (a miss).
    OnDemand,
}

/// Called around each block's forward. Hooks compose: a ring calls them in the
/// order they were added before the block and in reverse order after.
pub trait Hook: Send {
    /// Before the block's first kernel.
    fn pre_forward(&mut self, _ctx: &BlockContext<'_>) {}
    /// After the block's last kernel has been enqueued.
    fn post_forward(&mut self, _ctx: &BlockContext<'_>) {}
}

/// Records the order in which blocks ran, and how each reached the device.
#[derive(Clone, Debug, Default)]
pub struct TraceRecorder {
    log: Arc<Mutex<Vec<(BlockId, BlockSource)>>>,
}

impl TraceRecorder {
    /// An empty recorder; clone it to keep a handle after handing it to a ring.
    pub fn new() -> Self {
        Self::default()
    }

    /// What was recorded so far.
    pub fn entries(&self) -> Vec<(BlockId, BlockSource)> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

impl Hook for TraceRecorder {
    fn pre_forward(&mut self, ctx: &BlockContext<'_>) {
        if let Ok(mut l) = self.log.lock() {
            l.push((ctx.block.clone(), ctx.source));
        }
    }
}
