//! The exponent codec's tests: round trips on fresh random weights, damaged
//! and foreign input refused, the device layout.

use super::*;

fn bf16s(vals: &[f32]) -> Vec<u8> {
    vals.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
}

#[test]
fn every_single_byte_change_changes_the_hash() {
    let base: Vec<u8> = (0..77u8).map(|i| i.wrapping_mul(31)).collect();
    let h = hash64(&base);
    for i in 0..base.len() {
        for flip in [1u8, 0x80, 0xff] {
            let mut b = base.clone();
            b[i] ^= flip;
            assert_ne!(hash64(&b), h, "byte {i} ^ {flip:#x}");
        }
    }
    // Lengths count too: a trailing zero is not the same string.
    assert_ne!(hash64(&base), hash64(&[base.as_slice(), &[0]].concat()));
}

#[test]
fn split_and_join_are_inverse() {
    for v in [0u16, 1, 0x7f80, 0xff80, 0x7fc1, 0x8001, 0x3f80, 0xc2f7] {
        let [lo, hi] = v.to_le_bytes();
        let (e, m) = (exponent(lo, hi), sign_mantissa(lo, hi));
        assert_eq!([(e << 7) | (m & 0x7f), (m & 0x80) | (e >> 1)], [lo, hi], "{v:#06x}");
    }
}

#[test]
fn normal_weights_shrink_below_seventy_percent() {
    // Normal weights at a linear layer's scale (σ = 0.02).
    let mut s = 1u64;
    let vals: Vec<f32> = (0..200_000)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u1 = ((s >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u2 = (s >> 11) as f64 / (1u64 << 53) as f64;
            (0.02 * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect();
    let raw = bf16s(&vals);
    let enc = encode_bf16(&raw);
    let ratio = enc.len() as f64 / raw.len() as f64;
    let h = exponent_entropy_bits(&raw);
    assert!(ratio <= 0.70, "ratio {ratio:.4}, exponent entropy {h:.3} bits");
    assert!((2.0..3.5).contains(&h), "entropy {h}");
    assert_eq!(decode_bf16(&enc, "t").unwrap(), raw);
}

#[test]
fn code_lengths_respect_the_limit_on_skewed_counts() {
    let mut f = [0u64; 256];
    for (i, c) in f.iter_mut().enumerate() {
        *c = 1u64 << (i % 40);
    }
    let lens = code_lengths(&f, MAX_CODE_BITS);
    assert!(lens.iter().all(|&l| l > 0 && u32::from(l) <= MAX_CODE_BITS));
    let kraft: f64 = lens.iter().map(|&l| 0.5f64.powi(i32::from(l))).sum();
    assert!(kraft <= 1.0 + 1e-12, "{kraft}");
}

#[test]
fn damage_is_an_error_naming_the_tensor() {
    let raw = bf16s(&(0..5000).map(|i| (i as f32 * 0.37).sin() * 0.05).collect::<Vec<_>>());
    let enc = encode_bf16(&raw);
    assert_eq!(enc[4], 1, "coded");
    let mut caught = 0;
    for at in (0..enc.len()).step_by(37) {
        let mut bad = enc.clone();
        bad[at] ^= 0x5a;
        match decode_bf16(&bad, "blocks.3.attn.to_q.weight") {
            Ok(v) => assert_eq!(v, raw, "a flip at {at} decoded to other weights"),
            Err(e) => {
                assert!(e.to_string().contains("blocks.3.attn.to_q.weight"), "{e}");
                caught += 1;
            }
        }
    }
    assert!(caught > 0);
    assert!(decode_bf16(&enc[..enc.len() - 1], "t").is_err());
    assert!(decode_bf16(b"nope", "t").is_err());
}

/// Normal bf16 values (Box–Muller over an LCG) of standard deviation `sd`.
fn normal_bf16(n: usize, sd: f32, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut u = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let v: Vec<f32> = (0..n).map(|_| ((-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos()) as f32 * sd).collect();
    bf16s(&v)
}

#[test]
fn device_blocks_round_trip_on_any_thread_count_and_segment_size() {
    // Normal weights, then incompressible bytes, then an odd tail: coded
    // segments, raw segments and a last segment of odd length.
    let mut raw = normal_bf16(300_000, 0.02, 11);
    let mut x = 7u64;
    raw.extend((0..40_001).map(|_| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        (x >> 33) as u8
    }));
    for seg in [4, 1000, 65_536, 1 << 20, usize::MAX / 2] {
        let one = code_for_device(&raw, seg, 1);
        assert_eq!(one, code_for_device(&raw, seg, 4), "segment {seg}: the threads change nothing");
        let (len, segs) = device_segments(&one, "b").unwrap();
        assert_eq!(len, raw.len());
        assert!(segs.iter().all(|s| s.out_at % 4 == 0 && s.enc_at % 256 == 0 && s.enc_len % 4 == 0));
        if seg == 65_536 {
            assert!(segs.iter().any(|s| s.coded.is_some()) && segs.iter().any(|s| s.coded.is_none()), "both kinds");
        }
        if seg <= 1000 {
            // A coded string would carry an 8 KiB table: every segment stays raw.
            assert!(segs.iter().all(|s| s.coded.is_none()), "segment {seg}: raw where the table outweighs the saving");
        }
        for threads in [1, 4] {
            let mut out = vec![0u8; raw.len()];
            decode_device_block_on(&one, &mut out, threads, "b").unwrap();
            assert!(out == raw, "segment {seg}, {threads} threads: decoded bytes differ");
        }
    }
    // Normal weights alone shrink as the per-tensor strings do.
    let w = normal_bf16(1 << 20, 0.02, 5);
    let r = code_for_device(&w, 1 << 20, 2).len() as f64 / w.len() as f64;
    assert!(r < 0.70, "ratio {r}");
    assert!(device_segments(&[], "b").is_err());
    let mut empty = vec![0u8; 0];
    decode_device_block(&code_for_device(&[], 64, 2), &mut empty, "b").unwrap();
}

#[test]
fn a_damaged_device_block_is_an_error_naming_the_block() {
    let raw = normal_bf16(200_000, 0.05, 3);
    let coded = code_for_device(&raw, 100_000, 2);
    let (_, segs) = device_segments(&coded, "blocks.7").unwrap();
    let (table_at, _) = segs[1].coded.clone().unwrap();
    let mut out = vec![0u8; raw.len()];
    // A stored table entry, a descriptor, the magic, a stream byte, a truncation.
    for (name, at) in [("table", table_at + 2 * 100 + 1), ("descriptor", 16 + 32 + 8), ("magic", 0), ("stream", segs[2].enc_at + 400)] {
        let mut bad = coded.clone();
        bad[at] ^= 0x21;
        for threads in [1, 3] {
            let e = decode_device_block_on(&bad, &mut out, threads, "blocks.7").unwrap_err().to_string();
            assert!(e.contains("blocks.7"), "{name}, {threads} threads: {e}");
        }
    }
    assert!(device_segments(&coded[..coded.len() - 300], "blocks.7").is_err());
    assert!(decode_device_block(&coded, &mut out[1..], "blocks.7").is_err());
}

#[test]
fn coded_bytes_match_the_bytes_they_were_made_from_and_no_others() {
    let raw = normal_bf16(300_001, 0.03, 8);
    for threads in [1, 3] {
        let coded = code_for_device(&raw, 65_536, 2);
        coded_matches(&coded, &raw, threads, "blocks.2").unwrap();
        // One value changed in the third segment, or in the last: named, with the segment.
        let last = raw.len().div_ceil(65_536) - 1;
        for (seg, at) in [(2, 2 * 65_536 + 10), (last, raw.len() - 3)] {
            let mut other = raw.clone();
            other[at] ^= 1;
            let e = coded_matches(&coded, &other, threads, "blocks.2").unwrap_err().to_string();
            assert!(e.contains("blocks.2") && e.contains(&format!("segment {seg} ")), "{e}");
        }
        // Another length, and structural damage.
        assert!(coded_matches(&coded, &raw[1..], threads, "blocks.2").unwrap_err().to_string().contains("blocks.2"));
        assert!(coded_matches(&coded[..coded.len() / 2], &raw, threads, "blocks.2").is_err());
    }
    coded_matches(&code_for_device(&[], 64, 2), &[], 2, "b").unwrap();
}

/// fp8 e4m3 weights as a per-output-channel scaled checkpoint holds them:
/// `rows` channels of normal values, each divided by its amax / 448 and cast
/// nearest-even.
fn scaled_fp8(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let v = normal_bf16(rows * cols, 0.02, seed);
    let f: Vec<f32> = v.chunks_exact(2).map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16)).collect();
    f.chunks(cols)
        .flat_map(|row| {
            let amax = row.iter().fold(0f32, |m, x| m.max(x.abs())).max(f32::MIN_POSITIVE);
            row.iter().map(move |x| crate::tensor::f32_to_fp8(x / (amax / 448.0), crate::tensor::DType::F8_E4M3).unwrap())
        })
        .collect()
}

#[test]
fn fp8_weights_round_trip_and_shrink_to_their_exponent_entropy() {
    let w = scaled_fp8(256, 1024, 11);
    let enc = encode_fp8_e4m3(&w);
    assert_eq!(enc[4], 2, "coded as fp8");
    assert_eq!(decode_bf16(&enc, "w").unwrap(), w);
    // The exponent field's order-0 entropy plus 4 bits of sign and mantissa.
    let mut h = [0u64; 256];
    for &b in &w {
        h[fp8_exponent(b) as usize] += 1;
    }
    let bound = (histogram_entropy_bits(&h) + 4.0) / 8.0;
    let r = enc.len() as f64 / w.len() as f64;
    assert!(r < 0.86 && r < bound + 0.02, "ratio {r}, entropy bound {bound}");
    // The bf16 code reads pairs of fp8 values as one bf16: it saves less.
    assert!(encode_bf16(&w).len() as f64 > 1.1 * enc.len() as f64);
    // Coded, an odd count of values (the last byte's high nibble unused).
    let odd = &w[..3 * 1024 + 17];
    let e = encode_fp8_e4m3(odd);
    assert_eq!(e[4], 2, "coded as fp8");
    assert_eq!(decode_bf16(&e, "odd").unwrap(), odd);
    // Every byte value, any length (odd ones included), round-trips (raw where
    // coding would not shrink them).
    for n in [1usize, 2, 3, 1023, 1024, 1025, 4097] {
        let any: Vec<u8> = (0..n).map(|i| (i * 151 + n) as u8).collect();
        assert_eq!(decode_bf16(&encode_fp8_e4m3(&any), "any").unwrap(), any, "{n} bytes");
    }
    // The tensor-by-tensor form codes an fp8 tensor with its own code.
    let spec = crate::tensor::TensorSpec { name: "w".into(), dtype: crate::tensor::DType::F8_E4M3, shape: vec![256, 1024] };
    let layout = crate::tensor::BlockLayout::new(vec![spec]).unwrap();
    let c = compress_block(&layout, &w, 2).unwrap();
    assert!(c.ratio() < 0.86, "compressed block ratio {}", c.ratio());
    let mut out = vec![0u8; w.len()];
    decompress_block_into(&layout, c.as_bytes(), &mut out, "blocks.0").unwrap();
    assert_eq!(out, w);
}

/// A block served in place from a file lays its tensors out in the file's
/// order, which need not be the layout's: such a block codes and decodes
/// whole, its gap zero; a hand-made layout with a tensor outside the block
/// or over another is a named error, not a panic.
#[test]
fn a_block_laid_out_out_of_order_round_trips_and_a_bad_layout_is_named() {
    use crate::tensor::{BlockLayout, PlacedTensor};
    let spec = |n: &str, len: usize| crate::tensor::TensorSpec { name: n.into(), dtype: crate::tensor::DType::BF16, shape: vec![len] };
    let (a, b) = (spec("blocks.0.a", 64), spec("blocks.0.b", 100));
    // `a` after `b` in the buffer, a 56-byte gap after `b`.
    let layout = BlockLayout::placed(vec![
        PlacedTensor { spec: a.clone(), offset: 256, nbytes: 128 },
        PlacedTensor { spec: b.clone(), offset: 0, nbytes: 200 },
    ])
    .unwrap();
    let mut bytes: Vec<u8> = (0..layout.bytes).map(|i| (i * 37 % 251) as u8).collect();
    bytes[200..256].fill(0);
    let c = compress_block(&layout, &bytes, 2).unwrap();
    let mut out = vec![0xAAu8; layout.bytes];
    decompress_block_into(&layout, c.as_bytes(), &mut out, "blocks.0").unwrap();
    assert_eq!(out, bytes);
    let mut bad = layout.clone();
    bad.tensors[0].offset = 128; // over `b`
    let e = compress_block(&bad, &bytes, 1).unwrap_err().to_string();
    assert!(e.contains("blocks.0.a") && e.contains("over another"), "{e}");
    let e = decompress_block_into(&bad, c.as_bytes(), &mut out, "blocks.0").unwrap_err().to_string();
    assert!(e.contains("blocks.0.a"), "{e}");
}

#[test]
fn damaged_fp8_strings_are_errors_naming_the_tensor() {
    let w = scaled_fp8(64, 1024, 12);
    let enc = encode_fp8_e4m3(&w);
    let l = coded_layout(&enc, w.len(), "w").unwrap();
    assert_eq!((l.code, l.values, enc.len() - l.sm_at), (Code::Fp8E4M3, w.len(), w.len() / 2));
    // A sign-mantissa nibble, a stream byte, a code for an exponent field of 16.
    for (name, at, flip) in [("nibble", l.sm_at + 77, 0x10u8), ("stream", l.stream_at + 5, 0x04), ("table", HEADER + 16, 1)] {
        let mut bad = enc.clone();
        bad[at] ^= flip;
        let e = decode_bf16(&bad, "blocks.3.w").unwrap_err().to_string();
        assert!(e.contains("blocks.3.w"), "{name}: {e}");
    }
    let mut short = enc.clone();
    short.pop();
    assert!(decode_bf16(&short, "w").is_err());
}

#[test]
fn device_blocks_hold_fp8_codes_only_where_the_device_reads_them() {
    // A block of fp8 weights then bf16 ones (fp8 linears beside bf16 modulation).
    let mut raw = scaled_fp8(128, 1024, 13);
    raw.extend(normal_bf16(65_536, 0.02, 14));
    let codes =
        |coded: &[u8]| device_segments(coded, "b").unwrap().1.iter().map(|s| s.coded.as_ref().map(|c| c.1.code)).collect::<Vec<_>>();
    // By default (what offload-cuda's kernels read): bf16's code or raw, never fp8's.
    // 64 KiB segments: two of fp8 weights, then two of bf16.
    let plain = code_for_device(&raw, 64 << 10, 2);
    assert!(codes(&plain).iter().all(|c| *c != Some(Code::Fp8E4M3)));
    let both = code_for_device_with(&raw, 64 << 10, 2, DeviceCodes { fp8_e4m3: true });
    let got = codes(&both);
    // The fp8 segments coded as fp8, the bf16 ones as bf16.
    assert_eq!(got, [Some(Code::Fp8E4M3), Some(Code::Fp8E4M3), Some(Code::Bf16), Some(Code::Bf16)]);
    assert!(both.len() < plain.len());
    for threads in [1, 3] {
        let mut out = vec![0u8; raw.len()];
        decode_device_block_on(&both, &mut out, threads, "b").unwrap();
        assert!(out == raw);
    }
    coded_matches(&both, &raw, 2, "b").unwrap();
}
