//! The libtorch backend of `offload`, through tch 0.24 (libtorch 2.11): stream the
//! block parameters of an unmodified `tch::nn` model from host memory.
//!
//! ```no_run
//! # #[cfg(feature = "libtorch")]
//! # fn demo() -> offload_core::Result<()> {
//! use offload_core::{NameDiscovery, Plan};
//! use offload_tch::{tch, TchOffload};
//!
//! let vs = tch::nn::VarStore::new(tch::Device::Cpu);
//! let blocks: Vec<tch::nn::Linear> =
//!     (0..4).map(|i| tch::nn::linear(vs.root() / "blocks" / i, 64, 64, Default::default())).collect();
//! // Block parameters move to the host store; the VarStore keeps empty placeholders.
//! let mut off = TchOffload::cpu(&vs, "model", &NameDiscovery, &Plan::layerwise())?;
//! let _guard = tch::no_grad_guard();
//! let mut x = tch::Tensor::ones([1, 64], (tch::Kind::Float, tch::Device::Cpu));
//! for (i, b) in blocks.iter().enumerate() {
//!     let block = off.block("blocks", i)?; // parameters now point at the streamed weights
//!     x = tch::nn::Module::forward(b, &x);
//!     block.finish()?; // back to placeholders; the slot is free once compute is done
//! }
//! off.end_step()?;
//! # Ok(()) }
//! ```
//!
//! Design choices:
//!
//! - **Parameters are re-pointed, never copied back.** Before a block runs, each of
//!   its parameters is pointed (`set_data`) at the block's tensors in the ring's
//!   slot; afterwards at an empty placeholder. The `nn` module holds the same
//!   tensor handles as the `VarStore`, so module code is unchanged.
//! - **CPU (feature `libtorch`).** The ring runs on the simulated device of
//!   `offload-core` (host memory as device, copies on a worker thread, protocol
//!   checks on); binding materialises each weight once from the slot. This is the
//!   CI path.
//! - **CUDA (feature `cuda`).** libtorch computes on the legacy default stream; the
//!   ring's copies run on a cudarc non-blocking stream of the same primary context
//!   (`offload-cuda`), the default stream waits on each copy's event. Each copy lands
//!   in a fresh `Uint8` buffer from libtorch's caching allocator and the weights are
//!   views of it (no copy beyond the host-to-device one).
//! - **No view outlives its block's bytes.** A view or a tensor derived from a
//!   parameter (a product, `Linear`'s transposed weight that autograd saves) holds
//!   a reference to its block's buffer, so it reads that block's weights for as
//!   long as it lives (CPU: each weight is a copy, so the same holds). A parameter
//!   autograd saves *itself* (LayerNorm's or GroupNorm's affine weight, a
//!   convolution's kernel, a scale multiplied in) is read when `backward()` runs,
//!   and after `finish` it points at its empty placeholder: backward through such
//!   a block after the block is finished fails in libtorch (a shape error). Run
//!   backward through tch only over blocks of `Linear`s, or use the Python package,
//!   which gives each block fresh parameter objects.
//! - **Transactional.** `TchOffload::new` builds the host store and the ring before
//!   it empties a parameter, and on any error leaves the `VarStore` as it was.
//! - **Out of the default build.** Without the `libtorch` feature this crate links
//!   nothing and exports only [`TchOffload`]'s error path, so `cargo build
//!   --workspace` never waits for libtorch.

#[cfg(all(feature = "libtorch", feature = "cuda"))]
mod cuda;
#[cfg(feature = "libtorch")]
mod offload;
#[cfg(feature = "libtorch")]
mod slots;
#[cfg(feature = "libtorch")]
mod tensors;

#[cfg(all(feature = "libtorch", feature = "cuda"))]
pub use cuda::{allocator_stats, cuda_backend, reset_allocator_peak, AllocatorStats, TchCudaBackend, TchSlot};
#[cfg(feature = "libtorch")]
pub use offload::{TchBlock, TchOffload};
#[cfg(feature = "libtorch")]
pub use slots::TchSlots;
#[cfg(feature = "libtorch")]
pub use tch;
#[cfg(feature = "libtorch")]
pub use tensors::{dtype_of, kind_of, VarStoreTensors};

#[cfg(not(feature = "libtorch"))]
mod off {
    use offload_core::{Error, Result};

    /// Without the `libtorch` feature there is no tch backend.
    #[derive(Debug)]
    pub struct TchOffload(());

    impl TchOffload {
        /// Always [`Error::Unsupported`]: build with the `libtorch` feature.
        pub fn unavailable() -> Result<Self> {
            Err(Error::unsupported("tch", "offload-tch was built without its `libtorch` feature"))
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn says_it_is_unsupported_without_libtorch() {
            let e = super::TchOffload::unavailable().unwrap_err().to_string();
            assert!(e.contains("libtorch"), "{e}");
        }
    }
}
#[cfg(not(feature = "libtorch"))]
pub use off::*;
