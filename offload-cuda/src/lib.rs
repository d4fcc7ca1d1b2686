//! The raw CUDA backend of `offload`, through cudarc.
//!
//! Design choices:
//!
//! - **Run-time loading.** cudarc opens `libcuda` at run time, so this crate builds
//!   and its tests run (skipping visibly) on machines without CUDA;
//!   [`CudaBackend::new`] returns `Unsupported` where there is no driver.
//! - **Two streams, events between them.** Copies run on a non-blocking copy
//!   stream; the model computes on the compute stream; the ring orders them with
//!   events. cudarc's own per-slice event tracking is off.
//! - **Pinned, not write-combined.** Host buffers come from `cuMemHostAlloc`
//!   (portable); copies from them run at full PCIe bandwidth.
//! - **Stream-ordered slots.** Slots come from the device's default pool
//!   (`cuMemAllocAsync`, release threshold at `u64::MAX`, so freed slots are reused
//!   and never returned to the driver mid-run) and are freed on the compute stream
//!   after their last copy and last read, never blocking the host.
//! - **Memory safety does not rest on the protocol.** A host buffer is freed only
//!   after the copy stream drained (and leaked if the drain fails); a slot only
//!   after its last copy; host memory is zeroed before a `fill` closure sees it;
//!   a buffer or slot of another backend instance is refused.
//! - **Event tracking off, behind `unsafe`.** cudarc's per-slice event tracking is
//!   off on the context [`CudaBackend::new`] makes (the ring orders its streams
//!   itself), so the context and streams are reachable only through `unsafe`
//!   accessors whose callers order cross-stream uses themselves. What the backend
//!   hands safe code is opaque for the same reason: its events are [`CudaEvent`]s
//!   and decoded bytes [`DecodedBytes`], not cudarc's `CudaEvent` and `CudaSlice`,
//!   whose safe `context()` and `stream()` would reach that context.
//! - **A checking mode for conformance.** [`CudaBackend::enable_checking`] poisons
//!   each slot and delays each copy on the copy stream, so a missing wait shows up
//!   as a wrong result on a real device, not as lucky timing.
//! - **Users bring their own kernels.** [`CudaBlockExt`] gives the device address
//!   of every tensor of a block; enqueue kernels on
//!   [`CudaBackend::compute_stream`].
//!
//! - [`map_checkpoint`]: the mapped host tier, a checkpoint mapped read-only and
//!   registered with the device once, its blocks served from the file's pages.

// The layers, from the bottom: `error` and `nvrtc`; the core (`engine`,
// `memory`); what stands on it (`codec`, `coded`, `mapped`, `relay`); the
// buffers made of those (`host`); the backend that wires them (`device`); and
// what is built on the backend (`fold`, `decoder`, `fresh`, `checked`,
// `reference`). No file imports one above it (the tidy test checks it).
pub mod checksum;
pub mod codec;
pub mod coded;
pub mod decoder;
mod device;
mod engine;
mod error;
pub mod framework_buffers;
#[cfg(test)]
mod gpu_tests;
mod host;
pub mod mapped;
mod memory;
mod nvrtc;
pub mod protocol_log;
pub mod reference;
pub mod relay;

pub use checksum::DeviceSlot;
pub use coded::{CodingOptions, STAGING_BUFFERS};
pub use cudarc;
pub use decoder::{DecodedBytes, DeviceCoded, ExponentDecoder};
pub use device::{CudaBackend, CudaCounters};
pub use engine::{driver_present, no_device, CudaEvent, POISON};
pub use framework_buffers::{FrameworkBufferEngine, FrameworkBufferSlot};
pub use host::CudaHostBuffer;
pub use mapped::{map_checkpoint, MappedFile};
pub use memory::CudaSlot;
pub use relay::{RelayInfo, RelayOptions};

use offload_core::{BlockGuard, BlockLayout, OffloadBackend, Result};

/// The device address of tensor `name` (full name, or the part after the block
/// prefix) of a block laid out as `layout` in `slot`.
pub fn tensor_ptr(slot: &CudaSlot, layout: &BlockLayout, name: &str) -> Result<u64> {
    slot.tensor_ptr(layout, name)
}

/// Device addresses of a block's tensors, for compute written against raw CUDA.
pub trait CudaBlockExt {
    /// The device address of tensor `name` (full name, or the part after the block prefix).
    fn tensor_ptr(&self, name: &str) -> Result<u64>;
    /// Every tensor's full name and device address.
    fn tensor_ptrs(&self) -> Vec<(&str, u64)>;
}

impl<B: OffloadBackend<Slot = CudaSlot>> CudaBlockExt for BlockGuard<'_, B> {
    fn tensor_ptr(&self, name: &str) -> Result<u64> {
        tensor_ptr(self.slot(), self.layout(), name)
    }
    fn tensor_ptrs(&self) -> Vec<(&str, u64)> {
        let base = self.slot().device_ptr();
        self.layout().tensors.iter().map(|t| (t.spec.name.as_str(), base + t.offset as u64)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver library the backend is `Unsupported` (no panic); with
    /// one it opens, or the failure is this test's (a device is then required
    /// of it under `OFFLOAD_REQUIRE_DEVICE=1`, and a driver that sees none skips).
    #[test]
    fn no_driver_is_unsupported_not_a_panic() {
        let required = std::env::var("OFFLOAD_REQUIRE_DEVICE").as_deref() == Ok("1");
        match CudaBackend::new(0) {
            Ok(b) => assert!(!b.device_name().unwrap_or_default().is_empty(), "a device with no name"),
            Err(e) if !driver_present() => {
                assert!(e.to_string().contains("unsupported"), "{e}");
                assert!(!required, "OFFLOAD_REQUIRE_DEVICE=1 but no CUDA driver library: {e}");
                eprintln!("SKIPPED: no CUDA driver library ({e})");
            }
            Err(e) if no_device() && !required => eprintln!("SKIPPED: the driver sees no device: {e}"),
            Err(e) => panic!("CUDA driver present but the backend failed: {e}"),
        }
    }
}
