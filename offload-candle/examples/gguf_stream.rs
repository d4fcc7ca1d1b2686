//! A GGUF file streamed block by block into candle's quantized matmul, on the
//! CPU device: the blocks cross as stored (Q4_K here) and become `QTensor`s.
//!
//! `cargo run -p offload-candle --example gguf_stream`

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use offload_candle::CandleBackend;
use offload_core::*;
use offload_formats::*;
use std::sync::Arc;

fn main() -> Result<()> {
    let ce = |e: candle_core::Error| Error::device("candle", "the example", e);
    // A small model file: two blocks of one Q4_K projection each.
    let path = std::env::temp_dir().join(format!("offload-gguf-example-{}.gguf", std::process::id()));
    let weight = || Tensor::randn(0f32, 0.05, (256, 256), &Device::Cpu).and_then(|t| QTensor::quantize(&t, GgmlDType::Q4K));
    let (w0, w1) = (weight().map_err(ce)?, weight().map_err(ce)?);
    let mut f = std::fs::File::create(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
    gguf_file::write(&mut f, &[], &[("blocks.0.fc.weight", &w0), ("blocks.1.fc.weight", &w1)]).map_err(ce)?;

    let file = GgufFile::open(&path)?;
    let inventory = NameDiscovery.discover("transformer", file.specs())?;
    let backend = CandleBackend::cpu();
    let store = Arc::new(HostStore::build(&backend, &inventory, &file)?);
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory))?;
    let mut ring = Ring::new(backend.clone(), store, &plan.components[0])?;
    let mut x = Tensor::ones((1, 256), candle_core::DType::F32, &Device::Cpu).map_err(ce)?;
    for i in 0..2 {
        let block = ring.block("blocks", i)?;
        let w = backend.qtensors(block.slot(), block.layout(), &format!("blocks.{i}."))?;
        x = QMatMul::from_arc(w["fc.weight"].clone()).and_then(|fc| fc.forward(&x)).map_err(ce)?;
        block.finish()?;
    }
    println!("{}", ring.end_step()?);
    ring.close()?;
    std::fs::remove_file(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
    println!("output: {:?}", x.dims());
    Ok(())
}
