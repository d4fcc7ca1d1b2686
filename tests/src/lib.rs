//! The conformance suite of `offload`: every case is written once, generic over a
//! [`Harness`], and instantiated per backend by [`conformance_tests!`].
//!
//! A case that needs hardware it cannot find prints `SKIPPED: <why>` and passes,
//! unless `OFFLOAD_REQUIRE_DEVICE=1`, where it fails.

#[cfg(feature = "candle")]
pub mod candle_harness;
pub mod cases;
pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod cuda_harness;
pub mod harness;
pub mod model;
pub mod sim_harness;
#[cfg(feature = "tch")]
pub mod tch_harness;
#[cfg(feature = "vulkan")]
pub mod vulkan_harness;

pub use harness::{CaseError, Harness, ModelCase, Outcome};

/// Whether a missing device is a failure (`OFFLOAD_REQUIRE_DEVICE=1`).
pub fn device_required() -> bool {
    std::env::var("OFFLOAD_REQUIRE_DEVICE").is_ok_and(|v| v == "1")
}

/// The result of one case in the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Passed.
    Pass,
    /// Failed, with why.
    Fail(String),
    /// Skipped, with why.
    Skipped(String),
}

fn verdict(o: Outcome) -> Verdict {
    match o {
        Ok(()) => Verdict::Pass,
        Err(CaseError::Fail(m)) => Verdict::Fail(m),
        Err(CaseError::Skip(w)) if device_required() => Verdict::Fail(format!("device required: {w}")),
        Err(CaseError::Skip(w)) => Verdict::Skipped(w),
    }
}

/// Run every case of harness `H`, then its model case if it has one; a skip
/// becomes a failure when the device is required.
pub fn run_suite<H: Harness>() -> Vec<(&'static str, &'static str, Verdict)> {
    let mut row: Vec<_> =
        cases::all::<H>().into_iter().map(|c| (c.name, c.invariant, verdict((c.run)(offload_core::sabotage::Sabotage::None)))).collect();
    for m in H::model_cases() {
        row.push((m.name, m.invariant, verdict((m.run)())));
    }
    row
}

/// What one deliberate ring break did to one backend's row.
#[derive(Clone, Debug)]
pub struct SabotageOutcome {
    /// The break.
    pub sabotage: offload_core::sabotage::Sabotage,
    /// Whether a case that guards the broken invariant failed.
    pub caught: bool,
    /// The cases that failed, with why (or why the row could not run).
    pub by: Vec<(&'static str, String)>,
    /// The cases that guard it and passed anyway.
    pub missed_by: Vec<&'static str>,
}

/// Run every ring break of [`Sabotage::ALL`](offload_core::sabotage::Sabotage::ALL)
/// against the cases of harness `H` that guard the broken invariant. A break is
/// caught when at least one of them fails. A skip (no device) is reported as not
/// caught, with why; so is a row whose backend does not open (its cases would
/// all fail for that reason alone, which is not catching a break).
pub fn run_sabotage<H: Harness>() -> Vec<SabotageOutcome> {
    offload_core::sabotage::Sabotage::ALL.iter().map(|&s| run_sabotage_one::<H>(s)).collect()
}

/// One break of [`run_sabotage`]: the cases of harness `H` that guard the
/// invariant `sabotage` breaks, run with it. The `conformance` binary runs each
/// break in a process of its own through this, so that a break which spoils the
/// device for the rest of its process (a freed slot still read, say) cannot make
/// a later break's cases fail for that reason instead of their own.
pub fn run_sabotage_one<H: Harness>(sabotage: offload_core::sabotage::Sabotage) -> SabotageOutcome {
    let unopened = match H::backend() {
        Ok(_) => None,
        Err(CaseError::Skip(why)) => Some(format!("SKIPPED: {why}")),
        Err(CaseError::Fail(why)) => Some(format!("the backend did not open: {why}")),
    };
    if let Some(why) = unopened {
        return SabotageOutcome { sabotage, caught: false, by: vec![("backend", why)], missed_by: Vec::new() };
    }
    let mut by = Vec::new();
    let mut missed_by = Vec::new();
    for case in cases::all::<H>().into_iter().filter(|c| c.caught.contains(&sabotage)) {
        match (case.run)(sabotage) {
            Err(CaseError::Fail(why)) => by.push((case.name, why)),
            Err(CaseError::Skip(why)) => by.push((case.name, format!("SKIPPED: {why}"))),
            Ok(()) => missed_by.push(case.name),
        }
    }
    let caught = caught_by(sabotage, by.iter().map(|(_, w)| w.as_str()));
    SabotageOutcome { sabotage, caught, by, missed_by }
}

/// One break on one backend, as the table keeps it (owned: it may come from a
/// child process).
#[derive(Debug)]
pub struct BreakRow {
    /// The break's name (`SkipFreeWait`).
    pub sabotage: String,
    /// Whether a case that guards the broken invariant failed.
    pub caught: bool,
    /// The cases that failed, with why (or why the row could not run).
    pub by: Vec<(String, String)>,
    /// The cases that guard the invariant and passed anyway.
    pub missed_by: Vec<String>,
}

impl BreakRow {
    /// The row as a child prints it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"sabotage": self.sabotage, "caught": self.caught, "by": self.by, "missed_by": self.missed_by})
    }

    /// A row as a child printed it.
    pub fn from_json(v: &serde_json::Value) -> Option<Self> {
        let strings = |v: &serde_json::Value| v.as_str().map(str::to_owned);
        Some(BreakRow {
            sabotage: strings(&v["sabotage"])?,
            caught: v["caught"].as_bool()?,
            by: v["by"].as_array()?.iter().map(|p| Some((strings(&p[0])?, strings(&p[1])?))).collect::<Option<_>>()?,
            missed_by: v["missed_by"].as_array()?.iter().map(strings).collect::<Option<_>>()?,
        })
    }
}

impl From<SabotageOutcome> for BreakRow {
    fn from(o: SabotageOutcome) -> Self {
        BreakRow {
            sabotage: format!("{:?}", o.sabotage),
            caught: o.caught,
            by: o.by.into_iter().map(|(c, w)| (c.to_owned(), w)).collect(),
            missed_by: o.missed_by.into_iter().map(str::to_owned).collect(),
        }
    }
}

/// The line a child process prints its break's row on.
pub const ROW_MARK: &str = "sabotage-row: ";

/// One break on `backend` in a child process of the `conformance` binary at
/// `exe` (`--sabotage-one`),
/// so that whatever one break leaves behind in its process (a device fault, a
/// leaked device) does not decide the next break's verdict. A child that dies,
/// exits with a failure or outlives `OFFLOAD_SABOTAGE_TIMEOUT_S` (default 600 s;
/// then killed) is a break not caught, with why.
pub fn break_in_child(exe: &std::path::Path, backend: &str, s: offload_core::sabotage::Sabotage) -> BreakRow {
    use std::io::Read;
    let name = format!("{s:?}");
    let lost = |why: String| BreakRow { sabotage: name.clone(), caught: false, by: vec![("process".into(), why)], missed_by: Vec::new() };
    let mut child = match std::process::Command::new(exe)
        .args(["--sabotage-one", backend, &name])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return lost(format!("starting the child process: {e}")),
    };
    // Read its output on a thread, so a full pipe cannot stall it while we wait.
    let Some(mut out) = child.stdout.take() else { return lost("the child's output was not captured".into()) };
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = out.read_to_string(&mut text);
        text
    });
    let limit = std::env::var("OFFLOAD_SABOTAGE_TIMEOUT_S").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(600);
    let started = std::time::Instant::now();
    let status = loop {
        // The limit before the poll: with a limit of 0 the child is killed before
        // it can finish, however quick its break.
        if started.elapsed().as_secs() >= limit {
            let _ = child.kill();
            let _ = child.wait();
            break Err(format!("the child process ran past {limit} s and was killed"));
        }
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) => std::thread::sleep(std::time::Duration::from_millis(20)),
            Err(e) => break Err(format!("waiting for the child process: {e}")),
        }
    };
    let stdout = reader.join().unwrap_or_default();
    let status = match status {
        Ok(st) => st,
        Err(why) => return lost(why),
    };
    let row = stdout.lines().find_map(|l| l.strip_prefix(ROW_MARK));
    match (row, status.success()) {
        (Some(row), true) => serde_json::from_str(row)
            .ok()
            .as_ref()
            .and_then(BreakRow::from_json)
            .unwrap_or_else(|| lost(format!("the child's row does not read: {row}"))),
        (Some(row), false) => lost(format!("the child process ended ({status}) after its row, so the row does not count: {row}")),
        (None, _) => lost(format!("the child process ended ({status}) without a row; its output: {}", stdout.trim())),
    }
}

/// How a [`CaseError::Skip`] says the case or break does not apply to the row
/// (a refusal the row makes by design): reported as n/a, never as a pass, and not
/// failed under `OFFLOAD_REQUIRE_DEVICE=1`.
pub const NOT_APPLICABLE: &str = "n/a:";

/// What a guarding case's failure says when it is the break that failed it:
/// the invariant the break breaks, as a protocol log reports it, or the wrong
/// result, budget, count or refusal the break causes. A failure saying
/// anything else (an error of another check on the way) is no catch.
pub fn marks(sabotage: offload_core::sabotage::Sabotage) -> &'static [&'static str] {
    use offload_core::sabotage::Sabotage as S;
    match sabotage {
        S::SkipComputeWait => &["(invariant 1)", "differs from the resident reference"],
        S::SkipFreeWait | S::NoReleaseEvent | S::EarlyRelease => &["(invariant 2)", "differs from the resident reference"],
        S::SyncEveryBlock => &["host synchronisations in"],
        S::ExtraSlot => &["peak device bytes"],
        S::TrustPrediction => &["differs from the resident r"],
        S::LeakOnError => &["still held after the failure"],
        S::SkipSourceCheck => &["over the changed file"],
        S::StaleBounce => &["result from the disk tier"],
        S::TrustCodedFile => &["a forged coded file (its hashes rewritten) built a store"],
        S::EarlyRefill => &["invariant 2, the disk tier)", "result from the disk tier"],
        S::SecondHostCopy => &["page-locked bytes for the store, which counts"],
        S::None => &[],
    }
}

/// Whether `sabotage` is caught by its guarding cases' failures (`why` each):
/// by one that failed for it (its [`marks`]), not skipped, not for a fault of
/// the harness, and not for another error on the way (a simulator's own check
/// refusing a forged file before the case's check ran).
pub fn caught_by<'a>(sabotage: offload_core::sabotage::Sabotage, whys: impl IntoIterator<Item = &'a str>) -> bool {
    whys.into_iter().any(|w| !w.starts_with("SKIPPED") && !w.starts_with(HARNESS_FAULT) && marks(sabotage).iter().any(|m| w.contains(m)))
}

/// How a failure the harness itself caused begins (a row that cannot build the
/// backend a break needs): it fails the case, and never counts as the break caught.
pub const HARNESS_FAULT: &str = "harness:";

/// Turn an outcome into a test result: panic on failure; print `SKIPPED` on a skip,
/// or panic when `OFFLOAD_REQUIRE_DEVICE=1`.
pub fn report(name: &str, outcome: Outcome) {
    match outcome {
        Ok(()) => {}
        Err(CaseError::Fail(m)) => panic!("{name}: {m}"),
        // A case or break that does not apply to the row (a refusal the row
        // makes by design) is n/a, not a pass and not a missing device.
        Err(CaseError::Skip(w)) if w.starts_with(NOT_APPLICABLE) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "N/A: {name}: {w}");
        }
        Err(CaseError::Skip(w)) if device_required() => panic!("{name}: OFFLOAD_REQUIRE_DEVICE=1 but {w}"),
        Err(CaseError::Skip(w)) => {
            // Straight to the process's stderr, past the test harness's capture,
            // so a skip is visible in every log.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED: {name}: {w}");
        }
    }
}

/// Instantiate every conformance case as a `#[test]` for a harness:
/// `conformance_tests!(sim, offload_tests::sim_harness::Sim);` gives `sim::ready_before_read`, ….
#[macro_export]
macro_rules! conformance_tests {
    ($module:ident, $harness:ty) => {
        mod $module {
            use $crate::cases::all;
            fn run(name: &str) {
                let case = all::<$harness>().into_iter().find(|c| c.name == name).expect("case exists");
                $crate::report(name, (case.run)(offload_core::sabotage::Sabotage::None));
            }
            #[test]
            fn ready_before_read() {
                run("ready_before_read")
            }
            #[test]
            fn free_after_last_use() {
                run("free_after_last_use")
            }
            #[test]
            fn no_host_sync_steady_state() {
                run("no_host_sync_steady_state")
            }
            #[test]
            fn no_weight_copy_back() {
                run("no_weight_copy_back")
            }
            #[test]
            fn bounded_device_memory() {
                run("bounded_device_memory")
            }
            #[test]
            fn bitwise_equal() {
                run("bitwise_equal")
            }
            #[test]
            fn order_learned() {
                run("order_learned")
            }
            #[test]
            fn transactional() {
                run("transactional")
            }
            #[test]
            fn one_host_copy() {
                run("one_host_copy")
            }
            #[test]
            fn on_demand_component() {
                run("on_demand_component")
            }
            #[test]
            fn safetensors_source() {
                run("safetensors_source")
            }
            #[test]
            fn mapped_source() {
                run("mapped_source")
            }
            #[test]
            fn disk_source() {
                run("disk_source")
            }
            #[test]
            fn file_faults() {
                run("file_faults")
            }
            #[test]
            fn coded_file() {
                run("coded_file")
            }
            #[test]
            fn every_case_is_instantiated() {
                assert_eq!(all::<$harness>().len(), 15)
            }
        }
    };
}
