//! The host tier's planner: which blocks stay in host memory under a host RAM
//! budget, and which are read from the checkpoint file at each use (the disk
//! tier, `HostStore::build_tiered`).
//!
//! Host memory holds the blocks kept in it, the non-block tensors, and the ring's
//! `d + 2` bounce buffers of the largest streamed block on disk. Every block on
//! disk is read once a step, so the step is at least `disk bytes ÷ disk
//! bandwidth`; which blocks go to disk changes only how well their reads hide. The
//! planner sends to disk first the blocks kept on the device (read once, when the
//! ring is built), then the streamed blocks with the most compute per byte, whose
//! reads hide best behind their own compute, until the rest fits the budget.

use crate::cost::CostModel;
use offload_core::{Error, Result};
use serde::Serialize;

/// What the host-tier planner chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostChoice {
    /// Per block (the cost model's order): whether it is left on disk.
    pub on_disk: Vec<bool>,
    /// Host bytes: blocks held, non-block tensors, bounce buffers.
    pub host_bytes: u64,
    /// Of those, the bounce buffers.
    pub bounce_bytes: u64,
    /// Bytes read from disk per step (the streamed blocks on disk).
    pub disk_bytes_per_step: u64,
    /// `disk bytes per step ÷ disk bandwidth`.
    pub disk_s: f64,
    /// `max(the ring's replayed step, disk_s)`.
    pub predicted_step_s: f64,
}

impl HostChoice {
    /// Names of the blocks on disk, for `ComponentPlan::disk_blocks`.
    pub fn disk_ids(&self, model: &CostModel) -> Vec<String> {
        model.blocks.iter().zip(&self.on_disk).filter(|(_, d)| **d).map(|(b, _)| b.id.clone()).collect()
    }
}

/// Host bytes with `on_disk` on disk under `resident` at depth `depth` (the
/// larger of the bounce buffers and the one-off read of a device-resident block on
/// disk counted), and the bounce buffers among them.
pub fn host_bytes(model: &CostModel, resident: &[bool], on_disk: &[bool], depth: usize) -> (u64, u64) {
    let each = model.blocks.iter().zip(on_disk).zip(resident).map(|((b, d), r)| (b.bytes, *d, *r));
    offload_core::plan::host_ram_of(each, depth, model.non_block_bytes)
}

/// Relative step of the logarithmic scale on which [`plan_host_tier`] ranks
/// compute per byte: means closer than about this share rank alike.
pub const COMPUTE_PER_BYTE_STEP: f64 = 0.25;

/// Each block's rank by compute per byte, as a step of [`COMPUTE_PER_BYTE_STEP`]
/// on a logarithmic scale (higher: more). Blocks of one size whose values lie
/// within one step of each other (a stack's, apart from noise) share their mean.
fn compute_per_byte_ranks(model: &CostModel) -> Vec<i64> {
    let per_byte = |b: &crate::cost::BlockCost| b.compute_s / b.bytes.max(1) as f64;
    let mut by_size: std::collections::HashMap<u64, (f64, f64, f64, f64)> = std::collections::HashMap::new();
    for b in &model.blocks {
        let e = by_size.entry(b.bytes).or_insert((0.0, 0.0, f64::INFINITY, 0.0));
        e.0 += b.compute_s;
        e.1 += b.bytes as f64;
        e.2 = e.2.min(per_byte(b));
        e.3 = e.3.max(per_byte(b));
    }
    model
        .blocks
        .iter()
        .map(|b| {
            let (compute, bytes, lo, hi) = by_size[&b.bytes];
            let v = if hi <= lo * (1.0 + COMPUTE_PER_BYTE_STEP) { compute / bytes.max(1.0) } else { per_byte(b) };
            if v > 0.0 && v.is_finite() {
                (v.ln() / (1.0 + COMPUTE_PER_BYTE_STEP).ln()).floor() as i64
            } else {
                i64::MIN
            }
        })
        .collect()
}

/// Choose the blocks left on disk so host memory stays within `budget` bytes,
/// with the ring's `resident` blocks and `depth`, reading at `disk_bytes_per_s`.
/// An error names the bytes when even every block on disk does not fit (the
/// bounce buffers and the non-block tensors need more than the budget).
///
/// Blocks go to disk device-resident first, then by compute per byte, most first,
/// so the read hides behind the most compute. Timings are noisy, so the choice
/// must not follow the noise: blocks of one size (a stack's) share their mean
/// compute per byte, means within [`COMPUTE_PER_BYTE_STEP`] of each other on a
/// logarithmic scale rank alike, and equals go in model order. Two processes
/// that calibrated the same model then plan the same blocks on disk (the H200
/// runs of 2026-12-01 planned 34 and 48 blocks of Flux-dev on disk before this).
pub fn plan_host_tier(model: &CostModel, resident: &[bool], depth: usize, budget: u64, disk_bytes_per_s: f64) -> Result<HostChoice> {
    if resident.len() != model.blocks.len() {
        return Err(Error::Plan(format!("{} resident flags for {} blocks", resident.len(), model.blocks.len())));
    }
    if !(1..=offload_core::MAX_PREFETCH_DEPTH).contains(&depth) {
        return Err(Error::Plan(format!("prefetch depth {depth}: 1 to {}", offload_core::MAX_PREFETCH_DEPTH)));
    }
    if !(disk_bytes_per_s.is_finite() && disk_bytes_per_s > 0.0) {
        return Err(Error::Plan(format!("disk bandwidth {disk_bytes_per_s} bytes/s is not a measurement")));
    }
    let n = model.blocks.len();
    // Order of going to disk: device-resident blocks first, then compute per byte, most first.
    let mut order: Vec<usize> = (0..n).collect();
    let rank = compute_per_byte_ranks(model);
    order.sort_by(|&a, &b| resident[b].cmp(&resident[a]).then(rank[b].cmp(&rank[a])).then(a.cmp(&b)));
    let mut on_disk = vec![false; n];
    let mut next = order.into_iter();
    while host_bytes(model, resident, &on_disk, depth).0 > budget {
        match next.next() {
            Some(i) => on_disk[i] = true,
            None => {
                let (need, bounce) = host_bytes(model, resident, &on_disk, depth);
                return Err(Error::Plan(format!(
                    "host RAM budget {budget} bytes is below what the disk tier needs with every block on disk: {need} bytes \
                     ({bounce} of bounce buffers, d + 2 = {}, and {} of non-block tensors)",
                    depth + 2,
                    model.non_block_bytes
                )));
            }
        }
    }
    let (host, bounce) = host_bytes(model, resident, &on_disk, depth);
    let disk_bytes_per_step: u64 =
        model.blocks.iter().zip(&on_disk).zip(resident).filter(|((_, d), r)| **d && !**r).map(|((b, _), _)| b.bytes).sum();
    let disk_s = disk_bytes_per_step as f64 / disk_bytes_per_s;
    let predicted_step_s = model.simulate_s(resident, depth).max(disk_s);
    Ok(HostChoice { on_disk, host_bytes: host, bounce_bytes: bounce, disk_bytes_per_step, disk_s, predicted_step_s })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::BlockCost;
    use offload_core::DiskFile;

    fn model() -> CostModel {
        // Ten 100 MB blocks; block k computes k ms, so the heavier ones go to disk first.
        let blocks = (0..10).map(|k| BlockCost::new(format!("blocks.{k}"), 100_000_000, k as f64 * 1e-3)).collect();
        CostModel {
            bandwidth_bytes_per_s: 50e9,
            blocks,
            non_block_bytes: 1_000_000,
            source: "test".into(),
            staging_buffers: crate::cost::DEFAULT_STAGING_BUFFERS,
            step_gap_s: 0.0,
        }
    }

    /// Two stacks (blocks of two sizes) of nearly equal compute per byte, timed
    /// with a few per cent of noise in each process: every process plans the same
    /// blocks on disk (by exact compute per byte, the noise chose which stack).
    #[test]
    fn noisy_timings_of_one_model_plan_the_same_blocks_on_disk() {
        let mut plans = std::collections::HashSet::new();
        let mut orders = std::collections::HashSet::new();
        for seed in 0..20u64 {
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut noise = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                1.0 + ((x % 1000) as f64 / 1000.0 - 0.5) * 0.06
            };
            let mut blocks = Vec::new();
            for k in 0..19 {
                blocks.push(BlockCost::new(format!("double_blocks.{k}"), 640_000_000, 4.0e-3 * noise()));
            }
            for k in 0..38 {
                blocks.push(BlockCost::new(format!("single_blocks.{k}"), 270_000_000, 4.0e-3 * 270.0 / 640.0 * 1.01 * noise()));
            }
            let m = CostModel {
                bandwidth_bytes_per_s: 55e9,
                blocks,
                non_block_bytes: 200_000_000,
                source: "noisy".into(),
                staging_buffers: 2,
                step_gap_s: 0.0,
            };
            let exact: Vec<usize> = {
                let per = |i: usize| m.blocks[i].compute_s / m.blocks[i].bytes as f64;
                let mut o: Vec<usize> = (0..m.blocks.len()).collect();
                o.sort_by(|&a, &b| per(b).total_cmp(&per(a)).then(a.cmp(&b)));
                o.truncate(10);
                o
            };
            orders.insert(exact);
            let c = plan_host_tier(&m, &vec![false; m.blocks.len()], 1, 8 << 30, 1.5e9).unwrap();
            plans.insert(c.on_disk.clone());
        }
        assert!(orders.len() > 1, "the noise does reorder the blocks by exact compute per byte");
        assert_eq!(plans.len(), 1, "{} different plans from one model's noisy timings", plans.len());
    }

    #[test]
    fn the_budget_holds_and_the_heaviest_blocks_go_to_disk() {
        let m = model();
        let resident = vec![false; 10];
        let bounce = (3 * DiskFile::span(100_000_000)) as u64;
        // Room for four blocks beside the bounce buffers and the non-block tensors.
        let budget = 4 * 100_000_000 + bounce + 1_000_000;
        let c = plan_host_tier(&m, &resident, 1, budget, 1e9).unwrap();
        assert!(c.host_bytes <= budget, "{c:?}");
        assert_eq!(c.bounce_bytes, bounce);
        assert_eq!(c.disk_ids(&m), ["blocks.4", "blocks.5", "blocks.6", "blocks.7", "blocks.8", "blocks.9"]);
        assert_eq!(c.disk_bytes_per_step, 600_000_000);
        assert!((c.disk_s - 0.6).abs() < 1e-9 && c.predicted_step_s >= c.disk_s);
        // Enough for everything: nothing on disk, no bounce buffers.
        let c = plan_host_tier(&m, &resident, 1, 2_000_000_000, 1e9).unwrap();
        assert!(c.on_disk.iter().all(|d| !d) && c.bounce_bytes == 0 && c.disk_s == 0.0);
        // A device-resident block is the first to go to disk (read once, into a
        // buffer of its size at build: counted, so alone it saves nothing here).
        let mut res = vec![false; 10];
        res[0] = true;
        let c = plan_host_tier(&m, &res, 1, 950_000_000, 1e9).unwrap();
        assert_eq!(c.disk_ids(&m), ["blocks.0", "blocks.7", "blocks.8", "blocks.9"]);
        assert!(c.host_bytes <= 950_000_000, "{c:?}");
        assert_eq!(c.disk_bytes_per_step, 300_000_000, "the resident block is not read each step");
    }

    #[test]
    fn a_budget_below_the_bounce_ring_is_refused_with_the_bytes() {
        let e = plan_host_tier(&model(), &[false; 10], 1, 100_000_000, 1e9).unwrap_err().to_string();
        assert!(e.contains("host RAM budget 100000000 bytes") && e.contains("bounce buffers"), "{e}");
        assert!(plan_host_tier(&model(), &[false; 10], 1, u64::MAX, 0.0).is_err(), "no disk bandwidth");
        assert!(plan_host_tier(&model(), &[false; 3], 1, u64::MAX, 1e9).is_err(), "flags of another model");
    }
}
