//! candle-transformers' SD3 joint blocks, unmodified, streamed through offload on
//! the CPU device: output byte-identical to candle's resident run.

use candle_core::Device;
use offload_candle::sd3::Sd3Blocks;
use offload_candle::CandleBackend;

#[test]
fn sd3_joint_blocks_stream_bitwise_equal() {
    let path = std::env::temp_dir().join(format!("offload-sd3-{}.safetensors", std::process::id()));
    let model = Sd3Blocks { hidden: 128, heads: 2, depth: 4 };
    model.write_random(&path).unwrap();
    let backend = CandleBackend::cpu();
    let o = model.run(&backend, &Device::Cpu, &path, (8, 32)).expect("runs");
    let _ = std::fs::remove_file(&path);
    backend.host_device().check().expect("no protocol violation");
    assert_eq!(o.resident.len(), 32 * 128);
    assert!(o.resident.iter().any(|v| *v != 0.0) && o.resident.iter().all(|v| v.is_finite()));
    assert!(o.bitwise_equal(), "streamed output differs from candle's resident run");
    assert_eq!(o.metrics.misses, 0);
    assert_eq!(o.metrics.blocks, 4);
    // Two slots of one block each, never the whole model.
    let peak = backend.host_device().stats().peak_bytes;
    assert!(peak < o.model_bytes, "{peak} vs {}", o.model_bytes);
}

/// The same blocks from a store built by `HostStore::build_mapped` on candle's
/// CPU device: every block served from the file (read into the device's memory,
/// which is host memory here), the output byte-identical to the resident run.
#[test]
fn sd3_joint_blocks_from_the_mapped_store_stream_bitwise_equal() {
    let path = std::env::temp_dir().join(format!("offload-sd3-mapped-{}.safetensors", std::process::id()));
    let model = Sd3Blocks { hidden: 128, heads: 2, depth: 4 };
    model.write_random(&path).unwrap();
    let backend = CandleBackend::cpu();
    let file = offload_core::SafetensorsFile::open(&path).unwrap();
    let o = model.run_mapped(&backend, &Device::Cpu, file, (8, 32)).expect("runs");
    let _ = std::fs::remove_file(&path);
    backend.host_device().check().expect("no protocol violation");
    assert_eq!((o.host_tier.mapped, o.host_tier.copied), (4, 0), "{:?}", o.host_tier);
    assert!(o.resident.iter().any(|v| *v != 0.0) && o.resident.iter().all(|v| v.is_finite()));
    assert!(o.bitwise_equal(), "streamed output differs from candle's resident run");
}
