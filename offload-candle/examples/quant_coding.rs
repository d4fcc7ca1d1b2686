//! Does coding pay on quantized weights? (issue 33, point 3.) Three of a
//! Flux-dev block's linear weights (to_q 3072², ff up 12288×3072, ff down
//! 3072×12288; normal at σ = 1/√fan-in, 85 M values) stored as bf16, as fp8
//! e4m3 with a per-output-channel scale (amax / 448, the cast nearest-even) and
//! as GGUF Q8_0, Q6_K, Q5_K and Q4_K (candle's quantizer). Per format: its stored
//! bytes, what the engine's device coding (`coded=True` today, the bf16 exponent
//! coder over the block's bytes) makes of them, the order-0 entropy of the bytes,
//! and for fp8 the bound of a dedicated coder (the exponent field's entropy plus
//! its sign and mantissa bits as they are). Sizes only: deterministic for a seed,
//! one run is the figure.
//!
//! `cargo run --release -p offload-candle --example quant_coding -- [--seed S] [--out F]`

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use offload_core::codec::{code_for_device, histogram_entropy_bits};
use offload_core::fp8::f32_to_fp8;
use offload_core::DType;

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
    offload_core::fp8::f32_to_bf16(v).to_le_bytes()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let seed: u64 = opt("--seed").and_then(|s| s.parse().ok()).unwrap_or(33);
    let (h, mlp) = (3072usize, 12288usize);
    // (name, rows = output channels, cols = fan-in)
    let shapes = [("attn.to_q", h, h), ("ff.net.0.proj", mlp, h), ("ff.net.2", h, mlp)];
    let weights: Vec<(usize, usize, Vec<f32>)> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(_, r, c))| (r, c, normal(r * c, seed.wrapping_add(i as u64), 1.0 / (c as f64).sqrt())))
        .collect();
    let mut formats: Vec<(&str, Vec<u8>)> = Vec::new();
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
    let values: usize = weights.iter().map(|(r, c, _)| r * c).sum();
    let bf16_bytes = formats[0].1.len() as f64;
    let mut rows = Vec::new();
    for (name, bytes) in &formats {
        let coded = code_for_device(bytes, 256 << 10, 2).len();
        let mut row = serde_json::json!({
            "format": name,
            "stored_bytes": bytes.len(),
            "bytes_per_weight": bytes.len() as f64 / values as f64,
            "stored_vs_bf16": bytes.len() as f64 / bf16_bytes,
            "device_coded_bytes": coded,
            "device_coded_vs_stored": coded as f64 / bytes.len() as f64,
            "byte_entropy_vs_stored": byte_entropy_bits(bytes) / 8.0,
        });
        if name.starts_with("fp8") {
            let mut hist = [0u64; 256];
            for &b in bytes {
                hist[((b >> 3) & 0xf) as usize] += 1;
            }
            let e = histogram_entropy_bits(&hist);
            row["fp8_exponent_entropy_bits"] = e.into();
            row["fp8_dedicated_coder_bound_vs_stored"] = ((e + 4.0) / 8.0).into();
        }
        eprintln!("{row}");
        rows.push(row);
    }
    let out = serde_json::json!({
        "generated_by": "cargo run --release -p offload-candle --example quant_coding",
        "seed": seed,
        "weights": shapes.iter().map(|(n, r, c)| format!("{n} {r}x{c}")).collect::<Vec<_>>(),
        "values": values,
        "formats": rows,
    });
    let text = serde_json::to_string_pretty(&out).expect("serialises") + "\n";
    match opt("--out") {
        Some(f) => std::fs::write(&f, text).unwrap_or_else(|e| panic!("writing {f}: {e}")),
        None => print!("{text}"),
    }
}
