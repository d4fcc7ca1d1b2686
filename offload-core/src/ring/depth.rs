//! The same ring at another prefetch depth: closed, then built again over the
//! same store and backend with what it learned.

use super::Ring;
use crate::backend::OffloadBackend;
use crate::error::{Error, Result};

impl<B: OffloadBackend> Ring<B> {
    /// This ring's blocks at prefetch depth `depth`: this ring closed (every
    /// slot freed after its last use), then a ring of `depth + 1` slots built
    /// over the same store and backend, with the order this one learned, its
    /// hooks and its totals. A plan under a device budget keeps it: a depth
    /// whose slots do not fit is refused before anything is closed. Where the
    /// new slots cannot be allocated, the ring comes back at its old depth
    /// (check [`depth`](Self::depth)). Call it between steps (no block lent).
    pub fn at_depth(mut self, depth: usize) -> Result<Self> {
        let mut plan = self.plan.clone();
        if !(1..=crate::plan::MAX_PREFETCH_DEPTH).contains(&depth) {
            return Err(Error::Plan(format!(
                "component {:?}: prefetch depth {depth} must be 1 to {}",
                plan.name,
                crate::plan::MAX_PREFETCH_DEPTH
            )));
        }
        if self.lent.is_some() {
            return Err(Error::Protocol(format!("component {:?}: the depth changes between steps, not while a block is lent", plan.name)));
        }
        if plan.strategy == crate::plan::Strategy::Layerwise {
            let largest = plan.largest_streamed_bytes as u64;
            let slots = |d: usize| (d as u64 + 1).saturating_mul(largest);
            plan.device_weight_bound = plan.device_weight_bound.saturating_sub(slots(plan.depth)).saturating_add(slots(depth));
        }
        if let Some(budget) = plan.budget.filter(|b| plan.device_weight_bound > *b) {
            return Err(Error::Plan(format!(
                "component {:?}: depth {depth} needs {} device bytes for weights, over the budget of {budget}",
                plan.name, plan.device_weight_bound
            )));
        }
        plan.depth = depth;
        let (backend, store, sabotage) = (self.backend.clone(), self.store.clone(), self.sabotage);
        let (hooks, next, total) = (std::mem::take(&mut self.hooks), self.next.clone(), self.total.clone());
        let (other_next, backward, first, outside) = (self.other_next.clone(), self.backward, self.first, self.outside.clone());
        let (follows, followed, last, ended) = (self.follows, self.followed, self.last, self.ended);
        let was = self.plan.clone();
        self.close()?;
        // Slots that cannot be had at the new depth: the ring at its old depth
        // again (what was just freed), so the caller keeps a ring.
        let mut ring = match Self::build(backend.clone(), store.clone(), &plan, sabotage) {
            Ok(ring) => ring,
            Err(e) => {
                tracing::warn!(component = %plan.name, depth, "{e}; the ring keeps depth {}", was.depth);
                Self::build(backend, store, &was, sabotage)?
            }
        };
        ring.hooks = hooks;
        ring.next = next;
        ring.other_next = other_next;
        ring.backward = backward;
        ring.first = first;
        ring.follows = follows;
        ring.followed = followed;
        ring.last = last;
        ring.ended = ended;
        ring.outside = outside;
        ring.total = total;
        Ok(ring)
    }
}
