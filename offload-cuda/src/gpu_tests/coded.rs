//! `coded` on a device, through the whole backend.
use crate::coded::*;
use crate::device::CudaBackend;
use offload_core::{resolve, BlockDiscovery, DType, HostStore, MemoryTensors, NameDiscovery, OffloadBackend, Plan, Ring, TensorSpec};
use offload_core::{HostBuffer, HostMemory};
use std::sync::Arc;

/// On a GPU: a ring over a store built with coding on puts every block's exact
/// bytes in its slot (read back after the block's copy event, four steps at
/// depth 2, with 2, 1, 4 and 3 staging buffers), moves fewer bytes than the blocks hold, and reports no damage.
/// Blocks mix coded bf16 matrices, a raw (incompressible) tensor and an odd
/// tail, in 80 KiB strings (≈ 38 a block: two decoder launches, SEGS = 32
/// strings and the rest; one launch block a string). Without a device it prints
/// SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
#[test]
fn coded_ring_streams_exact_bytes() {
    coded_ring_exact(80 << 10, 1_500_000);
}

/// The same with 512 KiB strings (256 chunks: two launch blocks each) in
/// ≈ 19 MB blocks (≈ 37 strings: two launches).
#[test]
fn coded_ring_streams_exact_bytes_in_multi_block_strings() {
    coded_ring_exact(512 << 10, 9_500_000);
}

/// On a GPU: fp8 e4m3 weights (normals cast under a per-row scale) beside bf16
/// ones and a raw tensor, coded with fp8's own code (`CodingOptions::fp8_code`):
/// block 0 decoded by launches in both codes (a code change starts one), every
/// block's exact bytes in its slot over four steps, and fewer bytes held than
/// with bf16's code alone. With the option off
/// the same store is coded without fp8's code. Without a device it prints
/// SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
#[test]
fn coded_ring_streams_exact_fp8_bytes() {
    let Some(b) = super::test_backend() else { return };
    let options = CodingOptions { threads: 4, segment_bytes: 256 << 10, fp8_code: true, ..Default::default() };
    b.enable_coding(options).unwrap();
    let mut t = MemoryTensors::new();
    let mut x = 5u64;
    for i in 0..4u64 {
        let v = crate::codec::sample_normal_bf16(2_000_000 + 1000 * i as usize, 0.02, 30 + i);
        let f: Vec<f32> = v.chunks_exact(2).map(|p| f32::from_bits(u32::from(u16::from_le_bytes([p[0], p[1]])) << 16)).collect();
        let w: Vec<u8> = f
            .chunks(3072)
            .flat_map(|row| {
                let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
                row.iter().map(move |v| offload_formats::fp8::f32_to_fp8(v / scale, DType::F8_E4M3).unwrap())
            })
            .collect();
        t.push(TensorSpec::new(format!("blocks.{i}.w"), DType::F8_E4M3, [w.len()]), w).unwrap();
        let m = crate::codec::sample_normal_bf16(400_000, 0.02, 40 + i);
        t.push(TensorSpec::new(format!("blocks.{i}.modulation"), DType::BF16, [m.len() / 2]), m).unwrap();
        let noise = super::noise(100_003, &mut x);
        t.push(TensorSpec::new(format!("blocks.{i}.noise"), DType::U8, [noise.len()]), noise).unwrap();
    }
    let inv = NameDiscovery.discover("model", offload_core::TensorSource::specs(&t)).unwrap();
    let store = Arc::new(HostStore::build(&b, &inv, &t).unwrap());
    let raw: Vec<Vec<u8>> = store.blocks().iter().map(|blk| blk.buffer().unwrap().block_bytes().unwrap().to_vec()).collect();
    let codes: Vec<u32> = store.blocks()[0]
        .buffer()
        .unwrap()
        .coded()
        .map_or(Vec::new(), |c| crate::codec::launches(&c.segments))
        .iter()
        .map(|(l, _)| l.code)
        .collect();
    assert!(codes.contains(&2) && codes.contains(&1), "block 0's launches in both codes: {codes:?}");
    let held: usize = store.blocks().iter().map(|blk| blk.buffer().unwrap().len()).sum();
    let plan = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&inv)).unwrap();
    let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
    for step in 0..4 {
        one_step_exact(&b, &mut ring, &raw, step);
    }
    ring.close().unwrap();
    b.poll_error().unwrap();
    // bf16's code alone, on another backend: more bytes held.
    let b2 = CudaBackend::new(0).unwrap();
    b2.enable_coding(CodingOptions { fp8_code: false, ..options }).unwrap();
    let s2 = HostStore::build(&b2, &inv, &t).unwrap();
    let held2: usize = s2.blocks().iter().map(|blk| blk.buffer().unwrap().len()).sum();
    assert!(held < held2, "fp8's code: {held} bytes held, bf16's alone {held2}");
}

/// On a GPU: the staging buffers the decode engine holds are what the backend
/// says it holds ([`HostMemory::decoder_staging_bytes`]), and a coded ring whose
/// budget holds the weights but not them is refused (naming them), while at
/// weights + staging it streams every block's exact bytes with the engine's
/// staging peak within the count. Without a device it prints SKIPPED (and fails
/// under `OFFLOAD_REQUIRE_DEVICE=1`).
#[test]
fn a_coded_ring_counts_the_staging_buffers_in_its_budget() {
    let Some(b) = super::test_backend() else { return };
    b.enable_coding(CodingOptions { threads: 4, segment_bytes: 256 << 10, ..Default::default() }).unwrap();
    let mut t = MemoryTensors::new();
    for i in 0..4u64 {
        let w = crate::codec::sample_normal_bf16(1_500_000 + 300_000 * i as usize, 0.02, 60 + i);
        t.push(TensorSpec::new(format!("blocks.{i}.w"), DType::BF16, [w.len() / 2]), w).unwrap();
    }
    let inv = NameDiscovery.discover("model", offload_core::TensorSource::specs(&t)).unwrap();
    let store = Arc::new(HostStore::build(&b, &inv, &t).unwrap());
    let largest = store.blocks().iter().filter_map(|blk| blk.buffer().unwrap().held_bytes()).max().expect("blocks coded");
    let staging = b.decoder_staging_bytes(largest);
    assert_eq!(staging, STAGING_BUFFERS as u64 * offload_core::codec::staging_buffer_bytes(largest as u64));
    let raw: Vec<Vec<u8>> = store.blocks().iter().map(|blk| blk.buffer().unwrap().block_bytes().unwrap().to_vec()).collect();
    let resolved = |budget: Option<u64>| {
        let mut plan = Plan::layerwise();
        plan.default.device_budget_bytes = budget;
        resolve(&plan, std::slice::from_ref(&inv)).unwrap().components.remove(0)
    };
    let bound = resolved(None).device_weight_bound;
    let e = Ring::new(b.clone(), store.clone(), &resolved(Some(bound + staging - 1))).err().expect("over budget by the staging");
    assert!(e.to_string().contains("staging buffers"), "{e}");
    let mut ring = Ring::new(b.clone(), store.clone(), &resolved(Some(bound + staging))).unwrap();
    for step in 0..2 {
        one_step_exact(&b, &mut ring, &raw, step);
    }
    ring.close().unwrap();
    b.poll_error().unwrap();
    let peak = b.counters().staging_peak_bytes;
    assert!(peak > 0 && peak <= staging, "staging peak {peak} bytes, counted {staging}");
}

/// One step of `ring` in order, each block's slot read back after its copy
/// event and compared with `raw`'s bytes for it.
fn one_step_exact(b: &CudaBackend, ring: &mut Ring<CudaBackend>, raw: &[Vec<u8>], step: usize) {
    for (i, want) in raw.iter().enumerate() {
        let g = ring.block_at(i).unwrap();
        let got = super::read_back(b, g.slot(), want.len());
        assert!(got == *want, "step {step}, block {i}: the slot's bytes differ from the block's");
        g.finish().unwrap();
    }
    ring.end_step().unwrap();
}

fn coded_ring_exact(segment_bytes: usize, values: usize) {
    let Some(b) = super::test_backend() else { return };
    b.enable_coding(CodingOptions { threads: 4, segment_bytes, ..Default::default() }).unwrap();
    let mut t = MemoryTensors::new();
    let mut x = 3u64;
    for i in 0..6u64 {
        let w = crate::codec::sample_normal_bf16(values + 1000 * i as usize, 0.02, 10 + i);
        t.push(TensorSpec::new(format!("blocks.{i}.w"), DType::BF16, [w.len() / 2]), w).unwrap();
        let noise = super::noise(100_003, &mut x);
        t.push(TensorSpec::new(format!("blocks.{i}.noise"), DType::U8, [noise.len()]), noise).unwrap();
    }
    let inv = NameDiscovery.discover("model", offload_core::TensorSource::specs(&t)).unwrap();
    let store = Arc::new(HostStore::build(&b, &inv, &t).unwrap());
    assert!(store.blocks().iter().all(|blk| blk.buffer().unwrap().is_coded()), "every block coded");
    let raw: Vec<Vec<u8>> = store.blocks().iter().map(|blk| blk.buffer().unwrap().block_bytes().unwrap().to_vec()).collect();
    let held: usize = store.blocks().iter().map(|blk| blk.buffer().unwrap().len()).sum();
    let plan = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&inv)).unwrap();
    let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
    let before = b.counters();
    // Steps with 2 (the default), 1, 4 (grown) and 3 (shrunk) staging buffers.
    assert!(b.set_staging_buffers(0).is_err(), "zero staging buffers refused");
    for (step, staging) in [2, 1, 4, 3].into_iter().enumerate() {
        b.set_staging_buffers(staging).unwrap();
        one_step_exact(&b, &mut ring, &raw, step);
    }
    ring.close().unwrap();
    b.poll_error().unwrap();
    let c = b.counters();
    let raw_total: usize = raw.iter().map(Vec::len).sum();
    assert!(c.coded_copies > before.coded_copies, "coded copies counted");
    // Each string carries its 8 KiB table: ≈ 0.79 of raw at 80 KiB, under 0.9.
    assert!(held < raw_total * 9 / 10, "coded {held} of {raw_total} bytes");
    let launches = store.blocks()[0].buffer().unwrap().coded().map_or(Vec::new(), |c| crate::codec::launches(&c.segments));
    assert!(launches.len() > 1, "{} launch(es) for block 0: one would decode it all", launches.len());
    if segment_bytes > 256 << 10 {
        let widest = launches.iter().flat_map(|(l, _)| l.s[..l.count as usize].iter().map(|g| g.chunks)).max().unwrap_or(0);
        assert!(widest > crate::codec::BLOCK_THREADS, "every string in one launch block ({widest} chunks at most)");
    }
    assert!(c.staging_peak_bytes > 0, "staging counted");
    // A plan's `coded` on a backend with coding off codes that store alone.
    let b2 = CudaBackend::new(0).unwrap();
    let pin = offload_core::PinOptions { coded: true, ..Default::default() };
    let s2 = HostStore::build_with(&b2, &inv, &t, pin).unwrap();
    assert_eq!(s2.coded_blocks(), s2.blocks().len(), "every block coded through alloc_host_coded");
    assert!(!b2.is_coding(), "other stores stay as they are");
    for (blk, want) in s2.blocks().iter().zip(&raw) {
        assert!(blk.buffer().unwrap().block_bytes().unwrap() == want.as_slice());
    }
}

/// On a GPU: a store read from a coded file made ahead of time
/// (`HostStore::build_from_coded_file`, coding off on the backend) holds
/// every block coded, and a ring over it puts each block's exact bytes in its
/// slot; a coded file damaged in an incompressible tensor's raw string (which
/// the device copies without a check) is refused at build by name. Without a
/// device it prints SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
#[test]
fn a_coded_file_streams_exact_bytes() {
    let Some(b) = super::test_backend() else { return };
    let mut t = MemoryTensors::new();
    let mut x = 5u64;
    for i in 0..4u64 {
        let w = crate::codec::sample_normal_bf16(700_000 + 999 * i as usize, 0.02, 30 + i);
        t.push(TensorSpec::new(format!("blocks.{i}.w"), DType::BF16, [w.len() / 2]), w).unwrap();
        let noise = super::noise(600_001, &mut x);
        t.push(TensorSpec::new(format!("blocks.{i}.noise"), DType::U8, [noise.len()]), noise).unwrap();
    }
    let inv = NameDiscovery.discover("model", offload_core::TensorSource::specs(&t)).unwrap();
    let dir = std::env::temp_dir().join(format!("offload-cuda-coded-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = offload_core::CodedFile::path_for(dir.join("model.safetensors"));
    offload_core::CodedFile::write(&path, &inv, &t, 256 << 10, 4).unwrap();
    let cf = offload_core::CodedFile::open(&path).unwrap();
    let plain = HostStore::build(&b, &inv, &t).unwrap();
    let raw: Vec<Vec<u8>> = plain.blocks().iter().map(|blk| blk.buffer().unwrap().block_bytes().unwrap().to_vec()).collect();
    let store = Arc::new(HostStore::build_from_coded_file(&b, &inv, &t, offload_core::PinOptions::default(), &cf).unwrap());
    // The model's tensors all lie in blocks: no non-block buffer.
    assert!(store.non_block().is_none());
    assert_eq!(store.coded_blocks(), store.blocks().len(), "every buffer coded from the file");
    assert!(!b.is_coding(), "the backend's own coding stays off");
    let plan = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&inv)).unwrap();
    // Counted from before the ring's first copies: a block still in a slot
    // from the step before is not copied again, so two steps copy each block
    // at least once, not twice (the H200 at 3b6a55d: fewer than 8).
    let before = b.counters();
    let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
    for step in 0..2 {
        one_step_exact(&b, &mut ring, &raw, step);
    }
    ring.close().unwrap();
    b.poll_error().unwrap();
    let copies = b.counters().coded_copies - before.coded_copies;
    assert!(copies >= 4, "each block's copy decoded on the device: {copies} coded copies for 4 blocks");
    // One byte of block 2's noise (a raw string) changed in the file.
    let entry = cf.entry("blocks.2").unwrap().clone();
    let (_, segs) =
        offload_core::codec::device_segments(&std::fs::read(&path).unwrap()[entry.at as usize..(entry.at + entry.len) as usize], "b")
            .unwrap();
    let raw_seg = segs.iter().find(|s| s.coded.is_none()).expect("the noise stays raw");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[entry.at as usize + raw_seg.enc_at + 24 + 100] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let cf = offload_core::CodedFile::open(&path).unwrap();
    let e = HostStore::build_from_coded_file(&b, &inv, &t, offload_core::PinOptions::default(), &cf).err().expect("refused").to_string();
    assert!(e.contains("model/blocks.2") && e.contains("damaged"), "{e}");
    // Forged: two equal-length exponent codes of block 1 swapped and the
    // file's own hashes written for the forged bytes. The device's decoder
    // checks no hash; the load decodes every block and compares it.
    let swapped = std::sync::atomic::AtomicBool::new(false);
    offload_core::CodedFile::write_with(&path, &inv, &t, 256 << 10, 4, offload_core::coded_file::PIECE_BYTES, 2, &|block, coded| {
        if block == "blocks.1" {
            swapped.store(offload_core::codec::swap_equal_length_codes(coded), std::sync::atomic::Ordering::Relaxed);
        }
    })
    .unwrap();
    assert!(swapped.load(std::sync::atomic::Ordering::Relaxed));
    let cf = offload_core::CodedFile::open(&path).unwrap();
    let e = HostStore::build_from_coded_file(&b, &inv, &t, offload_core::PinOptions::default(), &cf).err().expect("refused").to_string();
    assert!(e.contains("model/blocks.1") && e.contains("damaged or altered"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// On a GPU: a coded block with two equal-length exponent codes swapped (its
/// structure intact, so the backend takes it and the decoder flags nothing)
/// decodes to wrong bytes silently without the checking mode; with it, the
/// decoded bytes are hashed on the device against what the strings store of
/// the weights, and the next poll names the block. Without a device it
/// prints SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
#[test]
fn the_checking_mode_refuses_decoded_bytes_that_do_not_hash_to_their_weights() {
    if super::test_backend().is_none() {
        return;
    }
    let raw = crate::codec::sample_normal_bf16(300_000, 0.02, 77);
    let mut coded = offload_core::codec::code_for_device(&raw, 256 << 10, 4);
    assert!(offload_core::codec::swap_equal_length_codes(&mut coded), "two equal-length codes swapped");
    for checking in [false, true] {
        let b = super::test_backend().expect("a device (found above)");
        if checking {
            b.enable_checking(0).unwrap();
        }
        let host = b
            .host()
            .alloc(offload_core::HostKind::Precoded { coded_len: coded.len() }, raw.len(), "forged/blocks.0", &mut |d| {
                d.copy_from_slice(&coded);
                Ok(())
            })
            .unwrap();
        let mut slot = b.alloc_slot(raw.len(), "forged/blocks.0").unwrap();
        let ev = b.copy_to_slot(&host, &mut slot, raw.len(), None).unwrap();
        b.compute_wait(&ev).unwrap();
        b.synchronize().unwrap();
        let got = super::read_back(&b, &slot, raw.len());
        assert!(got != raw, "the forged block decodes to other bytes");
        match (b.poll_error(), checking) {
            (Ok(()), false) => {}
            (Err(e), true) => {
                let e = e.to_string();
                assert!(e.contains("forged/blocks.0") && e.contains("checking mode"), "{e}");
            }
            (r, _) => panic!("checking mode {checking}: {r:?}"),
        }
        b.free_slot(slot, None).unwrap();
    }
}
