//! The Rust engine of the `offload` Python package (`offload._offload`): the host
//! store, the ring, the plan and the metrics of one component of a
//! `torch.nn.Module`, behind a small class the package's hooks call. The Python
//! side (`python/offload/`) finds the blocks, points parameters at the streamed
//! bytes and restores the module; everything else is here or below.
//!
//! No libtorch is linked: tensors cross as DLPack capsules (host weights, slot
//! buffers) and streams as `CUstream` handles, so one abi3 wheel serves any
//! torch 2.x.

mod cuda;
mod dlpack;

use offload_core::sim::{SimBackend, SimConfig};
use offload_core::HostBuffer as _;
use offload_core::{
    resolve, BlockDiscovery, ComponentInventory, ComponentPlan, DType, DeclaredStacks, Error, HostStore, OffloadBackend, PinFallback,
    PinOptions, Plan, Result, Ring, TensorSource, TensorSpec,
};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

pyo3::create_exception!(
    _offload,
    OffloadError,
    PyRuntimeError,
    "An error of the offload engine; its message names the tensor, block or component at fault."
);

/// An [`OffloadError`] with `msg`.
pub(crate) fn error(msg: impl Into<String>) -> PyErr {
    OffloadError::new_err(msg.into())
}

std::thread_local! {
    /// A `KeyboardInterrupt` or `SystemExit` raised inside a Python call the
    /// engine made (a progress callback, torch's allocation), kept here to be
    /// raised again as itself: the engine's error carries only its text, and a
    /// caller's `except Exception` must not swallow Ctrl-C.
    static INTERRUPT: std::cell::RefCell<Option<PyErr>> = const { std::cell::RefCell::new(None) };
}

/// Keep `e` to be raised again as itself ([`INTERRUPT`]) where it is not an
/// `Exception` (`KeyboardInterrupt`, `SystemExit`); returns it either way.
pub(crate) fn keep_interrupt(py: Python<'_>, e: PyErr) -> PyErr {
    if !e.is_instance_of::<pyo3::exceptions::PyException>(py) {
        INTERRUPT.with(|k| *k.borrow_mut() = Some(e.clone_ref(py)));
    }
    e
}

fn py_err(component: &str, e: Error) -> PyErr {
    // An interrupt raised inside the call that failed is raised again as itself.
    if let Some(kept) = INTERRUPT.with(|k| k.borrow_mut().take()) {
        return kept;
    }
    error(format!("component {component:?}: {e}"))
}

/// Block tensors handed over as host torch tensors, read once each into the
/// host store (through a DLPack capsule made at the read), with the bytes read
/// reported to `progress`.
struct CapsuleTensors<'py> {
    specs: Vec<TensorSpec>,
    tensors: Vec<Bound<'py, PyAny>>,
    progress: Option<Bound<'py, PyAny>>,
    total: u64,
    done: std::cell::Cell<u64>,
}

impl TensorSource for CapsuleTensors<'_> {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let name = &self.specs[index].name;
        let py = self.tensors[index].py();
        dlpack::read_host(&self.tensors[index], name, self.specs[index].dtype, dst)
            .map_err(|e| Error::BadTensor { tensor: name.clone(), fault: keep_interrupt(py, e).to_string() })?;
        let done = self.done.get() + dst.len() as u64;
        self.done.set(done);
        if let Some(p) = &self.progress {
            p.call1((done, self.total))
                .map_err(|e| Error::BadTensor { tensor: name.clone(), fault: format!("progress callback: {}", keep_interrupt(py, e)) })?;
        }
        Ok(())
    }
    fn origin(&self) -> String {
        "the module's parameters".into()
    }
}

/// A block's layout as the package reads it: stack, index, `(tensor, offset, bytes)`.
type BlockLayoutRow = (String, usize, Vec<(String, usize, usize)>);

enum AnyRing {
    Cpu(Ring<SimBackend>),
    Cuda(Ring<cuda::PyCuda>),
}

macro_rules! with_ring {
    ($self:expr, $r:ident => $e:expr) => {
        match $self {
            AnyRing::Cpu($r) => $e,
            AnyRing::Cuda($r) => {
                let _keep = cuda::KeepContext::new();
                $e
            }
        }
    };
}

impl AnyRing {
    /// An error while the compute stream is captured into a CUDA graph (the
    /// copies and waits a call issues would be captured and replayed); none on
    /// the simulated device.
    fn refuse_capture(&self) -> Result<()> {
        match self {
            AnyRing::Cpu(_) => Ok(()),
            AnyRing::Cuda(r) => r.backend().refuse_capture(),
        }
    }

    /// `probe_bandwidth` over this ring's store, `passes` passes, capture
    /// refused, its copies and host synchronisations with the GIL released
    /// (compute another thread queues meanwhile delays them: probe with the
    /// device otherwise idle).
    fn probe(&mut self, py: Python<'_>, passes: usize) -> Result<f64> {
        self.refuse_capture()?;
        py.detach(|| with_ring!(self, r => offload_core::probe_bandwidth(r.backend(), r.store(), passes)))
    }
}

/// The plan a ring runs, and why.
#[derive(Clone)]
struct Planned {
    depth: usize,
    resident: Vec<String>,
    /// `"given"`, `"budget"` (the planner under `budget_gib`) or `"auto"`.
    chosen_by: &'static str,
    why: String,
}

/// One component's blocks streamed through a ring: built from the module's
/// block tensors, asked for a block before its forward and given it back after.
#[pyclass(module = "offload._offload")]
struct Streamer {
    component: String,
    /// The plan the ring runs: its depth and the blocks it keeps resident.
    planned: Mutex<Planned>,
    /// Taken with `try_lock` only: a call from a second thread while another is
    /// inside (which may wait for the GIL the first released) is an error, never a deadlock.
    ring: Mutex<Option<AnyRing>>,
}

fn dtype(name: &str, tensor: &str) -> PyResult<DType> {
    DType::parse(name).ok_or_else(|| error(format!("tensor {tensor:?}: dtype {name} cannot be streamed")))
}

fn build<B: OffloadBackend>(
    backend: B,
    component: &str,
    inventory: &ComponentInventory,
    source: &CapsuleTensors<'_>,
    checkpoint: Option<&str>,
    plan: &Plan,
) -> Result<Ring<B>> {
    let rc = resolve(plan, std::slice::from_ref(inventory))?.components.remove(0);
    let pin = PinOptions::from_plan(plan.for_component(component));
    let store = match checkpoint {
        Some(path) => {
            let file = offload_cuda::map_checkpoint(path)?;
            check_same(&file, source)?;
            HostStore::build_mapped(&backend, inventory, &file, pin)?
        }
        None => HostStore::build_with(&backend, inventory, source, pin)?,
    };
    Ring::new(backend, Arc::new(store), &rc)
}

/// Every streamed tensor is in the checkpoint with the module's dtype and shape,
/// and where the module holds its weights (not built on the meta device), with
/// its bytes: the store serves the file's, and `disable` gives them back to the
/// module, so a fine-tuned or fused module given its base model's file would
/// otherwise compute with, and end up holding, the file's weights.
fn check_same(file: &offload_core::SafetensorsFile, module: &CapsuleTensors<'_>) -> Result<()> {
    let (mut mine, mut theirs) = (Vec::new(), Vec::new());
    for (i, s) in module.specs.iter().enumerate() {
        let Some(at) = file.specs().iter().position(|f| f.name == s.name) else {
            return Err(Error::BadTensor { tensor: s.name.clone(), fault: format!("not in {}", file.path().display()) });
        };
        let f = &file.specs()[at];
        if f.dtype != s.dtype || f.shape != s.shape {
            return Err(Error::BadTensor {
                tensor: s.name.clone(),
                fault: format!("{:?} {:?} in the module, {:?} {:?} in {}", s.dtype, s.shape, f.dtype, f.shape, file.path().display()),
            });
        }
        let tensor = &module.tensors[i];
        if tensor.is_none() {
            continue;
        }
        let n = s.nbytes()?;
        mine.resize(n, 0);
        theirs.resize(n, 0);
        dlpack::read_host(tensor, &s.name, s.dtype, &mut mine)
            .map_err(|e| Error::BadTensor { tensor: s.name.clone(), fault: keep_interrupt(tensor.py(), e).to_string() })?;
        file.read_into(at, &mut theirs)?;
        if mine != theirs {
            return Err(Error::BadTensor {
                tensor: s.name.clone(),
                fault: format!(
                    "the module's bytes differ from {}'s (give the file the module was loaded from, or build the module on the meta device)",
                    file.path().display()
                ),
            });
        }
    }
    Ok(())
}

#[pymethods]
impl Streamer {
    /// Build the host store and the ring of `component`.
    ///
    /// `tensors`: `(name, dtype, shape, tensor)` for every block tensor, the
    /// tensor a dense host tensor. `stacks`: the block lists' prefixes
    /// (`"transformer_blocks"`). `device`: `None` for the simulated device in
    /// host memory, else a CUDA ordinal with torch's compute stream `stream` (a
    /// `torch.cuda.Stream`). `checkpoint`: a safetensors file holding the same
    /// tensors, served mapped in place (the tensors given are then not read: a
    /// module built on the meta device gives `None` for each).
    #[new]
    /// `calibration`: a cost model as [`calibration`](Self::calibration) writes
    /// it (JSON): with `budget_bytes`, the planner replays the ring with its
    /// measured compute times and bandwidth, choosing the depth and the resident
    /// blocks that make the step shortest.
    #[pyo3(signature = (component, tensors, stacks, *, device=None, stream=None, depth=1, budget_bytes=None, resident_blocks=Vec::new(), coded=false, pin_budget_bytes=None, pageable_fallback=false, checkpoint=None, progress=None, calibration=None))]
    #[allow(clippy::too_many_arguments)]
    fn new<'py>(
        py: Python<'py>,
        component: String,
        tensors: Vec<(String, String, Vec<usize>, Bound<'py, PyAny>)>,
        stacks: Vec<String>,
        device: Option<usize>,
        stream: Option<Bound<'py, PyAny>>,
        depth: usize,
        budget_bytes: Option<u64>,
        resident_blocks: Vec<String>,
        coded: bool,
        pin_budget_bytes: Option<u64>,
        pageable_fallback: bool,
        checkpoint: Option<String>,
        progress: Option<Bound<'py, PyAny>>,
        calibration: Option<String>,
    ) -> PyResult<Self> {
        let _ = py;
        INTERRUPT.with(|k| k.borrow_mut().take());
        let mut tensors = tensors;
        if let Some(path) = checkpoint.as_deref() {
            // Each block laid out in the file's order, so that a block whose tensors
            // lie in the file as the store lays them out is served in place.
            let file = offload_core::SafetensorsFile::open(path).map_err(|e| py_err(&component, e))?;
            let at: std::collections::HashMap<&str, u64> =
                file.specs().iter().enumerate().map(|(i, s)| (s.name.as_str(), file.data_offset(i))).collect();
            tensors.sort_by_key(|t| at.get(t.0.as_str()).copied().unwrap_or(u64::MAX));
        }
        let mut specs = Vec::with_capacity(tensors.len());
        let mut held = Vec::with_capacity(tensors.len());
        for (name, dt, shape, tensor) in tensors {
            specs.push(TensorSpec::new(name.clone(), dtype(&dt, &name)?, shape));
            held.push(tensor);
        }
        let total = specs.iter().fold(0u64, |a, s| a.saturating_add(s.nbytes().unwrap_or(0) as u64));
        let inventory = DeclaredStacks::new(stacks).discover(&component, &specs).map_err(|e| py_err(&component, e))?;
        if inventory.stacks.is_empty() {
            return Err(error(format!("component {component:?}: none of its tensors is in a block list")));
        }
        let source = CapsuleTensors { specs, tensors: held, progress, total, done: Default::default() };
        // Under a budget with no blocks named, the planner keeps the blocks that save
        // the most: with a calibration, the step its replay predicts shortest (the
        // depth too); without one (no compute time known) the most streamed bytes,
        // planning for a transfer-bound step whatever the bandwidth.
        let calibrated = calibration.map(|c| calibrated_model(&component, &inventory, &c)).transpose()?;
        if calibrated.is_some() && coded {
            return Err(error(format!(
                "component {component:?}: a calibration plans a ring that is not coded (its cost model has no decode time and no staging buffers): give coded=False"
            )));
        }
        if calibrated.is_some() && (budget_bytes.is_none() || !resident_blocks.is_empty()) {
            return Err(error(format!(
                "component {component:?}: a calibration plans under a device budget with no blocks named resident (give budget_gib, not resident_blocks)"
            )));
        }
        let mut why = "as given".to_owned();
        let (depth, resident_blocks) = match budget_bytes {
            Some(budget) if resident_blocks.is_empty() => {
                let model = match calibrated {
                    Some(m) => m,
                    None => offload_plan::CostModel::from_inventory(&inventory, 25e9).map_err(|e| py_err(&component, e))?,
                };
                let choice = offload_plan::plan(&model, budget, depth.max(1), offload_core::ResidentPolicy::Auto)
                    .map_err(|e| py_err(&component, e))?;
                let timed = model.compute_s() > 0.0;
                let depth = if timed { choice.depth } else { depth };
                let resident: Vec<String> = choice.resident_ids(&model).into_iter().map(str::to_owned).collect();
                why = match timed {
                    true => format!(
                        "the planner under a device budget of {budget} bytes, replaying the calibration's compute times and \
                         {:.1} GB/s link{}: depth {depth} and {} block(s) resident predict a {:.4} s step (resident: {:.4} s)",
                        model.bandwidth_bytes_per_s / 1e9,
                        if model.trains() { " over a training step (a forward, then a backward streaming each block again)" } else { "" },
                        resident.len(),
                        choice.predicted_step_s,
                        choice.resident_step_s
                    ),
                    false => format!(
                        "the planner under a device budget of {budget} bytes, by bytes alone (no calibration: a copy-bound \
                         step assumed): the {} block(s) saving the most streamed bytes resident, depth {depth} as given",
                        resident.len()
                    ),
                };
                (depth, resident)
            }
            _ => (depth, resident_blocks),
        };
        // Each block as the engine names it (`blocks.01` is block `blocks.1`).
        let named = |s: &String| offload_core::BlockId::parse(s).map_or_else(|| s.clone(), |id| id.to_string());
        let chosen_by = if why == "as given" { "given" } else { "budget" };
        let planned = Mutex::new(Planned { depth, resident: resident_blocks.iter().map(named).collect(), chosen_by, why });
        let plan = Plan {
            default: ComponentPlan {
                prefetch_depth: depth,
                device_budget_bytes: budget_bytes,
                resident_blocks,
                coded,
                host_pin_budget_bytes: pin_budget_bytes,
                pin_fallback: if pageable_fallback { PinFallback::Pageable } else { PinFallback::Fail },
                ..ComponentPlan::default()
            },
            ..Plan::default()
        };
        let ck = checkpoint.as_deref();
        let ring = match device {
            None => {
                // The simulated device serves a checkpoint's blocks from the mapped
                // file as the CUDA one does (its host memory takes mapped regions).
                // OFFLOAD_SIM_LINK_BYTES_PER_S gives the simulated link a rate (its
                // copies then take time, as a device's do: for tests of the diagnosis).
                let link = std::env::var("OFFLOAD_SIM_LINK_BYTES_PER_S").ok().and_then(|v| v.parse::<f64>().ok());
                let sim = SimBackend::new(SimConfig { registers_regions: true, link_bytes_per_s: link, ..SimConfig::fast() });
                AnyRing::Cpu(build(sim, &component, &inventory, &source, ck, &plan).map_err(|e| py_err(&component, e))?)
            }
            Some(ordinal) => {
                let _keep = cuda::KeepContext::new();
                let stream = stream.ok_or_else(|| error(format!("component {component:?}: a CUDA device needs torch's compute stream")))?;
                let backend = cuda::PyCuda::new(ordinal, stream).map_err(|e| py_err(&component, e))?;
                if coded {
                    backend.cuda().enable_coding(Default::default()).map_err(|e| py_err(&component, e))?;
                }
                AnyRing::Cuda(build(backend, &component, &inventory, &source, ck, &plan).map_err(|e| py_err(&component, e))?)
            }
        };
        Ok(Streamer { component, planned, ring: Mutex::new(Some(ring)) })
    }

    /// Every block: `(stack, index, [(tensor name, byte offset, bytes)])`, in store order.
    fn layouts(&self) -> PyResult<Vec<BlockLayoutRow>> {
        let mut held = self.held()?;
        Ok(with_ring!(held.ring()?, r => r
            .store()
            .blocks()
            .iter()
            .map(|b| (b.id.stack.clone(), b.id.index, b.layout.tensors.iter().map(|t| (t.spec.name.clone(), t.offset, t.nbytes)).collect()))
            .collect()))
    }

    /// Lend block `index` of `stack`: ready for compute on the engine's stream.
    /// Returns its bytes: on CUDA the slot's torch buffer (`uint8`), on the
    /// simulated device a fresh `bytearray` copy of the slot. With `keep`, the
    /// caller keeps the block on the device for good (`hold_outside` follows):
    /// the learned order is not taught by this lend.
    #[pyo3(signature = (stack, index, keep = false))]
    fn lend(&self, py: Python<'_>, stack: &str, index: usize, keep: bool) -> PyResult<Py<PyAny>> {
        let component = self.component.clone();
        let mut held = self.held()?;
        let ring = held.ring()?;
        let fail = |e| py_err(&component, e);
        ring.refuse_capture().map_err(fail)?;
        match ring {
            AnyRing::Cpu(r) => {
                (if keep { r.lend_to_keep(stack, index) } else { r.lend(stack, index) }).map_err(fail)?;
                let (_, _, slot) = r.lent().ok_or_else(|| error("no block lent"))?;
                let bytes = r.backend().read_slot(slot, <[u8]>::to_vec);
                Ok(PyByteArray::new(py, &bytes).into_any().unbind())
            }
            AnyRing::Cuda(r) => {
                (if keep { r.lend_to_keep(stack, index) } else { r.lend(stack, index) }).map_err(fail)?;
                let (id, _, slot) = r.lent().ok_or_else(|| error("no block lent"))?;
                r.backend().note_read(slot);
                slot.buffer().map(|b| b.clone_ref(py)).ok_or_else(|| error(format!("component {component:?}: block {id} has no buffer")))
            }
        }
    }

    /// The buffers the ring's slots hold now (on CUDA the torch buffers lent
    /// from them: a lent buffer among these is the ring's own, one outside them
    /// still alive is kept by something else). None on the simulated device,
    /// which lends a fresh copy each time and holds none of them.
    fn held_buffers(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let mut held = self.held()?;
        Ok(match held.ring()? {
            AnyRing::Cpu(_) => Vec::new(),
            AnyRing::Cuda(r) => r.slots().filter_map(|s| s.buffer().map(|b| b.clone_ref(py))).collect(),
        })
    }

    /// Block `index` of `stack` as the host store holds it, read back on the host
    /// (decoded where it is held coded; through the file where it is mapped): a
    /// `bytearray` laid out as [`layouts`](Self::layouts) says. For putting the
    /// module back on disable; never on the streaming path.
    fn block_bytes(&self, py: Python<'_>, stack: &str, index: usize) -> PyResult<Py<PyAny>> {
        let component = self.component.clone();
        let mut held = self.held()?;
        let ring = held.ring()?;
        let id = offload_core::BlockId::new(stack, index);
        let b = with_ring!(&*ring, r => r.store().position(&id));
        let b = b.ok_or_else(|| error(format!("component {component:?}: no block {id}")))?;
        // The read (a file's pages, a decode) runs with the GIL released.
        let bytes = py.detach(|| {
            with_ring!(ring, r => {
                let store = r.store().clone();
                store.with_buffer(r.backend(), &store.blocks()[b], |buf| buf.block_bytes().map(<[u8]>::to_vec))
            })
        });
        Ok(PyByteArray::new(py, &bytes.map_err(|e| py_err(&component, e))?).into_any().unbind())
    }

    /// Give the lent block back: its slot is reused once the compute submitted so far has run.
    fn give_back(&self) -> PyResult<()> {
        let component = self.component.clone();
        let mut held = self.held()?;
        let ring = held.ring()?;
        // Giving back issues the next copies.
        ring.refuse_capture().map_err(|e| py_err(&component, e))?;
        with_ring!(ring, r => r.give_back()).map_err(|e| py_err(&component, e))
    }

    /// End a step: its metrics as a JSON object (`StepMetrics`).
    fn end_step(&self) -> PyResult<String> {
        let component = self.component.clone();
        let m = with_ring!(self.held()?.ring()?, r => r.end_step()).map_err(|e| py_err(&component, e))?;
        serde_json::to_string(&m).map_err(|e| error(e.to_string()))
    }

    /// Record device-timed spans of both streams from now on.
    fn enable_timeline(&self) -> PyResult<()> {
        let component = self.component.clone();
        with_ring!(self.held()?.ring()?, r => r.enable_timeline()).map_err(|e| py_err(&component, e))
    }

    /// Blocks (`[(stack, index), ...]`) held on the device by the caller from
    /// now on (each kept from a lent copy): never prefetched again; the next
    /// step's first streamed blocks copied ahead now.
    fn hold_outside(&self, blocks: Vec<(String, usize)>) -> PyResult<()> {
        let component = self.component.clone();
        with_ring!(self.held()?.ring()?, r => r.hold_outside(&blocks)).map_err(|e| py_err(&component, e))
    }

    /// Whether the blocks are now asked for by a backward pass (each pass
    /// learns its own order; the next steps' metrics say which pass).
    fn set_backward(&self, backward: bool) -> PyResult<()> {
        let component = self.component.clone();
        with_ring!(self.held()?.ring()?, r => r.set_backward(backward)).map_err(|e| py_err(&component, e))
    }

    /// Stop recording the timeline.
    fn disable_timeline(&self) -> PyResult<()> {
        with_ring!(self.held()?.ring()?, r => r.disable_timeline());
        Ok(())
    }

    /// Why the last traced step was slower than its bound, as JSON (`Diagnosis`),
    /// against `link_bytes_per_s` where given; `None` before a traced step ended.
    #[pyo3(signature = (link_bytes_per_s=None))]
    fn diagnose(&self, link_bytes_per_s: Option<f64>) -> PyResult<Option<String>> {
        let d = with_ring!(self.held()?.ring()?, r => r.diagnose(link_bytes_per_s));
        d.map(|d| serde_json::to_string(&d).map_err(|e| error(e.to_string()))).transpose()
    }

    /// Write the timeline's Chrome trace (Perfetto opens it); the last step ended.
    fn write_trace(&self, path: &str) -> PyResult<()> {
        let tl = with_ring!(self.held()?.ring()?, r => r.timeline().cloned());
        let tl = tl.ok_or_else(|| error(format!("component {:?}: no timeline (enable_trace first)", self.component)))?;
        tl.write_chrome_trace(path).map_err(|e| error(format!("writing {path}: {e}")))
    }

    /// Host-to-device bandwidth, bytes per second: every block held in memory
    /// copied into one slot, `passes` times, the best pass (as the bench room's
    /// Rust drivers measure it; synchronises the host, so call it between steps).
    /// It runs with the GIL released: compute another thread queues on the
    /// device meanwhile delays its copies and lowers the figure (and a
    /// calibration planned from it), so probe with the device otherwise idle.
    fn probe_bandwidth(&self, py: Python<'_>, passes: usize) -> PyResult<f64> {
        self.held()?.ring()?.probe(py, passes).map_err(|e| py_err(&self.component, e))
    }

    /// Host bytes the store holds, and how many of them are page-locked.
    fn host_bytes(&self) -> PyResult<(u64, u64)> {
        Ok(with_ring!(self.held()?.ring()?, r => (r.store().host_bytes(), r.store().pinned_bytes())))
    }

    /// How the store holds the blocks: `(served in place from the checkpoint,
    /// copied into the store's own memory, why any was copied)`.
    fn host_tier(&self) -> PyResult<(usize, usize, Option<String>)> {
        Ok(with_ring!(self.held()?.ring()?, r => {
            let t = r.store().tier();
            (t.mapped, t.copied, t.copy_reason.clone())
        }))
    }

    /// Violations of the ring's protocol the CUDA engine saw (none on the simulated device, which fails instead).
    fn violations(&self) -> PyResult<Vec<String>> {
        Ok(match self.held()?.ring()? {
            AnyRing::Cpu(r) => r.backend().check().err().map(|e| vec![e.to_string()]).unwrap_or_default(),
            AnyRing::Cuda(r) => r.backend().violations(),
        })
    }

    /// The device's counters since the ring was built: host synchronisations
    /// (`syncs`), copies, bytes copied, slot bytes live and at peak.
    fn counters(&self) -> PyResult<Vec<(&'static str, u64)>> {
        let c = match self.held()?.ring()? {
            AnyRing::Cpu(r) => {
                let s = r.backend().stats();
                [s.syncs, s.copies, s.bytes_copied, s.live_bytes, s.peak_bytes]
            }
            AnyRing::Cuda(r) => {
                let c = r.backend().counters();
                [c.syncs, c.copies, c.bytes_copied, c.live_bytes, c.peak_bytes]
            }
        };
        Ok(["syncs", "copies", "bytes_copied", "live_bytes", "peak_bytes"].into_iter().zip(c).collect())
    }

    /// The plan the ring runs: `(depth, resident block names, chosen by, why)`.
    fn plan(&self) -> (usize, Vec<String>, String, String) {
        let p = self.planned.lock().unwrap_or_else(|e| e.into_inner()).clone();
        (p.depth, p.resident, p.chosen_by.to_owned(), p.why)
    }

    /// Choose the prefetch depth from the traced steps (the default when no
    /// depth is given: the second step alone): each block's median compute span
    /// and the last step's copies' rate
    /// replayed at depths 1 to `max_depth` (`offload_plan`'s replay of the
    /// ring), the smallest depth within 1 % of the shortest predicted step, no
    /// deeper than a quarter of the device's free memory allows for the extra
    /// slots. The ring is rebuilt at that depth if it differs. Returns the
    /// depth chosen and why.
    fn choose_depth(&self, max_depth: usize) -> PyResult<(usize, String)> {
        let component = self.component.clone();
        let mut held = self.held()?;
        let ring = held.ring()?;
        let (now, model, largest, free, late_first) = with_ring!(&*ring, r => {
            let Some(d) = r.diagnose(None) else {
                return Err(error(format!("component {component:?}: no traced step to choose a depth from")));
            };
            // The diagnosed step, in the order the device ran its blocks, with
            // its edges: the gap since the step before (traced too: the
            // timeline starts at `enable` when the depth is the package's to
            // choose) and how long before the device reached each block the
            // host asked for it. Not on a backend whose compute runs on the
            // host (the simulated device): its host is never ahead of its
            // device, and the edges say nothing there.
            let edges = !r.backend().compute_on_host();
            let (order, gap, leads) = match r.timeline() {
                Some(t) => {
                    let step = t.spans.iter().filter(|s| s.stream == "compute" && !s.backward).map(|s| s.step).max().unwrap_or(0);
                    let gap = if edges { t.step_gap_s(step).unwrap_or(0.0) } else { 0.0 };
                    (t.step_blocks(step), gap, if edges { t.ask_leads(step) } else { Vec::new() })
                }
                None => (Vec::new(), 0.0, Vec::new()),
            };
            let bandwidth = if d.copy_s > 0.0 { d.copy_bytes as f64 / d.copy_s } else { 0.0 };
            let store = r.store().blocks();
            let cost = |id: &str, t: f64| {
                let bytes = store.iter().find(|b| b.id.to_string() == id).map_or(0, |b| b.link_bytes() as u64);
                let mut c = offload_plan::BlockCost::new(id, bytes, t);
                c.ask_lead_s = leads.iter().find(|(b, _)| b == id).map(|(_, l)| *l);
                c
            };
            let mut blocks: Vec<offload_plan::BlockCost> = order.iter().map(|(id, t)| cost(id, *t)).collect();
            // A block the step did not run (a cache skipped it) computes nothing.
            for b in store {
                let id = b.id.to_string();
                if !order.iter().any(|(o, _)| *o == id) {
                    blocks.push(cost(&id, 0.0));
                }
            }
            // A training loop (a backward traced before this forward, every
            // block in it): the replay runs the forward, then the backward in
            // reverse with each block's backward time (its recompute's with it).
            let back = r.timeline().map(last_backward_sums).unwrap_or_default();
            // A backward that skipped blocks (frozen ones, a cache's) is not
            // replayed: the forward alone, as before any backward.
            if !back.is_empty() && blocks.iter().all(|b| back.contains_key(&b.id)) {
                blocks = blocks.into_iter().map(|b| { let t = back[&b.id]; b.with_backward(t) }).collect();
            }
            let late_first = match (order.first(), leads.first()) {
                (Some((first, _)), Some((led, lead))) if first == led && *lead < gap => Some(*lead),
                _ => None,
            };
            let largest = store.iter().map(|b| b.bytes() as u64).max().unwrap_or(0);
            let free = r.backend().memory_info().map(|m| m.free).ok();
            let model = offload_plan::CostModel {
                bandwidth_bytes_per_s: bandwidth,
                blocks,
                non_block_bytes: 0,
                source: format!("component {component:?}, a traced step"),
                staging_buffers: offload_plan::DEFAULT_STAGING_BUFFERS,
                step_gap_s: gap,
            };
            (r.depth(), model, largest, free, late_first)
        });
        if model.bandwidth_bytes_per_s <= 0.0 {
            let why = "depth kept: the traced step copied nothing".to_owned();
            self.set_planned(now, why.clone(), "auto");
            return Ok((now, why));
        }
        let n = model.blocks.len();
        // Short of a ring holding every block, which would never copy again.
        let top = max_depth.clamp(1, offload_core::MAX_PREFETCH_DEPTH).min(n.saturating_sub(2).max(1));
        let none = vec![false; n];
        let predicted: Vec<f64> = (1..=top).map(|d| model.simulate_s(&none, d)).collect();
        let best = predicted.iter().copied().fold(f64::INFINITY, f64::min);
        let mut depth = predicted.iter().position(|p| *p <= best * 1.01).map_or(now, |i| i + 1);
        // A step whose first block the host asks for only as the device gets
        // there (a forward that synchronises the host before its first block)
        // with a gap of the model's own work before it: what the model does
        // in the gap (its own host-to-device copies, queued behind the ring's
        // copies in flight) the replay does not see. One block more copied
        // ahead keeps the link busy through it (Lumina2 on an H100: 1.019 ×
        // its bound at depth 2, 1.000 at depth 3; bench/NOTES.md).
        let mut edge = String::new();
        if let Some(lead) = late_first.filter(|_| model.step_gap_s >= 0.01 * best && depth < top) {
            depth += 1;
            edge = format!(
                "; one deeper for the step's edge: {:.2} ms of the model's own work before the first block, which the host asked \
                 for only {:.2} ms before the device got there",
                model.step_gap_s * 1e3,
                lead * 1e3
            );
        }
        let mut memory = String::new();
        if let Some(free) = free {
            while depth > now && (depth - now) as u64 * largest > free / 4 {
                depth -= 1;
                memory = format!(
                    "; deeper is predicted faster, but its slots would take more than a quarter of the {:.1} GiB free",
                    free as f64 / (1u64 << 30) as f64
                );
            }
        }
        let list = predicted.iter().enumerate().map(|(i, p)| format!("{}: {p:.4} s", i + 1)).collect::<Vec<_>>().join(", ");
        let what = if model.trains() { "a traced training step (a forward, then its backward in reverse)" } else { "a traced step" };
        let mut why = format!(
            "depth {depth}, chosen from {what}: its blocks' compute ({:.4} s) and copies ({:.2} GiB at {:.1} GB/s) replayed \
             at each depth predict {list}; the smallest depth within 1 % of the shortest{edge}{memory}",
            model.compute_s(),
            model.blocks.iter().map(|b| b.bytes).sum::<u64>() as f64 / (1u64 << 30) as f64,
            model.bandwidth_bytes_per_s / 1e9
        );
        if depth != now {
            let taken = held.guard.take().ok_or_else(|| error(format!("component {component:?}: closed")))?;
            let rebuilt = match taken {
                AnyRing::Cpu(r) => r.at_depth(depth).map(AnyRing::Cpu),
                AnyRing::Cuda(r) => {
                    let _keep = cuda::KeepContext::new();
                    r.at_depth(depth).map(AnyRing::Cuda)
                }
            };
            let ring = rebuilt.map_err(|e| py_err(&component, e))?;
            let got = with_ring!(&ring, r => r.depth());
            *held.guard = Some(ring);
            if got != depth {
                why = format!("depth {got} kept: the slots of depth {depth} could not be allocated ({why})");
                depth = got;
            }
        }
        self.set_planned(depth, why.clone(), "auto");
        Ok((depth, why))
    }

    /// This ring's cost model as JSON (`offload_plan::CostModel`, what
    /// `calibration=` takes): each block's bytes, its compute time and the
    /// link's bandwidth (probed now: it synchronises). Compute times come from
    /// `compute_s` (`{block: seconds}`, every block named) or else from the
    /// forward steps traced since `enable_timeline` (each block's median).
    /// Backward times (a training step: the backward brings every block again)
    /// come from `backward_s`, or else from the traced backward steps where
    /// every block ran in one; with neither, the model is a forward's. A coded
    /// ring is refused: its copies are not its blocks' bytes at the link's rate.
    #[pyo3(signature = (compute_s=None, backward_s=None))]
    fn calibration(
        &self,
        py: Python<'_>,
        compute_s: Option<std::collections::HashMap<String, f64>>,
        backward_s: Option<std::collections::HashMap<String, f64>>,
    ) -> PyResult<String> {
        let component = self.component.clone();
        let mut held = self.held()?;
        let ring = held.ring()?;
        if with_ring!(&*ring, r => r.store().coded_blocks()) > 0 {
            return Err(error(format!("component {component:?}: calibrate a ring that is not coded (coded=False): a coded copy is not its block's bytes at the link's rate")));
        }
        let bandwidth = ring.probe(py, 3).map_err(|e| py_err(&component, e))?;
        let model = with_ring!(ring, r => {
            let traced = r.timeline().map(|t| compute_medians(t, false)).unwrap_or_default();
            let traced_back = r.timeline().map(|t| compute_medians(t, true)).unwrap_or_default();
            let every = r.store().blocks().iter().all(|b| traced_back.contains_key(&b.id.to_string()));
            let mut blocks = Vec::with_capacity(r.store().blocks().len());
            for b in r.store().blocks() {
                let id = b.id.to_string();
                let t = match &compute_s {
                    Some(given) => given.get(&id).copied().ok_or_else(|| error(format!("component {component:?}: block {id} has no time in compute_s")))?,
                    None => traced.get(&id).copied().ok_or_else(|| {
                        error(format!("component {component:?}: block {id} ran in no traced step (enable_trace, then run a step; CUDA only), or give compute_s"))
                    })?,
                };
                let back = match &backward_s {
                    Some(given) => Some(given.get(&id).copied().ok_or_else(|| error(format!("component {component:?}: block {id} has no time in backward_s")))?),
                    None => traced_back.get(&id).copied().filter(|_| every),
                };
                for (what, t) in [("compute", Some(t)), ("backward", back)] {
                    if let Some(t) = t.filter(|t| !(t.is_finite() && *t >= 0.0)) {
                        return Err(error(format!("component {component:?}: block {id}: {what} time {t} s")));
                    }
                }
                let cost = offload_plan::BlockCost::new(id, b.bytes() as u64, t);
                blocks.push(match back { Some(s) => cost.with_backward(s), None => cost });
            }
            offload_plan::CostModel { bandwidth_bytes_per_s: bandwidth, blocks, non_block_bytes: 0, source: format!("component {component:?}"), staging_buffers: offload_plan::DEFAULT_STAGING_BUFFERS, step_gap_s: 0.0 }
        });
        Ok(model.to_json())
    }

    /// Close the ring: every slot freed after its last use, the host store dropped.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let component = self.component.clone();
        let taken = self.held()?.guard.take();
        match taken {
            // The device drained and the files re-checked with the GIL released (a
            // slot buffer dropped then is released by pyo3 once the GIL is back).
            Some(ring) => py.detach(move || with_ring!(ring, r => r.close())).map_err(|e| py_err(&component, e)),
            None => Ok(()),
        }
    }
}

impl Drop for Streamer {
    /// A ring not closed (the Python object collected) is dropped with the
    /// caller's CUDA context kept, as every call is.
    fn drop(&mut self) {
        let ring = self.ring.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(AnyRing::Cuda(r)) = ring {
            let _keep = cuda::KeepContext::new();
            drop(r);
        }
    }
}

impl Streamer {
    fn set_planned(&self, depth: usize, why: String, chosen_by: &'static str) {
        let mut p = self.planned.lock().unwrap_or_else(|e| e.into_inner());
        p.depth = depth;
        p.why = why;
        p.chosen_by = chosen_by;
    }
}

/// The last traced backward step's compute seconds per block, a block's spans
/// summed (a checkpoint's recompute and the block's backward are one block's
/// backward time); empty where no backward was traced.
fn last_backward_sums(tl: &offload_core::Timeline) -> std::collections::HashMap<String, f64> {
    let mut by: std::collections::HashMap<String, f64> = Default::default();
    let Some(step) = tl.spans.iter().filter(|s| s.backward && s.stream == "compute").map(|s| s.step).max() else { return by };
    for s in tl.spans.iter().filter(|s| s.backward && s.step == step) {
        if let Some(id) = s.name.strip_prefix("compute ") {
            *by.entry(id.to_owned()).or_default() += s.dur_s;
        }
    }
    by
}

/// Each block's median compute span in a timeline's forward steps (or its
/// backward steps: `backward`), by block name.
fn compute_medians(tl: &offload_core::Timeline, backward: bool) -> std::collections::HashMap<String, f64> {
    let mut by: std::collections::HashMap<String, Vec<f64>> = Default::default();
    for s in tl.spans.iter().filter(|s| s.backward == backward) {
        if let Some(id) = s.name.strip_prefix("compute ") {
            by.entry(id.to_owned()).or_default().push(s.dur_s);
        }
    }
    by.into_iter()
        .map(|(id, mut v)| {
            v.sort_by(f64::total_cmp);
            (id, v[v.len() / 2])
        })
        .collect()
}

/// A calibration's cost model, checked against the module's blocks: the same
/// blocks in the same order, a positive bandwidth, and each block's bytes those
/// of the module's block up to the tensors' alignment (a ring served from a
/// checkpoint lays a block out as the file does, padded otherwise than the host
/// store's own layout). Each block is planned at the larger of the two counts.
fn calibrated_model(component: &str, inventory: &ComponentInventory, json: &str) -> PyResult<offload_plan::CostModel> {
    let mut m = offload_plan::CostModel::from_json(json).map_err(|e| error(format!("component {component:?}: calibration: {e}")))?;
    let own = offload_plan::CostModel::from_inventory(inventory, 1.0).map_err(|e| py_err(component, e))?;
    if !(m.bandwidth_bytes_per_s.is_finite() && m.bandwidth_bytes_per_s > 0.0) {
        return Err(error(format!("component {component:?}: calibration: bandwidth {} bytes/s", m.bandwidth_bytes_per_s)));
    }
    if m.blocks.len() != own.blocks.len() {
        return Err(error(format!("component {component:?}: calibration has {} blocks, the module {}", m.blocks.len(), own.blocks.len())));
    }
    for ((c, o), spec) in m.blocks.iter_mut().zip(&own.blocks).zip(inventory.blocks()) {
        let padding = (spec.tensors.len() * offload_core::TENSOR_ALIGN) as u64;
        if c.id != o.id || c.bytes.abs_diff(o.bytes) >= padding {
            return Err(error(format!(
                "component {component:?}: calibration block {} ({} bytes) where the module has {} ({} bytes): calibrate this module",
                c.id, c.bytes, o.id, o.bytes
            )));
        }
        if !(c.compute_s.is_finite() && c.compute_s >= 0.0) {
            return Err(error(format!("component {component:?}: calibration block {}: compute time {} s", c.id, c.compute_s)));
        }
        c.bytes = c.bytes.max(o.bytes);
    }
    if !m.compute_s().is_finite() {
        return Err(error(format!("component {component:?}: calibration: the blocks' compute times add up to {} s", m.compute_s())));
    }
    Ok(offload_plan::CostModel { non_block_bytes: 0, ..m })
}

/// The ring, locked for one call.
struct Held<'a> {
    guard: MutexGuard<'a, Option<AnyRing>>,
    component: &'a str,
    /// The CUDA context current when the call began, current again when it
    /// ends: every method's first CUDA call (the capture check binds the
    /// engine's device) comes after it, so none leaves another device current.
    _keep: cuda::KeepContext,
}

impl Held<'_> {
    fn ring(&mut self) -> PyResult<&mut AnyRing> {
        let c = self.component;
        self.guard.as_mut().ok_or_else(|| error(format!("component {c:?}: closed")))
    }
}

impl Streamer {
    fn held(&self) -> PyResult<Held<'_>> {
        // Every call starts here: an interrupt kept by an earlier call whose error
        // was not raised is not this call's.
        INTERRUPT.with(|k| k.borrow_mut().take());
        let c = &self.component;
        match self.ring.try_lock() {
            Ok(guard) => Ok(Held { guard, component: c, _keep: cuda::KeepContext::new() }),
            Err(TryLockError::WouldBlock) => Err(error(format!("component {c:?}: in use by another thread"))),
            Err(TryLockError::Poisoned(_)) => {
                Err(error(format!("component {c:?}: a call panicked inside the engine; disable and enable again")))
            }
        }
    }
}

/// The tensors of a diffusion model's GGUF file as offload streams them: under
/// diffusers' names, mapped by the architecture the file names
/// (`general.architecture`: `flux`, `wan`, `qwen_image`), each
/// `(name, dtype, shape)` with its quant type as stored (`Q8_0`, `Q4_K`, `BF16`, ...).
/// A file naming no architecture, or one offload does not map, and a tensor
/// the map does not know are errors naming them.
#[pyfunction]
fn gguf_tensors(path: &str) -> PyResult<Vec<(String, String, Vec<usize>)>> {
    Ok(spec_rows(gguf_renamed(path)?.specs()))
}

/// Tensor `name` (diffusers' name, as [`gguf_tensors`] lists it) of a GGUF
/// file: its bytes as stored (quantized blocks as they are), read through the
/// same map. An unknown name is an error naming it.
#[pyfunction]
fn gguf_read<'py>(py: Python<'py>, path: &str, name: &str) -> PyResult<Bound<'py, PyByteArray>> {
    read_named(py, &gguf_renamed(path)?, path, name)
}

/// Every tensor of the safetensors file at `path`: `(name, dtype, shape)`,
/// dtype as `DType` names it (`BF16`, `F8_E4M3`, ...).
#[pyfunction]
fn safetensors_tensors(path: &str) -> PyResult<Vec<(String, String, Vec<usize>)>> {
    Ok(spec_rows(safetensors_file(path)?.specs()))
}

/// Tensor `name` of the safetensors file at `path`, its bytes as stored. An
/// unknown name is an error naming it.
#[pyfunction]
fn safetensors_read<'py>(py: Python<'py>, path: &str, name: &str) -> PyResult<Bound<'py, PyByteArray>> {
    read_named(py, &safetensors_file(path)?, path, name)
}

fn safetensors_file(path: &str) -> PyResult<offload_core::SafetensorsFile> {
    offload_core::SafetensorsFile::open(path).map_err(|e| error(format!("{path}: {e}")))
}

/// `(name, dtype, shape)` of each spec, the dtype as `DType` names it.
fn spec_rows(specs: &[TensorSpec]) -> Vec<(String, String, Vec<usize>)> {
    specs.iter().map(|s| (s.name.clone(), format!("{:?}", s.dtype), s.shape.clone())).collect()
}

/// Tensor `name` of `source` (the file at `path`), its bytes as stored; an
/// unknown name is an error naming it.
fn read_named<'py>(py: Python<'py>, source: &dyn TensorSource, path: &str, name: &str) -> PyResult<Bound<'py, PyByteArray>> {
    let i = source.specs().iter().position(|s| s.name == name).ok_or_else(|| error(format!("{path}: no tensor {name:?}")))?;
    let mut bytes = vec![0u8; source.specs()[i].nbytes().map_err(|e| error(format!("{path}: {e}")))?];
    source.read_into(i, &mut bytes).map_err(|e| error(format!("{path}: {e}")))?;
    Ok(PyByteArray::new(py, &bytes))
}

/// The GGUF file at `path` under diffusers' names.
fn gguf_renamed(path: &str) -> PyResult<offload_formats::Renamed<offload_formats::GgufFile>> {
    let file = offload_formats::GgufFile::open(path).map_err(|e| error(format!("{path}: {e}")))?;
    offload_formats::gguf_under_diffusers_names(file).map_err(|e| error(format!("{path}: {e}")))
}

/// The engine's module. It needs the GIL (`gil_used = true`: a free-threaded
/// interpreter turns the GIL on at its import): the package's hooks and the
/// DLPack reads count on it to keep Python code from running meanwhile.
#[pymodule(gil_used = true)]
fn _offload(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Streamer>()?;
    m.add_function(wrap_pyfunction!(gguf_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(gguf_read, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_read, m)?)?;
    m.add("OffloadError", m.py().get_type::<OffloadError>())?;
    // The workspace's version; the package's (`pyproject.toml`) is checked equal by a test.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
