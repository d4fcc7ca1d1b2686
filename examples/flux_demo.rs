//! The main job on a machine without a GPU: a small Flux-shaped transformer
//! (double blocks over image and text tokens, then single blocks over both, with
//! Flux's matrix shapes scaled down) run all-resident and then offloaded block by
//! block through the simulated device, with the two outputs compared byte for byte.
//!
//! `cargo xtask demo` runs it; `cargo run --release --example flux_demo --features sim`
//! does the same. Arguments: `--hidden N --double N --single N --steps N --depth N`.

use offload::sim::{SimBackend, SimConfig};
use offload::*;
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Instant;

struct Cfg {
    hidden: usize,
    heads: usize,
    mlp: usize,
    double: usize,
    single: usize,
    img_tokens: usize,
    txt_tokens: usize,
    steps: usize,
    depth: usize,
}

fn parse_args() -> Cfg {
    let mut c = Cfg { hidden: 192, heads: 3, mlp: 768, double: 4, single: 8, img_tokens: 96, txt_tokens: 16, steps: 3, depth: 1 };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i + 1 < args.len() {
        let v: usize = args[i + 1].parse().unwrap_or_else(|_| {
            eprintln!("{}: expected a number, got {:?}", args[i], args[i + 1]);
            std::process::exit(2)
        });
        match args[i].as_str() {
            "--hidden" => c.hidden = v,
            "--double" => c.double = v,
            "--single" => c.single = v,
            "--steps" => c.steps = v,
            "--depth" => c.depth = v,
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2)
            }
        }
        i += 2;
    }
    c.mlp = 4 * c.hidden;
    c.heads = (c.hidden / 64).max(1);
    c
}

/// Flux's tensor names and shapes (`[out, in]`), at `hidden`.
fn flux_tensors(c: &Cfg, seed: u64) -> Result<MemoryTensors> {
    let (h, m) = (c.hidden, c.mlp);
    let mut specs: Vec<(String, Vec<usize>)> = vec![
        ("img_in.weight".into(), vec![h, h]),
        ("vector_in.weight".into(), vec![h, h]),
        ("final_layer.linear.weight".into(), vec![h, h]),
    ];
    for i in 0..c.double {
        for s in ["img", "txt"] {
            let p = format!("double_blocks.{i}.{s}");
            specs.push((format!("{p}_mod.lin.weight"), vec![6 * h, h]));
            specs.push((format!("{p}_mod.lin.bias"), vec![6 * h]));
            specs.push((format!("{p}_attn.qkv.weight"), vec![3 * h, h]));
            specs.push((format!("{p}_attn.qkv.bias"), vec![3 * h]));
            specs.push((format!("{p}_attn.proj.weight"), vec![h, h]));
            specs.push((format!("{p}_attn.proj.bias"), vec![h]));
            specs.push((format!("{p}_mlp.0.weight"), vec![m, h]));
            specs.push((format!("{p}_mlp.0.bias"), vec![m]));
            specs.push((format!("{p}_mlp.2.weight"), vec![h, m]));
            specs.push((format!("{p}_mlp.2.bias"), vec![h]));
        }
    }
    for i in 0..c.single {
        let p = format!("single_blocks.{i}");
        specs.push((format!("{p}.modulation.lin.weight"), vec![3 * h, h]));
        specs.push((format!("{p}.modulation.lin.bias"), vec![3 * h]));
        specs.push((format!("{p}.linear1.weight"), vec![3 * h + m, h]));
        specs.push((format!("{p}.linear1.bias"), vec![3 * h + m]));
        specs.push((format!("{p}.linear2.weight"), vec![h, h + m]));
        specs.push((format!("{p}.linear2.bias"), vec![h]));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut t = MemoryTensors::new();
    for (name, shape) in specs {
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        let n: usize = shape.iter().product();
        let bytes: Vec<u8> = (0..n).flat_map(|_| (rng.gen_range(-1.0f32..1.0) / fan_in.sqrt()).to_le_bytes()).collect();
        t.push(TensorSpec::new(name, DType::F32, shape), bytes)?;
    }
    Ok(t)
}

/// A block's weights as f32, read from its slot.
struct Weights<'a> {
    layout: &'a BlockLayout,
    bytes: &'a [u8],
}

impl Weights<'_> {
    fn get(&self, name: &str) -> Vec<f32> {
        let t = self.layout.get(name).unwrap_or_else(|| panic!("tensor {name} missing from block"));
        self.bytes[t.offset..t.offset + t.nbytes].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
    /// `x [n, in] · Wᵀ + b` with `W [out, in]`.
    fn linear(&self, x: &[f32], n: usize, name: &str) -> Vec<f32> {
        let w = self.get(&format!("{name}.weight"));
        let b = self.get(&format!("{name}.bias"));
        linear(x, n, &w, &b)
    }
}

fn linear(x: &[f32], n: usize, w: &[f32], b: &[f32]) -> Vec<f32> {
    let out = b.len();
    let inp = w.len() / out;
    let mut y = vec![0f32; n * out];
    for r in 0..n {
        let xr = &x[r * inp..(r + 1) * inp];
        for (o, yo) in y[r * out..(r + 1) * out].iter_mut().enumerate() {
            let wr = &w[o * inp..(o + 1) * inp];
            *yo = b[o] + xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>();
        }
    }
    y
}

fn layer_norm(x: &[f32], h: usize) -> Vec<f32> {
    x.chunks(h)
        .flat_map(|r| {
            let mean = r.iter().sum::<f32>() / h as f32;
            let var = r.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
            let inv = 1.0 / (var + 1e-6).sqrt();
            r.iter().map(move |v| (v - mean) * inv)
        })
        .collect()
}

fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044_715 * x * x * x)).tanh())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn modulate(x: &[f32], h: usize, shift: &[f32], scale: &[f32]) -> Vec<f32> {
    layer_norm(x, h)
        .chunks(h)
        .flat_map(|r| r.iter().enumerate().map(|(j, v)| v * (1.0 + scale[j]) + shift[j]).collect::<Vec<_>>())
        .collect()
}

/// Multi-head attention over `qkv [n, 3h]`.
fn attention(qkv: &[f32], n: usize, h: usize, heads: usize) -> Vec<f32> {
    let d = h / heads;
    let mut out = vec![0f32; n * h];
    let scale = 1.0 / (d as f32).sqrt();
    let mut p = vec![0f32; n];
    for hd in 0..heads {
        for i in 0..n {
            let q = &qkv[i * 3 * h + hd * d..i * 3 * h + hd * d + d];
            let mut max = f32::MIN;
            for (j, pj) in p.iter_mut().enumerate() {
                let k = &qkv[j * 3 * h + h + hd * d..j * 3 * h + h + hd * d + d];
                *pj = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(*pj);
            }
            let sum: f32 = p
                .iter_mut()
                .map(|v| {
                    *v = (*v - max).exp();
                    *v
                })
                .sum();
            let o = &mut out[i * h + hd * d..i * h + hd * d + d];
            for (j, pj) in p.iter().enumerate() {
                let v = &qkv[j * 3 * h + 2 * h + hd * d..j * 3 * h + 2 * h + hd * d + d];
                for (oo, vv) in o.iter_mut().zip(v) {
                    *oo += pj / sum * vv;
                }
            }
        }
    }
    out
}

fn double_block(c: &Cfg, w: &Weights, img: &mut Vec<f32>, txt: &mut Vec<f32>, vec: &[f32]) {
    let (h, ni, nt) = (c.hidden, c.img_tokens, c.txt_tokens);
    let sv: Vec<f32> = vec.iter().map(|&v| silu(v)).collect();
    let im = w.linear(&sv, 1, "img_mod.lin");
    let tm = w.linear(&sv, 1, "txt_mod.lin");
    let m = |v: &[f32], k: usize| v[k * h..(k + 1) * h].to_vec();
    let img_qkv = w.linear(&modulate(img, h, &m(&im, 0), &m(&im, 1)), ni, "img_attn.qkv");
    let txt_qkv = w.linear(&modulate(txt, h, &m(&tm, 0), &m(&tm, 1)), nt, "txt_attn.qkv");
    let qkv: Vec<f32> = txt_qkv.iter().chain(&img_qkv).copied().collect();
    let att = attention(&qkv, nt + ni, h, c.heads);
    for (s, x, md, n, off) in [("img", &mut *img, &im, ni, nt), ("txt", &mut *txt, &tm, nt, 0)] {
        let proj = w.linear(&att[off * h..(off + n) * h], n, &format!("{s}_attn.proj"));
        let g1 = m(md, 2);
        for (k, v) in x.iter_mut().enumerate() {
            *v += g1[k % h] * proj[k];
        }
        let hid: Vec<f32> = w.linear(&modulate(x, h, &m(md, 3), &m(md, 4)), n, &format!("{s}_mlp.0")).into_iter().map(gelu).collect();
        let out = w.linear(&hid, n, &format!("{s}_mlp.2"));
        let g2 = m(md, 5);
        for (k, v) in x.iter_mut().enumerate() {
            *v += g2[k % h] * out[k];
        }
    }
}

fn single_block(c: &Cfg, w: &Weights, x: &mut [f32], vec: &[f32]) {
    let (h, mlp, n) = (c.hidden, c.mlp, c.img_tokens + c.txt_tokens);
    let sv: Vec<f32> = vec.iter().map(|&v| silu(v)).collect();
    let md = w.linear(&sv, 1, "modulation.lin");
    let y = w.linear(&modulate(x, h, &md[..h], &md[h..2 * h]), n, "linear1");
    let qkv: Vec<f32> = y.chunks(3 * h + mlp).flat_map(|r| r[..3 * h].to_vec()).collect();
    let att = attention(&qkv, n, h, c.heads);
    let cat: Vec<f32> = (0..n)
        .flat_map(|r| {
            att[r * h..(r + 1) * h]
                .iter()
                .copied()
                .chain(y[r * (3 * h + mlp) + 3 * h..(r + 1) * (3 * h + mlp)].iter().map(|&v| gelu(v)))
                .collect::<Vec<_>>()
        })
        .collect();
    let out = w.linear(&cat, n, "linear2");
    for (k, v) in x.iter_mut().enumerate() {
        *v += md[2 * h + k % h] * out[k];
    }
}

/// One denoising step: every block of the ring, in Flux's order.
fn step(c: &Cfg, ring: &mut Ring<SimBackend>, backend: &SimBackend, img0: &[f32], txt0: &[f32], vec: &[f32]) -> Result<Vec<f32>> {
    let (mut img, mut txt) = (img0.to_vec(), txt0.to_vec());
    for i in 0..c.double {
        let b = ring.block("double_blocks", i)?;
        backend.read_slot(b.slot(), |bytes| double_block(c, &Weights { layout: b.layout(), bytes }, &mut img, &mut txt, vec));
    }
    let mut x: Vec<f32> = txt.into_iter().chain(img).collect();
    for i in 0..c.single {
        let b = ring.block("single_blocks", i)?;
        backend.read_slot(b.slot(), |bytes| single_block(c, &Weights { layout: b.layout(), bytes }, &mut x, vec));
    }
    Ok(x)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn main() -> Result<()> {
    let c = parse_args();
    let tensors = flux_tensors(&c, 0xF1u64)?;
    let inventory = DeclaredStacks::new(["double_blocks", "single_blocks"]).discover("transformer", tensors.specs())?;
    let backend = SimBackend::new(SimConfig::fast());
    let store = Arc::new(HostStore::build(&backend, &inventory, &tensors)?);
    println!("offload demo: a Flux-shaped transformer on the simulated CPU device (no GPU needed)");
    println!(
        "  {} double blocks + {} single blocks, hidden {}, MLP {}, {} image + {} text tokens, f32",
        c.double, c.single, c.hidden, c.mlp, c.img_tokens, c.txt_tokens
    );
    println!(
        "  host store: {:.1} MiB in {} block buffers (tensor bytes {:.1} MiB), largest block {:.2} MiB",
        mib(store.host_bytes()),
        store.blocks().len(),
        mib(store.payload_bytes()),
        mib(store.largest_block_bytes() as u64)
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut rand_vec = |n: usize| (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect::<Vec<f32>>();
    let (img, txt, vec) = (rand_vec(c.img_tokens * c.hidden), rand_vec(c.txt_tokens * c.hidden), rand_vec(c.hidden));

    let mut outputs = Vec::new();
    for (label, plan) in [("resident", Plan::resident()), ("offloaded", Plan::layerwise().prefetch_depth(c.depth))] {
        let rc = resolve(&plan, std::slice::from_ref(&inventory))?.components.remove(0);
        backend.reset_counters();
        let mut ring = Ring::new(backend.clone(), store.clone(), &rc)?;
        let mut times = Vec::new();
        let mut out = Vec::new();
        let mut metrics = StepMetrics::default();
        for _ in 0..c.steps {
            let t = Instant::now();
            out = step(&c, &mut ring, &backend, &img, &txt, &vec)?;
            times.push(t.elapsed().as_secs_f64());
            metrics = ring.end_step()?;
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let peak = backend.stats().peak_bytes;
        println!("\n[{label}] step {:.1} ms (median of {}), peak device bytes for weights {:.2} MiB", median * 1e3, c.steps, mib(peak));
        println!("  last step: {metrics}");
        ring.close()?;
        backend.check()?;
        outputs.push((median, peak, out));
    }
    let (r, o) = (&outputs[0], &outputs[1]);
    let identical = r.2.iter().zip(&o.2).all(|(a, b)| a.to_bits() == b.to_bits()) && r.2.len() == o.2.len();
    println!("\noffloaded / resident step time: {:.3}", o.0 / r.0);
    println!(
        "device memory for weights: {:.2} MiB offloaded vs {:.2} MiB resident ({:.0} %)",
        mib(o.1),
        mib(r.1),
        100.0 * o.1 as f64 / r.1 as f64
    );
    println!("outputs bitwise identical: {}", if identical { "yes" } else { "NO" });
    if !identical {
        std::process::exit(1);
    }
    Ok(())
}
