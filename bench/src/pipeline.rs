//! The pipeline case: a text encoder streamed layer by layer, a DiT
//! for a few denoising steps streamed with planner-chosen resident blocks, and a
//! VAE decoder loaded whole on demand — in one process, under one device budget —
//! against the same pipeline with every component resident.
//!
//! One process writes a [`PipelineRun`] (`zoo pipeline`, tch's compute);
//! [`merge`] takes at least three of them (separate processes) and computes the
//! medians, spreads, bounds and targets of the published file. Pure data here:
//! no backend is needed to merge.

use crate::harness::spread;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The components in the order a pass runs them.
pub const COMPONENTS: [&str; 3] = ["text_encoder", "transformer", "vae"];

/// One component of one process run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ComponentRun {
    /// `text_encoder`, `transformer` or `vae`.
    pub component: String,
    /// Registry model.
    pub model: String,
    /// How it is held: `layerwise`, `layerwise+resident` (planner's choice) or `on_demand`.
    pub mode: String,
    /// Seconds of this component in each timed resident pass.
    pub resident_s: Vec<f64>,
    /// Seconds of this component in each timed offloaded pass.
    pub offloaded_s: Vec<f64>,
    /// Bytes of its blocks (what streams or loads).
    pub block_bytes: u64,
    /// Bytes copied per pass under the plan (blocks not resident, times the calls;
    /// on demand: the whole component, plus what its two-slot ring warms after).
    pub copied_bytes_per_pass: u64,
    /// Peak device bytes above the pass's start while it ran, resident (activations).
    pub activations_peak_bytes: u64,
    /// Its output equal, byte for byte, to the resident pipeline's.
    pub bitwise_equal: bool,
    /// Its output finite and not constant.
    pub output_finite: bool,
    /// See [`ComponentRun::output_finite`].
    pub output_nonconstant: bool,
}

/// What one process of `zoo pipeline` writes.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PipelineRun {
    /// `BENCH_DATE`.
    pub date: String,
    /// Commit the binary was built from.
    pub commit: String,
    /// Device name.
    pub gpu: String,
    /// Backend (`tch`).
    pub backend: String,
    /// The one device budget, bytes.
    pub budget_bytes: u64,
    /// Denoising steps of the DiT per pass.
    pub steps: usize,
    /// The DiT's case (`1024`).
    pub case: String,
    /// Pinned host-to-device bandwidth measured in this process, GB/s.
    pub bandwidth_gbps: f64,
    /// Components in pass order.
    pub components: Vec<ComponentRun>,
    /// Seconds of each timed resident pass, whole.
    pub resident_pass_s: Vec<f64>,
    /// Seconds of each timed offloaded pass, whole.
    pub offloaded_pass_s: Vec<f64>,
    /// Peak device bytes allocated during the offloaded passes (libtorch's
    /// allocator: weights, slots and activations together).
    pub peak_device_bytes: u64,
    /// The DiT's plan: prefetch depth, resident blocks, the planner's predicted step.
    pub dit_depth: usize,
    /// See [`PipelineRun::dit_depth`].
    pub dit_resident_blocks: Vec<String>,
    /// See [`PipelineRun::dit_depth`].
    pub dit_predicted_step_s: f64,
    /// The DiT's budget for weights the planner was given, bytes.
    pub dit_budget_bytes: u64,
}

impl PipelineRun {
    /// Per component: its bound from this run's resident time and bandwidth.
    /// A streamed component: `max(resident, copied ÷ bandwidth)` (for the DiT the
    /// same as per step times the steps: every step copies alike); on demand: `copied ÷ bandwidth + resident` (loaded
    /// whole before it computes).
    pub fn bounds(&self) -> Result<Vec<f64>, String> {
        let bw = self.bandwidth_gbps * 1e9;
        if !(bw.is_finite() && bw > 0.0) {
            return Err(format!("pipeline run at {}: bandwidth {} GB/s", self.commit, self.bandwidth_gbps));
        }
        self.components
            .iter()
            .map(|c| {
                let r = spread(&c.resident_s).ok_or_else(|| format!("{}: no resident times", c.component))?.median;
                let copy = c.copied_bytes_per_pass as f64 / bw;
                Ok(if c.mode == "on_demand" { copy + r } else { r.max(copy) })
            })
            .collect()
    }
}

/// The target: the whole offloaded pass ≤ this × the sum of its components' bounds.
pub const TARGET_RATIO: f64 = 1.03;

/// Merge ≥ `min_runs` process runs into the published document: per component
/// and whole, medians with min and max, bounds, ratios, bitwise equality, peak
/// device memory against the budget, and whether the targets are met.
pub fn merge(runs: &[PipelineRun], min_runs: usize) -> Result<Value, String> {
    if runs.len() < min_runs {
        return Err(format!("{} pipeline runs, at least {min_runs} needed (separate processes)", runs.len()));
    }
    crate::harness::one_gpu("merge-pipeline", runs.iter().map(|r| r.gpu.as_str()))?;
    let r0 = &runs[0];
    for r in runs {
        let same = r.steps == r0.steps
            && r.budget_bytes == r0.budget_bytes
            && r.case == r0.case
            && r.components.len() == r0.components.len()
            && r.components.iter().zip(&r0.components).all(|(a, b)| a.model == b.model && a.block_bytes == b.block_bytes);
        if !same {
            return Err(format!("pipeline runs at {} and {} differ in their models, case, steps or budget", r0.commit, r.commit));
        }
        if r.offloaded_pass_s.is_empty() || r.resident_pass_s.is_empty() {
            return Err(format!("a pipeline run at {} timed no pass", r.commit));
        }
    }
    let per_run = |f: &dyn Fn(&PipelineRun) -> Result<f64, String>| -> Result<Vec<f64>, String> { runs.iter().map(f).collect() };
    let med = |xs: &[f64]| -> Result<f64, String> { spread(xs).map(|s| s.median).ok_or_else(|| format!("not finite: {xs:?}")) };
    let mut comps = Vec::new();
    let mut cases = Vec::new();
    let mut all_equal = true;
    for (k, c0) in r0.components.iter().enumerate() {
        let off = per_run(&|r| med(&r.components[k].offloaded_s))?;
        let res = per_run(&|r| med(&r.components[k].resident_s))?;
        let bounds = per_run(&|r| Ok(r.bounds()?[k]))?;
        let (so, sr, sb) = (spread(&off).ok_or("offloaded")?, spread(&res).ok_or("resident")?, spread(&bounds).ok_or("bounds")?);
        let equal = runs.iter().all(|r| r.components[k].bitwise_equal);
        let sane = runs.iter().all(|r| r.components[k].output_finite && r.components[k].output_nonconstant);
        all_equal &= equal && sane;
        comps.push(json!({
            "component": c0.component, "model": c0.model, "mode": c0.mode, "repeats": runs.len(),
            "offloaded_s": so.median, "offloaded_s_min": so.min, "offloaded_s_max": so.max,
            "resident_s": sr.median, "resident_s_min": sr.min, "resident_s_max": sr.max,
            "bound_s": sb.median, "ratio_to_bound": so.median / sb.median,
            "block_bytes": c0.block_bytes,
            "copied_bytes_per_pass_per_run": runs.iter().map(|r| r.components[k].copied_bytes_per_pass).collect::<Vec<_>>(),
            "activations_peak_bytes": runs.iter().map(|r| r.components[k].activations_peak_bytes).max(),
            "bitwise_equal": equal, "output_finite_nonconstant": sane,
        }));
        // The same component in DESIGN's case fields: per run, the bound
        // `max(resident, copied ÷ bandwidth)` and the ratio, then their spreads.
        let copied = runs.iter().map(|r| r.components[k].copied_bytes_per_pass as f64).collect::<Vec<_>>();
        let bound: Vec<f64> = runs.iter().zip(&res).zip(&copied).map(|((r, res), c)| res.max(c / (r.bandwidth_gbps * 1e9))).collect();
        let ratio: Vec<f64> = off.iter().zip(&bound).map(|(o, b)| o / b).collect();
        let (sbd, sq) = (spread(&bound).ok_or("bound")?, spread(&ratio).ok_or("ratio")?);
        let depth = match c0.component.as_str() {
            "transformer" if runs.iter().all(|r| r.dit_depth == r0.dit_depth) => json!(r0.dit_depth),
            "text_encoder" => json!(1),
            _ => Value::Null,
        };
        cases.push(json!({
            "component": c0.component, "model": c0.model, "resolution": r0.case.parse::<u64>().ok(), "batch": 1, "depth": depth,
            "budget_bytes": r0.budget_bytes, "repeats": runs.len(),
            "step_resident_s": sr.median, "step_resident_s_min": sr.min, "step_resident_s_max": sr.max,
            "step_streamed_s": so.median, "step_streamed_s_min": so.min, "step_streamed_s_max": so.max,
            "bandwidth_gbps": med(&runs.iter().map(|r| r.bandwidth_gbps).collect::<Vec<_>>())?,
            "streamed_bytes": med(&copied)? as u64,
            "bound_s": sbd.median, "ratio_to_bound": sq.median, "ratio_to_bound_min": sq.min, "ratio_to_bound_max": sq.max,
            "peak_device_bytes": runs.iter().map(|r| r.peak_device_bytes).max(), "bitwise_equal": equal,
        }));
    }
    let whole = per_run(&|r| med(&r.offloaded_pass_s))?;
    let resident = per_run(&|r| med(&r.resident_pass_s))?;
    let bound = per_run(&|r| Ok(r.bounds()?.iter().sum::<f64>()))?;
    let ratios: Vec<f64> = whole.iter().zip(&bound).map(|(w, b)| w / b).collect();
    let (sw, sr, sb, sq) = (
        spread(&whole).ok_or("whole")?,
        spread(&resident).ok_or("resident")?,
        spread(&bound).ok_or("bound")?,
        spread(&ratios).ok_or("ratio")?,
    );
    let peak = runs.iter().map(|r| r.peak_device_bytes).max().unwrap_or(0);
    let ratio = sw.median / sb.median;
    let meets = ratio <= TARGET_RATIO && all_equal && peak <= r0.budget_bytes;
    Ok(json!({
        "backend": r0.backend, "gpu": r0.gpu, "date": r0.date, "commit": crate::harness::joined(runs.iter().map(|r| r.commit.as_str())), "repeats": runs.len(),
        "model": r0.components.iter().map(|c| c.model.as_str()).collect::<Vec<_>>().join(" → "),
        "case": r0.case, "steps": r0.steps, "budget_bytes": r0.budget_bytes, "peak_device_bytes": peak,
        "bandwidth_gbps": spread(&runs.iter().map(|r| r.bandwidth_gbps).collect::<Vec<_>>()).map(|s| s.median),
        // Each process measured its own bandwidth and planned the DiT from it: per run.
        "dit_depth_per_run": runs.iter().map(|r| r.dit_depth).collect::<Vec<_>>(),
        "dit_resident_blocks_per_run": runs.iter().map(|r| r.dit_resident_blocks.len()).collect::<Vec<_>>(),
        "dit_predicted_step_s_per_run": runs.iter().map(|r| r.dit_predicted_step_s).collect::<Vec<_>>(),
        "dit_budget_bytes_per_run": runs.iter().map(|r| r.dit_budget_bytes).collect::<Vec<_>>(),
        "components": comps,
        // DESIGN's schema: one case per component, per pass (the DiT's `steps` steps),
        // its bound `max(step_resident_s, streamed_bytes ÷ bandwidth)`; the whole
        // pass's bound is the components' own bounds summed (`whole`, `method`).
        "cases": cases,
        "whole": {
            "offloaded_s": sw.median, "offloaded_s_min": sw.min, "offloaded_s_max": sw.max,
            "resident_s": sr.median, "resident_s_min": sr.min, "resident_s_max": sr.max,
            "bound_s": sb.median, "ratio_to_bound": ratio, "ratio_to_bound_min": sq.min, "ratio_to_bound_max": sq.max,
            "target_ratio_to_bound": TARGET_RATIO, "bitwise_equal": all_equal,
        },
        "meets_targets": meets,
        "method": "each component timed on the host between device synchronisations; bounds per run from that run's resident \
                   component times and its measured pinned bandwidth (streamed: max(resident, copied ÷ bandwidth), the DiT per \
                   step; on demand: copied ÷ bandwidth + resident), summed for the whole pass; medians over process runs",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(scale: f64, equal: bool) -> PipelineRun {
        let comp = |name: &str, mode: &str, res: f64, off: f64, bytes: u64| ComponentRun {
            component: name.into(),
            model: name.into(),
            mode: mode.into(),
            resident_s: vec![res; 3],
            offloaded_s: vec![off * scale; 3],
            block_bytes: bytes,
            copied_bytes_per_pass: bytes,
            bitwise_equal: equal,
            output_finite: true,
            output_nonconstant: true,
            ..Default::default()
        };
        PipelineRun {
            commit: "c".into(),
            backend: "tch".into(),
            budget_bytes: 8 << 30,
            steps: 4,
            case: "1024".into(),
            bandwidth_gbps: 50.0,
            // Encoder: 5 GB at 50 GB/s = 0.1 s > 0.02 s resident; DiT: 4 steps of
            // max(0.1, 10 GB / 4 / 50 GB/s = 0.05) = 0.4 s; VAE: 0.01 + 0.05 s.
            components: vec![
                comp("text_encoder", "layerwise", 0.02, 0.1, 5_000_000_000),
                comp("transformer", "layerwise+resident", 0.4, 0.4, 10_000_000_000),
                comp("vae", "on_demand", 0.05, 0.06, 500_000_000),
            ],
            resident_pass_s: vec![0.47; 3],
            offloaded_pass_s: vec![0.56 * scale; 3],
            peak_device_bytes: 7 << 30,
            ..Default::default()
        }
    }

    #[test]
    fn bounds_follow_each_components_mode() {
        let b = run(1.0, true).bounds().unwrap();
        assert!((b[0] - 0.1).abs() < 1e-12 && (b[1] - 0.4).abs() < 1e-12 && (b[2] - 0.06).abs() < 1e-12, "{b:?}");
    }

    #[test]
    fn merge_computes_the_whole_against_the_sum_and_fails_what_misses() {
        let doc = merge(&[run(1.0, true), run(1.01, true), run(0.99, true)], 3).unwrap();
        assert_eq!(doc["whole"]["bound_s"], 0.56);
        assert!((doc["whole"]["ratio_to_bound"].as_f64().unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(doc["meets_targets"], true);
        assert_eq!(doc["components"][1]["offloaded_s_max"], 0.4 * 1.01);
        // DESIGN's case fields, one per component: the encoder's bound max(0.02, 5 GB ÷ 50 GB/s) = 0.1 s.
        let c = &doc["cases"][0];
        assert_eq!((c["component"].as_str(), c["resolution"].as_u64(), c["batch"].as_u64()), (Some("text_encoder"), Some(1024), Some(1)));
        assert!((c["bound_s"].as_f64().unwrap() - 0.1).abs() < 1e-12 && (c["ratio_to_bound"].as_f64().unwrap() - 1.0).abs() < 1e-9, "{c}");
        for k in [
            "step_resident_s",
            "step_streamed_s",
            "bandwidth_gbps",
            "streamed_bytes",
            "peak_device_bytes",
            "bitwise_equal",
            "budget_bytes",
            "depth",
        ] {
            assert!(doc["cases"].as_array().unwrap().iter().all(|c| c.get(k).is_some()), "{k}");
        }
        // Slower than 1.03 × the bound, a component not bitwise equal, or over budget: missed.
        assert_eq!(merge(&[run(1.05, true), run(1.05, true), run(1.05, true)], 3).unwrap()["meets_targets"], false);
        assert_eq!(merge(&[run(1.0, true), run(1.0, false), run(1.0, true)], 3).unwrap()["meets_targets"], false);
        let mut big = run(1.0, true);
        big.peak_device_bytes = 9 << 30;
        assert_eq!(merge(&[run(1.0, true), big, run(1.0, true)], 3).unwrap()["meets_targets"], false);
        assert!(merge(&[run(1.0, true), run(1.0, true)], 3).unwrap_err().contains("at least 3"));
        let mut other = run(1.0, true);
        other.steps = 8;
        assert!(merge(&[run(1.0, true), other, run(1.0, true)], 3).is_err());
        let mut zero = run(1.0, true);
        zero.bandwidth_gbps = 0.0;
        assert!(merge(&[run(1.0, true), zero, run(1.0, true)], 3).is_err());
    }
}
