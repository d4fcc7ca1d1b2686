//! The candle backend's row (CPU device): the fold reads the slot through candle,
//! as a `U8` tensor materialised from the slot the way a block's weights are.

use crate::harness::{CaseError, Harness};
use crate::model::{block_hash, fold_combine, SEED};
use offload_candle::CandleBackend;
use offload_core::sim::SimSlot;
use offload_core::{BlockLayout, DType, Error, Result, TensorSpec};

/// candle on `Device::Cpu`.
pub struct Candle;

impl Harness for Candle {
    type B = CandleBackend;
    type Acc = u64;
    const NAME: &'static str = "candle";

    fn backend() -> std::result::Result<CandleBackend, CaseError> {
        Ok(CandleBackend::cpu())
    }
    fn new_acc(_: &CandleBackend) -> Result<u64> {
        Ok(SEED)
    }
    fn fold(b: &CandleBackend, acc: &mut u64, slot: &SimSlot, bytes: usize) -> Result<()> {
        let layout = BlockLayout::new(vec![TensorSpec::new("slot", DType::U8, [bytes])])?;
        let tensors = b.tensors(slot, &layout, "")?;
        let t = &tensors["slot"];
        let v: Vec<u8> = t.to_vec1().map_err(|e| Error::device("candle", "reading a slot tensor", e))?;
        *acc = fold_combine(*acc, block_hash(&v));
        Ok(())
    }
    fn read(_: &CandleBackend, acc: &u64) -> Result<u64> {
        Ok(*acc)
    }
    fn violations(b: &CandleBackend) -> Vec<String> {
        b.host_device().stats().violations
    }
    fn live_bytes(b: &CandleBackend) -> u64 {
        b.host_device().stats().live_bytes
    }
    fn peak_bytes(b: &CandleBackend) -> u64 {
        b.host_device().stats().peak_bytes
    }
    fn reset_peak(b: &CandleBackend) {
        b.host_device().reset_counters()
    }
    fn host_syncs(b: &CandleBackend) -> u64 {
        b.host_device().stats().syncs
    }
}

/// candle on CUDA with `U8` slots (the cases stream raw bytes of any length): the
/// fold reads the slot through candle (a view of the slot tensor, copied to the
/// host on candle's stream after the ring's wait).
#[cfg(feature = "candle-cuda")]
pub struct CandleCuda;

#[cfg(feature = "candle-cuda")]
impl Harness for CandleCuda {
    type B = offload_candle::CandleCudaBackend;
    type Acc = u64;
    const NAME: &'static str = "candle-cuda";

    fn backend() -> std::result::Result<Self::B, CaseError> {
        if !offload_cuda::driver_present() {
            return Err(CaseError::Skip("no CUDA driver library (libcuda.so) on this machine".into()));
        }
        offload_candle::CandleCudaBackend::new(0, candle_core::DType::U8)
            .map_err(|e| CaseError::Skip(format!("no CUDA device for candle: {e}")))
    }
    fn new_acc(_: &Self::B) -> Result<u64> {
        Ok(SEED)
    }
    fn fold(_: &Self::B, acc: &mut u64, slot: &offload_candle::CandleSlot, bytes: usize) -> Result<()> {
        let t = slot.tensor().ok_or_else(|| Error::Protocol("slot without tensor".into()))?;
        let v: Vec<u8> =
            t.narrow(0, 0, bytes).and_then(|v| v.to_vec1()).map_err(|e| Error::device("candle", "reading a slot tensor", e))?;
        *acc = fold_combine(*acc, block_hash(&v));
        Ok(())
    }
    fn read(_: &Self::B, acc: &u64) -> Result<u64> {
        Ok(*acc)
    }
    fn violations(_: &Self::B) -> Vec<String> {
        Vec::new()
    }
    fn live_bytes(b: &Self::B) -> u64 {
        b.cuda().counters().live_bytes
    }
    fn peak_bytes(b: &Self::B) -> u64 {
        b.cuda().counters().peak_bytes
    }
    fn reset_peak(b: &Self::B) {
        b.cuda().reset_peak()
    }
    fn host_syncs(b: &Self::B) -> u64 {
        b.cuda().counters().syncs
    }
}
