//! An unmodified `tch::nn` model streamed block by block on the CPU: output
//! byte-identical to the resident run, parameters emptied between blocks.
#![cfg(feature = "libtorch")]

use offload_core::{NameDiscovery, Plan};
use offload_tch::tch::nn::{self, Module};
use offload_tch::tch::{self, Device, Kind, Tensor};
use offload_tch::TchOffload;

const H: i64 = 96;

/// A small transformer-ish stack: per block, layer norm → linear → gelu → linear, residual.
struct Block {
    norm: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
}

impl Block {
    fn new(p: nn::Path, mlp: i64) -> Self {
        Block {
            norm: nn::layer_norm(&p / "norm", vec![H], Default::default()),
            up: nn::linear(&p / "up", H, mlp, Default::default()),
            down: nn::linear(&p / "down", mlp, H, Default::default()),
        }
    }
    fn forward(&self, x: &Tensor) -> Tensor {
        x + self.down.forward(&self.up.forward(&self.norm.forward(x)).gelu("none"))
    }
}

struct Model {
    embed: nn::Linear,
    double: Vec<Block>,
    single: Vec<Block>,
}

fn model(vs: &nn::VarStore, kind: Kind) -> Model {
    let r = vs.root();
    let m = Model {
        embed: nn::linear(&r / "embed", 16, H, Default::default()),
        double: (0..3).map(|i| Block::new(&r / "double_blocks" / i, 4 * H)).collect(),
        single: (0..5).map(|i| Block::new(&r / "single_blocks" / i, 2 * H)).collect(),
    };
    // Fresh random values everywhere (layer norms start at ones and zeros).
    tch::no_grad(|| {
        for (_, mut v) in vs.variables() {
            let r = Tensor::randn(v.size(), (Kind::Float, Device::Cpu)) * 0.2;
            v.copy_(&r.to_kind(kind));
        }
    });
    m
}

fn run(kind: Kind, depth: usize) {
    tch::manual_seed(7);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs, kind);
    if kind != Kind::Float {
        vs.set_kind(kind);
    }
    let _g = tch::no_grad_guard();
    let x0 = (Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu))).to_kind(kind);
    let resident = {
        let mut x = m.embed.forward(&x0);
        for b in m.double.iter().chain(&m.single) {
            x = b.forward(&x);
        }
        x
    };
    let mut off = TchOffload::cpu(&vs, "transformer", &NameDiscovery, &Plan::layerwise().prefetch_depth(depth)).unwrap();
    // Block parameters no longer hold memory in the VarStore; non-block ones do.
    let vars = vs.variables();
    assert_eq!(vars["double_blocks.0.up.weight"].numel(), 0);
    assert_eq!(vars["embed.weight"].numel(), (16 * H) as usize);
    for step in 0..2 {
        let mut x = m.embed.forward(&x0);
        for (stack, blocks) in [("double_blocks", &m.double), ("single_blocks", &m.single)] {
            for (i, b) in blocks.iter().enumerate() {
                let block = off.block(stack, i).unwrap();
                assert_eq!(vars[&format!("{stack}.{i}.up.weight")].size(), b.up.ws.size());
                assert!(b.up.ws.numel() > 0, "the module sees the streamed weight");
                x = b.forward(&x);
                block.finish().unwrap();
                assert_eq!(b.up.ws.numel(), 0, "back at its placeholder after the block");
            }
        }
        let metrics = off.end_step().unwrap();
        assert_eq!(metrics.misses, 0);
        assert_eq!(
            resident_bytes(&resident),
            resident_bytes(&x),
            "step {step}: streamed output differs from the resident run ({kind:?}, d = {depth})"
        );
    }
    off.close().unwrap();
}

fn resident_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let n = t.numel() * t.kind().elt_size_in_bytes();
    let mut v = vec![0u8; n];
    t.copy_data_u8(&mut v, t.numel());
    v
}

#[test]
fn streamed_equals_resident_f32_d1() {
    run(Kind::Float, 1);
}

#[test]
fn streamed_equals_resident_bf16_d2() {
    run(Kind::BFloat16, 2);
}

/// fp8 weights streamed as stored: the linear weights held as float8_e4m3fn (one
/// byte a weight on the link), each layer upcast to bf16 where it computes, the
/// way diffusers' layerwise casting computes; bitwise equal to the resident
/// model computing the same way.
#[test]
fn fp8_weights_stream_as_stored_and_upcast_per_layer() {
    tch::manual_seed(9);
    let mut vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs, Kind::BFloat16);
    vs.set_kind(Kind::BFloat16);
    let _g = tch::no_grad_guard();
    let mut fp8 = 0;
    for (name, mut v) in vs.variables() {
        if name.ends_with("up.weight") || name.ends_with("down.weight") {
            v.set_data(&v.to_kind(Kind::Float8e4m3fn));
            fp8 += v.numel();
        }
    }
    assert_eq!(m.double[0].up.ws.kind(), Kind::Float8e4m3fn, "the module holds fp8 weights");
    let lin = |l: &nn::Linear, x: &Tensor| x.matmul(&l.ws.to_kind(Kind::BFloat16).tr()) + l.bs.as_ref().unwrap();
    let forward = |b: &Block, x: &Tensor| x + lin(&b.down, &lin(&b.up, &b.norm.forward(x)).gelu("none"));
    let x0 = Tensor::randn([2, 5, 16], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
    let resident = m.double.iter().chain(&m.single).fold(m.embed.forward(&x0), |x, b| forward(b, &x));
    let block_params: i64 = vs.variables().iter().filter(|(n, _)| n.contains("_blocks.")).map(|(_, v)| v.numel() as i64).sum();
    let mut off = TchOffload::cpu(&vs, "transformer", &NameDiscovery, &Plan::layerwise()).unwrap();
    let mut x = m.embed.forward(&x0);
    for (stack, blocks) in [("double_blocks", &m.double), ("single_blocks", &m.single)] {
        for (i, b) in blocks.iter().enumerate() {
            let block = off.block(stack, i).unwrap();
            assert_eq!(b.up.ws.kind(), Kind::Float8e4m3fn, "bound as stored");
            x = forward(b, &x);
            block.finish().unwrap();
        }
    }
    let metrics = off.end_step().unwrap();
    off.close().unwrap();
    let out = resident_bytes(&x);
    assert!(x.isfinite().all().int64_value(&[]) == 1 && x.std(true).double_value(&[]) > 0.0);
    assert_eq!(resident_bytes(&resident), out, "streamed fp8 output differs from the resident run");
    // Fewer bytes than the same blocks in bf16: the fp8 weights cross at one byte each.
    assert!(
        (metrics.bytes_copied as i64) < 2 * block_params - fp8 as i64 / 2,
        "{} bytes a step, {block_params} block parameters, {fp8} fp8",
        metrics.bytes_copied
    );
}

#[test]
fn a_model_without_stacks_is_an_error() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _l = nn::linear(vs.root() / "only", 4, 4, Default::default());
    let e = TchOffload::cpu(&vs, "tiny", &NameDiscovery, &Plan::layerwise()).err().expect("no stacks").to_string();
    assert!(e.contains("no block stacks"), "{e}");
}
