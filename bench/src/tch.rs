//! tch's file: the registry's blocks computed with libtorch's kernels (cuBLAS
//! linears, `scaled_dot_product_attention`), resident and streamed through
//! [`offload_tch::TchOffload`] in one process.

use crate::harness::{RunDoc, RunOptions as Options};
use crate::registry::{dual_names, BlockKind, Case, DualNames, Model};
use offload_core::sim::SimBackend;
use offload_core::{DeclaredStacks, Plan};
use offload_tch::tch::{self, nn, Device, Kind, Tensor};
#[cfg(feature = "tch-cuda")]
use offload_tch::TchCudaBackend;
use offload_tch::{TchOffload, TchSlots};
use std::collections::HashMap;

mod pipeline;
#[cfg(feature = "tch-cuda")]
pub use pipeline::run_pipeline;
pub use pipeline::{check_pipeline_cpu, Pipeline, PipelineCpuCheck, PipelineOptions};

type W = HashMap<String, Tensor>;

/// `m`'s block stacks, declared in the order a step runs them.
fn prefixes(m: &Model) -> DeclaredStacks {
    DeclaredStacks::new(m.stacks.iter().map(|s| s.prefix).collect::<Vec<_>>())
}

fn err(what: impl std::fmt::Display) -> String {
    format!("tch: {what}")
}

/// One block: its stack, index, kind and parameters (handles that share the
/// VarStore's variables, so the ring's binds show through).
struct Block {
    stack: &'static str,
    index: usize,
    kind: BlockKind,
    w: W,
}

struct Net<'m> {
    model: &'m Model,
    names: DualNames,
    /// SD3's joint blocks: image first, no rotary positions.
    sd3: bool,
    globals: W,
    blocks: Vec<Block>,
}

struct Inputs {
    latents: Tensor,
    text: Tensor,
    pooled: Option<Tensor>,
    t: f64,
    guidance: f64,
    /// Rotary tables `[1, T, 1, hd]`: interleaved `(c, c)` / `(-s, s)` pairs for
    /// the diffusion models (`rope_pairs`), rotate-half halves for the decoder.
    cos: Tensor,
    sin: Tensor,
    text_tokens: i64,
    /// Token ids `[B, T]` for a text encoder (no latents then).
    ids: Option<Tensor>,
}

/// Whether tch's file computes every block of `model`: the dual- and single-stream
/// blocks (Flux, Qwen-Image), T5's encoder blocks and decoder layers used as an
/// encoder (Qwen2.5-VL's language model).
pub fn computes(model: &Model) -> bool {
    model.stacks.iter().all(|s| match s.kind {
        // SD3's context-only last block is a dual-stream override the file handles.
        BlockKind::DualStream => s.overrides.iter().all(|(i, _)| *i + 1 == s.count),
        BlockKind::SingleStream | BlockKind::Decoder => s.overrides.is_empty(),
        BlockKind::T5 => s.overrides.iter().all(|(i, _)| *i == 0),
        BlockKind::Wan | BlockKind::ZImage => s.overrides.is_empty(),
        // Every up block differs in its channels: each is an override.
        BlockKind::VaeUp => true,
    })
}

/// Rotary positions on adjacent pairs of the last dimension of `x` `[B, T, heads,
/// hd]`, computed in f32, with interleaved tables `[1, T, 1, hd]`: `cos` as
/// `(c, c)` per pair and `sin` as `(-s, s)`, so that a pair `(re, im)` becomes
/// `(re c - im s, im c + re s)` = `x * cos + swap(x) * sin`. Three kernels read
/// `x` (the product promotes to f32, the swap stays bf16, `addcmul_` accumulates)
/// where the per-component form took nine.
fn rope_pairs(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let s = x.size();
    let swapped = x.reshape([s[0], s[1], s[2], s[3] / 2, 2]).flip([-1]).reshape([s[0], s[1], s[2], s[3]]);
    let mut out = x * cos;
    let _ = out.addcmul_(&swapped, sin);
    out.to_kind(x.kind())
}

/// T5's bidirectional relative position buckets (32 buckets, max distance 128) as
/// an additive attention bias `[1, heads, T, T]` from block 0's table `[32, heads]`:
/// a new tensor, so it outlives the block that served the table.
fn t5_bias(table: &Tensor, t: i64, kind: Kind) -> Tensor {
    let dev = table.device();
    let pos = Tensor::arange(t, (Kind::Int64, dev));
    let rel = pos.unsqueeze(0) - pos.unsqueeze(1);
    let (half, exact) = (16i64, 8i64);
    let n = rel.abs();
    let large = (n.clamp_min(1).to_kind(Kind::Float) / exact as f64).log() / (128f64 / exact as f64).ln() * (half - exact) as f64;
    let large = (large.to_kind(Kind::Int64) + exact).clamp_max(half - 1);
    let bucket = rel.gt(0).to_kind(Kind::Int64) * half + n.where_self(&n.lt(exact), &large);
    let heads = table.size()[1];
    table.index_select(0, &bucket.flatten(0, -1)).view([t, t, heads]).permute([2, 0, 1]).unsqueeze(0).to_kind(kind)
}

fn get<'a>(w: &'a W, name: &str) -> &'a Tensor {
    w.get(name).unwrap_or_else(|| panic!("registry parameter {name} missing from the VarStore"))
}

/// A linear layer without bias (`{name}.weight` only).
fn nobias(x: &Tensor, w: &W, name: &str) -> Tensor {
    x.linear::<Tensor>(get(w, &format!("{name}.weight")), None)
}

fn lin(x: &Tensor, w: &W, name: &str) -> Tensor {
    x.linear(get(w, &format!("{name}.weight")), Some(get(w, &format!("{name}.bias"))))
}

/// RMS norm over the last dimension with scale `s`: libtorch's `rms_norm` (one
/// fused kernel on CUDA, as `torch.nn.RMSNorm` in diffusers' attention).
fn rms(x: &Tensor, s: &Tensor) -> Tensor {
    rms_eps(x, s, 1e-6)
}

/// [`rms`] with its epsilon (Z-Image's norms use 1e-5, as diffusers' `norm_eps`).
fn rms_eps(x: &Tensor, s: &Tensor, eps: f64) -> Tensor {
    let d = *x.size().last().unwrap_or(&1);
    x.rms_norm([d], Some(s), eps)
}

fn ln(x: &Tensor, h: i64) -> Tensor {
    x.layer_norm([h], None::<Tensor>, None::<Tensor>, 1e-6, false)
}

/// A group norm of 32 groups (ε = 1e-6, as diffusers' VAE).
fn gn(x: &Tensor, w: &W, name: &str) -> Tensor {
    x.group_norm(32, Some(get(w, &format!("{name}.weight"))), Some(get(w, &format!("{name}.bias"))), 1e-6, true)
}

/// A 2-D convolution, stride 1, `pad` on each side.
fn conv(x: &Tensor, w: &W, name: &str, pad: i64) -> Tensor {
    x.conv2d(get(w, &format!("{name}.weight")), Some(get(w, &format!("{name}.bias"))), [1, 1], [pad, pad], [1, 1], 1)
}

/// A VAE ResNet block (diffusers' `ResnetBlock2D` without a time embedding).
fn resnet(x: &Tensor, w: &W, name: &str) -> Tensor {
    let h = conv(&gn(x, w, &format!("{name}.norm1")).silu(), w, &format!("{name}.conv1"), 1);
    let h = conv(&gn(&h, w, &format!("{name}.norm2")).silu(), w, &format!("{name}.conv2"), 1);
    let shortcut = format!("{name}.conv_shortcut");
    if w.contains_key(&format!("{shortcut}.weight")) {
        conv(x, w, &shortcut, 0) + h
    } else {
        x + h
    }
}

/// The VAE's middle attention: one head over every pixel, residual.
fn vae_attention(x: &Tensor, w: &W, name: &str) -> Tensor {
    let s = x.size();
    let (b, c, hw) = (s[0], s[1], s[2] * s[3]);
    let y = gn(x, w, &format!("{name}.group_norm")).view([b, c, hw]).transpose(1, 2);
    let qkv: Vec<Tensor> = ["to_q", "to_k", "to_v"].iter().map(|l| lin(&y, w, &format!("{name}.{l}")).unsqueeze(1)).collect();
    let o = Tensor::scaled_dot_product_attention(&qkv[0], &qkv[1], &qkv[2], None::<Tensor>, 0.0, false, None, false).squeeze_dim(1);
    x + lin(&o, w, &format!("{name}.to_out.0")).transpose(1, 2).reshape([b, c, s[2], s[3]])
}

fn modulate(x: &Tensor, h: i64, shift: &Tensor, scale: &Tensor) -> Tensor {
    ln(x, h) * (scale + 1.0) + shift
}

/// Sinusoidal embedding of `t` (256 wide, cos first), as diffusers' `Timesteps`.
fn sinusoid(t: f64, dev: Device) -> Tensor {
    let half = 128;
    let freqs = (Tensor::arange(half, (Kind::Float, dev)) * (-(10000f64.ln()) / half as f64)).exp();
    let a = freqs * (t * 1000.0);
    Tensor::cat(&[a.cos(), a.sin()], -1).unsqueeze(0).to_kind(Kind::BFloat16)
}

impl Net<'_> {
    fn h(&self) -> i64 {
        self.model.hidden as i64
    }

    /// `[B, T, H]` → `[B, T, heads, hd]`: the projection's own layout, in which q
    /// and k are normalised and rotated (as diffusers does); attention permutes.
    fn heads(&self, x: &Tensor) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        x.view([b, t, self.model.heads as i64, self.model.head_dim as i64])
    }

    fn rope(&self, x: &Tensor, i: &Inputs) -> Tensor {
        rope_pairs(x, &i.cos, &i.sin)
    }

    /// Attention over `[B, T, heads, hd]` inputs, back to `[B, T, H]`.
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let (q, k, v) = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2));
        let o = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, false, None, false);
        let (b, t) = (o.size()[0], o.size()[2]);
        o.transpose(1, 2).reshape([b, t, self.h()])
    }

    fn mlp(&self, x: &Tensor, w: &W, name: &str) -> Tensor {
        lin(&lin(x, w, &format!("{name}.net.0.proj")).gelu("tanh"), w, &format!("{name}.net.2"))
    }

    /// A dual-stream block. Flux and Qwen-Image: text first in the joint sequence,
    /// rotary positions. SD3 (`self.sd3`): image first, no rotary positions, and a
    /// last block whose context is only projected for attention (it has no
    /// `attn.to_add_out`; the text stream leaves it unchanged, and unused).
    fn dual(&self, w: &W, img: &Tensor, txt: &Tensor, temb: &Tensor, i: &Inputs) -> (Tensor, Tensor) {
        let n = self.names;
        let h = self.h();
        let st = temb.silu();
        let pre_only = !w.contains_key("attn.to_add_out.weight");
        let mi: Vec<Tensor> = lin(&st, w, n.img_mod).unsqueeze(1).chunk(6, -1);
        let mt: Vec<Tensor> = lin(&st, w, n.txt_mod).unsqueeze(1).chunk(if pre_only { 2 } else { 6 }, -1);
        let ni = modulate(img, h, &mi[0], &mi[1]);
        // The context-only block's norm is continuous (scale, shift), not zero-gated.
        let nt = if pre_only { modulate(txt, h, &mt[1], &mt[0]) } else { modulate(txt, h, &mt[0], &mt[1]) };
        let q = |x: &Tensor, l: &str, norm: Option<&str>| {
            let y = self.heads(&lin(x, w, &format!("attn.{l}")));
            match norm {
                Some(nm) => rms(&y, get(w, &format!("attn.{nm}.weight"))),
                None => y,
            }
        };
        let joint = |t: Tensor, im: Tensor| if self.sd3 { Tensor::cat(&[im, t], 1) } else { Tensor::cat(&[t, im], 1) };
        let qq = joint(q(&nt, "add_q_proj", Some("norm_added_q")), q(&ni, "to_q", Some("norm_q")));
        let kk = joint(q(&nt, "add_k_proj", Some("norm_added_k")), q(&ni, "to_k", Some("norm_k")));
        let vv = joint(q(&nt, "add_v_proj", None), q(&ni, "to_v", None));
        let a = if self.sd3 { self.attention(&qq, &kk, &vv) } else { self.attention(&self.rope(&qq, i), &self.rope(&kk, i), &vv) };
        let (nimg, ntxt) = (img.size()[1], txt.size()[1]);
        let (ta, ia) =
            if self.sd3 { (a.narrow(1, nimg, ntxt), a.narrow(1, 0, nimg)) } else { (a.narrow(1, 0, ntxt), a.narrow(1, ntxt, nimg)) };
        let img = img + &mi[2] * lin(&ia, w, "attn.to_out.0");
        let img = &img + &mi[5] * self.mlp(&modulate(&img, h, &mi[3], &mi[4]), w, n.img_mlp);
        if pre_only {
            return (img, txt.shallow_clone());
        }
        let txt = txt + &mt[2] * lin(&ta, w, "attn.to_add_out");
        let txt = &txt + &mt[5] * self.mlp(&modulate(&txt, h, &mt[3], &mt[4]), w, n.txt_mlp);
        (img, txt)
    }

    fn single(&self, w: &W, x: &Tensor, temb: &Tensor, i: &Inputs) -> Tensor {
        let h = self.h();
        let m: Vec<Tensor> = lin(&temb.silu(), w, "norm.linear").unsqueeze(1).chunk(3, -1);
        let nx = modulate(x, h, &m[0], &m[1]);
        let mlp = lin(&nx, w, "proj_mlp").gelu("tanh");
        let q = rms(&self.heads(&lin(&nx, w, "attn.to_q")), get(w, "attn.norm_q.weight"));
        let k = rms(&self.heads(&lin(&nx, w, "attn.to_k")), get(w, "attn.norm_k.weight"));
        let v = self.heads(&lin(&nx, w, "attn.to_v"));
        let a = self.attention(&self.rope(&q, i), &self.rope(&k, i), &v);
        x + &m[2] * lin(&Tensor::cat(&[a, mlp], 2), w, "proj_out")
    }

    /// A Wan 2.1 block over the video tokens `x` with the projected text `ctx` and
    /// the step's modulation `tproj` `[B, 6, H]`: modulated self-attention (q and k
    /// normalised across heads, rotary positions), cross-attention to the text
    /// after an affine norm, modulated FFN.
    fn wan(&self, w: &W, x: &Tensor, ctx: &Tensor, tproj: &Tensor, i: &Inputs) -> Tensor {
        let h = self.h();
        let m: Vec<Tensor> = (get(w, "scale_shift_table") + tproj).chunk(6, 1);
        let qk = |x: &Tensor, a: &str, l: &str, norm: &str| {
            self.heads(&rms(&lin(x, w, &format!("{a}.{l}")), get(w, &format!("{a}.{norm}.weight"))))
        };
        let n1 = modulate(x, h, &m[0], &m[1]);
        let n = x.size()[1];
        let (cos, sin) = (i.cos.narrow(1, 0, n), i.sin.narrow(1, 0, n));
        let rot = |y: &Tensor| rope_pairs(y, &cos, &sin);
        let q = rot(&qk(&n1, "attn1", "to_q", "norm_q"));
        let k = rot(&qk(&n1, "attn1", "to_k", "norm_k"));
        let v = self.heads(&lin(&n1, w, "attn1.to_v"));
        let x = x + lin(&self.attention(&q, &k, &v), w, "attn1.to_out.0") * &m[2];
        let n2 = x.layer_norm([h], Some(get(w, "norm2.weight")), Some(get(w, "norm2.bias")), 1e-6, false);
        let q = qk(&n2, "attn2", "to_q", "norm_q");
        let k = qk(ctx, "attn2", "to_k", "norm_k");
        let v = self.heads(&lin(ctx, w, "attn2.to_v"));
        let x = &x + lin(&self.attention(&q, &k, &v), w, "attn2.to_out.0");
        &x + self.mlp(&modulate(&x, h, &m[3], &m[4]), w, "ffn") * &m[5]
    }

    /// A Wan 2.1 forward call: patch embedding (the 1 × 2 × 2 convolution as a
    /// linear over patchified latents), time and text embedders, every block,
    /// the modulated output norm and projection.
    fn video<B: TchSlots>(&self, i: &Inputs, mut off: Option<&mut TchOffload<B>>) -> offload_core::Result<Tensor> {
        let g = &self.globals;
        let dev = i.latents.device();
        let h = self.h();
        let mut x = i.latents.linear(&get(g, "patch_embedding.weight").view([h, -1]), Some(get(g, "patch_embedding.bias")));
        let temb = lin(
            &lin(&sinusoid(i.t, dev), g, "condition_embedder.time_embedder.linear_1").silu(),
            g,
            "condition_embedder.time_embedder.linear_2",
        );
        let b = temb.size()[0];
        let tproj = lin(&temb.silu(), g, "condition_embedder.time_proj").view([b, 6, h]);
        let ctx =
            lin(&lin(&i.text, g, "condition_embedder.text_embedder.linear_1").gelu("tanh"), g, "condition_embedder.text_embedder.linear_2");
        for blk in &self.blocks {
            let guard = off.as_deref_mut().map(|o| o.block(blk.stack, blk.index)).transpose()?;
            x = match blk.kind {
                BlockKind::Wan => self.wan(&blk.w, &x, &ctx, &tproj, i),
                other => {
                    return Err(offload_core::Error::unsupported(
                        "tch (bench room)",
                        format!("{other:?} blocks in a Wan model ({}.{})", blk.stack, blk.index),
                    ))
                }
            };
            guard.map(|g| g.finish()).transpose()?;
        }
        let e: Vec<Tensor> = (get(g, "scale_shift_table") + temb.unsqueeze(1)).chunk(2, 1);
        let out = lin(&modulate(&x, h, &e[0], &e[1]), g, "proj_out");
        if let Some(o) = off {
            o.end_step()?;
        }
        Ok(out)
    }

    /// A Z-Image block: sandwich RMS norms around attention (q and k normalised
    /// per head, rotary positions from `pos`, the first position of this block's
    /// sequence in the step's tables) and a SwiGLU feed-forward; modulated (scales
    /// and tanh gates from `adaln`) where the block has `adaLN_modulation`.
    fn zimage(&self, w: &W, x: &Tensor, adaln: &Tensor, pos: i64, i: &Inputs) -> Tensor {
        let n = x.size()[1];
        let norm = |y: &Tensor, name: &str| rms_eps(y, get(w, &format!("{name}.weight")), 1e-5);
        let m: Option<Vec<Tensor>> =
            w.contains_key("adaLN_modulation.0.weight").then(|| lin(adaln, w, "adaLN_modulation.0").unsqueeze(1).chunk(4, 2));
        let scaled = |y: Tensor, k: usize| match &m {
            Some(m) => y * (&m[k] + 1.0),
            None => y,
        };
        let gated = |y: Tensor, k: usize| match &m {
            Some(m) => m[k].tanh() * y,
            None => y,
        };
        let n1 = scaled(norm(x, "attention_norm1"), 0);
        let (cos, sin) = (i.cos.narrow(1, pos, n), i.sin.narrow(1, pos, n));
        let q = rope_pairs(&rms_eps(&self.heads(&nobias(&n1, w, "attention.to_q")), get(w, "attention.norm_q.weight"), 1e-5), &cos, &sin);
        let k = rope_pairs(&rms_eps(&self.heads(&nobias(&n1, w, "attention.to_k")), get(w, "attention.norm_k.weight"), 1e-5), &cos, &sin);
        let v = self.heads(&nobias(&n1, w, "attention.to_v"));
        let a = nobias(&self.attention(&q, &k, &v), w, "attention.to_out.0");
        let x = x + gated(norm(&a, "attention_norm2"), 1);
        let f = scaled(norm(&x, "ffn_norm1"), 2);
        let f = nobias(&(nobias(&f, w, "feed_forward.w1").silu() * nobias(&f, w, "feed_forward.w3")), w, "feed_forward.w2");
        &x + gated(norm(&f, "ffn_norm2"), 3)
    }

    /// A Z-Image forward call: the image tokens through the noise refiner, the
    /// caption through the context refiner, then both (image first) through the
    /// main layers, and the final layer's scaled norm and projection.
    fn zimage_step<B: TchSlots>(&self, i: &Inputs, mut off: Option<&mut TchOffload<B>>) -> offload_core::Result<Tensor> {
        let g = &self.globals;
        let dev = i.latents.device();
        let adaln = lin(&lin(&sinusoid(i.t, dev), g, "t_embedder.mlp.0").silu(), g, "t_embedder.mlp.2");
        let mut x = lin(&i.latents, g, "all_x_embedder.2-1");
        let mut cap = lin(&rms_eps(&i.text, get(g, "cap_embedder.0.weight"), 1e-5), g, "cap_embedder.1");
        let n = x.size()[1];
        let mut unified: Option<Tensor> = None;
        for blk in &self.blocks {
            let guard = off.as_deref_mut().map(|o| o.block(blk.stack, blk.index)).transpose()?;
            if blk.kind != BlockKind::ZImage {
                return Err(offload_core::Error::unsupported(
                    "tch (bench room)",
                    format!("{:?} blocks in Z-Image ({}.{})", blk.kind, blk.stack, blk.index),
                ));
            }
            match blk.stack {
                "noise_refiner" => x = self.zimage(&blk.w, &x, &adaln, 0, i),
                "context_refiner" => cap = self.zimage(&blk.w, &cap, &adaln, n, i),
                _ => {
                    let u = unified.take().unwrap_or_else(|| Tensor::cat(&[&x, &cap], 1));
                    unified = Some(self.zimage(&blk.w, &u, &adaln, 0, i));
                }
            }
            guard.map(|g| g.finish()).transpose()?;
        }
        let u = unified.unwrap_or_else(|| Tensor::cat(&[&x, &cap], 1));
        let scale = lin(&adaln.silu(), g, "all_final_layer.2-1.adaLN_modulation.1").unsqueeze(1) + 1.0;
        let out = lin(&(ln(&u, self.h()) * scale), g, "all_final_layer.2-1.linear").narrow(1, 0, n);
        if let Some(o) = off {
            o.end_step()?;
        }
        Ok(out)
    }

    /// T5's encoder block (pre-norm self-attention without scaling, plus the
    /// relative bias block 0 made; gated-GELU FFN).
    fn t5(&self, w: &W, x: &Tensor, bias: &mut Option<Tensor>) -> Tensor {
        let t = x.size()[1];
        let pb = bias
            .get_or_insert_with(|| t5_bias(get(w, "layer.0.SelfAttention.relative_attention_bias.weight"), t, x.kind()))
            .shallow_clone();
        let n = rms(x, get(w, "layer.0.layer_norm.weight"));
        let (q, k, v) = ["q", "k", "v"].map(|l| self.heads(&nobias(&n, w, &format!("layer.0.SelfAttention.{l}"))).transpose(1, 2)).into();
        let o = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(pb), 0.0, false, Some(1.0), false);
        let (b, t) = (o.size()[0], o.size()[2]);
        let x = x + nobias(&o.transpose(1, 2).reshape([b, t, self.h()]), w, "layer.0.SelfAttention.o");
        let n = rms(&x, get(w, "layer.1.layer_norm.weight"));
        let ff = "layer.1.DenseReluDense";
        &x + nobias(&(nobias(&n, w, &format!("{ff}.wi_0")).gelu("tanh") * nobias(&n, w, &format!("{ff}.wi_1"))), w, &format!("{ff}.wo"))
    }

    /// A Qwen2-style decoder layer used as an encoder: causal grouped-query
    /// attention with rotate-half rotary positions, SwiGLU MLP, RMS norms.
    fn decoder(&self, w: &W, x: &Tensor, i: &Inputs) -> Tensor {
        let (b, t) = (x.size()[0], x.size()[1]);
        let hd = self.model.head_dim as i64;
        let n = rms(x, get(w, "input_layernorm.weight"));
        let rot = |y: &Tensor| {
            let half = y.narrow(-1, 0, hd / 2);
            let other = y.narrow(-1, hd / 2, hd / 2);
            let f = y.to_kind(Kind::Float);
            let rotated = Tensor::cat(&[other.neg(), half], -1).to_kind(Kind::Float);
            (f * &i.cos + rotated * &i.sin).to_kind(y.kind())
        };
        let split = |y: Tensor| y.view([b, t, -1, hd]);
        let q = rot(&split(lin(&n, w, "self_attn.q_proj"))).transpose(1, 2);
        let k = rot(&split(lin(&n, w, "self_attn.k_proj"))).transpose(1, 2);
        let v = split(lin(&n, w, "self_attn.v_proj")).transpose(1, 2);
        let groups = q.size()[1] / k.size()[1];
        let (k, v) = (k.repeat_interleave_self_int(groups, 1, None), v.repeat_interleave_self_int(groups, 1, None));
        let o = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
        let x = x + nobias(&o.transpose(1, 2).reshape([b, t, self.h()]), w, "self_attn.o_proj");
        let n = rms(&x, get(w, "post_attention_layernorm.weight"));
        &x + nobias(&(nobias(&n, w, "mlp.gate_proj").silu() * nobias(&n, w, "mlp.up_proj")), w, "mlp.down_proj")
    }

    /// A text encoder's forward call: token embeddings, every block, final norm.
    fn encode<B: TchSlots>(&self, i: &Inputs, ids: &Tensor, mut off: Option<&mut TchOffload<B>>) -> offload_core::Result<Tensor> {
        let g = &self.globals;
        let t5 = g.contains_key("shared.weight");
        let (emb, norm) = if t5 { ("shared.weight", "encoder.final_layer_norm.weight") } else { ("embed_tokens.weight", "norm.weight") };
        let mut x = Tensor::embedding(get(g, emb), ids, -1, false, false);
        let mut bias = None;
        for b in &self.blocks {
            let guard = off.as_deref_mut().map(|o| o.block(b.stack, b.index)).transpose()?;
            x = match b.kind {
                BlockKind::T5 => self.t5(&b.w, &x, &mut bias),
                BlockKind::Decoder => self.decoder(&b.w, &x, i),
                other => {
                    return Err(offload_core::Error::unsupported(
                        "tch (bench room)",
                        format!("{other:?} blocks in a text encoder ({}.{})", b.stack, b.index),
                    ))
                }
            };
            guard.map(|g| g.finish()).transpose()?;
        }
        let out = rms(&x, get(g, norm));
        if let Some(o) = off {
            o.end_step()?;
        }
        Ok(out)
    }

    /// The VAE's decoder on latents `[B, C, h, w]`: Flux's scale and shift undone,
    /// the middle block (ResNet, attention, ResNet), the up blocks streamed, the
    /// output norm and convolution: an image `[B, 3, 8h, 8w]`.
    fn vae_decode<B: TchSlots>(&self, z: &Tensor, mut off: Option<&mut TchOffload<B>>) -> offload_core::Result<Tensor> {
        let g = &self.globals;
        let z = z / 0.3611 + 0.1159;
        let mut x = conv(&z, g, "decoder.conv_in", 1);
        x = resnet(&x, g, "decoder.mid_block.resnets.0");
        x = vae_attention(&x, g, "decoder.mid_block.attentions.0");
        x = resnet(&x, g, "decoder.mid_block.resnets.1");
        for b in &self.blocks {
            let guard = off.as_deref_mut().map(|o| o.block(b.stack, b.index)).transpose()?;
            for r in 0..3 {
                x = resnet(&x, &b.w, &format!("resnets.{r}"));
            }
            if b.w.contains_key("upsamplers.0.conv.weight") {
                let (h, w) = (x.size()[2], x.size()[3]);
                x = conv(&x.upsample_nearest2d([2 * h, 2 * w], None, None), &b.w, "upsamplers.0.conv", 1);
            }
            guard.map(|g| g.finish()).transpose()?;
        }
        let out = conv(&gn(&x, g, "decoder.conv_norm_out").silu(), g, "decoder.conv_out", 1);
        if let Some(o) = off {
            o.end_step()?;
        }
        Ok(out)
    }

    fn embedder(&self, e: &Tensor, name: &str) -> Tensor {
        lin(&lin(e, &self.globals, &format!("{name}.linear_1")).silu(), &self.globals, &format!("{name}.linear_2"))
    }

    /// One forward call; with `off`, each block's parameters are streamed in around it.
    fn step<B: TchSlots>(&self, i: &Inputs, mut off: Option<&mut TchOffload<B>>) -> offload_core::Result<Tensor> {
        if let Some(ids) = &i.ids {
            return self.encode(i, ids, off);
        }
        if self.blocks.first().is_some_and(|b| b.kind == BlockKind::Wan) {
            return self.video(i, off);
        }
        if self.blocks.first().is_some_and(|b| b.kind == BlockKind::ZImage) {
            return self.zimage_step(i, off);
        }
        if self.blocks.first().is_some_and(|b| b.kind == BlockKind::VaeUp) {
            return self.vae_decode(&i.latents, off);
        }
        let g = &self.globals;
        let dev = i.latents.device();
        let mut temb = self.embedder(&sinusoid(i.t, dev), "time_text_embed.timestep_embedder");
        let (mut img, mut txt);
        if let Some(pooled) = &i.pooled {
            if self.model.guidance {
                temb += self.embedder(&sinusoid(i.guidance, dev), "time_text_embed.guidance_embedder");
            }
            // Out of place: the step's embedding `[1, H]` broadcasts to the batch
            // (`+=` would write the sum into the `[1, H]` tensor and fail at batch 2).
            #[allow(clippy::assign_op_pattern)]
            {
                temb = temb + self.embedder(pooled, "time_text_embed.text_embedder");
            }
            img = match g.get("pos_embed.proj.weight") {
                // SD3's 2×2 patch convolution as a linear over patchified latents.
                Some(conv) => i.latents.linear(&conv.view([self.h(), -1]), Some(get(g, "pos_embed.proj.bias"))),
                None => lin(&i.latents, g, "x_embedder"),
            };
            txt = lin(&i.text, g, "context_embedder");
        } else {
            img = lin(&i.latents, g, "img_in");
            txt = lin(&rms(&i.text, get(g, "txt_norm.weight")), g, "txt_in");
        }
        let mut joint: Option<Tensor> = None;
        for b in &self.blocks {
            let guard = off.as_deref_mut().map(|o| o.block(b.stack, b.index)).transpose()?;
            match b.kind {
                BlockKind::DualStream => (img, txt) = self.dual(&b.w, &img, &txt, &temb, i),
                BlockKind::SingleStream => {
                    let x = joint.take().unwrap_or_else(|| Tensor::cat(&[&txt, &img], 1));
                    joint = Some(self.single(&b.w, &x, &temb, i));
                }
                other => {
                    return Err(offload_core::Error::unsupported("tch (bench room)", format!("{other:?} blocks ({}.{})", b.stack, b.index)))
                }
            }
            guard.map(|g| g.finish()).transpose()?;
        }
        if let Some(x) = joint {
            img = x.narrow(1, i.text_tokens, img.size()[1]);
        }
        let e: Vec<Tensor> = lin(&temb.silu(), g, "norm_out.linear").unsqueeze(1).chunk(2, -1);
        let out = lin(&modulate(&img, self.h(), &e[1], &e[0]), g, "proj_out");
        if let Some(o) = off {
            o.end_step()?;
        }
        Ok(out)
    }
}

/// libtorch's generator is one per process: a seeded section (the weights from
/// seed 0, a case's inputs from its own seed) holds this lock, so that two
/// threads (tests run in parallel) cannot draw from each other's seed.
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Fill `vs` with `model`'s parameters (random bf16 on the VarStore's device, seed
/// 0: linear weights at ±1/√fan-in, biases ±0.01, norm scales in [0.5, 1.5]) and
/// the block-by-block view of them a step reads.
fn build<'m>(model: &'m Model, vs: &nn::VarStore) -> Result<Net<'m>, String> {
    let dev = vs.device();
    let _seeded = SEEDED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    tch::manual_seed(0);
    for p in model.params() {
        let segs: Vec<&str> = p.name.split('.').collect();
        let (last, dirs) = segs.split_last().ok_or_else(|| err("empty parameter name"))?;
        let path = dirs.iter().fold(vs.root(), |path, s| path.sub(*s));
        let shape: Vec<i64> = p.shape.iter().map(|&d| d as i64).collect();
        let t = Tensor::empty(&shape, (Kind::BFloat16, dev));
        let (lo, hi) = p.init_range();
        let _ = path.add(last, t.uniform(lo, hi), false);
    }
    let vars = vs.variables();
    let pick = |prefix: &str| -> W {
        vars.iter().filter_map(|(n, t)| n.strip_prefix(prefix).map(|r| (r.to_owned(), t.shallow_clone()))).collect()
    };
    let block_prefixes: Vec<&str> = model.stacks.iter().map(|s| s.prefix).collect();
    let globals: W = vars
        .iter()
        .filter(|(n, _)| !block_prefixes.iter().any(|p| n.starts_with(&format!("{p}."))))
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let mut blocks = Vec::new();
    for s in &model.stacks {
        for i in 0..s.count {
            blocks.push(Block { stack: s.prefix, index: i, kind: s.kind, w: pick(&format!("{}.{i}.", s.prefix)) });
        }
    }
    let net = Net { model, names: dual_names(model), sd3: model.name.starts_with("sd3"), globals, blocks };
    Ok(net)
}

fn inputs(model: &Model, case: &Case, dev: Device) -> Inputs {
    let _seeded = SEEDED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    tch::manual_seed(case.resolution as i64);
    let r = |s: &[i64]| Tensor::randn(s, (Kind::Float, dev)).to_kind(Kind::BFloat16);
    let (b, n, t) = (case.batch as i64, case.image_tokens as i64, case.text_tokens as i64);
    if model.stacks.iter().any(|s| s.kind == BlockKind::VaeUp) {
        // A VAE decoder: latents `[B, C, height/8, width/8]`.
        let (lh, lw) = ((case.height / 8) as i64, (case.resolution / 8) as i64);
        return Inputs {
            latents: r(&[b, model.in_channels as i64, lh, lw]),
            text: Tensor::zeros([0], (Kind::BFloat16, dev)),
            pooled: None,
            t: 0.0,
            guidance: 0.0,
            cos: Tensor::zeros([0], (Kind::Float, dev)),
            sin: Tensor::zeros([0], (Kind::Float, dev)),
            text_tokens: 0,
            ids: None,
        };
    }
    if model.in_channels == 0 {
        // A text encoder: seeded token ids; rotate-half tables (θ = 10^6, as
        // Qwen2.5-VL's text positions, where its three rotary sections coincide).
        let vocab = model.globals.first().map_or(1, |p| p.shape[0] as i64);
        let hd = model.head_dim as i64;
        let inv = (Tensor::arange(hd / 2, (Kind::Float, dev)) * (-(1e6f64.ln()) * 2.0 / hd as f64)).exp().unsqueeze(0);
        let ang = Tensor::arange(t, (Kind::Float, dev)).unsqueeze(1) * inv;
        let ang = Tensor::cat(&[&ang, &ang], -1).view([1, t, 1, hd]);
        return Inputs {
            latents: Tensor::zeros([0], (Kind::BFloat16, dev)),
            text: Tensor::zeros([0], (Kind::BFloat16, dev)),
            pooled: None,
            t: 0.0,
            guidance: 0.0,
            cos: ang.cos(),
            sin: ang.sin(),
            text_tokens: t,
            ids: Some(Tensor::randint(vocab, [b, t], (Kind::Int64, dev))),
        };
    }
    // Rotary tables over text then image positions, one frequency per pair.
    let half = model.head_dim as i64 / 2;
    let pos = Tensor::arange(n + t, (Kind::Float, dev)).unsqueeze(1);
    let freqs = (Tensor::arange(half, (Kind::Float, dev)) * (-(10000f64.ln()) / half as f64)).exp().unsqueeze(0);
    let ang = (pos * freqs).view([1, n + t, 1, half, 1]);
    let (c, sn) = (ang.cos(), ang.sin());
    let pairs = |a: &Tensor, b: &Tensor| Tensor::cat(&[a, b], -1).view([1, n + t, 1, 2 * half]);
    Inputs {
        latents: r(&[b, n, model.in_channels as i64]),
        text: r(&[b, t, model.text_dim as i64]),
        pooled: model.pooled_dim.map(|p| r(&[b, p as i64])),
        t: 0.5,
        guidance: 3.5,
        cos: pairs(&c, &c),
        sin: pairs(&-&sn, &sn),
        text_tokens: t,
        ids: None,
    }
}

fn host_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let mut v = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut v, t.numel());
    v
}

fn host_f32(t: &Tensor) -> Vec<f32> {
    let t = t.to_kind(Kind::Float).to_device(Device::Cpu).flatten(0, -1);
    Vec::<f32>::try_from(&t).unwrap_or_default()
}

/// libtorch's allocator on GPU 0 (the pipeline case's peak).
#[cfg(feature = "tch-cuda")]
fn stats() -> Result<offload_tch::AllocatorStats, String> {
    offload_tch::allocator_stats(0).map_err(err)
}

/// Build `model` with random bf16 weights on GPU 0, time every case resident,
/// then streamed at every depth, in this process ([`crate::drive::run`]).
#[cfg(feature = "tch-cuda")]
pub fn run(model: &Model, opts: &Options) -> Result<RunDoc, String> {
    run_on(model, opts, Device::Cuda(0), || offload_tch::cuda_backend(0).map_err(err))
}

/// The same on libtorch's CPU device (one thread), streamed through the
/// simulated backend: `zoo run --backend tch`'s own code in tests without a GPU
/// (no allocator there: activations and derived weights are 0).
pub fn run_cpu(model: &Model, opts: &Options) -> Result<RunDoc, String> {
    tch::set_num_threads(1);
    run_on(model, opts, Device::Cpu, || Ok(SimBackend::new(offload_core::sim::SimConfig::fast())))
}

fn run_on<B: TchDevice>(model: &Model, opts: &Options, dev: Device, be: impl FnOnce() -> Result<B, String>) -> Result<RunDoc, String> {
    if !computes(model) {
        return Err(err(format!("{}: the bench room has no tch compute for its blocks yet", model.name)));
    }
    let _nograd = tch::no_grad_guard();
    let vs = nn::VarStore::new(dev);
    crate::drive::run(model, opts, || {
        let be = be()?;
        let t0 = std::time::Instant::now();
        let net = build(model, &vs)?;
        be.sync();
        eprintln!("{}: {} parameters built in {:.1} s", model.name, vs.variables().len(), t0.elapsed().as_secs_f64());
        let first = Plan::layerwise().prefetch_depth(opts.depths.first().copied().unwrap_or(1));
        Ok(TchRun { net, vs: &vs, be, dev, off: None, first, steps: (opts.warmup, opts.steps) })
    })
}

/// What tch's file reads of its device beside the ring: names and memory counters.
pub trait TchDevice: TchSlots {
    /// The GPU's name.
    fn gpu(&self) -> String;
    /// Wait for libtorch's work on the device.
    fn sync(&self);
    /// The ring's slots: bytes live now and their peak since [`Self::reset_slot_peak`].
    fn slots(&self) -> (u64, u64);
    /// Restart the slots' peak at the live bytes.
    fn reset_slot_peak(&self);
    /// libtorch's allocated bytes and their peak, where it keeps them (0 elsewhere).
    fn allocated(&self) -> Result<(u64, u64), String>;
    /// Restart the allocator's peak.
    fn reset_allocated_peak(&self) -> Result<(), String>;
}

impl TchDevice for SimBackend {
    fn gpu(&self) -> String {
        "CPU (simulated device)".into()
    }
    fn sync(&self) {}
    fn slots(&self) -> (u64, u64) {
        let s = self.stats();
        (s.live_bytes, s.peak_bytes)
    }
    fn reset_slot_peak(&self) {
        self.reset_counters()
    }
    fn allocated(&self) -> Result<(u64, u64), String> {
        Ok((0, 0))
    }
    fn reset_allocated_peak(&self) -> Result<(), String> {
        Ok(())
    }
}

#[cfg(feature = "tch-cuda")]
impl TchDevice for TchCudaBackend {
    fn gpu(&self) -> String {
        self.cuda().device_name().unwrap_or_default()
    }
    fn sync(&self) {
        tch::Cuda::synchronize(0)
    }
    fn slots(&self) -> (u64, u64) {
        let c = self.counters();
        (c.live_bytes, c.peak_bytes)
    }
    fn reset_slot_peak(&self) {
        self.reset_peak()
    }
    fn allocated(&self) -> Result<(u64, u64), String> {
        stats().map(|s| (s.allocated, s.allocated_peak))
    }
    fn reset_allocated_peak(&self) -> Result<(), String> {
        offload_tch::reset_allocator_peak(0).map_err(err)
    }
}

/// tch's file in the loop: every parameter on the device for the resident runs,
/// then the blocks moved to the host store ([`TchOffload`]) for the streamed ones.
struct TchRun<'m, B: TchSlots> {
    net: Net<'m>,
    vs: &'m nn::VarStore,
    be: B,
    dev: Device,
    off: Option<TchOffload<B>>,
    /// The ring's plan when the blocks move to the host.
    first: Plan,
    steps: (usize, usize),
}

impl<B: TchDevice> TchRun<'_, B> {
    fn timed(&mut self, i: &Inputs) -> Result<(Vec<f64>, Tensor), String> {
        let be = self.be.clone();
        let sync = || {
            be.sync();
            Ok(())
        };
        let (net, mut off) = (&self.net, self.off.as_mut());
        crate::harness::timed(self.steps, &sync, &mut || net.step(i, off.as_deref_mut()).map_err(err))
    }
}

impl<B: TchDevice> crate::drive::Driver for TchRun<'_, B> {
    const BACKEND: &'static str = "tch";

    fn gpu(&self) -> String {
        self.be.gpu()
    }

    fn resident_bytes(&self) -> u64 {
        self.net.model.global_bytes(2)
    }

    fn resident(&mut self, c: &Case, calibrate: bool) -> Result<crate::drive::Resident, String> {
        if calibrate {
            return Err(err("no calibration here: --budgets and --depths auto are cuda's and candle's"));
        }
        let i = inputs(self.net.model, c, self.dev);
        self.be.sync();
        let before = self.be.allocated()?.0;
        self.be.reset_allocated_peak()?;
        let (times, out) = self.timed(&i)?;
        let activations = self.be.allocated()?.1.saturating_sub(before);
        Ok(crate::drive::Resident { times, out: host_bytes(&out), activations, cost: None })
    }

    fn stream(&mut self) -> Result<crate::harness::StoreFacts, String> {
        // Blocks to the host store (their device copies are dropped).
        let t = std::time::Instant::now();
        let mut off = TchOffload::new(self.be.clone(), self.vs, "transformer", &prefixes(self.net.model), &self.first).map_err(err)?;
        let facts = crate::harness::store_facts(&self.be, off.ring().store(), t).map_err(err)?;
        self.off = Some(off);
        Ok(facts)
    }

    fn streamed(
        &mut self,
        c: &Case,
        plan: &Plan,
        r: &crate::drive::Resident,
        _: Option<&str>,
    ) -> Result<crate::drive::StreamedRun, String> {
        let i = inputs(self.net.model, c, self.dev);
        let off = self.off.as_mut().ok_or_else(|| err("streamed before the blocks moved to the host"))?;
        off.replan(plan).map_err(err)?;
        self.be.synchronize().map_err(err)?;
        self.be.sync();
        self.be.reset_slot_peak();
        let live_slots = self.be.slots().0;
        let before = self.be.allocated()?.0;
        self.be.reset_allocated_peak()?;
        let misses0 = off.ring().metrics().misses;
        let (times, out) = self.timed(&i)?;
        let memory = (before, live_slots, self.be.allocated()?.1);
        let (weights, derived) = crate::harness::streamed_weights(self.be.slots().1, self.resident_bytes(), memory, r.activations);
        let off = self.off.as_mut().expect("set above");
        let (equal, values, misses) = (host_bytes(&out) == r.out, host_f32(&out), off.ring().metrics().misses - misses0);
        let s = crate::harness::Streamed { times, equal, values, weights, derived, misses };
        Ok(crate::drive::StreamedRun { s, depth: off.ring().depth(), step_bytes: None, timeline: None })
    }

    fn finish(&mut self, _doc: &mut RunDoc) -> Result<(), String> {
        self.off.take().map_or(Ok(()), |off| off.close().map_err(err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rope_pairs` with the interleaved tables rotates each pair `(re, im)` by its
    /// angle, as the per-component form does (to a bf16 rounding).
    #[test]
    fn rope_pairs_rotates_each_pair_by_its_angle() {
        tch::manual_seed(7);
        let (t, heads, half) = (5i64, 3i64, 4i64);
        let x = Tensor::randn([2, t, heads, 2 * half], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let ang = Tensor::randn([1, t, 1, half, 1], (Kind::Float, Device::Cpu));
        let (c, s) = (ang.cos(), ang.sin());
        let pairs = |a: &Tensor, b: &Tensor| Tensor::cat(&[a, b], -1).view([1, t, 1, 2 * half]);
        let got = rope_pairs(&x, &pairs(&c, &c), &pairs(&-&s, &s)).to_kind(Kind::Float);
        let f = x.to_kind(Kind::Float).view([2, t, heads, half, 2]);
        let (re, im) = (f.select(-1, 0), f.select(-1, 1));
        let (c, s) = (c.squeeze_dim(-1), s.squeeze_dim(-1));
        let want = Tensor::stack(&[&re * &c - &im * &s, &re * &s + &im * &c], -1).view([2, t, heads, 2 * half]);
        let err = (&got - &want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        assert!(scale > 0.5, "inputs too small to test: {scale}");
        assert!(err <= scale / 128.0, "rope_pairs off by {err} (values up to {scale})");
    }
}
