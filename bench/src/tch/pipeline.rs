//! tch's compute for the pipeline case ([`crate::pipeline`]): T5's encoder, the
//! DiT's denoising steps (Euler, text from the encoder) and the VAE's decoder,
//! each a registry model computed by this file's blocks, chained in one pass.

use super::*;
use crate::harness::check_output;
#[cfg(feature = "tch-cuda")]
use crate::harness::gib;
#[cfg(feature = "tch-cuda")]
use crate::pipeline::{ComponentRun, PipelineRun};
use crate::registry::{self, Case};
use offload_core::{ComponentPlan, ResidentPolicy};
use std::time::Instant;

/// A text-to-image pipeline: its three components, the DiT's case and its steps.
#[derive(Clone, Debug)]
pub struct Pipeline {
    /// The text encoder (T5-XXL's encoder for Flux).
    pub encoder: Model,
    /// The denoising transformer.
    pub dit: Model,
    /// The VAE's decoder.
    pub vae: Model,
    /// The DiT's case; the encoder runs its text tokens, the VAE decodes its side.
    pub case: Case,
    /// Denoising steps per pass.
    pub steps: usize,
}

impl Pipeline {
    /// Flux-dev at `res`²: T5-XXL (512 tokens), Flux-dev, Flux's VAE.
    pub fn flux(res: &str, steps: usize) -> Result<Self, String> {
        let dit = registry::flux_dev();
        let case = dit.case(res)?.clone();
        let mut vae = registry::flux_vae();
        vae.cases = vec![Case { name: case.name.clone(), resolution: case.resolution, height: case.height, ..vae.cases[0].clone() }];
        Ok(Pipeline { encoder: registry::t5_xxl(), dit, vae, case, steps })
    }

    /// Every component shrunk ([`registry::tiny`]), the DiT's text width set to the
    /// encoder's: what the CPU check runs.
    pub fn tiny(&self) -> Self {
        let encoder = registry::tiny(&self.encoder);
        let mut dit = registry::tiny(&self.dit);
        let width = encoder.hidden;
        dit.text_dim = width;
        for p in &mut dit.globals {
            if p.name == "context_embedder.weight" {
                p.shape[1] = width;
            }
        }
        let vae = registry::tiny(&self.vae);
        let case = Case { text_tokens: encoder.cases[0].text_tokens, ..dit.cases[0].clone() };
        Pipeline { encoder, dit, vae, case, steps: self.steps.min(2) }
    }

    fn encoder_case(&self) -> Case {
        Case { text_tokens: self.case.text_tokens, ..self.encoder.cases[0].clone() }
    }
}

struct Nets<'m> {
    enc: Net<'m>,
    dit: Net<'m>,
    vae: Net<'m>,
}

/// The offloaded components.
struct Offs<B: TchSlots> {
    enc: TchOffload<B>,
    dit: TchOffload<B>,
    vae: TchOffload<B>,
}

/// One pass's outputs and each component's seconds.
struct Outs {
    text: Tensor,
    latents: Tensor,
    image: Tensor,
    /// Seconds per component (the CPU check does not time).
    #[cfg_attr(not(feature = "tch-cuda"), allow(dead_code))]
    secs: [f64; 3],
}

/// The DiT's inputs at one step: `base`'s tables, these latents, this text, time `t`.
fn at(base: &Inputs, latents: &Tensor, text: &Tensor, t: f64) -> Inputs {
    Inputs {
        latents: latents.shallow_clone(),
        text: text.shallow_clone(),
        pooled: base.pooled.as_ref().map(Tensor::shallow_clone),
        t,
        guidance: base.guidance,
        cos: base.cos.shallow_clone(),
        sin: base.sin.shallow_clone(),
        text_tokens: base.text_tokens,
        ids: None,
    }
}

/// Flux's packed latents `[B, (H/16)·(W/16), 64]` as an image's latents `[B, 16, H/8, W/8]`.
fn unpack(x: &Tensor, case: &Case) -> Tensor {
    let (b, h, w) = (x.size()[0], (case.height / 16) as i64, (case.resolution / 16) as i64);
    x.view([b, h, w, 16, 2, 2]).permute([0, 3, 1, 4, 2, 5]).reshape([b, 16, 2 * h, 2 * w])
}

/// One pass: encode, `steps` Euler steps of the DiT from `dit_in`'s noise, decode.
/// With `offs`, every component is offloaded (the VAE re-planned resident for its
/// decode, then back to two slots: loaded whole on demand). `mark(k)` is called
/// at each component boundary (0 before the encoder … 3 after the VAE), after
/// the device has finished the work before it.
fn pass<B: TchSlots>(
    p: &Pipeline,
    nets: &Nets,
    enc_in: &Inputs,
    dit_in: &Inputs,
    mut offs: Option<&mut Offs<B>>,
    mark: &mut dyn FnMut(usize),
) -> offload_core::Result<Outs> {
    mark(0);
    let t0 = Instant::now();
    let text = nets.enc.step(enc_in, offs.as_deref_mut().map(|o| &mut o.enc))?;
    mark(1);
    let t1 = Instant::now();
    let mut x = dit_in.latents.shallow_clone();
    let n = p.steps.max(1);
    for k in 0..n {
        let v = nets.dit.step(&at(dit_in, &x, &text, 1.0 - k as f64 / n as f64), offs.as_deref_mut().map(|o| &mut o.dit))?;
        x = &x - v * (1.0 / n as f64);
    }
    mark(2);
    let t2 = Instant::now();
    let z = unpack(&x, &p.case);
    let image = match offs {
        Some(o) => {
            o.vae.replan(&Plan::resident())?;
            let image = nets.vae.vae_decode(&z, Some(&mut o.vae))?;
            o.vae.replan(&Plan::layerwise())?;
            image
        }
        None => nets.vae.vae_decode::<B>(&z, None)?,
    };
    mark(3);
    let t3 = Instant::now();
    let s = |a: Instant, b: Instant| (b - a).as_secs_f64();
    Ok(Outs { text, latents: x, image, secs: [s(t0, t1), s(t1, t2), s(t2, t3)] })
}

/// What the CPU check of the pipeline saw: per component (encoder, DiT, VAE)
/// whether the offloaded output equals the resident one byte for byte, and
/// whether it is finite and not constant.
#[derive(Clone, Debug)]
pub struct PipelineCpuCheck {
    /// Per component, bitwise equal to the resident pipeline.
    pub bitwise_equal: [bool; 3],
    /// Per component, finite and not constant.
    pub sane: [bool; 3],
    /// The VAE's output against a resident pass from other noise: must differ
    /// (the comparison above can fail).
    pub other_noise_differs: bool,
    /// DiT blocks served from the ring's resident set in the offloaded pass.
    pub dit_resident: usize,
}

/// The pipeline shrunk, on libtorch's CPU device through the simulated backend:
/// resident, then offloaded (the DiT with its first block resident, the VAE
/// loaded whole around its decode).
pub fn check_pipeline_cpu(p: &Pipeline) -> Result<PipelineCpuCheck, String> {
    let _nograd = tch::no_grad_guard();
    tch::set_num_threads(1);
    let (ve, vd, vv) = (nn::VarStore::new(Device::Cpu), nn::VarStore::new(Device::Cpu), nn::VarStore::new(Device::Cpu));
    let nets = Nets { enc: build(&p.encoder, &ve)?, dit: build(&p.dit, &vd)?, vae: build(&p.vae, &vv)? };
    let enc_in = inputs(&p.encoder, &p.encoder_case(), Device::Cpu);
    let dit_in = inputs(&p.dit, &p.case, Device::Cpu);
    let resident = pass::<SimBackend>(p, &nets, &enc_in, &dit_in, None, &mut |_| {}).map_err(err)?;
    let mut other_case = p.case.clone();
    other_case.resolution += 1; // another seed, the same shapes
    let other = pass::<SimBackend>(p, &nets, &enc_in, &inputs(&p.dit, &other_case, Device::Cpu), None, &mut |_| {}).map_err(err)?;
    let first = format!("{}.0", p.dit.stacks[0].prefix);
    let dit_plan = Plan::layerwise().component(
        "transformer",
        ComponentPlan { resident_policy: ResidentPolicy::Explicit, resident_blocks: vec![first], ..Default::default() },
    );
    let mut offs = Offs {
        enc: TchOffload::cpu(&ve, "text_encoder", &prefixes(&p.encoder), &Plan::layerwise()).map_err(err)?,
        dit: TchOffload::cpu(&vd, "transformer", &prefixes(&p.dit), &dit_plan).map_err(err)?,
        vae: TchOffload::cpu(&vv, "vae", &prefixes(&p.vae), &Plan::layerwise()).map_err(err)?,
    };
    let streamed = pass(p, &nets, &enc_in, &dit_in, Some(&mut offs), &mut |_| {}).map_err(err)?;
    let dit_resident = offs.dit.ring().metrics().resident_hits as usize;
    let outs = |o: &Outs| [host_bytes(&o.text), host_bytes(&o.latents), host_bytes(&o.image)];
    let (a, b) = (outs(&resident), outs(&streamed));
    let sane = [&streamed.text, &streamed.latents, &streamed.image].map(|t| {
        let (f, n) = check_output(&host_f32(t));
        f && n
    });
    for o in [offs.enc, offs.dit, offs.vae] {
        o.close().map_err(err)?;
    }
    Ok(PipelineCpuCheck {
        bitwise_equal: [a[0] == b[0], a[1] == b[1], a[2] == b[2]],
        sane,
        other_noise_differs: host_bytes(&other.image) != b[2],
        dit_resident,
    })
}

/// Options of one `zoo pipeline` process.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// The one device budget, GiB.
    pub budget_gib: f64,
    /// Untimed passes first.
    pub warmup: usize,
    /// Timed passes.
    pub passes: usize,
    /// Commit the binary was built from.
    pub commit: String,
}

/// The pipeline on CUDA device 0: resident (every component's weights on the
/// device), then offloaded under one budget — the encoder layer by layer, the
/// DiT with the resident blocks `offload_plan::plan` chooses for what the budget
/// leaves it, the VAE loaded whole around its decode.
#[cfg(feature = "tch-cuda")]
pub fn run_pipeline(p: &Pipeline, opts: &PipelineOptions) -> Result<PipelineRun, String> {
    use crate::harness::median;
    use offload_plan::BlockCost;
    let dev = Device::Cuda(0);
    let be = offload_tch::cuda_backend(0).map_err(err)?;
    let _nograd = tch::no_grad_guard();
    let budget = (opts.budget_gib * (1u64 << 30) as f64) as u64;
    let (ve, vd, vv) = (nn::VarStore::new(dev), nn::VarStore::new(dev), nn::VarStore::new(dev));
    let nets = Nets { enc: build(&p.encoder, &ve)?, dit: build(&p.dit, &vd)?, vae: build(&p.vae, &vv)? };
    let enc_in = inputs(&p.encoder, &p.encoder_case(), dev);
    let dit_in = inputs(&p.dit, &p.case, dev);
    let sync = || tch::Cuda::synchronize(0);
    // Resident: every weight on the device. The first timed pass also measures
    // each component's activations (peak above its start).
    let mut acts = [0u64; 3];
    let mut res_secs = Vec::new();
    let mut resident = None;
    for k in 0..opts.warmup + opts.passes {
        let mut before = 0u64;
        let measure = k == opts.warmup;
        let mut mark = |i: usize| {
            sync();
            if measure {
                let s = stats().unwrap_or_default();
                if i > 0 {
                    acts[i - 1] = s.allocated_peak.saturating_sub(before);
                }
                before = s.allocated;
                let _ = offload_tch::reset_allocator_peak(0);
            }
        };
        let o = pass::<TchCudaBackend>(p, &nets, &enc_in, &dit_in, None, &mut mark).map_err(err)?;
        if k >= opts.warmup {
            res_secs.push(o.secs);
        }
        resident = Some(o);
    }
    let resident = resident.ok_or_else(|| err("no resident pass"))?;
    let med = |secs: &[[f64; 3]], c: usize| median(&secs.iter().map(|s| s[c]).collect::<Vec<_>>());
    eprintln!(
        "pipeline resident: encoder {:.4} s, DiT {:.4} s ({} steps), VAE {:.4} s; activations {:.2} / {:.2} / {:.2} GiB",
        med(&res_secs, 0),
        med(&res_secs, 1),
        p.steps,
        med(&res_secs, 2),
        gib(acts[0]),
        gib(acts[1]),
        gib(acts[2])
    );
    // Offloaded: the blocks to host stores; the DiT first at depth 1 (its store's
    // bandwidth probed), then re-planned under what the budget leaves it.
    let t = Instant::now();
    let mut dit = TchOffload::new(be.clone(), &vd, "transformer", &prefixes(&p.dit), &Plan::layerwise()).map_err(err)?;
    let facts = crate::harness::store_facts(&be, dit.ring().store(), t).map_err(err)?;
    let enc = TchOffload::new(be.clone(), &ve, "text_encoder", &prefixes(&p.encoder), &Plan::layerwise()).map_err(err)?;
    let vae = TchOffload::new(be.clone(), &vv, "vae", &prefixes(&p.vae), &Plan::layerwise()).map_err(err)?;
    let non_block = p.encoder.global_bytes(2) + p.dit.global_bytes(2) + p.vae.global_bytes(2);
    let held = 2 * p.encoder.largest_block_bytes(2) + p.vae.block_bytes(2) + 2 * p.vae.largest_block_bytes(2);
    let margin = 256u64 << 20;
    let dit_budget = budget
        .checked_sub(non_block + held + acts.iter().max().copied().unwrap_or(0) + margin)
        .ok_or_else(|| err(format!("a budget of {:.2} GiB leaves the DiT nothing", gib(budget))))?;
    // Per block: its bytes, and the resident step's compute shared out by bytes
    // (the file times no single block).
    let step_s = med(&res_secs, 1) / p.steps.max(1) as f64;
    let store = dit.ring().store().clone();
    let total: u64 = store.blocks().iter().map(|b| b.bytes() as u64).sum();
    let blocks: Vec<BlockCost> = store
        .blocks()
        .iter()
        .map(|b| BlockCost::new(b.id.to_string(), b.bytes() as u64, step_s * b.bytes() as f64 / total as f64))
        .collect();
    let cost = crate::budgets::cost_model(facts.bandwidth, blocks, "pipeline, resident step by bytes".into());
    let choice = offload_plan::plan(&cost, dit_budget, 1, ResidentPolicy::Auto).map_err(|e| err(format!("planner: {e}")))?;
    dit.replan(&Plan::layerwise().component("transformer", choice.component_plan(&cost, dit_budget))).map_err(err)?;
    let resident_ids: Vec<String> = choice.resident_ids(&cost).into_iter().map(str::to_owned).collect();
    eprintln!(
        "pipeline plan: DiT budget {:.2} GiB of {:.2} → depth {}, {} blocks resident, predicted step {:.4} s",
        gib(dit_budget),
        gib(budget),
        choice.depth,
        resident_ids.len(),
        choice.predicted_step_s
    );
    let mut offs = Offs { enc, dit, vae };
    let mut off_secs = Vec::new();
    let mut peak = 0u64;
    let mut streamed = None;
    for k in 0..opts.warmup + opts.passes {
        sync();
        let _ = offload_tch::reset_allocator_peak(0);
        let o = pass(p, &nets, &enc_in, &dit_in, Some(&mut offs), &mut |_| sync()).map_err(err)?;
        peak = peak.max(stats()?.allocated_peak);
        if k >= opts.warmup {
            off_secs.push(o.secs);
        }
        streamed = Some(o);
    }
    let streamed = streamed.ok_or_else(|| err("no offloaded pass"))?;
    let outs = |o: &Outs| [&o.text, &o.latents, &o.image].map(host_bytes);
    let (a, b) = (outs(&resident), outs(&streamed));
    let sane = [&streamed.text, &streamed.latents, &streamed.image].map(|t| check_output(&host_f32(t)));
    let dit_copied = choice.streamed_bytes * p.steps as u64;
    let models = [&p.encoder, &p.dit, &p.vae];
    let modes = ["layerwise", "layerwise+resident", "on_demand"];
    // The VAE: its blocks copied whole for the decode, and the first two again by
    // the two-slot ring it is re-planned to afterwards (which warms them, to be
    // dropped by the next pass's whole load).
    let vae_stack = &p.vae.stacks[0];
    let warm: u64 = (0..vae_stack.count.min(2)).map(|i| vae_stack.bytes(i, 2)).sum();
    let copied = [p.encoder.block_bytes(2), dit_copied, p.vae.block_bytes(2) + warm];
    let components = (0..3)
        .map(|c| ComponentRun {
            component: crate::pipeline::COMPONENTS[c].into(),
            model: models[c].name.into(),
            mode: modes[c].into(),
            resident_s: res_secs.iter().map(|s| s[c]).collect(),
            offloaded_s: off_secs.iter().map(|s| s[c]).collect(),
            block_bytes: models[c].block_bytes(2),
            copied_bytes_per_pass: copied[c],
            activations_peak_bytes: acts[c],
            bitwise_equal: a[c] == b[c],
            output_finite: sane[c].0,
            output_nonconstant: sane[c].1,
        })
        .collect::<Vec<_>>();
    for c in &components {
        eprintln!(
            "pipeline {} ({}, {}): offloaded {:.4} s, resident {:.4} s, bitwise_equal {}, finite {}, nonconstant {}",
            c.component,
            c.model,
            c.mode,
            median(&c.offloaded_s),
            median(&c.resident_s),
            c.bitwise_equal,
            c.output_finite,
            c.output_nonconstant
        );
    }
    let whole = |secs: &[[f64; 3]]| secs.iter().map(|s| s.iter().sum()).collect::<Vec<f64>>();
    eprintln!("pipeline: peak device memory {:.2} GiB of a {:.2} GiB budget", gib(peak), gib(budget));
    for o in [offs.enc, offs.dit, offs.vae] {
        o.close().map_err(err)?;
    }
    Ok(PipelineRun {
        date: std::env::var("BENCH_DATE").unwrap_or_default(),
        commit: opts.commit.clone(),
        gpu: be.cuda().device_name().unwrap_or_default(),
        backend: "tch".into(),
        budget_bytes: budget,
        steps: p.steps,
        case: p.case.name.clone(),
        bandwidth_gbps: facts.bandwidth / 1e9,
        components,
        resident_pass_s: whole(&res_secs),
        offloaded_pass_s: whole(&off_secs),
        peak_device_bytes: peak,
        dit_depth: choice.depth,
        dit_resident_blocks: resident_ids,
        dit_predicted_step_s: choice.predicted_step_s,
        dit_budget_bytes: dit_budget,
    })
}
