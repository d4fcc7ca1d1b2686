//! Host-side cost per block of the ring (target ≤ 10 µs with `d = 1`): the time
//! `Ring::block_at` plus releasing the guard takes on the host, measured on a
//! backend whose primitives do nothing (the ring's own bookkeeping) and on the
//! simulated backend (bookkeeping plus a real copy thread).

#![allow(missing_docs)] // criterion_group! generates undocumented items.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use offload_core::sim::{SimBackend, SimConfig};
use offload_core::*;
use std::sync::Arc;

/// A backend whose primitives are free: what remains is the ring's cost.
#[derive(Clone)]
struct Null;

/// Its host buffers: ordinary memory.
struct NullHost(Vec<u8>);

impl HostBuffer for NullHost {
    fn is_pinned(&self) -> bool {
        false
    }
    fn block_bytes(&self) -> Result<&[u8]> {
        Ok(&self.0)
    }
}

impl HostMemory for Null {
    type Buffer = NullHost;
    fn capabilities(&self) -> HostCapabilities {
        HostCapabilities::default()
    }
    fn alloc(&self, kind: HostKind<'_>, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<NullHost> {
        if !matches!(kind, HostKind::Pinned) {
            return Err(host::unsupported_kind("null", kind, purpose));
        }
        let mut v = vec![0; bytes];
        fill(&mut v)?;
        Ok(NullHost(v))
    }
}

impl OffloadBackend for Null {
    type Host = Null;
    type Slot = ();
    type Event = ();
    type Wait = ();
    fn name(&self) -> &'static str {
        "null"
    }
    fn host(&self) -> Null {
        Null
    }
    fn alloc_slot(&self, _: usize, _: &str) -> Result<()> {
        Ok(())
    }
    fn free_slot(&self, _: (), _: Option<&()>) -> Result<()> {
        Ok(())
    }
    fn copy_to_slot(&self, _: &NullHost, _: &mut (), _: usize, _: Option<&()>) -> Result<()> {
        Ok(())
    }
    fn compute_wait(&self, _: &()) -> Result<()> {
        Ok(())
    }
    fn record_compute(&self) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

fn flux_like_tensors(blocks: usize) -> MemoryTensors {
    let mut t = MemoryTensors::new();
    for stack in ["double_blocks", "single_blocks"] {
        for i in 0..blocks {
            for name in ["attn.qkv.weight", "attn.proj.weight", "mlp.0.weight", "mlp.2.weight", "norm.scale"] {
                t.push(TensorSpec::new(format!("{stack}.{i}.{name}"), DType::BF16, [8, 8]), vec![1; 128]).expect("sizes agree");
            }
        }
    }
    t
}

fn bench_backend<B: OffloadBackend>(c: &mut Criterion, name: &str, backend: B) {
    let tensors = flux_like_tensors(19);
    let inv = NameDiscovery.discover("transformer", tensors.specs()).expect("discover");
    let store = Arc::new(HostStore::build(&backend, &inv, &tensors).expect("store"));
    let mut g = c.benchmark_group("ring_host_cost_per_block");
    g.throughput(Throughput::Elements(1));
    for depth in [1usize, 2] {
        let rc = resolve(&Plan::layerwise().prefetch_depth(depth), std::slice::from_ref(&inv)).expect("plan").components.remove(0);
        let mut ring = Ring::new(backend.clone(), store.clone(), &rc).expect("ring");
        let n = ring.len();
        let mut b = 0;
        g.bench_with_input(BenchmarkId::new(name, format!("d{depth}")), &depth, |bench, _| {
            bench.iter(|| {
                let guard = ring.block_at(b).expect("block");
                drop(guard);
                b = (b + 1) % n;
            })
        });
    }
    g.finish();
}

fn host_cost(c: &mut Criterion) {
    bench_backend(c, "null", Null);
    bench_backend(c, "sim", SimBackend::new(SimConfig::fast()));
}

criterion_group!(benches, host_cost);
criterion_main!(benches);
