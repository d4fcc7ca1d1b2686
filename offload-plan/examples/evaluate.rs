//! Plan a calibrated model at several budgets and print what the planner predicts:
//! `cargo run -p offload-plan --example evaluate -- CALIBRATION.json 8 12 16`.

use offload_core::ResidentPolicy;
use offload_plan::{plan, CostModel};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!("usage: evaluate CALIBRATION.json GIB...");
        std::process::exit(2);
    };
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let m = CostModel::from_json(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    for gib in &args[1..] {
        let gib: f64 = gib.parse().unwrap_or_else(|e| panic!("{gib}: {e}"));
        let budget = (gib * (1u64 << 30) as f64) as u64;
        match plan(&m, budget, 1, ResidentPolicy::Auto) {
            Ok(c) => println!(
                "{gib} GiB: depth {}, {} resident, predicted {:.4} s, bound {:.4} s, ratio {:.4}, device {:.2} GiB",
                c.depth,
                c.resident.iter().filter(|r| **r).count(),
                c.predicted_step_s,
                c.bound_s.max(m.compute_s()),
                c.predicted_step_s / c.bound_s.max(m.compute_s()),
                c.device_bytes as f64 / (1u64 << 30) as f64
            ),
            Err(e) => println!("{gib} GiB: {e}"),
        }
    }
}
