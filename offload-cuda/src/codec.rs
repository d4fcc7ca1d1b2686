//! The GPU decoder of [`offload_core::codec`]'s bf16 coding: one thread per
//! chunk of [`CHUNK_VALUES`] exponents reads its own bit stream through the
//! lookup table (in shared memory) — the CPU reference decoder's loop, on the
//! device — 32 exponents at a time into a shared tile, from which its warp
//! writes each value's bf16 bits (exponent and sign-mantissa byte) with
//! coalesced stores. Structural damage (no code matching the next bits, a chunk whose codes
//! do not fill its bytes) raises a flag the host reads back; the CPU decoder's
//! hash of the decoded bytes has no parallel form and is not checked here.
//!
//! Not yet part of the ring: [`ExponentDecoder::decode`] copies one encoded
//! string to the device and decodes it there, synchronously (the round trip the
//! issue's property tests run where a GPU exists); [`ExponentDecoder::upload`],
//! [`ExponentDecoder::launch`] and [`DeviceCoded::finish`] are its three stages
//! (the speed example times the kernel alone).

use crate::dev;
use crate::device::CudaBackend;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc;
use offload_core::codec::{coded_layout, decoded_len, CHUNK_VALUES, MAX_CODE_BITS};
use offload_core::{Error, Result};
use std::sync::{Arc, OnceLock};

const KERNELS: &str = r#"
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define CHUNK 1024
#define BITS 12
#define TILE 32
#define WARPS 4
// One thread per chunk, 32 chunks per warp, WARPS warps per block (the launch's
// 128 threads). In tiles of 32 values: each lane decodes the next 32 exponents of
// its own chunk into its row of a shared tile (serial: a chunk is one bit
// stream), then the warp writes the tile chunk by chunk, lane l taking value l, so
// the sign-mantissa reads and the output writes are coalesced (64 bytes per warp
// store) where one thread per chunk writing its own chunk touched 32 lines at once.
// `offsets` (at offsets_at in enc) holds chunks + 1 byte offsets into the stream;
// `table` maps the next BITS bits to exponent | length << 8; `err` collects
// 1 (no code matches) and 2 (a chunk's codes do not fill its bytes).
extern "C" __global__ void exp_decode(const u8* enc, u64 stream_at, u64 offsets_at, u32 chunks, u64 sm_at, u64 n,
                                      const u16* table, u16* out, u32* err) {
    const u8* stream = enc + stream_at;
    const u32* offsets = (const u32*)(enc + offsets_at);
    const u8* sm = enc + sm_at;
    __shared__ u16 t[1 << BITS];
    // One word per exponent, rows of 33 words: lane l writing word j of its row and
    // lane l reading word l of row r both touch 32 different banks.
    __shared__ u32 tile[WARPS][32 * (TILE + 1)];
    for (u32 i = threadIdx.x; i < (1u << BITS); i += blockDim.x) t[i] = table[i];
    __syncthreads();
    u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 first = blockIdx.x * blockDim.x + warp * 32;
    u32 c = first + lane;
    bool have = c < chunks;
    u32 from = have ? offsets[c] : 0, to = have ? offsets[c + 1] : 0;
    u64 base = (u64)c * CHUNK;
    u32 values = have ? (n - base < CHUNK ? (u32)(n - base) : CHUNK) : 0;
    u64 acc = 0;
    u32 bits = 0, next = from, used = 0;
    bool bad = false;
    u32* e = tile[warp];
    for (u32 k0 = 0; k0 < CHUNK; k0 += TILE) {
        for (u32 j = 0; j < TILE && !bad && k0 + j < values; ++j) {
            while (bits < BITS) {
                acc = (acc << 8) | (next < to ? stream[next] : 0);
                ++next;
                bits += 8;
            }
            u16 x = t[(acc >> (bits - BITS)) & ((1u << BITS) - 1)];
            u32 len = x >> 8;
            if (len == 0) { bad = true; atomicOr(err, 1u); break; }
            bits -= len;
            used += len;
            e[lane * (TILE + 1) + j] = x & 0xff;
        }
        __syncwarp();
        for (u32 r = 0; r < 32; ++r) {
            u32 cc = first + r;
            if (cc >= chunks) break;
            u64 b = (u64)cc * CHUNK;
            u32 vals = n - b < CHUNK ? (u32)(n - b) : CHUNK;
            u32 k = k0 + lane;
            if (k < vals) {
                u16 s = sm[b + k];
                out[b + k] = (u16)((s & 0x80) << 8) | (u16)(e[r * (TILE + 1) + lane] << 7) | (u16)(s & 0x7f);
            }
        }
        __syncwarp();
    }
    if (have && !bad && (used + 7) / 8 != to - from) atomicOr(err, 2u);
}
"#;

fn ptx() -> std::result::Result<&'static nvrtc::Ptx, String> {
    static PTX: OnceLock<std::result::Result<nvrtc::Ptx, String>> = OnceLock::new();
    crate::compiled(&PTX, KERNELS)
}

fn damaged(what: &str, fault: &str) -> Error {
    Error::BadTensor { tensor: what.to_owned(), fault: format!("compressed bytes damaged: {fault}") }
}

/// The decoding kernel, loaded on one backend's context.
pub struct ExponentDecoder {
    decode: CudaFunction,
}

impl ExponentDecoder {
    /// Compile (once per process) and load the kernel on `b`'s context.
    pub fn new(b: &CudaBackend) -> Result<Self> {
        let ptx = ptx().map_err(|e| dev("compiling the exponent decoder", e))?;
        let module = b.shared().ctx.load_module(ptx.clone()).map_err(|e| dev("loading the exponent decoder", e))?;
        Ok(ExponentDecoder { decode: module.load_function("exp_decode").map_err(|e| dev("exp_decode", e))? })
    }

    /// Decode the encoded string `enc` ([`offload_core::codec::encode_bf16`]) on
    /// `b`'s compute stream into a new device buffer of the original bytes, and
    /// wait for it (a host synchronisation: for tests and one-off decodes, not the
    /// ring's steady state). `what` names the tensor in errors; damage the kernel
    /// sees is an error, never returned bytes.
    pub fn decode(&self, b: &CudaBackend, enc: &[u8], what: &str) -> Result<CudaSlice<u8>> {
        let mut coded = self.upload(b, enc, what)?;
        let s = &b.shared().compute;
        let mut out = s.alloc_zeros::<u8>(coded.len).map_err(|e| dev("the decoded buffer", e))?;
        self.launch(b, &mut coded, &mut out)?;
        coded.finish()?;
        Ok(out)
    }

    /// Check `enc`'s layout on the host and copy it, with its decode table, to
    /// the device (on `b`'s compute stream): what [`ExponentDecoder::launch`]
    /// decodes, as many times as asked.
    pub fn upload(&self, b: &CudaBackend, enc: &[u8], what: &str) -> Result<DeviceCoded> {
        let s = &b.shared().compute;
        let len = decoded_len(enc, what)?;
        let (raw, l) = match enc.get(4) {
            Some(0) => {
                let body = enc.get(24..).filter(|body| body.len() == len).ok_or_else(|| damaged(what, "raw body of another length"))?;
                (Some(body), None)
            }
            Some(1) => (None, Some(coded_layout(enc, len, what)?)),
            _ => return Err(damaged(what, "unknown mode")),
        };
        let bytes = raw.unwrap_or(enc);
        let table: &[u16] = l.as_ref().map(|l| l.table.as_slice()).unwrap_or(&[0]);
        debug_assert!(l.as_ref().is_none_or(|l| l.table.len() == 1 << MAX_CODE_BITS));
        Ok(DeviceCoded {
            stream: s.clone(),
            enc: s.clone_htod(bytes).map_err(|e| dev("copying the encoded bytes", e))?,
            table: s.clone_htod(table).map_err(|e| dev("copying the decode table", e))?,
            err: s.clone_htod(&[0u32]).map_err(|e| dev("the error flag", e))?,
            at: l.as_ref().map(|l| (l.stream_at as u64, l.offsets_at as u64, l.sm_at as u64, l.chunks as u32, l.values as u64)),
            len,
            what: what.to_owned(),
        })
    }

    /// Enqueue the decode of `coded` into `out` on `b`'s compute stream, without
    /// waiting (a raw string is a device-to-device copy). `out` must hold exactly
    /// the decoded length, and both must live on that stream (`coded` uploaded
    /// through `b`, `out` allocated on its compute stream, e.g. by
    /// [`ExponentDecoder::decode`] with `b`): anything else is an error, so every
    /// buffer the kernel touches is freed in order after it. Damage found by the
    /// kernel is reported by [`DeviceCoded::finish`].
    pub fn launch(&self, b: &CudaBackend, coded: &mut DeviceCoded, out: &mut CudaSlice<u8>) -> Result<()> {
        let s = &b.shared().compute;
        if !Arc::ptr_eq(&coded.stream, s) || !Arc::ptr_eq(out.stream(), s) {
            return Err(Error::Protocol(format!(
                "decoding {}: the encoded tensor and the output must be on the compute stream of the backend that decodes",
                coded.what
            )));
        }
        if out.len() != coded.len {
            return Err(Error::BadTensor {
                tensor: coded.what.clone(),
                fault: format!("decode into {} bytes, {} decoded", out.len(), coded.len),
            });
        }
        let Some((stream, offsets, sm, chunks, n)) = coded.at else {
            return s.memcpy_dtod(&coded.enc, out).map_err(|e| dev("copying a raw tensor", e));
        };
        if n == 0 {
            return Ok(());
        }
        // 32 chunks per warp, 4 warps (the kernel's WARPS: its shared tiles are sized for it).
        let threads = 128u32;
        let cfg = LaunchConfig { grid_dim: (chunks.div_ceil(threads), 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        debug_assert_eq!(CHUNK_VALUES, 1024);
        // SAFETY: `coded.enc` holds the whole string, whose offset table, stream and sign-mantissa bytes `coded_layout` checked lie inside it (offsets monotone within the stream, exactly `n` sign-mantissa bytes, `chunks` = ⌈n / 1024⌉; the offset table starts at byte 284 of a 256-aligned allocation, so its u32s are aligned); `out` holds 2 × `n` bytes (checked above), the table 2^MAX_CODE_BITS entries, the flag one u32; every one of them was allocated on `s`, this kernel's stream (checked above), and a `CudaSlice` frees on its own stream, so no free can run before this kernel ends.
        unsafe {
            s.launch_builder(&self.decode)
                .arg(&coded.enc)
                .arg(&stream)
                .arg(&offsets)
                .arg(&chunks)
                .arg(&sm)
                .arg(&n)
                .arg(&coded.table)
                .arg(out)
                .arg(&mut coded.err)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(|e| dev("exp_decode launch", e))
    }
}

/// An encoded string on the device with its decode table and damage flag
/// ([`ExponentDecoder::upload`]).
pub struct DeviceCoded {
    /// The stream its buffers were made on, and the only one it decodes on.
    stream: Arc<CudaStream>,
    enc: CudaSlice<u8>,
    table: CudaSlice<u16>,
    err: CudaSlice<u32>,
    /// (stream, offsets, sign-mantissa) byte offsets in `enc`, chunks, values; `None` for a raw string.
    at: Option<(u64, u64, u64, u32, u64)>,
    len: usize,
    what: String,
}

impl DeviceCoded {
    /// The decoded length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it decodes to nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Wait for the decodes enqueued so far and report damage any of them saw
    /// (a host synchronisation on its stream), naming the tensor.
    pub fn finish(&self) -> Result<()> {
        let s = &self.stream;
        let flag = s.clone_dtoh(&self.err).map_err(|e| dev("reading the error flag", e))?;
        s.synchronize().map_err(|e| dev("decoding", e))?;
        match flag.first().copied().unwrap_or(0) {
            0 => Ok(()),
            f if f & 1 != 0 => Err(damaged(&self.what, "no code matches a chunk's next bits")),
            _ => Err(damaged(&self.what, "a chunk's codes do not fill its bytes")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::codec::{decode_bf16, encode_bf16};

    /// The decoder compiles with NVRTC (no GPU needed, only libnvrtc).
    #[test]
    fn kernels_compile_with_nvrtc() {
        crate::nvrtc_check::compiles("the exponent decoder", super::KERNELS);
    }

    fn bf16s(vals: impl IntoIterator<Item = f32>) -> Vec<u8> {
        vals.into_iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
    }

    /// Normal values of standard deviation `sd` (Box–Muller over a fixed LCG).
    fn normal(n: usize, sd: f32, seed: u64) -> Vec<f32> {
        let mut x = seed;
        let mut u = || {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n).map(|_| ((-2.0 * u().ln()).sqrt() * (std::f64::consts::TAU * u()).cos()) as f32 * sd).collect()
    }

    /// On a GPU: every input decodes to its exact bytes, as on the CPU; damage the
    /// kernel sees is an error. Without a device it prints SKIPPED (and fails
    /// under `OFFLOAD_REQUIRE_DEVICE=1`).
    #[test]
    fn gpu_decode_round_trips_bit_exact_and_names_damage() {
        let b = match CudaBackend::new(0) {
            Ok(b) => b,
            Err(e) if !crate::driver_present() => {
                assert!(std::env::var("OFFLOAD_REQUIRE_DEVICE").as_deref() != Ok("1"), "a CUDA device is required: {e}");
                println!("SKIPPED: no CUDA device ({e})");
                return;
            }
            Err(e) => panic!("CUDA driver present but the backend failed: {e}"),
        };
        let d = ExponentDecoder::new(&b).unwrap();
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-40, -1e-40, 0.0, -0.0, 1.0, -2.5];
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("normal", bf16s(normal(5000, 0.02, 1))),
            ("one exponent", bf16s((0..3000).map(|i| 1.0 + (i % 128) as f32 / 128.0))),
            ("every exponent", (0..2048u32).flat_map(|i| (((i % 256) << 7) as u16 | (i / 256) as u16).to_le_bytes()).collect()),
            ("specials", bf16s((0..1500).map(|i| specials[i % specials.len()]))),
            ("odd length", vec![7u8; 2049]),
            ("empty", Vec::new()),
        ];
        for (name, raw) in &cases {
            let enc = encode_bf16(raw);
            assert_eq!(&decode_bf16(&enc, name).unwrap(), raw, "{name}: the CPU reference");
            let got = b.shared().compute.clone_dtoh(&d.decode(&b, &enc, name).unwrap()).unwrap();
            assert_eq!(&got, raw, "{name}: GPU decode");
        }
        // Damage: one code length kept, the others dropped — the stream's other
        // codes match nothing (the CPU decoder refuses it too).
        let enc = encode_bf16(&cases[0].1);
        assert_eq!(enc[4], 1, "the normal case is coded");
        let mut bad = enc.clone();
        let keep = (24..24 + 256).find(|&i| bad[i] > 0).unwrap();
        for byte in &mut bad[keep + 1..24 + 256] {
            *byte = 0;
        }
        assert!(decode_bf16(&bad, "damaged").is_err());
        let e = d.decode(&b, &bad, "normal (damaged)").unwrap_err().to_string();
        assert!(e.contains("normal (damaged)") && e.contains("damaged"), "{e}");
        // Buffers of another backend's stream are refused, not raced.
        let b2 = CudaBackend::new(0).unwrap();
        let mut coded = d.upload(&b, &enc, "normal").unwrap();
        let mut out = d.decode(&b, &enc, "normal").unwrap();
        let mut other = d.decode(&b2, &enc, "normal").unwrap();
        assert!(d.launch(&b2, &mut coded, &mut out).is_err(), "an upload of another backend");
        assert!(d.launch(&b, &mut coded, &mut other).is_err(), "an output of another backend");
        d.launch(&b, &mut coded, &mut out).unwrap();
        coded.finish().unwrap();
    }
}
