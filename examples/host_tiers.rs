//! The host tiers (docs/host-tiers.md, docs/coded-streaming.md): a checkpoint
//! served from its own pages (mapped), blocks left in the file and read at each
//! use (disk), and blocks coded once into a file beside the checkpoint.
//! `cargo run --release --example host_tiers --features cuda -- model.safetensors`

use offload::cuda::{map_checkpoint, CudaBackend};
use offload::*;
use std::sync::Arc;

fn main() -> Result<()> {
    let path = std::env::args().nth(1).ok_or_else(|| Error::Plan("usage: host_tiers MODEL.safetensors".into()))?;
    let backend = CudaBackend::new(0)?;
    let file = SafetensorsFile::open(&path)?;
    let inventory = NameDiscovery.discover("transformer", file.specs())?;
    let layerwise = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory))?;

    // Mapped: host memory at 1 × the model, the page cache shared by every process.
    let mapped = map_checkpoint(&path)?; // mapped read-only, header checked
    let store = Arc::new(HostStore::build_mapped(&backend, &inventory, &mapped, PinOptions::default())?);
    println!("{:?}", store.tier()); // blocks served in place, blocks copied and why, build time
    stream(&backend, store, &layerwise.components[0])?;

    // Disk: host memory smaller than the model.
    let cp = ComponentPlan { host_ram_budget_bytes: Some(8 << 30), ..Default::default() };
    let plan = resolve(&Plan::layerwise().component("transformer", cp), std::slice::from_ref(&inventory))?;
    let rc = &plan.components[0];
    let store = Arc::new(HostStore::build_tiered(&backend, &inventory, &file, PinOptions::default(), &|id| rc.is_on_disk(id))?);
    stream(&backend, store, rc)?; // metrics: disk_bytes_read, disk_wait_s, host_bounce_bytes

    // Coded: fewer bytes on the wire, coded once into a file beside the checkpoint.
    let coded = CodedFile::path_for(&path); // model.safetensors.offload-coded
    if !coded.exists() {
        CodedFile::write(&coded, &inventory, &file, 32 << 20, 16)?; // once, ahead of time
    }
    let store = Arc::new(HostStore::build_from_coded_file(&backend, &inventory, &file, PinOptions::default(), &CodedFile::open(&coded)?)?);
    stream(&backend, store, &layerwise.components[0])
}

/// Three steps over every block, in order (your kernels go where each block is held).
fn stream(backend: &CudaBackend, store: Arc<HostStore<CudaBackend>>, plan: &ResolvedComponent) -> Result<()> {
    let mut ring = Ring::new(backend.clone(), store, plan)?;
    for step in 0..3 {
        for b in 0..ring.len() {
            ring.block_at(b)?.finish()?;
        }
        println!("step {step}: {}", ring.end_step()?);
    }
    ring.close()
}
