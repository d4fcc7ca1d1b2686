//! Reading torch tensors through DLPack capsules (`torch.utils.dlpack.to_dlpack`):
//! where a tensor's bytes are, on which device, how many. The capsule keeps the
//! tensor alive; nothing here takes ownership of it (the capsule's own
//! destructor frees it). A capsule is made right before it is read, with no
//! Python code run in between: its data pointer is never used after Python
//! could have freed or moved the tensor's memory.

use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods};
use std::ffi::c_void;

/// DLPack's device types this crate reads.
pub const DL_CPU: i32 = 1;
/// CUDA device memory.
pub const DL_CUDA: i32 = 2;
/// Page-locked host memory of CUDA.
pub const DL_CUDA_HOST: i32 = 3;

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// Where a dense tensor's bytes are.
#[derive(Clone, Copy, Debug)]
pub struct Located {
    /// The first byte's address (data plus byte offset).
    pub addr: usize,
    /// Bytes: elements times element size.
    pub nbytes: usize,
    /// DLPack's type code of its elements (0 int, 1 uint, 2 float, 4 bfloat, 6 bool, …).
    pub code: u8,
    /// Bits an element.
    pub bits: u8,
    /// DLPack's device type ([`DL_CPU`], [`DL_CUDA`], ...).
    pub device_type: i32,
    /// The device's ordinal.
    pub device_id: i32,
}

/// Read a `"dltensor"` capsule: the tensor must be dense (no strides, or
/// row-major compact ones) with whole-byte elements and one lane.
pub fn locate(capsule: &Bound<'_, PyAny>, what: &str) -> PyResult<Located> {
    let capsule = capsule
        .cast::<PyCapsule>()
        .map_err(|_| crate::error(format!("{what}: not a DLPack capsule (torch.utils.dlpack.to_dlpack gives one)")))?;
    let ptr = capsule
        .pointer_checked(Some(c"dltensor"))
        .map_err(|_| crate::error(format!("{what}: the capsule is not an unused \"dltensor\" capsule")))?;
    // The capsule is borrowed for this call; no Python code runs before the fields are copied out.
    // SAFETY: a "dltensor" capsule holds a live `DLManagedTensor` while unconsumed (DLPack).
    let t = unsafe { &ptr.cast::<DlManagedTensor>().as_ref().dl_tensor };
    let ndim = usize::try_from(t.ndim).map_err(|_| crate::error(format!("{what}: negative rank {}", t.ndim)))?;
    if ndim > 0 && t.shape.is_null() {
        return Err(crate::error(format!("{what}: rank {ndim} with no shape")));
    }
    let shape: Vec<i64> = if ndim == 0 {
        Vec::new()
    } else {
        // SAFETY: DLPack's `shape` points at `ndim` values owned by the managed tensor.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec()
    };
    let strides: Option<Vec<i64>> = if t.strides.is_null() || ndim == 0 {
        None
    } else {
        // SAFETY: a non-null `strides` points at `ndim` values, as `shape`.
        Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec())
    };
    if t.dtype.lanes != 1 || t.dtype.bits % 8 != 0 || t.dtype.bits == 0 {
        return Err(crate::error(format!("{what}: elements of {} bits in {} lanes are not whole bytes", t.dtype.bits, t.dtype.lanes)));
    }
    let mut numel = 1usize;
    for &d in &shape {
        let d = usize::try_from(d).map_err(|_| crate::error(format!("{what}: negative dimension in {shape:?}")))?;
        numel = numel.checked_mul(d).ok_or_else(|| crate::error(format!("{what}: shape {shape:?} overflows")))?;
    }
    if let Some(strides) = strides {
        let mut want = 1i64;
        for (&d, &s) in shape.iter().zip(&strides).rev() {
            if d != 1 && s != want {
                return Err(crate::error(format!("{what}: not contiguous (shape {shape:?}, strides {strides:?})")));
            }
            want = want.saturating_mul(d);
        }
    }
    let nbytes =
        numel.checked_mul(usize::from(t.dtype.bits / 8)).ok_or_else(|| crate::error(format!("{what}: shape {shape:?} overflows")))?;
    let offset = usize::try_from(t.byte_offset).map_err(|_| crate::error(format!("{what}: byte offset {} overflows", t.byte_offset)))?;
    let addr = (t.data as usize).checked_add(offset).ok_or_else(|| crate::error(format!("{what}: address overflows")))?;
    if nbytes > 0 && addr == 0 {
        return Err(crate::error(format!("{what}: a null data pointer for {nbytes} bytes")));
    }
    Ok(Located { addr, nbytes, code: t.dtype.code, bits: t.dtype.bits, device_type: t.device.device_type, device_id: t.device.device_id })
}

/// Whether DLPack elements of `code` and `bits` are `dtype`'s. fp8 types have
/// codes of their own (10 and 12 under DLPack 1.1; any code but the integer,
/// float and bool ones is taken, for torch versions that number them otherwise).
fn holds(dtype: offload_core::DType, code: u8, bits: u8) -> bool {
    use offload_core::DType as D;
    let (int, uint, float, bfloat, bool_) = (0, 1, 2, 4, 6);
    let want_bits = match dtype {
        D::BOOL | D::U8 | D::I8 | D::F8_E4M3 | D::F8_E5M2 => 8,
        D::I16 | D::U16 | D::F16 | D::BF16 => 16,
        D::I32 | D::U32 | D::F32 => 32,
        D::I64 | D::U64 | D::F64 => 64,
        // Block-quantized types are no torch dtype: never handed over as such.
        _ => return false,
    };
    bits == want_bits
        && match dtype {
            D::I8 | D::I16 | D::I32 | D::I64 => code == int,
            D::U8 | D::U16 | D::U32 | D::U64 => code == uint,
            D::F16 | D::F32 | D::F64 => code == float,
            D::BF16 => code == bfloat,
            D::BOOL => code == bool_,
            _ => ![int, uint, float, bfloat, bool_].contains(&code),
        }
}

/// Copy the bytes of host tensor `tensor`, declared `dtype`, into `dst`
/// (exactly its size), through a capsule made here and read before any Python
/// code runs. A tensor of another dtype is an error naming it.
pub fn read_host(tensor: &Bound<'_, PyAny>, what: &str, dtype: offload_core::DType, dst: &mut [u8]) -> PyResult<()> {
    let py = tensor.py();
    let capsule = py.import("torch")?.getattr("utils")?.getattr("dlpack")?.call_method1("to_dlpack", (tensor,))?;
    let at = locate(&capsule, what)?;
    // Declared and held alike: bf16 bytes read as F32 (the same byte count, other
    // elements) would stream as another tensor.
    if !holds(dtype, at.code, at.bits) {
        return Err(crate::error(format!(
            "{what}: declared {dtype:?}, the tensor holds elements of DLPack type code {} and {} bits",
            at.code, at.bits
        )));
    }
    if !matches!(at.device_type, DL_CPU | DL_CUDA_HOST) {
        return Err(crate::error(format!("{what}: in device memory (type {}), not host memory", at.device_type)));
    }
    if at.nbytes != dst.len() {
        return Err(crate::error(format!("{what}: {} bytes in the tensor, {} expected", at.nbytes, dst.len())));
    }
    if at.nbytes > 0 {
        // The capsule was made just above, and no Python bytecode runs until the
        // copy ends (this thread holds the GIL throughout; the threads the copy
        // is split over run none). What the GIL does not exclude, as before the
        // copy was split: native code of another thread writing or freeing the
        // tensor meanwhile (a torch op that let the GIL go, a non-blocking copy
        // still landing in a pinned tensor): the caller's tensors are handed over
        // at rest (`enable` reads the module's parameters, nothing else).
        // SAFETY: `locate` checked a live dense host tensor of `nbytes` at `addr`,
        // which `dst` (the store's buffer, exclusively borrowed) cannot overlap.
        let src = unsafe { std::slice::from_raw_parts(at.addr as *const u8, at.nbytes) };
        offload_core::host::copy_parallel(dst, src);
    }
    Ok(())
}
