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

/// `bench/raw/`: the raw runs the published results cite, unpacked from their
/// archive (`bench/raw.sh`, once a process) for the tests and merges that read them.
///
/// # Panics
///
/// Where the archive cannot be unpacked (the script names why).
pub fn raw_dir() -> std::path::PathBuf {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let bench = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    ONCE.call_once(|| {
        let s = std::process::Command::new("bash").arg(bench.join("raw.sh")).status().expect("bash runs bench/raw.sh");
        assert!(s.success(), "bench/raw.sh could not unpack bench/raw.tar.gz ({s})");
    });
    bench.join("raw")
}
