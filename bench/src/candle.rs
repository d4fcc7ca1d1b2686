//! candle's file: the registry's blocks with candle ops (`candle_nn` linears,
//! fused RMS and layer norms, `rope_i`, matmul-softmax attention over groups of
//! heads), every block served by the ring through [`CandleBlockExt`] and the
//! non-block weights kept on the device. The resident reference reads every
//! block's weights straight from the source, without a ring. SD3's joint blocks
//! are candle-transformers' own (`mmdit::blocks`), unmodified, fed the registry's
//! diffusers names mapped to SAI's ([`sai_block`]).

use crate::registry::{dual_names, BlockKind, Case, DualNames, Model};
use crate::source::{block_inventory, resolved, RegistrySource};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::Module;
use offload_candle::{candle_error, CandleBackend, CandleBlockExt};
use offload_core::{BlockGuard, HostStore, OffloadBackend, Plan, Ring, TensorSource};
use std::collections::HashMap;
use std::sync::Arc;

type W = HashMap<String, Tensor>;
type R<T> = candle_core::Result<T>;

/// Whether candle's file computes `model`: Flux-style dual- and single-stream
/// blocks ([`Model::computed`]), SD3's joint blocks and Z-Image's blocks through
/// candle-transformers.
pub fn computes(model: &Model) -> bool {
    model.computed() || is_sd3(model) || is_z_image(model) || is_encoder(model)
}

/// T5's encoder or a Qwen2-style decoder used as an encoder: candle-transformers
/// keeps those blocks private, so the file runs its own, on the same names.
fn is_encoder(model: &Model) -> bool {
    model.in_channels == 0 && model.stacks.iter().all(|s| matches!(s.kind, BlockKind::T5 | BlockKind::Decoder))
}

/// T5's bidirectional relative position bucket (32 buckets, max distance 128) of
/// key position `j` seen from query position `i`.
fn t5_bucket(i: usize, j: usize) -> u32 {
    let (half, exact) = (16u32, 8u32);
    let rel = j as i64 - i as i64;
    let n = rel.unsigned_abs() as u32;
    let side = if rel > 0 { half } else { 0 };
    if n < exact {
        return side + n;
    }
    let large = exact + ((n as f32 / exact as f32).ln() / (128f32 / exact as f32).ln() * (half - exact) as f32) as u32;
    side + large.min(half - 1)
}

fn is_z_image(model: &Model) -> bool {
    model.stacks.iter().all(|s| s.kind == BlockKind::ZImage && s.overrides.is_empty())
}

fn is_sd3(model: &Model) -> bool {
    model.name.starts_with("sd3")
        && model.stacks.iter().all(|s| s.kind == BlockKind::DualStream && s.overrides.iter().all(|(i, _)| *i + 1 == s.count))
}

/// One SD3 joint block's weights under SAI's names, from the registry's diffusers
/// names (the reverse of diffusers' SD3 conversion): `to_q`, `to_k`, `to_v` (and
/// the context's `add_*_proj`) concatenated into `attn.qkv`, `to_out.0` /
/// `to_add_out` as `attn.proj`, `ff*.net.{0.proj,2}` as `mlp.fc{1,2}`, the QK norms
/// as `attn.ln_{q,k}`, `norm1*.linear` as `adaLN_modulation.1` — with the
/// context-only block's `(scale, shift)` halves swapped to SAI's `(shift, scale)`.
/// The concatenations are new tensors: nothing here outlives the block's guard.
fn sai_block(w: &W, pre_only: bool) -> R<W> {
    let mut m = W::new();
    let sides = [
        (
            "x_block",
            ["attn.to_q", "attn.to_k", "attn.to_v"],
            Some("attn.to_out.0"),
            ["attn.norm_q", "attn.norm_k"],
            "norm1.linear",
            Some("ff"),
        ),
        (
            "context_block",
            ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
            (!pre_only).then_some("attn.to_add_out"),
            ["attn.norm_added_q", "attn.norm_added_k"],
            "norm1_context.linear",
            (!pre_only).then_some("ff_context"),
        ),
    ];
    for (side, qkv, out, [nq, nk], modulation, ff) in sides {
        for part in ["weight", "bias"] {
            let parts = qkv.iter().map(|l| get(w, &format!("{l}.{part}"))).collect::<R<Vec<_>>>()?;
            m.insert(format!("{side}.attn.qkv.{part}"), Tensor::cat(&parts, 0)?);
            let mo = get(w, &format!("{modulation}.{part}"))?;
            let mo = match side == "context_block" && pre_only {
                true => {
                    let h = mo.dim(0)? / 2;
                    Tensor::cat(&[mo.narrow(0, h, h)?, mo.narrow(0, 0, h)?], 0)?
                }
                false => mo.clone(),
            };
            m.insert(format!("{side}.adaLN_modulation.1.{part}"), mo);
            if let Some(o) = out {
                m.insert(format!("{side}.attn.proj.{part}"), get(w, &format!("{o}.{part}"))?.clone());
            }
            if let Some(f) = ff {
                m.insert(format!("{side}.mlp.fc1.{part}"), get(w, &format!("{f}.net.0.proj.{part}"))?.clone());
                m.insert(format!("{side}.mlp.fc2.{part}"), get(w, &format!("{f}.net.2.{part}"))?.clone());
            }
        }
        m.insert(format!("{side}.attn.ln_q.weight"), get(w, &format!("{nq}.weight"))?.clone());
        m.insert(format!("{side}.attn.ln_k.weight"), get(w, &format!("{nk}.weight"))?.clone());
    }
    Ok(m)
}

fn get<'a>(w: &'a W, name: &str) -> R<&'a Tensor> {
    w.get(name).ok_or_else(|| candle_core::Error::Msg(format!("registry parameter {name} not served")))
}

/// A linear layer without bias (`{name}.weight` only).
fn nobias(x: &Tensor, w: &W, name: &str) -> R<Tensor> {
    candle_nn::Linear::new(get(w, &format!("{name}.weight"))?.clone(), None).forward(x)
}

fn lin(x: &Tensor, w: &W, name: &str) -> R<Tensor> {
    candle_nn::Linear::new(get(w, &format!("{name}.weight"))?.clone(), Some(get(w, &format!("{name}.bias"))?.clone())).forward(x)
}

/// One forward call's inputs.
pub struct Inputs {
    latents: Tensor,
    text: Tensor,
    pooled: Option<Tensor>,
    cos: Tensor,
    sin: Tensor,
    text_tokens: usize,
    /// Token ids `[B, T]` for a text encoder (latents and text are empty then).
    ids: Option<Tensor>,
    /// A decoder's causal mask `[T, T]` (0 on and below the diagonal, −∞ above),
    /// made once per call's inputs.
    causal: Option<Tensor>,
}

/// The model's non-block weights on the device and what every block reads.
pub struct Net<'m> {
    model: &'m Model,
    sd3: bool,
    /// candle-transformers' Z-Image configuration, for a Z-Image model.
    z_image: Option<candle_transformers::models::z_image::transformer::Config>,
    names: DualNames,
    globals: W,
    ones: Tensor,
    zeros: Tensor,
    dev: Device,
    /// While calibrating: each block's compute time of the step, seconds, in step
    /// order (the device synchronised before and after the block).
    timer: std::cell::RefCell<Option<Vec<f64>>>,
}

impl<'m> Net<'m> {
    /// `model`'s non-block weights from `src`, on `dev`.
    pub fn new(model: &'m Model, src: &RegistrySource, dev: &Device) -> offload_core::Result<Self> {
        let err = candle_error("loading the non-block weights");
        let prefixes: Vec<String> = model.stacks.iter().map(|s| format!("{}.", s.prefix)).collect();
        let mut globals = W::new();
        for (i, spec) in src.specs().iter().enumerate().filter(|(_, s)| !prefixes.iter().any(|p| s.name.starts_with(p))) {
            let mut bytes = vec![0u8; spec.nbytes()?];
            src.read_into(i, &mut bytes)?;
            let t = Tensor::from_raw_buffer(&bytes, DType::BF16, &spec.shape, &Device::Cpu).and_then(|t| t.to_device(dev)).map_err(err)?;
            globals.insert(spec.name.clone(), t);
        }
        let h = model.hidden;
        let ones = Tensor::ones(h, DType::BF16, dev).map_err(err)?;
        let zeros = Tensor::zeros(h, DType::BF16, dev).map_err(err)?;
        let z_image = match is_z_image(model) {
            // Diffusers' Z-Image: RMS norms at 1e-5, QK norms, as many key-value heads
            // as heads; attention without flash-attn (not built here).
            true => Some(
                serde_json::from_value(serde_json::json!({
                    "dim": h, "n_heads": model.heads, "n_kv_heads": model.heads, "norm_eps": 1e-5, "qk_norm": true,
                    "use_accelerated_attn": false,
                }))
                .map_err(|e| offload_core::Error::Protocol(format!("Z-Image configuration: {e}")))?,
            ),
            false => None,
        };
        Ok(Net {
            model,
            sd3: is_sd3(model),
            z_image,
            names: dual_names(model),
            globals,
            ones,
            zeros,
            dev: dev.clone(),
            timer: std::cell::RefCell::new(None),
        })
    }

    /// Random inputs of `case` (seeded by its resolution) and the rotary tables.
    pub fn inputs(&self, case: &Case) -> offload_core::Result<Inputs> {
        let err = candle_error("making the inputs");
        let m = self.model;
        let (b, n, t) = (case.batch, case.image_tokens, case.text_tokens);
        let dev = &self.dev;
        let r = |s: &[usize], seed: u64| -> R<Tensor> {
            let v = crate::source::unit_values(case.resolution as u64 * 16 + seed, s.iter().product());
            Tensor::from_vec(v, s, &Device::Cpu)?.to_device(dev)?.to_dtype(DType::BF16)
        };
        if m.in_channels == 0 {
            // Seeded token ids; rotate-half tables with θ = 10^6 (Qwen2.5-VL's text
            // positions), as tch's file.
            let vocab = m.globals.first().map_or(1, |p| p.shape[0]) as u64;
            let ids: Vec<u32> = crate::source::unit_values(case.text_tokens as u64 * 16 + 4, b * t)
                .into_iter()
                .map(|v| ((v.abs() * 1e6) as u64 % vocab) as u32)
                .collect();
            let half = m.head_dim / 2;
            let ang: Vec<f32> = (0..t)
                .flat_map(|p| (0..half).map(move |j| p as f32 * (-(1e6f32.ln()) * 2.0 * j as f32 / m.head_dim as f32).exp()))
                .collect();
            let ang = Tensor::from_vec(ang, (t, half), dev).map_err(err)?;
            let empty = Tensor::zeros(0, DType::BF16, dev).map_err(err)?;
            return Ok(Inputs {
                latents: empty.clone(),
                text: empty,
                pooled: None,
                cos: ang.cos().and_then(|c| c.to_dtype(DType::BF16)).map_err(err)?,
                sin: ang.sin().and_then(|c| c.to_dtype(DType::BF16)).map_err(err)?,
                text_tokens: t,
                ids: Some(Tensor::from_vec(ids, (b, t), dev).map_err(err)?),
                causal: Some(
                    Tensor::from_vec(
                        (0..t).flat_map(|r| (0..t).map(move |c| if c > r { f32::NEG_INFINITY } else { 0.0 })).collect::<Vec<f32>>(),
                        (t, t),
                        dev,
                    )
                    .and_then(|m| m.to_dtype(DType::BF16))
                    .map_err(err)?,
                ),
            });
        }
        let half = m.head_dim / 2;
        let pos = Tensor::arange(0u32, (n + t) as u32, dev).and_then(|p| p.to_dtype(DType::F32)).map_err(err)?;
        let freqs: Vec<f32> = (0..half).map(|j| (-(10000f32.ln()) * j as f32 / half as f32).exp()).collect();
        let freqs = Tensor::new(freqs.as_slice(), dev).map_err(err)?;
        let ang = pos.unsqueeze(1).and_then(|p| p.broadcast_mul(&freqs.unsqueeze(0)?)).map_err(err)?;
        Ok(Inputs {
            latents: r(&[b, n, m.in_channels], 1).map_err(err)?,
            text: r(&[b, t, m.text_dim], 2).map_err(err)?,
            pooled: m.pooled_dim.map(|p| r(&[b, p], 3)).transpose().map_err(err)?,
            cos: ang.cos().and_then(|c| c.to_dtype(DType::BF16)).map_err(err)?,
            sin: ang.sin().and_then(|c| c.to_dtype(DType::BF16)).map_err(err)?,
            text_tokens: t,
            ids: None,
            causal: None,
        })
    }

    fn ln(&self, x: &Tensor) -> R<Tensor> {
        candle_nn::ops::layer_norm(&x.contiguous()?, &self.ones, &self.zeros, 1e-6)
    }

    fn modulate(&self, x: &Tensor, shift: &Tensor, scale: &Tensor) -> R<Tensor> {
        self.ln(x)?.broadcast_mul(&(scale + 1.0)?)?.broadcast_add(shift)
    }

    /// `[B, T, H]` → `[B, heads, T, hd]`.
    fn heads(&self, x: &Tensor) -> R<Tensor> {
        let (b, t, _) = x.dims3()?;
        x.reshape((b, t, self.model.heads, self.model.head_dim))?.transpose(1, 2)?.contiguous()
    }

    fn rms(x: &Tensor, s: &Tensor) -> R<Tensor> {
        candle_nn::ops::rms_norm(&x.contiguous()?, s, 1e-6)
    }

    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> R<Tensor> {
        let (b, h, t, hd) = q.dims4()?;
        // Scores in groups of heads of at most 2^30 elements.
        let group = ((1usize << 30) / (t * t).max(1)).clamp(1, h);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut outs = Vec::new();
        for start in (0..h).step_by(group) {
            let n = group.min(h - start);
            let (qc, kc, vc) = (q.narrow(1, start, n)?, k.narrow(1, start, n)?, v.narrow(1, start, n)?);
            let s = (qc.matmul(&kc.t()?.contiguous()?)? * scale)?;
            outs.push(candle_nn::ops::softmax_last_dim(&s)?.matmul(&vc)?);
        }
        Tensor::cat(&outs, 1)?.transpose(1, 2)?.reshape((b, t, self.model.hidden))
    }

    fn mlp(&self, x: &Tensor, w: &W, name: &str) -> R<Tensor> {
        lin(&lin(x, w, &format!("{name}.net.0.proj"))?.gelu()?, w, &format!("{name}.net.2"))
    }

    /// A dual-stream block with diffusers' names. SD3's context-only last block (no
    /// `attn.to_add_out`) takes its context norm as `(scale, shift)` and leaves the
    /// text unchanged; its context QK norms are skipped, as candle-transformers'
    /// `ContextQkvOnlyJointBlock` does (the step runs that block: this form is the
    /// test's reference for it).
    fn dual(&self, w: &W, img: &Tensor, txt: &Tensor, temb: &Tensor, i: &Inputs) -> R<(Tensor, Tensor)> {
        let n = self.names;
        let st = temb.silu()?;
        let pre_only = !w.contains_key("attn.to_add_out.weight");
        let mi = lin(&st, w, n.img_mod)?.unsqueeze(1)?.chunk(6, D::Minus1)?;
        let mt = lin(&st, w, n.txt_mod)?.unsqueeze(1)?.chunk(if pre_only { 2 } else { 6 }, D::Minus1)?;
        let nt = if pre_only { self.modulate(txt, &mt[1], &mt[0])? } else { self.modulate(txt, &mt[0], &mt[1])? };
        let ni = self.modulate(img, &mi[0], &mi[1])?;
        let (nq, nk) = if pre_only { (None, None) } else { (Some("norm_added_q"), Some("norm_added_k")) };
        let p = |x: &Tensor, l: &str, norm: Option<&str>| -> R<Tensor> {
            let y = self.heads(&lin(x, w, &format!("attn.{l}"))?)?;
            match norm {
                Some(nm) => Self::rms(&y, get(w, &format!("attn.{nm}.weight"))?),
                None => Ok(y),
            }
        };
        let q = Tensor::cat(&[p(&nt, "add_q_proj", nq)?, p(&ni, "to_q", Some("norm_q"))?], 2)?;
        let k = Tensor::cat(&[p(&nt, "add_k_proj", nk)?, p(&ni, "to_k", Some("norm_k"))?], 2)?;
        let v = Tensor::cat(&[p(&nt, "add_v_proj", None)?, p(&ni, "to_v", None)?], 2)?;
        let rope = |x: &Tensor| candle_nn::rotary_emb::rope_i(&x.contiguous()?, &i.cos, &i.sin);
        // SD3 has no rotary positions (its step runs `sd3_joint`; a test compares).
        let a = if self.sd3 { self.attention(&q, &k, &v)? } else { self.attention(&rope(&q)?, &rope(&k)?, &v)? };
        let (ta, ia) = (a.narrow(1, 0, i.text_tokens)?, a.narrow(1, i.text_tokens, img.dim(1)?)?);
        let img = (img + mi[2].broadcast_mul(&lin(&ia, w, "attn.to_out.0")?)?)?;
        let img = (&img + mi[5].broadcast_mul(&self.mlp(&self.modulate(&img, &mi[3], &mi[4])?, w, n.img_mlp)?)?)?;
        if pre_only {
            return Ok((img, txt.clone()));
        }
        let txt = (txt + mt[2].broadcast_mul(&lin(&ta, w, "attn.to_add_out")?)?)?;
        let txt = (&txt + mt[5].broadcast_mul(&self.mlp(&self.modulate(&txt, &mt[3], &mt[4])?, w, n.txt_mlp)?)?)?;
        Ok((img, txt))
    }

    /// An SD3 joint block by candle-transformers: `MMDiTJointBlock`, or for the
    /// last block (no `attn.to_add_out`) `ContextQkvOnlyJointBlock`, which leaves
    /// the text unchanged. candle-transformers' context-only block does not apply
    /// the context's QK norms (`ln_q`, `ln_k`) that SD3.5's checkpoint has there;
    /// the block is run as candle-transformers has it.
    fn sd3_joint(&self, w: &W, img: &Tensor, txt: &Tensor, temb: &Tensor) -> R<(Tensor, Tensor)> {
        use candle_transformers::models::mmdit::blocks::{ContextQkvOnlyJointBlock, JointBlock, MMDiTJointBlock};
        let pre_only = !w.contains_key("attn.to_add_out.weight");
        let vb = candle_nn::VarBuilder::from_tensors(sai_block(w, pre_only)?, DType::BF16, &self.dev);
        let (h, heads) = (self.model.hidden, self.model.heads);
        match pre_only {
            true => Ok((ContextQkvOnlyJointBlock::new(h, heads, false, vb)?.forward(txt, img, temb)?, txt.clone())),
            false => {
                let (txt, img) = MMDiTJointBlock::new(h, heads, false, vb)?.forward(txt, img, temb)?;
                Ok((img, txt))
            }
        }
    }

    /// A Z-Image block by candle-transformers' `ZImageTransformerBlock`, unmodified
    /// (diffusers' names, as the registry's), over `x` whose rotary positions start
    /// at `pos` in the step's tables; modulated by `adaln` where the block has
    /// `adaLN_modulation`.
    fn z_image_block(&self, w: &W, x: &Tensor, adaln: &Tensor, pos: usize, i: &Inputs) -> R<Tensor> {
        use candle_transformers::models::z_image::transformer::ZImageTransformerBlock;
        let cfg = self.z_image.as_ref().ok_or_else(|| candle_core::Error::Msg("not a Z-Image model".into()))?;
        let modulated = w.contains_key("adaLN_modulation.0.weight");
        let block = ZImageTransformerBlock::new(cfg, modulated, candle_nn::VarBuilder::from_tensors(w.clone(), DType::BF16, &self.dev))?;
        let n = x.dim(1)?;
        block.forward(x, None, &i.cos.narrow(0, pos, n)?, &i.sin.narrow(0, pos, n)?, Some(adaln))
    }

    fn single(&self, w: &W, x: &Tensor, temb: &Tensor, i: &Inputs) -> R<Tensor> {
        let m = lin(&temb.silu()?, w, "norm.linear")?.unsqueeze(1)?.chunk(3, D::Minus1)?;
        let nx = self.modulate(x, &m[0], &m[1])?;
        let mlp = lin(&nx, w, "proj_mlp")?.gelu()?;
        let q = Self::rms(&self.heads(&lin(&nx, w, "attn.to_q")?)?, get(w, "attn.norm_q.weight")?)?;
        let k = Self::rms(&self.heads(&lin(&nx, w, "attn.to_k")?)?, get(w, "attn.norm_k.weight")?)?;
        let v = self.heads(&lin(&nx, w, "attn.to_v")?)?;
        let rope = |x: &Tensor| candle_nn::rotary_emb::rope_i(x, &i.cos, &i.sin);
        let a = self.attention(&rope(&q)?, &rope(&k)?, &v)?;
        x + m[2].broadcast_mul(&lin(&Tensor::cat(&[a, mlp], 2)?, w, "proj_out")?)?
    }

    fn sinusoid(&self, t: f64) -> R<Tensor> {
        let half = 128;
        let f: Vec<f32> = (0..half).map(|j| ((-(10000f64.ln()) * j as f64 / half as f64).exp() * t * 1000.0) as f32).collect();
        let a = Tensor::new(f.as_slice(), &self.dev)?;
        Tensor::cat(&[a.cos()?, a.sin()?], 0)?.unsqueeze(0)?.to_dtype(DType::BF16)
    }

    fn embedder(&self, e: &Tensor, name: &str) -> R<Tensor> {
        lin(&lin(e, &self.globals, &format!("{name}.linear_1"))?.silu()?, &self.globals, &format!("{name}.linear_2"))
    }

    /// T5's encoder block: pre-norm self-attention without scaling, plus the
    /// relative bias `bias` (made from block 0's table on first use: a new tensor,
    /// it outlives block 0's slot); gated-GELU FFN.
    fn t5(&self, w: &W, x: &Tensor, bias: &mut Option<Tensor>) -> R<Tensor> {
        let (b, t, h) = x.dims3()?;
        if bias.is_none() {
            let table = get(w, "layer.0.SelfAttention.relative_attention_bias.weight")?;
            let idx: Vec<u32> = (0..t).flat_map(|i| (0..t).map(move |j| t5_bucket(i, j))).collect();
            let idx = Tensor::from_vec(idx, t * t, &self.dev)?;
            // [T·T, heads] → [1, heads, T, T]
            let heads = table.dim(1)?;
            *bias = Some(table.index_select(&idx, 0)?.reshape((t, t, heads))?.permute((2, 0, 1))?.unsqueeze(0)?.contiguous()?);
        }
        let pb = bias.as_ref().ok_or_else(|| candle_core::Error::Msg("T5 bias".into()))?;
        let n = Self::rms(x, get(w, "layer.0.layer_norm.weight")?)?;
        let p = |l: &str| self.heads(&nobias(&n, w, &format!("layer.0.SelfAttention.{l}"))?);
        let (q, k, v) = (p("q")?, p("k")?, p("v")?);
        let s = q.matmul(&k.t()?.contiguous()?)?.broadcast_add(&pb.to_dtype(q.dtype())?)?;
        let o = candle_nn::ops::softmax_last_dim(&s)?.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h))?;
        let x = (x + nobias(&o, w, "layer.0.SelfAttention.o")?)?;
        let n = Self::rms(&x, get(w, "layer.1.layer_norm.weight")?)?;
        let ff = "layer.1.DenseReluDense";
        let g = (nobias(&n, w, &format!("{ff}.wi_0"))?.gelu()? * nobias(&n, w, &format!("{ff}.wi_1"))?)?;
        &x + nobias(&g, w, &format!("{ff}.wo"))?
    }

    /// A Qwen2-style decoder layer used as an encoder: causal grouped-query
    /// attention with rotate-half rotary positions, SwiGLU MLP, RMS norms.
    fn decoder(&self, w: &W, x: &Tensor, i: &Inputs) -> R<Tensor> {
        let (b, t, h) = x.dims3()?;
        let hd = self.model.head_dim;
        let n = Self::rms(x, get(w, "input_layernorm.weight")?)?;
        let split = |y: Tensor| -> R<Tensor> { y.reshape((b, t, (), hd))?.transpose(1, 2)?.contiguous() };
        let q = candle_nn::rotary_emb::rope(&split(lin(&n, w, "self_attn.q_proj")?)?, &i.cos, &i.sin)?;
        let k = candle_nn::rotary_emb::rope(&split(lin(&n, w, "self_attn.k_proj")?)?, &i.cos, &i.sin)?;
        let v = split(lin(&n, w, "self_attn.v_proj")?)?;
        let groups = q.dim(1)? / k.dim(1)?;
        let (k, v) = (candle_transformers::utils::repeat_kv(k, groups)?, candle_transformers::utils::repeat_kv(v, groups)?);
        let mask = i.causal.as_ref().ok_or_else(|| candle_core::Error::Msg("a decoder's inputs carry its causal mask".into()))?;
        let s = ((q.matmul(&k.t()?.contiguous()?)? * (1.0 / (hd as f64).sqrt()))?.broadcast_add(mask))?;
        let o = candle_nn::ops::softmax_last_dim(&s)?.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h))?;
        let x = (x + nobias(&o, w, "self_attn.o_proj")?)?;
        let n = Self::rms(&x, get(w, "post_attention_layernorm.weight")?)?;
        let g = (nobias(&n, w, "mlp.gate_proj")?.silu()? * nobias(&n, w, "mlp.up_proj")?)?;
        &x + nobias(&g, w, "mlp.down_proj")?
    }

    /// A text encoder's forward call: token embeddings, every block, final norm.
    fn encode<B>(&self, mut ring: Option<&mut Ring<B>>, direct: Option<&[W]>, i: &Inputs, ids: &Tensor) -> offload_core::Result<Tensor>
    where
        B: OffloadBackend,
        for<'a> BlockGuard<'a, B>: CandleBlockExt,
    {
        let err = candle_error("running a bench-room block");
        let g = &self.globals;
        let t5 = g.contains_key("shared.weight");
        let (emb, norm) = if t5 { ("shared.weight", "encoder.final_layer_norm.weight") } else { ("embed_tokens.weight", "norm.weight") };
        let table = get(g, emb).map_err(err)?;
        let mut x = candle_nn::Embedding::new(table.clone(), self.model.hidden).forward(ids).map_err(err)?;
        let mut bias = None;
        each_block(self.model, (&self.timer, &self.dev), ring.as_deref_mut(), direct, |s, _, w| {
            x = match s.kind {
                BlockKind::T5 => self.t5(w, &x, &mut bias).map_err(err)?,
                _ => self.decoder(w, &x, i).map_err(err)?,
            };
            Ok(())
        })?;
        let out = Self::rms(&x, get(g, norm).map_err(err)?).map_err(err)?;
        if let Some(r) = ring {
            r.end_step()?;
        }
        Ok(out)
    }

    /// A Z-Image forward call (as tch's file): the image tokens through the noise
    /// refiner, the caption through the context refiner, then both (image first)
    /// through the main layers; the final layer's scaled norm and projection.
    fn z_image_step<B>(&self, mut ring: Option<&mut Ring<B>>, direct: Option<&[W]>, i: &Inputs) -> offload_core::Result<Tensor>
    where
        B: OffloadBackend,
        for<'a> BlockGuard<'a, B>: CandleBlockExt,
    {
        let err = candle_error("running a bench-room block");
        let g = &self.globals;
        let prelude = || -> R<(Tensor, Tensor, Tensor)> {
            let adaln = lin(&lin(&self.sinusoid(0.5)?, g, "t_embedder.mlp.0")?.silu()?, g, "t_embedder.mlp.2")?;
            let x = lin(&i.latents, g, "all_x_embedder.2-1")?;
            // diffusers' `norm_eps` (1e-5), as candle-transformers' blocks use.
            let cap = lin(&candle_nn::ops::rms_norm(&i.text.contiguous()?, get(g, "cap_embedder.0.weight")?, 1e-5)?, g, "cap_embedder.1")?;
            Ok((adaln, x, cap))
        };
        let (adaln, mut x, mut cap) = prelude().map_err(err)?;
        let n = x.dim(1).map_err(err)?;
        let mut unified: Option<Tensor> = None;
        each_block(self.model, (&self.timer, &self.dev), ring.as_deref_mut(), direct, |s, _, w| {
            match s.prefix {
                "noise_refiner" => x = self.z_image_block(w, &x, &adaln, 0, i).map_err(err)?,
                "context_refiner" => cap = self.z_image_block(w, &cap, &adaln, n, i).map_err(err)?,
                _ => {
                    let u = match unified.take() {
                        Some(u) => u,
                        None => Tensor::cat(&[&x, &cap], 1).map_err(err)?,
                    };
                    unified = Some(self.z_image_block(w, &u, &adaln, 0, i).map_err(err)?);
                }
            }
            Ok(())
        })?;
        let out = (|| -> R<Tensor> {
            let u = match unified {
                Some(u) => u,
                None => Tensor::cat(&[&x, &cap], 1)?,
            };
            let scale = (lin(&adaln.silu()?, g, "all_final_layer.2-1.adaLN_modulation.1")?.unsqueeze(1)? + 1.0)?;
            lin(&self.ln(&u)?.broadcast_mul(&scale)?, g, "all_final_layer.2-1.linear")?.narrow(1, 0, n)
        })()
        .map_err(err)?;
        if let Some(r) = ring {
            r.end_step()?;
        }
        Ok(out)
    }

    /// Per-block compute times of `steps` resident steps over `direct`, each
    /// block timed between device synchronisations (kept out of the timed steps),
    /// the median per block: the planner's calibration.
    pub fn calibrate<B>(&self, direct: &[W], i: &Inputs, steps: usize) -> offload_core::Result<Vec<f64>>
    where
        B: OffloadBackend,
        for<'a> BlockGuard<'a, B>: CandleBlockExt,
    {
        let mut per_step = Vec::new();
        for _ in 0..steps.max(1) {
            *self.timer.borrow_mut() = Some(Vec::new());
            let r = self.step::<B>(None, Some(direct), i);
            let times = self.timer.borrow_mut().take().unwrap_or_default();
            r?;
            per_step.push(times);
        }
        let n = per_step[0].len();
        if per_step.iter().any(|t| t.len() != n) {
            return Err(offload_core::Error::Protocol("calibration: the steps timed different block counts".into()));
        }
        (0..n)
            .map(|j| {
                let xs: Vec<f64> = per_step.iter().map(|t| t[j]).collect();
                crate::harness::spread(&xs)
                    .map(|sp| sp.median)
                    .ok_or_else(|| offload_core::Error::Protocol(format!("calibration: block {j} timed {xs:?}")))
            })
            .collect()
    }

    /// Every block's weights straight from `src` on the device, in step order:
    /// the resident reference, served without the ring.
    pub fn direct_weights(&self, src: &RegistrySource) -> offload_core::Result<Vec<W>> {
        let err = candle_error("loading the blocks");
        let by_name: HashMap<&str, usize> = src.specs().iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
        let mut out = Vec::new();
        for s in &self.model.stacks {
            for index in 0..s.count {
                let mut w = W::new();
                for p in s.block_params(index) {
                    let full = format!("{}.{index}.{}", s.prefix, p.name);
                    let i = *by_name
                        .get(full.as_str())
                        .ok_or_else(|| offload_core::Error::BadTensor { tensor: full.clone(), fault: "not in the source".into() })?;
                    let mut bytes = vec![0u8; p.numel() * 2];
                    src.read_into(i, &mut bytes)?;
                    let t = Tensor::from_raw_buffer(&bytes, DType::BF16, &p.shape, &Device::Cpu)
                        .and_then(|t| t.to_device(&self.dev))
                        .map_err(err)?;
                    w.insert(p.name.clone(), t);
                }
                out.push(w);
            }
        }
        Ok(out)
    }

    /// One forward call, each block served by `ring` (its plan decides what stays
    /// resident), or, with `direct`, from those weights without a ring.
    pub fn step<B>(&self, mut ring: Option<&mut Ring<B>>, direct: Option<&[W]>, i: &Inputs) -> offload_core::Result<Tensor>
    where
        B: OffloadBackend,
        for<'a> BlockGuard<'a, B>: CandleBlockExt,
    {
        let err = candle_error("running a bench-room block");
        let g = &self.globals;
        if self.z_image.is_some() {
            return self.z_image_step(ring, direct, i);
        }
        if let Some(ids) = &i.ids {
            return self.encode(ring, direct, i, ids);
        }
        let prelude = || -> R<(Tensor, Tensor, Tensor)> {
            let mut temb = self.embedder(&self.sinusoid(0.5)?, "time_text_embed.timestep_embedder")?;
            Ok(match &i.pooled {
                Some(pooled) => {
                    if self.model.guidance {
                        temb = (temb + self.embedder(&self.sinusoid(3.5)?, "time_text_embed.guidance_embedder")?)?;
                    }
                    // The step's embedding `[1, H]` broadcasts to the batch (SD3.5: 2).
                    temb = temb.broadcast_add(&self.embedder(pooled, "time_text_embed.text_embedder")?)?;
                    let img = match g.get("pos_embed.proj.weight") {
                        // SD3's 2×2 patch convolution as a linear over patchified latents.
                        Some(conv) => {
                            let wt = conv.reshape((self.model.hidden, ()))?;
                            candle_nn::Linear::new(wt, Some(get(g, "pos_embed.proj.bias")?.clone())).forward(&i.latents)?
                        }
                        None => lin(&i.latents, g, "x_embedder")?,
                    };
                    (temb, img, lin(&i.text, g, "context_embedder")?)
                }
                None => (temb, lin(&i.latents, g, "img_in")?, lin(&Self::rms(&i.text, get(g, "txt_norm.weight")?)?, g, "txt_in")?),
            })
        };
        let (temb, mut img, mut txt) = prelude().map_err(err)?;
        let mut joint: Option<Tensor> = None;
        each_block(self.model, (&self.timer, &self.dev), ring.as_deref_mut(), direct, |s, index, w| {
            match s.kind {
                BlockKind::DualStream if self.sd3 => (img, txt) = self.sd3_joint(w, &img, &txt, &temb).map_err(err)?,
                BlockKind::DualStream => (img, txt) = self.dual(w, &img, &txt, &temb, i).map_err(err)?,
                BlockKind::SingleStream => {
                    let x = match joint.take() {
                        Some(x) => x,
                        None => Tensor::cat(&[&txt, &img], 1).map_err(err)?,
                    };
                    joint = Some(self.single(w, &x, &temb, i).map_err(err)?);
                }
                other => {
                    return Err(offload_core::Error::unsupported("candle (bench room)", format!("{other:?} blocks ({}.{index})", s.prefix)))
                }
            }
            Ok(())
        })?;
        let out = (|| -> R<Tensor> {
            if let Some(x) = &joint {
                img = x.narrow(1, i.text_tokens, img.dim(1)?)?;
            }
            let e = lin(&temb.silu()?, g, "norm_out.linear")?.unsqueeze(1)?.chunk(2, D::Minus1)?;
            lin(&self.modulate(&img, &e[1], &e[0])?, g, "proj_out")
        })()
        .map_err(err)?;
        if let Some(r) = ring {
            r.end_step()?;
        }
        Ok(out)
    }
}

/// Every block of `model` in step order, its weights handed to `f`: as views of
/// the slot `ring` serves (the guard finished once `f` returns and the views are
/// dropped), or `direct`'s resident copies.
fn each_block<B>(
    model: &Model,
    (timer, dev): (&std::cell::RefCell<Option<Vec<f64>>>, &Device),
    mut ring: Option<&mut Ring<B>>,
    direct: Option<&[W]>,
    mut f: impl FnMut(&crate::registry::Stack, usize, &W) -> offload_core::Result<()>,
) -> offload_core::Result<()>
where
    B: OffloadBackend,
    for<'a> BlockGuard<'a, B>: CandleBlockExt,
{
    let mut k = 0;
    for s in &model.stacks {
        for index in 0..s.count {
            let guard = match ring.as_deref_mut() {
                Some(r) => Some(r.block(s.prefix, index)?),
                None => None,
            };
            let w: W = match (&guard, direct) {
                (Some(g), _) => {
                    // Every tensor of the block read, or the build names those left.
                    g.build(DType::BF16, |vb| {
                        s.block_params(index)
                            .iter()
                            .map(|p| vb.get(p.shape.as_slice(), &p.name).map(|t| (p.name.clone(), t)))
                            .collect::<R<_>>()
                    })?
                }
                (None, Some(ws)) => {
                    ws.get(k).cloned().ok_or_else(|| offload_core::Error::Protocol(format!("no direct weights for block {k}")))?
                }
                (None, None) => return Err(offload_core::Error::Protocol("a step needs a ring or direct weights".into())),
            };
            k += 1;
            let timing = timer.borrow().is_some();
            let sync = || dev.synchronize().map_err(candle_error("synchronising a calibration step"));
            if timing {
                sync()?;
            }
            let t = std::time::Instant::now();
            f(s, index, &w)?;
            if timing {
                sync()?;
                if let Some(times) = timer.borrow_mut().as_mut() {
                    times.push(t.elapsed().as_secs_f64());
                }
            }
            drop(w);
            if let Some(g) = guard {
                g.finish()?;
            }
        }
    }
    Ok(())
}

fn output(t: &Tensor) -> offload_core::Result<(Vec<u8>, Vec<f32>)> {
    let v = t
        .flatten_all()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(candle_error("reading the output"))?;
    Ok((v.iter().flat_map(|x| x.to_le_bytes()).collect(), v))
}

/// Build `model`'s host store (random bf16, pinned) on GPU 0, time every case
/// resident (every block's weights on the device, no ring), then streamed at
/// every depth, in this process ([`crate::drive::run`]).
#[cfg(feature = "candle-cuda")]
pub fn run(model: &Model, opts: &crate::harness::RunOptions) -> Result<crate::harness::RunDoc, String> {
    let be = || offload_candle::CandleCudaBackend::new(0, DType::BF16).map_err(|x| format!("candle: {x}"));
    run_on(model, opts, be)
}

/// The same on candle's CPU device over the simulated one (the loop's test in
/// CI: no activations or allocator peaks there, those fields are 0).
pub fn run_cpu(model: &Model, opts: &crate::harness::RunOptions) -> Result<crate::harness::RunDoc, String> {
    run_on(model, opts, || Ok(CandleBackend::cpu()))
}

fn run_on<B: CandleDevice>(
    model: &Model,
    opts: &crate::harness::RunOptions,
    be: impl FnOnce() -> Result<B, String>,
) -> Result<crate::harness::RunDoc, String>
where
    for<'a> BlockGuard<'a, B>: CandleBlockExt,
{
    if !computes(model) {
        return Err(format!("candle: {}: the bench room has no candle compute for its blocks yet", model.name));
    }
    crate::drive::run(model, opts, || CandleRun::new(model, be()?, (opts.warmup, opts.steps)))
}

/// What candle's file reads of its device beside the ring: names and memory counters.
pub trait CandleDevice: OffloadBackend {
    /// candle's device.
    fn device(&self) -> Device;
    /// The GPU's name.
    fn gpu(&self) -> String;
    /// The ring's slots: bytes live now and their peak since [`Self::reset_slot_peak`].
    fn slots(&self) -> (u64, u64);
    /// Restart the slots' peak at the live bytes.
    fn reset_slot_peak(&self);
    /// The allocator's bytes in use and their peak, where the device has one (0 elsewhere).
    fn pool(&self) -> offload_core::Result<(u64, u64)>;
    /// Restart the allocator's peak.
    fn reset_pool_peak(&self) -> offload_core::Result<()>;
}

impl CandleDevice for CandleBackend {
    fn device(&self) -> Device {
        CandleBackend::device(self)
    }
    fn gpu(&self) -> String {
        "CPU (simulated device)".into()
    }
    fn slots(&self) -> (u64, u64) {
        let s = self.host_device().stats();
        (s.live_bytes, s.peak_bytes)
    }
    fn reset_slot_peak(&self) {
        self.host_device().reset_counters()
    }
    fn pool(&self) -> offload_core::Result<(u64, u64)> {
        Ok((0, 0))
    }
    fn reset_pool_peak(&self) -> offload_core::Result<()> {
        Ok(())
    }
}

#[cfg(feature = "candle-cuda")]
impl CandleDevice for offload_candle::CandleCudaBackend {
    fn device(&self) -> Device {
        offload_candle::CandleCudaBackend::device(self)
    }
    fn gpu(&self) -> String {
        self.cuda().device_name().unwrap_or_default()
    }
    fn slots(&self) -> (u64, u64) {
        let c = self.counters();
        (c.live_bytes, c.peak_bytes)
    }
    fn reset_slot_peak(&self) {
        self.reset_peak()
    }
    fn pool(&self) -> offload_core::Result<(u64, u64)> {
        self.cuda().pool_used_bytes()
    }
    fn reset_pool_peak(&self) -> offload_core::Result<()> {
        self.cuda().reset_pool_peak()
    }
}

fn e(x: offload_core::Error) -> String {
    format!("candle: {x}")
}

/// candle's file in the loop: the host store built first; the resident runs
/// read every block's weights straight from the source (dropped before the
/// first ring).
struct CandleRun<'m, B: OffloadBackend> {
    model: &'m Model,
    be: B,
    dev: Device,
    src: RegistrySource,
    inv: offload_core::ComponentInventory,
    store: Arc<HostStore<B>>,
    facts: crate::harness::StoreFacts,
    net: Net<'m>,
    direct: Option<Vec<W>>,
    steps: (usize, usize),
}

impl<'m, B: CandleDevice> CandleRun<'m, B>
where
    for<'a> BlockGuard<'a, B>: CandleBlockExt,
{
    fn new(model: &'m Model, be: B, steps: (usize, usize)) -> Result<Self, String> {
        let dev = be.device();
        let src = RegistrySource::new(model, 0);
        let inv = block_inventory(model, src.specs()).map_err(e)?;
        let t = std::time::Instant::now();
        let store = Arc::new(HostStore::build(&be, &inv, &src).map_err(e)?);
        let facts = crate::harness::store_facts(&be, &store, t).map_err(e)?;
        let net = Net::new(model, &src, &dev).map_err(e)?;
        Ok(CandleRun { model, be, dev, src, inv, store, facts, net, direct: None, steps })
    }

    fn sync(&self) -> Result<(), String> {
        self.dev.synchronize().map_err(|x| format!("candle: synchronize: {x}"))
    }

    fn timed(&self, f: &mut dyn FnMut() -> offload_core::Result<Tensor>) -> Result<(Vec<f64>, Tensor), String> {
        crate::harness::timed(self.steps, &|| self.sync(), &mut || f().map_err(e))
    }
}

impl<B: CandleDevice> crate::drive::Driver for CandleRun<'_, B>
where
    for<'a> BlockGuard<'a, B>: CandleBlockExt,
{
    const BACKEND: &'static str = "candle";

    fn gpu(&self) -> String {
        self.be.gpu()
    }

    fn resident_bytes(&self) -> u64 {
        self.model.global_bytes(2)
    }

    fn resident(&mut self, c: &Case, calibrate: bool) -> Result<crate::drive::Resident, String> {
        if self.direct.is_none() {
            self.direct = Some(self.net.direct_weights(&self.src).map_err(e)?);
        }
        let (net, direct) = (&self.net, self.direct.as_deref().expect("set above"));
        let i = net.inputs(c).map_err(e)?;
        self.sync()?;
        let before = self.be.pool().map_err(e)?.0;
        self.be.reset_pool_peak().map_err(e)?;
        let (times, rout) = self.timed(&mut || net.step::<B>(None, Some(direct), &i))?;
        let activations = self.be.pool().map_err(e)?.1.saturating_sub(before);
        let (out, _) = output(&rout).map_err(e)?;
        // The budget runs' (and `--depths auto`'s) calibration: three more resident steps, each block's
        // compute timed between device synchronisations, in step order.
        let cost = match calibrate {
            false => None,
            true => {
                let compute = net.calibrate::<B>(direct, &i, 3).map_err(e)?;
                let bytes: HashMap<String, u64> = self.store.blocks().iter().map(|b| (b.id.to_string(), b.bytes() as u64)).collect();
                let ids = self.model.stacks.iter().flat_map(|s| (0..s.count).map(move |k| format!("{}.{k}", s.prefix)));
                let blocks: Vec<offload_plan::BlockCost> = ids
                    .zip(&compute)
                    .map(|(id, &t)| match bytes.get(&id) {
                        Some(&b) => Ok(offload_plan::BlockCost::new(id, b, t)),
                        None => Err(format!("candle: calibration: block {id} is not in the store")),
                    })
                    .collect::<Result<_, _>>()?;
                if blocks.len() != self.store.blocks().len() {
                    return Err(format!("candle: calibration timed {} blocks of {}", blocks.len(), self.store.blocks().len()));
                }
                let source = format!("{}, {} {}, resident steps of zoo run --backend candle", self.gpu(), self.model.name, c.name);
                Some(crate::budgets::cost_model(self.facts.bandwidth, blocks, source))
            }
        };
        Ok(crate::drive::Resident { times, out, activations, cost })
    }

    fn stream(&mut self) -> Result<crate::harness::StoreFacts, String> {
        self.direct = None;
        self.sync()?;
        Ok(self.facts.clone())
    }

    fn streamed(
        &mut self,
        c: &Case,
        plan: &Plan,
        r: &crate::drive::Resident,
        _: Option<&str>,
    ) -> Result<crate::drive::StreamedRun, String> {
        let i = self.net.inputs(c).map_err(e)?;
        let rc = resolved(plan, &self.inv).map_err(e)?;
        self.be.synchronize().map_err(e)?;
        self.be.reset_slot_peak();
        let live_slots = self.be.slots().0;
        let before = self.be.pool().map_err(e)?.0;
        self.be.reset_pool_peak().map_err(e)?;
        let mut ring = Ring::new(self.be.clone(), self.store.clone(), &rc).map_err(e)?;
        let net = &self.net;
        // The bytes the ring copied in the last timed step (the loop holds a budget
        // run to the planner's streamed bytes).
        let mut step_bytes = 0;
        let (times, out) = self.timed(&mut || {
            let before = ring.metrics().bytes_copied;
            let out = net.step(Some(&mut ring), None, &i)?;
            step_bytes = ring.metrics().bytes_copied - before;
            Ok(out)
        })?;
        let memory = (before, live_slots, self.be.pool().map_err(e)?.1);
        let (weights, derived) = crate::harness::streamed_weights(self.be.slots().1, self.resident_bytes(), memory, r.activations);
        let (misses, depth) = (ring.metrics().misses, ring.depth());
        ring.close().map_err(e)?;
        let (sbytes, values) = output(&out).map_err(e)?;
        let s = crate::harness::Streamed { times, equal: sbytes == r.out, values, weights, derived, misses };
        Ok(crate::drive::StreamedRun { s, depth, step_bytes: Some(step_bytes), timeline: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// candle-transformers' SD3 joint block, fed [`sai_block`]'s renamed weights,
    /// computes what the file's own diffusers-named dual block computes without
    /// rotary positions (to a few bf16 ulps of summation order): a q/k/v
    /// concatenated in the wrong order, or a misplaced tensor, would not.
    #[test]
    fn sd3_joint_block_by_candle_transformers_matches_the_diffusers_named_block() {
        let model = crate::registry::tiny(&crate::registry::model("sd3.5-large").unwrap());
        let src = RegistrySource::new(&model, 0);
        let net = Net::new(&model, &src, &Device::Cpu).unwrap();
        assert!(net.sd3);
        let i = net.inputs(&model.cases[0]).unwrap();
        let ws = net.direct_weights(&src).unwrap();
        let (b, h) = (model.cases[0].batch, model.hidden);
        let r = |shape: &[usize]| Tensor::randn(0f32, 1f32, shape, &Device::Cpu).and_then(|t| t.to_dtype(DType::BF16)).unwrap();
        let (img, txt, temb) = (r(&[b, 16, h]), r(&[b, 8, h]), r(&[b, h]));
        // Block 0 (joint) and the last block (context only: its norm's halves swapped).
        let last = ws.len() - 1;
        assert!(!ws[last].contains_key("attn.to_add_out.weight") && ws[0].contains_key("attn.to_add_out.weight"));
        for (k, w) in [(0, &ws[0]), (last, &ws[last])] {
            let (ours_img, ours_txt) = net.dual(w, &img, &txt, &temb, &i).unwrap();
            let (ct_img, ct_txt) = net.sd3_joint(w, &img, &txt, &temb).unwrap();
            for (name, a, c) in [("image", &ours_img, &ct_img), ("text", &ours_txt, &ct_txt)] {
                let a = a.to_dtype(DType::F32).unwrap();
                let c = c.to_dtype(DType::F32).unwrap();
                let scale = a.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let err = (&a - &c).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                assert!(scale > 0.5, "block {k} {name}: outputs too small to compare ({scale})");
                // Threaded CPU GEMMs may sum in another order: a few bf16 ulps at the
                // largest values (one ulp is scale/128 to scale/256); the sabotages
                // (q and k swapped, no (scale, shift) swap) differ by over scale/20.
                assert!(err <= scale / 32.0, "block {k} {name}: candle-transformers' block differs by {err} (values up to {scale})");
            }
        }
    }
}
