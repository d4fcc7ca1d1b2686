//! The error type of `offload-core`, shared by every backend.

use std::path::PathBuf;

/// Result with the core [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in offload, named so that a caller can act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The backend cannot do what was asked (yet).
    #[error("{backend}: unsupported: {what}")]
    Unsupported {
        /// Backend name.
        backend: String,
        /// What was asked.
        what: String,
    },
    /// Device memory ran out.
    #[error("{backend}: out of device memory allocating {requested} bytes for {purpose} ({free} bytes free)")]
    OutOfDeviceMemory {
        /// Backend name.
        backend: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free at the time, as the backend reported them (0 if unknown).
        free: u64,
        /// What the memory was for.
        purpose: String,
    },
    /// Host memory could not be allocated or page-locked.
    #[error("{backend}: could not allocate {requested} bytes of host memory for {purpose}: {reason}")]
    HostAlloc {
        /// Backend name.
        backend: String,
        /// Bytes asked for.
        requested: u64,
        /// What the memory was for.
        purpose: String,
        /// Why.
        reason: String,
    },
    /// The device failed (driver error, lost device, failed launch).
    #[error("{backend}: device error during {during}: {message}")]
    Device {
        /// Backend name.
        backend: String,
        /// The operation that failed.
        during: String,
        /// The native error, as text.
        message: String,
    },
    /// A checkpoint is malformed.
    #[error("bad checkpoint {path}{}: {fault}", tensor_at(.tensor))]
    BadCheckpoint {
        /// File path.
        path: PathBuf,
        /// Tensor at fault (empty when the header itself is at fault).
        tensor: String,
        /// What is wrong.
        fault: String,
    },
    /// A coded file ([`CodedFile`](crate::coded_file::CodedFile)) cannot serve a block: not
    /// one, damaged, or made from other weights than the checkpoint's.
    #[error("coded file {path}: {block}: {fault}")]
    CodedFile {
        /// File path.
        path: PathBuf,
        /// Block at fault (empty when the file itself is at fault).
        block: String,
        /// What is wrong.
        fault: String,
    },
    /// Reading a file failed.
    #[error("reading {path}: {source}")]
    Io {
        /// File path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Reading a block of the disk tier from its file failed: the block is not
    /// served.
    #[error("reading block {block} ({bytes} bytes at offset {offset}) from {path}: {fault}")]
    DiskRead {
        /// File path.
        path: PathBuf,
        /// The block (`component/stack.index`).
        block: String,
        /// Where its bytes start in the file.
        offset: u64,
        /// How many bytes.
        bytes: usize,
        /// What went wrong.
        fault: String,
    },
    /// A tensor's declared shape and dtype disagree with the bytes given.
    #[error("tensor {tensor:?}: {fault}")]
    BadTensor {
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        fault: String,
    },
    /// A plan cannot be applied to the model.
    #[error("plan: {0}")]
    Plan(String),
    /// A block was asked for that the ring does not hold.
    #[error("component {component:?} has no block {stack}.{index}")]
    UnknownBlock {
        /// Component name.
        component: String,
        /// Stack name.
        stack: String,
        /// Block index in the stack.
        index: usize,
    },
    /// The protocol was broken (detected by the simulated backend or a debug check).
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A fault injected on purpose by a test backend.
    #[error("injected fault: {0}")]
    Injected(String),
}

impl Error {
    /// An [`Error::Unsupported`] for `backend`.
    pub fn unsupported(backend: &str, what: impl Into<String>) -> Self {
        Error::Unsupported { backend: backend.to_owned(), what: what.into() }
    }

    /// An [`Error::Device`] for `backend`.
    pub fn device(backend: &str, during: impl Into<String>, message: impl std::fmt::Display) -> Self {
        Error::Device { backend: backend.to_owned(), during: during.into(), message: message.to_string() }
    }
}

/// `: tensor "name"` for an error naming a tensor, nothing for one about the
/// whole file (its header, its identity): a file-level error names no tensor.
fn tensor_at(tensor: &str) -> String {
    if tensor.is_empty() {
        String::new()
    } else {
        format!(": tensor {tensor:?}")
    }
}
