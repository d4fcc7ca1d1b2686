//! The relay, measured: one process streams the same Flux-dev-shaped model
//! through two backends on device 0 of the same machine, one plain (its own host
//! link) and one with relay on (`CudaBackend::enable_relay`: helper GPUs fetch
//! shares over their own links and forward them over NVLink), with the resident
//! step, the single link's bandwidth and the aggregate bandwidth measured in the
//! same process. `run` (feature `cuda`) is one process; `merge` makes
//! `bench/results/<date>-relay-x2.json` from three or more, every bound, ratio and
//! speedup computed here.

use crate::harness::{sp, spread, spread_of};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// One process run of the relay bench.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RelayRun {
    /// Commit built.
    pub commit: String,
    /// GPU name.
    pub gpu: String,
    /// GPUs the machine has.
    pub gpus: usize,
    /// Registry model and case.
    pub model: String,
    /// Registry case.
    pub case: String,
    /// Resolution of the case, in pixels a side.
    pub resolution: usize,
    /// Prefetch depth.
    pub depth: usize,
    /// Helper devices.
    pub helpers: Vec<usize>,
    /// Share of each copy each helper carried.
    pub helper_share: f64,
    /// Host-to-device bandwidth of device 0 alone (bytes/s, best of three passes).
    pub single_bps: f64,
    /// Host-to-device bandwidth with relay (bytes/s, best of three passes).
    pub aggregate_bps: f64,
    /// Timed steps: resident, streamed over one link, streamed with relay.
    pub steps_resident_s: Vec<f64>,
    /// See [`steps_resident_s`](Self::steps_resident_s).
    pub steps_single_s: Vec<f64>,
    /// See [`steps_resident_s`](Self::steps_resident_s).
    pub steps_relay_s: Vec<f64>,
    /// Bytes streamed per step.
    pub step_bytes: u64,
    /// Bytes the helpers carried in the relay steps.
    pub relayed_bytes: u64,
    /// Both streamed outputs equal the resident one, bit for bit.
    pub bitwise_equal: bool,
    /// The output is finite and not constant.
    pub output_finite_nonconstant: bool,
}

/// Targets (two GPUs): the relayed step within 1.05 × `max(resident, bytes ÷
/// aggregate bandwidth)`, at least 1.8 × faster than one link, bitwise equal.
pub const RATIO_TARGET: f64 = 1.05;
/// See [`RATIO_TARGET`].
pub const SPEEDUP_TARGET: f64 = 1.8;

/// Medians with min and max over `runs` (at least `min_repeats`, one commit,
/// model, case and depth): the file.
pub fn merge(runs: &[RelayRun], min_repeats: usize) -> Result<Value, String> {
    let first = crate::harness::enough("merge-relay", runs, min_repeats)?;
    crate::harness::one_gpu("merge-relay", runs.iter().map(|r| r.gpu.as_str()))?;
    let mut ratios = Vec::new();
    let mut speedups = Vec::new();
    let mut bounds = Vec::new();
    for r in runs {
        if (&r.commit, &r.model, &r.case, r.depth, &r.helpers) != (&first.commit, &first.model, &first.case, first.depth, &first.helpers) {
            return Err(format!(
                "merge-relay: runs differ ({} {} {} and {} {} {})",
                first.commit, first.model, first.case, r.commit, r.model, r.case
            ));
        }
        let med = |v: &[f64], what: &str| spread(v).map(|s| s.median).ok_or_else(|| format!("merge-relay: a run has no {what} steps"));
        let (resident, single, relay) =
            (med(&r.steps_resident_s, "resident")?, med(&r.steps_single_s, "single")?, med(&r.steps_relay_s, "relay")?);
        if !(r.aggregate_bps.is_finite() && r.aggregate_bps > 0.0 && r.single_bps.is_finite() && r.single_bps > 0.0) {
            return Err("merge-relay: a run's bandwidths are not measurements".into());
        }
        let bound = resident.max(r.step_bytes as f64 / r.aggregate_bps);
        bounds.push(bound);
        ratios.push(relay / bound);
        speedups.push(single / relay);
    }
    let col = |f: &dyn Fn(&RelayRun) -> Vec<f64>| spread_of(runs.iter().filter_map(|r| spread(&f(r)).map(|s| s.median)));
    let (ratio, speedup) = (spread(&ratios), spread(&speedups));
    let bitwise = runs.iter().all(|r| r.bitwise_equal && r.output_finite_nonconstant);
    let carried = runs.iter().all(|r| r.relayed_bytes > 0);
    let meets =
        ratio.is_some_and(|s| s.median <= RATIO_TARGET) && speedup.is_some_and(|s| s.median >= SPEEDUP_TARGET) && bitwise && carried;
    Ok(json!({
        "date": std::env::var("BENCH_DATE").unwrap_or_default(),
        "commit": first.commit,
        "gpu": first.gpu,
        "gpus": first.gpus,
        "backend": "cuda",
        "process_runs": runs.len(),
        "helpers": first.helpers,
        "helper_share": first.helper_share,
        "link_gbps": {
            "host_to_gpu0": spread_of(runs.iter().map(|r| r.single_bps / 1e9)),
            "aggregate_relay": spread_of(runs.iter().map(|r| r.aggregate_bps / 1e9)),
        },
        "targets": {"ratio_to_bound": RATIO_TARGET, "speedup": SPEEDUP_TARGET},
        "cases": [{
            "model": first.model,
            "case": first.case,
            "resolution": first.resolution,
            "batch": 1,
            "depth": first.depth,
            "step_resident_s": col(&|r| r.steps_resident_s.clone()),
            "step_single_s": col(&|r| r.steps_single_s.clone()),
            "step_relay_s": col(&|r| r.steps_relay_s.clone()),
            "aggregate_gbps": spread_of(runs.iter().map(|r| r.aggregate_bps / 1e9)),
            "bound_s": sp(spread(&bounds)),
            "ratio_to_bound": sp(ratio),
            "speedup": sp(speedup),
            "bitwise_equal": bitwise,
            "meets_targets": meets,
        }],
        "meets_targets": meets,
    }))
}

#[cfg(feature = "cuda")]
pub use run::run;

#[cfg(feature = "cuda")]
mod run {
    use super::RelayRun;
    use crate::cuda::ring_steps;
    use crate::registry::Model;
    use crate::source::RegistrySource;
    use offload_core::{HostStore, OffloadBackend, Plan, TensorSource};
    use offload_cuda::reference::RefNet;
    use offload_cuda::{CudaBackend, RelayOptions};
    use std::sync::Arc;

    fn err(what: impl std::fmt::Display) -> String {
        format!("relay: {what}")
    }

    /// One process: the model's store on a plain backend and on a relayed one
    /// (both on device 0), resident, single-link and relayed steps, bandwidths.
    pub fn run(model: &Model, case: &str, depth: usize, n: usize, helpers: &[usize], commit: &str) -> Result<RelayRun, String> {
        let c = model.case(case)?;
        let dims = crate::cuda::dims(model, c)?;
        let single = CudaBackend::new(0).map_err(err)?;
        let relayed = CudaBackend::new(0).map_err(err)?;
        let info = relayed
            .enable_relay(RelayOptions { helpers: helpers.to_vec(), max_copy_bytes: 1 << 30, ..Default::default() })
            .map_err(|e| err(format!("relay could not be turned on (copies would stay direct): {e}")))?;
        let src = RegistrySource::new(model, 0);
        let inv = crate::source::block_inventory(model, src.specs()).map_err(err)?;
        let mut doc = RelayRun {
            commit: commit.into(),
            gpu: single.device_name().unwrap_or_default(),
            gpus: offload_cuda::cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize,
            model: model.name.into(),
            case: case.into(),
            resolution: c.resolution,
            depth,
            helpers: info.helpers.clone(),
            helper_share: info.helper_share,
            ..Default::default()
        };
        let layerwise = Plan::layerwise().prefetch_depth(depth);
        // One link.
        let store = Arc::new(HostStore::build(&single, &inv, &src).map_err(err)?);
        doc.single_bps = offload_core::probe_bandwidth(&single, &store, 3).map_err(err)?;
        let mut net = RefNet::new(&single, dims, c.resolution as u64).map_err(err)?;
        let (resident, _, want) = ring_steps(&single, model, (&store, &Plan::resident(), &inv), &mut net, (1, n))?;
        let (single_s, step_bytes, out_single) = ring_steps(&single, model, (&store, &layerwise, &inv), &mut net, (1, n))?;
        drop(net);
        drop(store);
        single.synchronize().map_err(err)?;
        // Relayed.
        let store = Arc::new(HostStore::build(&relayed, &inv, &src).map_err(err)?);
        let before: u64 = relayed.relayed_bytes().iter().map(|(_, b)| b).sum();
        doc.aggregate_bps = offload_core::probe_bandwidth(&relayed, &store, 3).map_err(err)?;
        let mut net = RefNet::new(&relayed, dims, c.resolution as u64).map_err(err)?;
        let t0: u64 = relayed.relayed_bytes().iter().map(|(_, b)| b).sum();
        let (relay_s, _, out_relay) = ring_steps(&relayed, model, (&store, &layerwise, &inv), &mut net, (1, n))?;
        doc.relayed_bytes = relayed.relayed_bytes().iter().map(|(_, b)| b).sum::<u64>() - t0;
        let (finite, nonconstant) = crate::harness::check_output(&crate::source::bf16_to_f32(&out_relay));
        doc.steps_resident_s = resident;
        doc.steps_single_s = single_s;
        doc.steps_relay_s = relay_s;
        doc.step_bytes = step_bytes;
        doc.bitwise_equal = out_single == want && out_relay == want;
        doc.output_finite_nonconstant = finite && nonconstant;
        eprintln!(
            "relay: single {:.1} GB/s, aggregate {:.1} GB/s (probe carried {} bytes by helpers); resident {:.4} s, single {:.4} s, relay {:.4} s; bitwise {}",
            doc.single_bps / 1e9,
            doc.aggregate_bps / 1e9,
            t0 - before,
            crate::harness::median(&doc.steps_resident_s),
            crate::harness::median(&doc.steps_single_s),
            crate::harness::median(&doc.steps_relay_s),
            doc.bitwise_equal
        );
        Ok(doc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(k: u64, relay_s: f64, equal: bool) -> RelayRun {
        RelayRun {
            commit: "abc".into(),
            gpu: "H200".into(),
            gpus: 2,
            model: "flux-dev".into(),
            case: "1024".into(),
            resolution: 1024,
            depth: 1,
            helpers: vec![1],
            helper_share: 0.5,
            single_bps: 55e9,
            aggregate_bps: 105e9,
            // 23.7 GB a step: 0.431 s over one link, 0.226 s over both; resident 0.17 s.
            steps_resident_s: vec![0.17; 3],
            steps_single_s: vec![0.431 + k as f64 * 1e-3; 3],
            steps_relay_s: vec![relay_s; 3],
            step_bytes: 23_700_000_000,
            relayed_bytes: 11_850_000_000,
            bitwise_equal: equal,
            output_finite_nonconstant: true,
        }
    }

    #[test]
    fn the_merge_computes_bound_ratio_and_speedup_and_each_target_can_fail() {
        let d = merge(&[run(0, 0.230, true), run(1, 0.231, true), run(2, 0.229, true)], 3).unwrap();
        let c = &d["cases"][0];
        let bound = 23.7 / 105.0;
        assert!((c["bound_s"]["median"].as_f64().unwrap() - bound).abs() < 1e-9, "{c}");
        assert!((c["ratio_to_bound"]["median"].as_f64().unwrap() - 0.230 / bound).abs() < 1e-9);
        assert!((c["speedup"]["median"].as_f64().unwrap() - 0.431 / 0.230).abs() < 1e-9, "{c}");
        assert_eq!(d["meets_targets"], true);
        // Too slow for the bound and the speedup; a wrong output; too few runs; mixed commits.
        assert_eq!(merge(&[run(0, 0.26, true), run(1, 0.26, true), run(2, 0.26, true)], 3).unwrap()["meets_targets"], false);
        assert_eq!(merge(&[run(0, 0.23, true), run(1, 0.23, false), run(2, 0.23, true)], 3).unwrap()["meets_targets"], false);
        assert!(merge(&[run(0, 0.23, true)], 3).is_err());
        let mut mixed = vec![run(0, 0.23, true), run(1, 0.23, true), run(2, 0.23, true)];
        mixed[1].commit = "def".into();
        assert!(merge(&mixed, 3).is_err());
        // Nothing carried by a helper: not relay, whatever the times say.
        let mut idle = vec![run(0, 0.23, true), run(1, 0.23, true), run(2, 0.23, true)];
        idle[0].relayed_bytes = 0;
        assert_eq!(merge(&idle, 3).unwrap()["meets_targets"], false);
    }
}
