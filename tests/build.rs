//! With `tch`: a RUNPATH to libtorch's lib folder for the conformance binary and
//! tests (link arguments of offload-tch's build script do not reach this package).

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    if let Some(l) = std::env::var_os("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}/lib", l.to_string_lossy());
        if std::env::var_os("CARGO_FEATURE_TCH_CUDA").is_some() {
            // Keep libtorch_cuda linked (`--as-needed` would drop it).
            println!("cargo:rustc-link-search=native={}/lib", l.to_string_lossy());
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-ltorch_cuda");
            println!("cargo:rustc-link-arg=-ltorch");
            println!("cargo:rustc-link-arg=-Wl,--as-needed");
        }
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,/opt/torch/.venv/lib/python3.12/site-packages/torch/lib");
}
