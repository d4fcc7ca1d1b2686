//! Tensors between offload and libtorch: dtypes, errors, a `VarStore` as a tensor source.

use offload_core::{DType, Error, Result, TensorSource, TensorSpec};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

pub(crate) const BACKEND: &str = "tch";

pub(crate) fn tch_err(during: impl Into<String>, e: tch::TchError) -> Error {
    Error::device(BACKEND, during, e)
}

/// The tch kind of an offload dtype.
pub fn kind_of(d: DType) -> Option<Kind> {
    Some(match d {
        DType::BOOL => Kind::Bool,
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I32 => Kind::Int,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::I64 => Kind::Int64,
        DType::F8_E4M3 => Kind::Float8e4m3fn,
        DType::F8_E5M2 => Kind::Float8e5m2,
        _ => return None,
    })
}

/// The offload dtype of a tch kind.
pub fn dtype_of(k: Kind) -> Option<DType> {
    Some(match k {
        Kind::Bool => DType::BOOL,
        Kind::Uint8 => DType::U8,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Int => DType::I32,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Int64 => DType::I64,
        Kind::Float8e4m3fn => DType::F8_E4M3,
        Kind::Float8e5m2 => DType::F8_E5M2,
        _ => return None,
    })
}

/// The variables of a `VarStore` as a [`TensorSource`]: names, dtypes and shapes
/// up front, bytes read (through the host) when the host store asks.
pub struct VarStoreTensors {
    pub(crate) specs: Vec<TensorSpec>,
    pub(crate) tensors: Vec<Tensor>,
}

impl VarStoreTensors {
    /// Every variable of `vs`, sorted by name.
    pub fn new(vs: &VarStore) -> Result<Self> {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut specs = Vec::with_capacity(vars.len());
        let mut tensors = Vec::with_capacity(vars.len());
        for (name, t) in vars {
            let kind = t.f_kind().map_err(|e| tch_err(format!("reading the kind of {name}"), e))?;
            let dtype = dtype_of(kind)
                .ok_or_else(|| Error::BadTensor { tensor: name.clone(), fault: format!("kind {kind:?} has no offload dtype") })?;
            let shape = t.size().into_iter().map(|d| d as usize).collect::<Vec<_>>();
            specs.push(TensorSpec::new(name, dtype, shape));
            tensors.push(t);
        }
        Ok(VarStoreTensors { specs, tensors })
    }
}

impl TensorSource for VarStoreTensors {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    /// The tensor copied straight into `dst` (on CUDA, one device-to-host copy into
    /// the pinned block buffer): a CPU tensor laid over `dst`, dropped before return.
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let spec = &self.specs[index];
        let name = &spec.name;
        let need = spec.nbytes()?;
        if dst.len() != need {
            return Err(Error::BadTensor { tensor: name.clone(), fault: format!("{} bytes given for a {need}-byte tensor", dst.len()) });
        }
        let kind = kind_of(spec.dtype).ok_or_else(|| Error::BadTensor { tensor: name.clone(), fault: "no tch kind".into() })?;
        let size: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
        // The variable as it is now: one changed since `new` (`set_data`, a cast)
        // would be converted or broadcast by `copy_` into another tensor's bytes.
        let t = &self.tensors[index];
        let now = (t.f_kind().map_err(|e| tch_err(format!("reading the kind of {name}"), e))?, t.size());
        if now != (kind, size.clone()) {
            return Err(Error::BadTensor {
                tensor: name.clone(),
                fault: format!("is {:?} {:?} now, {kind:?} {size:?} when the store was planned: the VarStore changed since", now.0, now.1),
            });
        }
        if need == 0 {
            return Ok(());
        }
        if dst.as_ptr() as usize % spec.dtype.size() != 0 {
            // Not aligned for the element type: through a CPU copy, as before.
            let t = self.tensors[index]
                .f_to_device(Device::Cpu)
                .and_then(|t| t.f_contiguous())
                .map_err(|e| tch_err(format!("reading {name}"), e))?;
            return t.f_copy_data_u8(dst, t.numel()).map_err(|e| tch_err(format!("reading {name}"), e));
        }
        let strides: Vec<i64> = (0..size.len()).map(|i| size[i + 1..].iter().product()).collect();
        // SAFETY: `dst` is `need` bytes (checked) aligned for `kind` (checked), exclusively borrowed for this call, and the view over it is dropped before return.
        let mut view = unsafe { Tensor::f_from_blob(dst.as_mut_ptr(), &size, &strides, kind, Device::Cpu) }
            .map_err(|e| tch_err(format!("reading {name}"), e))?;
        let copied = view.f_copy_(&self.tensors[index]).map_err(|e| tch_err(format!("reading {name}"), e));
        drop(view);
        copied
    }
    fn origin(&self) -> String {
        "the VarStore".into()
    }
}
