//! Per-step metrics of a ring.

use serde::{Deserialize, Serialize};

/// What one step (or the run so far) of one component cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Component name.
    pub component: String,
    /// Blocks served.
    pub blocks: u64,
    /// Host-to-device bytes copied.
    pub bytes_copied: u64,
    /// Copies issued.
    pub copies: u64,
    /// Blocks that were prefetched in time.
    pub prefetch_hits: u64,
    /// Blocks not predicted, fetched on demand.
    pub misses: u64,
    /// Blocks served from the resident set.
    pub resident_hits: u64,
    /// Times the learned order changed (a block followed another than predicted).
    pub retraces: u64,
    /// Host-observed seconds spent waiting in `compute_wait` (non-zero only on
    /// backends whose compute is host code; CUDA waits happen on the device).
    pub host_wait_s: f64,
    /// Device bytes the ring holds for weights (slots and resident blocks).
    pub device_weight_bytes: u64,
    /// Peak of `device_weight_bytes` since the ring was built.
    pub peak_device_weight_bytes: u64,
    /// Host bytes of the component's store.
    pub host_bytes: u64,
}

impl StepMetrics {
    /// Add the counters of `other` (a later step) to these.
    pub fn accumulate(&mut self, other: &StepMetrics) {
        self.blocks += other.blocks;
        self.bytes_copied += other.bytes_copied;
        self.copies += other.copies;
        self.prefetch_hits += other.prefetch_hits;
        self.misses += other.misses;
        self.resident_hits += other.resident_hits;
        self.retraces += other.retraces;
        self.host_wait_s += other.host_wait_s;
        self.device_weight_bytes = other.device_weight_bytes;
        self.peak_device_weight_bytes = self.peak_device_weight_bytes.max(other.peak_device_weight_bytes);
        self.host_bytes = other.host_bytes;
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

impl std::fmt::Display for StepMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} blocks ({} prefetched, {} resident, {} misses, {} retraces), {:.1} MiB in {} copies, \
             device weights {:.1} MiB (peak {:.1} MiB), host {:.1} MiB",
            self.component,
            self.blocks,
            self.prefetch_hits,
            self.resident_hits,
            self.misses,
            self.retraces,
            mib(self.bytes_copied),
            self.copies,
            mib(self.device_weight_bytes),
            mib(self.peak_device_weight_bytes),
            mib(self.host_bytes)
        )
    }
}
