//! cuda's file: the registry's dual- and single-stream blocks computed with raw
//! CUDA by [`offload_cuda::reference::RefNet`] (cuBLAS GEMMs, batched-GEMM
//! attention, small NVRTC kernels; no rotary positions, no embedders: the hidden
//! states start from seeded values), each block read from the slot a
//! [`Ring`] serves. The resident reference is the same compute from a ring whose
//! plan keeps every block resident (loaded once, never streamed).

use crate::harness::{check_output, spread, RunCase, RunDoc, RunOptions};
use crate::registry::{dual_names, BlockKind, Case, Model};
use crate::source::RegistrySource;
use offload_core::{resolve, BlockDiscovery, DeclaredStacks, HostStore, OffloadBackend, Plan, Ring};
use offload_cuda::reference::{DualNames, RefDims, RefNet, HEAD_DIM};
use offload_cuda::CudaBackend;
use std::sync::Arc;
use std::time::Instant;

fn err(what: impl std::fmt::Display) -> String {
    format!("cuda: {what}")
}

/// Whether cuda's file computes `model`: dual- and single-stream blocks without
/// per-block overrides, heads of 128.
pub fn computes(model: &Model) -> bool {
    model.computed() && model.head_dim == HEAD_DIM
}

fn dims(model: &Model, case: &Case) -> Result<RefDims, String> {
    if case.batch != 1 {
        return Err(err(format!("{} {}: the reference model runs batch 1, the case has {}", model.name, case.name, case.batch)));
    }
    Ok(RefDims { heads: model.heads, mlp: model.mlp, text_tokens: case.text_tokens, image_tokens: case.image_tokens })
}

/// One forward call through `ring`, every block in the registry's order.
fn step(model: &Model, net: &mut RefNet, ring: &mut Ring<CudaBackend>) -> offload_core::Result<()> {
    let n = dual_names(model);
    let names = DualNames { img_mod: n.img_mod, txt_mod: n.txt_mod, img_mlp: n.img_mlp, txt_mlp: n.txt_mlp };
    net.begin_step()?;
    for s in &model.stacks {
        for i in 0..s.count {
            let block = ring.block(s.prefix, i)?;
            match s.kind {
                BlockKind::DualStream => net.dual_block(&block, &names)?,
                BlockKind::SingleStream => net.single_block(&block)?,
                other => return Err(offload_core::Error::unsupported("cuda (bench room)", format!("{other:?} blocks ({}.{i})", s.prefix))),
            }
            block.finish()?;
        }
    }
    ring.end_step()?;
    Ok(())
}

/// Build `model`'s host store (random bf16, pinned) on GPU 0 and, per case, time
/// the reference model resident (every block loaded once) and streamed at every
/// depth, in this process.
pub fn run(model: &Model, opts: &RunOptions) -> Result<RunDoc, String> {
    if !computes(model) {
        return Err(err(format!("{}: the reference model computes dual- and single-stream blocks with heads of 128 only", model.name)));
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let median = |v: &[f64]| spread(v).map_or(f64::NAN, |s| s.median);
    let be = CudaBackend::new(0).map_err(err)?;
    let cases: Vec<&Case> = opts.cases.iter().map(|c| model.case(c)).collect::<Result<_, _>>()?;
    let src = RegistrySource::new(model, 0);
    let prefixes: Vec<&str> = model.stacks.iter().map(|s| s.prefix).collect();
    // Blocks only: the reference model has no embedders, so no non-block weights
    // go to the device (resident bytes 0).
    let mut inv = DeclaredStacks::new(prefixes).discover("transformer", offload_core::TensorSource::specs(&src)).map_err(err)?;
    inv.non_block.clear();
    let t = Instant::now();
    let store = Arc::new(HostStore::build(&be, &inv, &src).map_err(err)?);
    let facts = crate::harness::store_facts(&be, &store, t).map_err(err)?;
    let (total, bandwidth) = (facts.total, facts.bandwidth);
    let timed = |net: &mut RefNet, ring: &mut Ring<CudaBackend>| -> Result<Vec<f64>, String> {
        for _ in 0..opts.warmup {
            step(model, net, ring).map_err(err)?;
        }
        let mut times = Vec::new();
        for _ in 0..opts.steps {
            be.synchronize().map_err(err)?;
            let t = Instant::now();
            step(model, net, ring).map_err(err)?;
            be.synchronize().map_err(err)?;
            times.push(t.elapsed().as_secs_f64());
        }
        Ok(times)
    };
    let as_f32 = |v: &[u16]| v.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect::<Vec<f32>>();
    let mut out_cases = Vec::new();
    for c in &cases {
        let before = be.pool_used_bytes().map_err(err)?.0;
        let mut net = RefNet::new(&be, dims(model, c)?, c.resolution as u64).map_err(err)?;
        be.synchronize().map_err(err)?;
        let activations = be.pool_used_bytes().map_err(err)?.0.saturating_sub(before);
        let resident_plan = resolve(&Plan::resident(), std::slice::from_ref(&inv)).map_err(err)?.components.remove(0);
        let mut ring = Ring::new(be.clone(), store.clone(), &resident_plan).map_err(err)?;
        let rtimes = timed(&mut net, &mut ring)?;
        let rout = net.output().map_err(err)?;
        ring.close().map_err(err)?;
        eprintln!("{} {}: resident step {:.4} s, activations {:.2} GiB", model.name, c.name, median(&rtimes), gib(activations));
        for &d in &opts.depths {
            let rc = resolve(&Plan::layerwise().prefetch_depth(d), std::slice::from_ref(&inv)).map_err(err)?.components.remove(0);
            be.synchronize().map_err(err)?;
            be.reset_peak();
            let mut ring = Ring::new(be.clone(), store.clone(), &rc).map_err(err)?;
            let times = timed(&mut net, &mut ring)?;
            let out = net.output().map_err(err)?;
            let misses = ring.metrics().misses;
            ring.close().map_err(err)?;
            let weights = be.counters().peak_bytes;
            let equal = out == rout;
            let (finite, nonconstant) = check_output(&as_f32(&out));
            let streamed = median(&times);
            let bound = median(&rtimes).max(total as f64 / bandwidth);
            eprintln!(
                "{} {} d={d}: streamed {streamed:.4} s, bound {bound:.4} s, ratio {:.4}, weights {:.2} GiB, bitwise_equal {equal}, \
                 finite {finite}, nonconstant {nonconstant}, misses {misses}",
                model.name,
                c.name,
                streamed / bound,
                gib(weights)
            );
            out_cases.push(RunCase {
                steps_resident_s: rtimes.clone(),
                steps_streamed_s: times,
                streamed_bytes: total,
                bandwidth_gbps: bandwidth / 1e9,
                weights_device_bytes: weights,
                weights_device_bytes_derived: weights,
                activations_peak_bytes: activations,
                bitwise_equal: equal,
                output_finite: finite,
                output_nonconstant: nonconstant,
                misses,
                ..RunCase::head(model, c, d)
            });
        }
    }
    Ok(RunDoc::new(opts, be.device_name().unwrap_or_default(), "cuda", &facts, 0, out_cases))
}
