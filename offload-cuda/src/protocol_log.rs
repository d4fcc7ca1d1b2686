//! A log of the ring's protocol for backends whose copies do not depend on it.
//!
//! The candle and tch backends copy every block into a fresh buffer of the
//! framework's allocator, ordered after all compute enqueued so far, so a ring
//! that broke invariant 2 (a copy not ordered after the slot's last read) would
//! still compute the right result there. The log makes such a break visible
//! anyway, the way the simulated backend does: each event carries its place in one
//! order, copies name their slot, and a copy into (or release of) a slot whose
//! `after` event does not follow the slot's last read is a violation.

use crate::engine::CudaEvent;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

/// An event with its place in the log's order and, for a copy, its slot.
#[derive(Clone)]
pub struct Checked<E> {
    event: E,
    seq: u64,
    slot: Option<u64>,
}

/// A CUDA event with its place in the log's order.
pub type CheckedEvent = Checked<CudaEvent>;

impl<E> Checked<E> {
    /// The underlying event.
    pub fn event(&self) -> &E {
        &self.event
    }
}

#[derive(Default, Clone, Copy)]
struct SlotLog {
    last_copy: Option<u64>,
    waited: u64,
    last_read: Option<u64>,
}

#[derive(Default)]
struct LogState {
    seq: u64,
    /// Reads up to this place are covered by a host synchronisation.
    synced: u64,
    next_slot: u64,
    slots: HashMap<u64, SlotLog>,
    violations: Vec<String>,
}

/// The protocol log of one backend instance.
#[derive(Default)]
pub struct ProtocolLog {
    state: Mutex<LogState>,
}

impl ProtocolLog {
    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new slot's id.
    pub fn new_slot(&self) -> u64 {
        let mut st = self.lock();
        st.next_slot += 1;
        let id = st.next_slot;
        st.slots.insert(id, SlotLog::default());
        id
    }

    fn covered<E>(st: &LogState, slot: u64, after: Option<&Checked<E>>) -> bool {
        match st.slots.get(&slot).and_then(|s| s.last_read) {
            None => true,
            Some(r) => st.synced >= r || after.is_some_and(|a| a.slot.is_none() && a.seq > r),
        }
    }

    /// The host waited for everything enqueued so far: every read before now is done.
    pub fn synchronized(&self) {
        let mut st = self.lock();
        st.synced = st.seq;
    }

    /// A slot freed after `after`; logs a violation if `after` does not follow its last read.
    pub fn free_slot<E>(&self, slot: u64, after: Option<&Checked<E>>) {
        let mut st = self.lock();
        if !Self::covered(&st, slot, after) {
            st.violations.push(format!("slot {slot} released before its last read (invariant 2)"));
        }
        st.slots.remove(&slot);
    }

    /// A timing event (never an order for the protocol).
    pub fn timing_event<E>(event: E) -> Checked<E> {
        Checked { event, seq: 0, slot: None }
    }

    /// An event recorded on the compute stream after everything enqueued so far.
    pub fn compute_event<E>(&self, event: E) -> Checked<E> {
        let mut st = self.lock();
        st.seq += 1;
        Checked { event, seq: st.seq, slot: None }
    }

    /// A copy into `slot` after `after`, completing at `event`.
    pub fn copy<E>(&self, slot: u64, after: Option<&Checked<E>>, event: E) -> Checked<E> {
        let mut st = self.lock();
        if !Self::covered(&st, slot, after) {
            st.violations.push(format!("slot {slot} overwritten before its last read (invariant 2)"));
        }
        st.seq += 1;
        let seq = st.seq;
        if let Some(s) = st.slots.get_mut(&slot) {
            s.last_copy = Some(seq);
            s.last_read = None;
        }
        Checked { event, seq, slot: Some(slot) }
    }

    /// Compute waits for `event` (for a copy event: its slot may now be read).
    pub fn wait<E>(&self, event: &Checked<E>) {
        let mut st = self.lock();
        if let Some(s) = event.slot.and_then(|id| st.slots.get_mut(&id)) {
            s.waited = s.waited.max(event.seq);
        }
    }

    /// Compute is about to read `slot` (its tensors were handed out, a kernel is
    /// enqueued): a violation if it did not wait for the copy that filled it.
    pub fn read(&self, slot: u64) {
        let mut st = self.lock();
        st.seq += 1;
        let seq = st.seq;
        let Some(s) = st.slots.get_mut(&slot) else {
            st.violations.push(format!("slot {slot} read after it was freed"));
            return;
        };
        s.last_read = Some(seq);
        let ok = s.last_copy.is_none_or(|c| s.waited >= c);
        if !ok {
            st.violations.push(format!("slot {slot} read before compute waited for its copy (invariant 1)"));
        }
    }

    /// Violations so far.
    pub fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log flags what the simulated backend flags, and nothing else.
    #[test]
    fn the_log_sees_each_break_and_no_false_one() {
        // The protocol kept: copy, wait, read, release event, next copy after it.
        let log = ProtocolLog::default();
        let s = log.new_slot();
        let c = log.copy(s, None, ());
        log.wait(&c);
        log.read(s);
        let rel = log.compute_event(());
        let c2 = log.copy(s, Some(&rel), ());
        log.wait(&c2);
        log.read(s);
        log.synchronized();
        log.free_slot::<()>(s, None);
        assert!(log.violations().is_empty(), "{:?}", log.violations());
        // A read without waiting for the copy (invariant 1).
        let log = ProtocolLog::default();
        let s = log.new_slot();
        log.copy(s, None, ());
        log.read(s);
        assert_eq!(log.violations().len(), 1);
        // A release event recorded before the read, then a copy after it (invariant 2).
        let log = ProtocolLog::default();
        let s = log.new_slot();
        let c = log.copy(s, None, ());
        log.wait(&c);
        let early = log.compute_event(());
        log.read(s);
        log.copy(s, Some(&early), ());
        assert_eq!(log.violations().len(), 1);
        // A copy with no event at all after a read, and a release without one.
        let log = ProtocolLog::default();
        let s = log.new_slot();
        let c = log.copy(s, None, ());
        log.wait(&c);
        log.read(s);
        log.copy::<()>(s, None, ());
        log.free_slot::<()>(s, None);
        assert_eq!(log.violations().len(), 1, "{:?}", log.violations());
    }
}
