//! `offload-plan`: read a safetensors checkpoint's header, discover its stacks,
//! and choose a plan under a device budget.
//!
//! `offload-plan CHECKPOINT --budget-gib 12 [--depth 1] [--calibration cal.json]
//! [--bandwidth-gbps 25] [--policy auto|leading|strided] [--write plan.toml]`

use offload_core::{BlockDiscovery, NameDiscovery, Plan, ResidentPolicy, SafetensorsFile, TensorSource};
use offload_plan::{plan, to_toml, CostModel};
use std::process::exit;

const USAGE: &str = "usage: offload-plan CHECKPOINT.safetensors --budget-gib GIB [--depth D] [--calibration FILE.json] \
[--bandwidth-gbps GBPS] [--policy auto|leading|strided] [--component NAME] [--write PLAN.toml]";

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("offload-plan: {msg}");
    exit(2)
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let opt = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let Some(path) = args.first().filter(|a| !a.starts_with("--")) else { fail(USAGE) };
    let budget_gib: f64 = opt("--budget-gib").unwrap_or_else(|| fail(USAGE)).parse().unwrap_or_else(|e| fail(format!("--budget-gib: {e}")));
    let depth: usize = opt("--depth").map(|d| d.parse().unwrap_or_else(|e| fail(format!("--depth: {e}")))).unwrap_or(1);
    let bandwidth: f64 =
        opt("--bandwidth-gbps").map(|d| d.parse().unwrap_or_else(|e| fail(format!("--bandwidth-gbps: {e}")))).unwrap_or(25.0) * 1e9;
    let policy = match opt("--policy").as_deref() {
        None | Some("auto") => ResidentPolicy::Auto,
        Some("leading") => ResidentPolicy::Leading,
        Some("strided") => ResidentPolicy::Strided,
        Some(p) => fail(format!("--policy {p}: expected auto, leading or strided")),
    };
    let component = opt("--component").unwrap_or_else(|| "transformer".into());
    let file = SafetensorsFile::open(path).unwrap_or_else(|e| fail(e));
    let inventory = NameDiscovery.discover(&component, file.specs()).unwrap_or_else(|e| fail(e));
    let model = match opt("--calibration") {
        Some(c) => {
            let text = std::fs::read_to_string(&c).unwrap_or_else(|e| fail(format!("{c}: {e}")));
            CostModel::from_json(&text).unwrap_or_else(|e| fail(format!("{c}: {e}")))
        }
        None => CostModel::from_inventory(&inventory, bandwidth).unwrap_or_else(|e| fail(e)),
    };
    println!("{path}: component {component:?}");
    for s in &inventory.stacks {
        let sizes: Vec<u64> =
            s.blocks.iter().filter_map(|b| model.blocks.iter().find(|c| c.id == b.id.to_string()).map(|c| c.bytes)).collect();
        let (min, max) = (sizes.iter().min().copied().unwrap_or(0), sizes.iter().max().copied().unwrap_or(0));
        println!(
            "  stack {:<24} {:>4} blocks, {:.3}–{:.3} GiB each, {:.2} GiB",
            s.name,
            s.blocks.len(),
            gib(min),
            gib(max),
            gib(sizes.iter().sum())
        );
    }
    println!("  non-block tensors: {} ({:.3} GiB, resident)", inventory.non_block.len(), gib(model.non_block_bytes));
    println!(
        "  blocks in all: {:.2} GiB; bandwidth {:.1} GB/s ({})",
        gib(model.total_bytes()),
        model.bandwidth_bytes_per_s / 1e9,
        model.source
    );
    let budget = (budget_gib * (1u64 << 30) as f64) as u64;
    let choice = plan(&model, budget, depth, policy).unwrap_or_else(|e| fail(e));
    let ids = choice.resident_ids(&model);
    println!("\nplan under {budget_gib} GiB at depth {depth}:");
    println!(
        "  resident blocks: {} of {} ({:.2} GiB){}",
        ids.len(),
        model.blocks.len(),
        gib(model.total_bytes() - choice.streamed_bytes),
        if choice.exact { "" } else { " [greedy fill]" }
    );
    if !ids.is_empty() && ids.len() < model.blocks.len() {
        println!("    {}", ids.join(", "));
    }
    println!("  streamed blocks: {:.2} GiB; device bytes for weights: {:.2} GiB", gib(choice.streamed_bytes), gib(choice.device_bytes));
    if model.compute_s() > 0.0 {
        println!(
            "  predicted step {:.4} s vs resident {:.4} s ({:.2}×); bound {:.4} s",
            choice.predicted_step_s,
            choice.resident_step_s,
            choice.predicted_step_s / choice.resident_step_s,
            choice.bound_s
        );
    } else {
        println!(
            "  predicted transfer time per step {:.4} s (compute unknown: pass --calibration for a step prediction)",
            choice.predicted_step_s
        );
    }
    if let Some(out) = opt("--write") {
        let cp = choice.component_plan(&model, budget);
        let text = to_toml(&Plan::layerwise().component(component, cp)).unwrap_or_else(|e| fail(e));
        std::fs::write(&out, text).unwrap_or_else(|e| fail(format!("{out}: {e}")));
        println!("\nwrote {out}");
    }
}
