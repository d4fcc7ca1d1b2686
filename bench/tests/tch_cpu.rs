//! tch's file of the bench room on libtorch's CPU device: the registry's blocks,
//! shrunk, computed resident and streamed through the ring; the streamed output
//! must be byte-identical, finite and varied, and every block served.
#![cfg(feature = "tch")]

use offload_bench::registry;

#[test]
fn tiny_registry_models_stream_bitwise_equal_on_the_cpu() {
    for m in registry::models().into_iter().filter(offload_bench::tch::computes) {
        let tiny = registry::tiny(&m);
        let blocks: usize = tiny.stacks.iter().map(|s| s.count).sum();
        let c = offload_bench::tch::check_cpu(&tiny).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        assert!(c.bitwise_equal, "{}: streamed output differs from resident", m.name);
        assert!(c.finite && c.nonconstant, "{}: output finite {} varied {}", m.name, c.finite, c.nonconstant);
        assert_eq!(c.blocks, blocks as u64, "{}: blocks served", m.name);
        assert_eq!(c.block_payload_bytes, tiny.block_bytes(2), "{}: the store's block tensors against the registry", m.name);
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
