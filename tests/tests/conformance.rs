//! The conformance suite, one module per backend (`cargo test -p offload-tests sim::`).

offload_tests::conformance_tests!(sim, offload_tests::sim_harness::Sim);

#[cfg(feature = "cuda")]
offload_tests::conformance_tests!(cuda, offload_tests::cuda_harness::Cuda);

#[cfg(feature = "candle")]
offload_tests::conformance_tests!(candle, offload_tests::candle_harness::Candle);
#[cfg(feature = "candle-cuda")]
offload_tests::conformance_tests!(candle_cuda, offload_tests::candle_harness::CandleCuda);
#[cfg(feature = "tch")]
offload_tests::conformance_tests!(tch, offload_tests::tch_harness::Tch);
#[cfg(feature = "tch-cuda")]
offload_tests::conformance_tests!(tch_cuda, offload_tests::tch_harness::TchCuda);

/// The model row: candle-transformers' SD3 joint blocks streamed vs resident.
#[cfg(feature = "candle")]
#[test]
fn candle_sd3_joint_blocks() {
    use offload_tests::Harness;
    let case = offload_tests::candle_harness::Candle::model_case().expect("the candle row has a model case");
    offload_tests::report(case.name, (case.run)());
}

/// The model row on CUDA.
#[cfg(feature = "candle-cuda")]
#[test]
fn candle_cuda_sd3_joint_blocks() {
    use offload_tests::Harness;
    let case = offload_tests::candle_harness::CandleCuda::model_case().expect("the candle-cuda row has a model case");
    offload_tests::report(case.name, (case.run)());
}
