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

/// Bytes of a safetensors file holding `tensors` (name, dtype as the header
/// names it, shape, bytes) in the order given, each at a multiple of
/// [`TENSOR_ALIGN`](offload_core::TENSOR_ALIGN) of the data: laid out as the host
/// store lays blocks out, so the mapped tier serves each block in place and the
/// disk tier reads each as one range.
pub fn laid_out_safetensors(tensors: &[(&str, &str, &[usize], &[u8])]) -> Vec<u8> {
    let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
    for (name, dtype, shape, bytes) in tensors {
        data.resize(data.len().next_multiple_of(offload_core::TENSOR_ALIGN), 0);
        let at = data.len();
        data.extend_from_slice(bytes);
        header.insert(name.to_string(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [at, data.len()]}));
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).expect("a JSON header");
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    out
}
