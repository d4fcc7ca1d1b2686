//! Fuzz the safetensors → host store → ring path on the simulated device:
//! `cargo +nightly fuzz run safetensors_store fuzz/corpus/safetensors_store`.
//! CI replays the committed corpus with stable Rust (`tests/tests/reliability.rs`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("offload-fuzz-{}.safetensors", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        let _ = offload_tests::checkpoint::load_on_sim(&path);
    }
});
