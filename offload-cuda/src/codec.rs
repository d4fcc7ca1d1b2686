//! The GPU decoder of [`offload_core::codec`]'s coding (bf16's code; fp8 e4m3's
//! in the same loop, a launch's `code` choosing the write, with
//! [`crate::CodingOptions::fp8_code`]): one thread per
//! chunk of [`CHUNK_VALUES`] exponents reads its own bit stream through the
//! lookup table (in shared memory) — the CPU reference decoder's loop, on the
//! device — 32 exponents at a time into a shared tile, from which its warp
//! writes each value's bits (bf16: exponent and sign-mantissa byte; fp8: exponent
//! field and sign-mantissa nibble) with coalesced stores. Structural damage (no code matching the next bits, a chunk whose codes
//! do not fill its bytes) raises a flag the host reads back; the CPU decoder's
//! hash of the decoded bytes has no parallel form and is not checked here.
//!
//! The ring runs it through [`crate::coded`]; [`crate::decoder`] runs it on
//! its own.

use cudarc::nvrtc;
use offload_core::codec::Code;
use std::sync::OnceLock;

const KERNELS: &str = r#"
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define CHUNK 1024
#define BITS 12
#define TILE 64
#define ROW (TILE + 4)
#define WARPS 4
// Builds the speed example times (`DecoderVariant`, set by -D options; the ring's
// is `DecoderVariant::RING`). PREFETCH: the next stream word is loaded one refill
// ahead, so a refill does not wait for its load. ROWS: the write loop's rows
// whose sign-mantissa loads are in flight before their stores (divides 32).
#ifndef PREFETCH
#define PREFETCH 0
#endif
#ifndef ROWS
#define ROWS 4
#endif
// EARLY: a tile's 32 rows of sign-mantissa bytes are loaded before its exponents
// are decoded, so the loads' latency hides behind the decode.
#ifndef EARLY
#define EARLY 0
#endif
// PIPE: the write loop's next ROWS rows of sign-mantissa bytes are loaded while
// the current ones are written, and a tile's first rows before its exponents are
// decoded (the previous tile's last group loads them).
#ifndef PIPE
#define PIPE 0
#endif
// GROUP: exponents decoded GROUP at a time; a lane's window is topped up to more
// than 32 bits only at a group's start (from a word loaded at its previous top-up),
// so the lanes' loads are issued together and each waits once a group at most,
// not at nearly every value (a warp waits on a register's load whichever lane
// issued it). A top-up inside a group only where a run of long codes needs one.
#ifndef GROUP
#define GROUP 0
#endif
// One thread per chunk, 32 chunks per warp, WARPS warps per block (the launch's
// 128 threads). In tiles of 64 values: each lane decodes the next 64 exponents of
// its own chunk into its row of a shared tile (serial: a chunk is one bit
// stream), then the warp writes the tile chunk by chunk, lane l taking values 2l
// and 2l + 1, so the sign-mantissa reads (64 bytes a row) and the output writes
// (one 128-byte line a row, 4-byte stores) are coalesced; the rows' loads are
// issued ROWS at a time before their stores. fp8 (`code` 2): lane l reads one
// byte of nibbles for values 2l and 2l + 1 (32 bytes a row) and writes them with
// one 2-byte store (64 bytes a row); the PIPE and EARLY loads are bf16's only.
// A lane refills its bit window 32 bits at a time from aligned words of the
// stream (the stream starts 4-aligned in `enc`, and the upload pads `enc` to
// whole words), bytes outside its chunk's [from, to) read as 0.
// `offsets` (at offsets_at in enc) holds chunks + 1 byte offsets into the stream;
// `table` maps the next BITS bits to exponent | length << 8; on damage `err`
// gets tag << 2 | 1 (no code matches) or tag << 2 | 2 (a chunk's codes do not fill
// its bytes) — a plain store, since `err` may be host memory mapped for the
// device (where atomics need not be atomic); any damage leaves it non-zero.
// A word's bytes before `from` (the first word's) sit above the window and are
// never looked at; bytes from `to` on read as 0, as the CPU decoder reads them.
// Split in two so that a load can be issued a refill before its bytes are used:
// `word_raw` loads word i as stored (0 past `to`, with no load), `word_fix` puts
// its first byte on top and zeroes its bytes from `to` on.
__device__ __forceinline__ u32 word_raw(const u32* __restrict__ words, u32 i, u32 to) {
    return (i << 2) < to ? __ldg(words + i) : 0;
}
__device__ __forceinline__ u32 word_fix(u32 raw, u32 i, u32 to) {
    u32 start = i << 2;
    if (start >= to) return 0;
    // Big-endian: the stream's first byte in the top bits.
    u32 w = __byte_perm(raw, 0, 0x0123);
    if (to - start < 4) w &= ~(0xffffffffu >> (8 * (to - start)));
    return w;
}
__device__ __forceinline__ u32 word_be(const u32* __restrict__ words, u32 i, u32 to) {
    return word_fix(word_raw(words, i, to), i, to);
}

// Rows rbase .. rbase + ROWS of a warp's tile: each lane's two sign-mantissa
// bytes at values k and k + 1 of chunk first + row (0 past the chunk's values).
__device__ __forceinline__ void load_rows(u32 (&dst)[ROWS], const u8* __restrict__ sm, u32 first, u32 chunks, u64 n, u32 k, u32 rbase) {
#pragma unroll
    for (u32 q = 0; q < ROWS; ++q) {
        u32 cc = first + rbase + q;
        u64 b = (u64)cc * CHUNK;
        u32 v = cc < chunks ? (n - b < CHUNK ? (u32)(n - b) : CHUNK) : 0;
        u32 lo = k < v ? __ldg(sm + b + k) : 0;
        u32 hi = k + 1 < v ? __ldg(sm + b + k + 1) : 0;
        dst[q] = lo | hi << 8;
    }
}

// The chunks of one coded string, `bid` the launch block among its blocks.
// `code`: 1 bf16 (out holds n u16s, sm one byte a value), 2 fp8 e4m3 (out holds
// n bytes, sm one byte per two values: value 2i's sign-mantissa nibble low, 2i + 1's
// high); uniform across a launch, so the branches on it do not diverge.
__device__ __forceinline__ void decode_chunks(const u8* __restrict__ enc, u64 stream_at, u64 offsets_at, u32 chunks, u64 sm_at,
                                              u64 n, const u16* __restrict__ table, u16* __restrict__ out, volatile u32* err,
                                              u32 tag, u32 bid, u32 code) {
    const bool fp8 = code == 2;
    const u32* words = (const u32*)(enc + stream_at);
    const u32* offsets = (const u32*)(enc + offsets_at);
    const u8* sm = enc + sm_at;
    __shared__ u16 t[1 << BITS];
    // One byte per exponent, rows of ROW bytes (17 words: lane l's byte j and
    // lane l's pair of row r fall in different banks across the warp).
    __shared__ u8 tile[WARPS][32 * ROW];
    for (u32 i = threadIdx.x; i < (1u << BITS); i += blockDim.x) t[i] = table[i];
    __syncthreads();
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 first = bid * blockDim.x + warp * 32;
    u32 c = first + lane;
    bool have = c < chunks;
    u32 from = have ? offsets[c] : 0, to = have ? offsets[c + 1] : 0;
    u64 base = (u64)c * CHUNK;
    u32 values = have ? (n - base < CHUNK ? (u32)(n - base) : CHUNK) : 0;
    u32 next = from >> 2;
    u64 acc = word_be(words, next++, to);
#if PREFETCH || GROUP
    // Word `next`, as loaded: fixed only at the refill that uses it, so the
    // load's latency passes while the lane decodes (past `to` nothing is loaded).
    u32 ahead = word_raw(words, next, to);
#endif
    u32 bits = 32 - 8 * (from & 3), used = 0;
    bool bad = false;
    u8* e = tile[warp];
#if PIPE
    u32 pipe[ROWS];
    if (!fp8) load_rows(pipe, sm, first, chunks, n, 2 * lane, 0);
#endif
    for (u32 k0 = 0; k0 < CHUNK; k0 += TILE) {
#if EARLY
        u32 early[32];
        if (!fp8) {
#pragma unroll
            for (u32 q = 0; q < 32; ++q) {
                u32 cc = first + q, k = k0 + 2 * lane;
                u64 b = (u64)cc * CHUNK;
                u32 v = cc < chunks ? (n - b < CHUNK ? (u32)(n - b) : CHUNK) : 0;
                u32 lo = k < v ? __ldg(sm + b + k) : 0;
                u32 hi = k + 1 < v ? __ldg(sm + b + k + 1) : 0;
                early[q] = lo | hi << 8;
            }
        }
#endif
#if GROUP
        for (u32 j0 = 0; j0 < TILE && !bad && k0 + j0 < values; j0 += GROUP) {
            if (bits <= 32) {
                acc = (acc << 32) | word_fix(ahead, next, to);
                ahead = word_raw(words, ++next, to);
                bits += 32;
            }
#pragma unroll
            for (u32 jj = 0; jj < GROUP; ++jj) {
                u32 j = j0 + jj;
                if (k0 + j >= values) break;
                if (bits < BITS) {
                    acc = (acc << 32) | word_fix(ahead, next, to);
                    ahead = word_raw(words, ++next, to);
                    bits += 32;
                }
                u16 x = t[(u32)(acc >> (bits - BITS)) & ((1u << BITS) - 1)];
                u32 len = x >> 8;
                if (len == 0) { bad = true; *err = tag << 2 | 1u; break; }
                bits -= len;
                used += len;
                e[lane * ROW + j] = (u8)x;
            }
        }
#else
        for (u32 j = 0; j < TILE && !bad && k0 + j < values; ++j) {
            if (bits < BITS) {
#if PREFETCH
                acc = (acc << 32) | word_fix(ahead, next, to);
                ahead = word_raw(words, ++next, to);
#else
                acc = (acc << 32) | word_be(words, next++, to);
#endif
                bits += 32;
            }
            u16 x = t[(u32)(acc >> (bits - BITS)) & ((1u << BITS) - 1)];
            u32 len = x >> 8;
            if (len == 0) { bad = true; *err = tag << 2 | 1u; break; }
            bits -= len;
            used += len;
            e[lane * ROW + j] = (u8)x;
        }
#endif
        __syncwarp();
        u32 k = k0 + 2 * lane;
#if EARLY
#pragma unroll
#endif
        for (u32 r0 = 0; r0 < 32; r0 += ROWS) {
            u32 s[ROWS], vals[ROWS];
#pragma unroll
            for (u32 q = 0; q < ROWS; ++q) {
                u32 cc = first + r0 + q;
                u64 b = (u64)cc * CHUNK;
                vals[q] = cc < chunks ? (n - b < CHUNK ? (u32)(n - b) : CHUNK) : 0;
                if (fp8) {
                    // Values k and k + 1 (k even, b even): the nibbles of one byte.
                    s[q] = k < vals[q] ? __ldg(sm + ((b + k) >> 1)) : 0;
                    continue;
                }
#if PIPE
                s[q] = pipe[q];
#elif EARLY
                s[q] = early[r0 + q];
#else
                u32 lo = k < vals[q] ? __ldg(sm + b + k) : 0;
                u32 hi = k + 1 < vals[q] ? __ldg(sm + b + k + 1) : 0;
                s[q] = lo | hi << 8;
#endif
            }
#if PIPE
            // The next group's rows, or the next tile's first rows after the last group.
            if (!fp8) {
                if (r0 + ROWS < 32) load_rows(pipe, sm, first, chunks, n, k, r0 + ROWS);
                else load_rows(pipe, sm, first, chunks, n, k + TILE, 0);
            }
#endif
#pragma unroll
            for (u32 q = 0; q < ROWS; ++q) {
                if (k >= vals[q]) continue;
                u32 r = r0 + q;
                u64 b = (u64)(first + r) * CHUNK;
                u32 ex = e[r * ROW + 2 * lane], ey = e[r * ROW + 2 * lane + 1];
                if (fp8) {
                    u8* o = (u8*)out;
                    u32 lo = ((s[q] & 0x08) << 4) | (ex << 3) | (s[q] & 0x07);
                    if (k + 1 < vals[q]) {
                        u32 sh = s[q] >> 4;
                        u32 hi = ((sh & 0x08) << 4) | (ey << 3) | (sh & 0x07);
                        // b + k is even and `out` 4-aligned: a 2-byte store.
                        *(u16*)(o + b + k) = (u16)(lo | hi << 8);
                    } else {
                        o[b + k] = (u8)lo;
                    }
                    continue;
                }
                u32 lo = ((s[q] & 0x80) << 8) | (ex << 7) | (s[q] & 0x7f);
                if (k + 1 < vals[q]) {
                    u32 sh = s[q] >> 8;
                    u32 hi = ((sh & 0x80) << 8) | (ey << 7) | (sh & 0x7f);
                    // b + k is even and `out` 4-aligned: a 4-byte store.
                    *(u32*)(out + b + k) = lo | hi << 16;
                } else {
                    out[b + k] = (u16)lo;
                }
            }
        }
        __syncwarp();
    }
    if (have && !bad && (used + 7) / 8 != to - from) *err = tag << 2 | 2u;
}

extern "C" __global__ void exp_decode(const u8* __restrict__ enc, u64 stream_at, u64 offsets_at, u32 chunks, u64 sm_at, u64 n,
                                      const u16* __restrict__ table, u16* __restrict__ out, volatile u32* err, u32 tag) {
    decode_chunks(enc, stream_at, offsets_at, chunks, sm_at, n, table, out, err, tag, blockIdx.x, 1);
}

// Up to SEGS coded strings of one block in one launch (a block's strings are
// 32 MiB each by default: one launch apiece would leave most of the GPU idle).
// A string's launch blocks are [first_block, next string's first_block); its
// stream, offsets, sign-mantissa bytes and table sit at byte offsets from
// `staging` + enc_at (the table at staging + table_at), its output at out + out_at bytes.
#define SEGS 32
struct Seg { u64 enc_at, stream_at, offsets_at, sm_at, n, table_at, out_at; u32 chunks, first_block; };
// `code`: every string of a launch is in one code (1 bf16, 2 fp8 e4m3; `launches`).
struct Segs { u32 count, code; Seg s[SEGS]; };
static_assert(sizeof(Seg) == 64 && sizeof(Segs) == 8 + 64 * SEGS, "Seg and Segs as the Rust side lays them out");
// The checking mode's check of one decoded segment: `offload_core::codec::hash64`
// of its `len` bytes at `out` (one thread, in order: the hash is a chain), against
// the hash its string stores of the bytes it was made from (8 little-endian bytes
// at `stored`). A mismatch writes `tag << 2 | 3` to the damage flag.
extern "C" __global__ void seg_verify(const u8* __restrict__ out, u64 len, const u8* __restrict__ stored, volatile u32* err, u32 tag) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const u64 K = 0x9E3779B97F4A7C15ull;
    u64 h = 0xcbf29ce484222325ull ^ (len * K);
    u64 full = len / 8 * 8, i = 0;
    for (; i < full; i += 8) {
        u64 w = 0;
        for (int k = 0; k < 8; k++) w |= ((u64)out[i + k]) << (8 * k);
        h = (h ^ w) * K;
        h ^= h >> 29;
    }
    u64 w = 0;
    for (int k = 0; i + k < len; k++) w |= ((u64)out[i + k]) << (8 * k);
    h = (h ^ w) * K;
    h ^= h >> 32;
    u64 want = 0;
    for (int k = 0; k < 8; k++) want |= ((u64)stored[k]) << (8 * k);
    if (h != want) *err = tag << 2 | 3u;
}
extern "C" __global__ void exp_decode_segs(const u8* __restrict__ staging, u8* __restrict__ out, const Segs segs, volatile u32* err,
                                           u32 tag) {
    u32 i = 0;
    while (i + 1 < segs.count && blockIdx.x >= segs.s[i + 1].first_block) ++i;
    const Seg g = segs.s[i];
    decode_chunks(staging + g.enc_at, g.stream_at, g.offsets_at, g.chunks, g.sm_at, g.n, (const u16*)(staging + g.table_at),
                  (u16*)(out + g.out_at), err, tag, blockIdx.x - g.first_block, segs.code);
}
"#;

/// Coded strings decoded by one `exp_decode_segs` launch (its `SEGS`).
pub(crate) const SEGS: usize = 32;

/// One coded string of a launch: `struct Seg` of the kernels' source, byte for byte.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Seg {
    pub enc_at: u64,
    pub stream_at: u64,
    pub offsets_at: u64,
    pub sm_at: u64,
    pub n: u64,
    pub table_at: u64,
    pub out_at: u64,
    pub chunks: u32,
    pub first_block: u32,
}

const _: () = assert!(
    std::mem::size_of::<Seg>() == 64
        && std::mem::align_of::<Seg>() == 8
        && std::mem::offset_of!(Seg, chunks) == 56
        && std::mem::size_of::<Segs>() == 8 + 64 * SEGS
        && std::mem::offset_of!(Segs, s) == 8
);

/// Threads (chunks) per launch block of the decoders.
pub(crate) const BLOCK_THREADS: u32 = 128;

/// The `exp_decode_segs` launches that decode a block's coded strings (raw strings
/// and empty ones are not in them): up to [`SEGS`] strings each, all of one code
/// (a string in another code starts a new launch), in order, with each string's
/// first launch block and the launch's block count.
pub(crate) fn launches(segments: &[offload_core::codec::DeviceSegment]) -> Vec<(Segs, u32)> {
    let code_of = |c: Code| match c {
        Code::Bf16 => 1u32,
        Code::Fp8E4M3 => 2,
    };
    let mut out = Vec::new();
    let mut batch = Segs { count: 0, code: 1, s: [Seg::default(); SEGS] };
    let mut blocks = 0u32;
    for sg in segments {
        let Some((table_at, l)) = &sg.coded else { continue };
        if l.values == 0 {
            continue;
        }
        if batch.count > 0 && batch.code != code_of(l.code) {
            out.push((batch, blocks));
            batch.count = 0;
            blocks = 0;
        }
        batch.code = code_of(l.code);
        batch.s[batch.count as usize] = Seg {
            enc_at: sg.enc_at as u64,
            stream_at: l.stream_at as u64,
            offsets_at: l.offsets_at as u64,
            sm_at: l.sm_at as u64,
            n: l.values as u64,
            table_at: *table_at as u64,
            out_at: sg.out_at as u64,
            chunks: l.chunks as u32,
            first_block: blocks,
        };
        batch.count += 1;
        blocks += (l.chunks as u32).div_ceil(BLOCK_THREADS);
        if batch.count as usize == SEGS {
            out.push((batch, blocks));
            batch.count = 0;
            blocks = 0;
        }
    }
    if batch.count > 0 {
        out.push((batch, blocks));
    }
    out
}

/// The strings of one launch: `struct Segs` of the kernels' source, byte for byte
/// (passed by value: 8 + 64 · SEGS = 2056 bytes, inside the 4 KiB of a launch's parameters).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Segs {
    pub count: u32,
    /// The launch's code: 1 bf16, 2 fp8 e4m3.
    pub code: u32,
    pub s: [Seg; SEGS],
}

// SAFETY: plain old data laid out as the kernel's `struct Segs` (repr(C), u64 and u32
// fields only, no padding the kernel reads); passed by value as a kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for Segs {}

/// One build of the decoder's kernel (its `PREFETCH`, `ROWS`, `EARLY`, `PIPE` and
/// `GROUP` macros): what the speed example times side by side. The ring and
/// [`ExponentDecoder::new`] use [`DecoderVariant::RING`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecoderVariant {
    /// Load the next stream word one refill ahead of its use.
    pub prefetch: bool,
    /// Rows of the write loop whose sign-mantissa loads are issued before their
    /// stores: 1, 2, 4, 8, 16 or 32.
    pub rows: u32,
    /// Load a tile's sign-mantissa bytes before decoding its exponents (`rows`
    /// then only groups the stores).
    pub early: bool,
    /// Load the write loop's next group of rows while writing the current one
    /// (and a tile's first group before its exponents are decoded).
    pub pipe: bool,
    /// Exponents decoded this many at a time, the lanes' windows topped up at
    /// each group's start (0: at any value, as a lane needs it). Divides 64.
    pub group: u32,
}

impl DecoderVariant {
    /// The build the ring uses.
    /// Exponents decoded 8 at a time (`group8-rows4`): 1.47 × the first build's
    /// speed at 256 MiB on the H200 (`bench/NOTES.md`).
    pub const RING: DecoderVariant = DecoderVariant { group: 8, ..DecoderVariant::FIRST };

    /// The build the ring used before grouped refills (`rows4`).
    pub const FIRST: DecoderVariant = DecoderVariant { prefetch: false, rows: 4, early: false, pipe: false, group: 0 };

    /// The builds the speed example times (`codec_speed --variants`).
    pub const TIMED: [DecoderVariant; 7] = [
        DecoderVariant::FIRST,
        DecoderVariant { group: 4, ..DecoderVariant::FIRST },
        DecoderVariant::RING,
        DecoderVariant { group: 16, ..DecoderVariant::FIRST },
        DecoderVariant { group: 32, ..DecoderVariant::FIRST },
        DecoderVariant { group: 8, rows: 8, ..DecoderVariant::FIRST },
        DecoderVariant { group: 8, rows: 2, ..DecoderVariant::FIRST },
    ];

    /// A short name: `prefetch-pipe-rows4`, `rows8`.
    pub fn name(&self) -> String {
        let flag = |on: bool, name: &str| if on { format!("{name}-") } else { String::new() };
        let group = if self.group > 0 { format!("group{}-", self.group) } else { String::new() };
        format!("{}{}{}{group}rows{}", flag(self.prefetch, "prefetch"), flag(self.early, "early"), flag(self.pipe, "pipe"), self.rows)
    }

    fn options(&self) -> std::result::Result<Vec<String>, String> {
        if !self.rows.is_power_of_two() || self.rows > 32 {
            return Err(format!("decoder variant {}: rows must divide 32", self.name()));
        }
        if self.group > 0 && (!self.group.is_power_of_two() || self.group > 64) {
            return Err(format!("decoder variant {}: group must divide 64", self.name()));
        }
        Ok(vec![
            format!("-DPREFETCH={}", u32::from(self.prefetch)),
            format!("-DROWS={}", self.rows),
            format!("-DEARLY={}", u32::from(self.early)),
            format!("-DPIPE={}", u32::from(self.pipe)),
            format!("-DGROUP={}", self.group),
        ])
    }

    pub(crate) fn compile(&self) -> std::result::Result<nvrtc::Ptx, String> {
        let options = self.options()?;
        nvrtc::compile_ptx_with_opts(KERNELS, nvrtc::CompileOptions { options, ..Default::default() })
            .map_err(|e| format!("NVRTC ({}): {e}", self.name()))
    }
}

pub(crate) fn ptx() -> std::result::Result<&'static nvrtc::Ptx, String> {
    static PTX: OnceLock<std::result::Result<nvrtc::Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| DecoderVariant::RING.compile()).as_ref().map_err(Clone::clone)
}

/// Normal values of standard deviation `sd` as bf16 bytes (Box–Muller over an
/// LCG from `seed`): sample weights for the decoder's speed example and tests.
pub fn sample_normal_bf16(n: usize, sd: f32, seed: u64) -> Vec<u8> {
    let mut x = seed;
    let mut u = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .flat_map(|_| {
            let v = ((-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos()) as f32 * sd;
            ((v.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {

    /// The batching of strings into launches, and the kernel's lookup of a launch
    /// block's string (mirrored here), on the CPU: every chunk of every coded
    /// string decoded by exactly one thread of one launch, raw and empty strings
    /// in none, no launch over SEGS strings.
    #[test]
    fn launches_cover_every_coded_chunk_once() {
        use offload_core::codec::{Code, CodedLayout, DeviceSegment};
        let seg = |i: usize, values: usize| DeviceSegment {
            out_at: i * 1000,
            out_len: 2 * values,
            enc_at: i * 256,
            enc_len: 0,
            coded: (i % 5 != 3).then(|| {
                let chunks = values.div_ceil(CHUNK_VALUES);
                (i * 512, CodedLayout { code: Code::Bf16, values, chunks, offsets_at: 8, stream_at: 16, sm_at: 24, table: Vec::new() })
            }),
        };
        // 75 strings: every fifth raw, one empty, sizes from one chunk to 300.
        let segments: Vec<DeviceSegment> =
            (0..75).map(|i| seg(i, if i == 40 { 0 } else { 1 + (i * 7919) % (300 * CHUNK_VALUES) })).collect();
        let ls = launches(&segments);
        let coded: Vec<&DeviceSegment> = segments.iter().filter(|s| s.coded.as_ref().is_some_and(|(_, l)| l.values > 0)).collect();
        assert_eq!(coded.len(), 59);
        assert_eq!(ls.len(), 2, "59 strings: a launch of {SEGS} and one of the rest");
        assert!(ls.iter().all(|(b, _)| b.code == 1), "bf16 strings: code 1");
        check_launches(&ls, &coded);
        // Strings 20 to 29 coded as fp8: launches split where the code changes,
        // each of one code, still every chunk once.
        let mixed: Vec<DeviceSegment> = segments
            .iter()
            .enumerate()
            .map(|(i, sg)| {
                let mut sg = sg.clone();
                if let Some((_, l)) = sg.coded.as_mut().filter(|_| (20..30).contains(&i)) {
                    l.code = Code::Fp8E4M3;
                }
                sg
            })
            .collect();
        let ls = launches(&mixed);
        let codes: Vec<(u32, u32)> = ls.iter().map(|(b, _)| (b.code, b.count)).collect();
        // 59 coded strings, 16 before string 20 (bf16), 8 of 20..30 (fp8), 35 after (bf16: 32 + 3).
        assert_eq!(codes, [(1, 16), (2, 8), (1, 32), (1, 3)]);
        let coded: Vec<&DeviceSegment> = mixed.iter().filter(|s| s.coded.as_ref().is_some_and(|(_, l)| l.values > 0)).collect();
        check_launches(&ls, &coded);
    }

    /// Every launch's blocks found by the kernel's lookup cover each of its strings'
    /// blocks once, and the launches hold `coded` in order.
    fn check_launches(ls: &[(Segs, u32)], coded: &[&offload_core::codec::DeviceSegment]) {
        let mut seen = Vec::new();
        for (batch, blocks) in ls {
            assert!(batch.count as usize <= SEGS && batch.count > 0);
            let mut hits = vec![0u32; batch.count as usize];
            for bid in 0..*blocks {
                // The kernel's lookup, line for line.
                let mut i = 0;
                while i + 1 < batch.count as usize && bid >= batch.s[i + 1].first_block {
                    i += 1;
                }
                let g = &batch.s[i];
                let local = bid - g.first_block;
                assert!(local < g.chunks.div_ceil(BLOCK_THREADS), "launch block {bid} past string {i}'s blocks");
                hits[i] += 1;
            }
            for (i, h) in hits.iter().enumerate() {
                let g = &batch.s[i];
                assert_eq!(*h, g.chunks.div_ceil(BLOCK_THREADS), "string {i}: each of its blocks once");
                seen.push((g.out_at, g.n));
            }
        }
        let want: Vec<(u64, u64)> = coded.iter().map(|s| (s.out_at as u64, s.coded.as_ref().map_or(0, |(_, l)| l.values as u64))).collect();
        assert_eq!(seen, want, "every coded string, in order, once");
    }
    use super::*;
    use offload_core::codec::{coded_layout, encode_bf16, Code, CHUNK_VALUES, MAX_CODE_BITS};

    /// The decoder compiles with NVRTC (no GPU needed, only libnvrtc).
    #[test]
    fn kernels_compile_with_nvrtc() {
        crate::nvrtc::check::compiles("the exponent decoder", super::KERNELS);
        // The timed builds, and those no list times (their fp8 guards compile too).
        let others = [
            DecoderVariant { prefetch: true, ..DecoderVariant::FIRST },
            DecoderVariant { early: true, ..DecoderVariant::FIRST },
            DecoderVariant { pipe: true, ..DecoderVariant::FIRST },
        ];
        for v in DecoderVariant::TIMED.into_iter().chain(others) {
            crate::nvrtc::check::compiles_by(&format!("the exponent decoder, {}", v.name()), || v.compile());
        }
    }

    /// A build whose write loop's rows do not divide 32 is refused by name, before NVRTC.
    #[test]
    fn a_variant_with_rows_not_dividing_32_is_refused() {
        for rows in [0, 3, 64] {
            let e = DecoderVariant { prefetch: true, rows, ..DecoderVariant::FIRST }.options().unwrap_err();
            assert!(e.contains(&format!("prefetch-rows{rows}")) && e.contains("divide 32"), "{e}");
        }
        for group in [3, 128] {
            let e = DecoderVariant { group, ..DecoderVariant::FIRST }.options().unwrap_err();
            assert!(e.contains(&format!("group{group}-rows4")) && e.contains("divide 64"), "{e}");
        }
        assert!(DecoderVariant::TIMED.contains(&DecoderVariant::RING), "the ring's build is among those timed");
    }

    pub(crate) fn bf16s(vals: impl IntoIterator<Item = f32>) -> Vec<u8> {
        vals.into_iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
    }

    /// Normal values of standard deviation `sd` (Box–Muller over a fixed LCG).
    pub(crate) fn normal(n: usize, sd: f32, seed: u64) -> Vec<f32> {
        let mut x = seed;
        let mut u = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos()) as f32 * sd).collect()
    }

    /// The kernel's per-lane loop mirrored line by line on the CPU (no GPU
    /// needed): the window refilled 32 bits at a time from aligned words of the
    /// padded string, bytes outside a chunk's range read as 0, tiles of 64 — its
    /// exponents and sign-mantissa bytes equal the input on every case, every
    /// chunk start alignment included. A mirror, not the kernel: the GPU test
    /// in `decoder.rs` runs the kernel itself.
    #[test]
    fn the_kernels_word_refill_decodes_like_the_cpu() {
        const BITS: u32 = MAX_CODE_BITS;
        let cases: Vec<Vec<u8>> = vec![
            bf16s(normal(9000, 0.02, 7)),
            bf16s((0..3000).map(|i| 1.0 + (i % 128) as f32 / 128.0)),
            bf16s(normal(3 * 1024 + 17, 0.5, 3)),
            bf16s(normal(1025, 3.0, 9)),
        ];
        // fp8 e4m3 cases (the kernel's `code` 2): normals cast under a per-row scale.
        let fp8 = |v: Vec<f32>, row: usize| -> Vec<u8> {
            v.chunks(row)
                .flat_map(|r| {
                    let scale = r.iter().fold(0f32, |m, x| m.max(x.abs())) / 448.0;
                    r.iter().map(move |x| offload_formats::fp8::f32_to_fp8(x / scale, offload_core::DType::F8_E4M3).unwrap())
                })
                .collect()
        };
        let fp8_cases = [fp8(normal(9000, 0.02, 17), 300), fp8(normal(3 * 1024 + 17, 0.5, 13), 1024 + 17)];
        let all = cases.iter().map(|c| (Code::Bf16, c)).chain(fp8_cases.iter().map(|c| (Code::Fp8E4M3, c)));
        for (ci, (code, raw)) in all.enumerate() {
            let enc = match code {
                Code::Bf16 => encode_bf16(raw),
                Code::Fp8E4M3 => offload_core::codec::encode_fp8_e4m3(raw),
            };
            assert_eq!(enc[4], if code == Code::Bf16 { 1 } else { 2 }, "case {ci} is coded");
            let l = coded_layout(&enc, raw.len(), "case").unwrap();
            assert_eq!(l.stream_at % 4, 0, "the stream starts on a word");
            let mut padded = enc.clone();
            padded.resize(enc.len().next_multiple_of(4), 0);
            let word = |i: usize| u32::from_le_bytes(padded[l.stream_at + 4 * i..l.stream_at + 4 * i + 4].try_into().unwrap());
            let off = |c: usize| u32::from_le_bytes(enc[l.offsets_at + 4 * c..l.offsets_at + 4 * c + 4].try_into().unwrap());
            let n = l.values;
            let mut starts = std::collections::HashSet::new();
            for c in 0..l.chunks {
                let (from, to) = (off(c), off(c + 1));
                starts.insert(from % 4);
                let word_be = |i: u32| -> u32 {
                    let start = i << 2;
                    if start >= to {
                        return 0;
                    }
                    let mut w = word(i as usize).swap_bytes();
                    if to - start < 4 {
                        w &= !(0xffff_ffffu32 >> (8 * (to - start)));
                    }
                    w
                };
                let values = (n - c * CHUNK_VALUES).min(CHUNK_VALUES);
                // Both refill schedules: at any value (GROUP 0), and the lanes' windows
                // topped up to more than 32 bits at each group's start (GROUP 2 to 32),
                // with a top-up inside a group only where it runs short.
                for group in [0usize, 2, 4, 8, 16, 32] {
                    let mut next = from >> 2;
                    let mut acc = u64::from(word_be(next));
                    next += 1;
                    let (mut bits, mut used) = (32 - 8 * (from & 3), 0u32);
                    for k in 0..values {
                        if group > 0 && k % group == 0 && bits <= 32 {
                            acc = (acc << 32) | u64::from(word_be(next));
                            next += 1;
                            bits += 32;
                        }
                        assert!(bits <= 64, "case {ci} chunk {c} value {k}: the window overflows");
                        if bits < BITS {
                            acc = (acc << 32) | u64::from(word_be(next));
                            next += 1;
                            bits += 32;
                        }
                        let x = l.table[((acc >> (bits - BITS)) as usize) & ((1 << BITS) - 1)];
                        let len = u32::from(x >> 8);
                        assert!(len > 0, "case {ci} chunk {c} value {k}: no code");
                        bits -= len;
                        used += len;
                        let v = c * CHUNK_VALUES + k;
                        let (got, want) = match code {
                            Code::Bf16 => {
                                let sm = enc[l.sm_at + v];
                                (
                                    (u16::from(sm & 0x80) << 8) | ((x & 0xff) << 7) | u16::from(sm & 0x7f),
                                    u16::from_le_bytes([raw[2 * v], raw[2 * v + 1]]),
                                )
                            }
                            Code::Fp8E4M3 => {
                                // Lane pairs: byte (b + k) / 2 of the nibbles, k's low and k + 1's high.
                                let pair = u16::from(enc[l.sm_at + (v & !1) / 2]);
                                let sm = if v % 2 == 0 { pair & 0x0f } else { pair >> 4 };
                                (((sm & 0x08) << 4) | ((x & 0xff) << 3) | (sm & 0x07), u16::from(raw[v]))
                            }
                        };
                        assert_eq!(got, want, "case {ci} chunk {c} value {k} (group {group})");
                    }
                    assert_eq!(used.div_ceil(8), to - from, "case {ci} chunk {c}: its codes fill its bytes");
                }
            }
            if ci == 0 {
                assert_eq!(starts.len(), 4, "chunks start at every offset within a word: {starts:?}");
            }
        }
    }
}
