//! How fast the bf16 exponent coding goes: the host encoder (one thread) and the
//! GPU decoder's kernel alone (the encoded bytes already on the device), on
//! normal-distributed weights of a linear layer's scale, checked bit-exact.
//! `cargo run --release -p offload-cuda --example codec_speed -- [MiB] [--json FILE] [--variants]`;
//! with `--variants` it also times every build of [`DecoderVariant::TIMED`] on the
//! same bytes (each checked bit-exact), after the ring's. Without a CUDA GPU it
//! says so and exits with status 2.

use offload_core::codec::{encode_bf16, exponent_entropy_bits};
use offload_cuda::codec::DecoderVariant;
use offload_cuda::CudaBackend;
use offload_cuda::ExponentDecoder;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(256);
    let json = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1));
    let variants = args.iter().any(|a| a == "--variants");
    let b = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("no CUDA GPU to decode on ({e}); this example needs one");
            std::process::exit(2);
        }
    };
    // A 3072-wide linear layer's init scale, as the bench's random weights.
    let raw = offload_cuda::codec::sample_normal_bf16(mib << 19, 1.0 / (3072f32).sqrt(), 7);
    let t = Instant::now();
    let enc = encode_bf16(&raw);
    let encode_s = t.elapsed().as_secs_f64();
    let entropy = exponent_entropy_bits(&raw);
    let d = ExponentDecoder::new(&b)?;
    let reps = 10;
    let (decode_s, out) = d.time_decodes(&b, &enc, "codec_speed", reps)?;
    let back = out.to_host()?;
    let exact = back == raw;
    let decode_gbps = (raw.len() * reps) as f64 / decode_s / 1e9;
    let ratio = enc.len() as f64 / raw.len() as f64;
    let encode_gbps = raw.len() as f64 / encode_s / 1e9;
    println!(
        "{mib} MiB bf16, sd 1/sqrt(3072): exponent entropy {entropy:.3} bits, coded {ratio:.4} of raw; \
         host encode (1 thread) {encode_gbps:.2} GB/s; GPU decode {decode_gbps:.1} GB/s of output; bit-exact {exact}"
    );
    // Each build on the same bytes, in turn, after the ring's (timed above).
    let mut timed = Vec::new();
    let mut all_exact = exact;
    for v in DecoderVariant::TIMED.into_iter().filter(|_| variants) {
        let d = ExponentDecoder::with_variant(&b, v)?;
        let (s, out) = d.time_decodes(&b, &enc, "codec_speed", reps)?;
        let ok = out.to_host()? == raw;
        all_exact &= ok;
        let gbps = (raw.len() * reps) as f64 / s / 1e9;
        println!("  build {}: {gbps:.1} GB/s of output; bit-exact {ok}", v.name());
        timed.push(format!("{{\"build\": \"{}\", \"decode_gbps\": {gbps:.2}, \"bit_exact\": {ok}}}", v.name()));
    }
    if let Some(path) = json {
        let doc = format!(
            "{{\"mib\": {mib}, \"exponent_entropy_bits\": {entropy:.4}, \"compression_ratio\": {ratio:.5}, \
             \"encode_gbps_host_one_thread\": {encode_gbps:.3}, \"decode_gbps\": {decode_gbps:.2}, \"bit_exact\": {exact}, \
             \"ring_build\": \"{}\", \"builds\": [{}]}}\n",
            DecoderVariant::RING.name(),
            timed.join(", ")
        );
        std::fs::write(path, doc)?;
    }
    if !all_exact {
        eprintln!("the decoded bytes differ from the original");
        std::process::exit(1);
    }
    Ok(())
}
