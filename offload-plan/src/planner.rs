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
use offload_core::{ComponentPlan, Error, ResidentPolicy, Result};
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
    /// Device bytes for weights (and, when `coded`, the staging buffers).
    pub device_bytes: u64,
    /// Bytes of the streamed blocks, each counted once (a training step copies
    /// most of them twice: [`CostModel::per_step`](crate::CostModel::per_step)).
    pub streamed_bytes: u64,
    /// `max(compute, the bytes a step copies ÷ bandwidth)` (and, when `coded`,
    /// the step's decode time).
    pub bound_s: f64,
    /// The replayed schedule's step time.
    pub predicted_step_s: f64,
    /// The resident step (all compute, nothing streamed).
    pub resident_step_s: f64,
    /// Whether the subset-sum was solved exactly.
    pub exact: bool,
    /// Whether the streamed blocks are held coded ([`Choice::with_coding`]).
    pub coded: bool,
}

impl Choice {
    /// Names of the resident blocks.
    pub fn resident_ids<'a>(&self, model: &'a CostModel) -> Vec<&'a str> {
        model.blocks.iter().zip(&self.resident).filter(|(_, r)| **r).map(|(b, _)| b.id.as_str()).collect()
    }

    /// The component plan that runs this choice: its depth, its resident blocks by
    /// name, and `budget` as the device budget the resolver checks.
    pub fn component_plan(&self, model: &CostModel, budget: u64) -> ComponentPlan {
        ComponentPlan {
            prefetch_depth: self.depth,
            device_budget_bytes: Some(budget),
            resident_policy: ResidentPolicy::Explicit,
            resident_blocks: self.resident_ids(model).into_iter().map(str::to_owned).collect(),
            coded: self.coded,
            ..Default::default()
        }
    }

    /// This choice with its streamed blocks coded, where that is faster: every
    /// streamed block's coded size known, the replayed schedule with the coded
    /// copies and their decodes more than [`CODING_GAIN`] faster than without
    /// (so a compute-bound step stays uncoded), and the staging buffers fitting
    /// `budget` beside the choice's device bytes. Otherwise the choice unchanged.
    pub fn with_coding(&self, model: &CostModel, budget: u64) -> Choice {
        if self.coded || !model.codable() || self.resident.iter().all(|r| *r) {
            return self.clone();
        }
        let step = model.simulate_coded_s(&self.resident, self.depth, true);
        let staging = model.staging_bytes(&self.resident, self.depth);
        if step < self.predicted_step_s * (1.0 - CODING_GAIN) && self.device_bytes + staging <= budget {
            let streamed =
                model.blocks.iter().zip(&self.resident).filter(|(_, r)| !**r).map(|(b, _)| b.coded.map_or(b.bytes, |c| c.bytes)).sum();
            let decode = model.per_step(&self.resident, self.depth, |b| b.coded.map_or(0.0, |c| c.decode_s));
            let moved = model.per_step(&self.resident, self.depth, |b| b.coded.map_or(b.bytes, |c| c.bytes) as f64);
            return Choice {
                coded: true,
                predicted_step_s: step,
                device_bytes: self.device_bytes + staging,
                streamed_bytes: streamed,
                bound_s: model.compute_s().max(moved / model.bandwidth_bytes_per_s).max(decode),
                ..self.clone()
            };
        }
        self.clone()
    }
}

/// The least predicted gain (a fraction of the step) for which the planner codes
/// the streamed blocks.
pub const CODING_GAIN: f64 = 0.01;

/// Maximise `Σ k_j · size_j ≤ cap` with `0 ≤ k_j ≤ count_j`. Returns the counts and
/// whether the search was exhaustive.
fn subset_sum(classes: &[(u64, u64)], cap: u64) -> (Vec<u64>, bool) {
    let combos: u64 = classes.iter().map(|&(_, c)| c + 1).try_fold(1u64, |a, c| a.checked_mul(c)).unwrap_or(u64::MAX);
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

/// Where the resident blocks of a size class go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// Spread evenly over the ring.
    Strided,
    /// The first of the class.
    Leading,
    /// The last of the class.
    Trailing,
    /// None (an explicit plan): every block streams through slots of the largest.
    Nothing,
}

/// Replay work (combinations × blocks) above which [`count_variants`] tries a
/// ladder per class instead of every combination: keeps 200 blocks under 10 ms
/// while a Flux-sized model (57 blocks, two classes) is searched in full.
const ALL_COUNTS_WORK: u64 = 60_000;

/// Resident counts per class to try: the bound-optimal fill `max` and, when
/// `variants`, other fills, since fewer residents, or residents of another size
/// class, can let a deeper or better-spread ring overlap more. With few
/// combinations, every count vector that fits `cap` (`classes` are `(size,
/// count)`); else a ladder of counts per class below the bound-optimal fill.
/// `blocks` is the model's block count (the cost of one replay).
fn count_variants(classes: &[(u64, u64)], max: &[u64], cap: u64, blocks: usize, variants: bool) -> Vec<Vec<u64>> {
    if !variants {
        return vec![max.to_vec()];
    }
    let fit: Vec<u64> = classes.iter().map(|&(size, count)| cap.checked_div(size).map_or(count, |f| count.min(f))).collect();
    let combos: u64 = fit.iter().map(|&m| m + 1).try_fold(1u64, |a, c| a.checked_mul(c)).unwrap_or(u64::MAX);
    let per_class: Vec<Vec<u64>> = if combos.saturating_mul(blocks as u64) <= ALL_COUNTS_WORK {
        fit.iter().map(|&m| (0..=m).collect()).collect()
    } else {
        max.iter()
            .map(|&m| {
                let mut v = vec![m, m.saturating_sub(1), m.saturating_sub(2), m * 3 / 4, m / 2, m / 4, 0];
                v.sort_unstable();
                v.dedup();
                v
            })
            .collect()
    };
    let mut out = vec![Vec::new()];
    // Fuller fills first: their bounds are lower, so later candidates prune sooner.
    let per_class: Vec<Vec<u64>> = per_class.into_iter().map(|v| v.into_iter().rev().collect()).collect();
    for options in &per_class {
        out = out.iter().flat_map(|prefix| options.iter().map(move |&k| [prefix.clone(), vec![k]].concat())).collect();
    }
    out.retain(|k| k.iter().zip(classes).map(|(&k, &(size, _))| k * size).sum::<u64>() <= cap);
    out
}

/// Pick `k` of the positions `idx` (ring order) by `placement`.
fn place(idx: &[usize], k: usize, placement: Placement) -> Vec<usize> {
    match placement {
        Placement::Nothing => Vec::new(),
        Placement::Leading => idx[..k].to_vec(),
        Placement::Trailing => idx[idx.len() - k..].to_vec(),
        _ => (0..k).map(|i| idx[(i * idx.len()) / k.max(1) + (idx.len() / k.max(1)) / 2]).collect(),
    }
}

/// Deepest prefetch the planner tries beyond the plan's depth.
const EXTRA_DEPTH: usize = 3;

/// [`plan`], and where every block's coded size is known, the same planned under
/// `budget` less the staging buffers coding would need (at the deepest depth
/// tried) and then coded ([`Choice::with_coding`]): the faster of the two, coded
/// only when it gains more than [`CODING_GAIN`] — so a transfer-bound step is
/// coded and a compute-bound one is not.
pub fn plan_with_coding(model: &CostModel, budget: u64, min_depth: usize, policy: ResidentPolicy) -> Result<Choice> {
    let raw = plan(model, budget, min_depth, policy)?;
    if !model.codable() {
        return Ok(raw);
    }
    // For each depth, plan under the budget less that depth's staging (every
    // block streamed: the most it can be), then code; keep the fastest that fits.
    let all_streamed = vec![false; model.blocks.len()];
    let mut best = raw.clone();
    for depth in min_depth..=min_depth + EXTRA_DEPTH {
        let reserve = model.staging_bytes(&all_streamed, depth);
        let Some(Ok(c)) = budget.checked_sub(reserve).map(|b| plan(model, b, depth, policy)) else { continue };
        let c = c.with_coding(model, budget);
        if c.coded && c.predicted_step_s < best.predicted_step_s {
            best = c;
        }
    }
    Ok(match best.coded && best.predicted_step_s < raw.predicted_step_s * (1.0 - CODING_GAIN) {
        true => best,
        false => raw,
    })
}

/// Choose the resident set and the prefetch depth (at least `min_depth`) for
/// `model` under `budget` device bytes, minimising the replayed step time.
///
/// For each depth from `min_depth` to `min_depth + 3` the candidates are the
/// bound-optimal fills of [`best_bound`] for each slot size, placed by the policy
/// (`auto` tries strided, leading and trailing placements); the replay of the
/// ring's schedule ([`CostModel::simulate_s`]) picks among them. Errors name the
/// smallest budget that could work.
pub fn plan(model: &CostModel, budget: u64, min_depth: usize, policy: ResidentPolicy) -> Result<Choice> {
    model.validate()?;
    if !(1..=offload_core::MAX_PREFETCH_DEPTH).contains(&min_depth) {
        return Err(Error::Plan(format!("prefetch depth {min_depth}: 1 to {}", offload_core::MAX_PREFETCH_DEPTH)));
    }
    if model.blocks.len() <= EXHAUSTIVE_MAX && matches!(policy, ResidentPolicy::Auto) {
        if let Some(c) = exhaustive(model, budget, min_depth) {
            return Ok(c);
        }
    }
    plan_heuristic(model, budget, min_depth, policy)
}

/// Inventories up to this many blocks are planned by exhaustive search.
pub const EXHAUSTIVE_MAX: usize = 12;

/// The choice "every block streamed at `depth`" on `model`, with its replayed
/// step: what [`Choice::with_coding`] weighs coding against for a fully streamed ring.
pub fn streamed_choice(model: &CostModel, depth: usize) -> Choice {
    choice(model, vec![false; model.blocks.len()], depth, true)
}

fn choice(model: &CostModel, resident: Vec<bool>, depth: usize, exact: bool) -> Choice {
    let all = resident.iter().all(|r| *r);
    Choice {
        depth,
        device_bytes: if all { model.total_bytes() + model.non_block_bytes } else { model.device_bytes(&resident, depth) },
        predicted_step_s: model.simulate_s(&resident, depth),
        resident_step_s: model.compute_s(),
        streamed_bytes: model.blocks.iter().zip(&resident).filter(|(_, r)| !**r).map(|(b, _)| b.bytes).sum(),
        bound_s: model.bound_s(&resident, depth),
        resident,
        exact,
        coded: false,
    }
}

/// The prefetch depth for a fully streamed ring (nothing resident): the smallest
/// depth from 1 to `max_depth` whose replayed step ([`CostModel::simulate_s`]) is
/// within `tolerance` of the bound `max(compute, bytes ÷ bandwidth)`, or, if none
/// is, the depth with the fastest replay (the smaller on a tie). Each depth costs
/// one more slot of the largest block, so the smallest that reaches the bound is
/// chosen, not the fastest.
///
/// A step whose cheap blocks copy as long as the others (Z-Image's caption-only
/// context refiner) stalls at depth 1: with two slots, block `k + 1`'s copy cannot
/// start before block `k − 1` has computed, so two cheap blocks in a row expose
/// their copies. A deeper ring hides them.
///
/// The depths tried stop short of a ring holding every block (at most
/// `blocks − 2`, and 1 for two blocks or fewer): that ring never copies
/// again, a resident model, not a streamed one.
///
/// `tolerance` must be finite and at least 0 and `max_depth` at least 1;
/// anything else is an error naming the argument.
pub fn streamed_depth(model: &CostModel, max_depth: usize, tolerance: f64) -> Result<Choice> {
    if max_depth == 0 {
        return Err(Error::Plan("streamed_depth: max_depth must be at least 1".into()));
    }
    if !(tolerance.is_finite() && tolerance >= 0.0) {
        return Err(Error::Plan(format!("streamed_depth: tolerance must be finite and at least 0, not {tolerance}")));
    }
    if model.blocks.is_empty() {
        return Err(Error::Plan("streamed_depth: the cost model has no blocks".into()));
    }
    let max_depth = max_depth.min(model.blocks.len().saturating_sub(2).max(1));
    let none = vec![false; model.blocks.len()];
    // Each depth against its own bound: a training step's bound falls with each
    // slot (the turns keep one more block each), a forward's does not move.
    let bounds: Vec<f64> = (1..=max_depth).map(|d| model.bound_s(&none, d)).collect();
    let depth = depth_within_each(&streamed_replays(model, max_depth), &bounds, tolerance);
    Ok(streamed_choice(model, depth))
}

/// The replayed step of `model` fully streamed at each depth from 1 to
/// `max_depth` (element `i` at depth `i + 1`): what [`streamed_depth`] chooses
/// from, for a caller to record beside its choice.
pub fn streamed_replays(model: &CostModel, max_depth: usize) -> Vec<f64> {
    let none = vec![false; model.blocks.len()];
    (1..=max_depth).map(|d| model.simulate_s(&none, d)).collect()
}

/// The rule of [`streamed_depth`] on replayed steps already computed
/// (`replayed[i]` at depth `i + 1`, all finite, at least one): the smallest depth
/// within `tolerance` of `bound` (with a relative slack of 1e-12 for rounding), else
/// the fastest, the smaller on a tie. What a results file's merge checks a
/// recorded choice against. Returns 0 when `replayed` is empty.
pub fn depth_within(replayed: &[f64], bound: f64, tolerance: f64) -> usize {
    depth_within_each(replayed, &vec![bound; replayed.len()], tolerance)
}

/// [`depth_within`] with each depth's own bound (`bounds[i]` at depth `i + 1`,
/// as long as `replayed`): the smallest depth whose replay is within
/// `tolerance` of its bound, else the fastest. A training step's bound falls
/// with each slot, a forward's stays: there the two rules agree.
pub fn depth_within_each(replayed: &[f64], bounds: &[f64], tolerance: f64) -> usize {
    if let Some(i) = replayed.iter().zip(bounds).position(|(&s, &b)| s <= b * (1.0 + tolerance) * (1.0 + 1e-12)) {
        return i + 1;
    }
    let mut best = 0;
    for (i, &s) in replayed.iter().enumerate() {
        if best == 0 || s < replayed[best - 1] * (1.0 - 1e-12) {
            best = i + 1;
        }
    }
    best
}

/// Every resident subset at every depth from `min_depth` to `min_depth + 3`.
fn exhaustive(model: &CostModel, budget: u64, min_depth: usize) -> Option<Choice> {
    let n = model.blocks.len();
    let mut best: Option<Choice> = None;
    for depth in min_depth..=min_depth + EXTRA_DEPTH {
        for mask in 0u64..(1 << n) {
            let resident: Vec<bool> = (0..n).map(|i| mask >> i & 1 == 1).collect();
            let c = choice(model, resident, depth, true);
            if c.device_bytes > budget {
                continue;
            }
            if best.as_ref().is_none_or(|b| {
                c.predicted_step_s < b.predicted_step_s - 1e-9
                    || ((c.predicted_step_s - b.predicted_step_s).abs() <= 1e-9 && c.device_bytes < b.device_bytes)
            }) {
                best = Some(c);
            }
        }
    }
    best
}

/// The heuristic planner (used above [`EXHAUSTIVE_MAX`] blocks): see [`plan`].
pub fn plan_heuristic(model: &CostModel, budget: u64, min_depth: usize, policy: ResidentPolicy) -> Result<Choice> {
    let placements: &[Placement] = match policy {
        ResidentPolicy::Auto => &[Placement::Strided, Placement::Leading, Placement::Trailing],
        ResidentPolicy::Leading => &[Placement::Leading],
        ResidentPolicy::Strided => &[Placement::Strided],
        ResidentPolicy::Explicit => &[Placement::Nothing],
    };
    let mut best: Option<Choice> = None;
    let mut first_err = None;
    for depth in min_depth..=min_depth + EXTRA_DEPTH {
        for &placement in placements {
            let prune = best.as_ref().map_or(f64::INFINITY, |b| b.predicted_step_s);
            for c in candidates(model, budget, depth, placement, true, prune) {
                match c {
                    Ok(c) => {
                        let better = best.as_ref().is_none_or(|b| {
                            c.predicted_step_s < b.predicted_step_s - 1e-9
                                || ((c.predicted_step_s - b.predicted_step_s).abs() <= 1e-9 && c.device_bytes < b.device_bytes)
                        });
                        if better {
                            best = Some(c);
                        }
                    }
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
        }
        if policy == ResidentPolicy::Explicit {
            break;
        }
    }
    best.ok_or_else(|| first_err.unwrap_or_else(|| Error::Plan("no plan".into())))
}

/// The plan that minimises the analytical bound `max(compute, streamed ÷ bandwidth)`
/// at exactly `depth`, placed strided. Exact (see the module docs); the property
/// tests hold it to brute force.
pub fn best_bound(model: &CostModel, budget: u64, depth: usize) -> Result<Choice> {
    candidates(model, budget, depth, Placement::Strided, false, f64::INFINITY)
        .into_iter()
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .min_by(|a, b| a.bound_s.total_cmp(&b.bound_s).then(a.device_bytes.cmp(&b.device_bytes)))
        .ok_or_else(|| Error::Plan("no plan".into()))
}

/// The bound-optimal fill for each slot size at `depth`, placed by `placement`;
/// an error if nothing fits.
/// Candidates whose bound exceeds `prune_above` (a step already reached) are not
/// replayed: no plan runs faster than its bound.
fn candidates(model: &CostModel, budget: u64, depth: usize, placement: Placement, variants: bool, prune_above: f64) -> Vec<Result<Choice>> {
    match bound_fills(model, budget, depth, placement, variants, prune_above) {
        Ok(v) => v.into_iter().map(Ok).collect(),
        Err(e) => vec![Err(e)],
    }
}

fn bound_fills(
    model: &CostModel,
    budget: u64,
    depth: usize,
    placement: Placement,
    variants: bool,
    mut prune_above: f64,
) -> Result<Vec<Choice>> {
    if depth == 0 {
        return Err(Error::Plan("prefetch depth must be at least 1".into()));
    }
    let n = model.blocks.len();
    let all_resident = model.total_bytes() + model.non_block_bytes;
    let mut sizes: Vec<u64> = model.blocks.iter().map(|b| b.bytes).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut out: Vec<Choice> = Vec::new();
    let mut thresholds: Vec<u64> = sizes.clone();
    thresholds.push(0);
    if placement == Placement::Nothing {
        // Exactly the plan's resident blocks: slots of the largest block, so no
        // block is kept resident for being larger than a slot.
        thresholds = sizes.last().copied().into_iter().collect();
    }
    for &s in &thresholds {
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
        let (max_counts, exact) = match placement {
            Placement::Nothing => (vec![0; class_list.len()], true),
            _ => subset_sum(&class_list, cap),
        };
        for counts in count_variants(&class_list, &max_counts, cap, n, variants) {
            let mut resident: Vec<bool> = model.blocks.iter().map(|b| s == 0 || b.bytes > s).collect();
            for ((_, idx), &k) in classes.iter().zip(&counts) {
                for i in place(idx, k as usize, placement) {
                    resident[i] = true;
                }
            }
            if model.device_bytes(&resident, depth) > budget && resident.iter().any(|r| !r) {
                continue;
            }
            let streamed_bytes = model.blocks.iter().zip(&resident).filter(|(_, r)| !**r).map(|(b, _)| b.bytes).sum();
            let bound_s = model.bound_s(&resident, depth);
            if bound_s > prune_above + 1e-9 {
                continue;
            }
            let predicted_step_s = model.simulate_s(&resident, depth);
            prune_above = prune_above.min(predicted_step_s);
            out.push(Choice {
                depth,
                device_bytes: if resident.iter().all(|r| *r) { all_resident } else { model.device_bytes(&resident, depth) },
                predicted_step_s,
                resident_step_s: model.compute_s(),
                streamed_bytes,
                bound_s,
                resident,
                exact,
                coded: false,
            });
        }
    }
    if out.is_empty() && prune_above.is_finite() {
        return Ok(out);
    }
    if out.is_empty() {
        let smallest = sizes.first().copied().unwrap_or(0);
        let need = ((depth as u64 + 1) * sizes.last().copied().unwrap_or(0) + model.non_block_bytes).min(all_resident);
        return Err(Error::Plan(format!(
            "device budget {budget} bytes fits no plan of {n} blocks at depth {depth}: streaming needs at least {need} bytes \
             ((d + 1) × largest block + non-block; smallest block {smallest})"
        )));
    }
    Ok(out)
}
