//! Loading a checkpoint end to end on the simulated device (header → discovery →
//! host store → ring → one pass), as the fuzz target, the corpus replay and the
//! fault table all do it: any input gives `Ok` or an error, never a panic.

use offload_core::sim::{SimBackend, SimConfig};
use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, Plan, Ring, SafetensorsFile, TensorSource};
use std::path::Path;
use std::sync::Arc;

/// What loading `path` did: the number of blocks served, or the error's text.
pub fn load_on_sim(path: &Path) -> Result<usize, String> {
    let file = SafetensorsFile::open(path).map_err(|e| e.to_string())?;
    let inventory = NameDiscovery.discover("transformer", file.specs()).map_err(|e| e.to_string())?;
    let backend = SimBackend::new(SimConfig::fast());
    let store = Arc::new(HostStore::build(&backend, &inventory, &file).map_err(|e| e.to_string())?);
    if inventory.blocks().count() < 2 {
        return Ok(0);
    }
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory)).map_err(|e| e.to_string())?.components.remove(0);
    let mut ring = Ring::new(backend.clone(), store, &rc).map_err(|e| e.to_string())?;
    for b in 0..ring.len() {
        let g = ring.block_at(b).map_err(|e| e.to_string())?;
        backend.read_slot(g.slot(), |m| std::hint::black_box(m.len()));
    }
    ring.close().map_err(|e| e.to_string())?;
    backend.check().map_err(|e| e.to_string())?;
    Ok(inventory.blocks().count())
}

/// Bytes of a small valid checkpoint: `blocks` blocks of two tensors, plus a head.
pub fn valid_checkpoint(blocks: usize) -> Vec<u8> {
    let data: Vec<Vec<u8>> = (0..2 * blocks + 1).map(|i| (0..96).map(|j| (i * 31 + j * 7) as u8).collect()).collect();
    let mut views = Vec::new();
    for b in 0..blocks {
        for (t, name) in ["attn.qkv.weight", "mlp.fc.weight"].iter().enumerate() {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![4, 12], &data[2 * b + t]).expect("valid view");
            views.push((format!("blocks.{b}.{name}"), v));
        }
    }
    let head = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![96], &data[2 * blocks]).expect("valid view");
    views.push(("head.weight".to_owned(), head));
    safetensors::serialize(views, &None).expect("serializes")
}
