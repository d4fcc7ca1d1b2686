//! A small compute kernel for proving the backend: an order-dependent fold of a
//! block's bytes into an on-device accumulator (a parallel hash of the slot with
//! 64-bit atomics, then a sequential combine). The conformance suite runs it as
//! the "model": reading a slot early, late or in the wrong order changes the result.
//!
//! With [`ChecksumKernel::spin_every`] some folds first spin on the device before they
//! read, so that, with the backend's checking mode
//! ([`CudaBackend::enable_checking`]), a copy not ordered after the fold's read
//! poisons the bytes while the fold is still to read them.

use crate::device::CudaBackend;
use crate::engine::Checking;
use crate::error::dev;
use crate::memory::CudaSlot;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use cudarc::nvrtc;
use offload_core::{Error, Result};
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
extern "C" __global__ void spin(u64 ns) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
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
    crate::nvrtc::compiled(&PTX, KERNELS)
}

impl CudaBackend {
    /// The checking mode, for conformance runs on a real device: before every
    /// copy into a slot the copy stream overwrites the whole slot with
    /// [`POISON`](crate::POISON) and then spins for `copy_spin_us` before it
    /// writes the block. A read before the copy's event (invariant 1) then sees
    /// poison rather than the block, and a copy not ordered after the slot's last
    /// read (invariant 2) poisons bytes a kernel is still reading — a wrong result
    /// instead of a lucky timing. Costs a memset and a spin per copy: never on in
    /// a measured run. Once on, it stays on for every clone of this backend.
    pub fn enable_checking(&self, copy_spin_us: u64) -> Result<()> {
        let engine = self.engine();
        if engine.checking.get().is_some() {
            return Ok(());
        }
        let copy_spin_ns = copy_spin_us
            .checked_mul(1000)
            .ok_or_else(|| Error::unsupported("cuda", format!("checking mode: a copy spin of {copy_spin_us} µs overflows nanoseconds")))?;
        let ptx = ptx().map_err(|e| dev("compiling the fold kernels", e))?;
        let module = engine.ctx.load_module(ptx.clone()).map_err(|e| dev("loading the fold kernels", e))?;
        let spin = module.load_function("spin").map_err(|e| dev("spin", e))?;
        let _ = engine.checking.set(Checking { spin, copy_spin_ns });
        Ok(())
    }
}

/// Device memory a kernel may read: a slot of some backend built on
/// `offload-cuda` (raw, candle's or libtorch's), as an address range.
///
/// # Safety
///
/// `device_range` returns memory of the backend's CUDA context that stays
/// allocated while the borrow of `self` lives, and whose free is afterwards
/// enqueued on the compute stream of the transfer engine `engine_id` names (so a
/// kernel enqueued there while the borrow lived runs before the memory is reused).
pub unsafe trait DeviceSlot {
    /// The slot's first device address and its length in bytes.
    fn device_range(&self) -> (u64, usize);
    /// The [`CudaBackend::engine_id`] of the engine whose compute stream frees it.
    fn engine_id(&self) -> usize;
}

// SAFETY: a `CudaSlot` owns its range until it is dropped, which the borrow prevents;
// its `Drop` frees it on its engine's compute stream.
unsafe impl DeviceSlot for CudaSlot {
    fn device_range(&self) -> (u64, usize) {
        (self.device_ptr(), self.len())
    }
    fn engine_id(&self) -> usize {
        std::sync::Arc::as_ptr(&self.engine) as usize
    }
}

/// The fold: `acc = (rotl(acc, 7) ^ Σ mix(word_i, i)) · K` per block, on the compute stream.
pub struct ChecksumKernel {
    /// The backend instance whose compute stream the accumulator lives on: the
    /// only one the kernel folds and reads for (its frees are ordered there).
    engine: std::sync::Arc<crate::engine::Engine>,
    acc: CudaSlice<u64>,
    hash: CudaFunction,
    combine: CudaFunction,
    spin: CudaFunction,
    /// `(every, ns)`: fold number `n` spins `ns` first when `n % every == every - 1`.
    spin_every: Option<(u64, u64)>,
    folds: u64,
}

impl Drop for ChecksumKernel {
    fn drop(&mut self) {
        // Folds and spins may still be queued on the compute stream: let them
        // finish before the module goes with the functions (the accumulator is
        // freed in stream order). If that fails, keep the module loaded.
        if let Err(e) =
            self.engine.bind().and_then(|()| self.engine.compute.synchronize().map_err(|e| dev("draining the compute stream", e)))
        {
            tracing::warn!("the fold kernels' module is kept loaded: the compute stream could not be drained ({e})");
            std::mem::forget(self.hash.clone());
        }
    }
}

impl ChecksumKernel {
    /// Compile (once per process) and load the kernels; the accumulator starts at `seed`.
    pub fn new(b: &CudaBackend, seed: u64) -> Result<Self> {
        let ptx = ptx().map_err(|e| dev("compiling the fold kernels", e))?;
        let module = b.engine().ctx.load_module(ptx.clone()).map_err(|e| dev("loading the fold kernels", e))?;
        let hash = module.load_function("block_hash").map_err(|e| dev("block_hash", e))?;
        let combine = module.load_function("fold_combine").map_err(|e| dev("fold_combine", e))?;
        let spin = module.load_function("spin").map_err(|e| dev("spin", e))?;
        let acc = b.engine().compute.clone_htod(&[seed, 0u64]).map_err(|e| dev("accumulator", e))?;
        Ok(ChecksumKernel { engine: b.engine().clone(), acc, hash, combine, spin, spin_every: None, folds: 0 })
    }

    /// Make every `every`-th fold spin `us` microseconds on the device before it
    /// reads (with the checking mode: a copy that does not wait for the fold's read
    /// poisons its bytes in that time). A spin past `u64::MAX` nanoseconds is that.
    pub fn spin_every(mut self, every: u64, us: u64) -> Self {
        self.spin_every = (every > 0).then_some((every, us.saturating_mul(1000)));
        self
    }

    /// Enqueue the fold of the first `bytes` of `slot` on `b`'s compute stream
    /// (`slot` and the kernel must belong to `b`: their frees are ordered on that stream).
    pub fn fold(&mut self, b: &CudaBackend, slot: &impl DeviceSlot, bytes: usize) -> Result<()> {
        self.own(b)?;
        if slot.engine_id() != b.engine_id() {
            return Err(Error::Protocol("fold of a slot of another CUDA backend instance".into()));
        }
        let (ptr, len) = slot.device_range();
        if bytes > len {
            return Err(Error::Protocol(format!("fold of {bytes} bytes over a {len}-byte slot")));
        }
        let s = &b.engine().compute;
        let n_fold = self.folds;
        self.folds += 1;
        if let Some((every, ns)) = self.spin_every {
            if n_fold % every == every - 1 {
                let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: the spin kernel takes one u64 and touches no memory.
                unsafe { s.launch_builder(&self.spin).arg(&ns).launch(one) }.map_err(|e| dev("spin launch", e))?;
            }
        }
        let n = bytes as u64;
        let words = bytes.div_ceil(8) as u32;
        let cfg = LaunchConfig { grid_dim: (words.div_ceil(256).clamp(1, 1024), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `ptr` addresses at least `bytes` device bytes (checked above) of a
        // slot kept alive by the borrow (`DeviceSlot`); the accumulator holds two u64.
        unsafe { s.launch_builder(&self.hash).arg(&ptr).arg(&n).arg(&mut self.acc).launch(cfg) }
            .map_err(|e| dev("block_hash launch", e))?;
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the accumulator holds two u64.
        unsafe { s.launch_builder(&self.combine).arg(&mut self.acc).launch(one) }.map_err(|e| dev("fold_combine launch", e))?;
        Ok(())
    }

    /// Read the accumulator back (an activation, not a weight; waits for compute).
    /// `b` must be the backend the kernel was made on.
    pub fn read(&self, b: &CudaBackend) -> Result<u64> {
        self.own(b)?;
        let v = b.engine().compute.clone_dtoh(&self.acc).map_err(|e| dev("reading the accumulator", e))?;
        Ok(v[0])
    }

    /// Refuse another backend instance than the kernel's: its compute stream is
    /// not the one the accumulator is freed on (event tracking is off, so nothing
    /// else would order that free after the other stream's use).
    fn own(&self, b: &CudaBackend) -> Result<()> {
        match std::sync::Arc::ptr_eq(&self.engine, b.engine()) {
            true => Ok(()),
            false => Err(Error::Protocol("a fold kernel used with another CUDA backend instance than it was made on".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    /// The fold kernels compile with NVRTC (no GPU needed, only libnvrtc).
    #[test]
    fn kernels_compile_with_nvrtc() {
        crate::nvrtc::check::compiles("the fold hash", super::KERNELS);
    }
}
