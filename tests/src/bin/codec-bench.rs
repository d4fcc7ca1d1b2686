//! Host speed of the exponent codec: one Flux-dev-shaped dual-stream
//! block (diffusers' tensor shapes, 0.63 GiB of bf16) with normal weights at each
//! tensor's init scale (σ = 1/√fan-in; norm scales around 1), compressed with
//! `compress_block` on every host thread and decoded by the CPU reference decoder,
//! checked byte for byte. One process run; `cargo xtask bench --codec` runs three
//! and merges them.
//!
//! `codec-bench --out F [--threads N] [--commit C]`

use offload_core::codec::{compress_block, decompress_block_into, exponent_entropy_bits};
use offload_core::tensor::{BlockLayout, DType, TensorSpec};
use std::time::Instant;

fn shapes() -> Vec<(String, Vec<usize>)> {
    let (h, mlp, hd) = (3072, 12288, 128);
    let mut v = Vec::new();
    let mut lin = |n: &str, i: usize, o: usize| {
        v.push((format!("{n}.weight"), vec![o, i]));
        v.push((format!("{n}.bias"), vec![o]));
    };
    lin("norm1.linear", h, 6 * h);
    lin("norm1_context.linear", h, 6 * h);
    for l in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"] {
        lin(&format!("attn.{l}"), h, h);
    }
    for m in ["ff", "ff_context"] {
        lin(&format!("{m}.net.0.proj"), h, mlp);
        lin(&format!("{m}.net.2"), mlp, h);
    }
    for q in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
        v.push((format!("attn.{q}.weight"), vec![hd]));
    }
    v
}

/// Normal values (Box–Muller over SplitMix64) with standard deviation `sigma` around `mean`, as bf16 bytes.
fn normal_bf16(dst: &mut [u8], seed: u64, mean: f64, sigma: f64) {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    for pair in dst.chunks_exact_mut(4) {
        let (u1, u2) = (next().max(1e-300), next());
        let r = (-2.0 * u1.ln()).sqrt();
        let (a, b) = (r * (std::f64::consts::TAU * u2).cos(), r * (std::f64::consts::TAU * u2).sin());
        for (k, x) in [a, b].into_iter().enumerate() {
            let bits = ((mean + sigma * x) as f32).to_bits();
            let v = ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
            pair[2 * k..2 * k + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let threads =
        opt("--threads").and_then(|t| t.parse().ok()).unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let specs: Vec<TensorSpec> =
        shapes().into_iter().map(|(n, s)| TensorSpec::new(format!("transformer_blocks.0.{n}"), DType::BF16, s)).collect();
    let layout = match BlockLayout::new(specs) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("codec-bench: {e}");
            std::process::exit(1);
        }
    };
    let mut bytes = vec![0u8; layout.bytes];
    let mut entropy = Vec::new();
    for (i, t) in layout.tensors.iter().enumerate() {
        let dst = &mut bytes[t.offset..t.offset + t.nbytes];
        let (mean, sigma) = match t.spec.shape.as_slice() {
            [_, fan_in] => (0.0, 1.0 / (*fan_in as f64).sqrt()),
            _ if t.spec.name.ends_with("bias") => (0.0, 0.01),
            _ => (1.0, 0.1),
        };
        normal_bf16(dst, 1 + i as u64, mean, sigma);
        entropy.push(serde_json::json!({"tensor": t.spec.name, "exponent_entropy_bits": exponent_entropy_bits(dst), "sigma": sigma}));
    }
    let t = Instant::now();
    let c = match compress_block(&layout, &bytes, threads) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("codec-bench: {e}");
            std::process::exit(1);
        }
    };
    let encode_s = t.elapsed().as_secs_f64();
    let mut out = vec![0u8; layout.bytes];
    let t = Instant::now();
    let decoded = decompress_block_into(&layout, c.as_bytes(), &mut out, "transformer_blocks.0");
    let decode_s = t.elapsed().as_secs_f64();
    let equal = decoded.is_ok() && out == bytes;
    let gb = layout.bytes as f64 / 1e9;
    let doc = serde_json::json!({
        "commit": opt("--commit").unwrap_or_default(), "gpu": "none", "threads": threads,
        "block_bytes": layout.bytes, "compressed_bytes": c.as_bytes().len(), "compression_ratio": c.ratio(),
        "exponent_entropy_bits": exponent_entropy_bits(&bytes), "encode_gbps_host": gb / encode_s,
        "decode_gbps_host_reference": gb / decode_s, "bitwise_equal": equal, "tensors": entropy,
    });
    println!(
        "{:.3} GB block: ratio {:.4}, exponent entropy {:.3} bits, encode {:.2} GB/s on {threads} threads, CPU reference decode {:.2} GB/s, equal {equal}",
        gb,
        c.ratio(),
        exponent_entropy_bits(&bytes),
        gb / encode_s,
        gb / decode_s
    );
    if let Some(path) = opt("--out") {
        if let Err(e) = std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n") {
            eprintln!("codec-bench: {path}: {e}");
            std::process::exit(1);
        }
    }
    if !equal {
        eprintln!("codec-bench: the decoded block differs from the original");
        std::process::exit(1);
    }
}
