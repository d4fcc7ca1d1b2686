//! Deliberate breaks of the protocol, so that the conformance suite can show
//! each of its cases fails when the property it checks is broken.
//!
//! The module is public only with the `sabotage` feature, which only the tests
//! crate turns on; without it nothing can set a break, every check reads "no
//! break" (`Ring::breaks` is then `false`, so the compiler drops the branches).

use std::cell::Cell;

/// Deliberate protocol breaks, so tests can show that the conformance cases
/// catch a broken ring (`Ring::with_sabotage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(not(feature = "sabotage"), allow(dead_code))]
pub enum Sabotage {
    /// Keep the protocol.
    #[default]
    None,
    /// Invariant 1: let compute read a slot without waiting for its copy.
    SkipComputeWait,
    /// Invariant 2: copy into a slot without waiting for its last use.
    SkipFreeWait,
    /// Invariant 3: synchronize the host on every block.
    SyncEveryBlock,
    /// Invariant 5: allocate one slot more than `d + 1`.
    ExtraSlot,
    /// Invariant 7: on a miss, serve the predicted block instead of the one asked for.
    TrustPrediction,
    /// Invariant 8: leak device slots when building the ring fails.
    LeakOnError,
    /// Invariant 2: record no release event (the slot's next copy waits only on
    /// whatever older event it had).
    NoReleaseEvent,
    /// Invariant 2: record the release event when the block is handed out, before
    /// the compute that reads it.
    EarlyRelease,
    /// Invariant 6 on the host tiers: skip the step-boundary check that the files
    /// a store streams from are unchanged (`HostStore::check_sources`).
    SkipSourceCheck,
    /// Invariant 6 on the disk tier: serve a block on disk from the oldest bounce
    /// buffer whose read is in flight, whichever block it was read for (a stale
    /// buffer), instead of its own.
    StaleBounce,
    /// Invariant 6 on coded files: build a store from a coded file without
    /// decoding its blocks at load (`HostStore::build_from_coded_file` trusts
    /// the file's own hashes).
    TrustCodedFile,
    /// Invariant 2 on the disk tier: refill a bounce buffer without waiting for
    /// its last copy to land. The wait is the backend's (`HostBuffer::refill`), so the
    /// ring does nothing different: the conformance suite builds the disk
    /// case's backend with the break (`Harness::disk_backend`).
    EarlyRefill,
    /// Invariant 9: keep a second page-locked copy of every block the store
    /// builds (`HostStore::build`; the ring does nothing different).
    SecondHostCopy,
}

#[cfg_attr(not(feature = "sabotage"), allow(dead_code))]
impl Sabotage {
    /// Every break, for tables.
    pub const ALL: [Sabotage; 13] = [
        Sabotage::SkipComputeWait,
        Sabotage::SkipFreeWait,
        Sabotage::NoReleaseEvent,
        Sabotage::EarlyRelease,
        Sabotage::SyncEveryBlock,
        Sabotage::ExtraSlot,
        Sabotage::TrustPrediction,
        Sabotage::LeakOnError,
        Sabotage::SkipSourceCheck,
        Sabotage::StaleBounce,
        Sabotage::TrustCodedFile,
        Sabotage::EarlyRefill,
        Sabotage::SecondHostCopy,
    ];
}

// The store's breaks (`Sabotage::TrustCodedFile`, `Sabotage::SecondHostCopy`),
// set per thread by a test around a build.
// Set only through the setters below, which exist only with the feature.
thread_local! {
    static TRUST_CODED: Cell<bool> = const { Cell::new(false) };
    static SECOND_COPY: Cell<bool> = const { Cell::new(false) };
}

/// Whether a coded file's blocks are trusted without being decoded at load.
pub(crate) fn trusts_coded() -> bool {
    cfg!(feature = "sabotage") && TRUST_CODED.with(Cell::get)
}

/// Whether each page-locked block is allocated twice, the second copy kept
/// (`Sabotage::SecondHostCopy`).
pub(crate) fn keeps_second_copy() -> bool {
    cfg!(feature = "sabotage") && SECOND_COPY.with(Cell::get)
}

/// Trust (or not) coded files' blocks without decoding them, on this thread.
#[cfg(feature = "sabotage")]
pub fn trust_coded(on: bool) {
    TRUST_CODED.with(|t| t.set(on));
}

/// Keep (or not) a second page-locked copy of every block a store builds, on this thread.
#[cfg(feature = "sabotage")]
pub fn keep_second_copy(on: bool) {
    SECOND_COPY.with(|t| t.set(on));
}
