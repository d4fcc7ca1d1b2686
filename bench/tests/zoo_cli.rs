//! `zoo run`'s argument checks, before any GPU work: a misspelt, repeated or
//! value-less option is an error naming it, never a default.

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zoo")).arg("run").args(args).output().expect("zoo runs");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_run_arguments_are_named_errors() {
    for (args, says) in [
        (&["--model", "flux-dev", "--budget", "8", "--out", "x"][..], "unknown argument \"--budget\""),
        (&["--model", "flux-dev", "--model", "qwen-image", "--out", "x"][..], "--model given twice"),
        (
            &["--backend", "cuda", "--model", "flux-dev", "--trace", "--no-gemm", "--out", "x"][..],
            "--trace needs a value, not the option --no-gemm",
        ),
        (
            &["--backend", "tch", "--model", "flux-dev", "--budgets", "8", "--out", "x"][..],
            "--budgets is implemented by the cuda and candle backends only, not by tch",
        ),
        (&["--model", "flux-dev", "--out"][..], "--out needs a value"),
        (
            &["--backend", "tch", "--model", "flux-dev", "--high-priority-compute", "--out", "x"][..],
            "--high-priority-compute: cuda's file only",
        ),
        (&["--backend", "tch", "--model", "flux-dev", "--depths", "1,auto", "--out", "x"][..], "--depths auto: only candle's file"),
        (&["--backend", "candle", "--model", "flux-dev", "--depths", "0", "--out", "x"][..], "--depths: \"0\" is neither"),
        (&["--backend", "candle", "--model", "flux-dev", "--depths", ",", "--out", "x"][..], "--depths: no depth given"),
        (&["--backend", "cuda", "--model", "flux-dev", "--high-priority-compute", "--out", "x"][..], "only with --coded"),
    ] {
        let (ok, err) = run(args);
        assert!(!ok, "{args:?} succeeded");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
