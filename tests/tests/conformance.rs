//! The conformance suite, one module per backend (`cargo test -p offload-tests sim::`).

offload_tests::conformance_tests!(sim, offload_tests::sim_harness::Sim);
offload_tests::conformance_tests!(sim_coded, offload_tests::sim_harness::SimCoded);

#[cfg(feature = "cuda")]
offload_tests::conformance_tests!(cuda, offload_tests::cuda_harness::Cuda);
#[cfg(feature = "cuda")]
offload_tests::conformance_tests!(cuda_coded, offload_tests::cuda_harness::CudaCoded);
#[cfg(feature = "cuda")]
offload_tests::conformance_tests!(cuda_relay, offload_tests::cuda_harness::CudaRelay);

#[cfg(feature = "candle")]
offload_tests::conformance_tests!(candle, offload_tests::candle_harness::Candle);
#[cfg(feature = "candle-cuda")]
offload_tests::conformance_tests!(candle_cuda, offload_tests::candle_harness::CandleCuda);
#[cfg(feature = "tch")]
offload_tests::conformance_tests!(tch, offload_tests::tch_harness::Tch);
#[cfg(feature = "tch-cuda")]
offload_tests::conformance_tests!(tch_cuda, offload_tests::tch_harness::TchCuda);
#[cfg(feature = "vulkan")]
offload_tests::conformance_tests!(vulkan, offload_tests::vulkan_harness::Vulkan);
#[cfg(feature = "vulkan")]
offload_tests::conformance_tests!(vulkan_import, offload_tests::vulkan_harness::VulkanImport);
#[cfg(feature = "vulkan")]
offload_tests::conformance_tests!(vulkan_split, offload_tests::vulkan_harness::VulkanSplit);

/// The Vulkan row's sabotage table: every break caught on this machine's device
/// (lavapipe in CI). Each break runs in a child process of the `conformance`
/// binary (`--sabotage-one`), as its `--sabotage` table does: a deliberately
/// broken ring on a device whose memory is this machine's (lavapipe) may leave
/// it reading memory given back, which must not take this test process (and
/// the tests beside it) down with it. A child that dies is a break not caught.
#[cfg(feature = "vulkan")]
#[test]
fn vulkan_sabotage() {
    sabotage_caught("vulkan");
}

/// The same with the store's pages imported.
#[cfg(feature = "vulkan")]
#[test]
fn vulkan_import_sabotage() {
    sabotage_caught("vulkan-import");
}

/// The same with every copy in two halves.
#[cfg(feature = "vulkan")]
#[test]
fn vulkan_split_sabotage() {
    sabotage_caught("vulkan-split");
}

#[cfg(feature = "vulkan")]
fn sabotage_caught(backend: &str) {
    // Each break on its own: one whose guarding cases skipped (no device, a
    // feature the device lacks) is reported skipped, and the others still judged.
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_conformance"));
    for s in offload_core::sabotage::Sabotage::ALL {
        let row = offload_tests::break_in_child(exe, backend, s);
        let (by, missed) = (&row.by, row.missed_by.len());
        let na = format!("SKIPPED: {}", offload_tests::NOT_APPLICABLE);
        assert!(missed == 0, "{backend}: {s:?} passed {:?}, which guard it", row.missed_by);
        if row.caught || (!by.is_empty() && by.iter().all(|(_, w)| w.starts_with(&na))) {
            continue;
        }
        match by.iter().find(|(_, w)| w.starts_with("SKIPPED")) {
            Some((case, why)) => {
                let name = format!("{backend} sabotage {s:?} ({case})");
                offload_tests::report(&name, Err(offload_tests::CaseError::Skip(why.trim_start_matches("SKIPPED: ").to_owned())));
            }
            None => panic!("{backend}: {s:?} was not caught ({row:?})"),
        }
    }
}

/// The backend-only rows (models, views after release, safe-API checks).
fn backend_cases<H: offload_tests::Harness>(expected: usize) {
    let cases = H::model_cases();
    assert_eq!(cases.len(), expected, "{}: backend-only cases", H::NAME);
    for case in cases {
        offload_tests::report(case.name, (case.run)());
    }
}

#[test]
fn sim_backend_cases() {
    backend_cases::<offload_tests::sim_harness::Sim>(0);
}

#[test]
fn sim_coded_backend_cases() {
    backend_cases::<offload_tests::sim_harness::SimCoded>(1);
}

/// Every ring break caught on the coded simulated row too.
#[test]
fn sim_coded_sabotage() {
    for row in offload_tests::run_sabotage::<offload_tests::sim_harness::SimCoded>() {
        // A break whose every guarding case does not apply to the row is n/a.
        let not_applicable = !row.by.is_empty()
            && row.missed_by.is_empty()
            && row.by.iter().all(|(_, w)| w.starts_with(&format!("SKIPPED: {}", offload_tests::NOT_APPLICABLE)));
        assert!(
            row.caught || not_applicable,
            "sim-coded: {:?} was not caught (passed: {:?}; by {:?})",
            row.sabotage,
            row.missed_by,
            row.by
        );
        assert!(row.missed_by.is_empty(), "sim-coded: {:?} passed {:?}, which guard it", row.sabotage, row.missed_by);
    }
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_backend_cases() {
    backend_cases::<offload_tests::cuda_harness::Cuda>(3);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_coded_backend_cases() {
    backend_cases::<offload_tests::cuda_harness::CudaCoded>(1);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_relay_backend_cases() {
    backend_cases::<offload_tests::cuda_harness::CudaRelay>(1);
}

#[cfg(feature = "candle")]
#[test]
fn candle_backend_cases() {
    backend_cases::<offload_tests::candle_harness::Candle>(2);
}

#[cfg(feature = "candle-cuda")]
#[test]
fn candle_cuda_backend_cases() {
    backend_cases::<offload_tests::candle_harness::CandleCuda>(2);
}

#[cfg(feature = "tch")]
#[test]
fn tch_backend_cases() {
    backend_cases::<offload_tests::tch_harness::Tch>(1);
}

#[cfg(feature = "tch-cuda")]
#[test]
fn tch_cuda_backend_cases() {
    backend_cases::<offload_tests::tch_harness::TchCuda>(1);
}

#[cfg(feature = "vulkan")]
#[test]
fn vulkan_backend_cases() {
    backend_cases::<offload_tests::vulkan_harness::Vulkan>(1);
}

#[cfg(feature = "vulkan")]
#[test]
fn vulkan_import_backend_cases() {
    backend_cases::<offload_tests::vulkan_harness::VulkanImport>(2);
}

#[cfg(feature = "vulkan")]
#[test]
fn vulkan_split_backend_cases() {
    backend_cases::<offload_tests::vulkan_harness::VulkanSplit>(3);
}
