//! tch's file of the bench room on libtorch's CPU device: the registry's blocks,
//! shrunk, computed resident and streamed through the ring; the streamed output
//! must be byte-identical, finite and varied, and every block served.
#![cfg(feature = "tch")]

use offload_bench::registry;

/// `zoo run --backend tch`'s own code on the CPU: every tiny model resident,
/// then streamed at depths 1 and 2 through the zoo's loop, each output bitwise
/// equal to the resident one, finite and varied, with no block missed.
#[test]
fn tiny_registry_models_stream_bitwise_equal_on_the_cpu() {
    for m in registry::models().into_iter().filter(offload_bench::tch::computes) {
        let tiny = registry::tiny(&m);
        let opts = offload_bench::harness::RunOptions {
            cases: vec![tiny.cases[0].name.clone()],
            depths: vec![1, 2],
            steps: 1,
            warmup: 1,
            ..Default::default()
        };
        let doc = offload_bench::tch::run_cpu(&tiny, &opts).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert_eq!(doc.cases.len(), 2, "{}", m.name);
        for c in &doc.cases {
            assert!(c.bitwise_equal, "{} d={}: streamed output differs from resident", m.name, c.depth);
            assert!(c.output_finite && c.output_nonconstant, "{} d={}: {c:?}", m.name, c.depth);
            assert_eq!(c.misses, 0, "{} d={}: every block prefetched, the warm-up step's included", m.name, c.depth);
        }
    }
}

#[test]
fn tch_computes_every_registered_model() {
    // The filter above must not drop any model silently.
    for m in registry::models() {
        assert!(offload_bench::tch::computes(&m), "{}", m.name);
    }
    // Z-Image's context refiner is not modulated; its other stacks are.
    let z = registry::tiny(&registry::model("z-image-turbo").unwrap());
    let modulated: Vec<bool> = z.stacks.iter().map(|s| s.params.iter().any(|p| p.name.starts_with("adaLN_modulation"))).collect();
    assert_eq!(modulated, [true, false, true]);
    // The shrunk SD3 keeps its context-only last block.
    let sd3 = registry::tiny(&registry::model("sd3.5-large").unwrap());
    let s = &sd3.stacks[0];
    assert!(!s.block_params(s.count - 1).iter().any(|p| p.name.starts_with("attn.to_add_out")));
    assert!(s.block_params(0).iter().any(|p| p.name.starts_with("attn.to_add_out")));
}

#[test]
fn the_pipeline_case_is_bitwise_equal_per_component_on_the_cpu() {
    // Encoder streamed, DiT streamed with its first block resident, VAE loaded
    // whole around its decode: each component's output equal to the resident
    // pipeline's, byte for byte, and the check able to fail (other noise differs).
    let p = offload_bench::tch::Pipeline::flux("1024", 4).unwrap().tiny();
    let c = offload_bench::tch::check_pipeline_cpu(&p).unwrap();
    assert_eq!(c.bitwise_equal, [true; 3], "{c:?}");
    assert_eq!(c.sane, [true; 3], "{c:?}");
    assert!(c.other_noise_differs, "{c:?}");
    assert_eq!(c.dit_resident, p.steps, "the DiT's first block served resident once per step: {c:?}");
}
