//! The exponent codec's round trip on the CPU reference decoder: random data,
//! adversarial data (one exponent everywhere, every exponent, NaN, infinities,
//! subnormals, odd lengths, empty), and every chunk boundary.

use offload_core::codec::{decode_bf16, encode_bf16, exponent_entropy_bits, CHUNK_VALUES};
use proptest::prelude::*;

fn round_trip(raw: &[u8]) -> Result<(), TestCaseError> {
    let enc = encode_bf16(raw);
    let back = decode_bf16(&enc, "t").map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(back.as_slice(), raw);
    // Never larger than raw plus the 24-byte header.
    prop_assert!(enc.len() <= raw.len() + 24, "{} > {} + 24", enc.len(), raw.len());
    Ok(())
}

/// Whether `raw` is held coded (header mode 1), not raw (mode 0): narrow
/// exponents must take the coded path, or the property tests only the raw copy.
fn is_coded(raw: &[u8]) -> bool {
    encode_bf16(raw)[4] == 1
}

fn from_u16(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_round_trip(raw in prop::collection::vec(any::<u8>(), 0..9000)) {
        round_trip(&raw)?;
    }

    #[test]
    fn random_bf16_round_trip(v in prop::collection::vec(any::<u16>(), 0..6000)) {
        round_trip(&from_u16(&v))?;
    }

    #[test]
    fn narrow_exponents_round_trip(
        v in prop::collection::vec((0u16..2, 118u16..124, 0u16..128), 1..5000),
    ) {
        let vals: Vec<u16> = v.iter().map(|&(s, e, m)| (s << 15) | (e << 7) | m).collect();
        round_trip(&from_u16(&vals))?;
        // Six exponents in 2.6 bits: a chunk's worth and more is coded.
        prop_assert!(vals.len() < CHUNK_VALUES || is_coded(&from_u16(&vals)), "{} values held raw", vals.len());
    }

    #[test]
    fn one_exponent_everywhere_round_trips(e in 0u16..256, n in 1usize..4000, m in prop::collection::vec(0u16..256, 1..64)) {
        let vals: Vec<u16> = (0..n).map(|i| ((m[i % m.len()] & 0x80) << 8) | (e << 7) | (m[i % m.len()] & 0x7f)).collect();
        round_trip(&from_u16(&vals))?;
        prop_assert!(n < CHUNK_VALUES || is_coded(&from_u16(&vals)), "{n} values of one exponent held raw");
    }
}

#[test]
fn adversarial_values_round_trip() {
    let special: Vec<u16> = vec![
        0x0000, 0x8000, // ±0
        0x7f80, 0xff80, // ±inf
        0x7fc0, 0xffc1, 0x7f81, // NaNs, quiet and signalling
        0x0001, 0x807f, 0x0040, // subnormals
        0x7f7f, 0xff7f, // ±max
        0x0080, // min normal
    ];
    let mut every: Vec<u16> = (0..256u16).map(|e| (e << 7) | (e & 0x7f)).collect();
    every.extend((0..256u16).map(|e| 0x8000 | (e << 7)));
    for case in [special.clone(), every.clone(), special.repeat(500), every.repeat(9)] {
        let raw = from_u16(&case);
        assert_eq!(decode_bf16(&encode_bf16(&raw), "t").unwrap(), raw);
    }
    // Lengths around chunk boundaries, and odd byte lengths.
    let base: Vec<u8> = (0..(3 * CHUNK_VALUES + 3) * 2).map(|i| ((i * 7919) % 251) as u8 & 0x3f).collect();
    for n in [0, 1, 2, 3, 2 * CHUNK_VALUES - 2, 2 * CHUNK_VALUES, 2 * CHUNK_VALUES + 2, 2 * CHUNK_VALUES + 1, base.len() - 1, base.len()] {
        let raw = &base[..n];
        assert_eq!(decode_bf16(&encode_bf16(raw), "t").unwrap(), raw, "{n} bytes");
    }
    assert_eq!(exponent_entropy_bits(&[]), 0.0);
    assert_eq!(exponent_entropy_bits(&from_u16(&[0x3f80; 100])), 0.0);
    assert!((exponent_entropy_bits(&from_u16(&every)) - 8.0).abs() < 1e-9);
}

#[test]
fn incompressible_data_is_stored_raw() {
    let mut s = 9u64;
    let raw: Vec<u8> = (0..20_000)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let enc = encode_bf16(&raw);
    assert_eq!(enc[4], 0, "random bytes are stored raw");
    assert_eq!(enc.len(), raw.len() + 24);
    assert_eq!(decode_bf16(&enc, "t").unwrap(), raw);
}

#[test]
fn a_block_of_mixed_tensors_round_trips_on_any_thread_count() {
    use offload_core::codec::{compress_block, decompress_block_into};
    use offload_core::tensor::{BlockLayout, DType, TensorSpec};
    let layout = BlockLayout::new(vec![
        TensorSpec::new("b.0.w", DType::BF16, [300, 64]),
        TensorSpec::new("b.0.bias", DType::BF16, [7]),
        TensorSpec::new("b.0.scale", DType::F32, [33]),
        TensorSpec::new("b.0.empty", DType::BF16, [0]),
        TensorSpec::new("b.0.v", DType::BF16, [5000]),
    ])
    .unwrap();
    let mut bytes = vec![0u8; layout.bytes];
    let mut s = 3u64;
    for t in &layout.tensors {
        for (k, b) in bytes[t.offset..t.offset + t.nbytes].iter_mut().enumerate() {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // bf16 high bytes near 0x3c (small weights), low bytes anything.
            *b = if t.spec.dtype == DType::BF16 && k % 2 == 1 { 0x3c | ((s >> 62) as u8 & 1) << 7 } else { (s >> 33) as u8 };
        }
    }
    let mut first = None;
    for threads in [1, 2, 3, 8] {
        let c = compress_block(&layout, &bytes, threads).unwrap();
        assert!(c.ratio() < 0.8, "ratio {}", c.ratio());
        let mut out = vec![0xee; layout.bytes];
        decompress_block_into(&layout, c.as_bytes(), &mut out, "b.0").unwrap();
        assert_eq!(out, bytes, "{threads} threads");
        // The same bytes whatever the thread count.
        assert_eq!(first.get_or_insert_with(|| c.clone()), &c);
    }
    let c = compress_block(&layout, &bytes, 2).unwrap();
    let mut bad = c.as_bytes().to_vec();
    let last = bad.len() - 3;
    bad[last] ^= 1;
    let e = decompress_block_into(&layout, &bad, &mut vec![0; layout.bytes], "b.0").unwrap_err();
    assert!(e.to_string().contains("b.0: b.0.v"), "{e}");
    assert!(compress_block(&layout, &bytes[1..], 2).is_err());
}

#[test]
fn a_header_claiming_more_than_the_string_holds_is_an_error() {
    let raw: Vec<u8> = (0..4000u32).flat_map(|i| (0x3c00u16 | (i % 200) as u16).to_le_bytes()).collect();
    for mut enc in [encode_bf16(&raw), encode_bf16(&raw[..3])] {
        enc[15] = 0x7f; // the top byte of the length
        let e = decode_bf16(&enc, "w").unwrap_err();
        assert!(e.to_string().contains("cannot hold"), "{e}");
    }
}
