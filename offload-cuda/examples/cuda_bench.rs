//! The cuda benchmark: offload-cuda's reference model ([`offload_cuda::reference`])
//! with Flux-dev's block shapes (19 dual-stream blocks, 38 single-stream blocks,
//! hidden 3072, MLP 12288, bf16, random weights, diffusers' names), whose compute
//! is real — cuBLAS GEMMs for every linear layer, attention as batched GEMMs
//! around an NVRTC softmax, LayerNorm-modulation, QK RMSNorm, GELU and gated
//! residual kernels — run all-resident and streamed (d = 1, 2) in one process, with
//! the pinned host-to-device bandwidth measured in the same run, and, with
//! `--budgets`, the planner's choice under each device budget, calibrated from the
//! resident run's per-block times. The bench room (`bench/`, `zoo run --backend
//! cuda`) runs the same model beside the other backends; this example keeps the
//! planner's budget runs and the per-block calibration.
//!
//! `cuda_bench [--resolutions 1024,2048] [--depths 1,2] [--steps 5] [--double 19]
//! [--single 38] [--budgets 8,12,16] [--no-gemm] [--trace F] [--out results.json]`.
//! Needs a CUDA GPU; built by `cargo xtask gpu-bundle`, run by `.bundle/gpu-run.sh`.

use cudarc::driver::{sys, CudaEvent, CudaStream};
use offload_core::{
    resolve, BlockDiscovery, DType, DeclaredStacks, Error, HostStore, OffloadBackend, Plan, Result, Ring, TensorSource, TensorSpec,
};
use offload_core::{ResidentPolicy, Strategy};
use offload_cuda::reference::{DualNames, RefDims, RefNet};
use offload_cuda::CudaBackend;
use offload_plan::{BlockCost, CostModel};
use std::sync::Arc;
use std::time::Instant;

const H: usize = 3072;
const MLP: usize = 12288;
const HEADS: usize = 24;
const HD: usize = 128;
const TXT: usize = 512;
const FLUX: DualNames<'static> =
    DualNames { img_mod: "norm1.linear", txt_mod: "norm1_context.linear", img_mlp: "ff", txt_mlp: "ff_context" };

fn dev(during: &str, e: impl std::fmt::Display) -> Error {
    Error::device("cuda", during, e)
}

/// Flux-dev's block tensors in diffusers' names and shapes, bf16.
fn flux_specs(double: usize, single: usize) -> Vec<TensorSpec> {
    let mut v = Vec::new();
    let mut t = |name: String, shape: Vec<usize>| v.push(TensorSpec::new(name, DType::BF16, shape));
    let lin = |t: &mut dyn FnMut(String, Vec<usize>), name: String, out: usize, k: usize| {
        t(format!("{name}.weight"), vec![out, k]);
        t(format!("{name}.bias"), vec![out]);
    };
    for i in 0..double {
        let p = format!("transformer_blocks.{i}");
        lin(&mut t, format!("{p}.norm1.linear"), 6 * H, H);
        lin(&mut t, format!("{p}.norm1_context.linear"), 6 * H, H);
        for n in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
            t(format!("{p}.attn.{n}.weight"), vec![HD]);
        }
        for l in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"] {
            lin(&mut t, format!("{p}.attn.{l}"), H, H);
        }
        for f in ["ff", "ff_context"] {
            lin(&mut t, format!("{p}.{f}.net.0.proj"), MLP, H);
            lin(&mut t, format!("{p}.{f}.net.2"), H, MLP);
        }
    }
    for i in 0..single {
        let p = format!("single_transformer_blocks.{i}");
        lin(&mut t, format!("{p}.norm.linear"), 3 * H, H);
        lin(&mut t, format!("{p}.proj_mlp"), MLP, H);
        lin(&mut t, format!("{p}.proj_out"), H, H + MLP);
        t(format!("{p}.attn.norm_q.weight"), vec![HD]);
        t(format!("{p}.attn.norm_k.weight"), vec![HD]);
        for l in ["to_q", "to_k", "to_v"] {
            lin(&mut t, format!("{p}.attn.{l}"), H, H);
        }
    }
    v
}

/// Random bf16 weights generated on the fly, straight into the pinned buffers
/// (no second copy of 22 GiB): magnitudes in [2^-8, 2^-4), random signs; norm
/// scales in [1, 2).
struct RandomWeights {
    specs: Vec<TensorSpec>,
    seed: u64,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl TensorSource for RandomWeights {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let name = &self.specs[index].name;
        let scale = name.contains(".norm_") && name.ends_with(".weight");
        let base = splitmix(self.seed ^ (index as u64).wrapping_mul(0x1000_0001));
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).min(32);
        let chunk = dst.len().div_ceil(threads).next_multiple_of(8).max(8);
        std::thread::scope(|s| {
            for (c, part) in dst.chunks_mut(chunk).enumerate() {
                s.spawn(move || {
                    let mut x = splitmix(base ^ c as u64);
                    for pair in part.chunks_mut(8) {
                        x = splitmix(x);
                        for (k, e) in pair.chunks_mut(2).enumerate() {
                            let r = (x >> (16 * k)) as u16;
                            let v: u16 = if scale {
                                0x3F80 | (r & 0x7F) // [1, 2)
                            } else {
                                (r & 0x8000) | ((119 + ((r >> 7) & 3)) << 7) | (r & 0x7F)
                            };
                            e.copy_from_slice(&v.to_le_bytes()[..e.len()]);
                        }
                    }
                });
            }
        });
        Ok(())
    }
}

/// The compute stream (events for the timings and the calibration).
fn compute(be: &CudaBackend) -> &Arc<CudaStream> {
    // The reference model's memory stays on this stream; only events are recorded here.
    // SAFETY: no cudarc slice is shared with another stream.
    unsafe { be.compute_stream() }
}

/// The copy stream (the bandwidth probe's events).
fn copy_stream(be: &CudaBackend) -> &Arc<CudaStream> {
    // SAFETY: only events are recorded on it.
    unsafe { be.copy_stream() }
}

/// The context (events, the device name).
fn context(be: &CudaBackend) -> &Arc<cudarc::driver::CudaContext> {
    // SAFETY: as for `compute`: no cudarc slice is used on two streams.
    unsafe { be.ctx() }
}

struct StepTiming {
    step_s: f64,
    stall_s: f64,
    /// Per block: compute time (from the end of its wait to the start of the next block's).
    block_compute_s: Vec<f64>,
}

fn timing_event(be: &CudaBackend) -> Result<CudaEvent> {
    context(be).new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| dev("event", e))
}

fn elapsed(a: &CudaEvent, b: &CudaEvent) -> Result<f64> {
    Ok(a.elapsed_ms(b).map_err(|e| dev("elapsed", e))? as f64 / 1e3)
}

/// Enqueue one denoising step through `ring`; events bracket each wait of the
/// compute stream for a block (the exposed stall). Nothing here blocks the host.
fn enqueue_step(
    be: &CudaBackend,
    net: &mut RefNet,
    ring: &mut Ring<CudaBackend>,
    double: usize,
    single: usize,
) -> Result<(Vec<(CudaEvent, CudaEvent)>, offload_core::StepMetrics)> {
    let s = compute(be);
    net.begin_step()?;
    let mut stalls = Vec::with_capacity(double + single);
    for (stack, count) in [("transformer_blocks", double), ("single_transformer_blocks", single)] {
        for i in 0..count {
            let before = timing_event(be)?;
            before.record(s).map_err(|e| dev("record", e))?;
            let block = ring.block(stack, i)?;
            let after = timing_event(be)?;
            after.record(s).map_err(|e| dev("record", e))?;
            stalls.push((before, after));
            if stack == "transformer_blocks" {
                net.dual_block(&block, &FLUX)?;
            } else {
                net.single_block(&block)?;
            }
            block.finish()?;
        }
    }
    let metrics = ring.end_step()?;
    Ok((stalls, metrics))
}

/// A warm-up step, then `steps` steps enqueued back to back (no host sync between
/// them, as in a real denoising loop); times come from events read at the end.
fn run_steps(
    be: &CudaBackend,
    net: &mut RefNet,
    ring: &mut Ring<CudaBackend>,
    double: usize,
    single: usize,
    steps: usize,
) -> Result<Vec<StepTiming>> {
    let s = compute(be);
    enqueue_step(be, net, ring, double, single)?;
    s.synchronize().map_err(|e| dev("warm-up", e))?;
    let mut bounds = vec![timing_event(be)?];
    bounds[0].record(s).map_err(|e| dev("record", e))?;
    let mut stalls = Vec::new();
    for _ in 0..steps {
        stalls.push(enqueue_step(be, net, ring, double, single)?.0);
        let e = timing_event(be)?;
        e.record(s).map_err(|e| dev("record", e))?;
        bounds.push(e);
    }
    let mut out = Vec::new();
    for (k, st) in stalls.iter().enumerate() {
        let mut stall_s = 0.0;
        let mut block_compute_s = Vec::with_capacity(st.len());
        for (j, (b, e)) in st.iter().enumerate() {
            stall_s += elapsed(b, e)?;
            let next = if j + 1 < st.len() { &st[j + 1].0 } else { &bounds[k + 1] };
            block_compute_s.push(elapsed(e, next)?);
        }
        out.push(StepTiming { step_s: elapsed(&bounds[k], &bounds[k + 1])?, stall_s, block_compute_s });
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn arg_list(args: &[String], name: &str, default: &str) -> Vec<usize> {
    let v = args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str).unwrap_or(default);
    v.split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

/// One plan's run: per-step timings, the output, peak device bytes, the ring's
/// metrics and the depth the ring ran at.
type PlanRun = (Vec<StepTiming>, Vec<u16>, u64, offload_core::StepMetrics, usize);

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let resolutions = arg_list(&args, "--resolutions", "1024,2048");
    let depths = arg_list(&args, "--depths", "1,2");
    let steps = arg_list(&args, "--steps", "5")[0];
    let double = arg_list(&args, "--double", "19")[0];
    let single = arg_list(&args, "--single", "38")[0];
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let budgets: Vec<usize> = if args.iter().any(|a| a == "--budgets") { arg_list(&args, "--budgets", "") } else { Vec::new() };
    let no_gemm = args.iter().any(|a| a == "--no-gemm");
    let trace = args.iter().position(|a| a == "--trace").and_then(|i| args.get(i + 1)).cloned();
    let traced = std::cell::Cell::new(false);
    let timeline_metrics: std::cell::RefCell<Option<offload_core::StepMetrics>> = std::cell::RefCell::new(None);
    let commit = args.iter().position(|a| a == "--commit").and_then(|i| args.get(i + 1)).cloned().unwrap_or_default();

    let be = CudaBackend::new(0)?;
    let gpu = context(&be).name().unwrap_or_default();
    eprintln!("device: {gpu}");
    let t0 = Instant::now();
    let source = RandomWeights { specs: flux_specs(double, single), seed: 0xF1_0D_E5 };
    let inventory = DeclaredStacks::new(["transformer_blocks", "single_transformer_blocks"]).discover("transformer", source.specs())?;
    let store = Arc::new(HostStore::build(&be, &inventory, &source)?);
    let total_bytes = store.host_bytes();
    eprintln!(
        "host store: {:.2} GiB pinned in {} blocks (largest {:.1} MiB) in {:.1} s",
        total_bytes as f64 / (1u64 << 30) as f64,
        store.blocks().len(),
        store.largest_block_bytes() as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );

    // Pinned host-to-device bandwidth, measured in this run: every block copied
    // once into one slot on the copy stream, twice over, the second pass timed.
    let bandwidth = {
        let mut slot = be.alloc_slot(store.largest_block_bytes(), "bandwidth probe")?;
        let c = copy_stream(&be);
        let mut best = 0.0f64;
        for _pass in 0..3 {
            let (a, b) = (timing_event(&be)?, timing_event(&be)?);
            a.record(c).map_err(|e| dev("record", e))?;
            for blk in store.blocks() {
                be.copy_to_slot(&blk.buffer, &mut slot, blk.bytes(), None)?;
            }
            b.record(c).map_err(|e| dev("record", e))?;
            let s = elapsed(&a, &b)?;
            best = best.max(total_bytes as f64 / s);
        }
        be.free_slot(slot, None)?;
        be.synchronize()?;
        best
    };
    eprintln!("pinned H2D bandwidth: {:.1} GB/s", bandwidth / 1e9);

    let mut cases = Vec::new();
    // Progress on a terminal (hidden when the output is piped, as on the runner).
    let progress = indicatif::ProgressBar::new((resolutions.len() * (1 + depths.len() + budgets.len())) as u64);
    for &res in &resolutions {
        let t = (res / 16) * (res / 16) + TXT;
        let mut a = RefNet::new(&be, RefDims { heads: HEADS, mlp: MLP, text_tokens: TXT, image_tokens: t - TXT }, res as u64)?;
        a.set_skip_gemm(no_gemm);
        let run_plan = |plan: &Plan, a: &mut RefNet| -> Result<PlanRun> {
            let rc = resolve(plan, std::slice::from_ref(&inventory))?.components.remove(0);
            be.synchronize()?;
            be.reset_peak();
            let base = be.counters().live_bytes;
            let mut ring = Ring::new(be.clone(), store.clone(), &rc)?;
            let depth = ring.depth();
            let times = run_steps(&be, a, &mut ring, double, single, steps)?;
            let m = ring.metrics();
            let outv = a.output()?;
            // One more step with the timeline on (after the timed ones, which it would perturb).
            if let (Some(path), Strategy::Layerwise) = (&trace, rc.strategy) {
                if rc.depth == 1 && rc.resident.is_empty() && !traced.get() {
                    traced.set(true);
                    ring.enable_timeline()?;
                    let (_, tm) = enqueue_step(&be, a, &mut ring, double, single)?;
                    eprintln!("timeline step: {tm}");
                    if let Some(tl) = ring.timeline() {
                        tl.write_chrome_trace(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
                    }
                    *timeline_metrics.borrow_mut() = Some(tm);
                }
            }
            ring.close()?;
            be.synchronize()?;
            progress.inc(1);
            Ok((times, outv, be.counters().peak_bytes - base, m, depth))
        };
        let (rt, rout, rpeak, _, _) = run_plan(&Plan::resident(), &mut a)?;
        let resident_s = median(rt.iter().map(|s| s.step_s).collect());
        eprintln!("{res}x{res}: resident step {:.4} s", resident_s);
        // Calibration from the resident run: per-block compute (median over steps) and the bandwidth.
        let cost = CostModel {
            bandwidth_bytes_per_s: bandwidth,
            blocks: store
                .blocks()
                .iter()
                .enumerate()
                .map(|(j, b)| BlockCost {
                    id: b.id.to_string(),
                    bytes: b.bytes() as u64,
                    compute_s: median(rt.iter().map(|s| s.block_compute_s[j]).collect()),
                })
                .collect(),
            non_block_bytes: 0,
            source: format!("{gpu}, {res}x{res}, resident run of this benchmark"),
        };
        if let Some(dir) = out.as_ref().and_then(|o| std::path::Path::new(o).parent()) {
            let p = dir.join(format!("calibration-{res}.json"));
            std::fs::write(&p, cost.to_json()).map_err(|e| Error::Io { path: p.clone(), source: e })?;
        }
        for &gib in &budgets {
            let budget = (gib as u64) << 30;
            let choice = offload_plan::plan(&cost, budget, 1, ResidentPolicy::Auto)?;
            let resident_blocks: Vec<String> = choice.resident_ids(&cost).iter().map(|s| s.to_string()).collect();
            let cp = choice.component_plan(&cost, budget);
            let (st, sout, speak, m, ran_depth) = run_plan(&Plan::layerwise().component("transformer", cp), &mut a)?;
            if ran_depth != choice.depth {
                return Err(Error::Plan(format!("budget {gib} GiB: the ring ran at depth {ran_depth}, the plan chose {}", choice.depth)));
            }
            let streamed_s = median(st.iter().map(|s| s.step_s).collect());
            let bound = resident_s.max(choice.streamed_bytes as f64 / bandwidth);
            let err = (streamed_s - choice.predicted_step_s) / choice.predicted_step_s;
            eprintln!(
                "{res}x{res} budget {gib} GiB: {} resident, streamed {:.4} s, predicted {:.4} s ({:+.1} %), bound {:.4} s, ratio {:.4}, peak {:.2} GiB, bitwise_equal {}",
                resident_blocks.len(), streamed_s, choice.predicted_step_s, err * 100.0, bound, streamed_s / bound, speak as f64 / (1u64 << 30) as f64, sout == rout
            );
            cases.push(serde_json::json!({
                "resolution": res, "tokens": t, "batch": 1, "depth": choice.depth, "budget_bytes": budget,
                "resident_blocks": resident_blocks, "step_resident_s": resident_s, "step_streamed_s": streamed_s,
                "steps_streamed_s": st.iter().map(|s| s.step_s).collect::<Vec<_>>(),
                "predicted_step_s": choice.predicted_step_s, "prediction_error": err, "within_10pct_of_prediction": err.abs() <= 0.10,
                "bandwidth_gbps": bandwidth / 1e9, "streamed_bytes": choice.streamed_bytes,
                "bound_s": bound, "ratio_to_bound": streamed_s / bound,
                "exposed_stall_s": median(st.iter().map(|s| s.stall_s).collect()),
                "peak_device_bytes": speak, "planned_device_bytes": choice.device_bytes, "peak_within_budget": speak <= budget,
                "bitwise_equal": sout == rout, "misses": m.misses,
            }));
        }
        for &d in &depths {
            let (st, sout, speak, m, _) = run_plan(&Plan::layerwise().prefetch_depth(d), &mut a)?;
            let streamed_s = median(st.iter().map(|s| s.step_s).collect());
            let stall_s = median(st.iter().map(|s| s.stall_s).collect());
            let streamed_bytes = total_bytes;
            let bound = resident_s.max(streamed_bytes as f64 / bandwidth);
            let equal = sout == rout;
            let largest = store.largest_block_bytes() as u64;
            eprintln!(
                "{res}x{res} d={d}: streamed {:.4} s, bound {:.4} s, ratio {:.4}, stall {:.4} s, peak {:.2} GiB, bitwise_equal {equal}, misses {}",
                streamed_s,
                bound,
                streamed_s / bound,
                stall_s,
                speak as f64 / (1u64 << 30) as f64,
                m.misses
            );
            cases.push(serde_json::json!({
                "resolution": res, "tokens": t, "batch": 1, "depth": d, "budget_bytes": null,
                "step_resident_s": resident_s, "step_streamed_s": streamed_s,
                "steps_resident_s": rt.iter().map(|s| s.step_s).collect::<Vec<_>>(),
                "steps_streamed_s": st.iter().map(|s| s.step_s).collect::<Vec<_>>(),
                "bandwidth_gbps": bandwidth / 1e9, "streamed_bytes": streamed_bytes,
                "bound_s": bound, "ratio_to_bound": streamed_s / bound,
                "exposed_stall_s": stall_s,
                "peak_device_bytes": speak, "peak_device_bytes_resident": rpeak,
                "peak_bound_bytes": (d as u64 + 1) * largest,
                "peak_within_bound": speak <= (d as u64 + 1) * largest,
                "bitwise_equal": equal, "misses": m.misses, "prefetch_hits": m.prefetch_hits,
            }));
        }
    }
    progress.finish_and_clear();
    let doc = serde_json::json!({
        "date": std::env::var("BENCH_DATE").unwrap_or_default(), "commit": commit, "gpu": gpu, "backend": "cuda",
        "model": format!("flux-dev-shaped: {double} dual + {single} single blocks, hidden {H}, mlp {MLP}, bf16, random weights, offload_cuda::reference"),
        "block_bytes_total": total_bytes, "largest_block_bytes": store.largest_block_bytes(),
        "cases": cases, "anchors": [],
        "timeline_step": timeline_metrics.borrow().as_ref().map(|m| serde_json::json!({
            "resolution": resolutions.first(), "depth": 1, "exposed_stall_s": m.exposed_stall_s, "copy_busy_s": m.copy_busy_s,
            "hidden_copy_share": m.hidden_copy_share(), "bytes_copied": m.bytes_copied, "note": "one extra step with the timeline on; trace file written beside this JSON",
        })), "no_gemm": no_gemm,
    });
    let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    match out {
        Some(p) => std::fs::write(&p, text + "\n").map_err(|e| Error::Io { path: p.into(), source: e })?,
        None => println!("{text}"),
    }
    Ok(())
}
