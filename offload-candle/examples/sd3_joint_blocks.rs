//! SD3's MMDiT joint blocks from candle-transformers, unmodified, streamed block by
//! block through offload on the CPU, compared byte for byte with candle's
//! resident run: `cargo run --release -p offload-candle --example sd3_joint_blocks`.

#[path = "../tests/common/mod.rs"]
mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("offload-sd3-joint-blocks.safetensors");
    let (hidden, heads, depth) = (512, 8, 8);
    let o = common::run(&path, hidden, heads, depth, (64, 256))?;
    let same = o.resident.iter().zip(&o.streamed).all(|(a, b)| a.to_bits() == b.to_bits());
    println!("SD3 joint blocks (candle-transformers, unmodified): {depth} blocks, hidden {hidden}, {heads} heads");
    println!(
        "model {:.1} MiB, peak device bytes streamed {:.1} MiB",
        o.model_bytes as f64 / 1048576.0,
        o.peak_device_bytes as f64 / 1048576.0
    );
    println!("{}", o.metrics);
    println!("outputs bitwise identical to candle's resident run: {}", if same { "yes" } else { "NO" });
    let _ = std::fs::remove_file(&path);
    if same {
        Ok(())
    } else {
        Err("outputs differ".into())
    }
}
