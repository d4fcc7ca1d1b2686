//! `fault-table OUT.md`: inject every fault of a sweep, try every bad input and
//! impossible plan, and write what happened as a Markdown table.

use offload_core::sim::{SimBackend, SimConfig};
use offload_core::HostBuffer as _;
use offload_core::{
    resolve, BlockDiscovery, ComponentInventory, ComponentPlan, Error, FaultInjector, FaultKind, HostStore, NameDiscovery, OffloadBackend,
    Plan, Ring,
};
use offload_tests::checkpoint::load_on_sim;
use offload_tests::model::{ModelShape, TestModel};
use offload_tests::sim_harness::sim_step;
use std::fmt::Write;
use std::sync::Arc;

fn short(s: &str) -> String {
    let s = s.replace('|', "\\|").replace('\n', " ");
    if s.chars().count() > 150 {
        format!("{}…", s.chars().take(150).collect::<String>())
    } else {
        s
    }
}

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "faults.md".into());
    let mut md =
        String::from("# Faults injected, bad inputs tried, and what happened\n\nProduced by `cargo xtask faults` (simulated device).\n\n");

    // 1. Fault sweep.
    let model =
        TestModel::random(&ModelShape { stacks: vec![3, 3], tensors_per_block: 2, min_bytes: 256, max_bytes: 4096, non_block: 1 }, 42);
    let sim = SimBackend::new(SimConfig { max_copy_delay_us: 20, ..Default::default() });
    let fi = FaultInjector::new(sim.clone());
    let plan = Plan::layerwise()
        .component("transformer", ComponentPlan { prefetch_depth: 2, resident_blocks: vec!["stack0.1".into()], ..Default::default() });
    let rc = resolve(&plan, std::slice::from_ref(&model.inventory)).expect("plan").components.remove(0);
    let order: Vec<usize> = (0..model.len()).collect();
    let want = model.reference(&order);
    md.push_str("## Injected faults (build store, enable, 2 steps, disable)\n\n`slots left`: device bytes still held after the failure; `weights intact`: a store rebuilt afterwards holds exactly the model's bytes; `retry`: enabling again with no fault.\n\n| fault | error | slots left | weights intact | retry |\n| --- | --- | --- | --- | --- |\n");
    let mut total = 0;
    for kind in [FaultKind::HostAlloc, FaultKind::SlotAlloc, FaultKind::Copy, FaultKind::Event] {
        for n in 0.. {
            fi.arm(kind, n);
            let attempt = (|| {
                let store = Arc::new(HostStore::build(&fi, &model.inventory, &model.tensors)?);
                let mut ring = Ring::new(fi.clone(), store.clone(), &rc)?;
                for _ in 0..2 {
                    if sim_step(&mut ring, &sim, &order)? != want {
                        return Err(Error::Protocol("wrong result".into()));
                    }
                }
                ring.close()?;
                Ok::<_, Error>(store)
            })();
            fi.disarm();
            let _ = sim.synchronize();
            let left = sim.stats().live_bytes;
            match attempt {
                Ok(_) => break,
                Err(e) => {
                    total += 1;
                    // Retry with nothing armed: the rebuilt store must hold exactly the
                    // model's bytes, and a ring must build and close.
                    let (intact, retry) = match HostStore::build(&fi, &model.inventory, &model.tensors) {
                        Ok(store) => {
                            let intact = store.blocks().iter().enumerate().all(|(i, b)| {
                                b.buffer().expect("held in memory").block_bytes().is_ok_and(|h| h == model.block_bytes(i).as_slice())
                            });
                            let retry = Ring::new(fi.clone(), Arc::new(store), &rc)
                                .and_then(|r| r.close())
                                .map_or_else(|e| format!("FAILED: {e}"), |_| "ok".into());
                            (intact, retry)
                        }
                        Err(e) => (false, format!("FAILED: {e}")),
                    };
                    let _ = writeln!(
                        md,
                        "| {kind:?} #{n} | {} | {left} | {} | {retry} |",
                        short(&e.to_string()),
                        if intact { "yes" } else { "NO" }
                    );
                }
            }
        }
    }
    let _ = writeln!(md, "\n{total} faults injected; violations seen by the simulated device: {}.\n", sim.stats().violations.len());

    // 2. Bad inputs: the committed fuzz corpus.
    md.push_str("## Checkpoints (fuzz corpus, `fuzz/corpus/safetensors_store`)\n\n| input | outcome |\n| --- | --- |\n");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/safetensors_store");
    let mut files: Vec<_> = std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    files.sort();
    for f in files {
        let outcome = match load_on_sim(&f) {
            Ok(n) => format!("loaded, {n} blocks streamed"),
            Err(e) => format!("error: {}", short(&e.replace(&dir.display().to_string(), "…"))),
        };
        let _ = writeln!(md, "| {} | {} |", f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(), outcome);
    }

    // 3. Plans that cannot work.
    md.push_str("\n## Plans that cannot work (rejected before any device work)\n\n| plan | error |\n| --- | --- |\n");
    let inv = |name: &str, blocks: usize| -> ComponentInventory {
        let t: Vec<_> =
            (0..blocks).map(|i| offload_core::TensorSpec::new(format!("{name}.{i}.w"), offload_core::DType::U8, [1024])).collect();
        NameDiscovery.discover(name, &t).expect("discover")
    };
    let cases: Vec<(&str, Plan, Vec<ComponentInventory>)> = vec![
        (
            "budget below (d+1) × largest block",
            Plan::layerwise().prefetch_depth(2).device_budget_gib(2048.0 / (1u64 << 30) as f64),
            vec![inv("blocks", 4)],
        ),
        ("prefetch depth 0", Plan::layerwise().prefetch_depth(0), vec![inv("blocks", 4)]),
        (
            "one block",
            Plan::layerwise(),
            vec![{
                let mut i = inv("blocks", 2);
                i.stacks[0].blocks.truncate(1);
                i
            }],
        ),
        (
            "zero blocks",
            Plan::layerwise(),
            vec![{
                let mut i = inv("blocks", 2);
                i.stacks.clear();
                i
            }],
        ),
        ("unknown component", Plan::layerwise().component("vae", ComponentPlan::default()), vec![inv("blocks", 4)]),
        ("component named twice", Plan::layerwise(), vec![inv("blocks", 3), inv("blocks", 3)]),
        (
            "block in two components",
            Plan::layerwise(),
            vec![inv("blocks", 3), {
                let mut i = inv("blocks", 3);
                i.name = "other".into();
                i
            }],
        ),
        (
            "resident block that does not exist",
            Plan::layerwise().component("blocks", ComponentPlan { resident_blocks: vec!["blocks.9".into()], ..Default::default() }),
            vec![inv("blocks", 4)],
        ),
    ];
    for (what, plan, inventory) in cases {
        let outcome = match resolve(&plan, &inventory) {
            Ok(_) => "ACCEPTED (should not be)".to_owned(),
            Err(e) => short(&e.to_string()),
        };
        let _ = writeln!(md, "| {what} | {outcome} |");
    }
    std::fs::write(&out, &md).unwrap_or_else(|e| panic!("{out}: {e}"));
    println!("{md}");
    println!("wrote {out}");
}
