//! Does coding pay on quantized weights? Three of a
//! Flux-dev block's linear weights (to_q 3072², ff up 12288×3072, ff down
//! 3072×12288; normal at σ = 1/√fan-in, 85 M values) stored as bf16, as fp8
//! e4m3 with a per-output-channel scale (amax / 448, the cast nearest-even) and
//! as GGUF Q8_0, Q6_K, Q5_K and Q4_K (candle's quantizer). Per format: its stored
//! bytes, what the engine's device coding makes of them (offload-cuda's today:
//! the bf16 exponent code over the block's bytes; and with fp8 e4m3's own code
//! allowed, as the CPU reference and the simulated device decode it), the
//! order-0 entropy of the bytes, and for fp8 the bound of a dedicated coder (the
//! exponent field's entropy plus its sign and mantissa bits as they are). Sizes only, deterministic for a seed:
//! each figure is the median over the seeds' runs (three by default), with min and max.
//!
//! `cargo run --release -p offload-candle --example quant_coding -- [--seeds 33,34,35] --commit C --date D [--out F]`

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use offload_core::codec::{code_for_device, code_for_device_with, histogram_entropy_bits, DeviceCodes};
use offload_core::DType;
use offload_formats::fp8::f32_to_fp8;

/// Normal values (Box–Muller over SplitMix64), standard deviation `sigma`.
fn normal(n: usize, seed: u64, sigma: f64) -> Vec<f32> {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let (u1, u2) = (next().max(1e-300), next());
        let r = (-2.0 * u1.ln()).sqrt();
        v.push((sigma * r * (std::f64::consts::TAU * u2).cos()) as f32);
        v.push((sigma * r * (std::f64::consts::TAU * u2).sin()) as f32);
    }
    v.truncate(n);
    v
}

fn byte_entropy_bits(bytes: &[u8]) -> f64 {
    let mut h = [0u64; 256];
    for &b in bytes {
        h[b as usize] += 1;
    }
    histogram_entropy_bits(&h)
}

fn bf16(v: f32) -> [u8; 2] {
    offload_formats::fp8::f32_to_bf16(v).to_le_bytes()
}

/// One format measured: (format, stored bytes, device-coded bytes, order-0 byte
/// entropy over 8, fp8's exponent-field entropy in bits, device-coded bytes with
/// fp8's own code allowed, in 256 KiB segments and in offload-cuda's default 32 MiB).
type Sizes = (&'static str, usize, usize, f64, Option<f64>, usize, usize);

/// One seed's weights in every format: their count and each format's sizes.
fn measure(seed: u64) -> (usize, Vec<Sizes>) {
    let weights: Vec<(usize, usize, Vec<f32>)> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, &(_, r, c))| (r, c, normal(r * c, seed.wrapping_add(i as u64), 1.0 / (c as f64).sqrt())))
        .collect();
    let mut formats: Vec<(&'static str, Vec<u8>)> = Vec::new();
    formats.push(("bf16", weights.iter().flat_map(|(_, _, w)| w.iter().flat_map(|&x| bf16(x))).collect()));
    let mut fp8 = Vec::new();
    for (r, c, w) in &weights {
        for row in w.chunks(*c).take(*r) {
            let amax = row.iter().fold(0f32, |a, x| a.max(x.abs()));
            let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            fp8.extend(row.iter().map(|&x| f32_to_fp8(x / scale, DType::F8_E4M3).expect("fp8 dtype")));
        }
    }
    formats.push(("fp8_e4m3_per_channel", fp8));
    for (name, dt) in
        [("gguf_q8_0", GgmlDType::Q8_0), ("gguf_q6_k", GgmlDType::Q6K), ("gguf_q5_k", GgmlDType::Q5K), ("gguf_q4_k", GgmlDType::Q4K)]
    {
        let mut bytes = Vec::new();
        for (r, c, w) in &weights {
            let t = Tensor::from_slice(w, (*r, *c), &Device::Cpu).expect("a tensor");
            bytes.extend_from_slice(&QTensor::quantize(&t, dt).expect("quantizes").data().expect("its bytes"));
        }
        formats.push((name, bytes));
    }
    let values = weights.iter().map(|(r, c, _)| r * c).sum();
    let rows = formats
        .iter()
        .map(|(name, bytes)| {
            let exponent = name.starts_with("fp8").then(|| {
                let mut hist = [0u64; 256];
                for &b in bytes {
                    hist[((b >> 3) & 0xf) as usize] += 1;
                }
                histogram_entropy_bits(&hist)
            });
            let with_fp8 = |seg: usize| code_for_device_with(bytes, seg, 2, DeviceCodes { fp8_e4m3: true }).len();
            let coded = code_for_device(bytes, 256 << 10, 2).len();
            (*name, bytes.len(), coded, byte_entropy_bits(bytes) / 8.0, exponent, with_fp8(256 << 10), with_fp8(32 << 20))
        })
        .collect();
    (values, rows)
}

/// (name, rows = output channels, cols = fan-in) of the weights measured.
const SHAPES: [(&str, usize, usize); 3] = [("attn.to_q", 3072, 3072), ("ff.net.0.proj", 12288, 3072), ("ff.net.2", 3072, 12288)];

fn spread(mut v: Vec<f64>) -> serde_json::Value {
    v.sort_by(f64::total_cmp);
    serde_json::json!({ "median": v[v.len() / 2], "min": v[0], "max": v[v.len() - 1], "n": v.len(), "runs": v })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let seeds: Vec<u64> = opt("--seeds").unwrap_or_else(|| "33,34,35".into()).split(',').filter_map(|s| s.parse().ok()).collect();
    if seeds.is_empty() {
        eprintln!("quant_coding: --seeds S1,S2,... (three or more for a published figure)");
        std::process::exit(2);
    }
    let runs: Vec<_> = seeds.iter().map(|&s| measure(s)).collect();
    let values = runs[0].0;
    let bf16_bytes = runs[0].1[0].1 as f64;
    let mut cases = Vec::new();
    for (k, &(name, stored, ..)) in runs[0].1.iter().enumerate() {
        let of = |f: &dyn Fn(&Sizes) -> f64| spread(runs.iter().map(|r| f(&r.1[k])).collect());
        let mut row = serde_json::json!({
            "format": name,
            "stored_bytes": stored,
            "bytes_per_weight": stored as f64 / values as f64,
            "stored_vs_bf16": stored as f64 / bf16_bytes,
            "device_coded_vs_stored": of(&|r| r.2 as f64 / r.1 as f64),
            "device_coded_fp8_code_allowed_vs_stored": of(&|r| r.5 as f64 / r.1 as f64),
            "device_coded_fp8_code_allowed_32mib_segments_vs_stored": of(&|r| r.6 as f64 / r.1 as f64),
            "byte_entropy_vs_stored": of(&|r| r.3),
        });
        if runs[0].1[k].4.is_some() {
            row["fp8_exponent_entropy_bits"] = of(&|r| r.4.unwrap_or(f64::NAN));
            row["fp8_dedicated_coder_bound_vs_stored"] = of(&|r| (r.4.unwrap_or(f64::NAN) + 4.0) / 8.0);
        }
        eprintln!("{row}");
        cases.push(row);
    }
    let out = serde_json::json!({
        "generated_by": "cargo run --release -p offload-candle --example quant_coding",
        "date": opt("--date").unwrap_or_else(|| "unknown".into()),
        "commit": opt("--commit").unwrap_or_else(|| "unknown".into()),
        "gpu": "none",
        "backend": "host",
        "model": "flux-dev (three linear weights of a double block)",
        "note": "sizes, not steps: the step fields of a results file do not apply; each figure is the median of one run per seed; \
                 device coding in 256 KiB segments (each coded one carries an 8 KiB decode table) unless the field says 32 MiB \
                 (offload-cuda's default segment)",
        "seeds": seeds,
        "weights": SHAPES.iter().map(|(n, r, c)| format!("{n} {r}x{c}")).collect::<Vec<_>>(),
        "values": values,
        "cases": cases,
    });
    let text = serde_json::to_string_pretty(&out).expect("serialises") + "\n";
    match opt("--out") {
        Some(f) => std::fs::write(&f, text).unwrap_or_else(|e| panic!("writing {f}: {e}")),
        None => print!("{text}"),
    }
}
