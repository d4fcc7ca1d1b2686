//! `offload`: run transformer models larger than the GPU by streaming each block's
//! weights from page-locked host memory, overlapping each copy with the previous
//! block's compute and never copying weights back.
//!
//! This facade only re-exports. Pick a backend with a Cargo feature:
//!
//! - `cuda`: raw CUDA through cudarc ([`cuda`]),
//! - `candle`: candle tensors ([`candle`]),
//! - `tch`: libtorch through tch ([`tch`]),
//! - `vulkan`: Vulkan through ash ([`vulkan`]),
//! - `sim`: the simulated backend that runs everywhere ([`core::sim`]).
//!
//! The backend-independent parts (host store, ring, plan, discovery, metrics) are
//! [`offload_core`], re-exported at the top level; plans in TOML and the planner are
//! [`plan`].

pub use offload_core as core;
pub use offload_core::*;
pub use offload_formats as formats;
/// Plans as TOML, the cost model and the planner.
pub use offload_plan as plan;

/// The raw CUDA backend (feature `cuda`).
#[cfg(feature = "cuda")]
pub use offload_cuda as cuda;

/// The candle backend (feature `candle`).
#[cfg(feature = "candle")]
pub use offload_candle as candle;

/// The libtorch backend (feature `tch`).
#[cfg(feature = "tch")]
pub use offload_tch as tch;

/// The Vulkan backend (feature `vulkan`).
#[cfg(feature = "vulkan")]
pub use offload_vulkan as vulkan;
