//! The CUDA backend's row: the fold runs as `offload_cuda::fold::FoldKernel` on
//! the compute stream, so reading a slot early or late changes the result.

use crate::harness::{CaseError, Harness};
use crate::model::SEED;
use offload_core::Result;
use offload_cuda::fold::FoldKernel;
use offload_cuda::{CudaBackend, CudaSlot};

/// The raw CUDA backend on device 0.
pub struct Cuda;

impl Harness for Cuda {
    type B = CudaBackend;
    type Acc = FoldKernel;
    const NAME: &'static str = "cuda";

    fn backend() -> std::result::Result<CudaBackend, CaseError> {
        CudaBackend::new(0).map_err(|e| CaseError::Skip(format!("no CUDA device: {e}")))
    }
    fn new_acc(b: &CudaBackend) -> Result<FoldKernel> {
        FoldKernel::new(b, SEED)
    }
    fn fold(b: &CudaBackend, acc: &mut FoldKernel, slot: &CudaSlot, bytes: usize) -> Result<()> {
        acc.fold(b, slot, bytes)
    }
    fn read(b: &CudaBackend, acc: &FoldKernel) -> Result<u64> {
        acc.read(b)
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
