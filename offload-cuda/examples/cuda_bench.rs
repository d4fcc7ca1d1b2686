//! The cuda benchmark: a synthetic transformer with Flux-dev's block shapes (19
//! double blocks, 38 single blocks, hidden 3072, MLP 12288, bf16, random weights)
//! whose compute is real — cuBLAS GEMMs for every linear layer, attention as
//! batched GEMMs around an NVRTC softmax, plus LayerNorm-modulation, QK RMSNorm,
//! GELU and gated residual kernels — run all-resident and streamed (d = 1, 2) in
//! one process, with the pinned host-to-device bandwidth measured in the same run.
//!
//! `cuda_bench [--resolutions 1024,2048] [--depths 1,2] [--steps 5] [--double 19]
//! [--single 38] [--out results.json]`. Needs a CUDA GPU; built by
//! `cargo xtask gpu-bundle`, run by `.bundle/gpu-run.sh` on the GPU runner.

use cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use cudarc::driver::{sys, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use offload_core::{
    resolve, BlockDiscovery, DType, DeclaredStacks, Error, HostStore, OffloadBackend, Plan, Result, Ring, TensorSource, TensorSpec,
};
use offload_core::{ResidentPolicy, Strategy};
use offload_cuda::{CudaBackend, CudaBlockExt};
use offload_plan::{BlockCost, CostModel};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// `--no-gemm`: skip cuBLAS (for compute-sanitizer runs over this crate's own kernels).
static SKIP_GEMM: AtomicBool = AtomicBool::new(false);

const H: usize = 3072;
const MLP: usize = 12288;
const HEADS: usize = 24;
const HD: usize = 128;
const TXT: usize = 512;
/// `gelu_from` of a linear layer without GELU.
const NO_GELU: usize = i32::MAX as usize;

const KERNELS: &str = r#"
typedef unsigned short bf16;
__device__ __forceinline__ float f(bf16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ bf16 b(float x) { unsigned u = __float_as_uint(x); u += 0x7FFFu + ((u >> 16) & 1u); return (bf16)(u >> 16); }
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x))); }

extern "C" __global__ void bias_act(bf16* y, const bf16* bias, long long rows, int cols, int ld, int gelu_from) {
    long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols; int c = (int)(i % cols);
        float v = f(y[r * ld + c]) + f(bias[c]);
        if (c >= gelu_from) v = gelu(v);
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
// One warp per (row, head): RMSNorm over 128 dims of q (col0) or k (col0 + heads*128).
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
extern "C" __global__ void copy_cols(bf16* dst, int ldd, const bf16* src, int lds, long long rows, int cols) {
    long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols; int c = (int)(i % cols);
        dst[r * ldd + c] = src[r * lds + c];
    }
}
"#;

fn dev(during: &str, e: impl std::fmt::Display) -> Error {
    Error::device("cuda", during, e)
}

/// Flux-dev's block tensors (names and shapes as in the checkpoint), bf16.
fn flux_specs(double: usize, single: usize) -> Vec<TensorSpec> {
    let mut v = Vec::new();
    let mut t = |name: String, shape: Vec<usize>| v.push(TensorSpec::new(name, DType::BF16, shape));
    for i in 0..double {
        for s in ["img", "txt"] {
            let p = format!("double_blocks.{i}.{s}");
            t(format!("{p}_mod.lin.weight"), vec![6 * H, H]);
            t(format!("{p}_mod.lin.bias"), vec![6 * H]);
            t(format!("{p}_attn.qkv.weight"), vec![3 * H, H]);
            t(format!("{p}_attn.qkv.bias"), vec![3 * H]);
            t(format!("{p}_attn.norm.query_norm.scale"), vec![HD]);
            t(format!("{p}_attn.norm.key_norm.scale"), vec![HD]);
            t(format!("{p}_attn.proj.weight"), vec![H, H]);
            t(format!("{p}_attn.proj.bias"), vec![H]);
            t(format!("{p}_mlp.0.weight"), vec![MLP, H]);
            t(format!("{p}_mlp.0.bias"), vec![MLP]);
            t(format!("{p}_mlp.2.weight"), vec![H, MLP]);
            t(format!("{p}_mlp.2.bias"), vec![H]);
        }
    }
    for i in 0..single {
        let p = format!("single_blocks.{i}");
        t(format!("{p}.linear1.weight"), vec![3 * H + MLP, H]);
        t(format!("{p}.linear1.bias"), vec![3 * H + MLP]);
        t(format!("{p}.linear2.weight"), vec![H, H + MLP]);
        t(format!("{p}.linear2.bias"), vec![H]);
        t(format!("{p}.norm.query_norm.scale"), vec![HD]);
        t(format!("{p}.norm.key_norm.scale"), vec![HD]);
        t(format!("{p}.modulation.lin.weight"), vec![3 * H, H]);
        t(format!("{p}.modulation.lin.bias"), vec![3 * H]);
    }
    v
}

/// Random bf16 weights generated on the fly, straight into the pinned buffers
/// (no second copy of 22 GiB): magnitudes in [2^-8, 2^-4), random signs; norm
/// scales near 1.
struct RandomWeights {
    specs: Vec<TensorSpec>,
    seed: u64,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl TensorSource for RandomWeights {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let scale = self.specs[index].name.ends_with(".scale");
        let base = splitmix(self.seed ^ (index as u64).wrapping_mul(0x1000_0001));
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).min(32);
        let chunk = dst.len().div_ceil(threads).next_multiple_of(8).max(8);
        std::thread::scope(|s| {
            for (c, part) in dst.chunks_mut(chunk).enumerate() {
                s.spawn(move || {
                    let mut x = splitmix(base ^ c as u64);
                    for pair in part.chunks_mut(8) {
                        x = splitmix(x);
                        for (k, e) in pair.chunks_mut(2).enumerate() {
                            let r = (x >> (16 * k)) as u16;
                            let v: u16 = if scale {
                                0x3F80 | (r & 0x7F) // [1, 2)
                            } else {
                                (r & 0x8000) | ((119 + ((r >> 7) & 3)) << 7) | (r & 0x7F)
                            };
                            e.copy_from_slice(&v.to_le_bytes()[..e.len()]);
                        }
                    }
                });
            }
        });
        Ok(())
    }
}

struct Kernels {
    bias_act: CudaFunction,
    silu: CudaFunction,
    modulate: CudaFunction,
    rms: CudaFunction,
    softmax: CudaFunction,
    residual: CudaFunction,
    copy_cols: CudaFunction,
}

/// Activations and scratch for one resolution.
struct Acts {
    t: usize,
    x: CudaSlice<u16>,    // [T, H] hidden: text rows first, then image rows
    xm: CudaSlice<u16>,   // [T, H] modulated input
    y: CudaSlice<u16>,    // [T, 7H] qkv / linear1 output
    o: CudaSlice<u16>,    // [T, H] attention output
    tmp: CudaSlice<u16>,  // [T, MLP] mlp hidden
    tmp2: CudaSlice<u16>, // [T, H]
    s: CudaSlice<u16>,    // [HEADS, T, T] scores
    vec: CudaSlice<u16>,  // [H]
    svec: CudaSlice<u16>, // [H]
    modv: CudaSlice<u16>, // [6H] x 2
    x0: CudaSlice<u16>,
}

fn ptr<T>(s: &CudaSlice<T>) -> u64 {
    let (p, _) = cudarc::driver::DevicePtr::device_ptr(s, s.stream());
    p
}

struct Model {
    be: CudaBackend,
    blas: CudaBlas,
    k: Kernels,
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(256).clamp(1, 65535) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// The compute stream.
fn compute(be: &CudaBackend) -> &Arc<CudaStream> {
    // SAFETY: the bench's own cudarc memory (activations, weights of the resident
    // run) is used on the compute stream only; slot memory is ordered by the ring.
    unsafe { be.compute_stream() }
}

/// The copy stream (the bandwidth probe's copies and events).
fn copy_stream(be: &CudaBackend) -> &Arc<CudaStream> {
    // SAFETY: only raw copies into a slot and events are put on it; no cudarc
    // slice is shared with another stream.
    unsafe { be.copy_stream() }
}

/// The context (modules, events, the device name).
fn context(be: &CudaBackend) -> &Arc<cudarc::driver::CudaContext> {
    // SAFETY: as for `compute`: no cudarc slice is used on two streams.
    unsafe { be.ctx() }
}

impl Model {
    fn stream(&self) -> &Arc<CudaStream> {
        compute(&self.be)
    }

    /// Row-major `Y[n, out] (ld ldy) = X[n, k] (ld ldx) · W[out, k]ᵀ`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, y: u64, ldy: usize, x: u64, ldx: usize, w: u64, n: usize, out: usize, k: usize) -> Result<()> {
        if SKIP_GEMM.load(Ordering::Relaxed) {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the pointers address live device buffers of the sizes given
        // (weights in a slot the ring holds, activations allocated above).
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

    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        y: u64,
        ldy: usize,
        x: u64,
        ldx: usize,
        w: u64,
        bias: u64,
        n: usize,
        out: usize,
        k: usize,
        gelu_from: usize,
    ) -> Result<()> {
        self.gemm(y, ldy, x, ldx, w, n, out, k)?;
        let (rows, cols, ld, gf) = (n as i64, out as i32, ldy as i32, gelu_from as i32);
        // SAFETY: `y` holds `n` rows of `ldy` bf16, `bias` holds `out` bf16.
        unsafe {
            self.stream().launch_builder(&self.k.bias_act).arg(&y).arg(&bias).arg(&rows).arg(&cols).arg(&ld).arg(&gf).launch(grid(n * out))
        }
        .map_err(|e| dev("bias_act", e))?;
        Ok(())
    }

    fn modulate(&self, out: u64, x: u64, rows: usize, shift: u64, scale: u64) -> Result<()> {
        let cols = H as i32;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `x` and `out` hold `rows × H` bf16; shift and scale hold H bf16.
        unsafe { self.stream().launch_builder(&self.k.modulate).arg(&out).arg(&x).arg(&cols).arg(&shift).arg(&scale).launch(cfg) }
            .map_err(|e| dev("modulate_ln", e))?;
        Ok(())
    }

    fn rms(&self, y: u64, rows: usize, ld: usize, col0: usize, scale: u64) -> Result<()> {
        if (rows * HEADS * 32).div_ceil(256) > 65535 {
            return Err(Error::Plan(format!("rms_heads: {rows} rows exceed one launch")));
        }
        let (r, l, c, h) = (rows as i64, ld as i32, col0 as i32, HEADS as i32);
        // SAFETY: `y` holds `rows × ld` bf16 with 24 heads of 128 from `col0`; scale holds 128.
        unsafe {
            self.stream().launch_builder(&self.k.rms).arg(&y).arg(&r).arg(&l).arg(&c).arg(&h).arg(&scale).launch(grid(rows * HEADS * 32))
        }
        .map_err(|e| dev("rms_heads", e))?;
        Ok(())
    }

    fn residual(&self, x: u64, y: u64, gate: u64, rows: usize, ldy: usize) -> Result<()> {
        let (r, c, l) = (rows as i64, H as i32, ldy as i32);
        // SAFETY: `x` holds `rows × H`, `y` `rows × ldy` bf16, gate H bf16.
        unsafe { self.stream().launch_builder(&self.k.residual).arg(&x).arg(&y).arg(&gate).arg(&r).arg(&c).arg(&l).launch(grid(rows * H)) }
            .map_err(|e| dev("gated_residual", e))?;
        Ok(())
    }

    /// Column-major batched `C_i = op(A_i) · B_i` over bf16 with f32 accumulation:
    /// `dims = (m, n, k)`, each operand as (pointer, leading dimension, batch stride).
    #[allow(clippy::too_many_arguments)]
    fn batched(
        &self,
        what: &str,
        trans_a: bool,
        dims: (usize, usize, usize),
        a: (u64, usize, usize),
        b: (u64, usize, usize),
        c: (u64, usize, usize),
    ) -> Result<()> {
        if SKIP_GEMM.load(Ordering::Relaxed) {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let op_a = if trans_a { bsys::cublasOperation_t::CUBLAS_OP_T } else { bsys::cublasOperation_t::CUBLAS_OP_N };
        let bf16 = bsys::cudaDataType::CUDA_R_16BF;
        // SAFETY: callers pass live device buffers whose leading dimensions and batch
        // strides cover `HEADS` batches of the given sizes.
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
                HEADS as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| dev(what, e))
    }

    /// Attention over `qkv [T, 3H]` (ld `ld`) into `o [T, H]`.
    fn attention(&self, a: &Acts, qkv: u64, ld: usize) -> Result<()> {
        let t = a.t;
        let (s, o) = (ptr(&a.s), ptr(&a.o));
        let (q, k, v) = (qkv, qkv + 2 * H as u64, qkv + 4 * H as u64);
        // Scores S_h = Q_h · K_hᵀ, one T × T matrix per head.
        self.batched("QK^T", true, (t, t, HD), (k, ld, HD), (q, ld, HD), (s, t, t * t))?;
        let (cols, scale) = (t as i64, 1.0f32 / (HD as f32).sqrt());
        let cfg = LaunchConfig { grid_dim: ((HEADS * t) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: scores hold HEADS × T rows of T bf16.
        unsafe { self.stream().launch_builder(&self.k.softmax).arg(&s).arg(&cols).arg(&scale).launch(cfg) }
            .map_err(|e| dev("softmax", e))?;
        // O_h = P_h · V_h, written into the head's columns of `o`.
        self.batched("PV", false, (HD, t, t), (v, ld, HD), (s, t, t * t), (o, H, HD))
    }

    fn double_block(&self, a: &Acts, w: &dyn Fn(&str) -> Result<u64>) -> Result<()> {
        let (t, ni) = (a.t, a.t - TXT);
        let e = 2u64; // bytes per bf16
        let svec = ptr(&a.svec);
        let modv = ptr(&a.modv);
        let streams = [("txt", 0usize, TXT), ("img", TXT, ni)];
        for (k, (s, row0, n)) in streams.iter().enumerate() {
            let m = modv + (k * 6 * H) as u64 * e;
            self.linear(m, 6 * H, svec, H, w(&format!("{s}_mod.lin.weight"))?, w(&format!("{s}_mod.lin.bias"))?, 1, 6 * H, H, NO_GELU)?;
            let x = ptr(&a.x) + (row0 * H) as u64 * e;
            let xm = ptr(&a.xm) + (row0 * H) as u64 * e;
            self.modulate(xm, x, *n, m, m + H as u64 * e)?;
            let y = ptr(&a.y) + (row0 * 3 * H) as u64 * e;
            self.linear(y, 3 * H, xm, H, w(&format!("{s}_attn.qkv.weight"))?, w(&format!("{s}_attn.qkv.bias"))?, *n, 3 * H, H, NO_GELU)?;
            self.rms(y, *n, 3 * H, 0, w(&format!("{s}_attn.norm.query_norm.scale"))?)?;
            self.rms(y, *n, 3 * H, H, w(&format!("{s}_attn.norm.key_norm.scale"))?)?;
        }
        self.attention(a, ptr(&a.y), 3 * H)?;
        let _ = t;
        for (k, (s, row0, n)) in streams.iter().enumerate() {
            let m = modv + (k * 6 * H) as u64 * e;
            let x = ptr(&a.x) + (row0 * H) as u64 * e;
            let o = ptr(&a.o) + (row0 * H) as u64 * e;
            let tmp2 = ptr(&a.tmp2);
            self.linear(tmp2, H, o, H, w(&format!("{s}_attn.proj.weight"))?, w(&format!("{s}_attn.proj.bias"))?, *n, H, H, NO_GELU)?;
            self.residual(x, tmp2, m + 2 * H as u64 * e, *n, H)?;
            let xm = ptr(&a.xm);
            self.modulate(xm, x, *n, m + 3 * H as u64 * e, m + 4 * H as u64 * e)?;
            let tmp = ptr(&a.tmp);
            self.linear(tmp, MLP, xm, H, w(&format!("{s}_mlp.0.weight"))?, w(&format!("{s}_mlp.0.bias"))?, *n, MLP, H, 0)?;
            self.linear(tmp2, H, tmp, MLP, w(&format!("{s}_mlp.2.weight"))?, w(&format!("{s}_mlp.2.bias"))?, *n, H, MLP, NO_GELU)?;
            self.residual(x, tmp2, m + 5 * H as u64 * e, *n, H)?;
        }
        Ok(())
    }

    fn single_block(&self, a: &Acts, w: &dyn Fn(&str) -> Result<u64>) -> Result<()> {
        let t = a.t;
        let e = 2u64;
        let (m, x, xm, y) = (ptr(&a.modv), ptr(&a.x), ptr(&a.xm), ptr(&a.y));
        let ld = 3 * H + MLP;
        self.linear(m, 3 * H, ptr(&a.svec), H, w("modulation.lin.weight")?, w("modulation.lin.bias")?, 1, 3 * H, H, NO_GELU)?;
        self.modulate(xm, x, t, m, m + H as u64 * e)?;
        self.linear(y, ld, xm, H, w("linear1.weight")?, w("linear1.bias")?, t, ld, H, 3 * H)?;
        self.rms(y, t, ld, 0, w("norm.query_norm.scale")?)?;
        self.rms(y, t, ld, H, w("norm.key_norm.scale")?)?;
        self.attention(a, y, ld)?;
        // linear2 reads [attention out | gelu(mlp)]: put the attention output where V was.
        let (o, yv) = (ptr(&a.o), y + 2 * H as u64 * e);
        let (ldd, lds, rows, cols) = (ld as i32, H as i32, t as i64, H as i32);
        // SAFETY: `y` holds T × ld bf16 and `o` T × H.
        unsafe {
            self.stream().launch_builder(&self.k.copy_cols).arg(&yv).arg(&ldd).arg(&o).arg(&lds).arg(&rows).arg(&cols).launch(grid(t * H))
        }
        .map_err(|e| dev("copy_cols", e))?;
        let tmp2 = ptr(&a.tmp2);
        self.linear(tmp2, H, yv, ld, w("linear2.weight")?, w("linear2.bias")?, t, H, H + MLP, NO_GELU)?;
        self.residual(x, tmp2, m + 2 * H as u64 * e, t, H)
    }

    fn acts(&self, t: usize, seed: u64) -> Result<Acts> {
        let s = self.stream();
        let z = |n: usize| s.alloc_zeros::<u16>(n).map_err(|e| dev("activation alloc", e));
        let rnd = |n: usize, k: u64| -> Vec<u16> {
            (0..n)
                .map(|i| {
                    let r = splitmix(seed ^ k ^ (i as u64)) as u16;
                    (r & 0x8000) | ((125 + ((r >> 7) & 1)) << 7) | (r & 0x7F)
                })
                .collect()
        };
        let x0 = rnd(t * H, 1);
        Ok(Acts {
            t,
            x: s.clone_htod(&x0).map_err(|e| dev("x", e))?,
            x0: s.clone_htod(&x0).map_err(|e| dev("x0", e))?,
            xm: z(t * H)?,
            y: z(t * (3 * H + MLP))?,
            o: z(t * H)?,
            tmp: z(t * MLP)?,
            tmp2: z(t * H)?,
            s: z(HEADS * t * t)?,
            vec: s.clone_htod(&rnd(H, 2)).map_err(|e| dev("vec", e))?,
            svec: z(H)?,
            modv: z(12 * H)?,
        })
    }
}

struct StepTiming {
    step_s: f64,
    stall_s: f64,
    /// Per block: compute time (from the end of its wait to the start of the next block's).
    block_compute_s: Vec<f64>,
}

fn timing_event(be: &CudaBackend) -> Result<CudaEvent> {
    context(be).new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| dev("event", e))
}

fn elapsed(a: &CudaEvent, b: &CudaEvent) -> Result<f64> {
    Ok(a.elapsed_ms(b).map_err(|e| dev("elapsed", e))? as f64 / 1e3)
}

/// Enqueue one denoising step through `ring`; events bracket each wait of the
/// compute stream for a block (the exposed stall). Nothing here blocks the host.
fn enqueue_step(
    model: &Model,
    ring: &mut Ring<CudaBackend>,
    a: &mut Acts,
    double: usize,
    single: usize,
) -> Result<(Vec<(CudaEvent, CudaEvent)>, offload_core::StepMetrics)> {
    let be = &model.be;
    let s = compute(be);
    s.memcpy_dtod(&a.x0, &mut a.x).map_err(|e| dev("reset x", e))?;
    let (svec, vec, n) = (ptr(&a.svec), ptr(&a.vec), H as i32);
    // SAFETY: both hold H bf16.
    unsafe { s.launch_builder(&model.k.silu).arg(&svec).arg(&vec).arg(&n).launch(grid(H)) }.map_err(|e| dev("silu", e))?;
    let mut stalls = Vec::with_capacity(double + single);
    for (stack, count) in [("double_blocks", double), ("single_blocks", single)] {
        for i in 0..count {
            let before = timing_event(be)?;
            before.record(s).map_err(|e| dev("record", e))?;
            let block = ring.block(stack, i)?;
            let after = timing_event(be)?;
            after.record(s).map_err(|e| dev("record", e))?;
            stalls.push((before, after));
            let w = |name: &str| block.tensor_ptr(name);
            if stack == "double_blocks" {
                model.double_block(a, &w)?;
            } else {
                model.single_block(a, &w)?;
            }
            block.finish()?;
        }
    }
    let metrics = ring.end_step()?;
    Ok((stalls, metrics))
}

/// A warm-up step, then `steps` steps enqueued back to back (no host sync between
/// them, as in a real denoising loop); times come from events read at the end.
fn run_steps(
    model: &Model,
    ring: &mut Ring<CudaBackend>,
    a: &mut Acts,
    double: usize,
    single: usize,
    steps: usize,
) -> Result<Vec<StepTiming>> {
    let s = compute(&model.be);
    enqueue_step(model, ring, a, double, single)?;
    s.synchronize().map_err(|e| dev("warm-up", e))?;
    let mut bounds = vec![timing_event(&model.be)?];
    bounds[0].record(s).map_err(|e| dev("record", e))?;
    let mut stalls = Vec::new();
    for _ in 0..steps {
        stalls.push(enqueue_step(model, ring, a, double, single)?.0);
        let e = timing_event(&model.be)?;
        e.record(s).map_err(|e| dev("record", e))?;
        bounds.push(e);
    }
    let mut out = Vec::new();
    for (k, st) in stalls.iter().enumerate() {
        let mut stall_s = 0.0;
        let mut block_compute_s = Vec::with_capacity(st.len());
        for (j, (b, e)) in st.iter().enumerate() {
            stall_s += elapsed(b, e)?;
            let next = if j + 1 < st.len() { &st[j + 1].0 } else { &bounds[k + 1] };
            block_compute_s.push(elapsed(e, next)?);
        }
        out.push(StepTiming { step_s: elapsed(&bounds[k], &bounds[k + 1])?, stall_s, block_compute_s });
    }
    Ok(out)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn arg_list(args: &[String], name: &str, default: &str) -> Vec<usize> {
    let v = args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(String::as_str).unwrap_or(default);
    v.split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

/// One plan's run: per-step timings, the output, peak device bytes, the ring's
/// metrics and the depth the ring ran at.
type PlanRun = (Vec<StepTiming>, Vec<u16>, u64, offload_core::StepMetrics, usize);

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let resolutions = arg_list(&args, "--resolutions", "1024,2048");
    let depths = arg_list(&args, "--depths", "1,2");
    let steps = arg_list(&args, "--steps", "5")[0];
    let double = arg_list(&args, "--double", "19")[0];
    let single = arg_list(&args, "--single", "38")[0];
    let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
    let budgets: Vec<usize> = if args.iter().any(|a| a == "--budgets") { arg_list(&args, "--budgets", "") } else { Vec::new() };
    SKIP_GEMM.store(args.iter().any(|a| a == "--no-gemm"), Ordering::Relaxed);
    let trace = args.iter().position(|a| a == "--trace").and_then(|i| args.get(i + 1)).cloned();
    let traced = std::cell::Cell::new(false);
    let timeline_metrics: std::cell::RefCell<Option<offload_core::StepMetrics>> = std::cell::RefCell::new(None);
    let commit = args.iter().position(|a| a == "--commit").and_then(|i| args.get(i + 1)).cloned().unwrap_or_default();

    let be = CudaBackend::new(0)?;
    let gpu = context(&be).name().unwrap_or_default();
    eprintln!("device: {gpu}");
    let ptx = cudarc::nvrtc::compile_ptx(KERNELS).map_err(|e| dev("NVRTC", e))?;
    let module = context(&be).load_module(ptx).map_err(|e| dev("load module", e))?;
    let f = |n: &str| module.load_function(n).map_err(|e| dev(n, e));
    let k = Kernels {
        bias_act: f("bias_act")?,
        silu: f("silu_vec")?,
        modulate: f("modulate_ln")?,
        rms: f("rms_heads")?,
        softmax: f("softmax_rows")?,
        residual: f("gated_residual")?,
        copy_cols: f("copy_cols")?,
    };
    let blas = CudaBlas::new(compute(&be).clone()).map_err(|e| dev("cuBLAS", e))?;
    let model = Model { be: be.clone(), blas, k };

    let t0 = Instant::now();
    let source = RandomWeights { specs: flux_specs(double, single), seed: 0xF1_0D_E5 };
    let inventory = DeclaredStacks::new(["double_blocks", "single_blocks"]).discover("transformer", source.specs())?;
    let store = Arc::new(HostStore::build(&be, &inventory, &source)?);
    let total_bytes = store.host_bytes();
    eprintln!(
        "host store: {:.2} GiB pinned in {} blocks (largest {:.1} MiB) in {:.1} s",
        total_bytes as f64 / (1u64 << 30) as f64,
        store.blocks().len(),
        store.largest_block_bytes() as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );

    // Pinned host-to-device bandwidth, measured in this run: every block copied
    // once into one slot on the copy stream, twice over, the second pass timed.
    let bandwidth = {
        let mut slot = be.alloc_slot(store.largest_block_bytes(), "bandwidth probe")?;
        let c = copy_stream(&be);
        let mut best = 0.0f64;
        for _pass in 0..3 {
            let (a, b) = (timing_event(&be)?, timing_event(&be)?);
            a.record(c).map_err(|e| dev("record", e))?;
            for blk in store.blocks() {
                be.copy_to_slot(&blk.buffer, &mut slot, blk.bytes(), None)?;
            }
            b.record(c).map_err(|e| dev("record", e))?;
            let s = elapsed(&a, &b)?;
            best = best.max(total_bytes as f64 / s);
        }
        be.free_slot(slot, None)?;
        be.synchronize()?;
        best
    };
    eprintln!("pinned H2D bandwidth: {:.1} GB/s", bandwidth / 1e9);

    let mut cases = Vec::new();
    // Progress on a terminal (hidden when the output is piped, as on the runner).
    let progress = indicatif::ProgressBar::new((resolutions.len() * (1 + depths.len() + budgets.len())) as u64);
    for &res in &resolutions {
        let t = (res / 16) * (res / 16) + TXT;
        let mut a = model.acts(t, res as u64)?;
        let run_plan = |plan: &Plan, a: &mut Acts| -> Result<PlanRun> {
            let rc = resolve(plan, std::slice::from_ref(&inventory))?.components.remove(0);
            be.synchronize()?;
            be.reset_peak();
            let base = be.counters().live_bytes;
            let mut ring = Ring::new(be.clone(), store.clone(), &rc)?;
            let depth = ring.depth();
            let times = run_steps(&model, &mut ring, a, double, single, steps)?;
            let m = ring.metrics();
            let outv = compute(&be).clone_dtoh(&a.x).map_err(|e| dev("read output", e))?;
            // One more step with the timeline on (after the timed ones, which it would perturb).
            if let (Some(path), Strategy::Layerwise) = (&trace, rc.strategy) {
                if rc.depth == 1 && rc.resident.is_empty() && !traced.get() {
                    traced.set(true);
                    ring.enable_timeline()?;
                    let (_, tm) = enqueue_step(&model, &mut ring, a, double, single)?;
                    eprintln!("timeline step: {tm}");
                    if let Some(tl) = ring.timeline() {
                        tl.write_chrome_trace(path).map_err(|e| Error::Io { path: path.into(), source: e })?;
                    }
                    *timeline_metrics.borrow_mut() = Some(tm);
                }
            }
            ring.close()?;
            be.synchronize()?;
            progress.inc(1);
            Ok((times, outv, be.counters().peak_bytes - base, m, depth))
        };
        let (rt, rout, rpeak, _, _) = run_plan(&Plan::resident(), &mut a)?;
        let resident_s = median(rt.iter().map(|s| s.step_s).collect());
        eprintln!("{res}x{res}: resident step {:.4} s", resident_s);
        // Calibration from the resident run: per-block compute (median over steps) and the bandwidth.
        let cost = CostModel {
            bandwidth_bytes_per_s: bandwidth,
            blocks: store
                .blocks()
                .iter()
                .enumerate()
                .map(|(j, b)| BlockCost {
                    id: b.id.to_string(),
                    bytes: b.bytes() as u64,
                    compute_s: median(rt.iter().map(|s| s.block_compute_s[j]).collect()),
                })
                .collect(),
            non_block_bytes: 0,
            source: format!("{gpu}, {res}x{res}, resident run of this benchmark"),
        };
        if let Some(dir) = out.as_ref().and_then(|o| std::path::Path::new(o).parent()) {
            let p = dir.join(format!("calibration-{res}.json"));
            std::fs::write(&p, cost.to_json()).map_err(|e| Error::Io { path: p.clone(), source: e })?;
        }
        for &gib in &budgets {
            let budget = (gib as u64) << 30;
            let choice = offload_plan::plan(&cost, budget, 1, ResidentPolicy::Auto)?;
            let resident_blocks: Vec<String> = choice.resident_ids(&cost).iter().map(|s| s.to_string()).collect();
            let cp = choice.component_plan(&cost, budget);
            let (st, sout, speak, m, ran_depth) = run_plan(&Plan::layerwise().component("transformer", cp), &mut a)?;
            if ran_depth != choice.depth {
                return Err(Error::Plan(format!("budget {gib} GiB: the ring ran at depth {ran_depth}, the plan chose {}", choice.depth)));
            }
            let streamed_s = median(st.iter().map(|s| s.step_s).collect());
            let bound = resident_s.max(choice.streamed_bytes as f64 / bandwidth);
            let err = (streamed_s - choice.predicted_step_s) / choice.predicted_step_s;
            eprintln!(
                "{res}x{res} budget {gib} GiB: {} resident, streamed {:.4} s, predicted {:.4} s ({:+.1} %), bound {:.4} s, ratio {:.4}, peak {:.2} GiB, bitwise_equal {}",
                resident_blocks.len(), streamed_s, choice.predicted_step_s, err * 100.0, bound, streamed_s / bound, speak as f64 / (1u64 << 30) as f64, sout == rout
            );
            cases.push(serde_json::json!({
                "resolution": res, "tokens": t, "batch": 1, "depth": choice.depth, "budget_bytes": budget,
                "resident_blocks": resident_blocks, "step_resident_s": resident_s, "step_streamed_s": streamed_s,
                "steps_streamed_s": st.iter().map(|s| s.step_s).collect::<Vec<_>>(),
                "predicted_step_s": choice.predicted_step_s, "prediction_error": err, "within_10pct_of_prediction": err.abs() <= 0.10,
                "bandwidth_gbps": bandwidth / 1e9, "streamed_bytes": choice.streamed_bytes,
                "bound_s": bound, "ratio_to_bound": streamed_s / bound,
                "exposed_stall_s": median(st.iter().map(|s| s.stall_s).collect()),
                "peak_device_bytes": speak, "planned_device_bytes": choice.device_bytes, "peak_within_budget": speak <= budget,
                "bitwise_equal": sout == rout, "misses": m.misses,
            }));
        }
        for &d in &depths {
            let (st, sout, speak, m, _) = run_plan(&Plan::layerwise().prefetch_depth(d), &mut a)?;
            let streamed_s = median(st.iter().map(|s| s.step_s).collect());
            let stall_s = median(st.iter().map(|s| s.stall_s).collect());
            let streamed_bytes = total_bytes;
            let bound = resident_s.max(streamed_bytes as f64 / bandwidth);
            let equal = sout == rout;
            let largest = store.largest_block_bytes() as u64;
            eprintln!(
                "{res}x{res} d={d}: streamed {:.4} s, bound {:.4} s, ratio {:.4}, stall {:.4} s, peak {:.2} GiB, bitwise_equal {equal}, misses {}",
                streamed_s,
                bound,
                streamed_s / bound,
                stall_s,
                speak as f64 / (1u64 << 30) as f64,
                m.misses
            );
            cases.push(serde_json::json!({
                "resolution": res, "tokens": t, "batch": 1, "depth": d, "budget_bytes": null,
                "step_resident_s": resident_s, "step_streamed_s": streamed_s,
                "steps_resident_s": rt.iter().map(|s| s.step_s).collect::<Vec<_>>(),
                "steps_streamed_s": st.iter().map(|s| s.step_s).collect::<Vec<_>>(),
                "bandwidth_gbps": bandwidth / 1e9, "streamed_bytes": streamed_bytes,
                "bound_s": bound, "ratio_to_bound": streamed_s / bound,
                "exposed_stall_s": stall_s,
                "peak_device_bytes": speak, "peak_device_bytes_resident": rpeak,
                "peak_bound_bytes": (d as u64 + 1) * largest,
                "peak_within_bound": speak <= (d as u64 + 1) * largest,
                "bitwise_equal": equal, "misses": m.misses, "prefetch_hits": m.prefetch_hits,
            }));
        }
    }
    progress.finish_and_clear();
    let doc = serde_json::json!({
        "date": std::env::var("BENCH_DATE").unwrap_or_default(), "commit": commit, "gpu": gpu, "backend": "cuda",
        "model": format!("flux-dev-shaped: {double} double + {single} single blocks, hidden {H}, mlp {MLP}, bf16, random weights"),
        "block_bytes_total": total_bytes, "largest_block_bytes": store.largest_block_bytes(),
        "cases": cases, "anchors": [],
        "timeline_step": timeline_metrics.borrow().as_ref().map(|m| serde_json::json!({
            "resolution": resolutions.first(), "depth": 1, "exposed_stall_s": m.exposed_stall_s, "copy_busy_s": m.copy_busy_s,
            "hidden_copy_share": m.hidden_copy_share(), "bytes_copied": m.bytes_copied, "note": "one extra step with the timeline on; trace file written beside this JSON",
        })), "no_gemm": SKIP_GEMM.load(Ordering::Relaxed),
    });
    let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    match out {
        Some(p) => std::fs::write(&p, text + "\n").map_err(|e| Error::Io { path: p.into(), source: e })?,
        None => println!("{text}"),
    }
    Ok(())
}
