//! The reference model on a device with fp8 weights streamed as stored.
use crate::device::CudaBackend;
use crate::reference::{DualNames, RefDims, RefNet, HEAD_DIM};
use offload_core::{
    resolve, BlockDiscovery, DType, HostStore, MemoryTensors, NameDiscovery, OffloadBackend, Plan, Ring, TensorSource, TensorSpec,
};
use offload_formats::fp8::{dequantize_to_bf16, f32_to_fp8};
use std::sync::Arc;

const NAMES: DualNames<'static> =
    DualNames { img_mod: "norm1.linear", txt_mod: "norm1_context.linear", img_mlp: "ff", txt_mlp: "ff_context" };

/// Flux's linear layers of a dual-stream block and a single-stream block: (name, out, in).
fn linears(h: usize, mlp: usize) -> [Vec<(String, usize, usize)>; 2] {
    let mut dual = vec![("norm1.linear".into(), 6 * h, h), ("norm1_context.linear".into(), 6 * h, h)];
    for l in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"] {
        dual.push((format!("attn.{l}"), h, h));
    }
    for ff in ["ff", "ff_context"] {
        dual.push((format!("{ff}.net.0.proj"), mlp, h));
        dual.push((format!("{ff}.net.2"), h, mlp));
    }
    let mut single = vec![("norm.linear".into(), 3 * h, h), ("proj_mlp".into(), mlp, h), ("proj_out".into(), h, h + mlp)];
    for l in ["to_q", "to_k", "to_v"] {
        single.push((format!("attn.{l}"), h, h));
    }
    [dual, single]
}

fn bf16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// How one block of the test model stores its linear weights: fp8 dtype, the
/// scale's tensor suffix (none: unscaled) and dtype, and per channel or per tensor.
struct Variant {
    dtype: DType,
    scale: Option<(&'static str, DType, bool)>,
}

/// The four blocks' variants: E4M3 per channel in `weight_scale` of `scale_dtype`;
/// E4M3 unscaled; E5M2 per tensor in ComfyUI's `scale_weight` (f32); E4M3 per
/// tensor in `weight_scale` of `scale_dtype`.
fn variants(scale_dtype: DType) -> [Variant; 4] {
    [
        Variant { dtype: DType::F8_E4M3, scale: Some(("weight_scale", scale_dtype, true)) },
        Variant { dtype: DType::F8_E4M3, scale: None },
        Variant { dtype: DType::F8_E5M2, scale: Some(("scale_weight", DType::F32, false)) },
        Variant { dtype: DType::F8_E4M3, scale: Some(("weight_scale", scale_dtype, false)) },
    ]
}

/// Two stores of one model (two dual-, then two single-stream blocks, each of
/// [`variants`]'s kinds in turn): every linear weight fp8, and the same model in
/// bf16 holding each weight as `dequantize_to_bf16` makes it. Biases and norms
/// bf16 in both.
fn models(h: usize, mlp: usize, scale_dtype: DType) -> (MemoryTensors, MemoryTensors) {
    let (mut fp8, mut bf16) = (MemoryTensors::new(), MemoryTensors::new());
    let mut seed = 11u64;
    let [dual, single] = linears(h, mlp);
    let blocks = (0..2)
        .map(|i| (format!("transformer_blocks.{i}"), &dual))
        .chain((0..2).map(|i| (format!("single_transformer_blocks.{i}"), &single)))
        .zip(variants(scale_dtype));
    for ((prefix, layers), var) in blocks {
        for (name, out, k) in layers.iter() {
            seed += 1;
            let v = crate::codec::sample_normal_bf16(out * k, 0.05, seed);
            let f: Vec<f32> = v.chunks_exact(2).map(|p| f32::from_bits(u32::from(u16::from_le_bytes([p[0], p[1]])) << 16)).collect();
            let max = if var.dtype == DType::F8_E5M2 { 57344.0 } else { 448.0 };
            let amax = |xs: &[f32]| xs.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6) / max;
            let scales: Vec<f32> = match var.scale {
                None => vec![1.0],
                Some((_, _, true)) => f.chunks(*k).map(amax).collect(),
                Some((_, _, false)) => vec![amax(&f)],
            };
            // A bf16 scale is what the device reads: the weights are quantised by it.
            let scales: Vec<f32> = match var.scale {
                Some((_, DType::BF16, _)) => {
                    scales.iter().map(|s| f32::from_bits(u32::from(offload_formats::fp8::f32_to_bf16(*s)) << 16)).collect()
                }
                _ => scales,
            };
            let per_row = |r: usize| scales[if scales.len() == 1 { 0 } else { r }];
            let w: Vec<u8> = f
                .chunks(*k)
                .enumerate()
                .flat_map(|(r, row)| row.iter().map(move |x| f32_to_fp8(x / per_row(r), var.dtype).unwrap()))
                .collect();
            let deq = dequantize_to_bf16(&w, var.dtype, *out, &scales).unwrap();
            let full = format!("{prefix}.{name}");
            fp8.push(TensorSpec::new(format!("{full}.weight"), var.dtype, [*out, *k]), w).unwrap();
            if let Some((suffix, dt, _)) = var.scale {
                let bytes: Vec<u8> = match dt {
                    DType::BF16 => scales.iter().flat_map(|s| offload_formats::fp8::f32_to_bf16(*s).to_le_bytes()).collect(),
                    _ => scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
                };
                fp8.push(TensorSpec::new(format!("{full}.{suffix}"), dt, [scales.len()]), bytes).unwrap();
            }
            bf16.push(TensorSpec::new(format!("{full}.weight"), DType::BF16, [*out, *k]), bf16_bytes(&deq)).unwrap();
            seed += 1;
            let b = crate::codec::sample_normal_bf16(*out, 0.02, seed);
            fp8.push(TensorSpec::new(format!("{full}.bias"), DType::BF16, [*out]), b.clone()).unwrap();
            bf16.push(TensorSpec::new(format!("{full}.bias"), DType::BF16, [*out]), b).unwrap();
        }
        let norms: &[&str] =
            if prefix.starts_with("single") { &["norm_q", "norm_k"] } else { &["norm_q", "norm_k", "norm_added_q", "norm_added_k"] };
        for n in norms {
            // bf16 values near 1 (0x3f80 ± a few ulps).
            let v: Vec<u8> = (0..HEAD_DIM as u16).flat_map(|i| (0x3f70u16 + (i % 32)).to_le_bytes()).collect();
            for t in [&mut fp8, &mut bf16] {
                t.push(TensorSpec::new(format!("{prefix}.attn.{n}.weight"), DType::BF16, [HEAD_DIM]), v.clone()).unwrap();
            }
        }
    }
    (fp8, bf16)
}

/// `steps` forward calls of the reference model through a ring of `plan` over
/// `src`'s blocks: the output after each.
fn run(b: &CudaBackend, d: RefDims, src: &MemoryTensors, plan: &Plan, steps: usize) -> offload_core::Result<Vec<Vec<u16>>> {
    let inv = NameDiscovery.discover("transformer", src.specs())?;
    if inv.stacks.iter().map(|s| s.blocks.len()).sum::<usize>() != 4 {
        return Err(offload_core::Error::Protocol(format!("discovery found {:?}", inv.stacks.iter().map(|s| &s.name).collect::<Vec<_>>())));
    }
    let store = Arc::new(HostStore::build(b, &inv, src)?);
    let rc = resolve(plan, std::slice::from_ref(&inv))?;
    let mut ring = Ring::new(b.clone(), store, &rc.components[0])?;
    let mut net = RefNet::new(b, d, 3)?;
    let mut outs = Vec::new();
    for _ in 0..steps {
        net.begin_step()?;
        for i in 0..2 {
            let g = ring.block("transformer_blocks", i)?;
            net.dual_block(&g, &NAMES)?;
            g.finish()?;
        }
        for i in 0..2 {
            let g = ring.block("single_transformer_blocks", i)?;
            net.single_block(&g)?;
            g.finish()?;
        }
        ring.end_step()?;
        outs.push(net.output()?);
    }
    ring.close()?;
    Ok(outs)
}

/// On a GPU: the reference model with every linear weight fp8 (one block of each
/// of [`variants`]: E4M3 and E5M2, per channel, per tensor and unscaled,
/// `weight_scale` and `scale_weight`; the scales f32, then bf16) streamed as
/// stored at depth 1, over three steps, gives the resident fp8 run's output and
/// the bf16 model of the CPU's dequantised weights' output, bit for bit (so the
/// device's dequantisation is `offload_formats::fp8::dequantize_to_bf16` exactly);
/// the output is finite and not constant. A wrong scale changes it; an f16 scale
/// is refused by name. Without a device it prints SKIPPED (and fails under
/// `OFFLOAD_REQUIRE_DEVICE=1`).
#[test]
fn fp8_weights_streamed_as_stored_compute_the_dequantised_bf16_model() {
    let Some(b) = super::test_backend() else { return };
    let d = RefDims { heads: 2, mlp: 512, text_tokens: 8, image_tokens: 56 };
    let (h, mlp) = (d.hidden(), d.mlp);
    for scale_dtype in [DType::F32, DType::BF16] {
        let (fp8, bf16) = models(h, mlp, scale_dtype);
        let streamed = run(&b, d, &fp8, &Plan::layerwise().prefetch_depth(1), 3).unwrap();
        let resident = run(&b, d, &fp8, &Plan::resident(), 1).unwrap();
        let reference = run(&b, d, &bf16, &Plan::layerwise().prefetch_depth(1), 1).unwrap();
        let x: Vec<f32> = streamed[0].iter().map(|v| f32::from_bits(u32::from(*v) << 16)).collect();
        assert!(x.iter().all(|v| v.is_finite()) && x.iter().any(|v| *v != x[0]), "{scale_dtype:?}: output not finite or constant");
        for (i, s) in streamed.iter().enumerate() {
            assert!(s == &resident[0], "{scale_dtype:?}: streamed step {i} differs from the resident fp8 step");
        }
        assert!(streamed[0] == reference[0], "{scale_dtype:?}: the fp8 model differs from the bf16 model of its dequantised weights");
        if scale_dtype == DType::F32 {
            // Sabotage: one output channel's scale doubled changes the result.
            let mut wrong = MemoryTensors::new();
            for s in fp8.specs() {
                let mut bytes = fp8.bytes(&s.name).unwrap().to_vec();
                if s.name == "transformer_blocks.0.attn.to_q.weight_scale" {
                    let v = f32::from_le_bytes(bytes[..4].try_into().unwrap()) * 2.0;
                    bytes[..4].copy_from_slice(&v.to_le_bytes());
                }
                wrong.push(s.clone(), bytes).unwrap();
            }
            let out = run(&b, d, &wrong, &Plan::layerwise().prefetch_depth(1), 1).unwrap();
            assert!(out[0] != reference[0], "a doubled scale went unseen");
        }
    }
    // An f16 scale is refused by name.
    let (fp8, _) = models(h, mlp, DType::F32);
    let mut f16 = MemoryTensors::new();
    for s in fp8.specs() {
        let bytes = fp8.bytes(&s.name).unwrap().to_vec();
        if s.name == "transformer_blocks.0.attn.to_q.weight_scale" {
            // The f32 scales' first half read as f16: as many values as half the bytes hold.
            f16.push(TensorSpec::new(s.name.clone(), DType::F16, [bytes.len() / 4]), bytes[..bytes.len() / 2].to_vec()).unwrap();
        } else {
            f16.push(s.clone(), bytes).unwrap();
        }
    }
    let e = run(&b, d, &f16, &Plan::layerwise().prefetch_depth(1), 1).unwrap_err().to_string();
    assert!(e.contains("transformer_blocks.0.attn.to_q.weight_scale") && e.contains("F16"), "{e}");
    b.poll_error().unwrap();
}

/// The test model above (no device needed): four blocks found by name, each of
/// its variant: E4M3 with per-channel `weight_scale`, E4M3 unscaled, E5M2 with a
/// per-tensor `scale_weight`, E4M3 with a per-tensor `weight_scale`.
#[test]
fn the_fp8_test_model_is_four_blocks_one_of_each_variant() {
    let (fp8, bf16) = models(256, 512, DType::F32);
    for t in [&fp8, &bf16] {
        let inv = NameDiscovery.discover("transformer", t.specs()).unwrap();
        let blocks: Vec<usize> = inv.stacks.iter().map(|s| s.blocks.len()).collect();
        assert_eq!(blocks, [2, 2]);
    }
    let count = |prefix: &str, f: &dyn Fn(&TensorSpec) -> bool| fp8.specs().iter().filter(|s| s.name.starts_with(prefix) && f(s)).count();
    let weight = |dt: DType| move |s: &TensorSpec| s.name.ends_with(".weight") && s.dtype == dt;
    let scale = |suffix: &'static str, n: usize| move |s: &TensorSpec| s.name.ends_with(suffix) && s.shape == [n].as_slice();
    assert_eq!(count("transformer_blocks.0.", &weight(DType::F8_E4M3)), 14);
    assert_eq!(count("transformer_blocks.0.attn.to_q.", &scale(".weight_scale", 256)), 1, "per channel");
    assert_eq!(count("transformer_blocks.1.", &weight(DType::F8_E4M3)), 14);
    assert_eq!(count("transformer_blocks.1.", &|s| s.name.contains("scale")), 0, "unscaled");
    assert_eq!(count("single_transformer_blocks.0.", &weight(DType::F8_E5M2)), 6);
    assert_eq!(count("single_transformer_blocks.0.", &scale(".scale_weight", 1)), 6, "per tensor");
    assert_eq!(count("single_transformer_blocks.1.", &weight(DType::F8_E4M3)), 6);
    assert_eq!(count("single_transformer_blocks.1.", &scale(".weight_scale", 1)), 6, "per tensor");
}
