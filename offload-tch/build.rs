//! With `libtorch`: a RUNPATH to libtorch's lib folder (the one built against, and
//! the GPU runner's) for this package's tests and examples. With `cuda`: keep
//! `libtorch_cuda` linked too (rustc links with `--as-needed`, which drops it, and
//! libtorch then reports no CUDA). Another package whose binaries use this crate
//! repeats these lines in its own build script (link arguments do not propagate).

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo::rustc-check-cfg=cfg(offload_tch_memory_stats)");
    if std::env::var_os("CARGO_FEATURE_LIBTORCH").is_none() {
        return;
    }
    let mut dirs = vec!["/opt/torch/.venv/lib/python3.12/site-packages/torch/lib".to_owned()];
    if let Some(l) = std::env::var_os("LIBTORCH") {
        dirs.insert(0, format!("{}/lib", l.to_string_lossy()));
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        // libtorch's allocator statistics (`memory_stats`): a small C++ file
        // against libtorch's headers, which torch-sys needs as well.
        println!("cargo:rerun-if-changed=src/memory_stats.cpp");
        if let Some(l) = std::env::var_os("LIBTORCH") {
            let l = std::path::PathBuf::from(l);
            cc::Build::new()
                .cpp(true)
                .std("c++17")
                .file("src/memory_stats.cpp")
                .include(l.join("include"))
                .define("_GLIBCXX_USE_CXX11_ABI", if std::env::var("LIBTORCH_CXX11_ABI").as_deref() == Ok("0") { "0" } else { "1" })
                .warnings(false)
                .compile("offload_tch_memory_stats");
            println!("cargo:rustc-cfg=offload_tch_memory_stats");
        }
        for d in &dirs {
            println!("cargo:rustc-link-search=native={d}");
        }
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-ltorch");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
    for d in &dirs {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{d}");
    }
}
