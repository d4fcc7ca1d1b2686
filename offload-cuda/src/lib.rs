//! offload-cuda
