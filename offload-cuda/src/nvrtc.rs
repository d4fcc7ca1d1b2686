//! NVRTC: the crate's kernels compiled once per process, and the tests' compile check.

/// `src` compiled by NVRTC once per process (`cache` is the caller's cell).
pub(crate) fn compiled(
    cache: &'static std::sync::OnceLock<std::result::Result<cudarc::nvrtc::Ptx, String>>,
    src: &'static str,
) -> std::result::Result<&'static cudarc::nvrtc::Ptx, String> {
    cache.get_or_init(|| cudarc::nvrtc::compile_ptx(src).map_err(|e| format!("NVRTC: {e}"))).as_ref().map_err(Clone::clone)
}

/// Compiling a crate's NVRTC kernels in tests, where no GPU is needed, only
/// libnvrtc: a compile error would otherwise first show on the GPU runner.
#[cfg(test)]
pub(crate) mod check {
    /// Compile `src` with NVRTC; panics with the compiler's log on a compile error.
    /// Without libnvrtc it prints `SKIPPED` — and fails where `OFFLOAD_REQUIRE_NVRTC=1`
    /// or `OFFLOAD_REQUIRE_DEVICE=1` (CI installs libnvrtc and sets the first).
    /// cudarc panics when it cannot load the library: that panic is caught (its
    /// message goes to the test's captured output).
    pub fn compiles(what: &str, src: &'static str) {
        compiles_by(what, || cudarc::nvrtc::compile_ptx(src).map_err(|e| format!("{e:?}")));
    }

    /// [`compiles`] for a compile of one's own (other options).
    pub fn compiles_by<T>(what: &str, compile: impl FnOnce() -> Result<T, String> + std::panic::UnwindSafe) {
        match std::panic::catch_unwind(compile) {
            Ok(ptx) => {
                if let Err(e) = ptx {
                    panic!("{what}: the kernels do not compile: {e}");
                }
            }
            Err(p) => {
                let why =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                assert!(why.contains("Unable to dynamically load"), "{what}: NVRTC panicked: {why}");
                for var in ["OFFLOAD_REQUIRE_NVRTC", "OFFLOAD_REQUIRE_DEVICE"] {
                    assert!(std::env::var(var).as_deref() != Ok("1"), "{what}: libnvrtc is required ({var}=1): {why}");
                }
                eprintln!("SKIPPED: {what}: libnvrtc not found ({why})");
            }
        }
    }
}
