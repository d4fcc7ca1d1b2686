//! The link lines offload-tch's build script documents (link arguments do not
//! propagate): with `tch`, a RUNPATH to the build-time and the GPU runner's
//! libtorch; with `tch-cuda`, libtorch_cuda kept linked too.

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    let mut dirs = vec!["/opt/torch/.venv/lib/python3.12/site-packages/torch/lib".to_owned()];
    if let Some(l) = std::env::var_os("LIBTORCH") {
        dirs.insert(0, format!("{}/lib", l.to_string_lossy()));
    }
    if std::env::var_os("CARGO_FEATURE_TCH_CUDA").is_some() {
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
