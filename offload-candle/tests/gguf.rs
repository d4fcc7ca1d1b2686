//! GGUF files written by candle's own writer (its quantizer making real Q8_0 and
//! K-quant blocks), read by offload's reader, streamed through the ring on the CPU
//! device and computed with candle's `QMatMul` from the slot's stored bytes: the
//! output byte-identical to candle's resident quantized run from the same file.

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use offload_candle::CandleBackend;
use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, Plan, Ring, TensorSource};
use offload_formats::GgufFile;
use std::collections::HashMap;
use std::sync::Arc;

const HIDDEN: usize = 256;
const DEPTH: usize = 4;
/// Each block's second projection in another quant type, so every type streams.
const FC2: [GgmlDType; DEPTH] = [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];

fn path(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("offload-gguf-{tag}-{}.gguf", std::process::id()))
}

/// Fresh random weights quantized by candle and written by candle's GGUF writer.
fn write_model(p: &std::path::Path, extra: Option<(&str, GgmlDType)>) {
    let dev = Device::Cpu;
    let q = |shape: &[usize], dt| QTensor::quantize(&Tensor::randn(0f32, 0.05, shape, &dev).unwrap(), dt).unwrap();
    let mut t: Vec<(String, QTensor)> = vec![("img_in.weight".into(), q(&[HIDDEN, HIDDEN], GgmlDType::F16))];
    // 1056 bytes, padded to 32 by the writer: block 0's next tensor lies off the
    // store's 256-byte grid, so the mapped tier copies block 0 and serves the others in place.
    t.push(("blocks.0.bias".into(), q(&[HIDDEN + 8], GgmlDType::F32)));
    for (i, &fc2) in FC2.iter().enumerate() {
        t.push((format!("blocks.{i}.fc1.weight"), q(&[2 * HIDDEN, HIDDEN], GgmlDType::Q4K)));
        t.push((format!("blocks.{i}.fc2.weight"), q(&[HIDDEN, 2 * HIDDEN], fc2)));
        t.push((format!("blocks.{i}.scale"), q(&[HIDDEN], GgmlDType::F32)));
        t.push((format!("blocks.{i}.shift"), q(&[HIDDEN], GgmlDType::BF16)));
    }
    if let Some((name, dt)) = extra {
        t.push((name.into(), q(&[HIDDEN], dt)));
    }
    let arch = gguf_file::Value::String("offload-test".into());
    let refs: Vec<(&str, &QTensor)> = t.iter().map(|(n, q)| (n.as_str(), q)).collect();
    let mut f = std::fs::File::create(p).unwrap();
    gguf_file::write(&mut f, &[("general.architecture", &arch)], &refs).unwrap();
}

/// One block: x + (fc2(gelu(fc1(x))) * scale + shift), every weight from `w`.
fn block(w: &HashMap<String, Arc<QTensor>>, x: &Tensor) -> Tensor {
    let mm = |n: &str| QMatMul::from_arc(w[n].clone()).unwrap();
    let deq = |n: &str| w[n].dequantize(&Device::Cpu).unwrap();
    let h = mm("fc1.weight").forward(x).unwrap().gelu().unwrap();
    let h = mm("fc2.weight").forward(&h).unwrap();
    let h = h.broadcast_mul(&deq("scale")).unwrap().broadcast_add(&deq("shift").to_dtype(candle_core::DType::F32).unwrap()).unwrap();
    (x + h).unwrap()
}

#[test]
fn candles_gguf_file_reads_the_same_in_offloads_reader() {
    let p = path("read");
    write_model(&p, None);
    let mut f = std::fs::File::open(&p).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let ours = GgufFile::open(&p).unwrap();
    assert_eq!(ours.version(), 2);
    assert_eq!(ours.metadata()["general.architecture"].as_str(), Some("offload-test"));
    assert_eq!(ours.specs().len(), content.tensor_infos.len());
    for (i, spec) in ours.specs().iter().enumerate() {
        let info = &content.tensor_infos[&spec.name];
        assert_eq!(spec.shape, info.shape.dims(), "{}", spec.name);
        assert_eq!(offload_candle::quantized::ggml_dtype(spec.dtype), Some(info.ggml_dtype), "{}", spec.name);
        assert_eq!(ours.data_offset(i), content.tensor_data_offset + info.offset, "{}", spec.name);
        let theirs = content.tensor(&mut f, &spec.name, &Device::Cpu).unwrap();
        let mut got = vec![0; spec.nbytes().unwrap()];
        ours.read_into(i, &mut got).unwrap();
        assert!(got == *theirs.data().unwrap(), "{}: stored bytes differ", spec.name);
    }
    let _ = std::fs::remove_file(&p);
}

/// How a test's host store holds the file's blocks.
#[derive(Clone, Copy, PartialEq)]
enum Tier {
    /// Copied into host memory.
    Copied,
    /// Served from the file in place where they lie on the store's grid.
    Mapped,
    /// Blocks 1-3 left on disk and read from the file for each copy (block 0 lies
    /// off the store's grid: see [`write_model`]).
    Disk,
}

#[test]
fn gguf_blocks_stream_as_stored_bitwise_equal_to_candles_resident_quantized_run() {
    stream_bitwise(Tier::Copied);
}

/// The same from the mapped host tier: a block whose tensors lie on the store's
/// 256-byte grid is served from the file in place; GGUF aligns to 32, so block
/// 0 (its first tensor 1056 bytes long) is copied, and counted so, with the reason.
#[test]
fn gguf_blocks_from_the_mapped_tier_stream_bitwise_equal_and_count_their_copies() {
    let tier = stream_bitwise(Tier::Mapped);
    // Blocks 1-3 and the resident img_in in place; block 0 copied.
    assert_eq!((tier.mapped, tier.copied), (DEPTH, 1), "{tier:?}");
    assert!(tier.copy_reason.as_deref().is_some_and(|r| r.contains("blocks.0.fc1.weight")), "{tier:?}");
}

/// The disk tier on a GGUF file: the blocks planned on disk are read from the
/// file as stored for each copy, bitwise equal to candle's resident run, every
/// step reading them again.
#[test]
fn gguf_blocks_from_the_disk_tier_stream_bitwise_equal() {
    let tier = stream_bitwise(Tier::Disk);
    assert_eq!(tier.on_disk, DEPTH - 1, "{tier:?}");
}

/// A block planned on disk whose tensors do not lie in the file as the store
/// lays them out (block 0: its first tensor 1056 bytes long, the next off the
/// 256-byte grid) is refused by name: held in memory it would take host memory
/// the plan did not count.
#[test]
fn a_gguf_block_that_cannot_be_read_from_disk_as_laid_out_is_named() {
    let p = path("disk-refused");
    write_model(&p, None);
    let file = GgufFile::open(&p).unwrap();
    let inventory = NameDiscovery.discover("transformer", file.specs()).unwrap();
    let e = HostStore::build_tiered(&CandleBackend::cpu(), &inventory, &file, offload_core::PinOptions::default(), &|_| true)
        .err()
        .expect("block 0 cannot be read from the file as laid out")
        .to_string();
    let _ = std::fs::remove_file(&p);
    assert!(e.contains("blocks.0") && e.contains("on disk") && e.contains("GGUF file"), "{e}");
}

fn stream_bitwise(tier: Tier) -> offload_core::HostTier {
    let p = path(match tier {
        Tier::Copied => "stream",
        Tier::Mapped => "mapped",
        Tier::Disk => "disk",
    });
    write_model(&p, None);
    let x = Tensor::randn(0f32, 1.0, (8, HIDDEN), &Device::Cpu).unwrap();

    // Resident: candle's own reader, every block's QTensors held.
    let mut f = std::fs::File::open(&p).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut x_r = x.clone();
    for i in 0..DEPTH {
        let w: HashMap<String, Arc<QTensor>> = ["fc1.weight", "fc2.weight", "scale", "shift"]
            .iter()
            .map(|n| (n.to_string(), Arc::new(content.tensor(&mut f, &format!("blocks.{i}.{n}"), &Device::Cpu).unwrap())))
            .collect();
        x_r = block(&w, &x_r);
    }

    // Streamed: offload's reader, host store and ring; QTensors from each slot.
    let file = GgufFile::open(&p).unwrap();
    let inventory = NameDiscovery.discover("transformer", file.specs()).unwrap();
    let backend = CandleBackend::cpu();
    let pin = offload_core::PinOptions::default();
    let store = Arc::new(match tier {
        Tier::Copied => HostStore::build(&backend, &inventory, &file).unwrap(),
        Tier::Mapped => HostStore::build_mapped(&backend, &inventory, &file, pin).unwrap(),
        Tier::Disk => HostStore::build_tiered(&backend, &inventory, &file, pin, &|id| id.index != 0).unwrap(),
    });
    // A block's bytes are its stored bytes: Q4_K's 144 bytes per 256 weights,
    // Q4_K's again (block 1's fc2), the f32 scale and the bf16 shift.
    let stored: usize = file.specs().iter().filter(|s| s.name.starts_with("blocks.1.")).map(|s| s.nbytes().unwrap()).sum();
    let n = 2 * HIDDEN * HIDDEN;
    assert_eq!(stored, 2 * (n / 256 * 144) + 4 * HIDDEN + 2 * HIDDEN);
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory)).unwrap();
    let mut ring = Ring::new(backend.clone(), store.clone(), &plan.components[0]).unwrap();
    // Two steps: the second reads the blocks on disk again (none stays in host memory).
    let mut x_s = x.clone();
    for step in 0..2 {
        x_s = x.clone();
        let mut on_demand = 0;
        for (i, &fc2) in FC2.iter().enumerate() {
            let g = ring.block("blocks", i).unwrap();
            on_demand += u64::from(g.source() == offload_core::BlockSource::OnDemand);
            let w = backend.qtensors(g.slot(), g.layout(), &format!("blocks.{i}.")).unwrap();
            assert_eq!(w["fc2.weight"].dtype(), fc2);
            x_s = block(&w, &x_s);
            g.finish().unwrap();
        }
        let m = ring.end_step().unwrap();
        // Every miss counted is a block served on demand, and only those. In memory
        // the steady step prefetches every block; on disk a block whose read is not
        // done when its prefetch comes due is fetched on demand instead (the thread
        // that computes never waits for a read ahead of need), so how many are
        // missed there depends on the disk's speed: CI once saw one in step 1.
        assert_eq!(m.blocks, DEPTH as u64, "step {step}: {m}");
        assert_eq!((m.misses, m.prefetch_hits + m.misses), (on_demand, DEPTH as u64), "step {step}: {m}");
        assert!(m.misses == 0 || tier == Tier::Disk, "step {step}: {m}");
        // Each step reads every block on disk from the file once, and only those.
        let on_disk = store.disk_bytes();
        assert_eq!(on_disk > 0, tier == Tier::Disk);
        assert_eq!(m.disk_bytes_read, on_disk, "step {step}: {m}");
    }
    ring.close().unwrap();
    backend.host_device().check().expect("no protocol violation");

    let (r, s) = (x_r.flatten_all().unwrap().to_vec1::<f32>().unwrap(), x_s.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    assert!(r.iter().all(|v| v.is_finite()) && r.iter().any(|v| *v != r[0]), "a finite, non-constant output");
    assert!(r.iter().zip(&s).all(|(a, b)| a.to_bits() == b.to_bits()), "streamed output differs from candle's resident quantized run");
    let _ = std::fs::remove_file(&p);
    store.tier().clone()
}

#[test]
fn a_quant_type_offload_does_not_take_is_named_with_its_tensor() {
    let p = path("q4_0");
    write_model(&p, Some(("blocks.0.odd", GgmlDType::Q4_0)));
    let e = GgufFile::open(&p).unwrap_err().to_string();
    let _ = std::fs::remove_file(&p);
    assert!(e.contains("blocks.0.odd") && e.contains("Q4_0"), "{e}");
}

/// A Flux GGUF file as the Flux GGUF releases name it (BFL's names: fused
/// `qkv`, `linear1`, `final_layer.adaLN_modulation.1`), written by candle's
/// writer with Q8_0 weights, seen through `flux_bfl_to_diffusers`: exactly the
/// parameters of diffusers' `FluxTransformer2DModel` (names and shapes, from
/// `tests/data/flux-diffusers-names.txt`, which a pytest row checks against
/// diffusers itself), each the right rows of its fused tensor as stored, and
/// streamed through the ring as candle `QTensor`s.
#[test]
fn a_bfl_named_flux_gguf_streams_under_diffusers_names() {
    use offload_formats::{flux_bfl_to_diffusers, Renamed};
    let (h, hd, mlp) = (64usize, 32usize, 256usize);
    let dev = Device::Cpu;
    let q = |shape: &[usize]| {
        let t = Tensor::randn(0f32, 0.05, shape, &dev).unwrap();
        // Q8_0 where the innermost dimension is whole blocks of 32; f32 otherwise.
        let dt = if shape.len() == 2 && shape[1] % 32 == 0 { GgmlDType::Q8_0 } else { GgmlDType::F32 };
        QTensor::quantize(&t, dt).unwrap()
    };
    let sizes = offload_formats::FluxSizes {
        hidden: h,
        head_dim: hd,
        mlp,
        double: 1,
        single: 1,
        pooled: 32,
        text: 32,
        in_channels: 8,
        out_channels: 8,
    };
    let t: Vec<(String, QTensor)> = offload_formats::flux_bfl_tensors(sizes).into_iter().map(|(n, shape)| (n, q(&shape))).collect();
    let p = path("bfl");
    let refs: Vec<(&str, &QTensor)> = t.iter().map(|(n, q)| (n.as_str(), q)).collect();
    gguf_file::write(&mut std::fs::File::create(&p).unwrap(), &[], &refs).unwrap();

    let file = GgufFile::open(&p).unwrap();
    let src = |name: &str| t.iter().find(|(n, _)| n == name).unwrap().1.data().unwrap().to_vec();
    let renamed = Renamed::new(GgufFile::open(&p).unwrap(), flux_bfl_to_diffusers(file.specs()).unwrap()).unwrap();
    let mut got: Vec<String> = renamed
        .specs()
        .iter()
        .map(|s| format!("{} {}", s.name, s.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")))
        .collect();
    let mut want: Vec<String> = include_str!("../../tests/data/flux-diffusers-names.txt").lines().map(str::to_owned).collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "the renamed file is not diffusers' Flux");
    // The rows of the fused tensors, as stored.
    let read = |name: &str| {
        let i = renamed.specs().iter().position(|s| s.name == name).unwrap();
        let mut b = vec![0; renamed.specs()[i].nbytes().unwrap()];
        renamed.read_into(i, &mut b).unwrap();
        b
    };
    let qkv = src("double_blocks.0.img_attn.qkv.weight");
    let third = qkv.len() / 3;
    assert!(read("transformer_blocks.0.attn.to_k.weight") == qkv[third..2 * third]);
    let l1 = src("single_blocks.0.linear1.bias");
    assert!(read("single_transformer_blocks.0.proj_mlp.bias") == l1[3 * h * 4..]);
    let m = src("final_layer.adaLN_modulation.1.weight");
    assert!(read("norm_out.linear.weight") == [&m[m.len() / 2..], &m[..m.len() / 2]].concat(), "scale and shift swapped");

    // Streamed under diffusers' names: each block's q projection dequantises to the fused tensor's first rows.
    let inventory = offload_core::DeclaredStacks::new(["transformer_blocks", "single_transformer_blocks"])
        .discover("transformer", renamed.specs())
        .unwrap();
    let backend = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&backend, &inventory, &renamed).unwrap());
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory)).unwrap();
    let mut ring = Ring::new(backend.clone(), store, &plan.components[0]).unwrap();
    for (stack, fused) in
        [("transformer_blocks", "double_blocks.0.img_attn.qkv.weight"), ("single_transformer_blocks", "single_blocks.0.linear1.weight")]
    {
        let g = ring.block(stack, 0).unwrap();
        let w = backend.qtensors(g.slot(), g.layout(), &format!("{stack}.0.")).unwrap();
        let ours = w["attn.to_q.weight"].dequantize(&dev).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let full = t.iter().find(|(n, _)| n == fused).unwrap().1.dequantize(&dev).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(
            ours.iter().zip(&full[..h * h]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{stack}: to_q is not the fused tensor's first rows"
        );
        g.finish().unwrap();
    }
    ring.close().unwrap();
    let _ = std::fs::remove_file(&p);
}

/// A Qwen-Image GGUF file as its releases hold it (diffusers' names behind a
/// `model.diffusion_model.` prefix, `general.architecture = "qwen_image"`),
/// written by candle's writer: the file's architecture picks the map, the
/// tensors arrive under `tests/data/qwen-image-diffusers-names.txt`'s names and
/// shapes (its block twice), and a block streams through the ring with its
/// quantized bytes as stored.
#[test]
fn a_qwen_image_gguf_streams_under_diffusers_names_by_its_architecture() {
    use offload_formats::gguf_under_diffusers_names;
    let dev = Device::Cpu;
    let fixture = include_str!("../../tests/data/qwen-image-diffusers-names.txt");
    // The fixture's one block and a second like it: a ring streams two or more.
    let lines: Vec<String> = fixture
        .lines()
        .map(str::to_owned)
        .chain(fixture.lines().filter_map(|l| l.strip_prefix("transformer_blocks.0.")).map(|l| format!("transformer_blocks.1.{l}")))
        .collect();
    let mut t: Vec<(String, QTensor)> = Vec::new();
    for line in &lines {
        let (name, shape) = line.split_once(' ').unwrap();
        let shape: Vec<usize> = shape.split('x').map(|d| d.parse().unwrap()).collect();
        let w = Tensor::randn(0f32, 0.05, shape.as_slice(), &dev).unwrap();
        let dt = if shape.len() == 2 && shape[1] % 32 == 0 { GgmlDType::Q8_0 } else { GgmlDType::F32 };
        t.push((format!("model.diffusion_model.{name}"), QTensor::quantize(&w, dt).unwrap()));
    }
    let p = path("qwen-image");
    let arch = gguf_file::Value::String("qwen_image".into());
    let refs: Vec<(&str, &QTensor)> = t.iter().map(|(n, q)| (n.as_str(), q)).collect();
    gguf_file::write(&mut std::fs::File::create(&p).unwrap(), &[("general.architecture", &arch)], &refs).unwrap();

    let file = GgufFile::open(&p).unwrap();
    assert_eq!(file.architecture(), Some("qwen_image"));
    let renamed = gguf_under_diffusers_names(file).unwrap();
    let got: Vec<String> = renamed
        .specs()
        .iter()
        .map(|s| format!("{} {}", s.name, s.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")))
        .collect();
    assert_eq!(got, lines, "the renamed file is not diffusers' Qwen-Image");

    let inventory = offload_core::DeclaredStacks::new(["transformer_blocks"]).discover("transformer", renamed.specs()).unwrap();
    let backend = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&backend, &inventory, &renamed).unwrap());
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory)).unwrap();
    let mut ring = Ring::new(backend.clone(), store, &plan.components[0]).unwrap();
    let g = ring.block("transformer_blocks", 0).unwrap();
    let w = backend.qtensors(g.slot(), g.layout(), "transformer_blocks.0.").unwrap();
    let stored = &t.iter().find(|(n, _)| n == "model.diffusion_model.transformer_blocks.0.attn.to_q.weight").unwrap().1;
    assert_eq!(w["attn.to_q.weight"].dtype(), GgmlDType::Q8_0);
    assert!(w["attn.to_q.weight"].data().unwrap() == stored.data().unwrap(), "to_q's quantized bytes as stored");
    g.finish().unwrap();
    ring.close().unwrap();
    let _ = std::fs::remove_file(&p);
}

/// The mapped and the disk tier under diffusers' names: a BFL-named Flux GGUF
/// whose tensors are each a whole number of 256 bytes (f32, as candle's writer
/// lays them one after another), seen through `flux_bfl_to_diffusers`. Every
/// block's tensors, `to_q`/`to_k`/`to_v` among them (runs of rows of a fused
/// `qkv`), lie in the file as the store lays them out, so each block is served
/// in place or read from disk as one range, its bytes those the renaming reads;
/// `norm_out.linear` (scale and shift swapped: two parts) is not one range, so
/// the tensors outside the blocks are copied, with the reason naming it.
#[test]
fn a_bfl_named_flux_gguf_serves_its_blocks_in_place_and_from_disk_under_diffusers_names() {
    use offload_core::{DeclaredStacks, PinOptions};
    use offload_formats::{flux_bfl_to_diffusers, Renamed};
    let dev = Device::Cpu;
    let sizes = offload_formats::FluxSizes {
        hidden: 64,
        head_dim: 64,
        mlp: 128,
        double: 2,
        single: 2,
        pooled: 64,
        text: 64,
        in_channels: 64,
        out_channels: 64,
    };
    let mut t: Vec<(String, QTensor)> = offload_formats::flux_bfl_tensors(sizes)
        .into_iter()
        .map(|(n, shape)| (n, QTensor::quantize(&Tensor::randn(0f32, 0.05, shape.as_slice(), &dev).unwrap(), GgmlDType::F32).unwrap()))
        .collect();
    // In name order, as a BFL safetensors file holds them and the GGUF
    // conversions write them: each block's tensors one run of the file.
    t.sort_by(|a, b| a.0.cmp(&b.0));
    let p = path("bfl-tiers");
    let refs: Vec<(&str, &QTensor)> = t.iter().map(|(n, q)| (n.as_str(), q)).collect();
    gguf_file::write(&mut std::fs::File::create(&p).unwrap(), &[], &refs).unwrap();
    let file = GgufFile::open(&p).unwrap();
    let map = flux_bfl_to_diffusers(file.specs()).unwrap();
    let renamed = Renamed::new(file, map).unwrap();
    let inventory =
        DeclaredStacks::new(["transformer_blocks", "single_transformer_blocks"]).discover("transformer", renamed.specs()).unwrap();
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory)).unwrap();
    let blocks = inventory.blocks().count();
    assert_eq!(blocks, 4);
    for on_disk in [false, true] {
        let backend = CandleBackend::cpu();
        let store = Arc::new(match on_disk {
            false => HostStore::build_mapped(&backend, &inventory, &renamed, PinOptions::default()).unwrap(),
            true => HostStore::build_tiered(&backend, &inventory, &renamed, PinOptions::default(), &|_| true).unwrap(),
        });
        let tier = store.tier().clone();
        match on_disk {
            false => assert_eq!((tier.mapped, tier.copied), (blocks, 1), "{tier:?}"),
            true => assert_eq!(tier.on_disk, blocks, "{tier:?}"),
        }
        if !on_disk {
            assert!(tier.copy_reason.as_deref().is_some_and(|r| r.contains("norm_out.linear.weight")), "{tier:?}");
        }
        let mut ring = Ring::new(backend.clone(), store.clone(), &plan.components[0]).unwrap();
        let (mut checked, mut on_demand) = (0, 0);
        for b in inventory.blocks() {
            let g = ring.block(&b.id.stack, b.id.index).unwrap();
            on_demand += u64::from(g.source() == offload_core::BlockSource::OnDemand);
            let prefix = format!("{}.", b.id);
            let w = backend.qtensors(g.slot(), g.layout(), &prefix).unwrap();
            for spec in &b.tensors {
                let i = renamed.specs().iter().position(|s| s.name == spec.name).unwrap();
                let mut want = vec![0; spec.nbytes().unwrap()];
                renamed.read_into(i, &mut want).unwrap();
                let got = w[spec.name.strip_prefix(&prefix).unwrap()].data().unwrap();
                assert!(*got == want, "{}: streamed bytes differ ({})", spec.name, if on_disk { "disk" } else { "mapped" });
                checked += 1;
            }
            g.finish().unwrap();
        }
        assert!(checked > 4 * blocks, "{checked} tensors checked");
        let m = ring.end_step().unwrap();
        // Misses are the blocks served on demand; in memory there are none. On disk
        // their number depends on how fast the reads come back (see `stream_bitwise`).
        assert_eq!((m.misses, m.prefetch_hits + m.misses), (on_demand, blocks as u64), "{m}");
        assert!(m.misses == 0 || on_disk, "{m}");
        assert!(!on_disk || m.disk_bytes_read >= store.disk_bytes(), "{m}");
        ring.close().unwrap();
        backend.host_device().check().expect("no protocol violation");
    }
    let _ = std::fs::remove_file(&p);
}
