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
