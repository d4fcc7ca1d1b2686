//! The backend-independent core of `offload`.
//!
//! Design choices:
//!
//! - **Static dispatch.** A backend is a type implementing [`OffloadBackend`] with
//!   associated types for its host buffers, slots and events; the [`Ring`] is
//!   generic over it. Hooks are `dyn`, since monomorphizing them would only grow
//!   compile time.
//! - **Immutable weights.** The [`HostStore`] is built once, one contiguous buffer
//!   per block, and never written again; nothing is ever copied back.
//! - **The protocol is the backend's contract.** Ready before read, free after last
//!   use, no host sync in the steady state: the ring keeps it, the simulated
//!   backend ([`sim`], feature `sim`) checks it, the conformance suite in `tests/`
//!   proves each backend against it.
//! - **Order is learned.** The ring predicts the next block from what followed it
//!   last time; what it did not predict is served correctly and counted.
//! - **Transactional.** Building a ring or loading an on-demand component either
//!   completes or releases everything it took; the host store is never touched.
//! - **No GPU crate here.** `offload-core` names no cudarc, candle or tch, and has
//!   no `unsafe`.
//!
//! A five-line tour, on the simulated backend:
//!
//! ```
//! # #[cfg(feature = "sim")] fn main() -> offload_core::Result<()> {
//! use offload_core::{sim::SimBackend, *};
//! use std::sync::Arc;
//! let mut tensors = MemoryTensors::new();
//! for i in 0..4 {
//!     tensors.push(TensorSpec::new(format!("blocks.{i}.w"), DType::U8, [64]), vec![i as u8; 64])?;
//! }
//! let inventory = NameDiscovery.discover("transformer", tensors.specs())?;
//! let plan = resolve(&Plan::layerwise().prefetch_depth(1), &[inventory.clone()])?;
//! let backend = SimBackend::default_device();
//! let store = Arc::new(HostStore::build(&backend, &inventory, &tensors)?);
//! let mut ring = Ring::new(backend.clone(), store, &plan.components[0])?;
//! for i in 0..4 {
//!     let block = ring.block("blocks", i)?;
//!     let sum: u32 = backend.read_slot(block.slot(), |w| w.iter().map(|&b| b as u32).sum());
//!     assert_eq!(sum, 64 * i as u32);
//! }
//! println!("{}", ring.end_step()?);
//! # Ok(()) }
//! # #[cfg(not(feature = "sim"))] fn main() {}
//! ```

pub mod backend;
pub mod codec;
pub mod coded_file;
pub mod diagnose;
pub mod discovery;
pub mod disk;
pub mod error;
pub mod fault;
pub mod hook;
pub mod host;
pub mod metrics;
pub mod ondemand;
pub mod plan;
pub mod ring;
#[cfg(feature = "sabotage")]
pub mod sabotage;
#[cfg(not(feature = "sabotage"))]
mod sabotage;
#[cfg(feature = "sim")]
pub mod sim;
pub mod source;
pub mod store;
pub mod tensor;
pub mod timeline;

pub use backend::{HostBufferOf, MemoryInfo, OffloadBackend, StreamKind};
pub use coded_file::{CodedEntry, CodedFile, CodedFileStats};
pub use diagnose::{diagnose, BlockWait, Cause, DiagnoseInput, Diagnosis};
pub use discovery::{BlockDiscovery, BlockId, BlockSpec, ComponentInventory, DeclaredStacks, NameDiscovery, StackSpec};
pub use disk::DiskFile;
pub use error::{Error, Result};
pub use fault::{FaultInjector, FaultKind};
pub use hook::{BlockContext, BlockSource, Hook, TraceRecorder};
pub use host::{Fill, HostBuffer, HostCapabilities, HostKind, HostMemory};
pub use metrics::{host_rss_beyond_page_cache, host_rss_file_bytes, StepMetrics};
pub use ondemand::OnDemand;
pub use plan::{
    resolve, resolve_on, ComponentPlan, PinFallback, Plan, ResidentPolicy, ResolvedComponent, ResolvedPlan, Strategy, MAX_PREFETCH_DEPTH,
};
pub use ring::{BlockGuard, Ring};
pub use source::{CheckpointFile, FileIdentity, FileRegion, HostRegion, MemoryTensors, RegionSource, SafetensorsFile, TensorSource};
pub use store::{probe_bandwidth, HostBlock, HostStore, HostTier, PinOptions};
pub use tensor::{align_up, f32_to_fp8, fp8_to_f32, BlockLayout, DType, PlacedTensor, TensorSpec, TENSOR_ALIGN};
pub use timeline::{HostMark, Span, Timeline};
