//! The bench room: one model registry ([`registry`]), one harness ([`harness`]:
//! what a process run writes, output checks, the merge of runs and anchors into
//! one results file; [`budgets`]: the planner's runs under device budgets; [`pipeline`]: the
//! pipeline case's runs and their merge), one loop ([`drive`]: every case resident, then streamed
//! at each depth, the planner's and under each budget), and a small file per backend that plugs its compute in
//! (`tch`: its CPU check behind the feature `tch`, its GPU run behind `tch-cuda`; `candle` and `candle-cuda` likewise; `cuda`: offload-cuda's reference model, GPU only). The `zoo` binary drives them;
//! `bench/zoo-run.sh` runs it three times per model on the GPU runner beside
//! diffusers' group offloading (`bench/anchors/zoo_anchor.py`) and merges.

#![recursion_limit = "512"]

pub mod budgets;
#[cfg(feature = "candle")]
pub mod candle;
pub mod compressed;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod drive;
pub mod harness;
pub mod host_tiers;
pub mod pipeline;
pub mod registry;
pub mod relay;
pub mod source;
#[cfg(feature = "tch")]
pub mod tch;
