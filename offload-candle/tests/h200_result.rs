//! The committed H200 result of the candle Flux benchmark
//! (`bench/results/2026-11-30-candle-flux.json`) holds what issue 4 asks of it: both
//! resolutions at d = 1 and 2, within 1.03 × its own bound, peak within (d + 1) ×
//! the largest block, output byte-identical to candle's resident run, no misses.

use serde_json::Value;

#[test]
fn committed_candle_flux_result_meets_the_target() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/results/2026-11-30-candle-flux.json");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).expect(path)).expect("valid JSON");
    assert_eq!(doc["backend"], "candle");
    assert_eq!(doc["complete"], true, "the run did not finish every case");
    assert!(doc["gpu"].as_str().unwrap_or("").contains("H200"), "not an H200 run: {}", doc["gpu"]);
    let cases = doc["cases"].as_array().expect("cases");
    let mut seen = Vec::new();
    for c in cases {
        let (res, d) = (c["resolution"].as_u64().unwrap(), c["depth"].as_u64().unwrap());
        let at = format!("{res}² d = {d}");
        let (streamed, resident, bound) =
            (c["step_streamed_s"].as_f64().unwrap(), c["step_resident_s"].as_f64().unwrap(), c["bound_s"].as_f64().unwrap());
        // The bound is recomputed from the run's own figures, not read back.
        let copy = c["streamed_bytes"].as_f64().unwrap() / (c["bandwidth_gbps"].as_f64().unwrap() * 1e9);
        assert!((bound - resident.max(copy)).abs() < 1e-9, "{at}: bound {bound} is not max(resident, bytes / bandwidth)");
        assert!(streamed / bound <= 1.03, "{at}: {:.4} × bound", streamed / bound);
        assert!(c["peak_device_bytes"].as_u64().unwrap() <= (d + 1) * doc["largest_block_bytes"].as_u64().unwrap(), "{at}: peak");
        assert_eq!(c["bitwise_equal"], true, "{at}: output differs from the resident run");
        assert_eq!(c["misses"], 0, "{at}: misses");
        seen.push((res, d));
    }
    seen.sort();
    assert_eq!(seen, [(1024, 1), (1024, 2), (2048, 1), (2048, 2)]);
}
