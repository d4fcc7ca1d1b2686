//! `TchOffload`: a `VarStore`'s block parameters streamed; enabling completes or leaves it as it was.

#[cfg(feature = "cuda")]
use crate::cuda::{cuda_backend, TchCudaBackend};
use crate::slots::{kind, TchSlots};
use crate::tensors::{tch_err, VarStoreTensors};
use offload_core::sim::{SimBackend, SimConfig};
use offload_core::{resolve, BlockDiscovery, BlockGuard, Error, HostStore, Plan, Result, Ring, StepMetrics, TensorSource};
use std::collections::HashMap;
use std::sync::Arc;
use tch::nn::VarStore;
use tch::{Device, Tensor};

/// A component of a tch model streamed through a [`Ring`]: its block parameters
/// live in the host store and point at the ring's slots only while their block
/// runs.
pub struct TchOffload<B: TchSlots> {
    ring: Ring<B>,
    inventory: offload_core::ComponentInventory,
    binds: Binds,
}

/// The block parameters, their placeholders and which are bound now.
struct Binds {
    params: HashMap<String, Tensor>,
    placeholders: HashMap<String, Tensor>,
    /// Names pointed at a block's weights and not yet pointed back (a forgotten
    /// [`TchBlock`] leaves them here for the next `block` to clear).
    bound: Vec<String>,
}

impl Binds {
    /// Point every bound parameter back at its placeholder. One that fails stays
    /// in `bound` (still a view of the slot), tried again at the next unbind,
    /// so no parameter is forgotten while it can read a slot the ring reuses.
    fn unbind(&mut self) -> Result<()> {
        let mut first = None;
        let mut failed = Vec::new();
        for name in std::mem::take(&mut self.bound) {
            if let (Some(p), Some(e)) = (self.params.get_mut(&name), self.placeholders.get(&name)) {
                if let Err(err) = p.f_set_data(e) {
                    first.get_or_insert(tch_err(format!("pointing {name} back at its placeholder"), err));
                    failed.push(name);
                }
            }
        }
        self.bound = failed;
        first.map_or(Ok(()), Err)
    }
}

impl TchOffload<SimBackend> {
    /// Stream `vs`'s blocks on the CPU (host memory as device: nothing is
    /// page-locked, and the store's pinned bytes say so).
    pub fn cpu(vs: &VarStore, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        Self::new(SimBackend::new(SimConfig { page_locked: false, ..SimConfig::fast() }), vs, component, discovery, plan)
    }
}

#[cfg(feature = "cuda")]
impl TchOffload<TchCudaBackend> {
    /// Stream `vs`'s blocks to CUDA device `ordinal` (libtorch computes on its
    /// default stream; see [`cuda_backend`]).
    pub fn cuda(vs: &VarStore, ordinal: usize, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        Self::new(cuda_backend(ordinal)?, vs, component, discovery, plan)
    }
}

impl<B: TchSlots> TchOffload<B> {
    /// Discover `vs`'s blocks, copy their parameters into the host store of
    /// `backend`, build the ring, then point the parameters at empty placeholders
    /// (so the `VarStore` no longer holds their memory). Non-block variables are
    /// left where they are (move the `VarStore` to the device for them).
    ///
    /// Transactional: on any error the `VarStore` is exactly as it was (every
    /// parameter emptied so far is pointed back at its own data).
    pub fn new(backend: B, vs: &VarStore, component: &str, discovery: &dyn BlockDiscovery, plan: &Plan) -> Result<Self> {
        let source = VarStoreTensors::new(vs)?;
        let mut inventory = discovery.discover(component, source.specs())?;
        inventory.non_block.clear();
        if inventory.stacks.is_empty() {
            return Err(Error::Plan(format!("component {component:?}: no block stacks among the VarStore's variables")));
        }
        let store = Arc::new(HostStore::build(&backend, &inventory, &source)?);
        let rc = resolve(plan, std::slice::from_ref(&inventory))?.components.remove(0);
        let device = backend.tch_device();
        let vars = vs.variables();
        // Everything that can fail before the VarStore is touched.
        let mut staged = Vec::new();
        for b in store.blocks() {
            for t in &b.layout.tensors {
                let name = &t.spec.name;
                let p = vars
                    .get(name)
                    .map(Tensor::shallow_clone)
                    .ok_or_else(|| Error::BadTensor { tensor: name.clone(), fault: "discovered but not in the VarStore".into() })?;
                // A block weight on a third device would meet the slot's in one kernel
                // (a libtorch panic naming nothing); an empty one is most likely a
                // VarStore offloaded already, whose weights are placeholders now.
                if p.device() != Device::Cpu && p.device() != device {
                    return Err(Error::BadTensor {
                        tensor: name.clone(),
                        fault: format!("on {:?}, not the host or {device:?}", p.device()),
                    });
                }

                let empty = Tensor::f_empty([0i64], (kind(&t.spec)?, device)).map_err(|e| tch_err(format!("placeholder for {name}"), e))?;
                let original = p.f_detach().map_err(|e| tch_err(format!("keeping {name}'s data"), e))?;
                staged.push((name.clone(), p, empty, original));
            }
        }
        // Every block variable empty: the VarStore's placeholders, offloaded
        // already (its weights would stream as nothing). One empty parameter in a
        // model is allowed.
        if let Some((name, ..)) = staged.first().filter(|_| staged.iter().all(|(_, p, ..)| p.numel() == 0)) {
            return Err(Error::BadTensor {
                tensor: name.clone(),
                fault: "every block variable is empty: is the VarStore offloaded already? (its weights would stream as nothing)".into(),
            });
        }
        let ring = Ring::new(backend, store, &rc)?;
        let mut params = HashMap::new();
        let mut placeholders = HashMap::new();
        for i in 0..staged.len() {
            let (done, rest) = staged.split_at_mut(i);
            let (name, p, empty, _) = &mut rest[0];
            if let Err(e) = p.f_set_data(empty) {
                // Put back every parameter emptied so far; one that cannot be is
                // named beside the first error, not left empty unseen.
                let mut lost = Vec::new();
                for (n, p, _, original) in done.iter_mut() {
                    if p.f_set_data(original).is_err() {
                        lost.push(n.as_str());
                    }
                }
                let e = tch_err(format!("emptying {name}"), e);
                return Err(match lost.is_empty() {
                    true => e,
                    false => Error::Protocol(format!("{e}; putting back {} failed too: the VarStore is not as it was", lost.join(", "))),
                });
            }
        }
        for (name, p, empty, _) in staged {
            placeholders.insert(name.clone(), empty);
            params.insert(name, p);
        }
        Ok(TchOffload { ring, inventory, binds: Binds { params, placeholders, bound: Vec::new() } })
    }

    /// Block `index` of `stack`: its parameters point at the streamed weights
    /// until the returned block is finished or dropped. If a previous block was
    /// forgotten (`mem::forget`), its parameters are pointed back first and the
    /// ring records its release (`StepMetrics::forgotten_guards`).
    pub fn block(&mut self, stack: &str, index: usize) -> Result<TchBlock<'_, B>> {
        self.binds.unbind()?;
        let guard = self.ring.block(stack, index)?;
        let block = TchBlock { guard: Some(guard), binds: &mut self.binds };
        let g = block.guard.as_ref().ok_or_else(|| Error::Protocol("block guard missing".into()))?;
        // Marked bound before binding, so a bind that fails part way is undone
        // (every name pointed back) when `block` drops.
        block.binds.bound = g.layout().tensors.iter().map(|t| t.spec.name.clone()).collect();
        g.backend().bind(g.slot(), g.layout(), &mut block.binds.params)?;
        Ok(block)
    }

    /// Run the same host store under another plan (another depth, resident set).
    /// The new ring is built before the old one is closed, so both hold slots
    /// for a moment; on error the old ring stays in place.
    pub fn replan(&mut self, plan: &Plan) -> Result<()> {
        let rc = resolve(plan, std::slice::from_ref(&self.inventory))?.components.remove(0);
        let (backend, store) = (self.ring.backend().clone(), self.ring.store().clone());
        let old = std::mem::replace(&mut self.ring, Ring::new(backend, store, &rc)?);
        old.close()
    }

    /// End a step: metrics of the step, and errors deferred by the device.
    pub fn end_step(&mut self) -> Result<StepMetrics> {
        self.ring.end_step()
    }

    /// The ring (metrics, timeline, backend).
    pub fn ring(&mut self) -> &mut Ring<B> {
        &mut self.ring
    }

    /// Release every slot; the host store stays until the last handle drops.
    pub fn close(self) -> Result<()> {
        self.ring.close()
    }
}

/// A block whose parameters point at its slot. Finish it (or drop it) before the
/// next block: its parameters then point at placeholders again and the ring
/// releases the slot after the compute enqueued so far. On CUDA the weights stay
/// valid for whatever still refers to them — views, derived tensors (the
/// transposed weight autograd saves for a `Linear`) — because each is a view of a
/// libtorch buffer that lives as long as they do. A parameter autograd saved
/// itself (a LayerNorm's or GroupNorm's weight, a convolution's kernel, a scale
/// multiplied in) is read when `backward()` runs: after `finish` that is the
/// empty placeholder, and backward fails in libtorch.
pub struct TchBlock<'a, B: TchSlots> {
    guard: Option<BlockGuard<'a, B>>,
    binds: &'a mut Binds,
}

impl<B: TchSlots> TchBlock<'_, B> {
    /// The block's guard (id, layout, slot).
    pub fn guard(&self) -> Option<&BlockGuard<'_, B>> {
        self.guard.as_ref()
    }

    /// Point the parameters back at placeholders and release the block.
    pub fn finish(mut self) -> Result<()> {
        let unbound = self.binds.unbind();
        let released = self.guard.take().map_or(Ok(()), BlockGuard::finish);
        unbound.and(released)
    }
}

impl<B: TchSlots> Drop for TchBlock<'_, B> {
    fn drop(&mut self) {
        let _ = self.binds.unbind();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::DType;
    use tch::{Device, Kind};

    /// `read_into` writes exactly the tensor's bytes, through the view laid over an
    /// aligned destination and through the CPU copy for a misaligned one.
    #[test]
    fn varstore_tensors_read_the_exact_bytes() {
        // Values bf16 holds exactly, so the bytes expected are their f32 bits' top halves,
        // known without libtorch.
        let values: Vec<f32> = (0..15).map(|k| (k as f32 - 7.0) * 0.375).collect();
        let want: Vec<u8> = values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        let mut vs = VarStore::new(Device::Cpu);
        let _ = vs.root().var_copy("w", &tch::Tensor::from_slice(&values).reshape([3, 5]));
        vs.set_kind(Kind::BFloat16);
        let src = VarStoreTensors::new(&vs).unwrap();
        assert_eq!(src.specs[0].dtype, DType::BF16);
        let mut buf = [0u8; 32];
        let aligned = buf.as_ptr() as usize % 2;
        for off in [aligned, 1 - aligned] {
            buf.fill(0);
            src.read_into(0, &mut buf[off..off + 30]).unwrap();
            assert_eq!(&buf[off..off + 30], &want[..], "destination offset {off}");
        }
        assert!(src.read_into(0, &mut buf[..29]).unwrap_err().to_string().contains("29 bytes"));
    }

    /// A VarStore offloaded already holds empty placeholders where its block
    /// weights were: offloading it again is refused by name, not accepted as
    /// blocks of nothing that the model's forward then fails on.
    #[test]
    fn offloading_a_varstore_twice_is_refused() {
        let vs = VarStore::new(Device::Cpu);
        for i in 0..2 {
            let _ = vs.root().sub("blocks").sub(i.to_string()).var("w", &[4, 4], tch::nn::Init::Randn { mean: 0.0, stdev: 1.0 });
        }
        let plan = Plan::layerwise();
        let first = TchOffload::cpu(&vs, "m", &offload_core::NameDiscovery, &plan).expect("the first offload");
        let e = TchOffload::cpu(&vs, "m", &offload_core::NameDiscovery, &plan).err().expect("a second offload").to_string();
        assert!(e.contains("blocks.0.w") && e.contains("offloaded already"), "{e}");
        drop(first);
    }
}
