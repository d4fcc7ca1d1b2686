//! The zoo's one loop (`zoo run`): every case resident, then streamed at every
//! depth given, at the planner's depth (`--depths auto`) and under each device
//! budget (`--budgets`), each output checked against the resident one, with the
//! backend's file as the parameter ([`Driver`]: cuda's, candle's and tch's).

use crate::budgets::Calibration;
use crate::harness::{gib, median, streamed_row, PlannerDepth, RunCase, RunDoc, RunOptions, StoreFacts, Streamed, TimelineStep};
use crate::registry::{Case, Model};
use offload_core::{Plan, StepMetrics};
use offload_plan::CostModel;

/// What a case's resident run measured.
pub struct Resident {
    /// Every timed step, seconds.
    pub times: Vec<f64>,
    /// The output's bytes, which every streamed run of the case must equal.
    pub out: Vec<u8>,
    /// The step's peak device bytes above what was allocated before it.
    pub activations: u64,
    /// The planner's cost model (each block's compute timed in resident steps),
    /// where the loop asked for one.
    pub cost: Option<CostModel>,
}

/// What one streamed run measured.
pub struct StreamedRun {
    /// Its steps, output and memory, as the results row takes them.
    pub s: Streamed,
    /// The depth the ring ran at.
    pub depth: usize,
    /// The bytes the ring copied in its last timed step, where the file counts them.
    pub step_bytes: Option<u64>,
    /// The extra traced step's metrics (with a trace path).
    pub timeline: Option<StepMetrics>,
}

/// A backend's file in the loop: its compute, resident and through a ring.
pub trait Driver {
    /// The backend's name in the results (`cuda`, `candle`, `tch`).
    const BACKEND: &'static str;
    /// The GPU's name.
    fn gpu(&self) -> String;
    /// Bytes of the non-block weights the file holds on the device throughout.
    fn resident_bytes(&self) -> u64;
    /// `case` resident (every block's weights on the device): its timed steps,
    /// output and activations, and with `calibrate` the planner's cost model.
    fn resident(&mut self, case: &Case, calibrate: bool) -> Result<Resident, String>;
    /// Once, after every resident run and before the first streamed one (a file
    /// that builds its host store from its resident weights builds it here): the
    /// host store's facts.
    fn stream(&mut self) -> Result<StoreFacts, String>;
    /// `case` streamed by a ring of `plan`, its output compared with `resident`'s;
    /// with `trace`, one more step with the ring's timeline on, written there.
    fn streamed(&mut self, case: &Case, plan: &Plan, resident: &Resident, trace: Option<&str>) -> Result<StreamedRun, String>;
    /// What the file adds to the row of `case` at `depth` (cuda: its coded
    /// store's runs; `trace` where the raw run was traced).
    fn extend_row(
        &mut self,
        _case: &Case,
        _depth: usize,
        _resident: &Resident,
        _trace: Option<&str>,
        _row: &mut RunCase,
    ) -> Result<(), String> {
        Ok(())
    }
    /// What the file adds to the run's document, after its last run.
    fn finish(&mut self, _doc: &mut RunDoc) -> Result<(), String> {
        Ok(())
    }
}

/// The loop: `opts`' cases of `model` resident, then streamed at every depth
/// (and the planner's, and under each budget) through the driver `make` builds
/// once the options are checked, in this process.
pub fn run<D: Driver>(model: &Model, opts: &RunOptions, make: impl FnOnce() -> Result<D, String>) -> Result<RunDoc, String> {
    let cases: Vec<&Case> = opts.cases.iter().map(|c| model.case(c)).collect::<Result<_, _>>()?;
    if opts.trace.is_some() && opts.depths.is_empty() {
        return Err(format!("{}: --trace traces a streamed step at the first of --depths: give at least one depth", D::BACKEND));
    }
    run_cases(&mut make()?, model, &cases, opts)
}

fn run_cases<D: Driver>(d: &mut D, model: &Model, cases: &[&Case], opts: &RunOptions) -> Result<RunDoc, String> {
    // A cost model where a budget, `--depths auto` or the coded runs' planner asks for one.
    let calibrate = !opts.budgets_gib.is_empty() || opts.auto_depth || opts.coded;
    let mut residents: Vec<Resident> = Vec::with_capacity(cases.len());
    for c in cases {
        let r = d.resident(c, calibrate)?;
        eprintln!("{} {}: resident step {:.4} s, activations {:.2} GiB", model.name, c.name, median(&r.times), gib(r.activations));
        residents.push(r);
    }
    let facts = d.stream()?;
    if facts.payload != model.block_bytes(2) {
        return Err(format!(
            "{}: the store holds {} bytes of block tensors, the registry says {}",
            D::BACKEND,
            facts.payload,
            model.block_bytes(2)
        ));
    }
    let mut doc = RunDoc::new(opts, d.gpu(), D::BACKEND, &facts, d.resident_bytes(), Vec::new());
    for (c, r) in cases.iter().zip(&residents) {
        // The depths given, then (`--depths auto`) the planner's for a fully
        // streamed ring, asked from this case's calibration before any streamed step.
        let mut depths: Vec<(usize, Option<PlannerDepth>)> = opts.depths.iter().map(|&d| (d, None)).collect();
        if opts.auto_depth {
            let cost = r.cost.as_ref().ok_or_else(|| format!("{}: --depths auto without a calibration", D::BACKEND))?;
            depths.push(planner_depth(cost, &format!("{} {} {} --depths auto", D::BACKEND, model.name, c.name))?);
        }
        for (k, (depth, planner_depth)) in depths.into_iter().enumerate() {
            // Blocks that all fit in the ring's d + 1 slots keep them between steps:
            // its steady steps copy nothing. The row says so; a merge refuses it (a
            // sanitizer's run of one block a stack is not merged).
            let blocks: usize = model.stacks.iter().map(|s| s.count).sum();
            let trace = opts.trace.as_deref().filter(|_| k == 0 && doc.timeline_step.is_none());
            let s = d.streamed(c, &Plan::layerwise().prefetch_depth(depth), r, trace)?;
            // The ring ran the depth asked, and where the row streams, its steps copied.
            if s.depth != depth || (blocks > depth + 1 && s.step_bytes == Some(0)) {
                return Err(format!(
                    "{} {} {} d={depth}: the ring ran d={} copying {:?} bytes a step",
                    D::BACKEND,
                    model.name,
                    c.name,
                    s.depth,
                    s.step_bytes
                ));
            }
            if let (Some(m), Some(path)) = (&s.timeline, trace) {
                doc.timeline_step = Some(TimelineStep {
                    model: model.name.into(),
                    case: c.name.clone(),
                    depth,
                    trace: path.into(),
                    exposed_stall_s: m.exposed_stall_s,
                    copy_busy_s: m.copy_busy_s,
                    hidden_copy_share: m.hidden_copy_share(),
                    bytes_copied: m.bytes_copied,
                });
            }
            let mut row = RunCase { planner_depth, blocks, ..streamed_row(model, c, depth, (&r.times, r.activations), &facts, s.s) };
            d.extend_row(c, depth, r, trace, &mut row)?;
            doc.cases.push(row);
        }
        let Some(cost) = &r.cost else { continue };
        for &budget_gib in &opts.budgets_gib {
            let resident_bytes = d.resident_bytes();
            doc.budgets.push(crate::budgets::run(model, c, cost, budget_gib, (&r.times, facts.bandwidth), &mut |choice, plan| {
                let s = d.streamed(c, plan, r, None)?;
                // The ring ran the planner's choice: its depth, and in steady state
                // exactly the non-resident blocks' bytes per step; none where they
                // all fit in its d + 1 slots (each keeps its slot between steps).
                let streamed = choice.resident.iter().filter(|r| !**r).count();
                let want = if streamed <= choice.depth + 1 { 0 } else { choice.streamed_bytes };
                if s.depth != choice.depth || s.step_bytes.is_some_and(|b| b != want) {
                    return Err(format!(
                        "the ring ran d={} copying {:?} bytes a step, the planner chose d={} streaming {} ({want} a steady step)",
                        s.depth, s.step_bytes, choice.depth, choice.streamed_bytes
                    ));
                }
                // The budget is the blocks' (the planner counts no non-block weights).
                let weights = s.s.weights.saturating_sub(resident_bytes);
                Ok(Streamed { weights, derived: weights, ..s.s })
            })?);
        }
        doc.calibrations.push(Calibration { model: model.name.into(), case: c.name.clone(), cost: cost.clone() });
    }
    d.finish(&mut doc)?;
    Ok(doc)
}

/// The planner's depth for a fully streamed ring from `cost` (reported on stderr, prefixed `at`).
fn planner_depth(cost: &CostModel, at: &str) -> Result<(usize, Option<PlannerDepth>), String> {
    use crate::harness::{AUTO_DEPTH_MAX, AUTO_DEPTH_TOLERANCE};
    let choice = offload_plan::streamed_depth(cost, AUTO_DEPTH_MAX, AUTO_DEPTH_TOLERANCE).map_err(|x| format!("{at}: {x}"))?;
    let replayed = offload_plan::streamed_replays(cost, AUTO_DEPTH_MAX);
    eprintln!(
        "{at}: d={} (replayed {:?} s at d=1..{AUTO_DEPTH_MAX}, bound {:.4} s)",
        choice.depth,
        replayed.iter().map(|x| (x * 1e4).round() / 1e4).collect::<Vec<_>>(),
        choice.bound_s
    );
    let p = PlannerDepth { predicted_step_s: choice.predicted_step_s, replayed_s_by_depth: replayed, calibrated_bound_s: choice.bound_s };
    Ok((choice.depth, Some(p)))
}

#[cfg(test)]
mod tests {
    //! The loop over a driver of the simulated device: real host store, rings and
    //! planner, each block's slot bytes hashed in place of a compute.
    use super::*;
    use crate::source::{block_inventory, resolved, RegistrySource};
    use offload_core::sim::{SimBackend, SimConfig};
    use offload_core::{ComponentInventory, HostStore, Ring, TensorSource};
    use std::sync::Arc;

    struct Sim {
        model: Model,
        be: SimBackend,
        inv: ComponentInventory,
        store: Arc<HostStore<SimBackend>>,
        /// What the loop asked, in order.
        log: Vec<String>,
        /// A break: report this many more bytes a step than the ring copied, in
        /// every row (`.0`) or in the budget runs only (`.1`: plans with blocks kept resident).
        extra_bytes: (u64, u64),
        /// A break: a store of other block sizes than the registry's.
        payload_off: bool,
    }

    impl Sim {
        fn new(model: Model) -> Sim {
            let be = SimBackend::new(SimConfig::default());
            let src = RegistrySource::new(&model, 0);
            let inv = block_inventory(&model, src.specs()).unwrap();
            let store = Arc::new(HostStore::build(&be, &inv, &src).unwrap());
            Sim { model, be, inv, store, log: Vec::new(), extra_bytes: (0, 0), payload_off: false }
        }

        /// One step: every block's slot bytes hashed in the registry's order.
        fn step(&self, ring: &mut Ring<SimBackend>) -> u64 {
            let mut h = 0xcbf29ce484222325u64;
            for s in &self.model.stacks {
                for i in 0..s.count {
                    let g = ring.block(s.prefix, i).unwrap();
                    let n = g.layout().bytes;
                    self.be.read_slot(g.slot(), |m| m[..n].iter().for_each(|b| h = (h ^ *b as u64).wrapping_mul(0x100000001b3)));
                    g.finish().unwrap();
                }
            }
            h
        }

        fn run(&mut self, plan: &Plan) -> (u64, usize, u64, u64) {
            let mut ring = Ring::new(self.be.clone(), self.store.clone(), &resolved(plan, &self.inv).unwrap()).unwrap();
            self.step(&mut ring);
            let before = ring.metrics().bytes_copied;
            let out = self.step(&mut ring);
            ring.end_step().unwrap();
            let (copied, misses, depth) = (ring.metrics().bytes_copied - before, ring.metrics().misses, ring.depth());
            ring.close().unwrap();
            (out, depth, copied, misses)
        }
    }

    impl Driver for Sim {
        const BACKEND: &'static str = "sim";
        fn gpu(&self) -> String {
            "simulated".into()
        }
        fn resident_bytes(&self) -> u64 {
            0
        }
        fn resident(&mut self, c: &Case, calibrate: bool) -> Result<Resident, String> {
            self.log.push(format!("resident {}", c.name));
            let (out, ..) = self.run(&Plan::resident());
            // A transfer-bound model: each block computes its bytes at 1 TB/s over a 1 GB/s link.
            let blocks = self
                .store
                .blocks()
                .iter()
                .map(|b| offload_plan::BlockCost::new(b.id.to_string(), b.bytes() as u64, b.bytes() as f64 / 1e12));
            let cost = calibrate.then(|| crate::budgets::cost_model(1e9, blocks.collect(), "sim".into()));
            Ok(Resident { times: vec![0.1; 5], out: out.to_le_bytes().to_vec(), activations: 7, cost })
        }
        fn stream(&mut self) -> Result<StoreFacts, String> {
            self.log.push("stream".into());
            let total: u64 = self.store.blocks().iter().map(|b| b.bytes() as u64).sum();
            let payload = crate::harness::block_payload_bytes(&self.store) + u64::from(self.payload_off);
            Ok(StoreFacts { total, payload, largest: self.store.largest_block_bytes() as u64, build_s: 0.0, rss: 0, bandwidth: 100e9 })
        }
        fn streamed(&mut self, c: &Case, plan: &Plan, r: &Resident, trace: Option<&str>) -> Result<StreamedRun, String> {
            let (out, depth, copied, misses) = self.run(plan);
            self.log.push(format!("streamed {} d={depth}{}", c.name, if trace.is_some() { " traced" } else { "" }));
            let equal = out.to_le_bytes().as_slice() == r.out;
            let s = Streamed { times: vec![0.2; 5], equal, values: vec![1.0, 2.0], weights: 1, derived: 1, misses };
            let timeline = trace.map(|_| StepMetrics::default());
            let budget_run = plan.components.values().chain([&plan.default]).any(|c| !c.resident_blocks.is_empty());
            let extra = self.extra_bytes.0 + if budget_run { self.extra_bytes.1 } else { 0 };
            Ok(StreamedRun { s, depth, step_bytes: Some(copied + extra), timeline })
        }
        fn extend_row(&mut self, c: &Case, depth: usize, _: &Resident, _: Option<&str>, row: &mut RunCase) -> Result<(), String> {
            self.log.push(format!("extend {} d={depth}", c.name));
            row.coded_bitwise_equal = Some(true);
            Ok(())
        }
        fn finish(&mut self, doc: &mut RunDoc) -> Result<(), String> {
            doc.gpu = format!("{} (finished)", doc.gpu);
            Ok(())
        }
    }

    fn tiny_flux() -> Model {
        let mut m = crate::registry::tiny(&crate::registry::model("flux-dev").unwrap());
        // Its 64² case and a second, non-square one.
        let second = crate::registry::user_case(&m, 96, 64, Some(1), 1).unwrap();
        m.cases.push(second);
        m
    }

    fn opts(m: &Model) -> RunOptions {
        RunOptions {
            cases: m.cases.iter().map(|c| c.name.clone()).collect(),
            depths: vec![1, 2],
            steps: 5,
            warmup: 1,
            ..Default::default()
        }
    }

    #[test]
    fn every_case_runs_resident_then_streamed_at_each_depth_the_planners_and_under_each_budget() {
        let m = tiny_flux();
        let (a, b) = (m.cases[0].name.clone(), m.cases[1].name.clone());
        let budget = m.block_bytes(2) as f64 * 0.8 / (1u64 << 30) as f64;
        let o = RunOptions { auto_depth: true, budgets_gib: vec![budget], trace: Some("t.json".into()), ..opts(&m) };
        let doc = run(&m, &o, || Ok(Sim::new(m.clone()))).unwrap();
        assert_eq!(doc.gpu, "simulated (finished)");
        // Two cases × (depths 1, 2 and the planner's), every output the resident one's.
        assert_eq!(doc.cases.len(), 6, "{:?}", doc.cases.iter().map(|c| (&c.case, c.depth)).collect::<Vec<_>>());
        for (k, c) in doc.cases.iter().enumerate() {
            assert_eq!(&c.case, if k < 3 { &a } else { &b });
            assert!(c.bitwise_equal && c.coded_bitwise_equal == Some(true), "{}", c.case);
            assert_eq!(c.planner_depth.is_some(), k % 3 == 2);
            assert_eq!(c.activations_peak_bytes, 7);
        }
        assert_eq!((doc.cases[0].depth, doc.cases[1].depth), (1, 2));
        // Traced once: the first case at the first depth.
        let t = doc.timeline_step.as_ref().expect("a traced step");
        assert_eq!((t.case.as_str(), t.depth), (a.as_str(), 1));
        // Under 0.8 of the blocks' bytes, transfer-bound: some blocks kept, the rest streamed as the ring ran the choice.
        assert_eq!(doc.budgets.len(), 2);
        for r in &doc.budgets {
            assert!(r.bitwise_equal && r.streamed_bytes > 0 && !r.resident_blocks.is_empty(), "{r:?}");
        }
        assert_eq!(doc.calibrations.len(), 2);
    }

    #[test]
    fn resident_runs_come_first_and_each_row_is_extended() {
        let m = tiny_flux();
        let mut d = Sim::new(m.clone());
        let doc = run_cases(&mut d, &m, &m.cases.iter().collect::<Vec<_>>(), &opts(&m)).unwrap();
        assert_eq!(doc.cases.len(), 4);
        let (a, b) = (&m.cases[0].name, &m.cases[1].name);
        let want: Vec<String> = [
            format!("resident {a}"),
            format!("resident {b}"),
            "stream".into(),
            format!("streamed {a} d=1"),
            format!("extend {a} d=1"),
            format!("streamed {a} d=2"),
            format!("extend {a} d=2"),
            format!("streamed {b} d=1"),
            format!("extend {b} d=1"),
            format!("streamed {b} d=2"),
            format!("extend {b} d=2"),
        ]
        .into();
        assert_eq!(d.log, want);
        assert!(doc.budgets.is_empty() && doc.calibrations.is_empty() && doc.timeline_step.is_none());
    }

    #[test]
    fn a_ring_that_did_not_run_the_planners_choice_or_a_store_off_the_registry_is_refused() {
        let m = tiny_flux();
        let budget = m.block_bytes(2) as f64 * 0.8 / (1u64 << 30) as f64;
        let e = run(&m, &RunOptions { budgets_gib: vec![budget], ..opts(&m) }, || Ok(Sim { extra_bytes: (0, 1), ..Sim::new(m.clone()) }))
            .expect_err("refused");
        assert!(e.contains("the planner chose"), "{e}");
        // A depth row records the model's blocks (a merge refuses a row whose blocks
        // all fit in its ring's slots: it never streamed).
        let blocks: usize = m.stacks.iter().map(|s| s.count).sum();
        let doc = run(&m, &RunOptions { depths: vec![1, blocks - 1], ..opts(&m) }, || Ok(Sim::new(m.clone()))).unwrap();
        assert!(doc.cases.iter().all(|c| c.blocks == blocks), "{:?}", doc.cases);
        let e = run(&m, &opts(&m), || Ok(Sim { payload_off: true, ..Sim::new(m.clone()) })).expect_err("refused");
        assert!(e.contains("the registry says"), "{e}");
        let e = run(&m, &RunOptions { auto_depth: true, budgets_gib: vec![], ..opts(&m) }, || Ok(Sim::new(m.clone())));
        assert!(e.is_ok(), "--depths auto calibrates without a budget: {e:?}");
        // Bad options are refused before the driver is built (it would build a host store).
        let never = || -> Result<Sim, String> { panic!("the driver was built") };
        let e = run(&m, &RunOptions { trace: Some("t.json".into()), depths: vec![], ..opts(&m) }, never).expect_err("refused");
        assert!(e.contains("sim: --trace"), "{e}");
        let e = run(&m, &RunOptions { cases: vec!["4096".into()], ..opts(&m) }, never).expect_err("refused");
        assert!(e.contains("no case \"4096\""), "{e}");
    }
}
