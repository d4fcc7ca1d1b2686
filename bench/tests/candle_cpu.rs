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
fn candle_computes_every_registered_model_but_wan_and_the_vae() {
    // The filter above must keep the models candle's file is meant to run: all but
    // Wan 2.1 (issue 15 asks candle for SD3.5, Z-Image and the two text encoders)
    // and the VAE (the pipeline case runs on tch).
    for m in registry::models() {
        assert_eq!(offload_bench::candle::computes(&m), !["wan2.1-t2v-14b", "flux-vae"].contains(&m.name), "{}", m.name);
    }
}

#[test]
fn calibration_times_every_block_of_the_step() {
    for m in registry::models().into_iter().filter(offload_bench::candle::computes) {
        let tiny = registry::tiny(&m);
        let blocks: usize = tiny.stacks.iter().map(|s| s.count).sum();
        let t = offload_bench::candle::calibrate_cpu(&tiny, 2).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert_eq!(t.len(), blocks, "{}: one time per block", m.name);
        assert!(t.iter().all(|&x| x.is_finite() && x > 0.0), "{}: {t:?}", m.name);
    }
}

#[test]
fn a_users_non_square_batched_case_runs_at_its_own_shape() {
    // 96 × 32 pixels, batch 2: 6 × 2 tokens a sample, 64 channels out; a case that
    // ignored --size or --batch would give another count.
    for m in [registry::flux_dev(), registry::qwen_image(), registry::sd35_large()] {
        let mut tiny = registry::tiny(&m);
        let case = registry::case_from_args(&tiny, Some("96x32"), Some("2"), None).unwrap().unwrap();
        assert_eq!((case.name.as_str(), case.image_tokens, case.batch), ("96x32 b2 f1", 12, 2), "{}", m.name);
        tiny.cases = vec![case];
        let c = offload_bench::candle::check_cpu(&tiny).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert!(c.bitwise_equal && c.finite && c.nonconstant, "{}: {c:?}", m.name);
        assert_eq!(c.output_elements, 2 * 12 * 64, "{}: output elements", m.name);
    }
}
