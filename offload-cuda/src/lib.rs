//! offload-cuda: being written.
