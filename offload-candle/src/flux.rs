//! Flux-shaped transformer blocks written with candle (candle-transformers keeps
//! Flux's own blocks private): a double block (image and text streams, joint
//! attention) and a single block (fused QKV + MLP), built per call from a
//! `VarBuilder` and run with candle ops. Used by the candle benchmark and tests;
//! the tensor names follow Flux's checkpoints (`img_attn.qkv.weight`, …).

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{linear, Linear, VarBuilder};

/// Block shapes.
#[derive(Clone, Copy, Debug)]
pub struct FluxShape {
    /// Hidden size (3072 in Flux-dev).
    pub hidden: usize,
    /// Attention heads (24).
    pub heads: usize,
    /// MLP width (12288).
    pub mlp: usize,
}

impl FluxShape {
    /// Flux-dev's shapes.
    pub const DEV: FluxShape = FluxShape { hidden: 3072, heads: 24, mlp: 12288 };

    /// `hidden ÷ heads` (0 for 0 heads: [`check`](Self::check) refuses such a shape).
    fn head_dim(&self) -> usize {
        self.hidden.checked_div(self.heads).unwrap_or(0)
    }

    /// Refuses a shape no Flux block has: a size of 0, heads that do not
    /// divide the hidden size, or a weight whose bytes overflow `usize`. The
    /// blocks check it when built.
    pub fn check(&self) -> Result<()> {
        // The widest weight is at most max(6h, 3h + m) × (h + m) bf16 elements.
        let (h, m) = (self.hidden, self.mlp);
        let widest = || h.checked_mul(6)?.max(h.checked_mul(3)?.checked_add(m)?).checked_mul(h.checked_add(m)?)?.checked_mul(2);
        if widest().is_none() {
            candle_core::bail!("a Flux block of hidden {h} and MLP {m}: its weights' sizes overflow");
        }
        if self.hidden == 0 || self.heads == 0 || self.mlp == 0 || self.hidden % self.heads != 0 {
            candle_core::bail!(
                "a Flux block of hidden {}, {} heads and MLP {}: each must be above 0 and the heads divide the hidden size",
                self.hidden,
                self.heads,
                self.mlp
            );
        }
        Ok(())
    }

    /// Every tensor of a double block, relative to the block: name and shape
    /// (sizes saturate where they would overflow: such a shape's tensors are
    /// then refused by their byte count; [`check`](Self::check) names it).
    pub fn double_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, m, hd) = (self.hidden, self.mlp, self.head_dim());
        let mut v = Vec::new();
        for s in ["img", "txt"] {
            let (h3, h6) = (h.saturating_mul(3), h.saturating_mul(6));
            for (n, o, i) in [("_mod.lin", h6, h), ("_attn.qkv", h3, h), ("_attn.proj", h, h), ("_mlp.0", m, h), ("_mlp.2", h, m)] {
                v.push((format!("{s}{n}.weight"), vec![o, i]));
                v.push((format!("{s}{n}.bias"), vec![o]));
            }
            v.push((format!("{s}_attn.norm.query_norm.scale"), vec![hd]));
            v.push((format!("{s}_attn.norm.key_norm.scale"), vec![hd]));
        }
        v
    }

    /// Every tensor of a single block, relative to the block: name and shape
    /// (sizes saturate as [`double_tensors`](Self::double_tensors)'s do).
    pub fn single_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, m, hd) = (self.hidden, self.mlp, self.head_dim());
        let mut v = Vec::new();
        let h3 = h.saturating_mul(3);
        for (n, o, i) in [("modulation.lin", h3, h), ("linear1", h3.saturating_add(m), h), ("linear2", h, h.saturating_add(m))] {
            v.push((format!("{n}.weight"), vec![o, i]));
            v.push((format!("{n}.bias"), vec![o]));
        }
        v.push(("norm.query_norm.scale".into(), vec![hd]));
        v.push(("norm.key_norm.scale".into(), vec![hd]));
        v
    }
}

fn rms(x: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let f = x.to_dtype(DType::F32)?;
    let r = (f.sqr()?.mean_keepdim(D::Minus1)? + 1e-6)?.sqrt()?.recip()?;
    f.broadcast_mul(&r)?.to_dtype(x.dtype())?.broadcast_mul(scale)
}

fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let f = x.to_dtype(DType::F32)?;
    let mean = f.mean_keepdim(D::Minus1)?;
    let c = f.broadcast_sub(&mean)?;
    let var = c.sqr()?.mean_keepdim(D::Minus1)?;
    let ln = c.broadcast_mul(&(var + 1e-6)?.sqrt()?.recip()?)?.to_dtype(x.dtype())?;
    ln.broadcast_mul(&(scale + 1.0)?)?.broadcast_add(shift)
}

/// `[B, T, 3H]` → q, k, v as `[B, heads, T, hd]`, q and k RMS-normed.
fn heads(qkv: &Tensor, shape: &FluxShape, qn: &Tensor, kn: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = qkv.dims3()?;
    let v = qkv.reshape((b, t, 3, shape.heads, shape.head_dim()))?.permute((2, 0, 3, 1, 4))?;
    Ok((rms(&v.get(0)?.contiguous()?, qn)?, rms(&v.get(1)?.contiguous()?, kn)?, v.get(2)?.contiguous()?))
}

/// The most elements one attention score tensor may hold. candle 0.11's CUDA
/// kernels index with 32-bit integers (`affine` loops on an `unsigned int`, the
/// softmax computes `int row * ncols`), so a score tensor of 2³¹ elements or more
/// hangs or reads the wrong rows; Flux at 2048² (16 896 tokens, 24 heads) would
/// need 6.9 × 10⁹. [`attention`] takes heads, and if one head is still too large
/// query rows, in groups whose scores stay under this.
pub const MAX_SCORES: usize = 1 << 30;

fn attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    attention_chunked(q, k, v, MAX_SCORES)
}

/// `softmax(q kᵀ / √hd) v` for `[B, heads, T, hd]` inputs, returned as
/// `[B, T, heads · hd]`, computing at most `max_scores` scores at a time (groups
/// of heads, then groups of query rows). Every score row is computed whole; a
/// grouping may still round differently from another one (the matrix products can
/// pick other kernels), but one grouping gives the same bytes every time.
pub fn attention_chunked(q: &Tensor, k: &Tensor, v: &Tensor, max_scores: usize) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    if b == 0 || h == 0 || t == 0 {
        // Nothing to attend from: the empty result (the groupings below need a head and a row).
        return Tensor::zeros((b, t, h * hd), q.dtype(), q.device());
    }
    let tk = k.dim(2)?;
    let q = (q * (1.0 / (hd as f64).sqrt()))?;
    let per_head = (b * t * tk).max(1);
    let group = (max_scores / per_head).clamp(1, h);
    let rows = (max_scores / (b * group * tk).max(1)).clamp(1, t);
    let mut heads = Vec::new();
    for h0 in (0..h).step_by(group) {
        let n = group.min(h - h0);
        let kt = k.narrow(1, h0, n)?.t()?.contiguous()?;
        let vh = v.narrow(1, h0, n)?.contiguous()?;
        let mut parts = Vec::new();
        for r0 in (0..t).step_by(rows) {
            let qh = q.narrow(1, h0, n)?.narrow(2, r0, rows.min(t - r0))?.contiguous()?;
            let p = candle_nn::ops::softmax_last_dim(&qh.matmul(&kt)?)?;
            parts.push(p.matmul(&vh)?);
        }
        heads.push(if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 2)? });
    }
    let o = if heads.len() == 1 { heads.remove(0) } else { Tensor::cat(&heads, 1)? };
    o.transpose(1, 2)?.contiguous()?.reshape((b, t, ()))
}

fn mods(lin: &Linear, vec: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    lin.forward(vec)?.unsqueeze(1)?.chunk(n, D::Minus1)
}

struct Stream {
    m: Linear,
    qkv: Linear,
    proj: Linear,
    qn: Tensor,
    kn: Tensor,
    fc1: Linear,
    fc2: Linear,
}

impl Stream {
    fn new(s: &FluxShape, vb: &VarBuilder, pre: &str) -> Result<Self> {
        let (h, m, hd) = (s.hidden, s.mlp, s.head_dim());
        Ok(Stream {
            m: linear(h, 6 * h, vb.pp(format!("{pre}_mod.lin")))?,
            qkv: linear(h, 3 * h, vb.pp(format!("{pre}_attn.qkv")))?,
            proj: linear(h, h, vb.pp(format!("{pre}_attn.proj")))?,
            qn: vb.get(hd, &format!("{pre}_attn.norm.query_norm.scale"))?,
            kn: vb.get(hd, &format!("{pre}_attn.norm.key_norm.scale"))?,
            fc1: linear(h, m, vb.pp(format!("{pre}_mlp.0")))?,
            fc2: linear(m, h, vb.pp(format!("{pre}_mlp.2")))?,
        })
    }
}

/// A Flux double block.
pub struct DoubleBlock {
    shape: FluxShape,
    img: Stream,
    txt: Stream,
}

impl DoubleBlock {
    /// Build from a block's `VarBuilder` (handle clones only).
    pub fn new(shape: FluxShape, vb: VarBuilder) -> Result<Self> {
        shape.check()?;
        Ok(DoubleBlock { shape, img: Stream::new(&shape, &vb, "img")?, txt: Stream::new(&shape, &vb, "txt")? })
    }

    /// `(img, txt)` after the block; `vec` is the conditioning vector `[B, H]`.
    pub fn forward(&self, img: &Tensor, txt: &Tensor, vec: &Tensor) -> Result<(Tensor, Tensor)> {
        let (mi, mt) = (mods(&self.img.m, vec, 6)?, mods(&self.txt.m, vec, 6)?);
        let (iq, ik, iv) = heads(&self.img.qkv.forward(&modulate(img, &mi[0], &mi[1])?)?, &self.shape, &self.img.qn, &self.img.kn)?;
        let (tq, tk, tv) = heads(&self.txt.qkv.forward(&modulate(txt, &mt[0], &mt[1])?)?, &self.shape, &self.txt.qn, &self.txt.kn)?;
        let a = attention(&Tensor::cat(&[tq, iq], 2)?, &Tensor::cat(&[tk, ik], 2)?, &Tensor::cat(&[tv, iv], 2)?)?;
        let tt = txt.dim(1)?;
        let (ta, ia) = (a.narrow(1, 0, tt)?, a.narrow(1, tt, img.dim(1)?)?);
        let img = (img + mi[2].broadcast_mul(&self.img.proj.forward(&ia)?)?)?;
        let f = self.img.fc2.forward(&self.img.fc1.forward(&modulate(&img, &mi[3], &mi[4])?)?.gelu()?)?;
        let img = (&img + mi[5].broadcast_mul(&f)?)?;
        let txt = (txt + mt[2].broadcast_mul(&self.txt.proj.forward(&ta)?)?)?;
        let f = self.txt.fc2.forward(&self.txt.fc1.forward(&modulate(&txt, &mt[3], &mt[4])?)?.gelu()?)?;
        let txt = (&txt + mt[5].broadcast_mul(&f)?)?;
        Ok((img, txt))
    }
}

/// A Flux single block.
pub struct SingleBlock {
    shape: FluxShape,
    m: Linear,
    l1: Linear,
    l2: Linear,
    qn: Tensor,
    kn: Tensor,
}

impl SingleBlock {
    /// Build from a block's `VarBuilder` (handle clones only).
    pub fn new(shape: FluxShape, vb: VarBuilder) -> Result<Self> {
        shape.check()?;
        let (h, m, hd) = (shape.hidden, shape.mlp, shape.head_dim());
        Ok(SingleBlock {
            shape,
            m: linear(h, 3 * h, vb.pp("modulation.lin"))?,
            l1: linear(h, 3 * h + m, vb.pp("linear1"))?,
            l2: linear(h + m, h, vb.pp("linear2"))?,
            qn: vb.get(hd, "norm.query_norm.scale")?,
            kn: vb.get(hd, "norm.key_norm.scale")?,
        })
    }

    /// `x` (text and image tokens) after the block.
    pub fn forward(&self, x: &Tensor, vec: &Tensor) -> Result<Tensor> {
        let h = self.shape.hidden;
        let m = mods(&self.m, vec, 3)?;
        let y = self.l1.forward(&modulate(x, &m[0], &m[1])?)?;
        let (qkv, mlp) = (y.narrow(2, 0, 3 * h)?, y.narrow(2, 3 * h, self.shape.mlp)?);
        let (q, k, v) = heads(&qkv.contiguous()?, &self.shape, &self.qn, &self.kn)?;
        let a = attention(&q, &k, &v)?;
        let o = self.l2.forward(&Tensor::cat(&[a, mlp.gelu()?], 2)?)?;
        x + m[2].broadcast_mul(&o)?
    }
}

/// Random bf16 weights for a Flux-shaped model (`double_blocks.*`, `single_blocks.*`),
/// generated when the host store reads them: no second copy of the model.
pub struct RandomFlux {
    specs: Vec<offload_core::TensorSpec>,
    seed: u64,
}

impl RandomFlux {
    /// `double` double blocks and `single` single blocks of `shape`.
    pub fn new(shape: FluxShape, double: usize, single: usize, seed: u64) -> Self {
        let mut specs = Vec::new();
        for (stack, n, tensors) in [("double_blocks", double, shape.double_tensors()), ("single_blocks", single, shape.single_tensors())] {
            for i in 0..n {
                for (name, dims) in &tensors {
                    specs.push(offload_core::TensorSpec::new(format!("{stack}.{i}.{name}"), offload_core::DType::BF16, dims.clone()));
                }
            }
        }
        RandomFlux { specs, seed }
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl offload_core::TensorSource for RandomFlux {
    fn specs(&self) -> &[offload_core::TensorSpec] {
        &self.specs
    }
    fn read_into(&self, index: usize, dst: &mut [u8]) -> offload_core::Result<()> {
        // Uniform-ish bf16 in ±[2^-6, 2^-5) with a random sign: scales and biases
        // included, so every output depends on every weight.
        let base = splitmix(self.seed ^ (index as u64).wrapping_mul(0x1000_0000_01b3));
        for (i, c) in dst.chunks_exact_mut(2).enumerate() {
            let r = splitmix(base ^ i as u64) as u16;
            let v = (r & 0x8000) | (121 << 7) | (r & 0x7F);
            c.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }
    fn origin(&self) -> String {
        "random Flux-shaped weights".into()
    }
}

/// One step of a Flux-shaped model through `ring`: every block built from its
/// streamed (or resident) weights with [`crate::CandleBlockExt::var_builder`].
pub fn step<B>(
    ring: &mut offload_core::Ring<B>,
    shape: FluxShape,
    (double, single): (usize, usize),
    img: &Tensor,
    txt: &Tensor,
    vec: &Tensor,
) -> offload_core::Result<Tensor>
where
    B: offload_core::OffloadBackend,
    for<'a> offload_core::BlockGuard<'a, B>: crate::CandleBlockExt,
{
    use crate::CandleBlockExt;
    let err = crate::candle_error("running a Flux block");
    let (mut img, mut txt) = (img.clone(), txt.clone());
    for i in 0..double {
        let g = ring.block("double_blocks", i)?;
        let b = g.build(DType::BF16, |vb| DoubleBlock::new(shape, vb))?;
        (img, txt) = b.forward(&img, &txt, vec).map_err(err)?;
        drop(b);
        g.finish()?;
    }
    let mut x = Tensor::cat(&[txt, img], 1).map_err(err)?;
    for i in 0..single {
        let g = ring.block("single_blocks", i)?;
        let b = g.build(DType::BF16, |vb| SingleBlock::new(shape, vb))?;
        x = b.forward(&x, vec).map_err(err)?;
        drop(b);
        g.finish()?;
    }
    ring.end_step()?;
    Ok(x)
}
