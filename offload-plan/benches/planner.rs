//! Planner speed on a 200-block inventory (target ≤ 10 ms).

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use criterion::{criterion_group, criterion_main, Criterion};
use offload_core::ResidentPolicy;
use offload_plan::{plan, BlockCost, CostModel};

fn planner(c: &mut Criterion) {
    let blocks = (0..200)
        .map(|i| BlockCost::new(format!("layers.{i}"), [300u64 << 20, 680 << 20, 120 << 20][i % 3], 0.002 + (i % 7) as f64 * 1e-4))
        .collect();
    let m = CostModel {
        bandwidth_bytes_per_s: 54e9,
        blocks,
        non_block_bytes: 1 << 30,
        source: "bench".into(),
        staging_buffers: offload_plan::DEFAULT_STAGING_BUFFERS,
        step_gap_s: 0.0,
    };
    c.bench_function("planner_200_blocks", |b| b.iter(|| plan(&m, 24 << 30, 2, ResidentPolicy::Auto).expect("fits")));
}

criterion_group!(benches, planner);
criterion_main!(benches);
