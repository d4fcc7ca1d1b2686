//! Lossless compression of bf16 weights for the wire: each value's sign and
//! mantissa byte is kept as it is, its 8-bit exponent is coded with a canonical
//! Huffman code of at most [`MAX_CODE_BITS`] bits (a bf16 exponent carries about
//! 2.6 bits of information in trained weights). Exponents are coded in chunks of
//! [`CHUNK_VALUES`] values, each starting at its own byte offset, so a GPU decodes
//! the chunks in parallel with one lookup table of `2^MAX_CODE_BITS` entries.
//!
//! fp8 e4m3 weights have their own code ([`encode_fp8_e4m3`], mode 2): the 4-bit
//! exponent field coded the same way, the sign and 3 mantissa bits of two values
//! packed in a byte (a per-channel-scaled normal's exponent field carries about
//! 2.6 of its 4 bits, so ≈ 0.82 of the fp8 bytes).
//!
//! The encoded form is one self-describing byte string ([`encode_bf16`]); data
//! that would not shrink (or is not a whole number of bf16 values) is stored raw.
//! [`decode_bf16`] is the CPU reference decoder: it checks the structure of every
//! chunk and a hash of the decoded bytes, so a damaged string is an error naming
//! what was being decoded, never a wrong weight.
//!
//! Layout (little endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 4 | magic `OFZ1` |
//! | 1 | mode: 0 raw, 1 coded bf16, 2 coded fp8 e4m3 |
//! | 3 | zero |
//! | 8 | length of the original bytes |
//! | 8 | [`hash64`] of the original bytes |
//! | raw: the original bytes; coded: | |
//! | 256 | code length of each exponent value (0: absent) |
//! | 4 | chunks `c` |
//! | 4 × (c + 1) | byte offset of each chunk in the exponent stream, then its length |
//! | … | the exponent stream |
//! | bf16: n | sign and mantissa bytes, one per value (`sign << 7 \| mantissa`) |
//! | fp8: ⌈n / 2⌉ | sign and mantissa nibbles (`sign << 3 \| mantissa`), value 2i in the low nibble of byte i, 2i + 1 in the high |

use crate::error::{Error, Result};

/// Values per independently decodable chunk of exponents.
pub const CHUNK_VALUES: usize = 1024;
/// Longest exponent code, in bits (the decoder's table has `2^MAX_CODE_BITS` entries).
pub const MAX_CODE_BITS: u32 = 12;

const MAGIC: &[u8; 4] = b"OFZ1";
const HEADER: usize = 24;

/// A 64-bit hash of `bytes`, eight bytes at a time: each word is xored in, then
/// multiplied by an odd constant and xor-shifted (both bijections), so a change
/// confined to one word always changes the hash. Not cryptographic: it catches
/// damage, not tampering.
pub fn hash64(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ (bytes.len() as u64).wrapping_mul(K);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        h = (h ^ u64::from_le_bytes(a)).wrapping_mul(K);
        h ^= h >> 29;
    }
    let rest = words.remainder();
    let mut a = [0u8; 8];
    a[..rest.len()].copy_from_slice(rest);
    h = (h ^ u64::from_le_bytes(a)).wrapping_mul(K);
    h ^ (h >> 32)
}

fn exponent(lo: u8, hi: u8) -> u8 {
    (hi << 1) | (lo >> 7)
}

fn sign_mantissa(lo: u8, hi: u8) -> u8 {
    (hi & 0x80) | (lo & 0x7f)
}

/// What a coded string codes: which field of each value is the coded symbol and
/// what the rest of the value is stored as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Mode 1: bf16, the 8-bit exponent coded, one sign-mantissa byte per value.
    Bf16,
    /// Mode 2: fp8 e4m3 (`s eeee mmm`), the 4-bit exponent field coded, the sign
    /// and mantissa of two values packed in one byte.
    Fp8E4M3,
}

impl Code {
    fn mode(self) -> u8 {
        match self {
            Code::Bf16 => 1,
            Code::Fp8E4M3 => 2,
        }
    }

    fn of_mode(mode: u8) -> Option<Code> {
        match mode {
            1 => Some(Code::Bf16),
            2 => Some(Code::Fp8E4M3),
            _ => None,
        }
    }

    /// Bytes per value.
    fn width(self) -> usize {
        match self {
            Code::Bf16 => 2,
            Code::Fp8E4M3 => 1,
        }
    }

    /// Bytes of sign and mantissa that `n` values keep beside their codes.
    fn residual_len(self, n: usize) -> usize {
        match self {
            Code::Bf16 => n,
            Code::Fp8E4M3 => n.div_ceil(2),
        }
    }

    /// Symbols a code table may hold (the exponent field's values).
    fn symbols(self) -> usize {
        match self {
            Code::Bf16 => 256,
            Code::Fp8E4M3 => 16,
        }
    }
}

/// The exponent field of an fp8 e4m3 byte.
fn fp8_exponent(b: u8) -> u8 {
    (b >> 3) & 0x0f
}

/// The sign and mantissa of an fp8 e4m3 byte, as a nibble (`sign << 3 | mantissa`).
fn fp8_sign_mantissa(b: u8) -> u8 {
    ((b >> 4) & 0x08) | (b & 0x07)
}

/// Counts of each exponent value in little-endian bf16 `bytes` (an odd last byte is ignored).
pub fn exponent_histogram(bytes: &[u8]) -> [u64; 256] {
    let mut h = [0u64; 256];
    for v in bytes.chunks_exact(2) {
        h[exponent(v[0], v[1]) as usize] += 1;
    }
    h
}

/// Shannon entropy of the exponents of bf16 `bytes`, in bits per value.
pub fn exponent_entropy_bits(bytes: &[u8]) -> f64 {
    histogram_entropy_bits(&exponent_histogram(bytes))
}

/// Shannon entropy of a histogram of exponents ([`exponent_histogram`]), in bits
/// per value (0 for an empty one): histograms of several tensors add up first.
pub fn histogram_entropy_bits(h: &[u64; 256]) -> f64 {
    let n: u64 = h.iter().sum();
    if n == 0 {
        return 0.0;
    }
    h.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n as f64).map(|p| -p * p.log2()).sum()
}

/// Huffman code lengths for `freq` (0 where a value is absent), at most `limit`
/// bits: frequencies are halved (keeping every present value) until the tree fits.
fn code_lengths(freq: &[u64; 256], limit: u32) -> [u8; 256] {
    let mut f = *freq;
    loop {
        let mut lens = [0u8; 256];
        let present: Vec<usize> = (0..256).filter(|&s| f[s] > 0).collect();
        match present.len() {
            0 => return lens,
            1 => {
                lens[present[0]] = 1;
                return lens;
            }
            _ => {}
        }
        // Nodes: (weight, symbols under it); merge the two lightest each time.
        let mut nodes: Vec<(u64, Vec<usize>)> = present.iter().map(|&s| (f[s], vec![s])).collect();
        while nodes.len() > 1 {
            nodes.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| b.1[0].cmp(&a.1[0])));
            let (wa, sa) = nodes.pop().unwrap_or_default();
            let (wb, sb) = nodes.pop().unwrap_or_default();
            for &s in sa.iter().chain(&sb) {
                lens[s] += 1;
            }
            nodes.push((wa + wb, sa.into_iter().chain(sb).collect()));
        }
        if present.iter().all(|&s| u32::from(lens[s]) <= limit) {
            return lens;
        }
        for s in present {
            f[s] = f[s].div_ceil(2);
        }
    }
}

/// Canonical codes for `lens`: (code, length) per value, codes of one length consecutive.
fn canonical(lens: &[u8; 256]) -> [(u32, u8); 256] {
    let mut order: Vec<usize> = (0..256).filter(|&s| lens[s] > 0).collect();
    order.sort_by_key(|&s| (lens[s], s));
    let mut codes = [(0u32, 0u8); 256];
    let (mut code, mut prev) = (0u32, 0u8);
    for (i, &s) in order.iter().enumerate() {
        if i > 0 {
            code = (code + 1) << (lens[s] - prev);
        } else {
            code <<= lens[s];
        }
        prev = lens[s];
        codes[s] = (code, lens[s]);
    }
    codes
}

/// Encode little-endian bf16 `bytes`. Data that is not a whole number of values,
/// or that would not shrink, is stored raw.
pub fn encode_bf16(bytes: &[u8]) -> Vec<u8> {
    encode(bytes, Code::Bf16)
}

/// Encode fp8 e4m3 `bytes` (mode 2: the exponent field coded, sign and mantissa
/// packed two values a byte). Data that would not shrink is stored raw. Any bytes
/// round-trip (the code is lossless whatever they hold); only e4m3 weights shrink.
pub fn encode_fp8_e4m3(bytes: &[u8]) -> Vec<u8> {
    encode(bytes, Code::Fp8E4M3)
}

/// Encode `bytes` with `code`, or raw where they are not a whole number of
/// values or would not shrink.
pub fn encode(bytes: &[u8], code: Code) -> Vec<u8> {
    match code {
        Code::Bf16 => encode_values::<2>(
            bytes,
            code,
            |v| exponent(v[0], v[1]),
            |out| out.extend(bytes.chunks_exact(2).map(|v| sign_mantissa(v[0], v[1]))),
        ),
        Code::Fp8E4M3 => encode_values::<1>(
            bytes,
            code,
            |v| fp8_exponent(v[0]),
            |out| out.extend(bytes.chunks(2).map(|p| fp8_sign_mantissa(p[0]) | p.get(1).map_or(0, |&b| fp8_sign_mantissa(b) << 4))),
        ),
    }
}

/// The coded string of `bytes`, `W` bytes a value: `symbol` of each value coded in
/// chunks, then what `residual` appends; raw where that is not shorter.
fn encode_values<const W: usize>(bytes: &[u8], code: Code, symbol: impl Fn(&[u8]) -> u8, residual: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let hash = hash64(bytes);
    let mut out = Vec::with_capacity(bytes.len() / W * 3 / 2 + 512);
    let header = |out: &mut Vec<u8>, mode: u8| {
        out.clear();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[mode, 0, 0, 0]);
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&hash.to_le_bytes());
    };
    let raw = |out: &mut Vec<u8>| {
        header(out, 0);
        out.extend_from_slice(bytes);
        std::mem::take(out)
    };
    if bytes.len() % W != 0 || bytes.is_empty() {
        return raw(&mut out);
    }
    let n = bytes.len() / W;
    let mut hist = [0u64; 256];
    for v in bytes.chunks_exact(W) {
        hist[symbol(v) as usize] += 1;
    }
    let lens = code_lengths(&hist, MAX_CODE_BITS);
    let codes = canonical(&lens);
    let chunks = n.div_ceil(CHUNK_VALUES);
    header(&mut out, code.mode());
    out.extend_from_slice(&lens);
    out.extend_from_slice(&(chunks as u32).to_le_bytes());
    let offsets_at = out.len();
    out.resize(offsets_at + 4 * (chunks + 1), 0);
    let stream_at = out.len();
    let mut offsets = Vec::with_capacity(chunks + 1);
    for chunk in bytes.chunks(W * CHUNK_VALUES) {
        offsets.push((out.len() - stream_at) as u32);
        let (mut acc, mut bits) = (0u64, 0u32);
        for v in chunk.chunks_exact(W) {
            let (code, len) = codes[symbol(v) as usize];
            acc = (acc << len) | u64::from(code);
            bits += u32::from(len);
            while bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
            }
        }
        if bits > 0 {
            out.push((acc << (8 - bits)) as u8);
        }
        if out.len() - stream_at > u32::MAX as usize {
            return raw(&mut out);
        }
    }
    offsets.push((out.len() - stream_at) as u32);
    for (i, o) in offsets.iter().enumerate() {
        out[offsets_at + 4 * i..offsets_at + 4 * i + 4].copy_from_slice(&o.to_le_bytes());
    }
    residual(&mut out);
    if out.len() >= HEADER + bytes.len() {
        return raw(&mut out);
    }
    out
}

/// A block's bytes compressed tensor by tensor: bf16 and fp8 e4m3 tensors coded,
/// others (and coded tensors that would not shrink) raw. One contiguous byte string, what a
/// copy puts in a staging buffer: the number of parts (`u32`), each part's start
/// and then the end (`u64` each, from the start of the parts), then the parts in
/// layout order, each an [`encode_bf16`] string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompressedBlock {
    bytes: Vec<u8>,
    raw_bytes: usize,
}

impl CompressedBlock {
    /// The compressed bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Bytes of the block uncompressed (its layout's size).
    pub fn raw_bytes(&self) -> usize {
        self.raw_bytes
    }

    /// Compressed size ÷ raw size.
    pub fn ratio(&self) -> f64 {
        self.bytes.len() as f64 / self.raw_bytes.max(1) as f64
    }
}

/// Compress a block laid out as `layout` whose bytes are `bytes`, on up to
/// `threads` host threads (tensors are shared out among them).
pub fn compress_block(layout: &crate::tensor::BlockLayout, bytes: &[u8], threads: usize) -> Result<CompressedBlock> {
    if bytes.len() != layout.bytes {
        return Err(Error::BadTensor {
            tensor: "<block>".into(),
            fault: format!("{} bytes for a {}-byte layout", bytes.len(), layout.bytes),
        });
    }
    spans(layout, "the block")?;
    let n = layout.tensors.len();
    let mut parts: Vec<Vec<u8>> = vec![Vec::new(); n];
    let threads = threads.clamp(1, n.max(1));
    // Largest tensors first, each to the thread with the least work so far.
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(layout.tensors[i].nbytes));
    let mut work = vec![(0usize, Vec::new()); threads];
    for i in order {
        let t = (0..threads).min_by_key(|&t| work[t].0).unwrap_or(0);
        work[t].0 += layout.tensors[i].nbytes;
        work[t].1.push(i);
    }
    let encode = |i: usize| {
        let t = &layout.tensors[i];
        let src = &bytes[t.offset..t.offset + t.nbytes];
        match t.spec.dtype {
            crate::tensor::DType::BF16 => encode_bf16(src),
            crate::tensor::DType::F8_E4M3 => encode_fp8_e4m3(src),
            _ => encode_raw(src),
        }
    };
    std::thread::scope(|scope| {
        let handles: Vec<_> =
            work.iter().map(|(_, idx)| scope.spawn(move || idx.iter().map(|&i| (i, encode(i))).collect::<Vec<_>>())).collect();
        for h in handles {
            // An encoder thread that panicked takes the caller down with it,
            // rather than leaving parts empty.
            for (i, p) in h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)) {
                parts[i] = p;
            }
        }
    });
    let table = 4 + 8 * (n + 1);
    let mut out = Vec::with_capacity(table + parts.iter().map(Vec::len).sum::<usize>());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    let mut at = 0u64;
    for p in &parts {
        out.extend_from_slice(&at.to_le_bytes());
        at += p.len() as u64;
    }
    out.extend_from_slice(&at.to_le_bytes());
    for p in &parts {
        out.extend_from_slice(p);
    }
    Ok(CompressedBlock { bytes: out, raw_bytes: layout.bytes })
}

/// The raw form of `bytes` (mode 0), for tensors that are neither bf16 nor fp8 e4m3.
fn encode_raw(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + bytes.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&hash64(bytes).to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// Decode a [`CompressedBlock`]'s bytes into `out` (the block's layout size):
/// every tensor at its offset, the alignment gaps zero. `block` names the block
/// in errors, with the tensor at fault.
pub fn decompress_block_into(layout: &crate::tensor::BlockLayout, compressed: &[u8], out: &mut [u8], block: &str) -> Result<()> {
    if out.len() != layout.bytes {
        return Err(damaged(block, format!("{} bytes given for a {}-byte block", out.len(), layout.bytes)));
    }
    let n = u32_at(compressed, 0, block)? as usize;
    if n != layout.tensors.len() {
        return Err(damaged(block, format!("{n} parts for {} tensors", layout.tensors.len())));
    }
    let base = 4 + 8 * (n + 1);
    // The gaps between the tensors (in the order they lie, which need not be the
    // layout's: a block served in place from a file) are zero.
    let mut end = 0;
    for (start, stop) in spans(layout, block)? {
        out[end..start].fill(0);
        end = stop;
    }
    for (i, t) in layout.tensors.iter().enumerate() {
        let what = format!("{block}: {}", t.spec.name);
        let (from, to) = (u64_at(compressed, 4 + 8 * i, &what)? as usize, u64_at(compressed, 12 + 8 * i, &what)? as usize);
        let range = base.checked_add(from).zip(base.checked_add(to)).filter(|(a, b)| a <= b);
        let part = range.and_then(|(a, b)| compressed.get(a..b)).ok_or_else(|| damaged(&what, "part outside the block"))?;
        decode_bf16_into(part, &mut out[t.offset..t.offset + t.nbytes], &what)?;
    }
    Ok(())
}

/// Each tensor's `(start, end)` in the block, in the order they lie: an error
/// naming the tensor where one lies outside the layout's bytes or over another
/// (a layout's fields are public; `BlockLayout::new` and `placed` never do this).
fn spans(layout: &crate::tensor::BlockLayout, block: &str) -> Result<Vec<(usize, usize)>> {
    let mut order: Vec<&crate::tensor::PlacedTensor> = layout.tensors.iter().collect();
    // Ties (a 0-byte tensor where another starts) by end, as `BlockLayout::placed` sorts.
    order.sort_by_key(|t| (t.offset, t.nbytes));
    let mut end = 0;
    let mut out = Vec::with_capacity(order.len());
    for t in order {
        let stop = t.offset.checked_add(t.nbytes).filter(|&s| s <= layout.bytes && t.offset >= end);
        let stop = stop.ok_or_else(|| Error::BadTensor {
            tensor: format!("{block}: {}", t.spec.name),
            fault: format!("{} bytes at offset {} lie outside the {}-byte block or over another tensor", t.nbytes, t.offset, layout.bytes),
        })?;
        out.push((t.offset, stop));
        end = stop;
    }
    Ok(out)
}

fn damaged(what: &str, fault: impl Into<String>) -> Error {
    Error::BadTensor { tensor: what.to_owned(), fault: format!("compressed bytes damaged: {}", fault.into()) }
}

fn u32_at(b: &[u8], at: usize, what: &str) -> Result<u32> {
    b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]])).ok_or_else(|| damaged(what, "truncated"))
}

fn u64_at(b: &[u8], at: usize, what: &str) -> Result<u64> {
    let s = b.get(at..at + 8).ok_or_else(|| damaged(what, "truncated header"))?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Ok(u64::from_le_bytes(a))
}

/// The original length of an encoded string, from its header.
pub fn decoded_len(enc: &[u8], what: &str) -> Result<usize> {
    if enc.get(..4) != Some(MAGIC.as_slice()) {
        return Err(damaged(what, "no OFZ1 magic"));
    }
    usize::try_from(u64_at(enc, 8, what)?).map_err(|_| damaged(what, "length does not fit this machine"))
}

/// Decode `enc` (from [`encode_bf16`]) into `out`, whose length must be the
/// original length. `what` names the tensor or block in errors.
pub fn decode_bf16_into(enc: &[u8], out: &mut [u8], what: &str) -> Result<()> {
    let len = decoded_len(enc, what)?;
    if out.len() != len {
        return Err(damaged(what, format!("{} bytes expected by the header, {} given", len, out.len())));
    }
    let hash = u64_at(enc, 16, what)?;
    match enc[4] {
        0 => {
            let body = enc.get(HEADER..).ok_or_else(|| damaged(what, "truncated"))?;
            if body.len() != len {
                return Err(damaged(what, format!("raw body of {} bytes, {len} expected", body.len())));
            }
            out.copy_from_slice(body);
        }
        1 | 2 => decode_coded(enc, out, what)?,
        m => return Err(damaged(what, format!("unknown mode {m}"))),
    }
    if hash64(out) != hash {
        return Err(damaged(what, "decoded bytes do not match the hash of the original"));
    }
    Ok(())
}

/// [`decode_bf16_into`] into a new vector.
pub fn decode_bf16(enc: &[u8], what: &str) -> Result<Vec<u8>> {
    let len = decoded_len(enc, what)?;
    // Never trust a length the string cannot hold: raw strings carry every byte,
    // coded ones at least one sign-mantissa byte per value (bf16) or per two
    // values of one byte each (fp8).
    let most = match enc.get(4) {
        Some(0) => enc.len().saturating_sub(HEADER),
        _ => 2 * enc.len().saturating_sub(HEADER + 260),
    };
    if len > most {
        return Err(damaged(what, format!("a header length of {len} bytes that {} encoded bytes cannot hold", enc.len())));
    }
    let mut out = vec![0u8; len];
    decode_bf16_into(enc, &mut out, what)?;
    Ok(out)
}

/// Where the parts of a coded string (mode 1 or 2) sit, checked against its
/// header: what a decoder on another device needs besides the bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodedLayout {
    /// What the string codes: a decoder that reads only one code refuses the others.
    pub code: Code,
    /// Values coded (bf16 or fp8, as `code` says).
    pub values: usize,
    /// Exponent chunks ([`CHUNK_VALUES`] values each, the last maybe fewer).
    pub chunks: usize,
    /// Byte offset of the chunk offset table (`chunks + 1` little-endian `u32`s,
    /// each relative to `stream_at`; the last is the stream's length).
    pub offsets_at: usize,
    /// Byte offset of the exponent stream.
    pub stream_at: usize,
    /// Byte offset of the sign-mantissa bytes (one per value for bf16, one per
    /// two values for fp8).
    pub sm_at: usize,
    /// The lookup table: the next [`MAX_CODE_BITS`] bits of a chunk's stream →
    /// `exponent | length << 8` (length 0: no code starts with those bits).
    pub table: Vec<u16>,
}

/// [`CodedLayout`] of the coded string `enc` whose decoded length is `len`:
/// every structural check of the CPU decoder but the chunks' own bits.
pub fn coded_layout(enc: &[u8], len: usize, what: &str) -> Result<CodedLayout> {
    let code = enc.get(4).and_then(|&m| Code::of_mode(m)).ok_or_else(|| damaged(what, "not a coded string"))?;
    if len % code.width() != 0 {
        return Err(damaged(what, "coded data of an odd length"));
    }
    let n = len / code.width();
    let lens: [u8; 256] =
        enc.get(HEADER..HEADER + 256).and_then(|s| s.try_into().ok()).ok_or_else(|| damaged(what, "truncated code table"))?;
    if lens.iter().any(|&l| u32::from(l) > MAX_CODE_BITS) {
        return Err(damaged(what, "a code longer than the limit"));
    }
    if lens[code.symbols()..].iter().any(|&l| l > 0) {
        return Err(damaged(what, "a code for a value no fp8 exponent field holds"));
    }
    let kraft: u64 = lens.iter().filter(|&&l| l > 0).map(|&l| 1u64 << (MAX_CODE_BITS - u32::from(l))).sum();
    if kraft > 1 << MAX_CODE_BITS {
        return Err(damaged(what, "code lengths that no prefix code has"));
    }
    let mut table = vec![0u16; 1 << MAX_CODE_BITS];
    for (s, &(code, l)) in canonical(&lens).iter().enumerate().filter(|(_, c)| c.1 > 0) {
        let shift = MAX_CODE_BITS - u32::from(l);
        let start = (code as usize) << shift;
        for e in &mut table[start..start + (1 << shift)] {
            *e = s as u16 | u16::from(l) << 8;
        }
    }
    let chunks = u32_at(enc, HEADER + 256, what)? as usize;
    if chunks != n.div_ceil(CHUNK_VALUES) {
        return Err(damaged(what, format!("{chunks} chunks for {n} values")));
    }
    let offsets_at = HEADER + 260;
    let stream_at = offsets_at + 4 * (chunks + 1);
    let stream_len = u32_at(enc, offsets_at + 4 * chunks, what)? as usize;
    let sm_at = stream_at + stream_len;
    let sm = enc.get(sm_at..).ok_or_else(|| damaged(what, "truncated exponent stream"))?;
    if sm.len() != code.residual_len(n) {
        return Err(damaged(what, format!("{} sign-mantissa bytes for {n} values", sm.len())));
    }
    let mut prev = 0;
    for c in 0..=chunks {
        let o = u32_at(enc, offsets_at + 4 * c, what)? as usize;
        if o < prev || o > stream_len {
            return Err(damaged(what, format!("chunk {c} outside the stream")));
        }
        prev = o;
    }
    Ok(CodedLayout { code, values: n, chunks, offsets_at, stream_at, sm_at, table })
}

fn decode_coded(enc: &[u8], out: &mut [u8], what: &str) -> Result<()> {
    let l = coded_layout(enc, out.len(), what)?;
    let (n, sm) = (l.values, &enc[l.sm_at..]);
    let stream = &enc[l.stream_at..l.sm_at];
    for c in 0..l.chunks {
        let (from, to) = (u32_at(enc, l.offsets_at + 4 * c, what)? as usize, u32_at(enc, l.offsets_at + 4 * c + 4, what)? as usize);
        let bytes = &stream[from..to];
        let values = CHUNK_VALUES.min(n - c * CHUNK_VALUES);
        let (mut acc, mut bits, mut next) = (0u64, 0u32, 0usize);
        let mut used = 0u64;
        for k in 0..values {
            while bits < MAX_CODE_BITS {
                acc = (acc << 8) | u64::from(bytes.get(next).copied().unwrap_or(0));
                next += 1;
                bits += 8;
            }
            let e = l.table[((acc >> (bits - MAX_CODE_BITS)) & ((1 << MAX_CODE_BITS) - 1)) as usize];
            let (s, len) = ((e & 0xff) as u8, u32::from(e >> 8));
            if len == 0 {
                return Err(damaged(what, format!("chunk {c}: no code matches")));
            }
            bits -= len;
            used += u64::from(len);
            let i = c * CHUNK_VALUES + k;
            match l.code {
                Code::Bf16 => {
                    let m = sm[i];
                    out[2 * i] = (s << 7) | (m & 0x7f);
                    out[2 * i + 1] = (m & 0x80) | (s >> 1);
                }
                Code::Fp8E4M3 => {
                    let m = (sm[i / 2] >> (4 * (i & 1))) & 0x0f;
                    out[i] = ((m & 0x08) << 4) | (s << 3) | (m & 0x07);
                }
            }
        }
        if used.div_ceil(8) != bytes.len() as u64 {
            return Err(damaged(what, format!("chunk {c}: {} bits coded in {} bytes", used, bytes.len())));
        }
    }
    Ok(())
}

/// Magic of a block coded for a device decoder ([`code_for_device`]).
const DEVICE_MAGIC: &[u8; 4] = b"OFD1";
/// Header of a device block: magic, segment count (`u32`), original length (`u64`).
const DEVICE_HEADER: usize = 16;
/// Bytes per segment descriptor: `out_at`, `enc_at`, `enc_len`, `table_at` (`u64` each).
const DEVICE_DESC: usize = 32;
/// Where each segment's string and table start in a device block.
const DEVICE_ALIGN: usize = 256;

/// One segment of a device block ([`device_segments`]): where its output goes in
/// the block, where its [`encode_bf16`] string sits in the coded bytes and, for a
/// coded string, where its lookup table sits and how the string is laid out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSegment {
    /// Offset of the segment's bytes in the block (a multiple of 4).
    pub out_at: usize,
    /// Length of the segment's bytes.
    pub out_len: usize,
    /// Offset of its string in the coded bytes (a multiple of 256).
    pub enc_at: usize,
    /// Length of the string, zero padding to whole 32-bit words included.
    pub enc_len: usize,
    /// A coded string's lookup table (`2^MAX_CODE_BITS` little-endian `u16`s, at a
    /// multiple of 256) and layout (offsets relative to `enc_at`); `None` for a raw one.
    pub coded: Option<(usize, CodedLayout)>,
}

/// Device bytes of one staging buffer that a decoder copies a coded block of
/// `coded_len` bytes into: rounded up to 2 MiB, so that blocks of nearly one
/// size share a buffer (offload-cuda's decode engine allocates so, the planner
/// and the ring count so).
pub fn staging_buffer_bytes(coded_len: u64) -> u64 {
    coded_len.max(4).checked_next_multiple_of(2 << 20).unwrap_or(u64::MAX)
}

/// Device bytes of `buffers` staging buffers for coded blocks of up to
/// `largest_coded` bytes (none where nothing is coded): what the decode engine
/// holds, and what the planner and the ring count.
pub fn staging_bytes(buffers: usize, largest_coded: u64) -> u64 {
    match largest_coded {
        0 => 0,
        c => (buffers as u64).saturating_mul(staging_buffer_bytes(c)),
    }
}

/// Code a block's bytes for a decoder on another device: cut into segments of at
/// most `segment_bytes` (rounded down to a multiple of 4, at least 4, at most
/// 1 GiB: a string's offsets are 32-bit), each encoded by [`encode_bf16`] on up
/// to `threads` host threads — kept raw where the coded string and its table
/// would not be shorter than the raw string — laid out with its lookup table so
/// that one copy of the result is all the device needs.
///
/// | bytes | field |
/// | --- | --- |
/// | 4 | magic `OFD1` |
/// | 4 | segments `s` |
/// | 8 | length of the original bytes |
/// | 32 × s | per segment: `out_at`, `enc_at`, `enc_len`, `table_at` (0 for a raw string), `u64` each |
/// | … | each string at a multiple of 256, zero-padded to whole 32-bit words; each coded string's table at a multiple of 256 |
pub fn code_for_device(raw: &[u8], segment_bytes: usize, threads: usize) -> Vec<u8> {
    code_for_device_with(raw, segment_bytes, threads, DeviceCodes::default())
}

/// The codes a device's decoder reads besides bf16's ([`Code`]): a device block
/// holds no other. The CPU reference ([`decode_device_block`]) and the simulated
/// device read fp8 e4m3's; offload-cuda's kernels read it with its
/// `CodingOptions::fp8_code` (on by default) and refuse a block holding it otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCodes {
    /// Segments may be coded as fp8 e4m3 ([`encode_fp8_e4m3`]) where that is shorter.
    pub fp8_e4m3: bool,
}

/// [`code_for_device`], each segment coded with whichever of the codes `codes`
/// allows (bf16's always) is shortest, or raw where none is shorter.
pub fn code_for_device_with(raw: &[u8], segment_bytes: usize, threads: usize, codes: DeviceCodes) -> Vec<u8> {
    let seg = (segment_bytes.min(1 << 30) / 4 * 4).max(4);
    // A coded string also carries its table (and alignment): worth it only below
    // the raw string's size.
    let encode = |p: &[u8]| {
        let mut e = encode_bf16(p);
        // bf16 weights code to ≈ 0.67 under bf16's code, and fp8's cannot beat that
        // on them: fp8's is tried only where bf16's left more than 0.8 of the bytes.
        if codes.fp8_e4m3 && e.len() * 5 > p.len() * 4 {
            let f = encode_fp8_e4m3(p);
            if f.len() < e.len() {
                e = f;
            }
        }
        match e[4] != 0 && e.len().next_multiple_of(4) + (2 << MAX_CODE_BITS) + DEVICE_ALIGN >= HEADER + p.len() {
            true => encode_raw(p),
            false => e,
        }
    };
    let encode = &encode;
    let pieces: Vec<&[u8]> = raw.chunks(seg).collect();
    let threads = threads.clamp(1, pieces.len().max(1));
    let mut strings: Vec<Vec<u8>> = vec![Vec::new(); pieces.len()];
    std::thread::scope(|scope| {
        let per = pieces.len().div_ceil(threads);
        let handles: Vec<_> = pieces
            .chunks(per.max(1))
            .enumerate()
            .map(|(t, group)| scope.spawn(move || (t * per, group.iter().map(|p| encode(p)).collect::<Vec<_>>())))
            .collect();
        for h in handles {
            // An encoder thread that panicked takes the caller down with it.
            let (first, encoded) = h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (i, e) in encoded.into_iter().enumerate() {
                strings[first + i] = e;
            }
        }
    });
    let mut out = Vec::new();
    out.extend_from_slice(DEVICE_MAGIC);
    out.extend_from_slice(&(pieces.len() as u32).to_le_bytes());
    out.extend_from_slice(&(raw.len() as u64).to_le_bytes());
    let desc_at = out.len();
    out.resize(desc_at + DEVICE_DESC * pieces.len(), 0);
    for (i, enc) in strings.iter().enumerate() {
        out.resize(out.len().next_multiple_of(DEVICE_ALIGN), 0);
        let enc_at = out.len();
        out.extend_from_slice(enc);
        out.resize(out.len().next_multiple_of(4), 0);
        let enc_len = out.len() - enc_at;
        let table_at = if enc[4] != 0 {
            // The table a coded string decodes with (its own, checked to build).
            let len = decoded_len(enc, "segment").unwrap_or(0);
            let table = coded_layout(enc, len, "segment").map(|l| l.table).unwrap_or_default();
            out.resize(out.len().next_multiple_of(DEVICE_ALIGN), 0);
            let at = out.len();
            out.extend(table.iter().flat_map(|e| e.to_le_bytes()));
            at
        } else {
            0
        };
        let d = desc_at + DEVICE_DESC * i;
        for (k, v) in [i * seg, enc_at, enc_len, table_at].into_iter().enumerate() {
            out[d + 8 * k..d + 8 * k + 8].copy_from_slice(&(v as u64).to_le_bytes());
        }
    }
    out
}

/// The original length and the segments of a device block ([`code_for_device`]),
/// every structural check made: segments in order, tiling the block, each output
/// 4-aligned, each string inside the bytes at a multiple of 256 and whole words
/// long, of the segment's length, and each coded string's layout and stored
/// table as its header says. What a device decoder launches from; `what` names
/// the block in errors.
pub fn device_segments(coded: &[u8], what: &str) -> Result<(usize, Vec<DeviceSegment>)> {
    if coded.get(..4) != Some(DEVICE_MAGIC.as_slice()) {
        return Err(damaged(what, "no OFD1 magic"));
    }
    let s = u32_at(coded, 4, what)? as usize;
    let len = usize::try_from(u64_at(coded, 8, what)?).map_err(|_| damaged(what, "length does not fit this machine"))?;
    if s.checked_mul(DEVICE_DESC).and_then(|d| d.checked_add(DEVICE_HEADER)).is_none_or(|end| end > coded.len()) {
        return Err(damaged(what, format!("{s} segments do not fit {} bytes", coded.len())));
    }
    let field = |i: usize, k: usize| -> Result<usize> {
        usize::try_from(u64_at(coded, DEVICE_HEADER + DEVICE_DESC * i + 8 * k, what)?).map_err(|_| damaged(what, "offset too large"))
    };
    let mut segs = Vec::with_capacity(s);
    let mut at = 0usize;
    for i in 0..s {
        let w = format!("{what}, segment {i}");
        let (out_at, enc_at, enc_len, table_at) = (field(i, 0)?, field(i, 1)?, field(i, 2)?, field(i, 3)?);
        if out_at != at || out_at % 4 != 0 {
            return Err(damaged(&w, format!("output at byte {out_at}, {at} expected (a multiple of 4)")));
        }
        if enc_at % DEVICE_ALIGN != 0 || enc_len % 4 != 0 || enc_at.checked_add(enc_len).is_none_or(|e| e > coded.len()) {
            return Err(damaged(&w, format!("string of {enc_len} bytes at {enc_at}: misaligned or outside the block")));
        }
        let enc = &coded[enc_at..enc_at + enc_len];
        let out_len = decoded_len(enc, &w)?;
        let coded_part = match enc.get(4) {
            Some(0) => {
                if table_at != 0 || HEADER.checked_add(out_len).is_none_or(|e| e > enc_len) {
                    return Err(damaged(&w, "a raw string with a table, or shorter than its length"));
                }
                None
            }
            Some(1 | 2) => {
                // The layout of the unpadded string: its sign-mantissa bytes end it.
                let l = coded_layout(&enc[..enc_len.min(unpadded_len(enc, out_len, &w)?)], out_len, &w)?;
                let tbytes = 2 << MAX_CODE_BITS;
                let stored = table_at
                    .checked_add(tbytes)
                    .filter(|&e| table_at % DEVICE_ALIGN == 0 && table_at != 0 && e <= coded.len())
                    .map(|e| &coded[table_at..e])
                    .ok_or_else(|| damaged(&w, "its table is misaligned or outside the block"))?;
                if stored.chunks_exact(2).zip(&l.table).any(|(b, &t)| u16::from_le_bytes([b[0], b[1]]) != t) {
                    return Err(damaged(&w, "its stored table is not its code's"));
                }
                Some((table_at, l))
            }
            _ => return Err(damaged(&w, "unknown mode")),
        };
        at = out_at.checked_add(out_len).ok_or_else(|| damaged(&w, "length overflows"))?;
        segs.push(DeviceSegment { out_at, out_len, enc_at, enc_len, coded: coded_part });
    }
    if at != len {
        return Err(damaged(what, format!("segments cover {at} of {len} bytes")));
    }
    Ok((len, segs))
}

/// Whether the device block `coded` ([`code_for_device`]) was made from `raw`:
/// its structure checked ([`device_segments`]), its length `raw`'s, and each
/// segment's stored hash of its original bytes equal to the hash of that range
/// of `raw` (computed on up to `threads` host threads). What binds coded bytes
/// made ahead of time to the weights they stand for; it does not check the
/// coded bytes decode to their hash (the CPU decoder does,
/// [`decode_device_block`]). `what` names the block in errors.
pub fn coded_matches(coded: &[u8], raw: &[u8], threads: usize, what: &str) -> Result<()> {
    let (len, segs) = device_segments(coded, what)?;
    if len != raw.len() {
        return Err(damaged(what, format!("coded from {len} bytes, {} given", raw.len())));
    }
    let stored: Vec<u64> = segs.iter().map(|sg| u64_at(coded, sg.enc_at + 16, what)).collect::<Result<_>>()?;
    let threads = threads.clamp(1, segs.len().max(1));
    let per = segs.len().div_ceil(threads).max(1);
    let mismatch = std::thread::scope(|scope| {
        let handles: Vec<_> = segs
            .chunks(per)
            .zip(stored.chunks(per))
            .enumerate()
            .map(|(t, (group, want))| {
                scope.spawn(move || {
                    group.iter().zip(want).position(|(sg, &h)| hash64(&raw[sg.out_at..sg.out_at + sg.out_len]) != h).map(|i| t * per + i)
                })
            })
            .collect();
        // A hashing thread that panicked takes the caller down with it.
        handles.into_iter().filter_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).min()
    });
    match mismatch {
        Some(i) => Err(damaged(
            what,
            format!("segment {i} (bytes {} to {}) was coded from other bytes than these", segs[i].out_at, segs[i].out_at + segs[i].out_len),
        )),
        None => Ok(()),
    }
}

/// A coded string's length without the word padding of a device block: its
/// layout ends with its sign-mantissa bytes (one per bf16 value, one per two fp8
/// values).
fn unpadded_len(enc: &[u8], out_len: usize, what: &str) -> Result<usize> {
    let code = enc.get(4).and_then(|&m| Code::of_mode(m)).ok_or_else(|| damaged(what, "not a coded string"))?;
    let chunks = u32_at(enc, HEADER + 256, what)? as usize;
    let offsets_at = HEADER + 260;
    let stream_len = u32_at(enc, offsets_at + 4 * chunks, what)? as usize;
    Ok(offsets_at + 4 * (chunks + 1) + stream_len + code.residual_len(out_len / code.width()))
}

/// Decode a device block ([`code_for_device`]) into `out` (its original length)
/// on the CPU: the reference for a device decoder, each segment checked by
/// [`decode_bf16_into`] (its hash included).
pub fn decode_device_block(coded: &[u8], out: &mut [u8], what: &str) -> Result<()> {
    decode_device_block_on(coded, out, 1, what)
}

/// [`decode_device_block`] with its segments decoded on up to `threads` host
/// threads (the first failing segment's error).
pub fn decode_device_block_on(coded: &[u8], out: &mut [u8], threads: usize, what: &str) -> Result<()> {
    let (len, segs) = device_segments(coded, what)?;
    if out.len() != len {
        return Err(damaged(what, format!("{len} bytes coded, {} given", out.len())));
    }
    // The segments tile `out` in order (checked by `device_segments`): one slice each.
    let mut jobs: Vec<(usize, &DeviceSegment, &mut [u8])> = Vec::with_capacity(segs.len());
    let mut rest = out;
    for (i, sg) in segs.iter().enumerate() {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(sg.out_len);
        jobs.push((i, sg, mine));
        rest = tail;
    }
    let decode = |(i, sg, dst): (usize, &DeviceSegment, &mut [u8])| -> Result<()> {
        let enc = &coded[sg.enc_at..sg.enc_at + sg.enc_len];
        let enc = match &sg.coded {
            Some(_) => enc.get(..unpadded_len(enc, sg.out_len, what)?).ok_or_else(|| damaged(what, "a string shorter than its layout"))?,
            None => &enc[..HEADER + sg.out_len],
        };
        decode_bf16_into(enc, dst, &format!("{what}, segment {i}"))
    };
    let per = jobs.len().div_ceil(threads.clamp(1, jobs.len().max(1))).max(1);
    let mut groups: Vec<Vec<(usize, &DeviceSegment, &mut [u8])>> = Vec::new();
    while !jobs.is_empty() {
        let tail = jobs.split_off(per.min(jobs.len()));
        groups.push(std::mem::replace(&mut jobs, tail));
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups.into_iter().map(|g| scope.spawn(move || g.into_iter().try_for_each(decode))).collect();
        // A decoding thread that panicked takes the caller down with it; the
        // first group's error first.
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect::<Result<Vec<()>>>().map(|_| ())
    })
}

/// Swap, in the first coded segment of the device block `coded` that has one,
/// the codes of two neighbouring values whose codes differ but are of equal
/// length: the string still parses and every chunk still uses its bits (what a
/// device decoder checks), but two exponents trade places. Whether one was found.
/// For tests of what catches coded bytes altered that way.
#[doc(hidden)]
pub fn swap_equal_length_codes(coded: &mut [u8]) -> bool {
    let Ok((_, segs)) = device_segments(coded, "swap") else { return false };
    for sg in segs {
        let Some((_, l)) = &sg.coded else { continue };
        let enc_at = sg.enc_at;
        let from = u32::from_le_bytes(coded[enc_at + l.offsets_at..enc_at + l.offsets_at + 4].try_into().unwrap_or_default()) as usize;
        let stream = enc_at + l.stream_at + from;
        let bit = |c: &[u8], p: usize| (c[stream + p / 8] >> (7 - p % 8)) & 1;
        // Walk chunk 0's codes: (bit position, length, code bits) of each value.
        let values = CHUNK_VALUES.min(l.values);
        let mut at = 0usize;
        let mut prev: Option<(usize, u32, u32)> = None;
        for _ in 0..values {
            let mut window = 0usize;
            for k in 0..MAX_CODE_BITS as usize {
                let p = at + k;
                let b = if stream + p / 8 < coded.len() { bit(coded, p) } else { 0 };
                window = window << 1 | b as usize;
            }
            let len = u32::from(l.table[window] >> 8);
            if len == 0 {
                return false;
            }
            let code = (window >> (MAX_CODE_BITS - len)) as u32;
            if let Some((p0, l0, c0)) = prev {
                if l0 == len && c0 != code {
                    // Write `code` at p0 and `c0` at `at`, `len` bits each.
                    for (pos, val) in [(p0, code), (at, c0)] {
                        for k in 0..len as usize {
                            let b = (val >> (len as usize - 1 - k)) & 1;
                            let p = pos + k;
                            let byte = &mut coded[stream + p / 8];
                            *byte = (*byte & !(1 << (7 - p % 8))) | ((b as u8) << (7 - p % 8));
                        }
                    }
                    return true;
                }
            }
            prev = Some((at, len, code));
            at += len as usize;
        }
    }
    false
}

#[cfg(test)]
mod tests;
