//! `vulkan-bench --out PATH [--commit C] [--blocks N] [--block-mib M] [--steps S]
//! [--host-cached] [--copy-queue transfer|second-compute|compute] [--copy-chunk-mib C]
//! [--host-memory allocated|imported] [--no-split-copies]` (copies split over two transfer queues by default; `--split-copies` is accepted and changes nothing):
//! the Vulkan backend on this machine's GPU, one process's run.
//!
//! - Transfer bandwidth: every block copied from host-visible memory into one slot
//!   on the transfer queue, best of three passes; next to it, cudarc's pinned
//!   host-to-device bandwidth over the same block sizes (`offload_core::probe_bandwidth`
//!   on `offload-cuda`), in the same process.
//! - A streamed step: per block, one invocation spins for a chosen number of rounds
//!   (the compute), then the fold hashes the block; all resident, then streamed at
//!   depth 1 and 2; compared with `max(resident step, streamed bytes ÷ Vulkan
//!   bandwidth)`, the fold's result compared with the resident one and the host's.
//!   Two compute lengths: about half and about twice a block's copy time.
//!
//! Writes one JSON file (DESIGN's schema, plus `bandwidth_gbps`, `cuda_bandwidth_gbps`).

use offload_core::{resolve, BlockDiscovery, DType, HostStore, MemoryTensors, NameDiscovery, Plan, Ring, TensorSpec};
use offload_vulkan::checksum::{reference_combine, reference_hash, ChecksumKernel};
use offload_vulkan::VulkanBackend;
use rand::{RngCore, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

type Res<T> = std::result::Result<T, String>;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// The options that take a value, and the flags.
const VALUED: [&str; 8] = ["--out", "--commit", "--blocks", "--block-mib", "--steps", "--copy-queue", "--copy-chunk-mib", "--host-memory"];
const FLAGS: [&str; 3] = ["--host-cached", "--no-split-copies", "--split-copies"];

/// Every argument a known option, given once, with a value where it takes one:
/// a misspelt option is an error, not a default.
fn check_args(args: &[String]) -> Res<()> {
    let mut it = args.iter().enumerate();
    while let Some((i, a)) = it.next() {
        if args[..i].contains(a) {
            return Err(format!("{a} given twice"));
        }
        if VALUED.contains(&a.as_str()) {
            it.next().filter(|(_, v)| !v.starts_with("--")).ok_or_else(|| format!("{a} needs a value"))?;
        } else if !FLAGS.contains(&a.as_str()) {
            return Err(format!("unknown argument {a:?} (options: {}, {})", VALUED.join(", "), FLAGS.join(", ")));
        }
    }
    Ok(())
}

/// The count after `name` (at least 1), or `default`.
fn count(args: &[String], name: &str, default: usize) -> Res<usize> {
    match arg(args, name) {
        None => Ok(default),
        Some(v) => v.parse().ok().filter(|&n| n >= 1).ok_or_else(|| format!("{name} {v:?}: not a count of at least 1")),
    }
}

fn model(blocks: usize, bytes: usize) -> Res<MemoryTensors> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x0ff1_0ad5);
    let mut t = MemoryTensors::new();
    for i in 0..blocks {
        let mut v = vec![0u8; bytes];
        rng.fill_bytes(&mut v);
        t.push(TensorSpec::new(format!("blocks.{i}.weight"), DType::U8, [bytes]), v).map_err(|e| e.to_string())?;
    }
    Ok(t)
}

/// One timed step: per block, wait token → spin + fold → release. Returns (seconds, fold).
fn step(ring: &mut Ring<VulkanBackend>, fold: &mut ChecksumKernel, rounds: u32) -> Res<(f64, u32)> {
    let t = Instant::now();
    for i in 0..ring.len() {
        let g = ring.block_at(i).map_err(|e| e.to_string())?;
        let waits: Vec<_> = g.wait_token().into_iter().copied().collect();
        fold.spin(None, rounds, &waits).map_err(|e| e.to_string())?;
        fold.fold(g.slot(), g.layout().bytes, &waits).map_err(|e| e.to_string())?;
        g.finish().map_err(|e| e.to_string())?;
    }
    ring.end_step().map_err(|e| e.to_string())?;
    let v = fold.read().map_err(|e| e.to_string())?;
    Ok((t.elapsed().as_secs_f64(), v))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if let Err(e) = run() {
        eprintln!("vulkan-bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    check_args(&args)?;
    let out = arg(&args, "--out").ok_or("--out PATH is required")?;
    let commit = arg(&args, "--commit").unwrap_or_default();
    let (blocks, mib, steps) = (count(&args, "--blocks", 24)?, count(&args, "--block-mib", 256)?, count(&args, "--steps", 5)?);
    let copy_chunk_bytes = match arg(&args, "--copy-chunk-mib") {
        None => None,
        Some(_) => Some(count(&args, "--copy-chunk-mib", 0)?.checked_mul(1 << 20).ok_or("--copy-chunk-mib overflows")? as u64),
    };
    let bytes = mib.checked_mul(1 << 20).filter(|b| b.checked_mul(blocks).is_some()).ok_or("--blocks × --block-mib overflows")?;
    let tensors = model(blocks, bytes)?;
    let inventory = NameDiscovery.discover("model", offload_core::TensorSource::specs(&tensors)).map_err(|e| e.to_string())?;
    let total = (blocks * bytes) as f64;

    let options = offload_vulkan::VulkanOptions {
        copy_queue: match arg(&args, "--copy-queue").as_deref() {
            None | Some("transfer") => offload_vulkan::CopyQueue::Transfer,
            Some("second-compute") => offload_vulkan::CopyQueue::SecondCompute,
            Some("compute") => offload_vulkan::CopyQueue::Compute,
            Some(other) => return Err(format!("--copy-queue {other}: transfer, second-compute or compute")),
        },
        host_cached: args.iter().any(|a| a == "--host-cached"),
        copy_chunk_bytes,
        host_memory: match arg(&args, "--host-memory").as_deref() {
            None | Some("allocated") => offload_vulkan::HostAllocation::Allocated,
            Some("imported") => offload_vulkan::HostAllocation::Imported,
            Some(other) => return Err(format!("--host-memory {other}: allocated or imported")),
        },
        // Split by default (as `VulkanOptions`); `--split-copies` kept for older commands.
        split_copies: !args.iter().any(|a| a == "--no-split-copies"),
        ..Default::default()
    };
    let vk = VulkanBackend::with_options(&options).map_err(|e| e.to_string())?;
    eprintln!(
        "vulkan device: {} (transfer queue: {}, host memory: {:?}, split copies on {:?} queue(s))",
        vk.device_name(),
        vk.has_transfer_queue(),
        vk.host_memory(),
        vk.split_copy_queues()
    );
    let t0 = Instant::now();
    let store = Arc::new(HostStore::build(&vk, &inventory, &tensors).map_err(|e| e.to_string())?);
    eprintln!("host store: {:.1} GiB in {:.1} s", total / (1u64 << 30) as f64, t0.elapsed().as_secs_f64());
    let bandwidth = offload_core::probe_bandwidth(&vk, &store, 3).map_err(|e| e.to_string())?;
    // cudarc's pinned bandwidth over the same blocks, where CUDA is installed.
    let cuda_bandwidth = match offload_cuda::CudaBackend::new(0) {
        Ok(cu) => {
            let cstore = HostStore::build(&cu, &inventory, &tensors).map_err(|e| e.to_string())?;
            Some(offload_core::probe_bandwidth(&cu, &cstore, 3).map_err(|e| e.to_string())?)
        }
        Err(e) if std::env::var("OFFLOAD_REQUIRE_DEVICE").is_ok_and(|v| v == "1") => return Err(format!("cudarc: {e}")),
        Err(e) => {
            eprintln!("no cudarc bandwidth: {e}");
            None
        }
    };
    eprintln!("bandwidth: vulkan {:.2} GB/s, cudarc pinned {:?} GB/s", bandwidth / 1e9, cuda_bandwidth.map(|b| b / 1e9));

    // Calibrate the spin: rounds per second of one invocation.
    let mut fold = ChecksumKernel::new(&vk, 0x5eed).map_err(|e| e.to_string())?;
    let cal_rounds = 4_000_000u32;
    fold.spin(None, cal_rounds, &[]).map_err(|e| e.to_string())?;
    fold.read().map_err(|e| e.to_string())?;
    let t = Instant::now();
    fold.spin(None, cal_rounds, &[]).map_err(|e| e.to_string())?;
    fold.read().map_err(|e| e.to_string())?;
    let rounds_per_s = cal_rounds as f64 / t.elapsed().as_secs_f64();
    let copy_s = bytes as f64 / bandwidth;
    eprintln!("spin: {:.3e} rounds/s; one block's copy {:.2} ms", rounds_per_s, copy_s * 1e3);
    let want = (0..blocks)
        .fold(0x5eed_u32, |acc, i| reference_combine(acc, reference_hash(store.blocks()[i].buffer().expect("held in memory").as_slice())));

    let mut cases = Vec::new();
    for (label, factor) in [("copy-bound", 0.5), ("compute-bound", 2.0)] {
        let rounds = ((copy_s * factor * rounds_per_s) as u64).clamp(1, u32::MAX as u64) as u32;
        let plan = |p: &Plan| resolve(p, std::slice::from_ref(&inventory)).map_err(|e| e.to_string());
        let mut resident_times = Vec::new();
        let resident_fold;
        {
            let rp = plan(&Plan::resident())?;
            let mut ring = Ring::new(vk.clone(), store.clone(), &rp.components[0]).map_err(|e| e.to_string())?;
            let mut f = ChecksumKernel::new(&vk, 0x5eed).map_err(|e| e.to_string())?;
            step(&mut ring, &mut f, rounds)?;
            for _ in 0..steps {
                f = ChecksumKernel::new(&vk, 0x5eed).map_err(|e| e.to_string())?;
                resident_times.push(step(&mut ring, &mut f, rounds)?.0);
            }
            resident_fold = f.read().map_err(|e| e.to_string())?;
            ring.close().map_err(|e| e.to_string())?;
        }
        let resident = median(&mut resident_times);
        for depth in [1usize, 2] {
            let rp = plan(&Plan::layerwise().prefetch_depth(depth))?;
            vk.reset_peak();
            let mut ring = Ring::new(vk.clone(), store.clone(), &rp.components[0]).map_err(|e| e.to_string())?;
            let mut f = ChecksumKernel::new(&vk, 0x5eed).map_err(|e| e.to_string())?;
            step(&mut ring, &mut f, rounds)?;
            let mut times = Vec::new();
            let mut folds = Vec::new();
            for _ in 0..steps {
                f = ChecksumKernel::new(&vk, 0x5eed).map_err(|e| e.to_string())?;
                let (s, v) = step(&mut ring, &mut f, rounds)?;
                times.push(s);
                folds.push(v);
            }
            let misses = ring.metrics().misses;
            ring.close().map_err(|e| e.to_string())?;
            let streamed = median(&mut times.clone());
            let bound = resident.max(total / bandwidth);
            let equal = folds.iter().all(|&v| v == resident_fold) && resident_fold == want;
            let line = format!(
                "{label} d={depth}: resident {resident:.4} s, streamed {streamed:.4} s, bound {bound:.4} s, ratio {:.4}, equal {equal}, misses {misses}",
                streamed / bound
            );
            eprintln!("{line}");
            cases.push(serde_json::json!({
                "case": label, "resolution": null, "batch": 1, "depth": depth, "budget_bytes": null,
                "compute_rounds_per_block": rounds,
                "step_resident_s": resident, "step_resident_s_all": resident_times,
                "step_streamed_s": streamed, "step_streamed_s_all": times,
                "bandwidth_gbps": bandwidth / 1e9, "streamed_bytes": total as u64,
                "bound_s": bound, "ratio_to_bound": streamed / bound,
                "peak_device_bytes": vk.counters().peak_bytes, "bitwise_equal": equal, "misses": misses,
            }));
        }
    }
    let doc = serde_json::json!({
        "date": std::env::var("BENCH_DATE").unwrap_or_default(), "commit": commit, "gpu": vk.device_name(),
        "backend": "vulkan", "model": format!("{blocks} blocks of {mib} MiB (random bytes), spin + fold per block"),
        "options": {"copy_queue": format!("{:?}", options.copy_queue), "copy_family": vk.copy_family(), "host_cached": options.host_cached, "copy_chunk_bytes": options.copy_chunk_bytes, "host_memory": format!("{:?}", vk.host_memory()), "split_copy_queues": vk.split_copy_queues()},
        "bandwidth_gbps": bandwidth / 1e9, "cuda_bandwidth_gbps": cuda_bandwidth.map(|b| b / 1e9),
        "bandwidth_ratio_to_cuda": cuda_bandwidth.map(|c| bandwidth / c), "cases": cases,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n").map_err(|e| format!("{out}: {e}"))?;
    let v = vk.validation_messages();
    if !v.is_empty() || !vk.violations().is_empty() {
        return Err(format!("validation {v:?}, protocol {:?}", vk.violations()));
    }
    Ok(())
}
