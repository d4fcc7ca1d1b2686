//! Flux-dev-shaped transformer written with `tch::nn` (19 double + 38 single
//! blocks, hidden 3072, MLP 12288, bf16, `scaled_dot_product_attention`):
//! resident vs streamed (d = 1, 2) in one process, with the pinned bandwidth
//! measured in the same run. Needs the `cuda` feature and a GPU.
//!
//! `tch_bench [--resolutions 1024,2048] [--depths 1,2] [--steps 5] [--double 19] [--single 38] [--out F] [--commit C]`

use offload_core::{NameDiscovery, OffloadBackend, Plan, Result};
use offload_tch::tch::nn::{self, Module};
use offload_tch::tch::{self, Device, Kind, Tensor};
use offload_tch::TchOffload;
use std::time::Instant;

const H: i64 = 3072;
const HEADS: i64 = 24;
const HD: i64 = 128;
const MLP: i64 = 12288;
const TXT: i64 = 512;

fn lin(p: nn::Path, i: i64, o: i64) -> nn::Linear {
    nn::linear(p, i, o, Default::default())
}

fn scale(p: nn::Path) -> Tensor {
    p.var("scale", &[HD], nn::Init::Uniform { lo: 0.5, up: 1.5 })
}

struct Stream {
    m: nn::Linear,
    qkv: nn::Linear,
    proj: nn::Linear,
    qn: Tensor,
    kn: Tensor,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Stream {
    fn new(p: &nn::Path, pre: &str) -> Self {
        Stream {
            m: lin(p / format!("{pre}_mod") / "lin", H, 6 * H),
            qkv: lin(p / format!("{pre}_attn") / "qkv", H, 3 * H),
            proj: lin(p / format!("{pre}_attn") / "proj", H, H),
            qn: scale(p / format!("{pre}_attn") / "norm" / "query_norm"),
            kn: scale(p / format!("{pre}_attn") / "norm" / "key_norm"),
            fc1: lin(p / format!("{pre}_mlp") / 0, H, MLP),
            fc2: lin(p / format!("{pre}_mlp") / 2, MLP, H),
        }
    }
}

fn rms(x: &Tensor, s: &Tensor) -> Tensor {
    let f = x.to_kind(Kind::Float);
    let r = (f.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float) + 1e-6).rsqrt();
    (f * r).to_kind(x.kind()) * s
}

fn modulate(x: &Tensor, shift: &Tensor, sc: &Tensor) -> Tensor {
    x.layer_norm([H], None::<Tensor>, None::<Tensor>, 1e-6, false) * (sc + 1.0) + shift
}

/// `[B, T, 3H]` → q, k, v as `[B, heads, T, hd]`, q and k RMS-normed.
fn heads(qkv: &Tensor, qn: &Tensor, kn: &Tensor) -> (Tensor, Tensor, Tensor) {
    let (b, t) = (qkv.size()[0], qkv.size()[1]);
    let v = qkv.view([b, t, 3, HEADS, HD]).permute([2, 0, 3, 1, 4]);
    (rms(&v.get(0), qn), rms(&v.get(1), kn), v.get(2))
}

fn attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let o = Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, false, None, false);
    let (b, t) = (o.size()[0], o.size()[2]);
    o.transpose(1, 2).reshape([b, t, H])
}

struct Double {
    img: Stream,
    txt: Stream,
}

impl Double {
    fn forward(&self, img: &Tensor, txt: &Tensor, vec: &Tensor) -> (Tensor, Tensor) {
        let mi: Vec<Tensor> = self.img.m.forward(vec).unsqueeze(1).chunk(6, -1);
        let mt: Vec<Tensor> = self.txt.m.forward(vec).unsqueeze(1).chunk(6, -1);
        let (iq, ik, iv) = heads(&self.img.qkv.forward(&modulate(img, &mi[0], &mi[1])), &self.img.qn, &self.img.kn);
        let (tq, tk, tv) = heads(&self.txt.qkv.forward(&modulate(txt, &mt[0], &mt[1])), &self.txt.qn, &self.txt.kn);
        let a = attention(&Tensor::cat(&[tq, iq], 2), &Tensor::cat(&[tk, ik], 2), &Tensor::cat(&[tv, iv], 2));
        let (ta, ia) = (a.narrow(1, 0, TXT), a.narrow(1, TXT, img.size()[1]));
        let img = img + &mi[2] * self.img.proj.forward(&ia);
        let img = &img + &mi[5] * self.img.fc2.forward(&self.img.fc1.forward(&modulate(&img, &mi[3], &mi[4])).gelu("tanh"));
        let txt = txt + &mt[2] * self.txt.proj.forward(&ta);
        let txt = &txt + &mt[5] * self.txt.fc2.forward(&self.txt.fc1.forward(&modulate(&txt, &mt[3], &mt[4])).gelu("tanh"));
        (img, txt)
    }
}

struct Single {
    m: nn::Linear,
    l1: nn::Linear,
    l2: nn::Linear,
    qn: Tensor,
    kn: Tensor,
}

impl Single {
    fn forward(&self, x: &Tensor, vec: &Tensor) -> Tensor {
        let m: Vec<Tensor> = self.m.forward(vec).unsqueeze(1).chunk(3, -1);
        let y = self.l1.forward(&modulate(x, &m[0], &m[1]));
        let (qkv, mlp) = (y.narrow(2, 0, 3 * H), y.narrow(2, 3 * H, MLP));
        let (q, k, v) = heads(&qkv, &self.qn, &self.kn);
        let a = attention(&q, &k, &v);
        x + &m[2] * self.l2.forward(&Tensor::cat(&[a, mlp.gelu("tanh")], 2))
    }
}

struct Model {
    double: Vec<Double>,
    single: Vec<Single>,
}

fn model(vs: &nn::VarStore, nd: usize, ns: usize) -> Model {
    let r = vs.root();
    Model {
        double: (0..nd)
            .map(|i| {
                let p = &r / "double_blocks" / i;
                Double { img: Stream::new(&p, "img"), txt: Stream::new(&p, "txt") }
            })
            .collect(),
        single: (0..ns)
            .map(|i| {
                let p = &r / "single_blocks" / i;
                Single {
                    m: lin(&p / "modulation" / "lin", H, 3 * H),
                    l1: lin(&p / "linear1", H, 3 * H + MLP),
                    l2: lin(&p / "linear2", H + MLP, H),
                    qn: scale(&p / "norm" / "query_norm"),
                    kn: scale(&p / "norm" / "key_norm"),
                }
            })
            .collect(),
    }
}

/// One step; with `off`, each block's parameters are streamed in around it.
fn step(
    m: &Model,
    img: &Tensor,
    txt: &Tensor,
    vec: &Tensor,
    mut off: Option<&mut TchOffload<offload_tch::TchCudaBackend>>,
) -> Result<Tensor> {
    let (mut img, mut txt) = (img.shallow_clone(), txt.shallow_clone());
    for (i, b) in m.double.iter().enumerate() {
        let g = off.as_deref_mut().map(|o| o.block("double_blocks", i)).transpose()?;
        (img, txt) = b.forward(&img, &txt, vec);
        g.map(|g| g.finish()).transpose()?;
    }
    let mut x = Tensor::cat(&[txt, img], 1);
    for (i, b) in m.single.iter().enumerate() {
        let g = off.as_deref_mut().map(|o| o.block("single_blocks", i)).transpose()?;
        x = b.forward(&x, vec);
        g.map(|g| g.finish()).transpose()?;
    }
    if let Some(o) = off {
        o.end_step()?;
    }
    Ok(x)
}

fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let mut v = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut v, t.numel());
    v
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn list(args: &[String], name: &str, default: &str) -> Vec<usize> {
    let s = args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, String::as_str);
    s.split(',').filter_map(|x| x.parse().ok()).collect()
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let resolutions = list(&args, "--resolutions", "1024,2048");
    let depths = list(&args, "--depths", "1,2");
    let steps = list(&args, "--steps", "5")[0].max(1);
    let (nd, ns) = (list(&args, "--double", "19")[0], list(&args, "--single", "38")[0]);
    let opt = |n: &str| args.iter().position(|a| a == n).and_then(|i| args.get(i + 1)).cloned();
    let dev = Device::Cuda(0);
    let be = offload_tch::cuda_backend(0)?;
    tch::manual_seed(0);
    let _nograd = tch::no_grad_guard();
    let mut vs = nn::VarStore::new(dev);
    let m = model(&vs, nd, ns);
    vs.set_kind(Kind::BFloat16);
    let sync = || tch::Cuda::synchronize(0);
    let time_steps = |off: &mut Option<&mut TchOffload<offload_tch::TchCudaBackend>>,
                      img: &Tensor,
                      txt: &Tensor,
                      vec: &Tensor|
     -> Result<(Vec<f64>, Tensor)> {
        let mut out = step(&m, img, txt, vec, off.as_deref_mut())?; // warm-up
        let mut times = Vec::new();
        for _ in 0..steps {
            sync();
            let t = Instant::now();
            out = step(&m, img, txt, vec, off.as_deref_mut())?;
            sync();
            times.push(t.elapsed().as_secs_f64());
        }
        Ok((times, out))
    };
    let inputs = |res: usize| {
        let n = ((res / 16) * (res / 16)) as i64;
        let r = |s: &[i64]| (Tensor::randn(s, (Kind::Float, dev)) * 0.5).to_kind(Kind::BFloat16);
        (r(&[1, n, H]), r(&[1, TXT, H]), r(&[1, H]).silu())
    };
    // Resident runs first (every parameter on the GPU), outputs kept on the host.
    let mut resident = Vec::new();
    for &res in &resolutions {
        tch::manual_seed(res as i64);
        let (img, txt, vec) = inputs(res);
        let (times, out) = time_steps(&mut None, &img, &txt, &vec)?;
        eprintln!("{res}x{res}: tch resident step {:.4} s", median(times.clone()));
        resident.push((res, times, bytes(&out)));
    }
    // Block parameters to the host store (the GPU copies are dropped).
    let t = Instant::now();
    let mut off = TchOffload::new(be.clone(), &vs, "transformer", &NameDiscovery, &Plan::layerwise())?;
    let store = off.ring().store().clone();
    let total: u64 = store.blocks().iter().map(|b| b.bytes() as u64).sum();
    let largest = store.largest_block_bytes() as u64;
    eprintln!(
        "host store: {:.2} GiB pinned in {} blocks in {:.1} s",
        total as f64 / (1u64 << 30) as f64,
        store.blocks().len(),
        t.elapsed().as_secs_f64()
    );
    let bandwidth = offload_core::probe_bandwidth(&be, &store, 3)?;
    eprintln!("pinned H2D bandwidth: {:.1} GB/s", bandwidth / 1e9);
    let mut cases = Vec::new();
    for (res, rtimes, rout) in &resident {
        let res = *res;
        tch::manual_seed(res as i64);
        let (img, txt, vec) = inputs(res);
        let resident_s = median(rtimes.clone());
        for &d in &depths {
            off.replan(&Plan::layerwise().prefetch_depth(d))?;
            be.synchronize()?;
            // The ring's slots are the backend's only allocations (libtorch's
            // activations come from its own allocator): peak = weights on device.
            be.reset_peak();
            let (times, out) = time_steps(&mut Some(&mut off), &img, &txt, &vec)?;
            let peak = be.counters().peak_bytes;
            let streamed = median(times.clone());
            let bound = resident_s.max(total as f64 / bandwidth);
            let equal = bytes(&out) == *rout;
            let m = off.ring().metrics();
            eprintln!(
                "{res}x{res} d={d}: tch streamed {streamed:.4} s, bound {bound:.4} s, ratio {:.4}, peak {:.2} GiB, bitwise_equal {equal}, misses {}",
                streamed / bound,
                peak as f64 / (1u64 << 30) as f64,
                m.misses
            );
            cases.push(serde_json::json!({
                "resolution": res, "tokens": (res / 16) * (res / 16) + TXT as usize, "batch": 1, "depth": d, "budget_bytes": null,
                "step_resident_s": resident_s, "steps_resident_s": rtimes, "step_streamed_s": streamed, "steps_streamed_s": times,
                "streamed_bytes": total, "bandwidth_gbps": bandwidth / 1e9, "bound_s": bound, "ratio_to_bound": streamed / bound,
                "peak_device_bytes": peak, "peak_bound_bytes": (d as u64 + 1) * largest, "peak_within_bound": peak <= (d as u64 + 1) * largest,
                "bitwise_equal": equal, "misses": m.misses,
            }));
        }
    }
    off.close()?;
    let doc = serde_json::json!({
        "date": std::env::var("BENCH_DATE").unwrap_or_default(), "commit": opt("--commit").unwrap_or_default(),
        "gpu": be.cuda().device_name().unwrap_or_default(), "backend": "tch",
        "model": format!("flux-dev-shaped tch::nn: {nd} double + {ns} single blocks, hidden 3072, mlp 12288, bf16, SDPA, random weights"),
        "block_bytes_total": total, "largest_block_bytes": largest, "cases": cases, "anchors": [],
    });
    if let Some(out) = opt("--out") {
        std::fs::write(&out, serde_json::to_string_pretty(&doc).unwrap_or_default())
            .map_err(|e| offload_core::Error::Io { path: out.into(), source: e })?;
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tch_bench: {e}");
        std::process::exit(1);
    }
}
