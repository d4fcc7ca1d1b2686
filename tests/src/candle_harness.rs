//! The candle backend's row (CPU device): the fold reads the slot through candle,
//! as a `U8` tensor materialised from the slot the way a block's weights are.

use crate::harness::{CaseError, Harness, ModelCase, Outcome};
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
    fn model_case() -> Option<ModelCase> {
        Some(ModelCase { name: "sd3_joint_blocks", invariant: "6,9", run: sd3_cpu })
    }
}

/// candle-transformers' SD3 joint blocks, unmodified, written with random weights
/// to a safetensors file: streamed output byte-identical to candle's resident run,
/// no misses, and never more than two blocks' weights on the device.
fn sd3_case<B>(backend: &B, device: &candle_core::Device, tag: &str) -> Outcome
where
    B: offload_core::OffloadBackend,
    for<'a> offload_core::BlockGuard<'a, B>: offload_candle::CandleBlockExt,
{
    let path = std::env::temp_dir().join(format!("offload-conformance-sd3-{tag}-{}.safetensors", std::process::id()));
    let model = offload_candle::sd3::Sd3Blocks { hidden: 128, heads: 2, depth: 4 };
    let run = model.write_random(&path).and_then(|()| model.run(backend, device, &path, (8, 32)));
    let _ = std::fs::remove_file(&path);
    let o = run?;
    crate::ensure!(o.resident.iter().any(|v| *v != 0.0), "the resident output is all zeros");
    crate::ensure!(o.bitwise_equal(), "streamed SD3 joint blocks differ from candle's resident run");
    crate::ensure!(o.metrics.misses == 0 && o.metrics.blocks == 4, "{} misses over {} blocks", o.metrics.misses, o.metrics.blocks);
    crate::ensure!(
        o.metrics.peak_device_weight_bytes < o.model_bytes,
        "peak device weights {} B, the whole model is {} B",
        o.metrics.peak_device_weight_bytes,
        o.model_bytes
    );
    Ok(())
}

fn sd3_cpu() -> Outcome {
    let b = CandleBackend::cpu();
    sd3_case(&b, &candle_core::Device::Cpu, "cpu")?;
    let v = Candle::violations(&b);
    crate::ensure!(v.is_empty(), "protocol violations: {v:?}");
    Ok(())
}

#[cfg(feature = "candle-cuda")]
fn sd3_cuda() -> Outcome {
    if !offload_cuda::driver_present() {
        return Err(CaseError::Skip("no CUDA driver library (libcuda.so) on this machine".into()));
    }
    // SD3's blocks are f32: an f32 backend (the suite's other cases use U8 slots).
    let b = offload_candle::CandleCudaBackend::new(0, candle_core::DType::F32)
        .map_err(|e| CaseError::Skip(format!("no CUDA device for candle: {e}")))?;
    sd3_case(&b, &b.device(), "cuda")
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
    fn model_case() -> Option<ModelCase> {
        Some(ModelCase { name: "sd3_joint_blocks", invariant: "6,9", run: sd3_cuda })
    }
}
