//! The planner's runs under device budgets (`zoo run --budgets`, cuda's file):
//! what one process run records of them (each budget's choice, its prediction and
//! the measured steps; the calibration the planner used) and their merge over
//! process runs, every spread computed here.

use crate::harness::{check_output, gib, group_by, median, sp, spread, RunDoc, Streamed};
use crate::registry::{Case, Model};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The planner's choice under one device budget, run and timed in the process
/// that calibrated it (from the resident run's per-block times).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct BudgetRun {
    /// Registry model.
    pub model: String,
    /// Registry case.
    pub case: String,
    /// Device budget for weights, bytes.
    pub budget_bytes: u64,
    /// Prefetch depth the planner chose (the ring ran at it).
    pub depth: usize,
    /// Blocks the planner kept resident, in ring order.
    pub resident_blocks: Vec<String>,
    /// Device bytes for weights the planner counted for its choice.
    pub planned_device_bytes: u64,
    /// Bytes streamed per step under the choice.
    pub streamed_bytes: u64,
    /// The planner's predicted step (its replay of the ring's schedule), seconds.
    pub predicted_step_s: f64,
    /// Median of [`steps_streamed_s`](Self::steps_streamed_s).
    pub step_streamed_s: f64,
    /// Every timed step under the choice, seconds.
    pub steps_streamed_s: Vec<f64>,
    /// The same process's median resident step, seconds.
    pub step_resident_s: f64,
    /// Pinned host-to-device bandwidth measured in this process, GB/s.
    pub bandwidth_gbps: f64,
    /// The most weight bytes (slots and resident blocks) live at once during the run.
    pub weights_device_bytes: u64,
    /// Output byte-identical to the resident run's.
    pub bitwise_equal: bool,
    /// Blocks that were not prefetched in time.
    pub misses: u64,
}

/// The planner's cost model of `blocks` (each with its measured compute) over a
/// link of `bandwidth` bytes a second, no non-block weights.
pub fn cost_model(bandwidth: f64, blocks: Vec<offload_plan::BlockCost>, source: String) -> offload_plan::CostModel {
    offload_plan::CostModel {
        bandwidth_bytes_per_s: bandwidth,
        blocks,
        non_block_bytes: 0,
        source,
        staging_buffers: offload_plan::DEFAULT_STAGING_BUFFERS,
        step_gap_s: 0.0,
    }
}

/// The planner's choice for `model`'s case `c` under `budget_gib` GiB of weights,
/// from `cost`: run by `stream` (given the choice's plan), checked (a correct
/// output within the budget, or an error), reported on stderr and recorded beside
/// the same process's resident steps and `bandwidth` (bytes a second).
pub fn run(
    model: &Model,
    c: &Case,
    cost: &offload_plan::CostModel,
    budget_gib: f64,
    (resident_s, bandwidth): (&[f64], f64),
    stream: &mut dyn FnMut(&offload_plan::Choice, &offload_core::Plan) -> Result<Streamed, String>,
) -> Result<BudgetRun, String> {
    let budget = (budget_gib * (1u64 << 30) as f64) as u64;
    let at = format!("{} {} budget {budget_gib} GiB", model.name, c.name);
    let choice = offload_plan::plan(cost, budget, 1, offload_core::ResidentPolicy::Auto).map_err(|e| format!("{at}: {e}"))?;
    let plan = offload_core::Plan::layerwise().component("transformer", choice.component_plan(cost, budget));
    let s = stream(&choice, &plan).map_err(|e| format!("{at}: {e}"))?;
    let resident_count = choice.resident.iter().filter(|r| **r).count();
    let (finite, nonconstant) = check_output(&s.values);
    if !s.equal || !finite || !nonconstant {
        return Err(format!(
            "{at}: the planner's choice ({resident_count} blocks resident, d={}) gave a wrong output: bitwise equal {}, finite {finite}, varied {nonconstant}",
            choice.depth, s.equal
        ));
    }
    if s.weights > budget {
        return Err(format!("{at}: {} bytes of weights on the device, over the budget", s.weights));
    }
    let step_s = median(&s.times);
    eprintln!(
        "{at}: {resident_count} resident, d={}, streamed {step_s:.4} s, predicted {:.4} s ({:+.1} %), weights {:.2} GiB, misses {}",
        choice.depth,
        choice.predicted_step_s,
        (step_s / choice.predicted_step_s - 1.0) * 100.0,
        gib(s.weights),
        s.misses
    );
    Ok(BudgetRun {
        model: model.name.into(),
        case: c.name.clone(),
        budget_bytes: budget,
        depth: choice.depth,
        resident_blocks: choice.resident_ids(cost).into_iter().map(str::to_owned).collect(),
        planned_device_bytes: choice.device_bytes,
        streamed_bytes: choice.streamed_bytes,
        predicted_step_s: choice.predicted_step_s,
        step_streamed_s: step_s,
        steps_streamed_s: s.times,
        step_resident_s: median(resident_s),
        bandwidth_gbps: bandwidth / 1e9,
        weights_device_bytes: s.weights,
        bitwise_equal: s.equal,
        misses: s.misses,
    })
}

/// The cost model the planner chose from at one case: per-block compute (the
/// median over the resident calibration steps) and the measured bandwidth.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Calibration {
    /// Registry model.
    pub model: String,
    /// Registry case.
    pub case: String,
    /// What `offload-plan --calibration` reads.
    pub cost: offload_plan::CostModel,
}

/// The budget runs of `runs`, per (model, case, budget) in first-seen order: the
/// median over the process runs of each run's median step with min and max, the
/// predictions likewise, and whether every run chose the same blocks. Empty when
/// no run has budget runs.
pub fn merge_budgets(runs: &[RunDoc], min_repeats: usize) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    let groups = group_by(runs.iter().flat_map(|r| &r.budgets), |b| (b.model.as_str(), b.case.as_str(), b.budget_bytes));
    for ((model, case, budget), per) in groups {
        let at = format!("{model} {case} budget {budget} bytes");
        if per.len() < min_repeats {
            return Err(format!("{at}: {} process runs, at least {min_repeats} needed", per.len()));
        }
        let medians: Vec<f64> = per
            .iter()
            .map(|b| spread(&b.steps_streamed_s).map(|s| s.median).ok_or_else(|| format!("{at}: no finite timings")))
            .collect::<Result<_, _>>()?;
        let each = |f: &dyn Fn(&BudgetRun) -> f64| per.iter().map(|b| f(b)).collect::<Vec<f64>>();
        let (s, p, r) = (
            spread(&medians).ok_or_else(|| format!("{at}: no finite streamed step"))?,
            spread(&each(&|b| b.predicted_step_s)).ok_or_else(|| format!("{at}: no finite predicted step"))?,
            spread(&each(&|b| b.step_resident_s)).ok_or_else(|| format!("{at}: no finite resident step"))?,
        );
        let weights = per.iter().map(|b| b.weights_device_bytes).max().unwrap_or(0);
        // Each run's bound under its choice, max(resident step, streamed bytes ÷ the
        // run's bandwidth), and its step over it (where the run measured a bandwidth).
        let bounds: Vec<f64> = per
            .iter()
            .filter(|b| b.bandwidth_gbps > 0.0)
            .map(|b| b.step_resident_s.max(b.streamed_bytes as f64 / (b.bandwidth_gbps * 1e9)))
            .collect();
        let ratios: Vec<f64> = medians.iter().zip(&bounds).map(|(m, b)| m / b).collect();
        let spread_json = |xs: &[f64]| sp(spread(xs));
        // A budget run is a timing of a correct step within its budget, or nothing.
        if let Some(b) = per.iter().find(|b| !b.bitwise_equal) {
            return Err(format!("{at}: a run's output (d={}, {} blocks resident) differs from resident", b.depth, b.resident_blocks.len()));
        }
        if weights > budget {
            return Err(format!("{at}: {weights} bytes of weights on the device, over the budget"));
        }
        let same = per.iter().all(|b| b.resident_blocks == per[0].resident_blocks && b.depth == per[0].depth);
        out.push(json!({
            "model": model, "case": case, "budget_bytes": budget, "repeats": per.len(),
            "depth": per[0].depth, "resident_blocks": per[0].resident_blocks, "same_choice_every_run": same,
            "depth_per_run": per.iter().map(|b| b.depth).collect::<Vec<_>>(),
            "resident_block_count_per_run": per.iter().map(|b| b.resident_blocks.len()).collect::<Vec<_>>(),
            "planned_device_bytes": per.iter().map(|b| b.planned_device_bytes).max(), "streamed_bytes": per[0].streamed_bytes,
            "step_streamed_s": s.median, "step_streamed_s_min": s.min, "step_streamed_s_max": s.max,
            "predicted_step_s": p.median, "predicted_step_s_min": p.min, "predicted_step_s_max": p.max,
            "prediction_error": s.median / p.median - 1.0,
            "step_resident_s": r.median, "step_resident_s_min": r.min, "step_resident_s_max": r.max,
            "bound_s": spread_json(&bounds), "ratio_to_bound": if bounds.len() == per.len() { spread_json(&ratios) } else { Value::Null },
            "weights_device_bytes": weights, "weights_within_budget": weights <= budget,
            "bitwise_equal": per.iter().all(|b| b.bitwise_equal), "misses": per.iter().map(|b| b.misses).sum::<u64>(),
            "steps_streamed_s_per_run": medians,
        }));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(step: f64, predicted: f64, resident: &[&str]) -> RunDoc {
        RunDoc {
            backend: "cuda".into(),
            budgets: vec![BudgetRun {
                model: "m".into(),
                case: "1024".into(),
                budget_bytes: 8 << 30,
                depth: 1,
                resident_blocks: resident.iter().map(|s| s.to_string()).collect(),
                predicted_step_s: predicted,
                steps_streamed_s: vec![step; 5],
                step_resident_s: 0.2,
                weights_device_bytes: 7 << 30,
                bitwise_equal: true,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn budgets_merge_into_spreads_and_name_a_changed_choice() {
        let runs = [doc(0.30, 0.29, &["a.0"]), doc(0.31, 0.30, &["a.0"]), doc(0.32, 0.31, &["a.1"])];
        let b = merge_budgets(&runs, 3).unwrap();
        assert_eq!(b.len(), 1);
        assert!((b[0]["step_streamed_s"].as_f64().unwrap() - 0.31).abs() < 1e-12);
        assert!((b[0]["step_streamed_s_min"].as_f64().unwrap() - 0.30).abs() < 1e-12);
        assert!((b[0]["predicted_step_s"].as_f64().unwrap() - 0.30).abs() < 1e-12);
        assert!((b[0]["prediction_error"].as_f64().unwrap() - (0.31 / 0.30 - 1.0)).abs() < 1e-12);
        assert_eq!(b[0]["same_choice_every_run"], false);
        assert_eq!(b[0]["weights_within_budget"], true);
        assert_eq!(b[0]["resident_block_count_per_run"], serde_json::json!([1, 1, 1]));
        // Bounds per run: max(0.2 s resident, 11 GB ÷ 55 GB/s = 0.2 s; 5.5 GB: 0.1 s).
        let mut bw = runs.clone();
        for (r, bytes) in bw.iter_mut().zip([11_000_000_000u64, 11_000_000_000, 5_500_000_000]) {
            r.budgets[0].bandwidth_gbps = 55.0;
            r.budgets[0].streamed_bytes = bytes;
        }
        let b2 = merge_budgets(&bw, 3).unwrap();
        assert!((b2[0]["bound_s"]["median"].as_f64().unwrap() - 0.2).abs() < 1e-12, "{}", b2[0]);
        assert!((b2[0]["ratio_to_bound"]["max"].as_f64().unwrap() - 0.32 / 0.2).abs() < 1e-12, "{}", b2[0]);
        assert!((b2[0]["ratio_to_bound"]["min"].as_f64().unwrap() - 0.30 / 0.2).abs() < 1e-12, "{}", b2[0]);
        assert_eq!(b[0]["ratio_to_bound"], Value::Null, "no bandwidth measured: no ratio");
        assert!(merge_budgets(&runs[..2], 3).unwrap_err().contains("2 process runs"));
        assert!(merge_budgets(&[RunDoc::default()], 3).unwrap().is_empty());
    }

    #[test]
    fn a_wrong_or_oversized_budget_run_fails_the_merge() {
        let mut runs = [doc(0.30, 0.29, &["a.0"]), doc(0.31, 0.30, &["a.0"]), doc(0.32, 0.31, &["a.0"])];
        runs[1].budgets[0].bitwise_equal = false;
        assert!(merge_budgets(&runs, 3).unwrap_err().contains("differs from resident"));
        runs[1].budgets[0].bitwise_equal = true;
        runs[2].budgets[0].weights_device_bytes = (8 << 30) + 1;
        assert!(merge_budgets(&runs, 3).unwrap_err().contains("over the budget"));
    }

    #[test]
    fn run_files_without_budgets_still_parse() {
        // A run file written before the budget fields existed.
        let old = r#"{"date":"d","commit":"c","gpu":"g","backend":"cuda","block_bytes_total":1,"largest_block_bytes":1,"resident_bytes":0,"cases":[]}"#;
        let d: RunDoc = serde_json::from_str(old).unwrap();
        assert!(d.budgets.is_empty() && d.calibrations.is_empty() && d.timeline_step.is_none() && !d.no_gemm);
        // And a run without them writes none of them.
        let text = serde_json::to_string(&d).unwrap();
        assert!(!text.contains("budgets") && !text.contains("no_gemm") && !text.contains("timeline_step"), "{text}");
    }
}
