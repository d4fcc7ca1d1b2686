//! cuda's file: the registry's dual- and single-stream blocks computed with raw
//! CUDA by [`offload_cuda::reference::RefNet`] (no rotary positions, no
//! embedders), each block read from the slot a [`Ring`] serves; the resident
//! reference is the same compute from a ring that keeps every block resident.
//! Beyond the other files: `--budgets` (calibrated with compute-stream events),
//! `--trace` (a Chrome trace of one extra streamed step, and of the coded one as
//! `<stem>-coded.json`), `--no-gemm` (a sanitizer's run) and `--coded`.

use crate::drive::{Driver, Resident, StreamedRun};
use crate::harness::{spread, CodedFacts, RunCase, RunDoc, RunOptions, StagingRun, StoreFacts, Streamed};
use crate::registry::{dual_names, BlockKind, Case, Model};
use crate::source::{bf16_to_f32, block_inventory, resolved, RegistrySource};
use offload_core::HostBuffer as _;
use offload_core::{ComponentInventory, HostStore, OffloadBackend, Plan, Ring, StepMetrics, StreamKind};
use offload_cuda::reference::{DualNames, RefDims, RefNet, HEAD_DIM};
use offload_cuda::CudaBackend;
use offload_plan::{BlockCost, CostModel};
use std::sync::Arc;
use std::time::Instant;

type Event = <CudaBackend as OffloadBackend>::Event;

/// One block's compute in one step, between two compute-stream timing events.
pub(crate) struct BlockMark {
    id: String,
    bytes: u64,
    start: Event,
    end: Event,
}

fn err(what: impl std::fmt::Display) -> String {
    format!("cuda: {what}")
}

/// Whether cuda's file computes `model`: dual- and single-stream blocks without
/// per-block overrides, heads of 128.
pub fn computes(model: &Model) -> bool {
    model.computed() && model.head_dim == HEAD_DIM
}

/// The reference model's dimensions for `case` of `model` (the host-tier and relay benches' too).
pub(crate) fn dims(model: &Model, case: &Case) -> Result<RefDims, String> {
    if case.batch != 1 {
        return Err(err(format!("{} {}: the reference model runs batch 1, the case has {}", model.name, case.name, case.batch)));
    }
    Ok(RefDims { heads: model.heads, mlp: model.mlp, text_tokens: case.text_tokens, image_tokens: case.image_tokens })
}

fn timing_event(be: &CudaBackend) -> offload_core::Result<Event> {
    be.record_timing(StreamKind::Compute)?.ok_or_else(|| offload_core::Error::unsupported("cuda", "timing events"))
}

/// One forward call through `ring`, every block in the registry's order; with
/// `marks`, a timing event on each side of each block's compute (after its wait).
pub(crate) fn step(
    be: &CudaBackend,
    model: &Model,
    net: &mut RefNet,
    ring: &mut Ring<CudaBackend>,
    mut marks: Option<&mut Vec<BlockMark>>,
) -> offload_core::Result<StepMetrics> {
    let n = dual_names(model);
    let names = DualNames { img_mod: n.img_mod, txt_mod: n.txt_mod, img_mlp: n.img_mlp, txt_mlp: n.txt_mlp };
    net.begin_step()?;
    for s in &model.stacks {
        for i in 0..s.count {
            let block = ring.block(s.prefix, i)?;
            let start = marks.is_some().then(|| timing_event(be)).transpose()?;
            match s.kind {
                BlockKind::DualStream => net.dual_block(&block, &names)?,
                BlockKind::SingleStream => net.single_block(&block)?,
                other => return Err(offload_core::Error::unsupported("cuda (bench room)", format!("{other:?} blocks ({}.{i})", s.prefix))),
            }
            if let (Some(m), Some(start)) = (marks.as_deref_mut(), start) {
                m.push(BlockMark { id: block.id().to_string(), bytes: block.layout().bytes as u64, start, end: timing_event(be)? });
            }
            block.finish()?;
        }
    }
    ring.end_step()
}

/// What one step moved: the bytes the ring copied (as the blocks hold them on the
/// device), the bytes that crossed the link (coded bytes where held coded) and
/// the bytes read from disk.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StepBytes {
    pub copied: u64,
    pub link: u64,
    pub disk: u64,
}

/// `warmup` untimed, then `steps` timed forward calls through `ring`: each timed
/// call's seconds, and what the last one moved.
pub(crate) fn timed_steps(
    be: &CudaBackend,
    model: &Model,
    net: &mut RefNet,
    ring: &mut Ring<CudaBackend>,
    (warmup, steps): (usize, usize),
) -> Result<(Vec<f64>, StepBytes), String> {
    crate::harness::timed((warmup, steps), &|| be.synchronize().map_err(err), &mut || {
        let before = ring.metrics().bytes_copied;
        let m = step(be, model, net, ring, None).map_err(err)?;
        Ok(StepBytes { copied: ring.metrics().bytes_copied - before, link: m.link_bytes, disk: m.disk_bytes_read })
    })
}

/// [`timed_steps`] through a ring of `plan` over `store`, then the output.
pub(crate) fn ring_steps(
    be: &CudaBackend,
    model: &Model,
    (store, plan, inv): (&Arc<HostStore<CudaBackend>>, &Plan, &ComponentInventory),
    net: &mut RefNet,
    warmup_steps: (usize, usize),
) -> Result<(Vec<f64>, u64, Vec<u16>), String> {
    let mut ring = Ring::new(be.clone(), store.clone(), &resolved(plan, inv).map_err(err)?).map_err(err)?;
    let (times, moved) = timed_steps(be, model, net, &mut ring, warmup_steps)?;
    let bytes = moved.copied;
    let out = net.output().map_err(err)?;
    ring.close().map_err(err)?;
    Ok((times, bytes, out))
}

/// The cost model of `steps` resident steps through `ring`: each block's compute
/// (the median over the steps, in the order blocks ran) and `bandwidth`.
fn calibrate_blocks(
    be: &CudaBackend,
    model: &Model,
    net: &mut RefNet,
    ring: &mut Ring<CudaBackend>,
    steps: usize,
    bandwidth: f64,
    source: String,
) -> Result<CostModel, String> {
    let mut per_step = Vec::with_capacity(steps);
    for _ in 0..steps {
        let mut marks = Vec::new();
        step(be, model, net, ring, Some(&mut marks)).map_err(err)?;
        per_step.push(marks);
    }
    be.synchronize().map_err(err)?;
    let first = per_step.first().ok_or_else(|| err("calibration: no steps"))?;
    let mut blocks = Vec::with_capacity(first.len());
    for (j, b) in first.iter().enumerate() {
        let mut xs = Vec::with_capacity(per_step.len());
        for m in &per_step {
            let m = m.get(j).filter(|m| m.id == b.id).ok_or_else(|| err(format!("calibration: block {j} changed between steps")))?;
            xs.push(be.elapsed_s(&m.start, &m.end).map_err(err)?.ok_or_else(|| err("calibration: no timing"))?);
        }
        let compute_s = spread(&xs).ok_or_else(|| err(format!("calibration: {} timed {xs:?}", b.id)))?.median;
        blocks.push(BlockCost::new(b.id.clone(), b.bytes, compute_s));
    }
    Ok(crate::budgets::cost_model(bandwidth, blocks, source))
}

/// What a streamed run measured.
struct RingRun {
    times: Vec<f64>,
    out: Vec<u8>,
    misses: u64,
    depth: usize,
    /// Bytes the ring copied in the last timed step.
    step_bytes: u64,
    weights: u64,
    timeline: Option<StepMetrics>,
}

/// Build `model`'s host store (random bf16, pinned) on GPU 0 and, per case, time
/// the reference model resident (every block loaded once), then streamed at every
/// depth and under the planner's choice for every budget, in this process
/// ([`crate::drive::run`]).
pub fn run(model: &Model, opts: &RunOptions) -> Result<RunDoc, String> {
    if !computes(model) {
        return Err(err(format!("{}: the reference model computes dual- and single-stream blocks with heads of 128 only", model.name)));
    }
    crate::drive::run(model, opts, || CudaRun::new(model, opts))
}

/// cuda's file on GPU 0: one host store (and with `--coded` a second, coded for
/// the device), one reference model per case, kept from its resident run to its
/// streamed ones.
struct CudaRun<'m> {
    model: &'m Model,
    opts: &'m RunOptions,
    be: CudaBackend,
    inv: ComponentInventory,
    store: Arc<HostStore<CudaBackend>>,
    facts: StoreFacts,
    coded: Option<(Arc<HostStore<CudaBackend>>, CodedFacts)>,
    nets: Vec<(String, RefNet)>,
}

/// The reference model's output as bytes (bf16, little-endian).
fn bytes(out: &[u16]) -> Vec<u8> {
    out.iter().flat_map(|v| v.to_le_bytes()).collect()
}

impl<'m> CudaRun<'m> {
    fn new(model: &'m Model, opts: &'m RunOptions) -> Result<Self, String> {
        use crate::harness::gib;
        let be = match opts.high_priority_compute {
            false => CudaBackend::new(0),
            true => CudaBackend::new_high_priority_compute(0),
        }
        .map_err(err)?;
        let src = match opts.coded {
            true => RegistrySource::normal(model, 0),
            false => RegistrySource::new(model, 0),
        };
        // Blocks only: the reference model has no embedders (resident bytes 0).
        let inv = block_inventory(model, offload_core::TensorSource::specs(&src)).map_err(err)?;
        let t = Instant::now();
        let store = Arc::new(HostStore::build(&be, &inv, &src).map_err(err)?);
        let facts = crate::harness::store_facts(&be, &store, t).map_err(err)?;
        // With --coded: the same weights in a second store, coded for the device
        // (coding turned on after the raw store is built, which stays raw).
        let coded = match opts.coded {
            false => None,
            true => {
                let (entropy, per_tensor) = entropies(&store);
                let largest = store
                    .blocks()
                    .iter()
                    .max_by_key(|b| b.bytes())
                    .map(|b| b.buffer().expect("held in memory").block_bytes().map(<[u8]>::to_vec))
                    .transpose()
                    .map_err(|e| e.to_string())?
                    .unwrap_or_default();
                let options = offload_cuda::CodingOptions { high_priority_decode: opts.high_priority_decode, ..Default::default() };
                let t = Instant::now();
                let sample = offload_core::codec::code_for_device(&largest, options.segment_bytes, options.threads);
                let encode_gbps = largest.len() as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9;
                drop(sample);
                let decode_gbps_in_run = decode_speed(&be, &largest).map_err(err)?;
                drop(largest);
                be.enable_coding(options).map_err(err)?;
                let t = Instant::now();
                // From the raw store's bytes: the same weights, not drawn a second time.
                let cstore = Arc::new(HostStore::build(&be, &inv, &StoreTensors::new(&store, &src)).map_err(err)?);
                let build_s = t.elapsed().as_secs_f64();
                let coded_bytes: u64 = cstore.blocks().iter().map(|b| b.buffer().map_or(0, |h| h.len()) as u64).sum();
                let (lo, mid, hi) =
                    (per_tensor.first().copied(), per_tensor.get(per_tensor.len() / 2).copied(), per_tensor.last().copied());
                let f = CodedFacts {
                    coded_bytes,
                    raw_bytes: facts.total,
                    compression_ratio: coded_bytes as f64 / facts.total.max(1) as f64,
                    exponent_entropy_bits: entropy,
                    tensor_entropy_bits_min: lo.unwrap_or(0.0),
                    tensor_entropy_bits_median: mid.unwrap_or(0.0),
                    tensor_entropy_bits_max: hi.unwrap_or(0.0),
                    encode_gbps_host: encode_gbps,
                    encode_threads: options.threads,
                    store_build_s: build_s,
                    staging_peak_bytes: 0,
                    decode_gbps_in_run,
                    high_priority_decode: options.high_priority_decode,
                    high_priority_compute: opts.high_priority_compute,
                };
                eprintln!(
                    "coded store: {:.2} GiB for {:.2} GiB ({:.4}), exponent entropy {entropy:.3} bits ({:.3}–{:.3} per tensor), \
                     host encode {encode_gbps:.2} GB/s on {} threads, built in {build_s:.1} s",
                    gib(coded_bytes),
                    gib(facts.total),
                    f.compression_ratio,
                    f.tensor_entropy_bits_min,
                    f.tensor_entropy_bits_max,
                    options.threads
                );
                Some((cstore, f))
            }
        };
        Ok(CudaRun { model, opts, be, inv, store, facts, coded, nets: Vec::new() })
    }

    fn net(&mut self, case: &Case) -> Result<&mut RefNet, String> {
        let i = self.nets.iter().position(|(c, _)| *c == case.name).ok_or_else(|| err(format!("{} was not run resident", case.name)))?;
        Ok(&mut self.nets[i].1)
    }

    /// A streamed run of `plan` from `store`: its timed steps, then (with `trace`)
    /// one more step with the timeline on, written to `trace`.
    fn ring_run(&mut self, coded: bool, case: &Case, plan: &Plan, trace: Option<&str>) -> Result<RingRun, String> {
        let (be, model, steps) = (self.be.clone(), self.model, (self.opts.warmup, self.opts.steps));
        let st = match (coded, &self.coded) {
            (false, _) => self.store.clone(),
            (true, Some((cstore, _))) => cstore.clone(),
            (true, None) => return Err(err("no coded store")),
        };
        let rc = resolved(plan, &self.inv).map_err(err)?;
        let net = self.net(case)?;
        be.synchronize().map_err(err)?;
        be.reset_peak();
        let mut ring = Ring::new(be.clone(), st, &rc).map_err(err)?;
        let depth = ring.depth();
        let (times, moved) = timed_steps(&be, model, net, &mut ring, steps)?;
        let out = bytes(&net.output().map_err(err)?);
        let misses = ring.metrics().misses;
        let timeline = match trace {
            Some(path) => {
                ring.enable_timeline().map_err(err)?;
                let m = step(&be, model, net, &mut ring, None).map_err(err)?;
                let tl = ring.timeline().ok_or_else(|| err("the ring recorded no timeline"))?;
                tl.write_chrome_trace(path).map_err(|e| err(format!("{path}: {e}")))?;
                eprintln!("timeline step: {m}; trace written to {path}");
                Some(m)
            }
            None => None,
        };
        ring.close().map_err(err)?;
        Ok(RingRun { times, out, misses, depth, step_bytes: moved.copied, weights: be.counters().peak_bytes, timeline })
    }
}

impl Driver for CudaRun<'_> {
    const BACKEND: &'static str = "cuda";

    fn gpu(&self) -> String {
        self.be.device_name().unwrap_or_default()
    }

    fn resident_bytes(&self) -> u64 {
        0
    }

    fn resident(&mut self, c: &Case, calibrate: bool) -> Result<Resident, String> {
        let be = self.be.clone();
        let before = be.pool_used_bytes().map_err(err)?.0;
        let mut net = RefNet::new(&be, dims(self.model, c)?, c.resolution as u64).map_err(err)?;
        net.set_skip_gemm(self.opts.no_gemm);
        be.synchronize().map_err(err)?;
        let activations = be.pool_used_bytes().map_err(err)?.0.saturating_sub(before);
        let rc = resolved(&Plan::resident(), &self.inv).map_err(err)?;
        let mut ring = Ring::new(be.clone(), self.store.clone(), &rc).map_err(err)?;
        let (times, _) = timed_steps(&be, self.model, &mut net, &mut ring, (self.opts.warmup, self.opts.steps))?;
        let out = bytes(&net.output().map_err(err)?);
        // The budget runs' calibration: more resident steps, each block's compute
        // timed on the device (kept out of the timed steps above); three do for the
        // coded runs' planner when no budget run needs more.
        let cost = match calibrate {
            false => None,
            true => {
                let source = format!("{}, {} {}, resident steps of zoo run --backend cuda", self.gpu(), self.model.name, c.name);
                let steps = if self.opts.budgets_gib.is_empty() { self.opts.steps.min(3) } else { self.opts.steps };
                Some(calibrate_blocks(&be, self.model, &mut net, &mut ring, steps, self.facts.bandwidth, source)?)
            }
        };
        ring.close().map_err(err)?;
        self.nets.push((c.name.clone(), net));
        Ok(Resident { times, out, activations, cost })
    }

    fn stream(&mut self) -> Result<StoreFacts, String> {
        Ok(self.facts.clone())
    }

    fn streamed(&mut self, c: &Case, plan: &Plan, r: &Resident, trace: Option<&str>) -> Result<StreamedRun, String> {
        let s = self.ring_run(false, c, plan, trace)?;
        let (equal, values) = (s.out == r.out, bf16_to_f32(&u16s(&s.out)));
        let streamed = Streamed { times: s.times, equal, values, weights: s.weights, derived: s.weights, misses: s.misses };
        Ok(StreamedRun { s: streamed, depth: s.depth, step_bytes: Some(s.step_bytes), timeline: s.timeline })
    }

    /// The same depth from the coded store (traced beside the raw trace, as
    /// `<trace stem>-coded.json`), then with each number of staging buffers asked
    /// for; and the planner's coding choice at this depth.
    fn extend_row(&mut self, c: &Case, d: usize, r: &Resident, trace: Option<&str>, row: &mut RunCase) -> Result<(), String> {
        let Some((cstore, f)) = &self.coded else { return Ok(()) };
        let (cstore, decode_gbps) = (cstore.clone(), f.decode_gbps_in_run);
        if let Some(cost) = &r.cost {
            let p = planner_coding(cost, &cstore, decode_gbps, d)?;
            eprintln!(
                "{} {} d={d}: the planner {} (replayed: raw {:.4} s, coded {:.4} s)",
                self.model.name,
                c.name,
                if p.coded { "codes" } else { "does not code" },
                p.predicted_raw_s,
                p.predicted_coded_s
            );
            row.planner = Some(p);
        }
        let bound = crate::harness::median(&r.times).max(self.facts.total as f64 / self.facts.bandwidth);
        let say = |how: &str, s: &RingRun, eq: bool| {
            let step = crate::harness::median(&s.times);
            let ratio = step / bound;
            eprintln!(
                "{} {} d={d}: coded streamed{how} {step:.4} s ({ratio:.4} × the raw bound), bitwise_equal {eq}, misses {}",
                self.model.name, c.name, s.misses
            );
        };
        let plan = Plan::layerwise().prefetch_depth(d);
        let coded_trace = trace.map(|p| format!("{}-coded.json", p.strip_suffix(".json").unwrap_or(p)));
        let cs = self.ring_run(true, c, &plan, coded_trace.as_deref())?;
        say("", &cs, cs.out == r.out);
        for &n in &self.opts.staging_buffers {
            self.be.set_staging_buffers(n).map_err(err)?;
            let sr = self.ring_run(true, c, &plan, None)?;
            say(&format!(" with {n} staging buffers"), &sr, sr.out == r.out);
            let staging_peak_bytes = self.be.counters().staging_peak_bytes;
            row.coded_by_staging.push(StagingRun {
                staging_buffers: n,
                bitwise_equal: sr.out == r.out,
                steps_s: sr.times,
                staging_peak_bytes,
            });
        }
        if !self.opts.staging_buffers.is_empty() {
            self.be.set_staging_buffers(offload_cuda::STAGING_BUFFERS).map_err(err)?;
        }
        row.coded_bitwise_equal = Some(cs.out == r.out);
        row.steps_streamed_coded_s = cs.times;
        Ok(())
    }

    fn finish(&mut self, doc: &mut RunDoc) -> Result<(), String> {
        if let Some((_, mut f)) = self.coded.take() {
            f.staging_peak_bytes = self.be.counters().staging_peak_bytes;
            doc.coded = Some(f);
        }
        Ok(())
    }
}

/// Little-endian bytes back to bf16 words.
fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|w| u16::from_le_bytes([w[0], w[1]])).collect()
}

/// Exponent entropy of every weight in `store` (bits per value) and of each
/// tensor, sorted; blocks shared out among the host's threads.
/// The decoder's speed on `raw` as one coded string, GB/s of output (five timed
/// launches after a warm-up, as `codec_speed`).
fn decode_speed(be: &CudaBackend, raw: &[u8]) -> offload_core::Result<f64> {
    let enc = offload_core::codec::encode_bf16(raw);
    let reps = 5;
    let (s, _) = offload_cuda::ExponentDecoder::new(be)?.time_decodes(be, &enc, "the decoder's speed", reps)?;
    Ok((raw.len() * reps) as f64 / s.max(1e-9) / 1e9)
}

/// The planner's coding choice at `depth` with every block streamed: `cost` (this
/// run's calibration) with each block's coded size from `cstore` and its decode
/// time at `decode_gbps`.
fn planner_coding(
    cost: &CostModel,
    cstore: &HostStore<CudaBackend>,
    decode_gbps: f64,
    depth: usize,
) -> Result<crate::harness::PlannerCoding, String> {
    let sizes: std::collections::HashMap<String, u64> =
        cstore.blocks().iter().map(|b| (b.id.to_string(), b.buffer().map_or(0, |h| h.len()) as u64)).collect();
    let mut m = cost.clone();
    for b in &mut m.blocks {
        let bytes =
            *sizes.get(&b.id).ok_or_else(|| err(format!("the planner's cost model names block {}, not in the coded store", b.id)))?;
        b.coded = Some(offload_plan::CodedCost { bytes, decode_s: b.bytes as f64 / (decode_gbps.max(1e-9) * 1e9) });
    }
    Ok(crate::compressed::coding_choice(&m, depth))
}

/// A built store's tensors as a source (by name, in `like`'s order): a second
/// store of the same weights without reading or drawing them again.
struct StoreTensors<'a> {
    store: &'a HostStore<CudaBackend>,
    specs: Vec<offload_core::TensorSpec>,
    /// Per spec: (block, byte offset, bytes) in the store, if a block holds it.
    at: Vec<Option<(usize, usize, usize)>>,
}

impl<'a> StoreTensors<'a> {
    fn new(store: &'a HostStore<CudaBackend>, like: &dyn offload_core::TensorSource) -> Self {
        let mut place = std::collections::HashMap::new();
        for (i, b) in store.blocks().iter().enumerate() {
            for t in &b.layout.tensors {
                place.insert(t.spec.name.as_str(), (i, t.offset, t.nbytes));
            }
        }
        let specs = like.specs().to_vec();
        let at = specs.iter().map(|s| place.get(s.name.as_str()).copied()).collect();
        StoreTensors { store, specs, at }
    }
}

impl offload_core::TensorSource for StoreTensors<'_> {
    fn specs(&self) -> &[offload_core::TensorSpec] {
        &self.specs
    }

    fn read_into(&self, index: usize, dst: &mut [u8]) -> offload_core::Result<()> {
        let name = self.specs.get(index).map_or_else(|| format!("#{index}"), |s| s.name.clone());
        let bad = |fault: String| offload_core::Error::BadTensor { tensor: name.clone(), fault };
        let (b, off, n) = self.at.get(index).copied().flatten().ok_or_else(|| bad("in no block of the raw store".into()))?;
        if n != dst.len() {
            return Err(bad(format!("{n} bytes in the raw store, {} asked for", dst.len())));
        }
        dst.copy_from_slice(&self.store.blocks()[b].buffer().expect("held in memory").block_bytes()?[off..off + n]);
        Ok(())
    }

    fn origin(&self) -> String {
        "the raw store of this run".into()
    }
}

fn entropies(store: &HostStore<CudaBackend>) -> (f64, Vec<f64>) {
    use offload_core::codec::{exponent_histogram, histogram_entropy_bits as entropy};
    let blocks = store.blocks();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(blocks.len()).max(1);
    let per = blocks.len().div_ceil(threads).max(1);
    let parts: Vec<([u64; 256], Vec<f64>)> = std::thread::scope(|s| {
        let hs: Vec<_> = blocks
            .chunks(per)
            .map(|group| {
                s.spawn(move || {
                    let (mut all, mut each) = ([0u64; 256], Vec::new());
                    for b in group {
                        // The store was built from memory here: its bytes are readable.
                        let Ok(bytes) = b.buffer().expect("held in memory").block_bytes() else { continue };
                        for t in &b.layout.tensors {
                            let h = exponent_histogram(&bytes[t.offset..t.offset + t.nbytes]);
                            for (a, x) in all.iter_mut().zip(h) {
                                *a += x;
                            }
                            each.push(entropy(&h));
                        }
                    }
                    (all, each)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let mut all = [0u64; 256];
    let mut each = Vec::new();
    for (h, e) in parts {
        for (a, x) in all.iter_mut().zip(h) {
            *a += x;
        }
        each.extend(e);
    }
    each.sort_by(f64::total_cmp);
    (entropy(&all), each)
}
