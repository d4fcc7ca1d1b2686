//! The main job: a Flux-shaped transformer written with candle
//! (`offload::candle::flux`: double blocks over image and text tokens, then single
//! blocks over both, Flux's tensor names and layout at a smaller width, random bf16
//! weights) run all-resident and then offloaded block by block, the two outputs
//! compared byte for byte.
//!
//! Without a GPU the blocks stream through candle's CPU device: host store → slot
//! copies on a worker thread, the same ring protocol as on a GPU. Built with the
//! `candle-cuda` feature and run where a CUDA device answers, the slots are candle
//! CUDA tensors filled on offload-cuda's copy stream.
//!
//! `cargo xtask demo` runs it; `cargo run --release --example flux_demo --features candle`
//! does the same. Arguments: `--hidden N --double N --single N --res PIXELS --steps N --depth N`.

use candle_core::{DType, Device, Tensor};
use offload::candle::flux::{step, FluxShape, RandomFlux};
use offload::candle::{candle_error as candle_err, CandleBackend, CandleBlockExt};
use offload::*;
use std::sync::Arc;
use std::time::Instant;

struct Cfg {
    shape: FluxShape,
    double: usize,
    single: usize,
    res: usize,
    txt_tokens: usize,
    steps: usize,
    depth: usize,
}

fn parse_args() -> std::result::Result<Cfg, String> {
    let mut c =
        Cfg { shape: FluxShape { hidden: 256, heads: 2, mlp: 1024 }, double: 4, single: 8, res: 256, txt_tokens: 32, steps: 3, depth: 1 };
    let args: Vec<String> = std::env::args().skip(1).collect();
    for pair in args.chunks(2) {
        let [name, value] = pair else { return Err(format!("{} needs a value", pair[0])) };
        let v: usize = value.parse().map_err(|_| format!("{name}: expected a number, got {value:?}"))?;
        match name.as_str() {
            // Flux's head width is 128 (3072 / 24).
            "--hidden" => c.shape = FluxShape { hidden: v, heads: (v / 128).max(1), mlp: 4 * v },
            "--double" => c.double = v,
            "--single" => c.single = v,
            "--res" => c.res = v,
            "--steps" => c.steps = v.max(1),
            "--depth" => c.depth = v,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if c.shape.hidden % c.shape.heads != 0 || c.res < 16 || c.depth == 0 {
        return Err(format!(
            "need --hidden divisible by its head count (hidden / 128), --res ≥ 16 and --depth ≥ 1 (got {}, {}, {})",
            c.shape.hidden, c.res, c.depth
        ));
    }
    Ok(c)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

/// Resident, then offloaded at `c.depth`, on `backend`; `sync` waits for the device.
fn run<B>(c: &Cfg, backend: B, device: &Device, where_: &str) -> Result<bool>
where
    B: OffloadBackend,
    for<'a> BlockGuard<'a, B>: CandleBlockExt,
{
    let src = RandomFlux::new(c.shape, c.double, c.single, 0xF1);
    let inventory = DeclaredStacks::new(["double_blocks", "single_blocks"]).discover("transformer", src.specs())?;
    let store = Arc::new(HostStore::build(&backend, &inventory, &src)?);
    let img_tokens = (c.res / 16) * (c.res / 16);
    println!("offload demo: a Flux-shaped transformer written with candle, on {where_}");
    println!(
        "  {} double + {} single blocks, hidden {}, {} heads, MLP {}; a {}×{} image ({} tokens) + {} text tokens, bf16",
        c.double, c.single, c.shape.hidden, c.shape.heads, c.shape.mlp, c.res, c.res, img_tokens, c.txt_tokens
    );
    println!(
        "  host store: {:.1} MiB in {} blocks, largest block {:.2} MiB",
        mib(store.payload_bytes()),
        store.blocks().len(),
        mib(store.largest_block_bytes() as u64)
    );
    // Fresh random inputs, never zeros.
    let rand = |dims: &[usize]| {
        Tensor::randn(0f32, 0.5, dims, device).and_then(|t| t.to_dtype(DType::BF16)).map_err(candle_err("making the inputs"))
    };
    let (img, txt, vec) = (rand(&[1, img_tokens, c.shape.hidden])?, rand(&[1, c.txt_tokens, c.shape.hidden])?, rand(&[1, c.shape.hidden])?);
    let mut outputs = Vec::new();
    for (label, plan) in [("resident", Plan::resident()), ("offloaded", Plan::layerwise().prefetch_depth(c.depth))] {
        let component = resolve(&plan, std::slice::from_ref(&inventory))?.components.remove(0);
        let mut ring = Ring::new(backend.clone(), store.clone(), &component)?;
        let mut times = Vec::new();
        let mut out = None;
        for _ in 0..c.steps {
            let t = Instant::now();
            let o = step(&mut ring, c.shape, (c.double, c.single), &img, &txt, &vec)?;
            device.synchronize().map_err(candle_err("waiting for the step"))?;
            times.push(t.elapsed().as_secs_f64());
            out = Some(o);
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let m = ring.metrics();
        println!(
            "\n[{label}] step {:.1} ms (median of {}); {} blocks served, {:.1} MiB copied host → device, {} misses; peak device bytes for weights {:.2} MiB",
            median * 1e3,
            c.steps,
            m.blocks,
            mib(m.bytes_copied),
            m.misses,
            mib(m.peak_device_weight_bytes)
        );
        ring.close()?;
        let bytes: Vec<u8> = out
            .map(|o| o.flatten_all().and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.to_vec1::<f32>()))
            .transpose()
            .map_err(candle_err("reading the output"))?
            .unwrap_or_default()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        outputs.push((median, m.peak_device_weight_bytes, bytes));
    }
    let (r, o) = (&outputs[0], &outputs[1]);
    let identical = r.2 == o.2 && r.2.iter().any(|b| *b != 0);
    println!("\noffloaded / resident step time: {:.3}", o.0 / r.0);
    println!(
        "device memory for weights: {:.2} MiB offloaded (depth {}) vs {:.2} MiB resident ({:.0} %)",
        mib(o.1),
        c.depth,
        mib(r.1),
        100.0 * o.1 as f64 / r.1 as f64
    );
    println!("outputs bitwise identical: {}", if identical { "yes" } else { "NO" });
    Ok(identical)
}

#[cfg(feature = "candle-cuda")]
fn run_on_gpu(c: &Cfg) -> Option<Result<bool>> {
    match offload::candle::CandleCudaBackend::new(0, DType::BF16) {
        Ok(be) => {
            let device = be.device();
            let name = be.cuda().device_name().unwrap_or_else(|_| "a CUDA device".into());
            Some(run(c, be, &device, &format!("{name} (candle CUDA tensors, offload-cuda copy stream)")))
        }
        Err(e) => {
            println!("no CUDA device ({e}); running on the CPU");
            None
        }
    }
}

#[cfg(not(feature = "candle-cuda"))]
fn run_on_gpu(_: &Cfg) -> Option<Result<bool>> {
    None
}

fn main() {
    let c = parse_args().unwrap_or_else(|e| {
        eprintln!("flux_demo: {e}");
        std::process::exit(2)
    });
    let result = run_on_gpu(&c).unwrap_or_else(|| {
        let be = CandleBackend::cpu();
        let device = be.device();
        run(&c, be, &device, "the CPU (candle's CPU device; slots filled on a copy thread)")
    });
    match result {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("flux_demo: {e}");
            std::process::exit(1)
        }
    }
}
