//! The compressed results file from `zoo run --backend cuda --coded`
//! process runs (raw and coded streamed steps of the same weights in one process)
//! and the decoder's speed files (`codec_speed --json`): per case and depth,
//! medians over the runs of each run's own median with min and max, the
//! uncompressed bound `max(resident step, raw bytes ÷ bandwidth)` and every ratio
//! computed per run, then spread; the targets are the constants below, judged
//! per case as transfer- or compute-bound. Both streamed runs bitwise equal to
//! the resident one, every run.

use crate::harness::{median as med, spread, PlannerCoding, RunDoc};
use offload_plan::CostModel;
use serde_json::{json, Value};

/// The planner's coding choice for "every block streamed at `depth`" on `m` (each
/// block with its coded cost): [`offload_plan::Choice::with_coding`], which codes
/// only where the replayed step gains more than [`offload_plan::CODING_GAIN`].
pub fn coding_choice(m: &CostModel, depth: usize) -> PlannerCoding {
    let raw = offload_plan::streamed_choice(m, depth);
    PlannerCoding {
        coded: raw.with_coding(m, u64::MAX).coded,
        predicted_raw_s: raw.predicted_step_s,
        predicted_coded_s: m.simulate_coded_s(&raw.resident, depth, true),
    }
}

/// Coded size over raw, at most.
pub const RATIO_TARGET: f64 = 0.70;
/// Decoder output, GB/s, at least.
pub const DECODE_TARGET_GBPS: f64 = 400.0;
/// Coded step over the uncompressed bound where transfer-bound, at most.
pub const BOUND_TARGET: f64 = 0.78;
/// Where compute-bound: the step the planner chose over the one it declined (the
/// coded step over the raw one without a planner's choice), at most. The same
/// 1 % the planner asks of coding before it codes ([`offload_plan::CODING_GAIN`]).
pub const COMPUTE_BOUND_TARGET: f64 = 1.01;

fn s(xs: &[f64]) -> Value {
    crate::harness::sp(spread(xs))
}

/// The results file from `runs` (at least `min_runs` process runs of one model,
/// all with `--coded`) and `codec` (`codec_speed` outputs: `decode_gbps`).
pub fn merge(runs: &[RunDoc], codec: &[Value], min_runs: usize) -> Result<Value, String> {
    if runs.len() < min_runs {
        return Err(format!("{} process runs, at least {min_runs} needed", runs.len()));
    }
    crate::harness::one_gpu("merge-compressed", runs.iter().map(|r| r.gpu.as_str()))?;
    let facts = runs
        .iter()
        .map(|r| r.coded.as_ref().ok_or_else(|| format!("a run at {} made without --coded", r.commit)))
        .collect::<Result<Vec<_>, _>>()?;
    if runs.iter().any(|r| r.no_gemm) {
        return Err("a run made with --no-gemm is not a measurement".into());
    }
    if facts.iter().any(|f| f.high_priority_decode != facts[0].high_priority_decode) {
        return Err("runs with and without --high-priority-decode: merge each on its own".into());
    }
    if facts.iter().any(|f| f.high_priority_compute != facts[0].high_priority_compute) {
        return Err("runs with and without --high-priority-compute: merge each on its own".into());
    }
    // The decoder's speed per buffer size (`mib`): sizes are not repeats of one
    // measurement, so each has its own median and the figure is the slowest size's.
    if codec.iter().any(|c| c["decode_gbps"].as_f64().is_none() || c["bit_exact"] == false) {
        return Err("a codec file without decode_gbps, or one whose decode was not bit-exact".into());
    }
    let by_mib = crate::harness::group_by(codec, |c| c["mib"].as_u64());
    let sizes: Vec<(Option<u64>, Vec<f64>)> =
        by_mib.into_iter().map(|(mib, cs)| (mib, cs.iter().filter_map(|c| c["decode_gbps"].as_f64()).collect())).collect();
    let slowest = sizes.iter().map(|(_, xs)| med(xs)).fold(f64::INFINITY, f64::min);
    let decode: Vec<f64> = if sizes.is_empty() { Vec::new() } else { vec![slowest] };
    let first = &runs[0];
    let mut cases = Vec::new();
    let mut all_met = true;
    for c in &first.cases {
        let per: Vec<_> = runs
            .iter()
            .map(|r| {
                r.cases
                    .iter()
                    .find(|x| x.model == c.model && x.case == c.case && x.depth == c.depth)
                    .ok_or_else(|| format!("{} {} d={} missing from a run", c.model, c.case, c.depth))
            })
            .collect::<Result<_, _>>()?;
        if per.iter().any(|x| x.steps_streamed_coded_s.is_empty()) {
            return Err(format!("{} {} d={}: a run without coded steps", c.model, c.case, c.depth));
        }
        let (mut res, mut raw, mut cod, mut bound, mut ratio, mut over_raw) = (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut transfer_bound = Vec::new();
        for x in &per {
            // A bandwidth of 0 makes the bound infinite and every ratio 0: a pass.
            if !(x.bandwidth_gbps.is_finite() && x.bandwidth_gbps > 0.0) || x.streamed_bytes == 0 {
                return Err(format!(
                    "{} {} d={}: a run measured {} GB/s for {} streamed bytes",
                    c.model, c.case, c.depth, x.bandwidth_gbps, x.streamed_bytes
                ));
            }
            let (r, st, cs) = (med(&x.steps_resident_s), med(&x.steps_streamed_s), med(&x.steps_streamed_coded_s));
            let bytes_s = x.streamed_bytes as f64 / (x.bandwidth_gbps * 1e9);
            let b = r.max(bytes_s);
            res.push(r);
            raw.push(st);
            cod.push(cs);
            bound.push(b);
            ratio.push(cs / b);
            over_raw.push(cs / st);
            transfer_bound.push(bytes_s > r);
        }
        let equal = per.iter().all(|x| x.bitwise_equal && x.coded_bitwise_equal == Some(true));
        let finite = per.iter().all(|x| x.output_finite && x.output_nonconstant);
        let tb = transfer_bound.iter().filter(|&&t| t).count() * 2 > transfer_bound.len();
        // The planner's choice, where the runs asked it (all or none): coded if most
        // runs' planners coded. The planned step is then the coded or the raw one.
        let plans: Vec<&PlannerCoding> = per.iter().filter_map(|x| x.planner.as_ref()).collect();
        let planner = match plans.len() {
            0 => None,
            n if n == per.len() => Some(plans.iter().filter(|p| p.coded).count() * 2 > n),
            _ => return Err(format!("{} {} d={}: the planner's choice in some runs only", c.model, c.case, c.depth)),
        };
        let planned_over_raw: Vec<f64> = over_raw.iter().map(|&o| if planner == Some(true) { o } else { 1.0 }).collect();
        let planned: Vec<f64> = raw.iter().zip(&cod).map(|(&r, &c)| if planner == Some(true) { c } else { r }).collect();
        // Per run, the step the planner chose over the one it declined: coded over
        // raw where it coded, raw over coded where it left the case raw. The
        // planned step over the raw one is 1 by construction for a raw choice, so
        // it cannot judge that choice; this can.
        let planned_over_declined: Vec<f64> = over_raw.iter().map(|&o| if planner == Some(true) { o } else { 1.0 / o }).collect();
        let planned_ratio: Vec<f64> = planned.iter().zip(&bound).map(|(p, b)| p / b).collect();
        // Transfer-bound: the coded step under 0.78 × the bound, and (where asked)
        // the planner coding it. Compute-bound: the step as planned within 1 % of
        // the one declined (without a planner, the coded step within 1 % of the raw).
        let (kind, met_step) = match (tb, planner) {
            (true, p) => ("transfer-bound", p != Some(false) && med(&ratio) <= BOUND_TARGET),
            (false, None) => ("compute-bound", med(&over_raw) <= COMPUTE_BOUND_TARGET),
            (false, Some(_)) => ("compute-bound", med(&planned_over_declined) <= COMPUTE_BOUND_TARGET),
        };
        let met = met_step && equal && finite;
        all_met &= met;
        cases.push(json!({
            "model": c.model, "case": c.case, "resolution": c.resolution, "depth": c.depth, "repeats": per.len(),
            "step_resident_s": s(&res), "step_streamed_raw_s": s(&raw), "step_streamed_compressed_s": s(&cod),
            // `ratio_to_uncompressed_bound` is the coded step's, whatever the planner
            // chose: what coding costs or gains against the raw bound, beside the
            // chosen step's own (`planned_ratio_to_bound`).
            "bound_uncompressed_s": s(&bound), "ratio_to_uncompressed_bound": s(&ratio), "compressed_over_raw_streamed": s(&over_raw),
            "raw_step": kind, "planner_codes": planner,
            "planner_predicted_raw_s": s(&plans.iter().map(|p| p.predicted_raw_s).collect::<Vec<_>>()),
            "planner_predicted_coded_s": s(&plans.iter().map(|p| p.predicted_coded_s).collect::<Vec<_>>()),
            "step_streamed_planned_s": if planner.is_some() { s(&planned) } else { Value::Null },
            "planned_over_raw_streamed": if planner.is_some() { s(&planned_over_raw) } else { Value::Null },
            "planned_over_declined": if planner.is_some() { s(&planned_over_declined) } else { Value::Null },
            "planned_ratio_to_bound": if planner.is_some() { s(&planned_ratio) } else { Value::Null },
            "bitwise_equal": equal, "output_finite_nonconstant": finite, "meets_targets": met,
        }));
    }
    let ratio: Vec<f64> = facts.iter().map(|f| f.compression_ratio).collect();
    // A ratio of 0 (no coded bytes counted) would pass the ratio target.
    if ratio.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
        return Err(format!("a coded store's compression ratio is not a measurement: {ratio:?}"));
    }
    let ratio_met = med(&ratio) <= RATIO_TARGET;
    let decode_met = !decode.is_empty() && med(&decode) >= DECODE_TARGET_GBPS;
    Ok(json!({
        "date": first.date, "commit": crate::harness::joined(runs.iter().map(|r| r.commit.as_str())),
        "gpu": first.gpu, "backend": first.backend, "process_runs": runs.len(),
        "weights": "normal, each tensor centred on its init range's middle with that uniform range's standard deviation (RegistrySource::normal)",
        "compression_ratio": med(&ratio), "compression_ratio_spread": s(&ratio),
        "exponent_entropy_bits": med(&facts.iter().map(|f| f.exponent_entropy_bits).collect::<Vec<_>>()),
        "tensor_entropy_bits": {
            "min": facts.iter().map(|f| f.tensor_entropy_bits_min).fold(f64::INFINITY, f64::min),
            "median": med(&facts.iter().map(|f| f.tensor_entropy_bits_median).collect::<Vec<_>>()),
            "max": facts.iter().map(|f| f.tensor_entropy_bits_max).fold(f64::NEG_INFINITY, f64::max),
        },
        "encode_gbps_host": med(&facts.iter().map(|f| f.encode_gbps_host).collect::<Vec<_>>()),
        "encode_gbps_host_spread": s(&facts.iter().map(|f| f.encode_gbps_host).collect::<Vec<_>>()),
        "encode_threads": facts[0].encode_threads,
        "high_priority_decode": facts[0].high_priority_decode,
        "high_priority_compute": facts[0].high_priority_compute,
        "coded_store_build_s": s(&facts.iter().map(|f| f.store_build_s).collect::<Vec<_>>()),
        "decode_gbps": if decode.is_empty() { Value::Null } else { json!(slowest) },
        "decode_gbps_by_mib": sizes.iter().map(|(mib, xs)| json!({"mib": mib, "runs": xs.len(), "decode_gbps": s(xs)})).collect::<Vec<_>>(),
        "decode_gbps_in_run": s(&facts.iter().map(|f| f.decode_gbps_in_run).filter(|&g| g > 0.0).collect::<Vec<_>>()),
        "bandwidth_gbps": med(&runs.iter().flat_map(|r| r.cases.first()).map(|c| c.bandwidth_gbps).collect::<Vec<_>>()),
        "staging_peak_bytes": facts.iter().map(|f| f.staging_peak_bytes).max(),
        "targets": {"compression_ratio_max": RATIO_TARGET, "decode_gbps_min": DECODE_TARGET_GBPS,
                    "ratio_to_uncompressed_bound_max_transfer_bound": BOUND_TARGET, "compressed_over_raw_max_compute_bound": COMPUTE_BOUND_TARGET,
                    "planned_over_declined_max_compute_bound": COMPUTE_BOUND_TARGET},
        "compression_ratio_met": ratio_met, "decode_met": decode_met,
        "cases": cases,
        "meets_targets": all_met && ratio_met && decode_met,
    }))
}

/// The exponent entropy of every block tensor of `model`'s weights as the coded
/// case draws them (`RegistrySource::normal(model, 0)`, the store `zoo run
/// --coded` builds), computed on the host, `threads` tensors at a time: each
/// tensor's bits, and per tensor name within its stack (`transformer_blocks.*.attn.to_q.weight`)
/// the count, min, median and max: the exponent entropy per tensor.
pub fn tensor_entropies(model: &crate::registry::Model, threads: usize) -> Result<Value, String> {
    use offload_core::codec::{exponent_histogram, histogram_entropy_bits};
    use offload_core::TensorSource;
    let src = crate::source::RegistrySource::normal(model, 0);
    let inv = crate::source::block_inventory(model, src.specs()).map_err(|e| e.to_string())?;
    let index: std::collections::HashMap<&str, usize> = src.specs().iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
    let mut todo: Vec<(String, usize, usize)> = Vec::new();
    for b in inv.blocks() {
        for t in &b.tensors {
            let i = *index.get(t.name.as_str()).ok_or_else(|| format!("{}: not in the source", t.name))?;
            let kind = t.name.replacen(&format!("{}.", b.id), &format!("{}.*.", b.id.stack), 1);
            todo.push((kind, i, t.nbytes().map_err(|e| e.to_string())?));
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Result<Vec<(usize, f64)>, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((_, i, n)) = todo.get(k) else { break };
                        let mut buf = vec![0u8; *n];
                        src.read_into(*i, &mut buf).map_err(|e| e.to_string())?;
                        out.push((k, histogram_entropy_bits(&exponent_histogram(&buf))));
                    }
                    Ok(out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let mut bits = vec![f64::NAN; todo.len()];
    for r in results {
        for (k, b) in r? {
            bits[k] = b;
        }
    }
    let mut kinds: Vec<(String, Vec<f64>)> = Vec::new();
    for ((kind, _, _), &b) in todo.iter().zip(&bits) {
        match kinds.iter_mut().find(|(k, _)| k == kind) {
            Some((_, v)) => v.push(b),
            None => kinds.push((kind.clone(), vec![b])),
        }
    }
    let specs = src.specs();
    Ok(json!({
        "model": model.name,
        "weights": "normal, each tensor centred on its init range's middle with that uniform range's standard deviation (RegistrySource::normal, seed 0: the coded case's store)",
        "tensors": todo.len(),
        "by_name": kinds.iter().map(|(k, v)| {
            let sp = spread(v).expect("at least one tensor");
            json!({"name": k, "count": v.len(), "bits_min": sp.min, "bits_median": sp.median, "bits_max": sp.max})
        }).collect::<Vec<_>>(),
        "each": todo.iter().zip(&bits).map(|((_, i, _), b)| json!({"name": specs[*i].name, "bits": b})).collect::<Vec<_>>(),
    }))
}

#[cfg(test)]
mod tests {
    /// Every block tensor of a (shrunk) model gets its entropy, the one of its
    /// bytes as the coded case's source reads them; per name, the counts add up
    /// to every tensor, and a stack's norms (narrow, near one) carry fewer bits
    /// than its matrices.
    #[test]
    fn tensor_entropies_cover_every_block_tensor() {
        use offload_core::codec::{exponent_histogram, histogram_entropy_bits};
        use offload_core::TensorSource;
        let model = crate::registry::tiny(&crate::registry::model("flux-dev").unwrap());
        let doc = super::tensor_entropies(&model, 2).unwrap();
        let each = doc["each"].as_array().unwrap();
        let src = crate::source::RegistrySource::normal(&model, 0);
        let blocks = src.specs().iter().filter(|s| model.stacks.iter().any(|st| s.name.starts_with(&format!("{}.", st.prefix)))).count();
        assert_eq!((doc["tensors"].as_u64(), each.len()), (Some(blocks as u64), blocks), "every block tensor once");
        let counted: u64 = doc["by_name"].as_array().unwrap().iter().map(|k| k["count"].as_u64().unwrap()).sum();
        assert_eq!(counted, blocks as u64);
        for e in each {
            let name = e["name"].as_str().unwrap();
            let i = src.specs().iter().position(|s| s.name == name).unwrap();
            let mut buf = vec![0u8; src.specs()[i].nbytes().unwrap()];
            src.read_into(i, &mut buf).unwrap();
            assert_eq!(e["bits"].as_f64(), Some(histogram_entropy_bits(&exponent_histogram(&buf))), "{name}");
        }
        let kind = |n: &str| doc["by_name"].as_array().unwrap().iter().find(|k| k["name"] == n).unwrap()["bits_median"].as_f64().unwrap();
        assert!(kind("single_transformer_blocks.*.attn.norm_q.weight") < kind("single_transformer_blocks.*.attn.to_q.weight"));
    }

    use super::*;
    use crate::harness::{CodedFacts, RunCase};

    fn run(k: f64, coded_1024: f64, coded_2048: f64) -> RunDoc {
        let case = |name: &str, res: f64, raw: f64, coded: f64| RunCase {
            model: "flux-dev".into(),
            case: name.into(),
            resolution: name.parse().unwrap(),
            depth: 1,
            steps_resident_s: vec![res * k; 5],
            steps_streamed_s: vec![raw * k; 5],
            steps_streamed_coded_s: vec![coded * k; 5],
            streamed_bytes: 22_000_000_000,
            bandwidth_gbps: 55.0,
            bitwise_equal: true,
            coded_bitwise_equal: Some(true),
            output_finite: true,
            output_nonconstant: true,
            ..RunCase::default()
        };
        RunDoc {
            commit: "abc".into(),
            gpu: "H200".into(),
            backend: "cuda".into(),
            cases: vec![case("1024", 0.17, 0.40, coded_1024), case("2048", 0.80, 0.805, coded_2048)],
            coded: Some(CodedFacts {
                compression_ratio: 0.665,
                exponent_entropy_bits: 2.55,
                encode_gbps_host: 3.0,
                ..CodedFacts::default()
            }),
            ..RunDoc::default()
        }
    }

    #[test]
    fn bounds_ratios_and_targets_are_computed_per_run_then_spread() {
        let codec = vec![json!({"decode_gbps": 500.0}), json!({"decode_gbps": 520.0})];
        let runs = vec![run(1.0, 0.29, 0.806), run(1.01, 0.29, 0.806), run(0.99, 0.29, 0.806)];
        let d = merge(&runs, &codec, 3).unwrap();
        let c = &d["cases"][0];
        // 22 GB ÷ 55 GB/s = 0.4 s bound (transfer-bound): 0.29 ÷ 0.4 = 0.725.
        assert_eq!(c["raw_step"], "transfer-bound");
        assert!((c["ratio_to_uncompressed_bound"]["median"].as_f64().unwrap() - 0.725).abs() < 1e-9, "{c}");
        assert_eq!(c["meets_targets"], true);
        assert_eq!(d["cases"][1]["raw_step"], "compute-bound");
        assert_eq!(d["cases"][1]["meets_targets"], true, "0.806 ÷ 0.805 within 1 %");
        assert_eq!(d["meets_targets"], true);
        assert_eq!(d["decode_gbps"], 510.0, "two runs of one size: their median");
        // Two sizes are two measurements, not repeats: the slowest size's figure,
        // each size beside it; a decode that was not bit-exact is refused.
        let sizes = vec![json!({"mib": 256, "decode_gbps": 700.0}), json!({"mib": 1024, "decode_gbps": 800.0})];
        let d2 = merge(&runs, &sizes, 3).unwrap();
        assert_eq!(d2["decode_gbps"], 700.0);
        assert_eq!(d2["decode_gbps_by_mib"][1]["decode_gbps"]["median"], 800.0);
        let inexact = vec![json!({"mib": 256, "decode_gbps": 700.0, "bit_exact": false})];
        assert!(merge(&runs, &inexact, 3).unwrap_err().contains("bit-exact"));
        // Each target can fail: a slow coded step, a compute-bound slowdown, a
        // slow decoder, too few runs, a run without --coded, a bitwise miss.
        let slow = vec![run(1.0, 0.33, 0.806), run(1.0, 0.33, 0.806), run(1.0, 0.33, 0.806)];
        assert_eq!(merge(&slow, &codec, 3).unwrap()["cases"][0]["meets_targets"], false);
        let heavy = vec![run(1.0, 0.29, 0.83), run(1.0, 0.29, 0.83), run(1.0, 0.29, 0.83)];
        assert_eq!(merge(&heavy, &codec, 3).unwrap()["cases"][1]["meets_targets"], false);
        assert_eq!(merge(&runs, &[json!({"decode_gbps": 300.0})], 3).unwrap()["meets_targets"], false);
        assert!(merge(&runs[..2], &codec, 3).is_err());
        // A bandwidth or a compression ratio of 0 is no measurement (each would pass its target).
        let mut zero = runs.clone();
        zero[1].cases[0].bandwidth_gbps = 0.0;
        assert!(merge(&zero, &codec, 3).unwrap_err().contains("0 GB/s"));
        let mut uncounted = runs.clone();
        uncounted[2].coded.as_mut().unwrap().compression_ratio = 0.0;
        assert!(merge(&uncounted, &codec, 3).unwrap_err().contains("compression ratio"));
        let mut plain = runs.clone();
        plain[1].coded = None;
        assert!(merge(&plain, &codec, 3).is_err());
        let mut wrong = runs.clone();
        wrong[2].cases[0].coded_bitwise_equal = Some(false);
        let w = merge(&wrong, &codec, 3).unwrap();
        assert_eq!(w["cases"][0]["bitwise_equal"], false);
        assert_eq!(w["cases"][0]["meets_targets"], false);
        assert_eq!(w["meets_targets"], false);
    }

    fn planned(mut r: RunDoc, code_1024: bool, code_2048: bool) -> RunDoc {
        for (c, coded) in r.cases.iter_mut().zip([code_1024, code_2048]) {
            c.planner = Some(PlannerCoding { coded, predicted_raw_s: 0.4, predicted_coded_s: 0.3 });
        }
        r
    }

    #[test]
    fn the_planners_choice_decides_the_compute_bound_case_and_must_code_the_transfer_bound_one() {
        let codec = vec![json!({"decode_gbps": 500.0})];
        // Forced coding at 2048 is 2.5 % slower than raw; the planner leaves it raw.
        let runs: Vec<RunDoc> = (0..3).map(|_| planned(run(1.0, 0.29, 0.825), true, false)).collect();
        let d = merge(&runs, &codec, 3).unwrap();
        let c = &d["cases"][1];
        assert_eq!(c["planner_codes"], false);
        assert!((c["compressed_over_raw_streamed"]["median"].as_f64().unwrap() - 0.825 / 0.805).abs() < 1e-9, "still reported: {c}");
        assert_eq!(c["planned_over_raw_streamed"]["median"], 1.0);
        assert!((c["planned_over_declined"]["median"].as_f64().unwrap() - 0.805 / 0.825).abs() < 1e-9, "{c}");
        assert!((c["planned_ratio_to_bound"]["median"].as_f64().unwrap() - 0.805 / 0.80).abs() < 1e-9, "{c}");
        assert!((c["ratio_to_uncompressed_bound"]["median"].as_f64().unwrap() - 0.825 / 0.80).abs() < 1e-9, "the coded step's: {c}");
        assert_eq!(c["meets_targets"], true);
        assert_eq!(d["meets_targets"], true);
        // The planner coding 2048 anyway: its slowdown counts.
        let wrong: Vec<RunDoc> = (0..3).map(|_| planned(run(1.0, 0.29, 0.825), true, true)).collect();
        assert_eq!(merge(&wrong, &codec, 3).unwrap()["cases"][1]["meets_targets"], false);
        // The planner not coding the transfer-bound case misses it, however fast coding was.
        let timid: Vec<RunDoc> = (0..3).map(|_| planned(run(1.0, 0.29, 0.806), false, false)).collect();
        let t = merge(&timid, &codec, 3).unwrap();
        assert_eq!(t["cases"][0]["meets_targets"], false);
        assert_eq!(t["meets_targets"], false);
        // Planned in some runs only: an error, not a guess.
        let mut mixed: Vec<RunDoc> = (0..3).map(|_| planned(run(1.0, 0.29, 0.806), true, false)).collect();
        mixed[1].cases[0].planner = None;
        assert!(merge(&mixed, &codec, 3).is_err());
    }

    /// A compute-bound case the planner leaves raw is judged against the coded
    /// step it declined: here coding would have been 3.2 % faster, so it misses.
    #[test]
    fn a_raw_choice_is_judged_against_the_coded_step_it_declined() {
        let codec = vec![json!({"decode_gbps": 500.0})];
        let runs: Vec<RunDoc> = (0..3)
            .map(|_| {
                let mut r = planned(run(1.0, 0.29, 0.78), true, false);
                r.cases[1].steps_resident_s = vec![0.70; 5];
                r
            })
            .collect();
        let d = merge(&runs, &codec, 3).unwrap();
        let c = &d["cases"][1];
        assert_eq!((c["raw_step"].as_str(), c["planner_codes"].as_bool()), (Some("compute-bound"), Some(false)), "{c}");
        assert_eq!(c["meets_targets"], false, "coding was faster by more than 1 %: {c}");
        assert_eq!(d["meets_targets"], false);
        assert_eq!(c["planned_over_raw_streamed"]["median"], 1.0, "1 by construction: not what is judged");
        assert!((c["planned_over_declined"]["median"].as_f64().unwrap() - 0.805 / 0.78).abs() < 1e-9, "{c}");
        assert!((c["ratio_to_uncompressed_bound"]["median"].as_f64().unwrap() - 0.78 / 0.70).abs() < 1e-9, "{c}");
        assert!((c["planned_ratio_to_bound"]["median"].as_f64().unwrap() - 0.805 / 0.70).abs() < 1e-9, "{c}");
        // Coding 0.5 % faster is within the planner's own 1 % threshold: a right choice.
        let close: Vec<RunDoc> = (0..3).map(|_| planned(run(1.0, 0.29, 0.801), true, false)).collect();
        assert_eq!(merge(&close, &codec, 3).unwrap()["cases"][1]["meets_targets"], true);
    }

    #[test]
    fn coding_choice_codes_a_transfer_bound_model_and_not_a_compute_bound_one() {
        use offload_plan::{BlockCost, CodedCost};
        // 10 blocks of 400 MB at 55 GB/s (7.3 ms a copy), coded to 0.67, decoded at 500 GB/s.
        let model = |compute_s: f64| CostModel {
            bandwidth_bytes_per_s: 55e9,
            blocks: (0..10)
                .map(|i| BlockCost {
                    coded: Some(CodedCost { bytes: 268_000_000, decode_s: 400e6 / 500e9 }),
                    ..BlockCost::new(format!("b.{i}"), 400_000_000, compute_s)
                })
                .collect(),
            non_block_bytes: 0,
            source: "test".into(),
            staging_buffers: offload_plan::DEFAULT_STAGING_BUFFERS,
            step_gap_s: 0.0,
        };
        let fast = coding_choice(&model(0.004), 2);
        assert!(fast.coded, "{fast:?}");
        assert!(fast.predicted_coded_s < fast.predicted_raw_s * 0.8, "{fast:?}");
        let slow = coding_choice(&model(0.040), 2);
        assert!(!slow.coded, "compute-bound: {slow:?}");
    }
}
