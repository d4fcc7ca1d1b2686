//! Tests of the layers below the backend that need the whole backend (a
//! device, a store, a ring): kept here, above every layer, so that no file
//! imports the backend that is built on it.

mod coded;
mod mapped;

use crate::device::CudaBackend;

/// The backend on device 0 for a GPU test, or `None` after printing `SKIPPED`
/// where no driver is installed (a failure under `OFFLOAD_REQUIRE_DEVICE=1`, and
/// any other error a failure).
pub(crate) fn test_backend() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) if !crate::engine::driver_present() => {
            assert!(std::env::var("OFFLOAD_REQUIRE_DEVICE").as_deref() != Ok("1"), "a CUDA device is required: {e}");
            println!("SKIPPED: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("CUDA driver present but the backend failed: {e}"),
    }
}
