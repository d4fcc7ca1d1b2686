//! candle-transformers' SD3 joint blocks, unmodified, streamed through offload on
//! the CPU device: output byte-identical to candle's resident run.

mod common;

#[test]
fn sd3_joint_blocks_stream_bitwise_equal() {
    let path = std::env::temp_dir().join(format!("offload-sd3-{}.safetensors", std::process::id()));
    let o = common::run(&path, 128, 2, 4, (8, 32)).expect("runs");
    let _ = std::fs::remove_file(&path);
    assert_eq!(o.resident.len(), 32 * 128);
    assert!(o.resident.iter().any(|v| *v != 0.0) && o.resident.iter().all(|v| v.is_finite()));
    let same = o.resident.iter().zip(&o.streamed).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "streamed output differs from candle's resident run");
    assert_eq!(o.metrics.misses, 0);
    assert_eq!(o.metrics.blocks, 4);
    // Two slots of one block each, never the whole model.
    assert!(o.peak_device_bytes < o.model_bytes, "{} vs {}", o.peak_device_bytes, o.model_bytes);
}
