//! The CUDA backend's row: the fold runs as two NVRTC-compiled kernels on the
//! compute stream (a parallel hash of the slot with 64-bit atomics, then the
//! order-dependent combine), so reading a slot early or late changes the result.

use crate::harness::{CaseError, Harness};
use crate::model::SEED;
use offload_core::{Error, Result};
use offload_cuda::cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use offload_cuda::cudarc::nvrtc;
use offload_cuda::{CudaBackend, CudaSlot};
use std::sync::OnceLock;

const KERNELS: &str = r#"
typedef unsigned long long u64;
__device__ u64 mix(u64 w, u64 i) {
    u64 x = (w + i * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 31);
}
extern "C" __global__ void block_hash(const unsigned char* p, u64 bytes, u64* acc) {
    u64 words = (bytes + 7) / 8;
    u64 sum = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < words; i += (u64)gridDim.x * blockDim.x) {
        u64 w = 0;
        u64 n = bytes - i * 8 < 8 ? bytes - i * 8 : 8;
        for (u64 k = 0; k < n; k++) w |= ((u64)p[i * 8 + k]) << (8 * k);
        sum += mix(w, i);
    }
    atomicAdd(&acc[1], sum);
}
extern "C" __global__ void fold_combine(u64* acc) {
    u64 a = acc[0];
    a = ((a << 7) | (a >> 57)) ^ acc[1];
    acc[0] = a * 0x9E3779B97F4A7C15ull;
    acc[1] = 0;
}
"#;

fn ptx() -> std::result::Result<&'static nvrtc::Ptx, String> {
    static PTX: OnceLock<std::result::Result<nvrtc::Ptx, String>> = OnceLock::new();
    PTX.get_or_init(|| nvrtc::compile_ptx(KERNELS).map_err(|e| format!("NVRTC: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

/// The accumulator on the device and the two kernels.
pub struct CudaAcc {
    acc: CudaSlice<u64>,
    hash: CudaFunction,
    combine: CudaFunction,
}

/// The raw CUDA backend on device 0.
pub struct Cuda;

fn dev(during: &str, e: impl std::fmt::Display) -> Error {
    Error::device("cuda", during, e)
}

impl Harness for Cuda {
    type B = CudaBackend;
    type Acc = CudaAcc;
    const NAME: &'static str = "cuda";

    fn backend() -> std::result::Result<CudaBackend, CaseError> {
        CudaBackend::new(0).map_err(|e| CaseError::Skip(format!("no CUDA device: {e}")))
    }

    fn new_acc(b: &CudaBackend) -> Result<CudaAcc> {
        let ptx = ptx().map_err(|e| dev("compiling the fold kernels", e))?;
        let module = b.ctx().load_module(ptx.clone()).map_err(|e| dev("loading the fold kernels", e))?;
        let hash = module.load_function("block_hash").map_err(|e| dev("block_hash", e))?;
        let combine = module.load_function("fold_combine").map_err(|e| dev("fold_combine", e))?;
        let acc = b.compute_stream().clone_htod(&[SEED, 0u64]).map_err(|e| dev("accumulator", e))?;
        Ok(CudaAcc { acc, hash, combine })
    }

    fn fold(b: &CudaBackend, acc: &mut CudaAcc, slot: &CudaSlot, bytes: usize) -> Result<()> {
        let s = b.compute_stream();
        let ptr = slot.device_ptr();
        let n = bytes as u64;
        let words = bytes.div_ceil(8) as u32;
        let cfg = LaunchConfig {
            grid_dim: (words.div_ceil(256).clamp(1, 1024), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `ptr` addresses `bytes` valid device bytes of a slot the ring
        // keeps alive while the guard lives; the accumulator holds two u64.
        unsafe { s.launch_builder(&acc.hash).arg(&ptr).arg(&n).arg(&mut acc.acc).launch(cfg) }.map_err(|e| dev("block_hash launch", e))?;
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the accumulator holds two u64.
        unsafe { s.launch_builder(&acc.combine).arg(&mut acc.acc).launch(one) }.map_err(|e| dev("fold_combine launch", e))?;
        Ok(())
    }

    fn read(b: &CudaBackend, acc: &CudaAcc) -> Result<u64> {
        let v = b
            .compute_stream()
            .clone_dtoh(&acc.acc)
            .map_err(|e| dev("reading the accumulator", e))?;
        Ok(v[0])
    }

    fn violations(_: &CudaBackend) -> Vec<String> {
        Vec::new()
    }
    fn live_bytes(b: &CudaBackend) -> u64 {
        b.counters().live_bytes
    }
    fn peak_bytes(b: &CudaBackend) -> u64 {
        b.counters().peak_bytes
    }
    fn reset_peak(b: &CudaBackend) {
        b.reset_peak()
    }
    fn host_syncs(b: &CudaBackend) -> u64 {
        b.counters().syncs
    }
}
