//! candle's file of the bench room on candle's CPU device: the registry's
//! blocks, shrunk, resident and streamed through the ring; the streamed output
//! must be byte-identical, finite and varied, and every block served.
#![cfg(feature = "candle")]

use offload_bench::registry;

#[test]
fn tiny_registry_models_stream_bitwise_equal_on_the_cpu() {
    for m in registry::models().into_iter().filter(offload_bench::candle::computes) {
        let tiny = registry::tiny(&m);
        let blocks: usize = tiny.stacks.iter().map(|s| s.count).sum();
        let c = offload_bench::candle::check_cpu(&tiny).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert!(c.bitwise_equal, "{}: streamed output differs from resident", m.name);
        assert!(c.finite && c.nonconstant, "{}: output finite {} varied {}", m.name, c.finite, c.nonconstant);
        assert_eq!(c.blocks, blocks as u64, "{}: blocks served", m.name);
        assert_eq!(c.block_payload_bytes, tiny.block_bytes(2), "{}: the store's block tensors against the registry", m.name);
    }
}

#[test]
fn candle_computes_flux_qwen_sd3_and_z_image() {
    // The filter above must keep the models candle's file is meant to run.
    let names: Vec<&str> = registry::models().into_iter().filter(offload_bench::candle::computes).map(|m| m.name).collect();
    for want in ["flux-dev", "qwen-image", "sd3.5-large", "z-image-turbo"] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
}
