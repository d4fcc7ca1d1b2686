//! How a model is wrapped: its weights as a [`TensorSource`] (here eight small
//! blocks held in memory; a checkpoint would be a `SafetensorsFile`), a pinned host
//! store, and a ring that streams one block at a time to the GPU while the
//! previous one computes. `cargo run -p offload-cuda --example stream`; without a
//! CUDA GPU it says so and exits.

use offload_core::{resolve, BlockDiscovery, DType, HostStore, MemoryTensors, NameDiscovery, Plan, Result, Ring, TensorSource, TensorSpec};
use offload_cuda::{CudaBackend, CudaBlockExt};
use std::sync::Arc;

const BLOCKS: usize = 8;

fn main() -> Result<()> {
    // 1. The weights, named `<stack>.<index>.<rest>`: eight blocks of one 1024 × 1024 bf16 matrix.
    let mut tensors = MemoryTensors::new();
    for i in 0..BLOCKS {
        let spec = TensorSpec::new(format!("blocks.{i}.weight"), DType::BF16, vec![1024, 1024]);
        tensors.push(spec, vec![i as u8; 2 << 20])?;
    }
    let inventory = NameDiscovery.discover("model", tensors.specs())?;
    // 2. The plan: layer by layer, the next block copied while this one computes.
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory))?;
    // 3. The backend, the host store (one pinned buffer per block) and the ring.
    let backend = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("no CUDA GPU to stream to ({e}); this example needs one");
            std::process::exit(2);
        }
    };
    let store = Arc::new(HostStore::build(&backend, &inventory, &tensors)?);
    let mut ring = Ring::new(backend.clone(), store, &plan.components[0])?;
    // 4. The forward: ask the ring for each block; its guard holds it on the device.
    for step in 0..3 {
        for i in 0..BLOCKS {
            let block = ring.block("blocks", i)?;
            let weight = block.tensor_ptr("weight")?;
            // Your kernels go here, enqueued on `backend.compute_stream()` and
            // reading the device address `weight`; they run after the block's copy.
            if step == 0 && i == 0 {
                println!("{} at device address {weight:#x}", block.id());
            }
            // The slot is reused once the compute enqueued so far has run.
            block.finish()?;
        }
        println!("step {step}: {}", ring.end_step()?);
    }
    ring.close()
}
