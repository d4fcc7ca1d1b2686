//! The tch backend's row (CPU): the fold reads the slot through libtorch, as a
//! `Uint8` parameter pointed at the slot the way a block's weights are.

use crate::harness::{CaseError, Harness};
use crate::model::{block_hash, fold_combine, SEED};
use offload_core::sim::{SimBackend, SimConfig, SimSlot};
use offload_core::{BlockLayout, DType, Error, Result, TensorSpec};
use offload_tch::tch::{Device, Kind, Tensor};
use offload_tch::TchSlots;
use std::collections::HashMap;

/// libtorch on the CPU (host memory as device).
pub struct Tch;

impl Harness for Tch {
    type B = SimBackend;
    type Acc = u64;
    const NAME: &'static str = "tch";

    fn backend() -> std::result::Result<SimBackend, CaseError> {
        Ok(SimBackend::new(SimConfig::fast()))
    }
    fn new_acc(_: &SimBackend) -> Result<u64> {
        Ok(SEED)
    }
    fn fold(b: &SimBackend, acc: &mut u64, slot: &SimSlot, bytes: usize) -> Result<()> {
        let layout = BlockLayout::new(vec![TensorSpec::new("slot", DType::U8, [bytes])])?;
        let mut params = HashMap::from([("slot".to_owned(), Tensor::empty([0i64], (Kind::Uint8, Device::Cpu)))]);
        b.bind(slot, &layout, &mut params)?;
        let t = &params["slot"];
        let mut v = vec![0u8; bytes];
        t.f_copy_data_u8(&mut v, bytes).map_err(|e| Error::device("tch", "reading a slot tensor", e))?;
        *acc = fold_combine(*acc, block_hash(&v));
        Ok(())
    }
    fn read(_: &SimBackend, acc: &u64) -> Result<u64> {
        Ok(*acc)
    }
    fn violations(b: &SimBackend) -> Vec<String> {
        b.stats().violations
    }
    fn live_bytes(b: &SimBackend) -> u64 {
        b.stats().live_bytes
    }
    fn peak_bytes(b: &SimBackend) -> u64 {
        b.stats().peak_bytes
    }
    fn reset_peak(b: &SimBackend) {
        b.reset_counters()
    }
    fn host_syncs(b: &SimBackend) -> u64 {
        b.stats().syncs
    }
}

/// libtorch on CUDA: compute (the fold's read) on libtorch's stream through a
/// `from_blob` view of the slot, copies on the ring's cudarc stream.
#[cfg(feature = "tch-cuda")]
pub struct TchCuda;

#[cfg(feature = "tch-cuda")]
impl Harness for TchCuda {
    type B = offload_cuda::CudaBackend;
    type Acc = u64;
    const NAME: &'static str = "tch-cuda";

    fn backend() -> std::result::Result<offload_cuda::CudaBackend, CaseError> {
        offload_tch::cuda_backend(0).map_err(|e| CaseError::Skip(format!("no CUDA device for libtorch: {e}")))
    }
    fn new_acc(_: &offload_cuda::CudaBackend) -> Result<u64> {
        Ok(SEED)
    }
    fn fold(b: &offload_cuda::CudaBackend, acc: &mut u64, slot: &offload_cuda::CudaSlot, bytes: usize) -> Result<()> {
        let layout = BlockLayout::new(vec![TensorSpec::new("slot", DType::U8, [bytes])])?;
        let dev = b.tch_device();
        let mut params = HashMap::from([("slot".to_owned(), Tensor::empty([0i64], (Kind::Uint8, dev)))]);
        b.bind(slot, &layout, &mut params)?;
        // Read through libtorch on its stream: ordered after the ring's wait.
        let host = params["slot"].f_to_device(Device::Cpu).map_err(|e| Error::device("tch", "reading a slot tensor", e))?;
        let mut v = vec![0u8; bytes];
        host.f_copy_data_u8(&mut v, bytes).map_err(|e| Error::device("tch", "reading a slot tensor", e))?;
        *acc = fold_combine(*acc, block_hash(&v));
        Ok(())
    }
    fn read(_: &offload_cuda::CudaBackend, acc: &u64) -> Result<u64> {
        Ok(*acc)
    }
    fn violations(_: &offload_cuda::CudaBackend) -> Vec<String> {
        Vec::new()
    }
    fn live_bytes(b: &offload_cuda::CudaBackend) -> u64 {
        b.counters().live_bytes
    }
    fn peak_bytes(b: &offload_cuda::CudaBackend) -> u64 {
        b.counters().peak_bytes
    }
    fn reset_peak(b: &offload_cuda::CudaBackend) {
        b.reset_peak()
    }
    fn host_syncs(b: &offload_cuda::CudaBackend) -> u64 {
        b.counters().syncs
    }
}
