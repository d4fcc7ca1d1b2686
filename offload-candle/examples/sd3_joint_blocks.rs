//! SD3's MMDiT joint blocks from candle-transformers, unmodified, streamed block by
//! block through offload on the CPU, compared byte for byte with candle's
//! resident run: `cargo run --release -p offload-candle --example sd3_joint_blocks`.

use candle_core::Device;
use offload_candle::sd3::Sd3Blocks;
use offload_candle::CandleBackend;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("offload-sd3-joint-blocks.safetensors");
    let model = Sd3Blocks { hidden: 512, heads: 8, depth: 8 };
    model.write_random(&path)?;
    let backend = CandleBackend::cpu();
    let o = model.run(&backend, &Device::Cpu, &path, (64, 256));
    let _ = std::fs::remove_file(&path);
    let o = o?;
    println!("SD3 joint blocks (candle-transformers, unmodified): {} blocks, hidden {}, {} heads", model.depth, model.hidden, model.heads);
    println!(
        "model {:.1} MiB, peak device bytes for weights streamed {:.1} MiB",
        o.model_bytes as f64 / 1048576.0,
        o.metrics.peak_device_weight_bytes as f64 / 1048576.0
    );
    println!("{}", o.metrics);
    let same = o.bitwise_equal();
    println!("outputs bitwise identical to candle's resident run: {}", if same { "yes" } else { "NO" });
    if same {
        Ok(())
    } else {
        Err("outputs differ".into())
    }
}
