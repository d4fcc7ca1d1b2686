//! candle's file of the bench room on candle's CPU device: `zoo run --backend
//! candle`'s own code (`candle::run_cpu`) over the registry's blocks, shrunk,
//! resident and streamed through the ring; every streamed output must be
//! byte-identical to the resident one, finite and varied.
#![cfg(feature = "candle")]

use offload_bench::registry;

#[test]
fn candle_computes_every_registered_model_but_wan_and_the_vae() {
    // The loop test's filter must keep the models candle's file is meant to run: all but
    // Wan 2.1 (candle's registry rows are SD3.5, Z-Image and the two text encoders)
    // and the VAE (the pipeline case runs on tch).
    for m in registry::models() {
        assert_eq!(offload_bench::candle::computes(&m), !["wan2.1-t2v-14b", "flux-vae"].contains(&m.name), "{}", m.name);
    }
}

/// `zoo run --backend candle`'s code on the CPU: every tiny model through the
/// zoo's loop at depths 1 and 2, the planner's depth and under a device budget,
/// each row bitwise equal to the resident run, finite and varied; the planner's
/// calibration times every block.
#[test]
fn the_zoo_loop_runs_candles_file_at_every_depth_the_planners_and_a_budget() {
    for m in registry::models().into_iter().filter(offload_bench::candle::computes) {
        let tiny = registry::tiny(&m);
        let blocks: usize = tiny.stacks.iter().map(|s| s.count).sum();
        // A budget under every block's bytes where the model has more than two
        // (the planner streams some), and at least two of the largest (a ring of
        // depth 1), with room for the store's alignment.
        let smallest = tiny.stacks.iter().map(|s| s.bytes(0, 2)).min().unwrap_or(0);
        let bytes = (tiny.block_bytes(2) - smallest).max(2 * tiny.largest_block_bytes(2));
        let budget = bytes as f64 * 1.02 / (1u64 << 30) as f64;
        let opts = offload_bench::harness::RunOptions {
            cases: vec![tiny.cases[0].name.clone()],
            depths: vec![1, 2],
            auto_depth: true,
            budgets_gib: vec![budget],
            steps: 1,
            warmup: 1,
            ..Default::default()
        };
        let doc = offload_bench::candle::run_cpu(&tiny, &opts).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert_eq!(doc.cases.len(), 3, "{}: depths 1, 2 and the planner's", m.name);
        for c in &doc.cases {
            assert!(c.bitwise_equal && c.output_finite && c.output_nonconstant, "{} d={}: {c:?}", m.name, c.depth);
        }
        assert!(doc.cases[2].planner_depth.is_some(), "{}", m.name);
        let cost = &doc.calibrations.first().unwrap_or_else(|| panic!("{}: no calibration", m.name)).cost;
        assert_eq!(cost.blocks.len(), blocks, "{}: one time per block", m.name);
        assert!(cost.blocks.iter().all(|b| b.compute_s.is_finite() && b.compute_s > 0.0), "{}: {:?}", m.name, cost.blocks);
        assert!(doc.budgets.len() == 1 && doc.budgets[0].bitwise_equal, "{}: {:?}", m.name, doc.budgets);
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
        let opts = offload_bench::harness::RunOptions { cases: vec![case.name.clone()], depths: vec![1], steps: 1, ..Default::default() };
        tiny.cases = vec![case];
        let doc = offload_bench::candle::run_cpu(&tiny, &opts).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let c = &doc.cases[0];
        assert!(c.bitwise_equal && c.output_finite && c.output_nonconstant, "{}: {c:?}", m.name);
        assert_eq!(c.output_elements, 2 * 12 * 64, "{}: output elements", m.name);
    }
}
