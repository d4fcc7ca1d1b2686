//! SD3's MMDiT joint blocks from candle-transformers, unmodified, run resident
//! (candle loading the whole file) and streamed through offload; shared by the
//! `sd3_joint_blocks` example and the test of the same name.

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::mmdit::blocks::{JointBlock, MMDiTJointBlock};
use offload_candle::{CandleBackend, CandleBlockExt};
use offload_core::{resolve, BlockDiscovery, DeclaredStacks, HostStore, Plan, Ring, SafetensorsFile, StepMetrics, TensorSource};
use std::path::Path;
use std::sync::Arc;

/// What a run produced.
pub struct Outcome {
    /// Final image-token state, resident run.
    pub resident: Vec<f32>,
    /// Final image-token state, streamed run.
    pub streamed: Vec<f32>,
    /// The streamed run's metrics.
    pub metrics: StepMetrics,
    /// Peak bytes of the host-memory "device" during the streamed run.
    pub peak_device_bytes: u64,
    /// Bytes of all blocks.
    pub model_bytes: u64,
}

type BoxError = Box<dyn std::error::Error>;

/// Write `depth` joint blocks with candle's own random initialisation to `path`,
/// then run them resident and streamed on the same random inputs.
pub fn run(path: &Path, hidden: usize, heads: usize, depth: usize, tokens: (usize, usize)) -> Result<Outcome, BoxError> {
    let cpu = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &cpu);
    for i in 0..depth {
        MMDiTJointBlock::new(hidden, heads, false, vb.pp(format!("joint_blocks.{i}")))?;
    }
    varmap.save(path)?;
    let context = Tensor::randn(0f32, 1.0, (1, tokens.0, hidden), &cpu)?;
    let x = Tensor::randn(0f32, 1.0, (1, tokens.1, hidden), &cpu)?;
    let c = Tensor::randn(0f32, 1.0, (1, hidden), &cpu)?;

    // Resident: candle's own loader over the whole file.
    let vb = VarBuilder::from_buffered_safetensors(std::fs::read(path)?, DType::F32, &cpu)?;
    let (mut ctx_r, mut x_r) = (context.clone(), x.clone());
    for i in 0..depth {
        let block = MMDiTJointBlock::new(hidden, heads, false, vb.pp(format!("joint_blocks.{i}")))?;
        (ctx_r, x_r) = block.forward(&ctx_r, &x_r, &c)?;
    }

    // Streamed: the same block code, weights from the ring.
    let file = SafetensorsFile::open(path)?;
    let inventory = DeclaredStacks::new(["joint_blocks"]).discover("transformer", file.specs())?;
    let backend = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&backend, &inventory, &file)?);
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory))?;
    let mut ring = Ring::new(backend.clone(), store.clone(), &plan.components[0])?;
    let (mut ctx_s, mut x_s) = (context, x);
    for i in 0..depth {
        let slot = ring.block("joint_blocks", i)?;
        let block = MMDiTJointBlock::new(hidden, heads, false, slot.var_builder(DType::F32)?)?;
        (ctx_s, x_s) = block.forward(&ctx_s, &x_s, &c)?;
    }
    let metrics = ring.end_step()?;
    ring.close()?;
    backend.host_device().check()?;
    Ok(Outcome {
        resident: x_r.flatten_all()?.to_vec1()?,
        streamed: x_s.flatten_all()?.to_vec1()?,
        metrics,
        peak_device_bytes: backend.host_device().stats().peak_bytes,
        model_bytes: store.host_bytes(),
    })
}
