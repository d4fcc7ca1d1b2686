//! Turning cudarc's driver errors into the core error, naming the operation.

use cudarc::driver::{sys, DriverError};
use offload_core::Error;

/// The backend name used in errors.
pub const BACKEND: &str = "cuda";

/// A driver error during `during`, as the core error.
pub fn driver(during: impl Into<String>, e: DriverError) -> Error {
    Error::device(BACKEND, during, e)
}

/// Whether `e` is the driver's out-of-memory error.
pub fn is_oom(e: &DriverError) -> bool {
    e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY
}

/// A device error of this crate that is not a driver call's (NVRTC, a module
/// load): what was being done, and the error.
pub fn dev(during: &str, e: impl std::fmt::Display) -> Error {
    Error::device(BACKEND, during, e)
}
