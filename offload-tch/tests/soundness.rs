//! The tch boundary on the CPU: `TchOffload::new` is transactional, a forgotten
//! `TchBlock` is cleaned up by the next `block` (parameters pointed back, the
//! ring records the release), and a bind that fails part way is undone.
#![cfg(feature = "libtorch")]

use offload_core::sim::{SimBackend, SimConfig, SimEvent, SimHostBuffer, SimSlot};
use offload_core::{BlockLayout, Error, NameDiscovery, OffloadBackend, Plan, Result};
use offload_tch::tch::nn::{self, Module};
use offload_tch::tch::{self, Device, Kind, Tensor};
use offload_tch::{TchOffload, TchSlots};
use std::collections::HashMap;

fn store(blocks: i64) -> (nn::VarStore, Vec<nn::Linear>) {
    tch::manual_seed(11);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = (0..blocks).map(|i| nn::linear(vs.root() / "blocks" / i, 32, 32, Default::default())).collect();
    (vs, m)
}

/// Every variable's name, shape and bytes.
fn snapshot(vs: &nn::VarStore) -> Vec<(String, Vec<i64>, Vec<u8>)> {
    let mut v: Vec<_> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| {
            let t = t.contiguous();
            let mut b = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
            t.copy_data_u8(&mut b, t.numel());
            (n, t.size(), b)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn a_failed_new_leaves_the_var_store_as_it_was() {
    let (vs, _m) = store(4);
    let before = snapshot(&vs);
    assert!(before.iter().all(|(_, s, _)| s.iter().product::<i64>() > 0));
    // A device too small for the ring's slots: the ring fails after the store is built.
    let tiny = SimBackend::new(SimConfig { device_bytes: 1024, ..SimConfig::fast() });
    let r = TchOffload::new(tiny, &vs, "model", &NameDiscovery, &Plan::layerwise());
    let e = r.err().expect("the ring cannot fit");
    assert!(e.to_string().contains("out of") || e.to_string().contains("memory"), "{e}");
    assert_eq!(snapshot(&vs), before, "the VarStore changed on a failed TchOffload::new");
}

#[test]
fn a_forgotten_block_is_cleaned_up_by_the_next() {
    let (vs, m) = store(3);
    let x = Tensor::randn([2, 32], (Kind::Float, Device::Cpu));
    let _g = tch::no_grad_guard();
    let want: Vec<Tensor> = m.iter().map(|l| l.forward(&x)).collect();
    let sim = SimBackend::new(SimConfig::default());
    let mut off = TchOffload::new(sim.clone(), &vs, "model", &NameDiscovery, &Plan::layerwise()).expect("offload");
    for step in 0..2 {
        for (i, l) in m.iter().enumerate() {
            let block = off.block("blocks", i).expect("block");
            let y = l.forward(&x);
            assert!(y.equal(&want[i]), "step {step} block {i}: wrong output");
            if i == 1 {
                std::mem::forget(block);
            } else {
                block.finish().expect("finish");
            }
        }
        let metrics = off.end_step().expect("end step");
        assert_eq!(metrics.forgotten_guards, 1, "{metrics}");
        // The forgotten block's parameters were pointed back at placeholders.
        assert_eq!(m[1].ws.numel(), 0, "step {step}: the forgotten block still points at its slot");
    }
    sim.check().expect("no protocol violation");
}

/// The simulated backend, but `bind` points the first tensor of a block at its
/// weights and then fails.
#[derive(Clone)]
struct FailingBind(SimBackend);

impl OffloadBackend for FailingBind {
    type Host = SimBackend;
    type Slot = SimSlot;
    type Event = SimEvent;
    type Wait = ();
    fn name(&self) -> &'static str {
        "failing-bind"
    }
    fn host(&self) -> SimBackend {
        self.0.clone()
    }
    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<SimSlot> {
        self.0.alloc_slot(bytes, purpose)
    }
    fn free_slot(&self, slot: SimSlot, after: Option<&SimEvent>) -> Result<()> {
        self.0.free_slot(slot, after)
    }
    fn copy_to_slot(&self, src: &SimHostBuffer, dst: &mut SimSlot, bytes: usize, after: Option<&SimEvent>) -> Result<SimEvent> {
        self.0.copy_to_slot(src, dst, bytes, after)
    }
    fn compute_wait(&self, event: &SimEvent) -> Result<()> {
        self.0.compute_wait(event)
    }
    fn record_compute(&self) -> Result<SimEvent> {
        self.0.record_compute()
    }
    fn synchronize(&self) -> Result<()> {
        self.0.synchronize()
    }
}

impl TchSlots for FailingBind {
    fn tch_device(&self) -> Device {
        Device::Cpu
    }
    fn bind(&self, slot: &SimSlot, layout: &BlockLayout, params: &mut HashMap<String, Tensor>) -> Result<()> {
        let first = BlockLayout::new(vec![layout.tensors[0].spec.clone()])?;
        self.0.bind(slot, &first, params)?;
        Err(Error::Injected(format!("bind after {}", layout.tensors[0].spec.name)))
    }
}

#[test]
fn a_bind_that_fails_part_way_is_undone() {
    let (vs, m) = store(2);
    let mut off = TchOffload::new(FailingBind(SimBackend::new(SimConfig::fast())), &vs, "model", &NameDiscovery, &Plan::layerwise())
        .expect("offload");
    let r = off.block("blocks", 0);
    assert!(r.is_err(), "the bind was to fail");
    drop(r);
    for (name, p) in [("bias", &m[0].bs), ("weight", &Some(m[0].ws.shallow_clone()))] {
        let n = p.as_ref().map_or(0, Tensor::numel);
        assert_eq!(n, 0, "blocks.0.{name} still points at the slot after a failed bind");
    }
}

/// A variable changed after its `VarStoreTensors` was made (another shape that
/// broadcasts into the planned one, another kind that `copy_` would convert) is
/// an error naming it when read, not another tensor's bytes in its place.
#[test]
fn a_var_store_changed_after_planning_is_an_error_naming_the_tensor() {
    use offload_core::TensorSource;
    use offload_tch::VarStoreTensors;
    for change in ["shape", "kind"] {
        let (vs, _) = store(2);
        let src = VarStoreTensors::new(&vs).unwrap();
        let i = src.specs().iter().position(|s| s.name == "blocks.1.weight").unwrap();
        let mut dst = vec![0u8; src.specs()[i].nbytes().unwrap()];
        src.read_into(i, &mut dst).unwrap();
        let mut w = vs.variables()["blocks.1.weight"].shallow_clone();
        tch::no_grad(|| match change {
            // [1, 32] broadcasts into the planned [32, 32].
            "shape" => w.set_data(&Tensor::ones([1, 32], (Kind::Float, Device::Cpu))),
            _ => w.set_data(&w.to_kind(Kind::Double)),
        });
        let e = src.read_into(i, &mut dst).err().unwrap_or_else(|| panic!("{change}: read as if unchanged")).to_string();
        assert!(e.contains("blocks.1.weight") && e.contains("changed since"), "{change}: {e}");
    }
}

/// A hand-built layout placing fewer bytes than its tensor holds is a named
/// error from `bind`, not a tensor read past those bytes (libtorch copies the
/// spec's size from the slice it is given).
#[test]
fn a_layout_placing_fewer_bytes_than_its_tensor_is_refused_by_bind() {
    use offload_core::{PlacedTensor, TensorSpec};
    let sim = SimBackend::new(SimConfig::fast());
    let slot = sim.alloc_slot(8192, "t").expect("slot");
    let spec = TensorSpec::new("b.0.w", offload_core::DType::F32, [1024]);
    let layout = BlockLayout { tensors: vec![PlacedTensor { spec, offset: 0, nbytes: 4 }], bytes: 4 };
    let mut params = HashMap::from([("b.0.w".to_string(), Tensor::zeros([1024], (Kind::Float, Device::Cpu)))]);
    let e = sim.bind(&slot, &layout, &mut params).expect_err("a short placement").to_string();
    assert!(e.contains("b.0.w") && e.contains("placed as 4 bytes"), "{e}");
}

/// On the CPU host memory is the device: nothing is page-locked, and a store's
/// pinned bytes say so (a pin budget is not charged for them).
#[test]
fn the_cpu_offload_page_locks_nothing() {
    let (vs, _m) = store(3);
    let mut off = TchOffload::cpu(&vs, "model", &NameDiscovery, &Plan::layerwise()).expect("offload");
    let store = off.ring().store().clone();
    assert!(store.host_bytes() > 0);
    assert_eq!(store.pinned_bytes(), 0, "a CPU store reports page-locked bytes");
}
