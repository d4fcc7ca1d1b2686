//! The exponent decoder on its own: [`ExponentDecoder::decode`] copies one
//! encoded string to the device and decodes it there, synchronously (the round
//! trip the property tests run where a GPU exists); [`ExponentDecoder::upload`],
//! [`ExponentDecoder::launch`] and [`DeviceCoded::finish`] are its three stages
//! (the bench room times the kernel alone). The ring's coded copies use the same
//! kernel through [`crate::coded`].

use crate::codec::{ptx, DecoderVariant};
use crate::device::CudaBackend;
use crate::error::dev;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use offload_core::codec::{coded_layout, decoded_len, CHUNK_VALUES, MAX_CODE_BITS};
use offload_core::{Error, Result};
use std::sync::Arc;

fn damaged(what: &str, fault: &str) -> Error {
    Error::BadTensor { tensor: what.to_owned(), fault: format!("compressed bytes damaged: {fault}") }
}

/// Decoded bytes on the device, on the compute stream of the backend that
/// decoded them. Opaque on purpose: a cudarc `CudaSlice` hands out its stream
/// and context, whose event tracking is off (see `CudaBackend::ctx`).
pub struct DecodedBytes(CudaSlice<u8>);

impl std::fmt::Debug for DecodedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DecodedBytes({} bytes)", self.0.len())
    }
}

impl DecodedBytes {
    /// Bytes held.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether no byte is held.
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }

    /// The bytes, copied to the host after every decode enqueued into them (a host
    /// synchronisation on their stream).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        self.0.stream().clone_dtoh(&self.0).map_err(|e| dev("reading decoded bytes back", e))
    }
}

/// The decoding kernel, loaded on one backend's context.
pub struct ExponentDecoder {
    decode: CudaFunction,
    /// The context the module is loaded on: drained before the module unloads.
    engine: std::sync::Arc<crate::engine::Engine>,
}

impl Drop for ExponentDecoder {
    fn drop(&mut self) {
        // Launches of this kernel may still be queued on any stream of the
        // context: let them finish before the module goes with `decode`.
        if let Err(e) =
            self.engine.bind().and_then(|()| self.engine.ctx.synchronize().map_err(|e| crate::error::dev("draining the context", e)))
        {
            tracing::warn!("the exponent decoder's module is kept loaded: the context could not be drained ({e})");
            std::mem::forget(self.decode.clone());
        }
    }
}

impl ExponentDecoder {
    /// Compile (once per process) and load the kernel on `b`'s context.
    pub fn new(b: &CudaBackend) -> Result<Self> {
        Self::with_variant(b, DecoderVariant::RING)
    }

    /// The kernel built as `variant` (compiled anew unless it is the ring's), for
    /// timing builds side by side.
    pub fn with_variant(b: &CudaBackend, variant: DecoderVariant) -> Result<Self> {
        let ptx = match variant == DecoderVariant::RING {
            true => ptx().cloned(),
            false => variant.compile(),
        }
        .map_err(|e| dev("compiling the exponent decoder", e))?;
        let module = b.engine().ctx.load_module(ptx).map_err(|e| dev("loading the exponent decoder", e))?;
        let decode = module.load_function("exp_decode").map_err(|e| dev("exp_decode", e))?;
        Ok(ExponentDecoder { decode, engine: b.engine().clone() })
    }

    /// Decode the encoded string `enc` ([`offload_core::codec::encode_bf16`]) on
    /// `b`'s compute stream into a new device buffer of the original bytes, and
    /// wait for it (a host synchronisation: for tests and one-off decodes, not the
    /// ring's steady state). `what` names the tensor in errors; damage the kernel
    /// sees is an error, never returned bytes.
    pub fn decode(&self, b: &CudaBackend, enc: &[u8], what: &str) -> Result<DecodedBytes> {
        let mut coded = self.upload(b, enc, what)?;
        let s = &b.engine().compute;
        let mut out = DecodedBytes(s.alloc_zeros::<u8>(coded.len).map_err(|e| dev("the decoded buffer", e))?);
        self.launch(b, &mut coded, &mut out)?;
        coded.finish()?;
        Ok(out)
    }

    /// Check `enc`'s layout on the host and copy it, with its decode table, to
    /// the device (on `b`'s compute stream): what [`ExponentDecoder::launch`]
    /// decodes, as many times as asked.
    pub fn upload(&self, b: &CudaBackend, enc: &[u8], what: &str) -> Result<DeviceCoded> {
        let s = &b.engine().compute;
        let len = decoded_len(enc, what)?;
        let (raw, l) = match enc.get(4) {
            Some(0) => {
                let body = enc.get(24..).filter(|body| body.len() == len).ok_or_else(|| damaged(what, "raw body of another length"))?;
                (Some(body), None)
            }
            Some(1) => (None, Some(coded_layout(enc, len, what)?)),
            Some(2) => return Err(damaged(what, "coded as fp8 e4m3, which this decoder does not read (bf16's code only)")),
            _ => return Err(damaged(what, "unknown mode")),
        };
        // A coded string padded to whole 32-bit words: the kernel reads its stream a
        // word at a time, and the last word may reach past the string's end.
        let padded: Vec<u8>;
        let bytes = match raw {
            Some(body) => body,
            None if enc.len() % 4 != 0 => {
                padded = enc.iter().copied().chain(std::iter::repeat_n(0, 4 - enc.len() % 4)).collect();
                &padded
            }
            None => enc,
        };
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
    pub fn launch(&self, b: &CudaBackend, coded: &mut DeviceCoded, out: &mut DecodedBytes) -> Result<()> {
        let s = &b.engine().compute;
        let out = &mut out.0;
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
        if stream % 4 != 0 || coded.enc.len() % 4 != 0 {
            return Err(damaged(&coded.what, "a stream not aligned to whole words"));
        }
        // 32 chunks per warp, 4 warps (the kernel's WARPS: its shared tiles are sized for it).
        let threads = 128u32;
        let cfg = LaunchConfig { grid_dim: (chunks.div_ceil(threads), 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        debug_assert_eq!(CHUNK_VALUES, 1024);
        // SAFETY: `coded.enc` holds the whole string, whose offset table, stream and sign-mantissa bytes `coded_layout` checked lie inside it (offsets monotone within the stream, exactly `n` sign-mantissa bytes, `chunks` = ⌈n / 1024⌉; the offset table starts at byte 284 of a 256-aligned allocation, so its u32s are aligned, and so does the stream, read as aligned words (its offset a multiple of 4, checked above), every word that holds one of its bytes inside the allocation (padded to whole words by `upload`, checked above)); `out` holds 2 × `n` bytes (checked above; 256-aligned, so the kernel's 4-byte stores at even values are aligned), the table 2^MAX_CODE_BITS entries, the flag one u32; every one of them was allocated on `s`, this kernel's stream (checked above), and a `CudaSlice` frees on its own stream, so no free can run before this kernel ends.
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
                .arg(&0u32)
                .launch(cfg)
        }
        .map(|_| ())
        .map_err(|e| dev("exp_decode launch", e))
    }

    /// The decoder's speed on `enc`: one warm-up decode (which allocates the
    /// output), then `reps` launches into the same buffer timed on the host around
    /// enqueue-and-wait (the launches' microseconds are lost in the kernels'
    /// milliseconds). Returns the seconds of the `reps` decodes and the output.
    pub fn time_decodes(&self, b: &CudaBackend, enc: &[u8], what: &str, reps: usize) -> Result<(f64, DecodedBytes)> {
        let mut coded = self.upload(b, enc, what)?;
        let mut out = self.decode(b, enc, what)?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            self.launch(b, &mut coded, &mut out)?;
        }
        coded.finish()?;
        Ok((t.elapsed().as_secs_f64(), out))
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
        match flag.first().copied().unwrap_or(0) & 3 {
            0 => Ok(()),
            1 => Err(damaged(&self.what, "no code matches a chunk's next bits")),
            _ => Err(damaged(&self.what, "a chunk's codes do not fill its bytes")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::{bf16s, normal};
    use offload_core::codec::{decode_bf16, encode_bf16};

    /// On a GPU: every input decodes to its exact bytes, as on the CPU; damage the
    /// kernel sees is an error. Without a device it prints SKIPPED (and fails
    /// under `OFFLOAD_REQUIRE_DEVICE=1`).
    #[test]
    fn gpu_decode_round_trips_bit_exact_and_names_damage() {
        let Some(b) = crate::gpu_tests::test_backend() else { return };
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
            let got = d.decode(&b, &enc, name).unwrap().to_host().unwrap();
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
