//! The candle backend of `offload` — **not implemented yet** (issue 4).
//!
//! Planned design: one slot per block wrapped as a candle tensor, weights as
//! `narrow`/`reshape` views, served to unmodified candle-nn blocks through a
//! `VarBuilder` backend; CPU everywhere, CUDA behind a `cuda` feature reusing
//! `offload-cuda`'s copy stream. Until then [`CandleOffload::new`] says so with
//! [`offload_core::Error::Unsupported`] instead of pretending.

use offload_core::{Error, Result};

/// Placeholder for the candle ring.
#[derive(Debug)]
pub struct CandleOffload(());

impl CandleOffload {
    /// Always [`Error::Unsupported`] until the candle backend lands.
    pub fn new() -> Result<Self> {
        Err(Error::unsupported("candle", "the candle backend is not implemented yet (issue 4)"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn says_it_is_unsupported() {
        let e = super::CandleOffload::new().unwrap_err().to_string();
        assert!(e.contains("unsupported"), "{e}");
    }
}
