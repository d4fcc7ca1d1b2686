//! The tch backend's row (CPU): the fold reads the slot through libtorch, as a
//! `Uint8` parameter pointed at the slot the way a block's weights are.

use crate::harness::{CaseError, Harness, ModelCase, Outcome};
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

    fn serves_mapped() -> bool {
        // libtorch's CPU device on the simulator: each range is read into host memory.
        true
    }
    fn decodes() -> bool {
        // The simulator beneath libtorch's CPU device decodes coded buffers.
        true
    }
    fn backend() -> std::result::Result<SimBackend, CaseError> {
        Ok(SimBackend::new(SimConfig::fast()))
    }
    fn host_pinned_bytes(b: &SimBackend) -> Option<u64> {
        Some(b.stats().pinned_bytes)
    }
    fn disk_backend(early_refill: bool) -> std::result::Result<SimBackend, CaseError> {
        Ok(SimBackend::new(crate::sim_harness::disk_config(SimConfig::fast(), early_refill)))
    }
    fn new_acc(_: &SimBackend) -> Result<u64> {
        Ok(SEED)
    }
    fn fold(b: &SimBackend, acc: &mut u64, slot: &SimSlot, bytes: usize, _waits: &[()]) -> Result<()> {
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
    fn model_cases() -> Vec<ModelCase> {
        vec![ModelCase { name: "grad_after_release", invariant: "6,10", run: grad_cpu }]
    }
}

/// libtorch on CUDA, in the transfer engine's checking mode: each copy lands in
/// a fresh libtorch buffer; the fold runs on libtorch's stream over it
/// (`offload_cuda::checksum`), with no host read inside it.
#[cfg(feature = "tch-cuda")]
pub struct TchCuda;

/// libtorch on device 0, each copy spinning `copy_spin_us` in the checking mode.
#[cfg(feature = "tch-cuda")]
fn tch_cuda(copy_spin_us: u64) -> std::result::Result<offload_tch::TchCudaBackend, CaseError> {
    let b = offload_tch::cuda_backend(0).map_err(|e| crate::cuda_harness::absent_or_failed("libtorch", e))?;
    b.cuda().enable_checking(copy_spin_us)?;
    Ok(b)
}

#[cfg(feature = "tch-cuda")]
crate::cuda_harness::fresh_engine_harness!(
    TchCuda,
    "tch-cuda",
    offload_tch::TchCudaBackend,
    offload_tch::TchSlot,
    tch_cuda,
    vec![ModelCase { name: "grad_after_release", invariant: "6,10", run: grad_cuda }]
);

#[cfg(feature = "tch-cuda")]
fn grad_cuda() -> Outcome {
    let b = TchCuda::backend()?;
    grad_after_release(b)
}

fn grad_cpu() -> Outcome {
    // One thread: libtorch's CPU GEMMs split work by thread count and timing,
    // which changes the last bits between two runs of the same product.
    let threads = offload_tch::tch::get_num_threads();
    offload_tch::tch::set_num_threads(1);
    let r = grad_after_release(SimBackend::new(SimConfig::fast()));
    offload_tch::tch::set_num_threads(threads);
    r
}

/// Invariant 10 under autograd: four `nn::Linear` blocks (1024 wide, tanh between)
/// streamed at depth 1 with grad mode on, `backward()` called after the step
/// ended (every slot reused since): the output and the input's gradient are
/// byte-identical to the resident run's. Tensors autograd saved keep their
/// block's bytes alive.
fn grad_after_release<B: TchSlots>(backend: B) -> Outcome {
    use offload_core::{NameDiscovery, Plan};
    use offload_tch::tch::nn::{self, Module};
    use offload_tch::TchOffload;
    let device = backend.tch_device();
    let err = |what: &'static str| move |e: offload_tch::tch::TchError| CaseError::Fail(format!("{what}: {e}"));
    offload_tch::tch::manual_seed(0x0ff1);
    let vs = nn::VarStore::new(device);
    let width = 1024;
    let blocks: Vec<nn::Linear> = (0..4).map(|i| nn::linear(vs.root() / "blocks" / i, width, width, Default::default())).collect();
    let x = Tensor::f_randn([64, width], (Kind::Float, device)).map_err(err("input"))?;
    let run = |streamed: Option<&mut TchOffload<B>>| -> std::result::Result<(Vec<u8>, Vec<u8>), CaseError> {
        let xg = x.f_detach().and_then(|t| t.f_set_requires_grad(true)).map_err(err("input"))?;
        let mut y = xg.shallow_clone();
        match streamed {
            None => {
                for b in &blocks {
                    y = b.forward(&y).f_tanh().map_err(err("forward"))?;
                }
            }
            Some(off) => {
                for (i, b) in blocks.iter().enumerate() {
                    let block = off.block("blocks", i)?;
                    y = b.forward(&y).f_tanh().map_err(err("forward"))?;
                    block.finish()?;
                }
                off.end_step()?;
                // Two more steps without grad: every slot now holds other bytes.
                let _g = offload_tch::tch::no_grad_guard();
                for _ in 0..2 {
                    for i in 0..blocks.len() {
                        off.block("blocks", i)?.finish()?;
                    }
                    off.end_step()?;
                }
            }
        }
        let loss = (&y * &y).f_sum(Kind::Float).map_err(err("loss"))?;
        loss.f_backward().map_err(err("backward"))?;
        let bytes = |t: &Tensor| -> std::result::Result<Vec<u8>, CaseError> {
            let t = t.f_to_device(Device::Cpu).and_then(|t| t.f_contiguous()).map_err(err("reading"))?;
            let n = t.numel() * 4;
            let mut v = vec![0u8; n];
            t.f_copy_data_u8(&mut v, t.numel()).map_err(err("reading"))?;
            Ok(v)
        };
        Ok((bytes(&y.f_detach().map_err(err("output"))?)?, bytes(&xg.grad())?))
    };
    let (y_ref, g_ref) = run(None)?;
    crate::ensure!(g_ref.iter().any(|&b| b != 0), "the resident gradient is all zeros");
    let mut off = TchOffload::new(backend, &vs, "model", &NameDiscovery, &Plan::layerwise().prefetch_depth(1))?;
    let (y, g) = run(Some(&mut off))?;
    crate::ensure!(y == y_ref, "streamed output differs from the resident output");
    let diff = g.iter().zip(&g_ref).filter(|(a, b)| a != b).count();
    crate::ensure!(diff == 0, "input gradient after backward() differs from the resident one in {diff} of {} bytes", g.len());
    off.close()?;
    Ok(())
}
