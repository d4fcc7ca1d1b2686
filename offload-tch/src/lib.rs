//! The libtorch (tch) backend of `offload` — **not implemented yet** (issue 5).
//!
//! Planned design: compute on libtorch's default stream, copies on a cudarc
//! non-blocking stream in the same primary context, module parameters pointed at
//! `Tensor::from_blob` views of the block's slot with `set_data`. This crate does
//! not link libtorch yet, so the default build never waits for it. Until then
//! [`TchOffload::new`] returns [`offload_core::Error::Unsupported`].

use offload_core::{Error, Result};

/// Placeholder for the tch ring.
#[derive(Debug)]
pub struct TchOffload(());

impl TchOffload {
    /// Always [`Error::Unsupported`] until the tch backend lands.
    pub fn new() -> Result<Self> {
        Err(Error::unsupported("tch", "the tch backend is not implemented yet (issue 5)"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn says_it_is_unsupported() {
        let e = super::TchOffload::new().unwrap_err().to_string();
        assert!(e.contains("unsupported"), "{e}");
    }
}
