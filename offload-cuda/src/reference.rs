//! A reference transformer computed with raw CUDA from the ring's slots: Flux- and
//! Qwen-Image-shaped dual-stream blocks and Flux's single-stream blocks, in
//! diffusers' parameter names, with cuBLAS GEMMs for every linear layer,
//! attention as batched GEMMs around an NVRTC softmax, and small kernels for
//! LayerNorm modulation, per-head RMS norm of q and k, GELU and gated residuals.
//! No rotary positions and no embedders: the hidden states start from seeded
//! random values. It is the compute the bench room's `cuda` file plugs in, and a
//! worked example of reading weights from a [`BlockGuard`].
//!
//! A linear layer's weight may be stored as fp8 (`F8_E4M3` or `F8_E5M2`, one
//! byte a weight), with its scale beside it as `X.weight_scale` (f32 or bf16,
//! one per tensor or one per output channel) or `X.scale_weight` (ComfyUI's, one
//! per tensor), or none (unscaled): a kernel dequantises it on the compute
//! stream to `bf16(f32(w) × scale)` in a scratch buffer, exactly
//! [`offload_formats::fp8::dequantize_to_bf16`] for every value that is not a NaN
//! (a NaN stays a NaN, its bits as the device makes them), and the GEMM reads
//! that. So a block streamed as stored computes what the bf16 model of the
//! dequantised weights computes, bit for bit. The scratch buffer (bf16 of the
//! largest linear weight: 94 MB for Flux-dev) is allocated at the first fp8
//! weight and is not in [`RefDims::activation_bytes`].
//!
//! Everything is checked before a launch: the dimensions against bounds that keep
//! every size product and 32-bit argument in range, each weight's dtype and size
//! against the dimensions, the guard's backend against this one (same streams),
//! every launch against its grid limits; activations are allocated here from the
//! same dimensions. So no argument makes a kernel read or write outside a buffer.

use crate::device::CudaBackend;
use crate::error::dev;
use cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use offload_core::{BlockGuard, DType, Error, Result};
use std::sync::Arc;

/// The one head size the kernels handle (Flux and Qwen-Image's).
pub const HEAD_DIM: usize = 128;

const KERNELS: &str = r#"
typedef unsigned short bf16;
__device__ __forceinline__ float f(bf16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ bf16 b(float x) { unsigned u = __float_as_uint(x); u += 0x7FFFu + ((u >> 16) & 1u); return (bf16)(u >> 16); }
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x))); }

extern "C" __global__ void bias_act(bf16* y, const bf16* bias, long long rows, int cols, int ld, int act) {
    long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols; int c = (int)(i % cols);
        float v = f(y[r * ld + c]) + f(bias[c]);
        if (act) v = gelu(v);
        y[r * ld + c] = b(v);
    }
}
extern "C" __global__ void silu_vec(bf16* out, const bf16* in, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) { float x = f(in[i]); out[i] = b(x / (1.0f + __expf(-x))); }
}
// One block per row: out = LayerNorm(x) * (1 + scale) + shift.
extern "C" __global__ void modulate_ln(bf16* out, const bf16* x, int cols, const bf16* shift, const bf16* scale) {
    long long r = blockIdx.x;
    const bf16* xr = x + r * cols; bf16* o = out + r * cols;
    __shared__ float s1[256], s2[256];
    float a = 0.f, q = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) { float v = f(xr[c]); a += v; q += v * v; }
    s1[threadIdx.x] = a; s2[threadIdx.x] = q; __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) { if (threadIdx.x < s) { s1[threadIdx.x] += s1[threadIdx.x + s]; s2[threadIdx.x] += s2[threadIdx.x + s]; } __syncthreads(); }
    float mean = s1[0] / cols; float var = s2[0] / cols - mean * mean; float inv = rsqrtf(var + 1e-6f);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = b((f(xr[c]) - mean) * inv * (1.0f + f(scale[c])) + f(shift[c]));
}
// One warp per (row, head): RMS norm over the 128 values of one head from col0.
extern "C" __global__ void rms_heads(bf16* y, long long rows, int ld, int col0, int heads, const bf16* scale) {
    long long w = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 32; int lane = threadIdx.x % 32;
    if (w >= rows * heads) return;
    long long r = w / heads; int h = (int)(w % heads);
    bf16* p = y + r * ld + col0 + h * 128;
    float v[4]; float ss = 0.f;
    for (int k = 0; k < 4; k++) { v[k] = f(p[lane + 32 * k]); ss += v[k] * v[k]; }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float inv = rsqrtf(ss / 128.f + 1e-6f);
    for (int k = 0; k < 4; k++) p[lane + 32 * k] = b(v[k] * inv * f(scale[lane + 32 * k]));
}
// One block per row of scores: softmax(scale * s) in place.
extern "C" __global__ void softmax_rows(bf16* s, long long cols, float scale) {
    bf16* p = s + blockIdx.x * cols;
    __shared__ float red[256];
    float m = -1e30f;
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, f(p[c]));
    red[threadIdx.x] = m; __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) { if (threadIdx.x < k) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + k]); __syncthreads(); }
    m = red[0]; __syncthreads();
    float sum = 0.f;
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) sum += __expf((f(p[c]) - m) * scale);
    red[threadIdx.x] = sum; __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) { if (threadIdx.x < k) red[threadIdx.x] += red[threadIdx.x + k]; __syncthreads(); }
    float inv = 1.0f / red[0];
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) p[c] = b(__expf((f(p[c]) - m) * scale) * inv);
}
// x[r, c] += gate[c] * y[r * ldy + c]
extern "C" __global__ void gated_residual(bf16* x, const bf16* y, const bf16* gate, long long rows, int cols, int ldy) {
    long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols; int c = (int)(i % cols);
        x[i] = b(f(x[i]) + f(gate[c]) * f(y[r * ldy + c]));
    }
}
// dst[r * ldd + c] = src[r * lds + c]
// fp8 (E4M3: ml_dtypes' float8_e4m3fn; E5M2: IEEE-like) to f32, as offload_formats::fp8::fp8_to_f32.
__device__ __forceinline__ float fp8f(unsigned v, int e5m2) {
    int eb = e5m2 ? 5 : 4, mb = 7 - eb, bias = e5m2 ? 15 : 7;
    int e = (v >> mb) & ((1 << eb) - 1), m = v & ((1 << mb) - 1);
    float r;
    if (!e5m2 && e == 15 && m == 7) r = __int_as_float(0x7fc00000);
    else if (e5m2 && e == 31) r = m ? __int_as_float(0x7fc00000) : __int_as_float(0x7f800000);
    else if (e == 0) r = (float)m / (float)(1 << mb) * ldexpf(1.0f, 1 - bias);
    else r = (1.0f + (float)m / (float)(1 << mb)) * ldexpf(1.0f, e - bias);
    return (v & 0x80) ? -r : r;
}
// f32 to bf16 rounded to nearest even, NaN kept a quiet NaN (offload_formats::fp8::f32_to_bf16).
__device__ __forceinline__ bf16 bq(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (bf16)((u >> 16) | 0x40u);
    return (bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
// out[i] = bf16(f32(w[i]) * scale[row or 0]); scale_kind 0: none, 1: f32, 2: bf16.
extern "C" __global__ void dequant_fp8(bf16* out, const unsigned char* w, const void* scale, long long n, long long cols,
                                       int per_channel, int scale_kind, int e5m2) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long k = per_channel ? i / cols : 0;
        float s = scale_kind == 1 ? ((const float*)scale)[k] : scale_kind == 2 ? f(((const bf16*)scale)[k]) : 1.0f;
        float x = fp8f(w[i], e5m2);
        out[i] = bq(scale_kind ? x * s : x);
    }
}

extern "C" __global__ void copy_cols(bf16* dst, int ldd, const bf16* src, int lds, long long rows, int cols) {
    long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols; int c = (int)(i % cols);
        dst[r * ldd + c] = src[r * lds + c];
    }
}
"#;

/// The sizes of one reference model and case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefDims {
    /// Attention heads (of [`HEAD_DIM`]); the hidden size is `heads × 128`.
    pub heads: usize,
    /// MLP hidden size.
    pub mlp: usize,
    /// Text tokens (the first rows of the hidden states).
    pub text_tokens: usize,
    /// Image tokens.
    pub image_tokens: usize,
}

impl RefDims {
    /// Hidden size.
    pub fn hidden(&self) -> usize {
        self.heads * HEAD_DIM
    }

    /// Tokens in all.
    pub fn tokens(&self) -> usize {
        self.text_tokens + self.image_tokens
    }

    /// Whether [`RefNet`] can run these sizes: every size positive and bounded so
    /// that no size product wraps and every 32-bit kernel and cuBLAS argument and
    /// launch grid stays in range. [`RefNet::new`] checks this first.
    pub fn check(&self) -> Result<()> {
        let d = *self;
        let bad = |why: String| Err(Error::Plan(format!("reference model {d:?}: {why}")));
        if d.heads == 0 || d.mlp == 0 || d.text_tokens == 0 || d.image_tokens == 0 {
            return bad("every size must be positive".into());
        }
        // Each field bounded first, so no product below can wrap (release builds do
        // not check overflow): heads ≤ 2^12, MLP and tokens per stream ≤ 2^20.
        if d.heads > 1 << 12 || d.mlp > 1 << 20 || d.text_tokens > 1 << 20 || d.image_tokens > 1 << 20 {
            return bad("heads above 4096, or an MLP or token count above 2^20".into());
        }
        let (t, h) = (d.tokens(), d.hidden());
        // cuBLAS and the kernels take 32-bit sizes and leading dimensions.
        if [t, 3 * h + d.mlp, t * t].iter().any(|&n| n > i32::MAX as usize) {
            return bad("a size or leading dimension exceeds 2^31".into());
        }
        // rms_heads launches one warp per (row, head) without a grid-stride loop.
        if (t * d.heads * 32).div_ceil(256) > 65535 {
            return bad(format!("{t} tokens × {} heads exceed one RMS-norm launch", d.heads));
        }
        Ok(())
    }

    /// Device bytes of the activations [`RefNet::new`] allocates for these sizes.
    pub fn activation_bytes(&self) -> u64 {
        let (t, h) = (self.tokens() as u64, self.hidden() as u64);
        let elems = 2 * t * h
            + t * (3 * h + self.mlp as u64)
            + 2 * t * h
            + t * self.mlp as u64
            + self.heads as u64 * t * t
            + 2 * h
            + 12 * h
            + t * h;
        2 * elems
    }
}

/// The names of a dual-stream block's per-stream parts (diffusers' Flux:
/// `norm1.linear`, `norm1_context.linear`, `ff`, `ff_context`; Qwen-Image:
/// `img_mod.1`, `txt_mod.1`, `img_mlp`, `txt_mlp`).
#[derive(Clone, Copy, Debug)]
pub struct DualNames<'a> {
    /// The image stream's modulation linear (6 × hidden outputs).
    pub img_mod: &'a str,
    /// The text stream's modulation linear.
    pub txt_mod: &'a str,
    /// The image stream's MLP (`.net.0.proj`, `.net.2`).
    pub img_mlp: &'a str,
    /// The text stream's MLP.
    pub txt_mlp: &'a str,
}

struct Kernels {
    bias_act: CudaFunction,
    silu: CudaFunction,
    modulate: CudaFunction,
    rms: CudaFunction,
    softmax: CudaFunction,
    residual: CudaFunction,
    copy_cols: CudaFunction,
    dequant_fp8: CudaFunction,
}

/// Activations and scratch for one case (bf16 as `u16`).
struct Acts {
    x: CudaSlice<u16>,    // [T, H] hidden: text rows first, then image rows
    x0: CudaSlice<u16>,   // [T, H] the seeded start
    xm: CudaSlice<u16>,   // [T, H] modulated input
    y: CudaSlice<u16>,    // [T, 3H + MLP] q, k, v (and the single block's MLP)
    o: CudaSlice<u16>,    // [T, H] attention output
    tmp: CudaSlice<u16>,  // [T, MLP] MLP hidden
    tmp2: CudaSlice<u16>, // [T, H]
    s: CudaSlice<u16>,    // [heads, T, T] scores
    vec: CudaSlice<u16>,  // [H] the conditioning vector
    svec: CudaSlice<u16>, // [H] its SiLU
    modv: CudaSlice<u16>, // [12H] two streams' modulation
}

/// A reference model's compute on one [`CudaBackend`]'s compute stream.
pub struct RefNet {
    be: CudaBackend,
    blas: CudaBlas,
    k: Kernels,
    a: Acts,
    d: RefDims,
    skip_gemm: bool,
    /// bf16 of the largest linear weight, made on the first fp8 weight: where
    /// each fp8 weight is dequantised right before its GEMM reads it (both on
    /// the compute stream, so the next weight's dequantisation waits for it).
    scratch: std::sync::OnceLock<CudaSlice<u16>>,
}

fn ptr(s: &CudaSlice<u16>) -> u64 {
    let (p, _) = s.device_ptr(s.stream());
    p
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// SplitMix64.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl RefNet {
    /// Compile the kernels, make a cuBLAS handle on `be`'s compute stream and
    /// allocate the activations for `d`, the hidden states seeded from `seed`
    /// (values of magnitude in [2^-2, 1), random signs).
    pub fn new(be: &CudaBackend, d: RefDims, seed: u64) -> Result<Self> {
        d.check()?;
        let (t, h) = (d.tokens(), d.hidden());
        // Cudarc memory made here (activations) is used on the compute stream only,
        // and the cuBLAS handle is bound to that stream; slot memory is ordered by
        // the ring (the guard's wait precedes these reads).
        // SAFETY: no cudarc slice of this model is used on two streams (see above).
        let (ctx, s) = unsafe { (be.ctx().clone(), be.compute_stream().clone()) };
        static PTX: std::sync::OnceLock<std::result::Result<cudarc::nvrtc::Ptx, String>> = std::sync::OnceLock::new();
        let ptx = crate::nvrtc::compiled(&PTX, KERNELS).map_err(|e| dev("NVRTC", e))?;
        let module = ctx.load_module(ptx.clone()).map_err(|e| dev("load module", e))?;
        let f = |n: &str| module.load_function(n).map_err(|e| dev(&format!("kernel {n}"), e));
        let k = Kernels {
            bias_act: f("bias_act")?,
            silu: f("silu_vec")?,
            modulate: f("modulate_ln")?,
            rms: f("rms_heads")?,
            softmax: f("softmax_rows")?,
            residual: f("gated_residual")?,
            copy_cols: f("copy_cols")?,
            dequant_fp8: f("dequant_fp8")?,
        };
        let blas = CudaBlas::new(s.clone()).map_err(|e| dev("cuBLAS handle", e))?;
        let z = |n: usize| s.alloc_zeros::<u16>(n).map_err(|e| dev("activation alloc", e));
        let rnd = |n: usize, k: u64| -> Vec<u16> {
            (0..n)
                .map(|i| {
                    let r = mix(seed ^ k.wrapping_mul(0xA24B_AED4_963E_E407) ^ i as u64) as u16;
                    (r & 0x8000) | ((125 + ((r >> 7) & 1)) << 7) | (r & 0x7F)
                })
                .collect()
        };
        let x0 = rnd(t * h, 1);
        let a = Acts {
            x: s.clone_htod(&x0).map_err(|e| dev("x", e))?,
            x0: s.clone_htod(&x0).map_err(|e| dev("x0", e))?,
            xm: z(t * h)?,
            y: z(t * (3 * h + d.mlp))?,
            o: z(t * h)?,
            tmp: z(t * d.mlp)?,
            tmp2: z(t * h)?,
            s: z(d.heads * t * t)?,
            vec: s.clone_htod(&rnd(h, 2)).map_err(|e| dev("vec", e))?,
            svec: z(h)?,
            modv: z(12 * h)?,
        };
        Ok(RefNet { be: be.clone(), blas, k, a, d, skip_gemm: false, scratch: std::sync::OnceLock::new() })
    }

    /// Skip every cuBLAS call (the outputs are then meaningless): for
    /// compute-sanitizer runs over this module's own kernels.
    pub fn set_skip_gemm(&mut self, skip: bool) {
        self.skip_gemm = skip;
    }

    /// The sizes this model was made for.
    pub fn dims(&self) -> RefDims {
        self.d
    }

    fn stream(&self) -> &Arc<CudaStream> {
        // SAFETY: as in `new`: only this model's own memory and slots are used here.
        unsafe { self.be.compute_stream() }
    }

    /// Make the backend's context current on this thread (cuBLAS uses whichever
    /// is current; the ring makes no CUDA call for a resident block).
    fn bind(&self) -> Result<()> {
        self.stream().context().bind_to_thread().map_err(|e| dev("binding the context", e))
    }

    /// Start a forward call: the hidden states back to their seeded start, the
    /// conditioning vector through SiLU. Enqueued; the host does not wait.
    pub fn begin_step(&mut self) -> Result<()> {
        self.bind()?;
        let s = self.stream().clone();
        s.memcpy_dtod(&self.a.x0, &mut self.a.x).map_err(|e| dev("reset x", e))?;
        let (svec, vec, n) = (ptr(&self.a.svec), ptr(&self.a.vec), self.d.hidden() as i32);
        // SAFETY: both hold `hidden` bf16 (allocated in `new` for these sizes).
        unsafe { s.launch_builder(&self.k.silu).arg(&svec).arg(&vec).arg(&n).launch(grid(self.d.hidden())) }.map_err(|e| dev("silu", e))?;
        Ok(())
    }

    /// The hidden states after the blocks run so far, copied to the host
    /// (activations, not weights; waits for the compute stream).
    pub fn output(&self) -> Result<Vec<u16>> {
        self.bind()?;
        self.stream().clone_dtoh(&self.a.x).map_err(|e| dev("reading the output", e))
    }

    /// The device address of weight `name` in `block`, checked to be bf16 of
    /// exactly `elems` values.
    fn weight(&self, block: &BlockGuard<'_, CudaBackend>, name: &str, elems: usize) -> Result<u64> {
        let t = block.layout().get(name).ok_or_else(|| Error::BadTensor { tensor: name.into(), fault: "not in this block".into() })?;
        if t.spec.dtype != DType::BF16 || t.nbytes != 2 * elems {
            return Err(Error::BadTensor {
                tensor: t.spec.name.clone(),
                fault: format!("the reference model needs bf16 × {elems}, the block holds {:?} {:?}", t.spec.dtype, t.spec.shape),
            });
        }
        // Inside the slot (the kernels read every byte of it).
        block.slot().tensor_ptr(block.layout(), name)
    }

    /// A linear layer's weight `[out, k]` and bias `[out]`; an fp8 weight
    /// dequantised into the scratch buffer first (see the [module docs](self)).
    fn wb(&self, block: &BlockGuard<'_, CudaBackend>, name: &str, out: usize, k: usize) -> Result<(u64, u64)> {
        let wname = format!("{name}.weight");
        let bias = self.weight(block, &format!("{name}.bias"), out)?;
        match block.layout().get(&wname).map(|t| t.spec.dtype) {
            Some(dt @ (DType::F8_E4M3 | DType::F8_E5M2)) => Ok((self.dequantized(block, name, dt, out, k)?, bias)),
            _ => Ok((self.weight(block, &wname, out * k)?, bias)),
        }
    }

    /// The largest linear weight of these dimensions, in values.
    fn largest_linear(&self) -> usize {
        let (h, mlp) = (self.d.hidden(), self.d.mlp);
        (6 * h * h).max(mlp * h).max(h * (h + mlp))
    }

    /// fp8 weight `{name}.weight` (`[out, k]`, of `dtype`) dequantised into the
    /// scratch buffer by its scale, if the block holds one: its device address.
    fn dequantized(&self, block: &BlockGuard<'_, CudaBackend>, name: &str, dtype: DType, out: usize, k: usize) -> Result<u64> {
        let layout = block.layout();
        let wname = format!("{name}.weight");
        let w = layout.get(&wname).ok_or_else(|| Error::BadTensor { tensor: wname.clone(), fault: "not in this block".into() })?;
        let n = out * k;
        if w.nbytes != n {
            return Err(Error::BadTensor {
                tensor: w.spec.name.clone(),
                fault: format!("the reference model needs fp8 × {n}, the block holds {:?} {:?}", w.spec.dtype, w.spec.shape),
            });
        }
        // (address, values, kind: 1 f32, 2 bf16) of the scale, if any.
        let scale = match [format!("{name}.weight_scale"), format!("{name}.scale_weight")].iter().find_map(|s| layout.get(s)) {
            None => None,
            Some(t) => {
                let (kind, size) = match t.spec.dtype {
                    DType::F32 => (1, 4),
                    DType::BF16 => (2, 2),
                    other => {
                        return Err(Error::BadTensor {
                            tensor: t.spec.name.clone(),
                            fault: format!("a scale of dtype {other:?}: the reference model takes f32 or bf16 scales"),
                        })
                    }
                };
                let values = t.nbytes / size;
                if t.nbytes % size != 0 || (values != 1 && values != out) {
                    return Err(Error::BadTensor {
                        tensor: t.spec.name.clone(),
                        fault: format!("{} bytes of {:?}: one scale or one per output channel ({out}) expected", t.nbytes, t.spec.dtype),
                    });
                }
                Some((block.slot().tensor_ptr(layout, &t.spec.name)?, values, kind))
            }
        };
        if self.scratch.get().is_none() {
            let s = self.stream().alloc_zeros::<u16>(self.largest_linear()).map_err(|e| dev("fp8 scratch alloc", e))?;
            let _ = self.scratch.set(s);
        }
        let scratch = ptr(self.scratch.get().expect("set above"));
        if n > self.largest_linear() {
            return Err(Error::BadTensor {
                tensor: wname,
                fault: format!("{n} values, more than the scratch buffer's {}", self.largest_linear()),
            });
        }
        let wp = block.slot().tensor_ptr(layout, &wname)?;
        let (sp, per_channel, kind) = scale.map_or((0u64, 0i32, 0i32), |(p, v, kind)| (p, i32::from(v == out && out > 1), kind));
        let (n64, cols, e5m2) = (n as i64, k as i64, i32::from(dtype == DType::F8_E5M2));
        // The GEMM that reads the scratch is enqueued after this on the same stream.
        // SAFETY: `wp` holds `n` fp8 bytes and the scale 1 or `out` values of its kind
        // in the slot the guard keeps alive, the scratch at least `n` bf16 (checked).
        unsafe {
            self.stream()
                .launch_builder(&self.k.dequant_fp8)
                .arg(&scratch)
                .arg(&wp)
                .arg(&sp)
                .arg(&n64)
                .arg(&cols)
                .arg(&per_channel)
                .arg(&kind)
                .arg(&e5m2)
                .launch(grid(n))
        }
        .map_err(|e| dev("dequant_fp8", e))?;
        Ok(scratch)
    }

    fn check_guard(&self, block: &BlockGuard<'_, CudaBackend>) -> Result<()> {
        // The guard's wait was enqueued on its backend's compute stream: the
        // kernels here must run on that same stream to be ordered after it.
        if !Arc::ptr_eq(&block.backend().shared, &self.be.shared) {
            return Err(Error::Protocol(format!("{}: a block of another backend (its ring waits on another stream)", block.id())));
        }
        Ok(())
    }

    /// Row-major `Y[n, out] (ld ldy) = X[n, k] (ld ldx) · W[out, k]ᵀ`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, y: u64, ldy: usize, x: u64, ldx: usize, w: u64, n: usize, out: usize, k: usize) -> Result<()> {
        if self.skip_gemm {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Callers pass `y` with `n` rows of `ldy ≥ out` and `x` with `n` rows of
        // `ldx ≥ k` inside this model's activations, and `w` checked by `weight` to
        // hold `out × k` bf16 in a slot the guard keeps alive.
        // SAFETY: every pointer covers the sizes given (see above).
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                out as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                bsys::cudaDataType::CUDA_R_16BF,
                k as i32,
                x as *const _,
                bsys::cudaDataType::CUDA_R_16BF,
                ldx as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                bsys::cudaDataType::CUDA_R_16BF,
                ldy as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev("cublasGemmEx", e))
    }

    /// `Y = X · Wᵀ + b`, with GELU where `gelu`.
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        y: u64,
        ldy: usize,
        x: u64,
        ldx: usize,
        (w, bias): (u64, u64),
        n: usize,
        out: usize,
        k: usize,
        gelu: bool,
    ) -> Result<()> {
        self.gemm(y, ldy, x, ldx, w, n, out, k)?;
        let (rows, cols, ld, g) = (n as i64, out as i32, ldy as i32, i32::from(gelu));
        // SAFETY: `y` holds `n` rows of `ldy ≥ out` bf16; `bias` holds `out` bf16 (checked).
        unsafe {
            self.stream().launch_builder(&self.k.bias_act).arg(&y).arg(&bias).arg(&rows).arg(&cols).arg(&ld).arg(&g).launch(grid(n * out))
        }
        .map_err(|e| dev("bias_act", e))?;
        Ok(())
    }

    fn modulate(&self, out: u64, x: u64, rows: usize, shift: u64, scale: u64) -> Result<()> {
        let cols = self.d.hidden() as i32;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `x` and `out` hold `rows × hidden` bf16; shift and scale `hidden` each (in `modv`).
        unsafe { self.stream().launch_builder(&self.k.modulate).arg(&out).arg(&x).arg(&cols).arg(&shift).arg(&scale).launch(cfg) }
            .map_err(|e| dev("modulate_ln", e))?;
        Ok(())
    }

    fn rms(&self, y: u64, rows: usize, ld: usize, col0: usize, scale: u64) -> Result<()> {
        let heads = self.d.heads;
        let (r, l, c, h) = (rows as i64, ld as i32, col0 as i32, heads as i32);
        // `new` checked the grid; `scale` holds 128 bf16 (checked by `weight`).
        // SAFETY: `y` holds `rows × ld` bf16 with `heads` heads of 128 from `col0` (col0 + hidden ≤ ld).
        unsafe {
            self.stream().launch_builder(&self.k.rms).arg(&y).arg(&r).arg(&l).arg(&c).arg(&h).arg(&scale).launch(grid(rows * heads * 32))
        }
        .map_err(|e| dev("rms_heads", e))?;
        Ok(())
    }

    fn residual(&self, x: u64, y: u64, gate: u64, rows: usize, ldy: usize) -> Result<()> {
        let (r, c, l) = (rows as i64, self.d.hidden() as i32, ldy as i32);
        // SAFETY: `x` holds `rows × hidden`, `y` `rows × ldy` bf16, `gate` hidden bf16.
        unsafe {
            self.stream()
                .launch_builder(&self.k.residual)
                .arg(&x)
                .arg(&y)
                .arg(&gate)
                .arg(&r)
                .arg(&c)
                .arg(&l)
                .launch(grid(rows * self.d.hidden()))
        }
        .map_err(|e| dev("gated_residual", e))?;
        Ok(())
    }

    /// Column-major batched `C_i = op(A_i) · B_i` over the heads.
    fn batched(
        &self,
        what: &str,
        trans_a: bool,
        dims: (usize, usize, usize),
        a: (u64, usize, usize),
        b: (u64, usize, usize),
        c: (u64, usize, usize),
    ) -> Result<()> {
        if self.skip_gemm {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let op_a = if trans_a { bsys::cublasOperation_t::CUBLAS_OP_T } else { bsys::cublasOperation_t::CUBLAS_OP_N };
        let bf16 = bsys::cudaDataType::CUDA_R_16BF;
        // `attention` passes q, k, v inside `y`, the scores `s` (heads × T × T) and `o` (T × hidden).
        // SAFETY: the leading dimensions and strides given cover `heads` batches inside those buffers.
        unsafe {
            blas::gemm_strided_batched_ex(
                *self.blas.handle(),
                op_a,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                dims.0 as i32,
                dims.1 as i32,
                dims.2 as i32,
                &alpha as *const f32 as *const _,
                a.0 as *const _,
                bf16,
                a.1 as i32,
                a.2 as i64,
                b.0 as *const _,
                bf16,
                b.1 as i32,
                b.2 as i64,
                &beta as *const f32 as *const _,
                c.0 as *mut _,
                bf16,
                c.1 as i32,
                c.2 as i64,
                self.d.heads as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev(what, e))
    }

    /// Attention over q, k, v at columns 0, H, 2H of `y` (ld `ld`) into `o`.
    fn attention(&self, ld: usize) -> Result<()> {
        let (t, h) = (self.d.tokens(), self.d.hidden());
        let (y, s, o) = (ptr(&self.a.y), ptr(&self.a.s), ptr(&self.a.o));
        let (q, k, v) = (y, y + 2 * h as u64, y + 4 * h as u64);
        self.batched("QK^T", true, (t, t, HEAD_DIM), (k, ld, HEAD_DIM), (q, ld, HEAD_DIM), (s, t, t * t))?;
        let (cols, scale) = (t as i64, 1.0f32 / (HEAD_DIM as f32).sqrt());
        let cfg = LaunchConfig { grid_dim: ((self.d.heads * t) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the scores hold heads × T rows of T bf16.
        unsafe { self.stream().launch_builder(&self.k.softmax).arg(&s).arg(&cols).arg(&scale).launch(cfg) }
            .map_err(|e| dev("softmax", e))?;
        self.batched("PV", false, (HEAD_DIM, t, t), (v, ld, HEAD_DIM), (s, t, t * t), (o, h, HEAD_DIM))
    }

    /// One dual-stream block read from `block` (diffusers' names: `attn.to_q`,
    /// `attn.add_q_proj`, `attn.norm_q`, …, and `names`' per-stream parts).
    pub fn dual_block(&self, block: &BlockGuard<'_, CudaBackend>, names: &DualNames<'_>) -> Result<()> {
        self.check_guard(block)?;
        self.bind()?;
        let (h, mlp, e) = (self.d.hidden(), self.d.mlp, 2u64);
        let (svec, modv) = (ptr(&self.a.svec), ptr(&self.a.modv));
        // (modulation, q, k, v, q norm, k norm, out, mlp) per stream; text rows first.
        let streams = [
            (
                names.txt_mod,
                ["add_q_proj", "add_k_proj", "add_v_proj"],
                ["norm_added_q", "norm_added_k"],
                "to_add_out",
                names.txt_mlp,
                0,
                self.d.text_tokens,
            ),
            (
                names.img_mod,
                ["to_q", "to_k", "to_v"],
                ["norm_q", "norm_k"],
                "to_out.0",
                names.img_mlp,
                self.d.text_tokens,
                self.d.image_tokens,
            ),
        ];
        for (k, (m_name, qkv, norms, _, _, row0, n)) in streams.iter().enumerate() {
            let m = modv + (k * 6 * h) as u64 * e;
            self.linear(m, 6 * h, svec, h, self.wb(block, m_name, 6 * h, h)?, 1, 6 * h, h, false)?;
            let (x, xm) = (ptr(&self.a.x) + (row0 * h) as u64 * e, ptr(&self.a.xm) + (row0 * h) as u64 * e);
            self.modulate(xm, x, *n, m, m + h as u64 * e)?;
            let y = ptr(&self.a.y) + (row0 * 3 * h) as u64 * e;
            for (j, l) in qkv.iter().enumerate() {
                self.linear(y + (j * h) as u64 * e, 3 * h, xm, h, self.wb(block, &format!("attn.{l}"), h, h)?, *n, h, h, false)?;
            }
            self.rms(y, *n, 3 * h, 0, self.weight(block, &format!("attn.{}.weight", norms[0]), HEAD_DIM)?)?;
            self.rms(y, *n, 3 * h, h, self.weight(block, &format!("attn.{}.weight", norms[1]), HEAD_DIM)?)?;
        }
        self.attention(3 * h)?;
        for (k, (_, _, _, out, mlp_name, row0, n)) in streams.iter().enumerate() {
            let m = modv + (k * 6 * h) as u64 * e;
            let x = ptr(&self.a.x) + (row0 * h) as u64 * e;
            let o = ptr(&self.a.o) + (row0 * h) as u64 * e;
            let (tmp, tmp2, xm) = (ptr(&self.a.tmp), ptr(&self.a.tmp2), ptr(&self.a.xm));
            self.linear(tmp2, h, o, h, self.wb(block, &format!("attn.{out}"), h, h)?, *n, h, h, false)?;
            self.residual(x, tmp2, m + 2 * h as u64 * e, *n, h)?;
            self.modulate(xm, x, *n, m + 3 * h as u64 * e, m + 4 * h as u64 * e)?;
            self.linear(tmp, mlp, xm, h, self.wb(block, &format!("{mlp_name}.net.0.proj"), mlp, h)?, *n, mlp, h, true)?;
            self.linear(tmp2, h, tmp, mlp, self.wb(block, &format!("{mlp_name}.net.2"), h, mlp)?, *n, h, mlp, false)?;
            self.residual(x, tmp2, m + 5 * h as u64 * e, *n, h)?;
        }
        Ok(())
    }

    /// One single-stream block (Flux's: `norm.linear`, `attn.to_q/k/v`,
    /// `attn.norm_q/k`, `proj_mlp`, `proj_out`) over every token.
    pub fn single_block(&self, block: &BlockGuard<'_, CudaBackend>) -> Result<()> {
        self.check_guard(block)?;
        self.bind()?;
        let (t, h, mlp, e) = (self.d.tokens(), self.d.hidden(), self.d.mlp, 2u64);
        let (m, x, xm, y) = (ptr(&self.a.modv), ptr(&self.a.x), ptr(&self.a.xm), ptr(&self.a.y));
        let ld = 3 * h + mlp;
        self.linear(m, 3 * h, ptr(&self.a.svec), h, self.wb(block, "norm.linear", 3 * h, h)?, 1, 3 * h, h, false)?;
        self.modulate(xm, x, t, m, m + h as u64 * e)?;
        for (j, l) in ["attn.to_q", "attn.to_k", "attn.to_v"].iter().enumerate() {
            self.linear(y + (j * h) as u64 * e, ld, xm, h, self.wb(block, l, h, h)?, t, h, h, false)?;
        }
        self.linear(y + (3 * h) as u64 * e, ld, xm, h, self.wb(block, "proj_mlp", mlp, h)?, t, mlp, h, true)?;
        self.rms(y, t, ld, 0, self.weight(block, "attn.norm_q.weight", HEAD_DIM)?)?;
        self.rms(y, t, ld, h, self.weight(block, "attn.norm_k.weight", HEAD_DIM)?)?;
        self.attention(ld)?;
        // proj_out reads [attention out | gelu(mlp)]: the attention output goes where v was.
        let (o, yv) = (ptr(&self.a.o), y + 2 * h as u64 * e);
        let (ldd, lds, rows, cols) = (ld as i32, h as i32, t as i64, h as i32);
        // SAFETY: `y` holds T × ld bf16 (columns 2H..3H+MLP read below) and `o` T × H.
        unsafe {
            self.stream().launch_builder(&self.k.copy_cols).arg(&yv).arg(&ldd).arg(&o).arg(&lds).arg(&rows).arg(&cols).launch(grid(t * h))
        }
        .map_err(|e| dev("copy_cols", e))?;
        let tmp2 = ptr(&self.a.tmp2);
        self.linear(tmp2, h, yv, ld, self.wb(block, "proj_out", h, h + mlp)?, t, h, h + mlp, false)?;
        self.residual(x, tmp2, m + 2 * h as u64 * e, t, h)
    }
}

impl Drop for RefNet {
    fn drop(&mut self) {
        // Kernels of this model may still be queued: let them finish before the
        // module and the cuBLAS handle go (the activations are freed in stream order).
        if self.bind().is_ok() {
            let _ = self.stream().synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(heads: usize, mlp: usize, text_tokens: usize, image_tokens: usize) -> RefDims {
        RefDims { heads, mlp, text_tokens, image_tokens }
    }

    #[test]
    fn sizes_that_could_wrap_or_overrun_a_launch_are_refused() {
        // Flux-dev at 1024² and 2048², Qwen-Image at 1328²: accepted.
        for d in [dims(24, 12288, 512, 4096), dims(24, 12288, 512, 16384), dims(24, 12288, 512, 6889)] {
            d.check().unwrap();
        }
        // Token counts whose sum wraps to 4 in release builds.
        let wrap = dims(1, 1, usize::MAX - (1 << 32) + 1001, (1 << 32) - 996);
        assert!(wrap.check().unwrap_err().to_string().contains("2^20"));
        assert!(dims(1 << 57, 1, 1, 1).check().is_err());
        assert!(dims(0, 1, 1, 1).check().is_err());
        assert!(dims(24, 12288, 0, 4096).check().is_err());
        // Within every field bound, but too many (row, head) warps for one launch.
        let e = dims(40, 13824, 512, 32760).check().unwrap_err().to_string();
        assert!(e.contains("RMS-norm launch"), "{e}");
    }

    #[test]
    fn activation_bytes_count_every_buffer() {
        let d = dims(1, 256, 2, 2);
        let (t, h, mlp) = (4u64, 128u64, 256u64);
        let elems = 2 * t * h + t * (3 * h + mlp) + 2 * t * h + t * mlp + t * t + 2 * h + 12 * h + t * h;
        assert_eq!(d.activation_bytes(), 2 * elems);
    }

    /// The kernels' source compiles with NVRTC (no GPU needed, only libnvrtc).
    #[test]
    fn kernels_compile_with_nvrtc() {
        crate::nvrtc::check::compiles("the reference model", KERNELS);
    }
}
