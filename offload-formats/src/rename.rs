//! A checkpoint's tensors under another model's names: each new tensor is one
//! or more runs of rows of the file's tensors, read as stored (a fused `qkv`
//! weight split into `to_q`, `to_k`, `to_v`; quantized rows are whole blocks, so
//! a split is a byte range). [`flux_bfl_to_diffusers`] maps Flux as Black
//! Forest Labs and the Flux GGUF releases name it onto diffusers'
//! `FluxTransformer2DModel`, as diffusers' own
//! `convert_flux_transformer_checkpoint_to_diffusers` does.

use offload_core::error::{Error, Result};
use offload_core::source::{CheckpointFile, FileIdentity, HostRegion, RegionSource, TensorSource};
use offload_core::tensor::TensorSpec;
use std::collections::HashMap;

/// Where a new tensor's bytes lie: (the source's tensor index, byte offset in
/// it, length), concatenated in order.
pub type Parts = Vec<(usize, usize, usize)>;

/// `inner`'s tensors under new names, each new tensor read from its parts.
pub struct Renamed<S> {
    inner: S,
    specs: Vec<TensorSpec>,
    parts: Vec<Parts>,
}

impl<S: RegionSource> Renamed<S> {
    /// `inner` seen through `mapping` (new spec, its parts). Every part must lie
    /// inside its tensor, be of the new spec's dtype and hold whole elements
    /// (whole blocks of a quantized type), and the parts must add up to the new
    /// spec's size.
    pub fn new(inner: S, mapping: Vec<(TensorSpec, Parts)>) -> Result<Self> {
        let (mut specs, mut parts) = (Vec::with_capacity(mapping.len()), Vec::with_capacity(mapping.len()));
        for (spec, p) in mapping {
            let want = spec.nbytes()?;
            let mut got = 0usize;
            for &(i, off, len) in &p {
                let src = inner.specs().get(i).ok_or_else(|| bad(&spec.name, format!("part of tensor {i}, which the source lacks")))?;
                if off.checked_add(len).is_none_or(|end| end > src.nbytes().unwrap_or(0)) {
                    return Err(bad(&spec.name, format!("bytes {off}..+{len} of {:?}, which holds {}", src.name, src.nbytes()?)));
                }
                // Read as stored: the same type, whole elements (whole blocks of a quantized type).
                if src.dtype != spec.dtype {
                    return Err(bad(&spec.name, format!("a {:?} tensor read from {:?}, which is {:?}", spec.dtype, src.name, src.dtype)));
                }
                let unit = src.dtype.size();
                if off % unit != 0 || len % unit != 0 {
                    return Err(bad(
                        &spec.name,
                        format!("bytes {off}..+{len} of {:?} cut an element (or block) of {unit} bytes", src.name),
                    ));
                }
                got += len;
            }
            if got != want {
                return Err(bad(&spec.name, format!("parts of {got} bytes for a tensor of {want}")));
            }
            specs.push(spec);
            parts.push(p);
        }
        Ok(Renamed { inner, specs, parts })
    }

    /// The source underneath.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

fn bad(tensor: &str, fault: String) -> Error {
    Error::BadTensor { tensor: tensor.to_owned(), fault }
}

impl<S: RegionSource> TensorSource for Renamed<S> {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn origin(&self) -> String {
        format!("{} (renamed)", self.inner.origin())
    }
    /// The parts read from the source's region (whose reads check the file is
    /// unchanged), one after another; a part of a source tensor that is not one
    /// range of the region (a renaming of a renaming) through the source's own read.
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let region = self.inner.region();
        let mut at = 0;
        for &(i, off, len) in &self.parts[index] {
            let read = match self.inner.tensor_offset(i) {
                Some(start) => region.read_at(start + off, &mut dst[at..at + len]),
                None => {
                    let mut whole = vec![0; self.inner.specs()[i].nbytes()?];
                    self.inner.read_into(i, &mut whole).map(|()| dst[at..at + len].copy_from_slice(&whole[off..off + len]))
                }
            };
            read.map_err(|e| offload_core::source::naming(e, &self.specs[index].name))?;
            at += len;
        }
        Ok(())
    }
}

/// The mapped host tier (and the disk tier) under the new names: a tensor that
/// is one run of rows of a file's tensor (a split `qkv`) lies in the file as one
/// range; one joined from parts (Flux's `norm_out.linear`, scale and shift
/// swapped) does not, and a block holding one is copied (planned on disk, it is
/// an error naming it).
impl<S: RegionSource> RegionSource for Renamed<S> {
    fn region(&self) -> std::sync::Arc<dyn HostRegion> {
        self.inner.region()
    }
    fn tensor_offset(&self, index: usize) -> Option<usize> {
        match self.parts[index].as_slice() {
            &[(i, off, _)] => self.inner.tensor_offset(i).map(|start| start + off),
            _ => None,
        }
    }
}

impl<S: CheckpointFile> CheckpointFile for Renamed<S> {
    fn file_path(&self) -> &std::path::Path {
        self.inner.file_path()
    }
    fn opened_identity(&self) -> FileIdentity {
        self.inner.opened_identity()
    }
}

/// The sizes of a Flux transformer, for [`flux_bfl_tensors`].
#[derive(Clone, Copy, Debug)]
pub struct FluxSizes {
    /// Hidden size (Flux-dev: 3072).
    pub hidden: usize,
    /// Head size (128), the query and key norms' length.
    pub head_dim: usize,
    /// MLP width (12288).
    pub mlp: usize,
    /// Double-stream and single-stream blocks (19, 38).
    pub double: usize,
    /// See [`double`](Self::double).
    pub single: usize,
    /// Pooled text embedding (768), text embedding (4096), latent channels in and out (64, 64).
    pub pooled: usize,
    /// See [`pooled`](Self::pooled).
    pub text: usize,
    /// See [`pooled`](Self::pooled).
    pub in_channels: usize,
    /// See [`pooled`](Self::pooled).
    pub out_channels: usize,
}

/// Every tensor of a Flux transformer (with a guidance embedder) as Black Forest
/// Labs' checkpoint and the Flux GGUF releases name it, `(name, shape)`, in the
/// order written here: what [`flux_bfl_to_diffusers`] maps.
pub fn flux_bfl_tensors(f: FluxSizes) -> Vec<(String, Vec<usize>)> {
    let (h, mut out) = (f.hidden, Vec::new());
    let mut lin = |name: String, o: usize, i: usize| {
        out.push((format!("{name}.weight"), vec![o, i]));
        out.push((format!("{name}.bias"), vec![o]));
    };
    for e in ["time_in", "guidance_in"] {
        lin(format!("{e}.in_layer"), h, 256);
        lin(format!("{e}.out_layer"), h, h);
    }
    lin("vector_in.in_layer".into(), h, f.pooled);
    lin("vector_in.out_layer".into(), h, h);
    lin("txt_in".into(), h, f.text);
    lin("img_in".into(), h, f.in_channels);
    for b in 0..f.double {
        for s in ["img", "txt"] {
            lin(format!("double_blocks.{b}.{s}_mod.lin"), 6 * h, h);
            lin(format!("double_blocks.{b}.{s}_attn.qkv"), 3 * h, h);
            lin(format!("double_blocks.{b}.{s}_attn.proj"), h, h);
            lin(format!("double_blocks.{b}.{s}_mlp.0"), f.mlp, h);
            lin(format!("double_blocks.{b}.{s}_mlp.2"), h, f.mlp);
        }
    }
    for b in 0..f.single {
        lin(format!("single_blocks.{b}.modulation.lin"), 3 * h, h);
        lin(format!("single_blocks.{b}.linear1"), 3 * h + f.mlp, h);
        lin(format!("single_blocks.{b}.linear2"), h, h + f.mlp);
    }
    lin("final_layer.linear".into(), f.out_channels, h);
    lin("final_layer.adaLN_modulation.1".into(), 2 * h, h);
    let norms = (0..f.double).flat_map(|b| ["img", "txt"].map(|s| format!("double_blocks.{b}.{s}_attn.norm")));
    for n in norms.chain((0..f.single).map(|b| format!("single_blocks.{b}.norm"))) {
        for k in ["query_norm", "key_norm"] {
            out.push((format!("{n}.{k}.scale"), vec![f.head_dim]));
        }
    }
    out
}

/// The bytes of the first `rows` rows of `s` (its outermost dimension): the size
/// of `s` with that dimension `rows`, an error naming `s` where that is no whole
/// number of its dtype's blocks (a 1-D block-quantized tensor cut mid-block).
fn rows_bytes(s: &TensorSpec, rows: usize) -> Result<usize> {
    let mut shape = s.shape.clone();
    match shape.first_mut() {
        Some(d) => *d = rows,
        None => return Err(Error::BadTensor { tensor: s.name.clone(), fault: "a scalar has no rows to split".into() }),
    }
    TensorSpec::new(s.name.clone(), s.dtype, shape)
        .nbytes()
        .map_err(|e| Error::BadTensor { tensor: s.name.clone(), fault: format!("{rows} rows do not split it where a block ends ({e})") })
}

/// Flux's tensors as BFL names them (`double_blocks.N.img_attn.qkv.weight`,
/// `single_blocks.N.linear1.weight`, `final_layer.adaLN_modulation.1.weight`,
/// …; a `model.diffusion_model.` prefix is dropped) mapped onto diffusers'
/// names: fused projections split by rows, the final modulation's shift and
/// scale halves swapped. The hidden size comes from the shapes. A tensor the
/// mapping does not know, or one whose rows do not split, is an error naming it:
/// nothing is dropped silently.
pub fn flux_bfl_to_diffusers(specs: &[TensorSpec]) -> Result<Vec<(TensorSpec, Parts)>> {
    let by_name: HashMap<&str, usize> =
        specs.iter().enumerate().map(|(i, s)| (s.name.strip_prefix("model.diffusion_model.").unwrap_or(&s.name), i)).collect();
    let mut used = vec![false; specs.len()];
    let mut out = Vec::new();
    // (new name, source index, first row, rows)
    let mut rows = |new: String, i: usize, first: usize, n: usize, out: &mut Vec<(TensorSpec, Parts)>| -> Result<()> {
        let s = &specs[i];
        let mut shape = s.shape.clone();
        if let Some(d) = shape.first_mut() {
            *d = n;
        }
        // Byte offsets of whole rows: for a 1-D block-quantized tensor, where a
        // block ends (an error naming the tensor otherwise).
        let (at, len) = (rows_bytes(s, first)?, rows_bytes(s, n)?);
        used[i] = true;
        out.push((TensorSpec::new(new, s.dtype, shape), vec![(i, at, len)]));
        Ok(())
    };
    let whole = |i: usize| specs[i].shape.first().copied().unwrap_or(1);
    // Renames one to one.
    let mut plain: Vec<(String, String)> = vec![
        ("time_in.in_layer".into(), "time_text_embed.timestep_embedder.linear_1".into()),
        ("time_in.out_layer".into(), "time_text_embed.timestep_embedder.linear_2".into()),
        ("vector_in.in_layer".into(), "time_text_embed.text_embedder.linear_1".into()),
        ("vector_in.out_layer".into(), "time_text_embed.text_embedder.linear_2".into()),
        ("guidance_in.in_layer".into(), "time_text_embed.guidance_embedder.linear_1".into()),
        ("guidance_in.out_layer".into(), "time_text_embed.guidance_embedder.linear_2".into()),
        ("txt_in".into(), "context_embedder".into()),
        ("img_in".into(), "x_embedder".into()),
        ("final_layer.linear".into(), "proj_out".into()),
    ];
    let blocks = |prefix: &str| {
        let mut v: Vec<usize> = by_name.keys().filter_map(|k| k.strip_prefix(prefix)?.split('.').next()?.parse().ok()).collect::<Vec<_>>();
        v.sort_unstable();
        v.dedup();
        v
    };
    for n in blocks("double_blocks.") {
        let (b, d) = (format!("double_blocks.{n}."), format!("transformer_blocks.{n}."));
        for (from, to) in [
            ("img_mod.lin", "norm1.linear"),
            ("txt_mod.lin", "norm1_context.linear"),
            ("img_attn.proj", "attn.to_out.0"),
            ("txt_attn.proj", "attn.to_add_out"),
            ("img_mlp.0", "ff.net.0.proj"),
            ("img_mlp.2", "ff.net.2"),
            ("txt_mlp.0", "ff_context.net.0.proj"),
            ("txt_mlp.2", "ff_context.net.2"),
        ] {
            plain.push((format!("{b}{from}"), format!("{d}{to}")));
        }
        for (from, to) in [
            ("img_attn.norm.query_norm.scale", "attn.norm_q.weight"),
            ("img_attn.norm.key_norm.scale", "attn.norm_k.weight"),
            ("txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"),
            ("txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"),
        ] {
            if let Some(&i) = by_name.get(format!("{b}{from}").as_str()) {
                rows(format!("{d}{to}"), i, 0, whole(i), &mut out)?;
            }
        }
        for (fused, parts) in [
            ("img_attn.qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]),
            ("txt_attn.qkv", ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"]),
        ] {
            for suffix in ["weight", "bias"] {
                let name = format!("{b}{fused}.{suffix}");
                let Some(&i) = by_name.get(name.as_str()) else { continue };
                let total = whole(i);
                if total % 3 != 0 {
                    return Err(bad(&specs[i].name, format!("{total} rows do not split into q, k and v")));
                }
                for (k, p) in parts.iter().enumerate() {
                    rows(format!("{d}{p}.{suffix}"), i, k * (total / 3), total / 3, &mut out)?;
                }
            }
        }
    }
    for n in blocks("single_blocks.") {
        let (b, d) = (format!("single_blocks.{n}."), format!("single_transformer_blocks.{n}."));
        plain.push((format!("{b}modulation.lin"), format!("{d}norm.linear")));
        plain.push((format!("{b}linear2"), format!("{d}proj_out")));
        for (from, to) in [("norm.query_norm.scale", "attn.norm_q.weight"), ("norm.key_norm.scale", "attn.norm_k.weight")] {
            if let Some(&i) = by_name.get(format!("{b}{from}").as_str()) {
                rows(format!("{d}{to}"), i, 0, whole(i), &mut out)?;
            }
        }
        // linear1: q, k, v (hidden rows each) then the MLP's input; hidden is linear2's output.
        let hidden = by_name.get(format!("{b}linear2.weight").as_str()).map(|&i| whole(i));
        for suffix in ["weight", "bias"] {
            let name = format!("{b}linear1.{suffix}");
            let Some(&i) = by_name.get(name.as_str()) else { continue };
            let h = hidden.ok_or_else(|| bad(&specs[i].name, format!("no {b}linear2.weight to size the split by")))?;
            let total = whole(i);
            // `h` is a header's number (checked: a zero-width tensor's rows can be any size).
            if h.checked_mul(3).is_none_or(|qkv| total <= qkv) {
                return Err(bad(&specs[i].name, format!("{total} rows: q, k, v of {h} and an MLP do not fit")));
            }
            for (k, p) in ["attn.to_q", "attn.to_k", "attn.to_v"].iter().enumerate() {
                rows(format!("{d}{p}.{suffix}"), i, k * h, h, &mut out)?;
            }
            rows(format!("{d}proj_mlp.{suffix}"), i, 3 * h, total - 3 * h, &mut out)?;
        }
    }
    for (from, to) in plain {
        for suffix in ["weight", "bias"] {
            if let Some(&i) = by_name.get(format!("{from}.{suffix}").as_str()) {
                rows(format!("{to}.{suffix}"), i, 0, whole(i), &mut out)?;
            }
        }
    }
    // The final modulation: BFL's (shift, scale), diffusers' (scale, shift).
    for suffix in ["weight", "bias"] {
        if let Some(&i) = by_name.get(format!("final_layer.adaLN_modulation.1.{suffix}").as_str()) {
            let s = &specs[i];
            let total = whole(i);
            if total % 2 != 0 {
                return Err(bad(&s.name, format!("{total} rows do not split into shift and scale")));
            }
            // Halves of whole rows (of a 1-D block-quantized tensor, where a block ends).
            let half = rows_bytes(s, total / 2)?;
            used[i] = true;
            out.push((TensorSpec::new(format!("norm_out.linear.{suffix}"), s.dtype, s.shape.clone()), vec![(i, half, half), (i, 0, half)]));
        }
    }
    if let Some(i) = used.iter().position(|u| !u) {
        return Err(bad(&specs[i].name, "a Flux checkpoint tensor the BFL-to-diffusers mapping does not know".into()));
    }
    Ok(out)
}

/// Wan 2.1's tensors as its own checkpoints and the Wan GGUF releases name
/// them (`blocks.N.self_attn.q`, `blocks.N.modulation`, `head.head`, …; a
/// `model.diffusion_model.` prefix dropped) under diffusers'
/// `WanTransformer3DModel` names: the renames diffusers'
/// `convert_wan_transformer_to_diffusers` applies, in its order (so `norm2` and
/// `norm3` trade places), each tensor whole. A name none of them touches keeps
/// its name (as diffusers' converter keeps it).
pub fn wan_to_diffusers(specs: &[TensorSpec]) -> Result<Vec<(TensorSpec, Parts)>> {
    const RENAMES: [(&str, &str); 30] = [
        ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
        ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
        ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
        ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
        ("time_projection.1", "condition_embedder.time_proj"),
        ("cross_attn", "attn2"),
        ("self_attn", "attn1"),
        (".o.", ".to_out.0."),
        (".q.", ".to_q."),
        (".k.", ".to_k."),
        (".v.", ".to_v."),
        (".k_img.", ".add_k_proj."),
        (".v_img.", ".add_v_proj."),
        (".norm_k_img.", ".norm_added_k."),
        ("head.modulation", "scale_shift_table"),
        ("head.head", "proj_out"),
        ("modulation", "scale_shift_table"),
        ("ffn.0", "ffn.net.0.proj"),
        ("ffn.2", "ffn.net.2"),
        ("norm2", "norm__placeholder"),
        ("norm3", "norm2"),
        ("norm__placeholder", "norm3"),
        ("img_emb.proj.0", "condition_embedder.image_embedder.norm1"),
        ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
        ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2"),
        ("img_emb.proj.4", "condition_embedder.image_embedder.norm2"),
        // Wan's first-last-frame model (FLF2V).
        ("img_emb.emb_pos", "condition_embedder.image_embedder.pos_embed"),
        ("before_proj", "proj_in"),
        ("after_proj", "proj_out"),
        ("model.diffusion_model.", ""),
    ];
    let mut out = Vec::with_capacity(specs.len());
    let mut names = std::collections::HashSet::new();
    for (i, s) in specs.iter().enumerate() {
        // The prefix first (the last entry), then the renames in diffusers' order.
        let mut name = s.name.strip_prefix("model.diffusion_model.").unwrap_or(&s.name).to_owned();
        for (from, to) in &RENAMES[..RENAMES.len() - 1] {
            name = name.replace(from, to);
        }
        if !names.insert(name.clone()) {
            return Err(bad(&s.name, format!("renamed {name:?}, which another tensor was renamed to as well")));
        }
        out.push((TensorSpec::new(name, s.dtype, s.shape.clone()), vec![(i, 0, s.nbytes()?)]));
    }
    Ok(out)
}

/// The top-level modules of diffusers' `QwenImageTransformer2DModel`, the only
/// names a Qwen-Image file under diffusers' names may start with
/// (`tests/data/qwen-image-diffusers-names.txt`, checked against diffusers).
const QWEN_IMAGE_MODULES: [&str; 7] = ["img_in", "norm_out", "proj_out", "time_text_embed", "transformer_blocks", "txt_in", "txt_norm"];

/// Qwen-Image's tensors as its GGUF releases name them under diffusers'
/// `QwenImageTransformer2DModel` names. The conversions (ComfyUI-GGUF's
/// `qwen_image` architecture) keep the names of the diffusers-format
/// checkpoint Qwen-Image was released in (`transformer_blocks.N.attn.to_q`,
/// `img_mod.1`, ...), some behind a `model.diffusion_model.` prefix, which is
/// dropped; each tensor whole. A tensor outside the model's modules (a file in
/// another model's names) is an error naming it.
pub fn qwen_image_to_diffusers(specs: &[TensorSpec]) -> Result<Vec<(TensorSpec, Parts)>> {
    let mut out = Vec::with_capacity(specs.len());
    let mut names = std::collections::HashSet::new();
    for (i, s) in specs.iter().enumerate() {
        let name = s.name.strip_prefix("model.diffusion_model.").unwrap_or(&s.name);
        let top = name.split('.').next().unwrap_or("");
        if !QWEN_IMAGE_MODULES.contains(&top) || !name.contains('.') {
            return Err(bad(
                &s.name,
                format!("not a Qwen-Image tensor under diffusers' names (its modules: {})", QWEN_IMAGE_MODULES.join(", ")),
            ));
        }
        if !names.insert(name.to_owned()) {
            return Err(bad(&s.name, format!("{name:?} given twice (with and without the prefix)")));
        }
        out.push((TensorSpec::new(name, s.dtype, s.shape.clone()), vec![(i, 0, s.nbytes()?)]));
    }
    Ok(out)
}

/// The architectures [`gguf_to_diffusers`] maps, as a GGUF file's
/// `general.architecture` names them.
pub const GGUF_ARCHITECTURES: [&str; 3] = ["flux", "qwen_image", "wan"];

/// `file`'s tensors under diffusers' names, by the architecture it names
/// ([`gguf_to_diffusers`]): what offload streams from a GGUF release. A file
/// naming no architecture is an error saying which ones are mapped.
pub fn gguf_under_diffusers_names(file: crate::gguf::GgufFile) -> Result<Renamed<crate::gguf::GgufFile>> {
    let arch = file.architecture().map(str::to_owned).ok_or_else(|| {
        Error::Plan(format!("{}: no general.architecture (offload maps {})", file.path().display(), GGUF_ARCHITECTURES.join(", ")))
    })?;
    let mapping = gguf_to_diffusers(&arch, file.specs())?;
    Renamed::new(file, mapping)
}

/// A diffusion model's GGUF tensors under diffusers' names, by the
/// architecture its metadata names (`general.architecture`, as ComfyUI-GGUF's
/// converter writes it; [`crate::gguf::GgufFile::architecture`]): `flux`
/// ([`flux_bfl_to_diffusers`]), `wan` ([`wan_to_diffusers`]) or `qwen_image`
/// ([`qwen_image_to_diffusers`]). Any other architecture is an error naming it.
pub fn gguf_to_diffusers(architecture: &str, specs: &[TensorSpec]) -> Result<Vec<(TensorSpec, Parts)>> {
    match architecture {
        "flux" => flux_bfl_to_diffusers(specs),
        "wan" => wan_to_diffusers(specs),
        "qwen_image" => qwen_image_to_diffusers(specs),
        other => Err(Error::Plan(format!(
            "a GGUF file of architecture {other:?}: offload maps {} onto diffusers' names",
            GGUF_ARCHITECTURES.join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::tensor::DType;

    /// BFL's final modulation swaps halves of whole rows: a 1-D block-quantized
    /// tensor splits only where a block ends (Q8_0 of 96 values is three 34-byte
    /// blocks: its middle is inside one, a named error, not a split block; of
    /// 128 values, four blocks, it splits after two).
    #[test]
    fn a_split_through_a_quantized_block_is_refused() {
        let q = vec![TensorSpec::new("final_layer.adaLN_modulation.1.bias", offload_core::tensor::DType::Q8_0, [96])];
        let e = flux_bfl_to_diffusers(&q).unwrap_err().to_string();
        assert!(e.contains("adaLN_modulation.1.bias") && e.contains("do not split"), "{e}");
        let b = vec![TensorSpec::new("final_layer.adaLN_modulation.1.bias", offload_core::tensor::DType::BF16, [96])];
        let m = flux_bfl_to_diffusers(&b).unwrap();
        assert_eq!(m[0].1, vec![(0, 96, 96), (0, 0, 96)], "bf16 halves swapped");
        let q = vec![TensorSpec::new("final_layer.adaLN_modulation.1.bias", offload_core::tensor::DType::Q8_0, [128])];
        let m = flux_bfl_to_diffusers(&q).unwrap();
        assert_eq!(m[0].1, vec![(0, 68, 68), (0, 0, 68)], "Q8_0 halves of two blocks each");
    }

    /// Zero-width tensors pass a file's byte checks with any row count: rows
    /// near `usize::MAX` split or are a named error, never an overflow.
    #[test]
    fn row_counts_near_the_top_of_usize_are_an_error_not_an_overflow() {
        let z = |name: &str, rows: usize| TensorSpec::new(name, DType::BF16, [rows, 0]);
        let single = [z("single_blocks.0.linear2.weight", 1 << 63), z("single_blocks.0.linear1.weight", (1 << 63) + 1)];
        let qkv = [z("double_blocks.0.img_attn.qkv.weight", 3 << 62)];
        let got = std::panic::catch_unwind(|| flux_bfl_to_diffusers(&single).map(|m| m.len()));
        assert!(matches!(got, Ok(Err(_))), "q, k and v of 2^63 rows each do not fit: {got:?}");
        // Split in three, as any other fused q, k, v.
        let got = std::panic::catch_unwind(|| flux_bfl_to_diffusers(&qkv).map(|m| m.len()));
        assert!(matches!(got, Ok(Ok(3))), "{got:?}");
    }

    /// A renaming of a renaming: the outer tensor is a run of bytes of an inner
    /// one joined from two parts (not one range of the file), read through the
    /// inner renaming; and it is not served as a range of the file.
    #[test]
    fn a_part_of_a_joined_tensor_is_read_through_the_renaming_below() {
        use offload_core::source::SafetensorsFile;
        let path = std::env::temp_dir().join(format!("offload-rename-nested-{}.safetensors", std::process::id()));
        let (a, b) = ([1u8, 2, 3, 4], [5u8, 6, 7, 8]);
        let views = [("a", &a), ("b", &b)]
            .map(|(n, v)| (n.to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![4], v).unwrap()));
        std::fs::write(&path, safetensors::serialize(views, &None).unwrap()).unwrap();
        let file = SafetensorsFile::open(&path).unwrap();
        let (ia, ib) = (file.specs().iter().position(|s| s.name == "a").unwrap(), file.specs().iter().position(|s| s.name == "b").unwrap());
        let u8s = |n: &str, len: usize| TensorSpec::new(n, DType::U8, [len]);
        let inner = Renamed::new(file, vec![(u8s("ab", 8), vec![(ib, 0, 4), (ia, 0, 4)])]).unwrap();
        let outer = Renamed::new(inner, vec![(u8s("x", 4), vec![(0, 2, 4)])]).unwrap();
        let mut got = [0u8; 4];
        outer.read_into(0, &mut got).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(got, [7, 8, 1, 2]);
        assert_eq!(outer.tensor_offset(0), None, "a part of a joined tensor is not one range of the file");
    }

    /// A caller's mapping that would read bytes as another type, or cut an
    /// element or a quantized block, is refused naming the tensor.
    #[test]
    fn a_mapping_that_reads_bytes_as_another_type_or_cuts_an_element_is_refused() {
        use offload_core::source::SafetensorsFile;
        let path = std::env::temp_dir().join(format!("offload-rename-types-{}.safetensors", std::process::id()));
        let w = [0u8; 16];
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4], &w).unwrap();
        std::fs::write(&path, safetensors::serialize([("w".to_string(), view)], &None).unwrap()).unwrap();
        let open = || SafetensorsFile::open(&path).unwrap();
        let e = Renamed::new(open(), vec![(TensorSpec::new("h", DType::BF16, [8]), vec![(0, 0, 16)])]).err().expect("bf16 over f32");
        assert!(e.to_string().contains("\"h\"") && e.to_string().contains("F32"), "{e}");
        let e = Renamed::new(open(), vec![(TensorSpec::new("x", DType::F32, [2]), vec![(0, 2, 8)])]).err().expect("mid-element");
        assert!(e.to_string().contains("\"x\"") && e.to_string().contains("element"), "{e}");
        assert!(Renamed::new(open(), vec![(TensorSpec::new("x", DType::F32, [2]), vec![(0, 8, 8)])]).is_ok());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn an_unknown_tensor_or_a_fused_tensor_that_does_not_split_is_named() {
        let t = |n: &str, s: &[usize]| TensorSpec::new(n, DType::BF16, s);
        let e = flux_bfl_to_diffusers(&[t("img_in.weight", &[4, 4]), t("lora_up.weight", &[4, 4])]).unwrap_err().to_string();
        assert!(e.contains("lora_up.weight") && e.contains("does not know"), "{e}");
        let e = flux_bfl_to_diffusers(&[t("double_blocks.0.img_attn.qkv.weight", &[10, 4])]).unwrap_err().to_string();
        assert!(e.contains("double_blocks.0.img_attn.qkv.weight") && e.contains("10 rows"), "{e}");
        let e = flux_bfl_to_diffusers(&[t("single_blocks.0.linear1.weight", &[12, 4])]).unwrap_err().to_string();
        assert!(e.contains("linear2"), "{e}");
        // The prefix some checkpoints carry is dropped.
        let m = flux_bfl_to_diffusers(&[t("model.diffusion_model.img_in.weight", &[4, 4])]).unwrap();
        assert_eq!(m[0].0.name, "x_embedder.weight");
    }

    /// `tests/data/qwen-image-diffusers-names.txt` (a one-block Qwen-Image,
    /// checked against diffusers by a pytest row), with and without the prefix.
    #[test]
    fn qwen_image_names_keep_diffusers_names_and_the_architecture_picks_the_map() {
        let fixture = include_str!("../../tests/data/qwen-image-diffusers-names.txt");
        let parse = |prefix: &str| -> Vec<TensorSpec> {
            fixture
                .lines()
                .map(|l| {
                    let (n, s) = l.split_once(' ').unwrap();
                    TensorSpec::new(format!("{prefix}{n}"), DType::BF16, s.split('x').map(|d| d.parse().unwrap()).collect::<Vec<usize>>())
                })
                .collect()
        };
        // The fixture's top-level modules are exactly the ones the map admits.
        let mut tops: Vec<&str> = fixture.lines().map(|l| l.split('.').next().unwrap()).collect();
        tops.sort_unstable();
        tops.dedup();
        assert_eq!(tops, QWEN_IMAGE_MODULES);
        let want: Vec<(String, Vec<usize>)> = parse("").into_iter().map(|s| (s.name, s.shape)).collect();
        for prefix in ["", "model.diffusion_model."] {
            let got: Vec<(String, Vec<usize>)> =
                gguf_to_diffusers("qwen_image", &parse(prefix)).unwrap().into_iter().map(|(s, _)| (s.name, s.shape)).collect();
            assert_eq!(got, want, "prefix {prefix:?}");
        }
        let t = |n: &str, s: &[usize]| TensorSpec::new(n, DType::BF16, s);
        // A Flux (BFL) name is not Qwen-Image's; a name given with and without the prefix is named.
        let e = qwen_image_to_diffusers(&[t("double_blocks.0.img_attn.qkv.weight", &[3, 4])]).unwrap_err().to_string();
        assert!(e.contains("double_blocks.0.img_attn.qkv.weight") && e.contains("txt_norm"), "{e}");
        let e = qwen_image_to_diffusers(&[t("img_in.weight", &[4, 4]), t("model.diffusion_model.img_in.weight", &[4, 4])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("given twice"), "{e}");
        // The architecture picks the map; an unknown one is named with those known.
        assert_eq!(gguf_to_diffusers("flux", &[t("img_in.weight", &[4, 4])]).unwrap()[0].0.name, "x_embedder.weight");
        assert_eq!(gguf_to_diffusers("wan", &[t("head.head.weight", &[4, 4])]).unwrap()[0].0.name, "proj_out.weight");
        let e = gguf_to_diffusers("sd3", &[t("img_in.weight", &[4, 4])]).unwrap_err().to_string();
        assert!(e.contains("\"sd3\"") && e.contains("qwen_image"), "{e}");
    }

    /// `tests/data/wan-original-names.txt` (a one-block Wan 2.1 as its own
    /// checkpoints name it) mapped onto `tests/data/wan-diffusers-names.txt`
    /// (diffusers' WanTransformer3DModel): a pytest row checks both fixtures
    /// against diffusers and its own converter.
    #[test]
    fn wan_names_map_onto_diffusers_wan() {
        let parse = |text: &str| -> Vec<TensorSpec> {
            text.lines()
                .map(|l| {
                    let (n, s) = l.split_once(' ').unwrap();
                    TensorSpec::new(n, DType::BF16, s.split('x').map(|d| d.parse().unwrap()).collect::<Vec<usize>>())
                })
                .collect()
        };
        let original = parse(include_str!("../../tests/data/wan-original-names.txt"));
        let mut want: Vec<(String, Vec<usize>)> =
            parse(include_str!("../../tests/data/wan-diffusers-names.txt")).into_iter().map(|s| (s.name, s.shape)).collect();
        let mut got: Vec<(String, Vec<usize>)> = wan_to_diffusers(&original).unwrap().into_iter().map(|(s, _)| (s.name, s.shape)).collect();
        got.sort();
        want.sort();
        assert_eq!(got, want);
        let t = |n: &str, s: &[usize]| TensorSpec::new(n, DType::BF16, s);
        let e =
            wan_to_diffusers(&[t("blocks.0.ffn.0.weight", &[4, 4]), t("blocks.0.ffn.net.0.proj.weight", &[4, 4])]).unwrap_err().to_string();
        assert!(e.contains("blocks.0.ffn.net.0.proj.weight") && e.contains("another tensor"), "{e}");
        // The first-last-frame model's image position embedding (diffusers' converter's name).
        let flf = wan_to_diffusers(&[t("model.diffusion_model.img_emb.emb_pos", &[1, 514, 1280])]).unwrap();
        assert_eq!(flf[0].0.name, "condition_embedder.image_embedder.pos_embed");
    }
}
