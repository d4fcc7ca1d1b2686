//! The registry against what the runner measured of the reference classes, and
//! through the project's discovery as a real checkpoint's names would arrive.

use offload_bench::registry::{self, BlockKind};
use offload_core::{BlockDiscovery, DType, DeclaredStacks, NameDiscovery, TensorSpec};
use serde_json::Value;

/// The committed comparison: the GPU runner's, every registered model (written by
/// `zoo-run.sh registry`, copied from its output unchanged).
fn committed_check() -> Vec<Value> {
    let path = format!("{}/registry-check/2026-11-30-runner.json", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).expect(&path)).expect("valid JSON")
}

/// Registered since the last check on the runner, to be checked by the next one
/// (`zoo-run.sh registry`). Once a committed check holds one, the test below
/// fails until it is taken off this list.
const NOT_YET_CHECKED: &[&str] = &[];

#[test]
fn the_registry_is_what_the_reference_classes_held_on_the_runner() {
    // registry_check.py built diffusers' classes on the meta device on the runner
    // and compared names and shapes with `zoo registry --json`; here the registry
    // of this build is recounted against the reference's own counts, so a change
    // to the registry needs a new check on the runner.
    let check = committed_check();
    for m in registry::models() {
        if NOT_YET_CHECKED.contains(&m.name) {
            assert!(check.iter().all(|c| c["model"] != m.name), "{} is checked now: take it off NOT_YET_CHECKED", m.name);
            continue;
        }
        let c = check.iter().find(|c| c["model"] == m.name).unwrap_or_else(|| panic!("{} was not checked on the runner", m.name));
        assert_eq!(c["equal"], true, "{}: the runner found differences: {c}", m.name);
        let params = m.params();
        let elements: u64 = params.iter().map(|p| p.numel() as u64).sum();
        assert_eq!(params.len() as u64, c["reference_params"].as_u64().unwrap(), "{}: parameter count", m.name);
        assert_eq!(elements, c["reference_elements"].as_u64().unwrap(), "{}: element count", m.name);
    }
}

fn checkpoint_names(m: &registry::Model) -> Vec<TensorSpec> {
    // A safetensors file lists its tensors sorted by name.
    let mut specs: Vec<TensorSpec> = m.params().into_iter().map(|p| TensorSpec::new(p.name, DType::BF16, p.shape)).collect();
    specs.sort_by(|a, b| a.name.cmp(&b.name));
    specs
}

#[test]
fn a_checkpoint_loads_through_declared_stacks_in_the_order_a_step_runs() {
    for m in registry::models() {
        let prefixes: Vec<&str> = m.stacks.iter().map(|s| s.prefix).collect();
        let inv = DeclaredStacks::new(prefixes.clone()).discover("transformer", &checkpoint_names(&m)).expect("discovery");
        let names: Vec<&str> = inv.stacks.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, prefixes, "{}", m.name);
        for (s, spec) in m.stacks.iter().zip(&inv.stacks) {
            assert_eq!(spec.blocks.len(), s.count, "{} {}", m.name, s.prefix);
            for (i, b) in spec.blocks.iter().enumerate() {
                let block_bytes: usize = b.tensors.iter().map(|t| t.shape.iter().product::<usize>() * 2).sum();
                assert_eq!(block_bytes as u64, s.block_params(i).iter().map(|p| p.numel() as u64 * 2).sum::<u64>(), "{} {i}", s.prefix);
            }
        }
        let mut globals: Vec<String> = inv.non_block.iter().map(|t| t.name.clone()).collect();
        globals.sort();
        let mut want: Vec<String> = m.globals.iter().map(|p| p.name.clone()).collect();
        want.sort();
        assert_eq!(globals, want, "{}: non-block weights", m.name);
    }
}

#[test]
fn name_discovery_finds_flux_dev_stacks_in_checkpoint_order_not_step_order() {
    // Why the registry declares its stacks: in a sorted checkpoint Flux's single
    // blocks come first, and discovery by names keeps the order names arrive in.
    let m = registry::flux_dev();
    let inv = NameDiscovery.discover("transformer", &checkpoint_names(&m)).expect("discovery");
    let names: Vec<&str> = inv.stacks.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["single_transformer_blocks", "transformer_blocks"]);
    assert_eq!(m.stacks[0].kind, BlockKind::DualStream);
}

#[test]
fn sizes_match_the_published_figures() {
    let (f, q) = (registry::flux_dev(), registry::qwen_image());
    // 22.05 GiB and 37.98 GiB of bf16 blocks; the largest block is a dual-stream one.
    assert_eq!(f.block_bytes(2), 23_674_566_656);
    assert_eq!(q.block_bytes(2), 40_779_755_520);
    assert_eq!(f.largest_block_bytes(2), 679_662_592);
    assert_eq!(q.largest_block_bytes(2), 679_662_592);
    assert_eq!(f.case("2048").unwrap().image_tokens, 16384);
    assert_eq!(q.case("1328").unwrap().image_tokens, 6889);
    assert!(q.case("4096").unwrap_err().contains("cases: 1024, 1328"));
    assert!(registry::model("sdxl").unwrap_err().contains("flux-dev, qwen-image"));
}

#[test]
fn short_runs_keep_the_first_blocks_and_add_a_case() {
    let sd3 = registry::model("sd3.5-large").unwrap();
    let short = registry::first_blocks(&sd3, 2);
    assert_eq!(short.stacks[0].count, 2);
    assert!(short.stacks[0].overrides.is_empty(), "the context-only block 37 is not among the first two");
    assert!(short.block_bytes(2) < sd3.block_bytes(2));
    assert_eq!(registry::first_blocks(&sd3, 100).block_bytes(2), sd3.block_bytes(2));
    let flux = registry::model("flux-dev").unwrap();
    let c = registry::extra_image_case(&flux, 256);
    assert_eq!((c.name.as_str(), c.image_tokens, c.text_tokens), ("256", 256, 512));
}

#[test]
fn a_users_case_follows_each_models_patching_and_says_all_of_it() {
    let case = |m: &str, size: Option<&str>, batch: Option<&str>, frames: Option<&str>| {
        registry::case_from_args(&registry::model(m).unwrap(), size, batch, frames)
    };
    assert!(case("flux-dev", None, None, None).unwrap().is_none(), "no option, no case");
    // Flux: (H/16)·(W/16) image tokens, T5's 512 text tokens, the batch asked.
    let c = case("flux-dev", Some("1344x768"), Some("2"), None).unwrap().unwrap();
    assert_eq!((c.name.as_str(), c.resolution, c.height, c.batch, c.frames), ("1344x768 b2 f1", 1344, 768, 2, 1));
    assert_eq!((c.image_tokens, c.text_tokens), (48 * 84, 512));
    // SD3.5 batches classifier-free guidance: its own batch unless one is given.
    let c = case("sd3.5-large", Some("768x1344"), None, None).unwrap().unwrap();
    assert_eq!((c.name.as_str(), c.image_tokens, c.batch), ("768x1344 b2 f1", 84 * 48, 2));
    // Wan: 81 frames are 21 latent frames (4× in time), 30 × 52 tokens each: the
    // registry's own 480x832x21 case; a batch alone keeps the model's size.
    let wan = registry::model("wan2.1-t2v-14b").unwrap();
    let c = case("wan2.1-t2v-14b", Some("832x480"), None, Some("81")).unwrap().unwrap();
    assert_eq!((c.name.as_str(), c.frames, c.image_tokens), ("832x480 b1 f81", 21, wan.case("480x832x21").unwrap().image_tokens));
    let c = case("wan2.1-t2v-14b", None, Some("2"), Some("33")).unwrap().unwrap();
    assert_eq!((c.name.as_str(), c.frames, c.image_tokens, c.batch), ("832x480 b2 f33", 9, 30 * 52 * 9, 2));
    // Flux's VAE decoder: 8 pixels a latent pixel.
    let c = case("flux-vae", Some("1344x768"), None, None).unwrap().unwrap();
    assert_eq!(c.image_tokens, 96 * 168);
    for (m, size, frames, says) in [
        ("flux-dev", Some("1344x760"), None, "multiples of 16"),
        ("flux-dev", Some("1344"), None, "WIDTHxHEIGHT"),
        ("flux-dev", None, Some("5"), "makes images"),
        ("wan2.1-t2v-14b", None, Some("80"), "4k + 1"),
        ("t5-xxl", Some("1024x1024"), None, "text encoder"),
    ] {
        let e = case(m, size, None, frames).unwrap_err();
        assert!(e.contains(says), "{m} {size:?} {frames:?}: {e}");
    }
}

/// Flux-dev as Black Forest Labs' checkpoint and the Flux GGUF releases name it
/// (fused `qkv` and `linear1`, `final_layer.adaLN_modulation.1`), built from the
/// registry's sizes, maps through `flux_bfl_to_diffusers` onto exactly the
/// registry's parameters, names and shapes: a GGUF release streams under the
/// registry's names, every tensor accounted for.
#[test]
fn a_bfl_named_flux_dev_maps_onto_the_registrys_parameters() {
    let m = registry::model("flux-dev").unwrap();
    let sizes = offload_formats::FluxSizes {
        hidden: m.hidden,
        head_dim: m.head_dim,
        mlp: m.mlp,
        double: m.stacks[0].count,
        single: m.stacks[1].count,
        pooled: m.pooled_dim.unwrap(),
        text: m.text_dim,
        in_channels: m.in_channels,
        out_channels: m.out_channels,
    };
    let bfl: Vec<TensorSpec> = offload_formats::flux_bfl_tensors(sizes)
        .into_iter()
        .map(|(name, shape)| TensorSpec::new(format!("model.diffusion_model.{name}"), DType::BF16, shape))
        .collect();
    let mut got: Vec<(String, Vec<usize>)> =
        offload_formats::gguf_to_diffusers("flux", &bfl).unwrap().into_iter().map(|(s, _)| (s.name, s.shape)).collect();
    let mut want: Vec<(String, Vec<usize>)> = m.params().into_iter().map(|p| (p.name, p.shape)).collect();
    got.sort();
    want.sort();
    assert_eq!(got.len(), want.len());
    assert_eq!(got, want);
}

/// Each quantized model's bytes as stored, against what the H200 measured of the
/// same storage applied to the real class (`model_bytes` in the runs named):
/// diffusers' layerwise casting as `enable_layerwise_casting` skips and with the class's patterns,
/// and the bench's GGUF Q8_0 blocks. A rule that casts one layer too many or too
/// few is off by that layer's bytes.
#[test]
fn stored_bytes_are_what_the_runner_measured_of_the_real_class() {
    let raw = offload_bench::raw_dir().display().to_string();
    for (name, run) in [
        ("flux-dev-fp8", "2026-12-03-py-8b90021/py-flux-dev-fp8-r1.json"),
        ("flux-dev-fp8-linears", "2026-12-04-py-8e92f2b-fp8-linears/py-flux-dev-fp8-linears-r1.json"),
        ("flux-dev-gguf-q8_0", "2026-12-04-py-a62e0cd-fp8-budget-gguf/py-flux-dev-gguf-q8_0-r1.json"),
        ("qwen-image-fp8", "2026-12-04-py-0b6eb55-qwen-fp8/py-qwen-image-fp8-r1.json"),
        // Wan's own patterns keep `patch_embedding` and `condition_embedder` bf16.
        ("wan2.1-t2v-14b-fp8", "2026-12-04-py-0e7f2f8-wan-fp8/py-wan2.1-t2v-14b-fp8-r1.json"),
    ] {
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(format!("{raw}/{run}")).unwrap()).unwrap();
        let measured = doc["cases"][0]["model_bytes"].as_u64().unwrap();
        let m = registry::quantized_models().into_iter().find(|m| m.name == name).unwrap();
        assert_eq!(m.stored_bytes(), measured, "{name}");
    }
    // bf16 is two bytes a weight; every quantized model stores less than its bf16
    // model (the ones not yet measured included), Q4_K less than Q8_0.
    let flux = registry::model("flux-dev").unwrap();
    assert_eq!(flux.stored_bytes(), 2 * flux.params().iter().map(|p| p.numel() as u64).sum::<u64>());
    for (name, of, _) in registry::QUANTIZED {
        let q = registry::quantized_models().into_iter().find(|m| m.name == name).unwrap().stored_bytes();
        assert!(q < registry::model(of).unwrap().stored_bytes(), "{name}");
    }
    let bytes = |n: &str| registry::quantized_models().into_iter().find(|m| m.name == n).unwrap().stored_bytes();
    assert!(bytes("flux-dev-gguf-q4_k") < bytes("flux-dev-gguf-q8_0"));
}

/// The registry file the Python bench reads says each quantized model's storage
/// and bytes; the Rust drivers refuse a quantized model by name, saying where it runs.
#[test]
fn quantized_models_are_in_the_registry_file_and_refused_by_the_rust_drivers() {
    let doc = registry::to_json(&registry::quantized_models());
    let q8 = doc.as_array().unwrap().iter().find(|m| m["name"] == "flux-dev-gguf-q8_0").unwrap();
    assert_eq!(q8["storage"], "gguf-q8_0");
    assert_eq!(q8["reference"], registry::model("flux-dev").unwrap().reference);
    assert!(q8["stored_bytes"].as_u64().unwrap() < 2 * 12_000_000_000);
    let e = registry::model("flux-dev-gguf-q8_0").unwrap_err();
    assert!(e.contains("flux-dev stored gguf-q8_0") && e.contains("py-run.sh"), "{e}");
}
