//! `cargo xtask <command>`: the project's tasks, in plain Rust with `std::process`.

#[cfg(test)]
mod docs_check;
mod report;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::{exit, Command};

const HELP: &str = "\
cargo xtask <command>

  ci                        everything CI runs: lint, every test, the conformance table (the README's test command);
                            fetches libtorch 2.11 (PyPI wheels, cached in ~/.cache/offload) unless LIBTORCH is set
  demo [--cpu] [-- ARGS]    the main job: a Flux-shaped candle model streamed block by block (the GPU
                            where nvidia-smi lists one, else candle's CPU device)
  conformance [--backend sim|sim-coded|cuda|cuda-coded|candle|tch|tch-cuda|vulkan|vulkan-import|vulkan-split|all]
                            the conformance table, cases x backends
  lint                      cargo fmt --check, clippy -D warnings, tidy
  bench [--backend sim]     host-side cost per block and planner speed (criterion); writes bench/results/<date>-sim-host-cost.json
  bench --backend cuda [-- ARGS]
                            the bench room's cuda file (offload-cuda's reference model, flux-dev; 3 process runs,
                            diffusers beside them) on this machine's GPU; ARGS go to each `zoo run --backend cuda`
                            (e.g. --budgets 8,12,16); runs under bench/raw/, bench/results/<date>-zoo-cuda.json
  bench --backend tch       the bench room (registry models, 3 process runs each, diffusers' group offloading
                            beside them) on this machine's GPU; runs under bench/raw/, bench/results/<date>-zoo-tch.json
  bench --backend candle [-- ARGS]
                            the Flux-shaped candle benchmark on this machine's GPU (nvcc from PyPI);
                            writes bench/results/<date>-candle-flux.json
  bench --codec             the exponent codec's host encode/decode speed (3 processes); bench/results/<date>-codec-host.json
  bench --report            README.md's measured tables, bench/REPORT.md and bench/plots/*.png from bench/results/*.json
  wheel                     the Python package's abi3 wheel (maturin) into .whl/offload/
  pytest                    the Python package's tests (torch, diffusers, transformers from PyPI, cached)
  faults                    inject faults, try bad inputs and plans; writes bench/results/<date>-faults.md
  house                     the house's counts: tracked files, README lines, import cycles, the longest library function
  gpu-bundle [--candle|--python]
                            build the CUDA, tch and Vulkan binaries and a run script into .bundle/ for the GPU runner
                            (and the Vulkan loader and validation layer as Debian packages into .gl/);
                            --candle adds candle's CUDA build (nvcc from PyPI, ~15 min on 2 cores); the Python
                            package's wheel, tests and bench always (--python: only those; run `.bundle/py-run.sh`)
";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut c: Command) -> Result<(), String> {
    eprintln!("$ {c:?}");
    let t0 = std::time::Instant::now();
    let st = c.status().map_err(|e| format!("cannot start {c:?}: {e}"))?;
    // Where CI's time goes, step by step (`grep '^xtask: step'` in its log).
    eprintln!("xtask: step took {:.0} s: {}", t0.elapsed().as_secs_f64(), step_name(&c));
    if st.success() {
        Ok(())
    } else {
        Err(format!("{c:?} failed: {st}"))
    }
}

/// A command's program and arguments, shortened for the step log.
fn step_name(c: &Command) -> String {
    let prog = Path::new(c.get_program()).file_name().map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
    let args: Vec<String> = c.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
    let line = format!("{prog} {}", args.join(" "));
    line.chars().take(160).collect()
}

/// Run `script` in bash at the repository root with nvcc on the path: candle's
/// CUDA kernels compile with nvcc from PyPI (scripts/cuda-build-env.sh, set up
/// once in the cache). `$CARGO` in the script is this cargo.
fn with_nvcc(script: &str) -> Result<(), String> {
    let env = cache_dir().join("cuda-build-env");
    let mut c = Command::new("bash");
    c.arg(root().join("scripts/cuda-build-env.sh")).arg(&env);
    run(c)?;
    let mut c = Command::new("bash");
    c.current_dir(root()).args(["-c", &format!("source {}/env.sh && {script}", env.display())]);
    c.env("CARGO", std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    run(c)
}

/// Where fetched toolchains live: `$OFFLOAD_CACHE`, else `~/.cache/offload`.
fn cache_dir() -> PathBuf {
    std::env::var_os("OFFLOAD_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/offload")))
        .unwrap_or_else(|| root().join("target/offload-cache"))
}

/// libtorch for the tch backend: `$LIBTORCH` if set, else libtorch 2.11 from the
/// PyPI wheels, fetched once by scripts/fetch-libtorch.sh into
/// `$OFFLOAD_CACHE` (default `~/.cache/offload`). Sets `LIBTORCH` and
/// `LIBTORCH_CXX11_ABI` for every cargo command run after it.
fn ensure_libtorch() -> Result<(), String> {
    if std::env::var_os("LIBTORCH").is_some() {
        return Ok(());
    }
    let dest = cache_dir().join("libtorch-2.11.0");
    let mut c = Command::new("bash");
    c.arg(root().join("scripts/fetch-libtorch.sh")).arg(&dest);
    run(c)?;
    // xtask runs one command at a time; every later command inherits these.
    std::env::set_var("LIBTORCH", dest.join("torch"));
    std::env::set_var("LIBTORCH_CXX11_ABI", "1");
    Ok(())
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

/// lavapipe, the Vulkan loader and the validation layer (scripts/install-vulkan.sh:
/// Debian's packages, installed when missing).
fn ensure_vulkan() -> Result<(), String> {
    let mut c = Command::new("bash");
    c.arg(root().join("scripts/install-vulkan.sh"));
    run(c)
}

/// The directory of libnvrtc from PyPI (`scripts/nvrtc.sh`, cached under
/// ~/.cache/offload/nvrtc).
fn ensure_nvrtc() -> Result<String, String> {
    let home = std::env::var("HOME").map_err(|_| "HOME is not set".to_string())?;
    let out = Command::new("bash")
        .arg(root().join("scripts/nvrtc.sh"))
        .arg(format!("{home}/.cache/offload/nvrtc"))
        .output()
        .map_err(|e| format!("scripts/nvrtc.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!("scripts/nvrtc.sh failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The Python package's test environment (scripts/python-env.sh: torch 2.11,
/// diffusers, transformers, pytest from PyPI, cached): its interpreter.
fn ensure_python_env() -> Result<PathBuf, String> {
    let dest = cache_dir().join("python-env");
    let mut c = Command::new("bash");
    c.arg(root().join("scripts/python-env.sh")).arg(&dest);
    run(c)?;
    Ok(dest.join("bin/python"))
}

/// The extension module cargo built (`lib_offload.so`) put where the package
/// imports it, as maturin would name it in a wheel.
fn install_extension(profile: &str) -> Result<PathBuf, String> {
    let built = root().join("target").join(profile).join("lib_offload.so");
    let dest = root().join("offload-py/python/offload/_offload.abi3.so");
    std::fs::copy(&built, &dest).map_err(|e| format!("{} -> {}: {e}", built.display(), dest.display()))?;
    Ok(root().join("offload-py/python"))
}

/// The Python package's tests (pytest on the tiny real diffusers and
/// transformers classes), on the extension built by `profile`.
fn python_tests(python: &Path, profile: &str) -> Result<(), String> {
    let path = install_extension(profile)?;
    let mut c = Command::new(python);
    c.current_dir(root().join("offload-py"));
    c.args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"]);
    c.env("PYTHONPATH", path);
    run(c)
}

/// `cargo xtask wheel`: the abi3 wheel (maturin, from PyPI into the Python
/// environment) into `.whl/offload/`, and the commit it was built from (with
/// `-dirty` where the tree had changes) in `.whl/COMMIT`: the GPU runner's copy
/// of the tree has no history of its own, so its runs read the commit there.
fn wheel() -> Result<(), String> {
    let dirty = Command::new("git").args(["status", "--porcelain", "--untracked-files=no"]).current_dir(root()).output().ok();
    let dirty = dirty.is_some_and(|o| !o.stdout.is_empty());
    std::fs::create_dir_all(root().join(".whl")).map_err(|e| format!(".whl: {e}"))?;
    let stamp = format!("{}{}\n", commit(), if dirty { "-dirty" } else { "" });
    std::fs::write(root().join(".whl/COMMIT"), stamp).map_err(|e| format!(".whl/COMMIT: {e}"))?;
    let python = ensure_python_env()?;
    let mut c = Command::new(&python);
    c.args(["-m", "pip", "install", "-q", "--disable-pip-version-check", "maturin==1.16.0"]);
    run(c)?;
    let mut c = Command::new(&python);
    c.args(["-m", "maturin", "build", "--release", "-m", "offload-py/Cargo.toml", "-o", ".whl/offload"]);
    c.current_dir(root());
    run(c)
}

/// Every backend feature that builds without a GPU, for the whole workspace at
/// once: what CI lints, and what its one test build compiles (one feature set,
/// so each crate is built once; separate `-p` runs resolved other feature sets
/// and rebuilt the same crates five times).
const CI_FEATURES: &str =
    "offload/sim,offload/cuda,offload/candle,offload/tch,offload/vulkan,offload-tests/cuda,offload-tests/candle,offload-tests/tch,\
offload-tests/vulkan,offload-bench/candle,offload-bench/tch,offload-bench/cuda";

fn lint() -> Result<(), String> {
    ensure_libtorch()?;
    let mut c = cargo();
    c.args(["fmt", "--all", "--check"]);
    run(c)?;
    let mut c = cargo();
    c.args(["clippy", "--workspace", "--all-targets", "--features", CI_FEATURES, "--", "-D", "warnings"]);
    run(c)?;
    clippy_tch_cuda()?;
    tidy()
}

/// libtorch on CUDA builds without a GPU (libtorch_cuda comes with the wheel):
/// lint it too, so the tch-cuda row compiles in CI.
fn clippy_tch_cuda() -> Result<(), String> {
    let mut c = cargo();
    c.args([
        "clippy",
        "-p",
        "offload-tests",
        "-p",
        "offload-tch",
        "-p",
        "offload-bench",
        "--all-targets",
        "--features",
        "offload-tests/tch-cuda,offload-tch/cuda,offload-bench/tch-cuda,offload-bench/cuda",
    ]);
    c.args(["--", "-D", "warnings"]);
    run(c)
}

/// The counts the house is held to, printed: tracked files (git), the README's
/// lines, import cycles among the layered crates' files, and the longest
/// library function (tidy's own readings).
fn house() -> Result<(), String> {
    let out = Command::new("git").args(["ls-files"]).current_dir(root()).output().map_err(|e| format!("git ls-files: {e}"))?;
    let tracked = String::from_utf8_lossy(&out.stdout).lines().count();
    let readme = std::fs::read_to_string(root().join("README.md")).map_err(|e| format!("README.md: {e}"))?.lines().count();
    let (cycles, longest) = tidy::house_counts(&root());
    println!("tracked files: {tracked} (at most 400)");
    println!("README.md lines: {readme} (at most 100)");
    println!("import cycles in {}: {}", tidy::LAYERED.join(", "), cycles.len());
    for c in &cycles {
        println!("  {c}");
    }
    match longest {
        Some((len, at)) => println!("longest library function: {len} lines ({at}; at most {})", tidy::LONGEST_FUNCTION),
        None => println!("longest library function: none found"),
    }
    Ok(())
}

fn tidy() -> Result<(), String> {
    let problems = tidy::check(&root());
    if problems.is_empty() {
        eprintln!("tidy: ok");
        Ok(())
    } else {
        Err(format!("tidy:\n  {}", problems.join("\n  ")))
    }
}

fn conformance(args: &[String]) -> Result<(), String> {
    let backend = flag(args, "--backend").unwrap_or_else(|| "sim".into());
    let mut c = cargo();
    // The dev profile (optimised dependencies): shares its build with `cargo test`.
    c.args(["run", "-q", "-p", "offload-tests", "--bin", "conformance"]);
    // Rows to features: `vulkan-import`, `vulkan-split` and `cuda-coded` are more rows of their features.
    let mut features: Vec<&str> = backend
        .split(',')
        .map(|b| match b {
            "vulkan-import" | "vulkan-split" => "vulkan",
            "cuda-coded" => "cuda",
            b => b,
        })
        .filter(|b| matches!(*b, "cuda" | "candle" | "tch" | "tch-cuda" | "vulkan"))
        .collect();
    features.sort_unstable();
    features.dedup();
    if backend == "all" || features.iter().any(|f| f.starts_with("tch")) {
        ensure_libtorch()?;
    }
    if backend == "all" || features.contains(&"vulkan") {
        ensure_vulkan()?;
    }
    if backend == "all" {
        c.args(["--features", "cuda,candle,tch,vulkan"]);
    } else if !features.is_empty() {
        c.args(["--features", &features.join(",")]);
    }
    // Every deliberate ring break on every row too (rows without their device skip).
    let sabotage = root().join("target/conformance-sabotage.json");
    c.args(["--", "--backend", &backend, "--sabotage"]).arg(sabotage);
    run(c)
}

fn today() -> String {
    let out = Command::new("date").args(["-u", "+%Y-%m-%d"]).output().ok();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_else(|| "unknown-date".into())
}

fn commit() -> String {
    let out = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(root()).output().ok();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned()).unwrap_or_default()
}

fn bench(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--report") {
        return report::report(&root());
    }
    if args.iter().any(|a| a == "--codec") {
        return codec_bench();
    }
    let backend = flag(args, "--backend").unwrap_or_else(|| "sim".into());
    match backend.as_str() {
        "sim" => {}
        "cuda" => {
            // The bench room's cuda file on this machine's GPU: bench/zoo-run.sh with
            // a zoo built here with the `cuda` feature only (no libtorch), flux-dev
            // unless ZOO_MODELS says otherwise, runs kept under bench/raw, the merged
            // file in bench/results. The GPU runner has no Rust: there, `cargo xtask
            // gpu-bundle` builds the zoo and .bundle/gpu-run.sh runs it.
            let mut c = cargo();
            c.args(["build", "-q", "-p", "offload-bench", "--features", "cuda", "--bin", "zoo"]);
            run(c)?;
            let raw = root().join(format!("bench/raw/{}-zoo-{}", today(), commit()));
            let zoo_args: Vec<&str> = args.iter().skip_while(|a| *a != "--").skip(1).map(String::as_str).collect();
            let mut c = Command::new("bash");
            c.arg(root().join("bench/zoo-run.sh"));
            c.env("ZOO_BIN", root().join("target/debug/zoo")).env("ZOO_DIR", &raw).env("COMMIT", commit()).env("ZOO_TCH", "0");
            c.env("OUT", std::env::temp_dir().join("offload-zoo-out"));
            if std::env::var_os("ZOO_MODELS").is_none() {
                c.env("ZOO_MODELS", "flux-dev");
            }
            if !zoo_args.is_empty() {
                c.env("ZOO_CUDA_ARGS", zoo_args.join(" "));
            }
            run(c)?;
            let out = root().join(format!("bench/results/{}-zoo-cuda.json", today()));
            std::fs::copy(raw.join("zoo-cuda.json"), &out).map_err(|e| format!("{}: {e}", out.display()))?;
            println!("wrote {}", out.display());
            return Ok(());
        }
        "tch" => {
            // The bench room on this machine's GPU (libtorch fetched if needed):
            // bench/zoo-run.sh with the zoo built here, runs kept under bench/raw,
            // the merged file in bench/results.
            ensure_libtorch()?;
            let mut c = cargo();
            c.args(["build", "-q", "-p", "offload-bench", "--features", "tch-cuda,cuda", "--bin", "zoo"]);
            run(c)?;
            let raw = root().join(format!("bench/raw/{}-zoo-{}", today(), commit()));
            let mut c = Command::new("bash");
            c.arg(root().join("bench/zoo-run.sh"));
            c.env("ZOO_BIN", root().join("target/debug/zoo")).env("ZOO_DIR", &raw).env("COMMIT", commit()).env("OUT", std::env::temp_dir().join("offload-zoo-out"));
            run(c)?;
            let out = root().join(format!("bench/results/{}-zoo-tch.json", today()));
            std::fs::copy(raw.join("zoo-tch.json"), &out).map_err(|e| format!("{}: {e}", out.display()))?;
            println!("wrote {}", out.display());
            return Ok(());
        }
        "candle" => {
            // The bench room's candle file on this machine's GPU (nvcc needed to build it).
            let raw = root().join(format!("bench/raw/{}-zoo-{}", today(), commit()));
            return with_nvcc(&format!(
                "$CARGO build -q -p offload-bench --features candle-cuda --bin zoo && \
                 ZOO_CANDLE_BIN=target/debug/zoo ZOO_BIN=target/debug/zoo ZOO_TCH=0 ZOO_CUDA_MODELS= ZOO_DIR={} COMMIT={} bash bench/zoo-run.sh",
                raw.display(),
                commit()
            ));
        }
        other => {
            return Err(format!(
                "no {other} benchmark yet (backends with one: sim, cuda, tch, candle); GPU runs: `cargo xtask gpu-bundle`, then .bundle/gpu-run.sh on the runner"
            ))
        }
    }
    let mut c = cargo();
    c.args(["bench", "-p", "offload-core", "--features", "sim", "--bench", "host_cost", "--", "--noplot"]);
    run(c)?;
    let mut cases = Vec::new();
    for backend in ["null", "sim"] {
        for depth in ["d1", "d2"] {
            let p = root().join(format!("target/criterion/ring_host_cost_per_block/{backend}/{depth}/new/estimates.json"));
            let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
            let ns = |k: &str| v[k]["point_estimate"].as_f64().unwrap_or(f64::NAN);
            cases.push(serde_json::json!({
                "backend": backend, "depth": depth[1..].parse::<u32>().unwrap_or(0),
                "host_cost_per_block_us": ns("median") / 1e3,
                "mean_us": ns("mean") / 1e3,
                "target_us": 10.0,
                "meets_target": ns("median") / 1e3 <= 10.0,
            }));
        }
    }
    let date = today();
    let mut c = cargo();
    c.args(["bench", "-p", "offload-plan", "--bench", "planner", "--", "--noplot"]);
    run(c)?;
    let p = root().join("target/criterion/planner_200_blocks/new/estimates.json");
    let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
    let ms = v["median"]["point_estimate"].as_f64().unwrap_or(f64::NAN) / 1e6;
    let planner = serde_json::json!({
        "date": date, "commit": commit(), "gpu": "none", "backend": "none",
        "model": "200 blocks of three sizes (120, 300, 680 MiB), 24 GiB budget, min depth 2",
        "what": "offload_plan::plan wall time, criterion median",
        "cases": [{ "blocks": 200, "plan_ms": ms, "target_ms": 10.0, "meets_target": ms <= 10.0 }],
    });
    let out = root().join(format!("bench/results/{date}-planner-speed.json"));
    std::fs::write(&out, serde_json::to_string_pretty(&planner).unwrap_or_default() + "\n")
        .map_err(|e| format!("{}: {e}", out.display()))?;
    println!("planner: {ms:.2} ms for 200 blocks; wrote {}", out.display());
    let doc = serde_json::json!({
        "date": date, "commit": commit(), "gpu": "none", "backend": "sim", "model": "flux-shaped, 19+19 blocks (tiny tensors)",
        "what": "host-side cost per block: Ring::block_at + guard release, criterion median",
        "cases": cases,
    });
    let out = root().join(format!("bench/results/{date}-sim-host-cost.json"));
    std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n").map_err(|e| format!("{}: {e}", out.display()))?;
    println!("{}", serde_json::to_string_pretty(&doc).unwrap_or_default());
    println!("wrote {}", out.display());
    Ok(())
}

/// The exponent codec's host speed: three `codec-bench` processes, merged into
/// `bench/results/<date>-codec-host.json` (median, min and max of each figure).
fn codec_bench() -> Result<(), String> {
    let mut c = cargo();
    c.args(["build", "--release", "-q", "-p", "offload-tests", "--bin", "codec-bench"]);
    run(c)?;
    let dir = root().join(format!("bench/raw/{}-codec-{}", today(), commit()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for r in 1..=3 {
        let out = dir.join(format!("run{r}.json"));
        let mut c = Command::new(root().join("target/release/codec-bench"));
        c.arg("--commit").arg(commit()).arg("--out").arg(&out);
        run(c)?;
        let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
        runs.push(serde_json::from_str::<serde_json::Value>(&text).map_err(|e| format!("{}: {e}", out.display()))?);
    }
    let names = (1..=runs.len())
        .map(|r| format!("bench/raw/{}/run{r}.json", dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()));
    let doc = codec_merge(&runs, names.collect(), &today())?;
    let out = root().join(format!("bench/results/{}-codec-host.json", today()));
    std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n").map_err(|e| format!("{}: {e}", out.display()))?;
    println!("wrote {}", out.display());
    Ok(())
}

/// The codec-host results file from its `codec-bench` runs (their paths as the
/// file names them): median, min and max of each speed, the rest from the first;
/// the commit the runs recorded (an error where they differ or none is recorded).
fn codec_merge(runs: &[serde_json::Value], names: Vec<String>, date: &str) -> Result<serde_json::Value, String> {
    let commits: std::collections::BTreeSet<&str> = runs.iter().map(|r| r["commit"].as_str().unwrap_or("")).collect();
    let commit = match commits.iter().collect::<Vec<_>>()[..] {
        [c] if !c.is_empty() => *c,
        _ => return Err(format!("codec-host runs: one commit recorded by every run, not {commits:?}")),
    };
    let spread = |k: &str| {
        let mut v: Vec<f64> = runs.iter().filter_map(|r| r[k].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        serde_json::json!({"median": v.get(v.len() / 2), "min": v.first(), "max": v.last()})
    };
    Ok(serde_json::json!({
        "date": date, "commit": commit, "gpu": "none", "backend": "none",
        "model": "one Flux-dev-shaped dual-stream block (diffusers' shapes), normal weights at each tensor's init scale",
        "runs": names,
        "cases": [{
            "case": "codec-host", "host_threads": runs[0]["threads"], "repeats": runs.len(), "block_bytes": runs[0]["block_bytes"],
            "compression_ratio": runs[0]["compression_ratio"], "exponent_entropy_bits": runs[0]["exponent_entropy_bits"],
            "encode_gbps_host": spread("encode_gbps_host"), "decode_gbps_host_reference": spread("decode_gbps_host_reference"),
            "bitwise_equal": runs.iter().all(|r| r["bitwise_equal"] == true),
        }],
    }))
}

/// The main job. Where `nvidia-smi` lists a GPU (and `--cpu` is not given) the demo
/// is built with candle's CUDA backend and runs on it; otherwise on candle's CPU device.
fn demo(args: &[String]) -> Result<(), String> {
    let cpu = args.iter().any(|a| a == "--cpu");
    let rest: Vec<&String> = args.iter().filter(|a| *a != "--cpu").skip_while(|a| *a == "--").collect();
    let gpu = !cpu
        && Command::new("nvidia-smi")
            .arg("-L")
            .output()
            .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("GPU"));
    if gpu {
        eprintln!("a GPU answers nvidia-smi: building the demo with candle's CUDA backend (first build ~15 min; `--cpu` to skip)");
        let rest: Vec<&str> = rest.iter().map(|a| a.as_str()).collect();
        return with_nvcc(&format!("$CARGO run --release -q --example flux_demo --features candle-cuda -- {}", rest.join(" ")));
    }
    let mut c = cargo();
    c.args(["run", "--release", "-q", "--example", "flux_demo", "--features", "candle", "--"]);
    c.args(rest);
    run(c)
}

/// offload-cuda's unit test binary (its GPU tests among them) into `dir` as
/// `cuda-lib-tests`, not yet stripped.
fn cuda_lib_tests(dir: &Path) -> Result<(), String> {
    let mut c = cargo();
    c.args(["test", "-p", "offload-cuda", "--lib", "--no-run", "--message-format=json"]);
    let out = c.output().map_err(|e| format!("offload-cuda tests: {e}"))?;
    if !out.status.success() {
        return Err(format!("building offload-cuda's tests failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let exe = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"]["name"] == "offload_cuda" && v["profile"]["test"] == true)
        .find_map(|v| v["executable"].as_str().map(str::to_owned))
        .ok_or("offload-cuda's test binary: not named in cargo's output")?;
    std::fs::copy(&exe, dir.join("cuda-lib-tests")).map_err(|e| format!("cuda-lib-tests: {e}"))?;
    Ok(())
}

/// The Python package's part of the bundle: its wheel and diffusers' (with
/// pytest's) in `.whl/`, the registry as JSON, the package's tests, the
/// anchor script that runs it beside diffusers, the merge, `py-run.sh`.
fn python_bundle(dir: &Path) -> Result<(), String> {
    wheel()?;
    let whl = root().join(".whl");
    let mut c = Command::new("python3");
    c.args(["-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d"]).arg(&whl);
    // gguf: diffusers' GGUF layers import it (the pytest rows of GGUF weights);
    // peft and what it imports beyond torch and transformers: the adapters'
    // training rows.
    c.args(["diffusers==0.42.1", "importlib_metadata", "zipp", "pytest==9.2.0", "pluggy", "iniconfig", "packaging", "gguf==0.19.0"]);
    c.args(["peft==0.21.2", "accelerate", "psutil"]);
    run(c)?;
    let mut c = cargo();
    c.args(["run", "-q", "-p", "offload-bench", "--bin", "zoo", "--", "registry", "--json"]).arg(dir.join("registry.json"));
    run(c)?;
    let tests = dir.join("py-tests");
    // Afresh: a test file moved or removed since the last bundle would run there still.
    let _ = std::fs::remove_dir_all(&tests);
    std::fs::create_dir_all(&tests).map_err(|e| e.to_string())?;
    // Every test file with CUDA rows, and what they import (the results-file and
    // GGUF-name tests are CPU-only: they read the repository).
    let dir_tests = root().join("offload-py/tests");
    let mut files: Vec<String> = std::fs::read_dir(&dir_tests)
        .map_err(|e| format!("{}: {e}", dir_tests.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|f| {
            f.ends_with(".py")
                && !["test_results_file.py", "test_gguf_names.py", "test_fixtures.py", "test_package.py"].contains(&f.as_str())
        })
        .collect();
    files.sort();
    for f in &files {
        std::fs::copy(dir_tests.join(f), tests.join(f)).map_err(|e| format!("{f}: {e}"))?;
    }
    // The docs' examples, which test_example.py runs (their CUDA rows too).
    let examples = dir.join("examples");
    std::fs::create_dir_all(&examples).map_err(|e| e.to_string())?;
    for e in std::fs::read_dir(root().join("offload-py/examples")).map_err(|e| format!("offload-py/examples: {e}"))?.flatten() {
        if e.path().extension().is_some_and(|x| x == "py") {
            std::fs::copy(e.path(), examples.join(e.file_name())).map_err(|x| format!("{}: {x}", e.path().display()))?;
        }
    }
    for f in [
        "bench/anchors/zoo_anchor.py",
        "bench/anchors/py_merge.py",
        "bench/anchors/py_start.py",
        "bench/anchors/py_pipeline.py",
        "bench/py-run.sh",
    ] {
        let p = root().join(f);
        std::fs::copy(&p, dir.join(p.file_name().unwrap_or_default())).map_err(|e| format!("{f}: {e}"))?;
    }
    // offload-cuda's GPU tests in the same carry (`py-run.sh cuda`).
    cuda_lib_tests(dir)?;
    let mut c = Command::new("strip");
    c.arg(dir.join("cuda-lib-tests"));
    run(c)
}

fn gpu_bundle(args: &[String]) -> Result<(), String> {
    let candle = args.iter().any(|a| a == "--candle");
    let dir = root().join(".bundle");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    python_bundle(&dir)?;
    if args.iter().any(|a| a == "--python") {
        println!("python bundle ready in {} (carry `.bundle` and `.whl`; run `bash .bundle/py-run.sh`)", dir.display());
        return Ok(());
    }
    let mut c = cargo();
    c.args(["build", "--profile", "bundle", "-p", "offload-tests", "--features", "cuda", "--bin", "conformance"]);
    run(c)?;
    std::fs::copy(root().join("target/bundle/conformance"), dir.join("conformance")).map_err(|e| format!("conformance: {e}"))?;
    // The Vulkan row and bench (the runner has NVIDIA's Vulkan driver; the loader
    // and the validation layer travel as Debian packages in .gl/).
    let mut c = cargo();
    c.args([
        "build",
        "--profile",
        "bundle",
        "-p",
        "offload-tests",
        "--features",
        "vulkan,cuda",
        "--bin",
        "conformance",
        "--bin",
        "vulkan-bench",
    ]);
    run(c)?;
    std::fs::copy(root().join("target/bundle/conformance"), dir.join("conformance-vulkan"))
        .map_err(|e| format!("conformance-vulkan: {e}"))?;
    std::fs::copy(root().join("target/bundle/vulkan-bench"), dir.join("vulkan-bench")).map_err(|e| format!("vulkan-bench: {e}"))?;
    let gl = root().join(".gl");
    std::fs::create_dir_all(&gl).map_err(|e| e.to_string())?;
    let mut c = Command::new("apt-get");
    // libGLX_nvidia (NVIDIA's Vulkan driver) needs glvnd's libraries beside the loader.
    c.current_dir(&gl).args([
        "download",
        "libvulkan1",
        "vulkan-validationlayers",
        "libglvnd0",
        "libglx0",
        "libegl1",
        "libgl1",
        "libopengl0",
        "libgles2",
    ]);
    run(c)?;
    // The cuda-only conformance binary again (the build above replaced target/bundle/conformance).
    let mut c = cargo();
    c.args(["build", "--profile", "bundle", "-p", "offload-tests", "--features", "cuda", "--bin", "conformance"]);
    run(c)?;
    std::fs::copy(root().join("target/bundle/conformance"), dir.join("conformance")).map_err(|e| format!("conformance: {e}"))?;
    // The tch binaries (libtorch found through RUNPATH on the runner), built in the
    // dev profile (optimised dependencies) to share torch-sys's build, then stripped.
    ensure_libtorch()?;
    let mut c = cargo();
    c.args(["build", "-p", "offload-tests", "--features", "tch-cuda", "--bin", "conformance"]);
    run(c)?;
    std::fs::copy(root().join("target/debug/conformance"), dir.join("conformance-tch")).map_err(|e| format!("conformance-tch: {e}"))?;
    // The bench room's driver with tch's file plugged in.
    let mut c = cargo();
    c.args(["build", "-p", "offload-bench", "--features", "tch-cuda,cuda", "--bin", "zoo"]);
    run(c)?;
    std::fs::copy(root().join("target/debug/zoo"), dir.join("zoo")).map_err(|e| format!("zoo: {e}"))?;
    let mut c = Command::new("strip");
    c.arg(dir.join("conformance-tch")).arg(dir.join("zoo"));
    run(c)?;
    // offload-cuda's unit tests (the exponent decoder's GPU round trip) and the
    // codec's speed example (gpu-run.sh CODEC=1).
    cuda_lib_tests(&dir)?;
    let mut c = cargo();
    c.args(["build", "--release", "-p", "offload-cuda", "--example", "codec_speed"]);
    run(c)?;
    std::fs::copy(root().join("target/release/examples/codec_speed"), dir.join("codec_speed")).map_err(|e| format!("codec_speed: {e}"))?;
    let mut c = Command::new("strip");
    c.arg(dir.join("cuda-lib-tests")).arg(dir.join("codec_speed"));
    run(c)?;
    // diffusers for the anchors (the runner has torch and transformers, no network).
    let whl = root().join(".whl");
    std::fs::create_dir_all(&whl).map_err(|e| e.to_string())?;
    let mut c = Command::new("python3");
    c.args(["-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d"]).arg(&whl);
    c.args(["diffusers==0.42.1", "importlib_metadata", "zipp"]);
    run(c)?;
    if candle {
        // Its binaries embed every kernel (~40 MB each): gzipped to fit the carry limit.
        with_nvcc(&format!(
            "$CARGO build --profile bundle -p offload-tests --features candle-cuda --bin conformance \
             && gzip -9 -c target/bundle/conformance > {dir}/conformance-candle.gz \
             && $CARGO build --profile bundle --example flux_demo --features candle-cuda \
             && gzip -9 -c target/bundle/examples/flux_demo > {dir}/flux_demo.gz \
             && $CARGO build --profile bundle -p offload-bench --features candle-cuda --bin zoo \
             && gzip -9 -c target/bundle/zoo > {dir}/zoo-candle.gz",
            dir = dir.display()
        ))?;
    }
    for f in [
        "bench/anchors/zoo_anchor.py",
        "bench/anchors/registry_check.py",
        "bench/zoo-run.sh",
        "bench/gpu-run.sh",
        "bench/conformance-rows.sh",
        "bench/host-tiers.sh",
        "bench/relay-run.sh",
        "bench/coded-probe.sh",
        "bench/sabotage_table.py",
        "bench/vulkan_merge.py",
    ] {
        let p = root().join(f);
        if p.exists() {
            let name = p.file_name().map(|n| n.to_owned()).unwrap_or_default();
            std::fs::copy(&p, dir.join(name)).map_err(|e| format!("{f}: {e}"))?;
        }
    }
    println!(
        "bundle ready in {} (carry `.bundle`, `.whl` and `.gl`; run `bash .bundle/gpu-run.sh`, the bench room `bash .bundle/zoo-run.sh`)",
        dir.display()
    );
    Ok(())
}

fn ci() -> Result<(), String> {
    // lavapipe for the Vulkan tests (Debian's packages, when missing); libtorch.
    ensure_vulkan()?;
    ensure_libtorch()?;
    // The raw runs the bench's tests and merges read, unpacked from their archive.
    let mut c = Command::new("bash");
    c.arg(root().join("bench/raw.sh"));
    run(c)?;
    // Every command below builds in the dev profile without debug info or
    // incremental caches (a clean clone only pays for them), so the build
    // scripts and proc macros the first one builds serve the rest.
    std::env::set_var("CARGO_PROFILE_DEV_DEBUG", "false");
    std::env::set_var("CARGO_INCREMENTAL", "0");
    let mut c = cargo();
    c.args(["fmt", "--all", "--check"]);
    run(c)?;
    tidy()?;
    clippy_tch_cuda()?;
    // One build of every test, example and binary with every CPU-buildable
    // feature, linted as it compiles: clippy's driver wraps rustc for the
    // workspace's own crates (what `cargo clippy` does, in a build that also
    // links), `-D warnings`. Its timings are kept in target/cargo-timings. The
    // CUDA rows build everywhere (run-time loading) and skip visibly without a
    // GPU; the candle row runs on the CPU device, the Vulkan rows on lavapipe,
    // the tch backend on libtorch's CPU, the bench room's tch and candle files
    // on the registry's models, shrunk.
    let out = Command::new("rustc").args(["--print", "sysroot"]).output().map_err(|e| format!("rustc --print sysroot: {e}"))?;
    let driver = Path::new(String::from_utf8_lossy(&out.stdout).trim()).join("bin/clippy-driver");
    if !driver.exists() {
        return Err(format!("{} is missing: `rustup component add clippy`", driver.display()));
    }
    std::env::set_var("RUSTC_WORKSPACE_WRAPPER", &driver);
    std::env::set_var("CLIPPY_ARGS", "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__");
    let test = |extra: &[&str]| {
        let mut c = cargo();
        c.args(["test", "--workspace", "--features", CI_FEATURES]);
        c.args(extra);
        c
    };
    run(test(&["--all-targets", "--timings"]))?;
    run(test(&["--doc"]))?;
    // The Python package: its extension module and its pytest suite. The
    // build is the test build's own unit graph (`--all-targets`, the same
    // features), so only offload-py's cdylib is new (a `--lib` build resolved
    // features without dev-dependencies and rebuilt ~5 min of crates).
    let python = ensure_python_env()?;
    let mut c = cargo();
    c.args(["build", "--workspace", "--features", CI_FEATURES, "--all-targets"]);
    run(c)?;
    python_tests(&python, "debug")?;
    // offload-cuda's NVRTC kernels compiled here, not first on the GPU runner:
    // libnvrtc from PyPI, and the compile tests required to run.
    let nvrtc = ensure_nvrtc()?;
    let mut c = test(&["--lib", "--", "kernels_compile_with_nvrtc"]);
    c.env("LD_LIBRARY_PATH", &nvrtc).env("OFFLOAD_REQUIRE_NVRTC", "1");
    let out = c.output().map_err(|e| format!("cargo test (NVRTC kernels): {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    eprint!("{text}{}", String::from_utf8_lossy(&out.stderr));
    // Every kernel source (reference model, fold hash, exponent decoder) compiled:
    // a filter that matched fewer tests would pass silently otherwise.
    if !out.status.success() || !text.contains("test result: ok. 3 passed") {
        return Err("NVRTC kernel tests: expected 3 passed (reference, fold, codec)".into());
    }
    // The main job, small, on the build above (only the example's own binary is
    // linked): it exits non-zero unless the offloaded output is byte-identical
    // to the resident one.
    let mut c = cargo();
    c.args(["build", "--workspace", "--features", CI_FEATURES, "--example", "flux_demo"]);
    run(c)?;
    // Run outside cargo, the binaries find libtorch (linked by the tch rows and
    // the facade's `tch` feature) where cargo's runs found it.
    let torch_lib = Path::new(&std::env::var("LIBTORCH").unwrap_or_default()).join("lib");
    let lib_path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", torch_lib.display()),
        _ => torch_lib.display().to_string(),
    };
    let mut c = Command::new(root().join("target/debug/examples/flux_demo"));
    c.args(["--hidden", "128", "--double", "2", "--single", "3", "--res", "128", "--steps", "2", "--depth", "2"]);
    c.env("LD_LIBRARY_PATH", &lib_path);
    run(c)?;
    // The conformance table with every deliberate break on every row, each break
    // in a process of its own (the binary the GPU runner runs), from the build above.
    let mut c = Command::new(root().join("target/debug/conformance"));
    c.args(["--backend", "sim,candle,tch,cuda,vulkan,vulkan-split", "--sabotage"]).arg(root().join("target/conformance-sabotage.json"));
    c.env("LD_LIBRARY_PATH", &lib_path);
    run(c)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rest = args.get(1..).unwrap_or(&[]).to_vec();
    let r = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("demo") => demo(&rest),
        Some("conformance") => conformance(&rest),
        Some("lint") => lint(),
        Some("bench") => bench(&rest),
        Some("gpu-bundle") => gpu_bundle(&rest),
        Some("house") => house(),
        Some("wheel") => wheel(),
        Some("pytest") => ensure_python_env().and_then(|py| {
            let mut c = cargo();
            c.args(["build", "-p", "offload-py"]);
            run(c)?;
            python_tests(&py, "debug")
        }),
        Some("faults") => {
            let mut c = cargo();
            let out = root().join(format!("bench/results/{}-faults.md", today()));
            c.args(["run", "-q", "-p", "offload-tests", "--bin", "fault-table", "--"]).arg(out);
            run(c)
        }
        Some("help" | "--help" | "-h") | None => {
            print!("{HELP}");
            Ok(())
        }
        Some(other) => Err(format!("unknown command {other:?}\n\n{HELP}")),
    };
    if let Err(e) = r {
        eprintln!("xtask: {e}");
        exit(1);
    }
}

#[cfg(test)]
mod tests {
    /// Every published codec-host file is what `codec_merge` makes of the runs it
    /// names, byte for byte (as `cargo xtask bench --codec` writes it).
    #[test]
    fn the_codec_host_files_rebuild_from_their_runs() {
        let results = super::root().join("bench/results");
        let mut seen = 0;
        for e in std::fs::read_dir(&results).unwrap() {
            let path = e.unwrap().path();
            if !path.to_string_lossy().ends_with("-codec-host.json") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
            let names: Vec<String> = doc["runs"].as_array().unwrap().iter().map(|n| n.as_str().unwrap().to_owned()).collect();
            let runs: Vec<serde_json::Value> =
                names.iter().map(|n| serde_json::from_str(&std::fs::read_to_string(super::root().join(n)).unwrap()).unwrap()).collect();
            let rebuilt = super::codec_merge(&runs, names, doc["date"].as_str().unwrap()).unwrap();
            assert!(
                serde_json::to_string_pretty(&rebuilt).unwrap() + "\n" == text,
                "{} is not what codec_merge makes of its runs",
                path.display()
            );
            seen += 1;
        }
        assert!(seen > 0, "no codec-host results file");
        // The commit is the runs' own: runs of two commits, or of none recorded, are refused.
        let run = |c: &str| serde_json::json!({"commit": c, "threads": 1, "encode_gbps_host": 1.0});
        assert!(super::codec_merge(&[run("a"), run("b")], vec![], "d").unwrap_err().contains("one commit"));
        assert!(super::codec_merge(&[run(""), run("")], vec![], "d").is_err());
        assert_eq!(super::codec_merge(&[run("a"), run("a")], vec![], "d").unwrap()["commit"], "a");
    }
}
