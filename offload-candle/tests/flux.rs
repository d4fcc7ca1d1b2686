//! The Flux-shaped candle blocks streamed on the CPU device: output byte-identical
//! to the all-resident run, at depths 1 and 2.

use candle_core::{DType, Device, Tensor};
use offload_candle::flux::{step, FluxShape, RandomFlux};
use offload_candle::CandleBackend;
use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, Plan, Ring, TensorSource};
use std::sync::Arc;

#[test]
fn flux_blocks_stream_bitwise_equal_on_cpu() {
    let shape = FluxShape { hidden: 64, heads: 4, mlp: 256 };
    let (nd, ns) = (2, 3);
    let src = RandomFlux::new(shape, nd, ns, 11);
    let inv = NameDiscovery.discover("transformer", src.specs()).unwrap();
    let be = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&be, &inv, &src).unwrap());
    let r = |s: &[usize], seed: u64| {
        Tensor::rand(-1f32, 1f32, s, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap().affine(1.0, seed as f64 * 1e-3).unwrap()
    };
    let (img, txt, vec) = (r(&[1, 16, 64], 1), r(&[1, 8, 64], 2), r(&[1, 64], 3));
    let run = |plan: &Plan| {
        let rc = resolve(plan, std::slice::from_ref(&inv)).unwrap().components.remove(0);
        let mut ring = Ring::new(be.clone(), store.clone(), &rc).unwrap();
        let out: Vec<Vec<u8>> = (0..2)
            .map(|_| {
                let t = step(&mut ring, shape, (nd, ns), &img, &txt, &vec).unwrap();
                t.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect()
            })
            .collect();
        let m = ring.metrics();
        ring.close().unwrap();
        (out, m)
    };
    let (resident, _) = run(&Plan::resident());
    assert!(resident[0].iter().any(|b| *b != 0));
    for d in [1, 2] {
        let (streamed, m) = run(&Plan::layerwise().prefetch_depth(d));
        assert_eq!(streamed, resident, "d = {d}: streamed output differs from the resident run");
        assert_eq!(m.misses, 0);
    }
}

/// Attention in groups of heads and of query rows gives the whole computation's
/// result: each case is compared with the ungrouped call on random inputs.
#[test]
fn chunked_attention_matches_the_whole() {
    use offload_candle::flux::attention_chunked;
    let dev = Device::Cpu;
    let (b, h, t, hd) = (1, 6, 40, 16);
    let r = || Tensor::randn(0f32, 1.0, (b, h, t, hd), &dev).unwrap();
    let (q, k, v) = (r(), r(), r());
    let whole = attention_chunked(&q, &k, &v, usize::MAX).unwrap();
    assert_eq!(whole.dims(), &[b, t, h * hd]);
    let whole: Vec<f32> = whole.flatten_all().unwrap().to_vec1().unwrap();
    assert!(whole.iter().any(|x| *x != 0.0));
    // 2 heads per group; one head in 3 row groups (14, 14, 12 rows); one row at a time.
    for max in [2 * t * t, 14 * t, 1] {
        let part: Vec<f32> = attention_chunked(&q, &k, &v, max).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let worst = whole.iter().zip(&part).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "max_scores = {max}: differs from the whole by {worst}");
    }
}

/// A layerwise ring over a small random Flux (hidden 64, 4 heads, 2 double
/// blocks and `single` single ones, weights from `seed`) on the CPU device.
fn small_ring(single: usize, seed: u64) -> (FluxShape, Ring<CandleBackend>) {
    let shape = FluxShape { hidden: 64, heads: 4, mlp: 256 };
    let src = RandomFlux::new(shape, 2, single, seed);
    let inv = NameDiscovery.discover("transformer", src.specs()).unwrap();
    let be = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&be, &inv, &src).unwrap());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    (shape, Ring::new(be, store, &rc).unwrap())
}

/// A model that asks a streamed block for a tensor it lacks, or with another
/// shape, gets an error naming the block and the tensor (not a panic, not a bare
/// "cannot find tensor").
#[test]
fn wrong_tensor_or_shape_names_the_block() {
    use offload_candle::flux::{DoubleBlock, SingleBlock};
    use offload_candle::CandleBlockExt;
    let (shape, mut ring) = small_ring(2, 5);
    let g = ring.block("double_blocks", 1).unwrap();
    let missing = SingleBlock::new(shape, g.var_builder(DType::BF16).unwrap()).err().expect("a double block has no single-block tensors");
    let msg = missing.to_string();
    assert!(msg.contains("double_blocks.1") && msg.contains("modulation.lin.weight"), "{msg}");
    let wider = FluxShape { hidden: 128, heads: 4, mlp: 256 };
    let msg = DoubleBlock::new(wider, g.var_builder(DType::BF16).unwrap()).err().expect("shapes differ").to_string();
    assert!(msg.contains("double_blocks.1") && msg.contains("img_mod.lin.weight") && msg.contains("[384, 64]"), "{msg}");
    g.finish().unwrap();
    ring.close().unwrap();
}

/// A module that leaves a tensor of its block unread computes another model
/// than the checkpoint's, and the resident model built the same way agrees with
/// it: `build` names the block and every tensor left, where `var_builder` lets
/// it pass. The whole block built through `build` reads everything.
#[test]
fn a_block_tensor_no_layer_reads_is_an_error_naming_it() {
    use offload_candle::flux::DoubleBlock;
    use offload_candle::CandleBlockExt;
    let (shape, mut ring) = small_ring(1, 7);
    let g = ring.block("double_blocks", 1).unwrap();
    // One Linear of the block read, the rest left: refused, by name.
    let only_mod = |vb: candle_nn::VarBuilder<'static>| vb.pp("img_mod").pp("lin").get((6 * 64, 64), "weight");
    let e = g.build(DType::BF16, only_mod).expect_err("tensors left unread").to_string();
    assert!(e.contains("double_blocks.1") && e.contains("img_attn.qkv.weight") && e.contains("never read"), "{e}");
    assert!(!e.contains("img_mod.lin.weight,") && !e.contains("(img_mod.lin.weight"), "the tensor read is not named: {e}");
    // The unchecked builder lets the same module pass.
    assert!(only_mod(g.var_builder(DType::BF16).unwrap()).is_ok());
    // The whole block reads every tensor.
    g.build(DType::BF16, |vb| DoubleBlock::new(shape, vb)).unwrap();
    g.finish().unwrap();
    ring.close().unwrap();
}

/// No panic on a degenerate shape: 0 tokens or 0 heads give the empty
/// attention result, and a block of 0 heads (or heads not dividing the hidden
/// size) is an error saying so.
#[test]
fn degenerate_shapes_are_errors_or_empty_not_panics() {
    use offload_candle::flux::{attention_chunked, DoubleBlock};
    let dev = Device::Cpu;
    for (h, t) in [(2, 0), (0, 5)] {
        let q = Tensor::zeros((1, h, t, 8), DType::F32, &dev).unwrap();
        let k = Tensor::zeros((1, h, 3, 8), DType::F32, &dev).unwrap();
        let o = attention_chunked(&q, &k, &k, 1 << 20).unwrap();
        assert_eq!(o.dims(), &[1, t, h * 8]);
    }
    let vb = candle_nn::VarBuilder::zeros(DType::F32, &dev);
    for bad in [FluxShape { hidden: 64, heads: 0, mlp: 256 }, FluxShape { hidden: 64, heads: 5, mlp: 256 }] {
        let e = DoubleBlock::new(bad, vb.clone()).err().expect("refused").to_string();
        assert!(e.contains("heads"), "{e}");
        let _ = RandomFlux::new(bad, 1, 1, 1); // the specs of a bad shape: no panic
    }
    // Sizes past usize: refused by name when checked, and the specs neither
    // panic nor wrap to small tensors (their byte counts are refused).
    let huge = FluxShape { hidden: 1 << 62, heads: 1, mlp: 1 };
    let e = DoubleBlock::new(huge, vb.clone()).err().expect("refused").to_string();
    assert!(e.contains("overflow"), "{e}");
    let src = RandomFlux::new(huge, 1, 1, 1);
    assert!(src.specs().iter().any(|s| s.nbytes().is_err()), "a wrapped size would read as a small tensor");
}

/// A block of I16, I32, I64 and F8 (E4M3) tensors streams to candle's CPU
/// device with its bytes: each dtype offload and candle share maps to one of
/// the same size (I16 and I32 were refused before).
#[test]
fn integer_and_fp8_tensors_reach_candle_with_their_bytes() {
    use offload_candle::{candle_dtype, CandleBlockExt};
    use offload_core::{DType as ODType, MemoryTensors, TensorSpec};
    let mut src = MemoryTensors::new();
    let kinds = [(ODType::I16, "a"), (ODType::I32, "b"), (ODType::I64, "c"), (ODType::F8_E4M3, "d")];
    for b in 0..2 {
        for (k, (dt, name)) in kinds.iter().enumerate() {
            let n = 64 * dt.size();
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + k * 11 + b * 3 + 5) as u8).collect();
            src.push(TensorSpec::new(format!("blocks.{b}.{name}"), *dt, vec![64]), bytes).unwrap();
            assert_eq!(candle_dtype(*dt).map(|c| c.size_in_bytes()), Some(dt.size()), "{dt:?}");
        }
    }
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let be = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&be, &inv, &src).unwrap());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    let mut ring = Ring::new(be, store, &rc).unwrap();
    let g = ring.block("blocks", 0).unwrap();
    let (vars, _) = g.block_vars().unwrap();
    let vb = vars.into_var_builder(DType::F32, &Device::Cpu);
    for (dt, name) in kinds {
        let t = vb.get_unchecked_dtype(name, candle_dtype(dt).unwrap()).unwrap();
        let mut got = Vec::new();
        t.write_bytes(&mut got).unwrap();
        assert_eq!(got, src.bytes(&format!("blocks.0.{name}")).unwrap(), "{dt:?}");
    }
    g.finish().unwrap();
    ring.close().unwrap();
}

/// An fp8 weight whose scale its block holds is refused when a module reads it
/// converted to another dtype (the conversion would drop the scale: an unscaled
/// model, quietly); read as fp8 it is served, and a weight without a scale converts.
#[test]
fn an_fp8_weight_with_its_scale_is_not_converted_unscaled() {
    use offload_candle::CandleBlockExt;
    use offload_core::{DType as D, MemoryTensors, TensorSpec};
    let mut src = MemoryTensors::new();
    for b in 0..2 {
        src.push(TensorSpec::new(format!("blocks.{b}.l.weight"), D::F8_E4M3, [2, 2]), vec![0x38; 4]).unwrap();
        src.push(TensorSpec::new(format!("blocks.{b}.l.weight_scale"), D::F32, [1]), 2f32.to_le_bytes().to_vec()).unwrap();
        src.push(TensorSpec::new(format!("blocks.{b}.m.weight"), D::F8_E4M3, [2, 2]), vec![0x38; 4]).unwrap();
    }
    let inv = NameDiscovery.discover("t", src.specs()).unwrap();
    let be = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&be, &inv, &src).unwrap());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    let mut ring = Ring::new(be.clone(), store, &rc).unwrap();
    let g = ring.block("blocks", 0).unwrap();
    let vb = g.var_builder(DType::F32).unwrap();
    let e = vb.get((2, 2), "l.weight").expect_err("converted without its scale").to_string();
    assert!(e.contains("l.weight") && e.contains("l.weight_scale"), "{e}");
    let fp8 = g.var_builder(DType::F8E4M3).unwrap().get((2, 2), "l.weight").unwrap();
    assert_eq!(fp8.dtype(), DType::F8E4M3);
    let plain = vb.get((2, 2), "m.weight").unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(plain, vec![1.0; 4], "0x38 is 1.0 in e4m3");
    drop(g);
    ring.close().unwrap();
}
