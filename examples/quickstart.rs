//! The README's example: every block of a safetensors checkpoint streamed to a
//! CUDA GPU one block at a time, each copy overlapping the previous block's
//! compute, the device copy dropped after use.
//! `cargo run --release --example quickstart --features cuda -- model.safetensors`

use offload::cuda::{CudaBackend, CudaBlockExt};
use offload::*;
use std::sync::Arc;

fn main() -> Result<()> {
    let path = std::env::args().nth(1).ok_or_else(|| Error::Plan("usage: quickstart MODEL.safetensors".into()))?;
    let file = SafetensorsFile::open(&path)?; // the header checked, no weight read yet
    let inventory = NameDiscovery.discover("transformer", file.specs())?; // stacks from `<stack>.<index>.<rest>`
    let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&inventory))?;
    let backend = CudaBackend::new(0)?;
    let store = Arc::new(HostStore::build(&backend, &inventory, &file)?); // page-locked, one buffer per block
    let mut ring = Ring::new(backend.clone(), store, &plan.components[0])?;
    for step in 0..3 {
        for stack in &inventory.stacks {
            for i in 0..stack.blocks.len() {
                let block = ring.block(&stack.name, i)?; // the compute stream waits for its copy
                for (_name, _device_ptr) in block.tensor_ptrs() {
                    // Enqueue your kernels reading the tensor at `_device_ptr` on
                    // `backend.compute_stream()` here.
                }
                block.finish()?; // the slot is reused once the kernels enqueued so far ran
            }
        }
        println!("step {step}: {}", ring.end_step()?); // bytes, misses, peak device bytes
    }
    ring.close()
}
