//! Per-step metrics of a ring.

use serde::{Deserialize, Serialize};

/// What one step (or the run so far) of one component cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Component name.
    pub component: String,
    /// Whether the step was a backward pass (its blocks asked for in reverse
    /// to recompute gradients through them): the two passes are counted apart.
    #[serde(default)]
    pub backward: bool,
    /// Blocks served.
    pub blocks: u64,
    /// Host-to-device bytes copied: the blocks' own bytes, what lands in the slots.
    pub bytes_copied: u64,
    /// Bytes that crossed the link for those copies: fewer than `bytes_copied`
    /// where blocks are held coded (their coded bytes cross, decoded on the device).
    #[serde(default)]
    pub link_bytes: u64,
    /// Copies issued.
    pub copies: u64,
    /// Blocks that were prefetched in time.
    pub prefetch_hits: u64,
    /// Blocks not predicted, fetched on demand.
    pub misses: u64,
    /// Blocks served from the resident set.
    pub resident_hits: u64,
    /// Blocks copied ahead and overwritten before they were asked for: what a
    /// model that skips blocks (a cache returning a block's output) costs the
    /// link beyond the blocks it ran, at most `depth` per skip decision.
    #[serde(default)]
    pub wasted_prefetches: u64,
    /// Times the learned order changed (a block followed another than predicted).
    pub retraces: u64,
    /// Block guards never dropped (`mem::forget`) whose release the ring recorded
    /// itself at the next `block`, `end_step` or `close`.
    #[serde(default)]
    pub forgotten_guards: u64,
    /// Host-observed seconds spent waiting in `compute_wait` (non-zero only on
    /// backends whose compute is host code; CUDA waits happen on the device).
    pub host_wait_s: f64,
    /// Device bytes the ring holds for weights (slots and resident blocks).
    pub device_weight_bytes: u64,
    /// Peak of `device_weight_bytes` since the ring was built.
    pub peak_device_weight_bytes: u64,
    /// Host bytes of the component's store.
    pub host_bytes: u64,
    /// Of those, page-locked.
    pub host_pinned_bytes: u64,
    /// Page-locked bounce buffers the ring holds for its blocks on disk (the disk tier).
    #[serde(default)]
    pub host_bounce_bytes: u64,
    /// Bytes read from disk for the blocks on disk this step served: each read
    /// counted once, in the step that first serves its block (a read ahead for
    /// the next step's first block counts there, however fast the disk). A read
    /// whose block was never served (read ahead, then no longer wanted) is not
    /// counted.
    #[serde(default)]
    pub disk_bytes_read: u64,
    /// Host seconds the ring waited for reads from disk (the read of a block not
    /// yet done when its copy was due).
    #[serde(default)]
    pub disk_wait_s: f64,
    /// Host wall-clock seconds of the step (between `end_step` calls).
    pub step_wall_s: f64,
    /// Device seconds the compute stream waited for copies (timeline enabled only).
    pub exposed_stall_s: Option<f64>,
    /// Device seconds the copy stream was busy (timeline enabled only).
    pub copy_busy_s: Option<f64>,
}

impl StepMetrics {
    /// Achieved host-to-device rate, GB/s: bytes over the copy stream's busy time
    /// when the timeline measured it (device time), else over the step's host
    /// wall time (on an asynchronous device that is the host's enqueue time, a
    /// lower bound on the step only when the host waited for the device).
    pub fn achieved_gbps(&self) -> f64 {
        let secs = self.copy_busy_s.filter(|s| *s > 0.0).unwrap_or(self.step_wall_s);
        if secs > 0.0 {
            self.bytes_copied as f64 / secs / 1e9
        } else {
            0.0
        }
    }

    /// Share of copy time hidden behind compute: `1 − stall ÷ copy time`
    /// (timeline enabled only).
    pub fn hidden_copy_share(&self) -> Option<f64> {
        let (stall, busy) = (self.exposed_stall_s?, self.copy_busy_s?);
        (busy > 0.0).then(|| (1.0 - stall / busy).clamp(0.0, 1.0))
    }
}

impl StepMetrics {
    /// Add the counters of `other` (a later step) to these.
    pub fn accumulate(&mut self, other: &StepMetrics) {
        self.blocks += other.blocks;
        self.bytes_copied += other.bytes_copied;
        self.link_bytes += other.link_bytes;
        self.copies += other.copies;
        self.prefetch_hits += other.prefetch_hits;
        self.misses += other.misses;
        self.resident_hits += other.resident_hits;
        self.wasted_prefetches += other.wasted_prefetches;
        self.retraces += other.retraces;
        self.forgotten_guards += other.forgotten_guards;
        self.host_wait_s += other.host_wait_s;
        self.device_weight_bytes = other.device_weight_bytes;
        self.peak_device_weight_bytes = self.peak_device_weight_bytes.max(other.peak_device_weight_bytes);
        self.host_bytes = other.host_bytes;
        self.host_pinned_bytes = other.host_pinned_bytes;
        self.host_bounce_bytes = other.host_bounce_bytes;
        self.disk_bytes_read += other.disk_bytes_read;
        self.disk_wait_s += other.disk_wait_s;
        self.step_wall_s += other.step_wall_s;
        let add = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
        self.exposed_stall_s = add(self.exposed_stall_s, other.exposed_stall_s);
        self.copy_busy_s = add(self.copy_busy_s, other.copy_busy_s);
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
             device weights {:.1} MiB (peak {:.1} MiB), host {:.1} MiB ({:.1} MiB pinned), {:.2} GB/s over {:.4} s",
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
            mib(self.host_bytes),
            mib(self.host_pinned_bytes),
            self.achieved_gbps(),
            self.step_wall_s
        )?;
        if self.link_bytes != self.bytes_copied {
            write!(f, ", {:.1} MiB of it on the link (coded)", mib(self.link_bytes))?;
        }
        if let (Some(stall), Some(share)) = (self.exposed_stall_s, self.hidden_copy_share()) {
            write!(f, ", exposed stall {stall:.4} s, {:.0} % of copy time hidden", share * 100.0)?;
        }
        if self.disk_bytes_read > 0 || self.host_bounce_bytes > 0 {
            write!(
                f,
                ", {:.1} MiB read from disk ({:.4} s waited; {:.1} MiB of bounce buffers)",
                mib(self.disk_bytes_read),
                self.disk_wait_s,
                mib(self.host_bounce_bytes)
            )?;
        }
        if self.forgotten_guards > 0 {
            write!(f, ", {} forgotten guard(s) released by the ring", self.forgotten_guards)?;
        }
        Ok(())
    }
}

/// This process's resident memory beyond the page cache, in bytes: anonymous and
/// shared-memory pages (`RssAnon + RssShmem` of `/proc/self/status`), which holds
/// a copying store's buffers but not a mapped checkpoint's file pages. `None`
/// where the file cannot be read (not Linux).
pub fn host_rss_beyond_page_cache() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    Some(status_bytes(&status, "RssAnon:")? + status_bytes(&status, "RssShmem:").unwrap_or(0))
}

/// This process's file-backed resident memory, in bytes (`RssFile` of
/// `/proc/self/status`): page-cache pages mapped into it, a mapped checkpoint's
/// among them (and its libraries'). `None` where the file cannot be read.
pub fn host_rss_file_bytes() -> Option<u64> {
    status_bytes(&std::fs::read_to_string("/proc/self/status").ok()?, "RssFile:")
}

/// A `kB` field of `/proc/self/status`, in bytes.
fn status_bytes(status: &str, name: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(name))?;
    line[name.len()..].trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A field reads in bytes, a missing one is `None`; on Linux both readings
    /// are there (the process has anonymous memory and its libraries' pages).
    #[test]
    fn status_fields_read_in_bytes() {
        assert_eq!(status_bytes("Name:\tx\nRssFile:\t  1234 kB\n", "RssFile:"), Some(1234 * 1024));
        assert_eq!(status_bytes("RssAnon:\t1 kB\n", "RssFile:"), None);
        if cfg!(target_os = "linux") {
            assert!(host_rss_beyond_page_cache().is_some_and(|b| b > 0), "no anonymous memory");
            assert!(host_rss_file_bytes().is_some_and(|b| b > 0), "no file-backed pages");
        }
    }
}
