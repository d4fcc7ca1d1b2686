//! The planner: which blocks stay resident under a device budget.
//!
//! The objective is the bound a layerwise ring reaches,
//! `max(compute, streamed bytes ÷ bandwidth)`, under the memory constraint
//! `(d + 1) × largest streamed block + resident + non-block ≤ budget`. The bound
//! falls with every resident byte, so for each candidate slot size `S` (a
//! distinct block size, or 0 for "everything resident") blocks larger than `S`
//! must stay resident and the rest of the budget is filled by an exact subset-sum
//! over block-size classes (transformers have one to a few distinct block sizes).
//! The chosen blocks of each class are then placed by the resident policy
//! (strided by default) and the ring's schedule is replayed to predict the step.

use crate::cost::CostModel;
use offload_core::{Error, ResidentPolicy, Result};
use serde::Serialize;
use std::collections::BTreeMap;

/// Enumeration limit of the exact subset-sum; beyond it the planner fills greedily.
const EXACT_LIMIT: u64 = 2_000_000;

/// What the planner chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Choice {
    /// Prefetch depth.
    pub depth: usize,
    /// Per block (ring order): whether it stays resident.
    pub resident: Vec<bool>,
    /// Device bytes for weights.
    pub device_bytes: u64,
    /// Bytes streamed per step.
    pub streamed_bytes: u64,
    /// `max(compute, streamed ÷ bandwidth)`.
    pub bound_s: f64,
    /// The replayed schedule's step time.
    pub predicted_step_s: f64,
    /// The resident step (all compute, nothing streamed).
    pub resident_step_s: f64,
    /// Whether the subset-sum was solved exactly.
    pub exact: bool,
}

impl Choice {
    /// Names of the resident blocks.
    pub fn resident_ids<'a>(&self, model: &'a CostModel) -> Vec<&'a str> {
        model
            .blocks
            .iter()
            .zip(&self.resident)
            .filter(|(_, r)| **r)
            .map(|(b, _)| b.id.as_str())
            .collect()
    }
}

/// Maximise `Σ k_j · size_j ≤ cap` with `0 ≤ k_j ≤ count_j`. Returns the counts and
/// whether the search was exhaustive.
fn subset_sum(classes: &[(u64, u64)], cap: u64) -> (Vec<u64>, bool) {
    let combos: u64 = classes
        .iter()
        .map(|&(_, c)| c + 1)
        .try_fold(1u64, |a, c| a.checked_mul(c))
        .unwrap_or(u64::MAX);
    if combos <= EXACT_LIMIT {
        let mut best = (0u64, vec![0u64; classes.len()]);
        let mut k = vec![0u64; classes.len()];
        fn rec(j: usize, used: u64, cap: u64, classes: &[(u64, u64)], k: &mut Vec<u64>, best: &mut (u64, Vec<u64>)) {
            if j == classes.len() {
                if used > best.0 {
                    *best = (used, k.clone());
                }
                return;
            }
            let (size, count) = classes[j];
            let max = (cap - used).checked_div(size).map_or(count, |fit| count.min(fit));
            for n in (0..=max).rev() {
                k[j] = n;
                rec(j + 1, used + n * size, cap, classes, k, best);
                if best.0 == cap {
                    return;
                }
            }
            k[j] = 0;
        }
        rec(0, 0, cap, classes, &mut k, &mut best);
        (best.1, true)
    } else {
        // Largest first, as many as fit.
        let mut order: Vec<usize> = (0..classes.len()).collect();
        order.sort_by_key(|&j| std::cmp::Reverse(classes[j].0));
        let mut left = cap;
        let mut k = vec![0; classes.len()];
        for j in order {
            let (size, count) = classes[j];
            k[j] = left.checked_div(size).map_or(count, |fit| count.min(fit));
            left -= k[j] * size;
        }
        (k, false)
    }
}

/// Pick `k` of the positions `idx` (ring order) by `policy`.
fn place(idx: &[usize], k: usize, policy: ResidentPolicy) -> Vec<usize> {
    match policy {
        ResidentPolicy::Leading => idx[..k].to_vec(),
        _ => (0..k)
            .map(|i| idx[(i * idx.len()) / k.max(1) + (idx.len() / k.max(1)) / 2])
            .collect(),
    }
}

/// Choose the resident set for `model` under `budget` device bytes at prefetch
/// depth `depth`. Errors name the smallest budget that could work.
pub fn plan(model: &CostModel, budget: u64, depth: usize, policy: ResidentPolicy) -> Result<Choice> {
    if depth == 0 {
        return Err(Error::Plan("prefetch depth must be at least 1".into()));
    }
    let n = model.blocks.len();
    let all_resident = model.total_bytes() + model.non_block_bytes;
    let mut sizes: Vec<u64> = model.blocks.iter().map(|b| b.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut best: Option<(f64, u64, Vec<bool>, bool)> = None;
    let mut candidates: Vec<u64> = sizes.clone();
    candidates.push(0);
    for &s in &candidates {
        // s = 0: every block resident (no slots).
        let forced: u64 = model.blocks.iter().filter(|b| s == 0 || b.bytes > s).map(|b| b.bytes).sum();
        let slots = if s == 0 { 0 } else { (depth as u64 + 1) * s };
        let Some(cap) = budget.checked_sub(slots + forced + model.non_block_bytes) else {
            continue;
        };
        let mut classes: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        if s > 0 {
            for (i, b) in model.blocks.iter().enumerate().filter(|(_, b)| b.bytes <= s) {
                classes.entry(b.bytes).or_default().push(i);
            }
        }
        let class_list: Vec<(u64, u64)> = classes.iter().map(|(&size, v)| (size, v.len() as u64)).collect();
        let (counts, exact) = if policy == ResidentPolicy::Explicit {
            (vec![0; class_list.len()], true)
        } else {
            subset_sum(&class_list, cap)
        };
        let mut resident: Vec<bool> = model.blocks.iter().map(|b| s == 0 || b.bytes > s).collect();
        for ((_, idx), &k) in classes.iter().zip(&counts) {
            for i in place(idx, k as usize, policy) {
                resident[i] = true;
            }
        }
        if model.device_bytes(&resident, depth) > budget && resident.iter().any(|r| !r) {
            continue;
        }
        let bound = model.bound_s(&resident);
        let res_bytes: u64 = model.blocks.iter().zip(&resident).filter(|(_, r)| **r).map(|(b, _)| b.bytes).sum();
        let better = match &best {
            None => true,
            Some((b, rb, _, _)) => bound < *b - 1e-12 || ((bound - *b).abs() <= 1e-12 && res_bytes < *rb),
        };
        if better {
            best = Some((bound, res_bytes, resident, exact));
        }
    }
    let Some((bound_s, _, resident, exact)) = best else {
        let smallest = sizes.first().copied().unwrap_or(0);
        let need = ((depth as u64 + 1) * sizes.last().copied().unwrap_or(0) + model.non_block_bytes).min(all_resident);
        return Err(Error::Plan(format!(
            "device budget {budget} bytes fits no plan of {n} blocks at depth {depth}: streaming needs at least {need} bytes \
             ((d + 1) × largest block + non-block; smallest block {smallest})"
        )));
    };
    let streamed_bytes = model.blocks.iter().zip(&resident).filter(|(_, r)| !**r).map(|(b, _)| b.bytes).sum();
    Ok(Choice {
        depth,
        device_bytes: if resident.iter().all(|r| *r) {
            all_resident
        } else {
            model.device_bytes(&resident, depth)
        },
        predicted_step_s: model.simulate_s(&resident, depth),
        resident_step_s: model.compute_s(),
        streamed_bytes,
        bound_s,
        resident,
        exact,
    })
}
