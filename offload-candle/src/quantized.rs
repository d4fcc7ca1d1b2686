//! GGUF blocks as candle's quantized tensors: a streamed block's stored bytes
//! (Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16) become `QTensor`s for `QMatMul`
//! and candle-transformers' quantized layers, never dequantised on the way.

use crate::CandleBackend;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use offload_core::sim::SimSlot;
use offload_core::{BlockLayout, DType, Error, Result};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

/// candle's GGML type of an offload dtype, for the types GGUF blocks hold.
pub fn ggml_dtype(d: DType) -> Option<GgmlDType> {
    Some(match d {
        DType::F32 => GgmlDType::F32,
        DType::F16 => GgmlDType::F16,
        DType::BF16 => GgmlDType::BF16,
        DType::Q8_0 => GgmlDType::Q8_0,
        DType::Q4_K => GgmlDType::Q4K,
        DType::Q5_K => GgmlDType::Q5K,
        DType::Q6_K => GgmlDType::Q6K,
        _ => return None,
    })
}

impl CandleBackend {
    /// The tensors of a block in `slot`, laid out as `layout`, as candle
    /// `QTensor`s on the CPU device (one copy each out of the slot, as
    /// [`tensors`](CandleBackend::tensors) makes), named relative to `prefix`.
    /// A dtype candle's quantized tensors cannot hold is an error naming the tensor.
    pub fn qtensors(&self, slot: &SimSlot, layout: &BlockLayout, prefix: &str) -> Result<HashMap<String, Arc<QTensor>>> {
        self.host_device().read_slot(slot, |bytes| {
            let mut map = HashMap::with_capacity(layout.tensors.len());
            for t in &layout.tensors {
                let bad = |fault: String| Error::BadTensor { tensor: t.spec.name.clone(), fault };
                let dtype = ggml_dtype(t.spec.dtype).ok_or_else(|| bad(format!("dtype {:?} is not a GGUF type", t.spec.dtype)))?;
                let raw = t.bytes_in(bytes)?;
                // candle reads the bytes as its block structs: refuse, not panic, on a
                // length or an address they cannot have.
                if t.nbytes % dtype.type_size() != 0 || raw.as_ptr() as usize % 4 != 0 {
                    return Err(bad(format!(
                        "{} bytes at {:p} are not whole {dtype:?} blocks on a 4-byte boundary",
                        t.nbytes,
                        raw.as_ptr()
                    )));
                }
                let storage = QStorage::from_data(Cow::Borrowed(raw), &Device::Cpu, dtype).map_err(|e| bad(e.to_string()))?;
                let q = QTensor::new(storage, t.spec.shape.as_slice()).map_err(|e| bad(e.to_string()))?;
                let name = t.spec.name.strip_prefix(prefix).unwrap_or(&t.spec.name).to_owned();
                crate::insert_once(&mut map, name, Arc::new(q), &t.spec.name)?;
            }
            Ok(map)
        })
    }
}
