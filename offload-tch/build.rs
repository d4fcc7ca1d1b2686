//! With `libtorch`: a RUNPATH to libtorch's lib folder (the one built against, and
//! the GPU runner's) for this package's tests and examples. With `cuda`: keep
//! `libtorch_cuda` linked too (rustc links with `--as-needed`, which drops it, and
//! libtorch then reports no CUDA). Another package whose binaries use this crate
//! repeats these lines in its own build script (link arguments do not propagate).

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if std::env::var_os("CARGO_FEATURE_LIBTORCH").is_none() {
        return;
    }
    let mut dirs = vec!["/opt/torch/.venv/lib/python3.12/site-packages/torch/lib".to_owned()];
    if let Some(l) = std::env::var_os("LIBTORCH") {
        dirs.insert(0, format!("{}/lib", l.to_string_lossy()));
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
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
