//! The pass the blocks are asked for by: a forward, or a backward asking for
//! them in reverse. Each pass learns its own order.

use super::Ring;
use crate::backend::OffloadBackend;
use crate::error::{Error, Result};

impl<B: OffloadBackend> Ring<B> {
    /// Whether the blocks are now asked for by a backward pass (`true`) or a
    /// forward one. Each pass learns its own order (a backward asks for the
    /// blocks in reverse, and its first order is the reverse of the
    /// inventory's), and a step's metrics say which pass it was. Switching
    /// copies ahead the first blocks the new pass asked for last time. Call it
    /// between blocks (none lent), at the start of a pass.
    pub fn set_backward(&mut self, backward: bool) -> Result<()> {
        if backward == self.backward {
            return Ok(());
        }
        if self.lent.is_some() {
            return Err(Error::Protocol(format!("component {:?}: the pass changes between blocks, not while one is lent", self.plan.name)));
        }
        std::mem::swap(&mut self.next, &mut self.other_next);
        self.backward = backward;
        self.step.backward = backward;
        self.prev = None;
        self.warm_pass(None)
    }

    /// Copy ahead the current pass's first streamed block — the first block it
    /// asked for last time (else `fallback`), or where that one does not
    /// stream (held outside, resident), the first that does after it in the
    /// pass's learned order — and the blocks after it, `depth` deep.
    pub(super) fn warm_pass(&mut self, fallback: Option<usize>) -> Result<()> {
        let Some(start) = self.first[usize::from(self.backward)].or(fallback).filter(|&f| f < self.next.len()) else {
            return Ok(());
        };
        let Some(f) = Some(start).filter(|&f| self.streams(f)).or_else(|| self.chain(start, 1).first().copied()) else {
            return Ok(());
        };
        let s = match self.slots.iter().position(|s| s.holds == Some(f)) {
            Some(s) => s,
            None => {
                let mut keep = self.ahead(f, self.depth);
                keep.push(f);
                let s = self.victim(&keep);
                self.load(s, f)?;
                s
            }
        };
        self.prefetch(f, s)
    }
}
