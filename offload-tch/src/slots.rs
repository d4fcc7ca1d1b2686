//! `TchSlots`: a backend whose slots libtorch parameters can point at; the CPU one.

use crate::tensors::{kind_of, tch_err};
use offload_core::sim::{SimBackend, SimSlot};
use offload_core::{BlockLayout, Error, OffloadBackend, Result, TensorSpec};
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

/// A backend whose slots libtorch can use as tensors.
pub trait TchSlots: OffloadBackend {
    /// The libtorch device the block tensors live on.
    fn tch_device(&self) -> Device;
    /// Point every parameter of `layout` (found in `params` by full name) at its
    /// bytes in `slot`.
    fn bind(&self, slot: &Self::Slot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()>;
}

pub(crate) fn param<'a>(params: &'a mut HashMap<String, Tensor>, name: &str) -> Result<&'a mut Tensor> {
    params.get_mut(name).ok_or_else(|| Error::BadTensor { tensor: name.to_owned(), fault: "not a parameter of the VarStore".into() })
}

pub(crate) fn kind(spec: &TensorSpec) -> Result<Kind> {
    kind_of(spec.dtype)
        .ok_or_else(|| Error::BadTensor { tensor: spec.name.clone(), fault: format!("dtype {:?} has no tch kind", spec.dtype) })
}

pub(crate) fn dims(spec: &TensorSpec) -> Vec<i64> {
    spec.shape.iter().map(|&d| d as i64).collect()
}

/// CPU: host memory is the device (the simulated backend's worker thread copies);
/// each weight is materialised once from the slot.
impl TchSlots for SimBackend {
    fn tch_device(&self) -> Device {
        Device::Cpu
    }
    fn bind(&self, slot: &SimSlot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()> {
        self.read_slot(slot, |bytes| {
            for t in &layout.tensors {
                let raw = t.bytes_in(bytes)?;
                let v = Tensor::f_from_data_size(raw, &dims(&t.spec), kind(&t.spec)?)
                    .map_err(|e| tch_err(format!("materialising {}", t.spec.name), e))?;
                param(params, &t.spec.name)?.f_set_data(&v).map_err(|e| tch_err(format!("pointing {} at its slot", t.spec.name), e))?;
            }
            Ok(())
        })
    }
}
