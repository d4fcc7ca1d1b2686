//! Checkpoint formats and model name maps, beside the engine (`offload-core`):
//! what a file holds and under which names, never how it streams.
//!
//! - [`gguf`]: GGUF files read as stored (quantized blocks never dequantised),
//!   a [`TensorSource`](offload_core::TensorSource) like a safetensors file.
//! - [`fp8`]: the fp8 scale conventions of safetensors checkpoints and the CPU
//!   reference of their dequantisation.
//! - [`rename`]: a checkpoint under another model's names (Flux, Wan and
//!   Qwen-Image releases, and GGUF files, under diffusers' names).
//!
//! The engine depends on none of this: a source of tensors is any
//! [`TensorSource`](offload_core::TensorSource).

pub mod fp8;
pub mod gguf;
pub mod rename;

pub use fp8::{fp8_weights, Fp8Convention, Fp8Weight, Fp8Weights};
pub use gguf::{GgufFile, GgufValue};
pub use rename::{
    flux_bfl_tensors, flux_bfl_to_diffusers, gguf_to_diffusers, gguf_under_diffusers_names, qwen_image_to_diffusers, wan_to_diffusers,
    FluxSizes, Renamed, GGUF_ARCHITECTURES,
};
