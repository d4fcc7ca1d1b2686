//! offload-plan
