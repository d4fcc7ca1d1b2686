//! offload-tch
