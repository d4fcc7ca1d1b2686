//! Flux-dev-shaped transformer in candle (`offload_candle::flux`: 19 double + 38
//! single blocks, hidden 3072, MLP 12288, bf16, random weights) on CUDA: candle
//! resident vs candle streamed (d = 1, 2) in one process, with the pinned bandwidth
//! measured in the same run. Needs the `cuda` feature and a GPU.
//!
//! `candle_flux_bench [--resolutions 1024,2048] [--depths 1,2] [--steps 5] [--double 19] [--single 38] [--out F] [--commit C]`

use candle_core::{DType, Tensor};
use offload_candle::flux::{step, FluxShape, RandomFlux};
use offload_candle::{candle_error as cerr, CandleCudaBackend};
use offload_core::{resolve, BlockDiscovery, Error, HostStore, NameDiscovery, OffloadBackend, Plan, Result, Ring, TensorSource};
use std::sync::Arc;
use std::time::Instant;

const TXT: usize = 512;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn list(args: &[String], name: &str, default: &str) -> Vec<usize> {
    let s = args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, String::as_str);
    s.split(',').filter_map(|x| x.parse().ok()).collect()
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let resolutions = list(&args, "--resolutions", "1024,2048");
    let depths = list(&args, "--depths", "1,2");
    let steps = list(&args, "--steps", "5")[0].max(1);
    let (nd, ns) = (list(&args, "--double", "19")[0], list(&args, "--single", "38")[0]);
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let shape = FluxShape::DEV;
    let be = CandleCudaBackend::new(0, DType::BF16)?;
    let dev = be.device();
    let t = Instant::now();
    let src = RandomFlux::new(shape, nd, ns, 7);
    let inv = NameDiscovery.discover("transformer", src.specs())?;
    let store = Arc::new(HostStore::build(&be, &inv, &src)?);
    let total: u64 = store.blocks().iter().map(|b| b.bytes() as u64).sum();
    let largest = store.largest_block_bytes() as u64;
    eprintln!(
        "host store: {:.2} GiB pinned in {} blocks in {:.1} s",
        total as f64 / (1u64 << 30) as f64,
        store.blocks().len(),
        t.elapsed().as_secs_f64()
    );
    let bandwidth = offload_core::probe_bandwidth(&be, &store, 3)?;
    let cuda = be.cuda().clone();
    eprintln!("pinned H2D bandwidth: {:.1} GB/s", bandwidth / 1e9);
    let sync = || dev.synchronize().map_err(cerr("synchronize"));
    // Written after every case, so a run cut short still leaves what it measured.
    let write = |cases: &[serde_json::Value], done: bool| -> Result<()> {
        let Some(out) = opt("--out") else { return Ok(()) };
        let doc = serde_json::json!({
            "date": std::env::var("BENCH_DATE").unwrap_or_default(), "commit": opt("--commit").unwrap_or_default(),
            "gpu": be.cuda().device_name().unwrap_or_default(), "backend": "candle", "complete": done,
            "model": format!("flux-dev-shaped candle (offload_candle::flux): {nd} double + {ns} single blocks, hidden 3072, mlp 12288, bf16, matmul-softmax attention in groups of at most 2^30 scores, random weights"),
            "block_bytes_total": total, "largest_block_bytes": largest, "cases": cases, "anchors": [],
        });
        std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap_or_default()).map_err(|e| Error::Io { path: out.into(), source: e })
    };
    let mut cases = Vec::new();
    for &res in &resolutions {
        let n = (res / 16) * (res / 16);
        let r = |s: &[usize], seed: u64| -> Result<Tensor> {
            dev.set_seed(seed).map_err(cerr("seed"))?;
            (Tensor::randn(0f32, 0.5, s, &dev).and_then(|t| t.to_dtype(DType::BF16))).map_err(cerr("inputs"))
        };
        let (img, txt, vec) = (r(&[1, n, shape.hidden], 1)?, r(&[1, TXT, shape.hidden], 2)?, r(&[1, shape.hidden], 3)?);
        let run_plan = |plan: &Plan| -> Result<(Vec<f64>, Vec<u8>, u64, u64)> {
            let rc = resolve(plan, std::slice::from_ref(&inv))?.components.remove(0);
            cuda.synchronize()?;
            // The ring's slot bytes (candle owns each buffer; the backend counts the slots).
            be.reset_peak();
            let base = be.counters().live_bytes;
            let mut ring = Ring::new(be.clone(), store.clone(), &rc)?;
            let mut out = step(&mut ring, shape, (nd, ns), &img, &txt, &vec)?; // warm-up (kernel loading)
            let mut times = Vec::new();
            for _ in 0..steps {
                sync()?;
                let t = Instant::now();
                out = step(&mut ring, shape, (nd, ns), &img, &txt, &vec)?;
                sync()?;
                times.push(t.elapsed().as_secs_f64());
                eprintln!("  step {:.4} s", t.elapsed().as_secs_f64());
            }
            let misses = ring.metrics().misses;
            let bytes: Vec<u8> = out
                .flatten_all()
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(cerr("reading the output"))?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            ring.close()?;
            cuda.synchronize()?;
            Ok((times, bytes, be.counters().peak_bytes - base, misses))
        };
        let (rtimes, rout, _, _) = run_plan(&Plan::resident())?;
        let resident_s = median(rtimes.clone());
        eprintln!("{res}x{res}: candle resident step {resident_s:.4} s");
        for &d in &depths {
            let (times, out, peak, misses) = run_plan(&Plan::layerwise().prefetch_depth(d))?;
            let streamed = median(times.clone());
            let bound = resident_s.max(total as f64 / bandwidth);
            let equal = out == rout;
            eprintln!(
                "{res}x{res} d={d}: candle streamed {streamed:.4} s, bound {bound:.4} s, ratio {:.4}, peak {:.2} GiB, bitwise_equal {equal}, misses {misses}",
                streamed / bound,
                peak as f64 / (1u64 << 30) as f64
            );
            cases.push(serde_json::json!({
                "resolution": res, "tokens": n + TXT, "batch": 1, "depth": d, "budget_bytes": null,
                "step_resident_s": resident_s, "steps_resident_s": rtimes, "step_streamed_s": streamed, "steps_streamed_s": times,
                "streamed_bytes": total, "bandwidth_gbps": bandwidth / 1e9, "bound_s": bound, "ratio_to_bound": streamed / bound,
                "peak_device_bytes": peak, "peak_bound_bytes": (d as u64 + 1) * largest, "peak_within_bound": peak <= (d as u64 + 1) * largest,
                "bitwise_equal": equal, "misses": misses,
            }));
            write(&cases, false)?;
        }
    }
    write(&cases, true)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("candle_flux_bench: {e}");
        std::process::exit(1);
    }
}
