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

    fn serves_mapped() -> bool {
        // Host memory is the device: each range is read into it.
        true
    }
    fn backend() -> std::result::Result<CandleBackend, CaseError> {
        Ok(CandleBackend::cpu())
    }
    fn disk_backend(early_refill: bool) -> std::result::Result<CandleBackend, CaseError> {
        let device = offload_core::sim::SimBackend::new(crate::sim_harness::disk_config(CandleBackend::cpu_config(), early_refill));
        Ok(CandleBackend::on_host_device(device))
    }
    fn new_acc(_: &CandleBackend) -> Result<u64> {
        Ok(SEED)
    }
    fn fold(b: &CandleBackend, acc: &mut u64, slot: &SimSlot, bytes: usize, _waits: &[()]) -> Result<()> {
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
    fn host_pinned_bytes(b: &CandleBackend) -> Option<u64> {
        Some(b.host_device().stats().pinned_bytes)
    }
    fn model_cases() -> Vec<ModelCase> {
        vec![
            ModelCase { name: "sd3_joint_blocks", invariant: "6,9", run: sd3_cpu },
            ModelCase { name: "views_outlive_block", invariant: "10", run: views_cpu },
        ]
    }
}

fn views_cpu() -> Outcome {
    let b = CandleBackend::cpu();
    views_outlive_block(&b, &candle_core::Device::Cpu)?;
    let v = Candle::violations(&b);
    crate::ensure!(v.is_empty(), "protocol violations: {v:?}");
    Ok(())
}

/// Invariant 10 at candle's boundary: a weight tensor and a `candle_nn::Linear`
/// built from block 0's `VarBuilder`, kept past the guard, past steps that reuse
/// block 0's slot for other blocks, and past `close()`, still read block 0's
/// weights: the tensor's bytes and the module's output equal the resident ones.
fn views_outlive_block<B>(backend: &B, device: &candle_core::Device) -> Outcome
where
    B: offload_core::OffloadBackend,
    for<'a> offload_core::BlockGuard<'a, B>: offload_candle::CandleBlockExt,
{
    use candle_core::{DType as CDType, Module, Tensor};
    use offload_candle::CandleBlockExt;
    use offload_core::{resolve, BlockDiscovery, HostStore, MemoryTensors, NameDiscovery, Plan, Ring};
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;
    let (n, w) = (6usize, 64usize);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed_0a11);
    let mut tensors = MemoryTensors::new();
    let mut weights = Vec::new();
    for i in 0..n {
        let vals: Vec<f32> = (0..w * w).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push(TensorSpec::new(format!("blocks.{i}.weight"), DType::F32, [w, w]), bytes)?;
        weights.push(vals);
    }
    let inventory = NameDiscovery.discover("model", offload_core::TensorSource::specs(&tensors))?;
    let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&inventory))?;
    let store = Arc::new(HostStore::build(backend, &inventory, &tensors)?);
    let mut ring = Ring::new(backend.clone(), store, &plan.components[0])?;
    let ce = |what: &'static str| move |e: candle_core::Error| CaseError::Fail(format!("{what}: {e}"));
    let x: Vec<f32> = (0..4 * w).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let x = Tensor::from_vec(x, (4, w), device).map_err(ce("input"))?;
    let resident_w0 = Tensor::from_vec(weights[0].clone(), (w, w), device).map_err(ce("resident weight"))?;
    let want = candle_nn::Linear::new(resident_w0, None).forward(&x).map_err(ce("resident forward"))?;
    let want: Vec<f32> = want.flatten_all().and_then(|t| t.to_vec1()).map_err(ce("resident output"))?;
    let (kept, linear) = {
        let g = ring.block("blocks", 0)?;
        let vb = g.var_builder(CDType::F32)?;
        let t = vb.get((w, w), "weight").map_err(ce("weight from the VarBuilder"))?;
        let linear = candle_nn::linear_no_bias(w, w, vb).map_err(ce("Linear from the VarBuilder"))?;
        (t, linear)
    };
    let read = |t: &Tensor| -> Result<Vec<f32>, CaseError> { t.flatten_all().and_then(|t| t.to_vec1()).map_err(ce("reading")) };
    let check = |when: &str| -> Outcome {
        let got = read(&kept)?;
        let differ = got.iter().zip(&weights[0]).filter(|(a, b)| a != b).count();
        crate::ensure!(differ == 0, "a weight view kept past its guard, read {when}: {differ} of {} values are not block 0's", got.len());
        let out = read(&linear.forward(&x).map_err(ce("forward after release"))?)?;
        crate::ensure!(out == want, "a Linear kept past its guard computes another result {when}");
        Ok(())
    };
    // At depth 1 block 2 is copied into the slot block 0 had (the prefetch issued
    // when block 1 is handed out) and compute waits for that copy when block 2 is
    // handed out: a view of the reused slot would read block 2's bytes here.
    for i in 1..n {
        ring.block("blocks", i)?.finish()?;
        if i == 2 {
            check("after its slot was refilled with block 2")?;
        }
    }
    ring.end_step()?;
    for i in 0..n {
        ring.block("blocks", i)?.finish()?;
    }
    ring.end_step()?;
    check("a step later")?;
    ring.close()?;
    check("after close()")
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
        .map_err(|e| crate::cuda_harness::absent_or_failed("candle", e))?;
    sd3_case(&b, &b.device(), "cuda")
}

#[cfg(feature = "candle-cuda")]
fn views_cuda() -> Outcome {
    if !offload_cuda::driver_present() {
        return Err(CaseError::Skip("no CUDA driver library (libcuda.so) on this machine".into()));
    }
    let b = offload_candle::CandleCudaBackend::new(0, candle_core::DType::F32)
        .map_err(|e| crate::cuda_harness::absent_or_failed("candle", e))?;
    b.cuda().enable_checking(crate::cuda_harness::COPY_SPIN_US)?;
    views_outlive_block(&b, &b.device())
}

/// candle on CUDA with `U8` slots (the cases stream raw bytes of any length),
/// in the transfer engine's checking mode: the fold runs on candle's stream over
/// the slot's buffer (`offload_cuda::checksum`), with no host read inside it.
#[cfg(feature = "candle-cuda")]
pub struct CandleCuda;

/// candle on device 0, each copy spinning `copy_spin_us` in the checking mode.
#[cfg(feature = "candle-cuda")]
fn candle_cuda(copy_spin_us: u64) -> std::result::Result<offload_candle::CandleCudaBackend, CaseError> {
    if !offload_cuda::driver_present() {
        return Err(CaseError::Skip("no CUDA driver library (libcuda.so) on this machine".into()));
    }
    let b = offload_candle::CandleCudaBackend::new(0, candle_core::DType::U8)
        .map_err(|e| crate::cuda_harness::absent_or_failed("candle", e))?;
    b.cuda().enable_checking(copy_spin_us)?;
    Ok(b)
}

#[cfg(feature = "candle-cuda")]
crate::cuda_harness::fresh_engine_harness!(
    CandleCuda,
    "candle-cuda",
    offload_candle::CandleCudaBackend,
    offload_candle::CandleSlot,
    candle_cuda,
    vec![
        ModelCase { name: "sd3_joint_blocks", invariant: "6,9", run: sd3_cuda },
        ModelCase { name: "views_outlive_block", invariant: "10", run: views_cuda },
    ]
);
