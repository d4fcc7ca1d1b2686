//! SD3's MMDiT joint blocks from candle-transformers (`mmdit::blocks`), unmodified:
//! written with candle's own random initialisation to a safetensors file, then run
//! resident (candle's loader over the whole file) and streamed block by block
//! through offload, on the same random inputs. Used by the `sd3_joint_blocks`
//! example and test and by the candle rows of the conformance suite. Feature `sd3`.

use crate::{candle_error as ce, CandleBlockExt};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::mmdit::blocks::{JointBlock, MMDiTJointBlock};
use offload_core::{
    resolve, BlockDiscovery, BlockGuard, DeclaredStacks, Error, HostStore, OffloadBackend, Plan, Result, Ring, SafetensorsFile,
    StepMetrics, TensorSource,
};
use std::path::Path;
use std::sync::Arc;

/// The model: `depth` joint blocks of width `hidden` with `heads` heads, f32.
#[derive(Clone, Copy, Debug)]
pub struct Sd3Blocks {
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Joint blocks.
    pub depth: usize,
}

/// What [`Sd3Blocks::run`] produced.
pub struct Sd3Run {
    /// Final image-token state of the resident run.
    pub resident: Vec<f32>,
    /// Final image-token state of the streamed run.
    pub streamed: Vec<f32>,
    /// The streamed step's metrics.
    pub metrics: StepMetrics,
    /// Bytes of all blocks in the host store.
    pub model_bytes: u64,
    /// Where the store held the blocks ([`Sd3Blocks::run_mapped`]: served from the file).
    pub host_tier: offload_core::HostTier,
}

impl Sd3Run {
    /// Whether the streamed output is byte-identical to the resident one.
    pub fn bitwise_equal(&self) -> bool {
        self.resident.len() == self.streamed.len() && self.resident.iter().zip(&self.streamed).all(|(a, b)| a.to_bits() == b.to_bits())
    }
}

impl Sd3Blocks {
    /// Write the blocks (`joint_blocks.<i>.…`) with candle's own random
    /// initialisation to the safetensors file `path`.
    pub fn write_random(&self, path: &Path) -> Result<()> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        for i in 0..self.depth {
            MMDiTJointBlock::new(self.hidden, self.heads, false, vb.pp(format!("joint_blocks.{i}")))
                .map_err(ce("initialising a joint block"))?;
        }
        varmap.save(path).map_err(ce("writing the safetensors file"))
    }

    /// Run the blocks in `path` on `tokens = (context, image)` random tokens: once
    /// resident on `device` through candle's loader, once streamed through
    /// `backend` (whose tensors live on `device`) at prefetch depth 1.
    pub fn run<B>(&self, backend: &B, device: &Device, path: &Path, tokens: (usize, usize)) -> Result<Sd3Run>
    where
        B: OffloadBackend,
        for<'a> BlockGuard<'a, B>: CandleBlockExt,
    {
        self.run_from(backend, device, SafetensorsFile::open(path)?, tokens, false)
    }

    /// [`run`](Self::run) with the host store built by `HostStore::build_mapped`
    /// from `file` (opened by `SafetensorsFile::open`, or mapped by
    /// `offload_cuda::map_checkpoint` for a CUDA backend): blocks served from the
    /// file where the backend can.
    pub fn run_mapped<B>(&self, backend: &B, device: &Device, file: SafetensorsFile, tokens: (usize, usize)) -> Result<Sd3Run>
    where
        B: OffloadBackend,
        for<'a> BlockGuard<'a, B>: CandleBlockExt,
    {
        self.run_from(backend, device, file, tokens, true)
    }

    fn run_from<B>(&self, backend: &B, device: &Device, file: SafetensorsFile, tokens: (usize, usize), mapped: bool) -> Result<Sd3Run>
    where
        B: OffloadBackend,
        for<'a> BlockGuard<'a, B>: CandleBlockExt,
    {
        let path = file.path().to_path_buf();
        let path = path.as_path();
        let (hidden, heads) = (self.hidden, self.heads);
        let rand = |n: usize| Tensor::randn(0f32, 1.0, (1, n, hidden), &Device::Cpu).and_then(|t| t.to_device(device));
        let context = rand(tokens.0).map_err(ce("making the inputs"))?;
        let x = rand(tokens.1).map_err(ce("making the inputs"))?;
        let c = Tensor::randn(0f32, 1.0, (1, hidden), &Device::Cpu).and_then(|t| t.to_device(device)).map_err(ce("making the inputs"))?;
        let bytes = std::fs::read(path).map_err(|e| Error::Io { path: path.into(), source: e })?;

        // Resident: candle's own loader over the whole file.
        let vb = VarBuilder::from_buffered_safetensors(bytes, DType::F32, device).map_err(ce("loading the file resident"))?;
        let (mut ctx_r, mut x_r) = (context.clone(), x.clone());
        for i in 0..self.depth {
            let block =
                MMDiTJointBlock::new(hidden, heads, false, vb.pp(format!("joint_blocks.{i}"))).map_err(ce("building a joint block"))?;
            (ctx_r, x_r) = block.forward(&ctx_r, &x_r, &c).map_err(ce("running a joint block"))?;
        }

        // Streamed: the same block code, weights from the ring.
        let inventory = DeclaredStacks::new(["joint_blocks"]).discover("transformer", file.specs())?;
        let store = Arc::new(match mapped {
            true => HostStore::build_mapped(backend, &inventory, &file, offload_core::PinOptions::default())?,
            false => HostStore::build(backend, &inventory, &file)?,
        });
        let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory))?;
        let mut ring = Ring::new(backend.clone(), store.clone(), &plan.components[0])?;
        let (mut ctx_s, mut x_s) = (context, x);
        for i in 0..self.depth {
            let slot = ring.block("joint_blocks", i)?;
            let block = slot.build(DType::F32, |vb| MMDiTJointBlock::new(hidden, heads, false, vb))?;
            (ctx_s, x_s) = block.forward(&ctx_s, &x_s, &c).map_err(ce("running a streamed joint block"))?;
            drop(block);
            slot.finish()?;
        }
        let metrics = ring.end_step()?;
        let read = |t: Tensor| {
            t.flatten_all().and_then(|t| t.to_device(&Device::Cpu)).and_then(|t| t.to_vec1::<f32>()).map_err(ce("reading the output"))
        };
        let out = Sd3Run {
            resident: read(x_r)?,
            streamed: read(x_s)?,
            metrics,
            model_bytes: store.laid_out_bytes(),
            host_tier: store.tier().clone(),
        };
        ring.close()?;
        Ok(out)
    }
}
