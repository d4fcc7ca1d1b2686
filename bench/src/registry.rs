//! The model registry: each model's block stacks, every parameter's name and
//! shape as in the real checkpoint (diffusers' naming), its non-block weights,
//! its token counts per case and its batch.
//!
//! `zoo registry --json F` writes it for `bench/anchors/registry_check.py`, which
//! builds the reference class on the meta device and compares names and shapes.

use serde::Serialize;
use serde_json::{json, Value};

mod vae;
pub use vae::*;

/// One parameter: its name inside the model (or inside a block) and its shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Param {
    /// Name, `.`-separated (`attn.to_q.weight`).
    pub name: String,
    /// Shape, outermost first.
    pub shape: Vec<usize>,
}

impl Param {
    fn new(name: impl Into<String>, shape: &[usize]) -> Self {
        Param { name: name.into(), shape: shape.to_vec() }
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The range random weights are drawn from (the anchors use the same rule):
    /// linear weights ±1/√fan-in, biases ±0.01, norm scales in [0.5, 1.5].
    pub fn init_range(&self) -> (f64, f64) {
        init_range(&self.name, &self.shape)
    }
}

/// [`Param::init_range`] for any named, shaped tensor.
pub fn init_range(name: &str, shape: &[usize]) -> (f64, f64) {
    match (shape.len(), name.ends_with(".weight")) {
        (1, true) => (0.5, 1.5),
        (1, false) => (-0.01, 0.01),
        _ => {
            let a = 1.0 / (shape.get(1).copied().unwrap_or(1).max(1) as f64).sqrt();
            (-a, a)
        }
    }
}

/// What a block computes (the per-backend files implement each kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum BlockKind {
    /// Two streams (image, text), each with its own modulation, projections and
    /// MLP, one joint attention: Flux's `FluxTransformerBlock`, Qwen-Image's
    /// `QwenImageTransformerBlock`, SD3's joint block.
    DualStream,
    /// One stream over the concatenated tokens, attention and MLP in parallel:
    /// Flux's `FluxSingleTransformerBlock`.
    SingleStream,
    /// Wan 2.1's block: self-attention, cross-attention to the text, FFN, a
    /// per-block modulation table.
    Wan,
    /// Z-Image's block: attention and a SwiGLU feed-forward with sandwich norms
    /// (modulated in the noise refiner and the main layers, not in the context refiner).
    ZImage,
    /// A T5 encoder block: self-attention with relative position bias, gated-GELU FFN.
    T5,
    /// A decoder layer used as an encoder (Qwen2.5-VL's language model): grouped-query
    /// attention, SwiGLU MLP, RMS norms.
    Decoder,
    /// An up block of an image VAE's decoder (diffusers' `UpDecoderBlock2D`):
    /// ResNet blocks of group norms and 3 × 3 convolutions, then (but in the last)
    /// a nearest 2× upsample and a convolution.
    VaeUp,
}

/// One stack of identical blocks.
#[derive(Clone, Debug, Serialize)]
pub struct Stack {
    /// Name prefix (`transformer_blocks`); block `i` is `<prefix>.<i>.*`.
    pub prefix: &'static str,
    /// Blocks in the stack.
    pub count: usize,
    /// What each block computes.
    pub kind: BlockKind,
    /// One block's parameters, names relative to `<prefix>.<i>`.
    pub params: Vec<Param>,
    /// Blocks whose parameters differ from `params` (T5's first block holds the
    /// relative position bias; SD3's last block only projects the context).
    pub overrides: Vec<(usize, Vec<Param>)>,
}

impl Stack {
    /// Block `i`'s parameters.
    pub fn block_params(&self, i: usize) -> &[Param] {
        self.overrides.iter().find(|(b, _)| *b == i).map_or(&self.params, |(_, p)| p)
    }

    /// Block `i`'s bytes at `elem` bytes per element.
    pub fn bytes(&self, i: usize, elem: usize) -> u64 {
        self.block_params(i).iter().map(|p| (p.numel() * elem) as u64).sum()
    }
}

/// One measured case.
#[derive(Clone, Debug, Serialize)]
pub struct Case {
    /// Case name (`1024`, `1328`, `480x832x21`, `512`).
    pub name: String,
    /// Image width in pixels (0 for a text encoder).
    pub resolution: usize,
    /// Image height in pixels (`resolution` for a square; 0 for a text encoder).
    pub height: usize,
    /// Latent frames (1 for images, 0 for a text encoder).
    pub frames: usize,
    /// Image tokens per sample: (height / 16) × (width / 16) per latent frame
    /// (a VAE decoder: its latent pixels, (height / 8) × (width / 8)).
    pub image_tokens: usize,
    /// Text tokens.
    pub text_tokens: usize,
    /// Batch of one forward call.
    pub batch: usize,
}

/// One model.
#[derive(Clone, Debug, Serialize)]
pub struct Model {
    /// Registry name (`flux-dev`).
    pub name: &'static str,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// MLP hidden size.
    pub mlp: usize,
    /// Channels of one latent token at the input.
    pub in_channels: usize,
    /// Channels of one latent token at the output.
    pub out_channels: usize,
    /// Width of the text encoder's states.
    pub text_dim: usize,
    /// Width of the pooled text embedding, where the model takes one.
    pub pooled_dim: Option<usize>,
    /// Whether the model embeds a guidance scale (guidance-distilled).
    pub guidance: bool,
    /// Forward calls per denoising step in the pipeline: 2 where it runs
    /// classifier-free guidance as two calls (Qwen-Image's `true_cfg_scale`).
    pub calls_per_step: usize,
    /// Block stacks, in the order a step runs them.
    pub stacks: Vec<Stack>,
    /// Weights outside the blocks (embedders, final norm and projection).
    pub globals: Vec<Param>,
    /// Measured cases.
    pub cases: Vec<Case>,
    /// The reference: a Python class and the config that builds this model.
    pub reference: Value,
    /// How its weights are stored ([`Storage::Bf16`] but for [`quantized_models`]).
    pub storage: Storage,
}

/// How a registry model's weights are stored, as `bench/anchors/zoo_anchor.py
/// --storage` makes them from the bf16 model (its tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Storage {
    /// bf16 throughout.
    Bf16,
    /// diffusers' layerwise casting as `ModelMixin.enable_layerwise_casting`
    /// skips: the supported layers (Linear, Conv) fp8 e4m3 but those under a
    /// module named `pos_embed`, `patch_embed`, `norm…`, the top-level
    /// `proj_in`/`proj_out`, or one of the class's own patterns (Wan's
    /// `patch_embedding` and `condition_embedder`).
    Fp8,
    /// Layerwise casting with the class's own skip patterns but `norm`: every
    /// Linear fp8, modulation projections included (Flux: 11.9 G weights).
    Fp8Linears,
    /// The Linears of the block lists whose fan-in is whole blocks of 32, GGUF
    /// Q8_0 (34 bytes per 32 weights); biases and everything else bf16.
    GgufQ8_0,
    /// The same as GGUF Q4_K (144 bytes per 256 weights).
    GgufQ4K,
}

impl Storage {
    /// The tag `zoo_anchor.py --storage` takes (and its rows' names carry).
    pub fn tag(self) -> &'static str {
        match self {
            Storage::Bf16 => "bf16",
            Storage::Fp8 => "fp8",
            Storage::Fp8Linears => "fp8-linears",
            Storage::GgufQ8_0 => "gguf-q8_0",
            Storage::GgufQ4K => "gguf-q4_k",
        }
    }
}

/// The quantized models: (name, the bf16 model, storage). Named as the bench's
/// rows name them (`MODEL-STORAGE`); `flux-dev-fp8` (every Linear
/// fp8, 11 GiB) is `flux-dev-fp8-linears` here, `flux-dev-fp8` being what
/// diffusers' defaults give.
pub const QUANTIZED: [(&str, &str, Storage); 6] = [
    ("flux-dev-fp8", "flux-dev", Storage::Fp8),
    ("flux-dev-fp8-linears", "flux-dev", Storage::Fp8Linears),
    ("flux-dev-gguf-q8_0", "flux-dev", Storage::GgufQ8_0),
    ("flux-dev-gguf-q4_k", "flux-dev", Storage::GgufQ4K),
    ("qwen-image-fp8", "qwen-image", Storage::Fp8),
    ("wan2.1-t2v-14b-fp8", "wan2.1-t2v-14b", Storage::Fp8),
];

/// Every quantized model ([`QUANTIZED`]): its bf16 model's parameters and
/// reference, stored as named. The Rust drivers stream bf16 models; these run
/// through the Python package (`bench/py-run.sh`, which reads the storage from
/// the registry file).
pub fn quantized_models() -> Vec<Model> {
    QUANTIZED.iter().map(|&(name, of, storage)| Model { name, storage, ..model(of).expect("a registry model") }).collect()
}

impl Model {
    /// Every parameter, full names.
    pub fn params(&self) -> Vec<Param> {
        let mut out = self.globals.clone();
        for s in &self.stacks {
            for i in 0..s.count {
                out.extend(s.block_params(i).iter().map(|p| Param::new(format!("{}.{i}.{}", s.prefix, p.name), &p.shape)));
            }
        }
        out
    }

    /// Bytes of every block at `elem` bytes per element.
    pub fn block_bytes(&self, elem: usize) -> u64 {
        self.stacks.iter().map(|s| (0..s.count).map(|i| s.bytes(i, elem)).sum::<u64>()).sum()
    }

    /// Bytes of the largest block.
    pub fn largest_block_bytes(&self, elem: usize) -> u64 {
        self.stacks.iter().flat_map(|s| (0..s.count).map(|i| s.bytes(i, elem))).max().unwrap_or(0)
    }

    /// Whether every block is a dual- or single-stream block with no per-block
    /// overrides (Flux, Qwen-Image): what candle's file computes (tch's file
    /// computes more: `tch::computes`).
    pub fn computed(&self) -> bool {
        self.stacks.iter().all(|s| matches!(s.kind, BlockKind::DualStream | BlockKind::SingleStream) && s.overrides.is_empty())
    }

    /// Bytes of every parameter as stored ([`Model::storage`]).
    pub fn stored_bytes(&self) -> u64 {
        let params = self.params();
        let block_lists: Vec<&str> = self.stacks.iter().map(|s| s.prefix).collect();
        params.iter().map(|p| self.stored_param_bytes(p, &params, &block_lists)).sum()
    }

    /// One parameter's stored bytes, by the rules [`Storage`] names.
    fn stored_param_bytes(&self, p: &Param, params: &[Param], block_lists: &[&str]) -> u64 {
        let bf16 = 2 * p.numel() as u64;
        let Some((module, kind)) = p.name.rsplit_once('.') else { return bf16 };
        // A supported layer (Linear, Conv): its weight has two or more dimensions.
        let weight = params.iter().find(|q| q.name == format!("{module}.weight"));
        let layer = matches!(kind, "weight" | "bias") && weight.is_some_and(|w| w.shape.len() >= 2);
        let cast = |skip: &[&str]| {
            // Skipped where any module on the path matches a pattern (a regex search;
            // `^x$` whole paths), as diffusers' recursion stops at the first match.
            let mut path = String::new();
            let skipped = module.split('.').any(|part| {
                path = if path.is_empty() { part.to_owned() } else { format!("{path}.{part}") };
                skip.iter().any(|pat| match pat.strip_prefix('^').and_then(|x| x.strip_suffix('$')) {
                    Some(whole) => path == whole,
                    None => path.contains(pat),
                })
            });
            if layer && !skipped {
                p.numel() as u64
            } else {
                bf16
            }
        };
        // The class's `_skip_layerwise_casting_patterns` but `norm` (none: every layer cast).
        let class_patterns: &[&str] = match self.reference["class"].as_str() {
            Some("WanTransformer3DModel") => &["patch_embedding", "condition_embedder"],
            Some("ZImageTransformer2DModel") => &["t_embedder", "cap_embedder"],
            Some("FluxTransformer2DModel" | "QwenImageTransformer2DModel" | "SD3Transformer2DModel") => &["pos_embed"],
            _ => &[],
        };
        let gguf = |block: usize, size: usize| {
            let in_blocks = block_lists.iter().any(|l| module.starts_with(&format!("{l}.")));
            match (kind, weight) {
                ("weight", Some(w)) if in_blocks && w.shape.len() == 2 && w.shape[1] % block == 0 => {
                    (w.shape[0] * w.shape[1] / block * size) as u64
                }
                _ => bf16,
            }
        };
        match self.storage {
            Storage::Bf16 => bf16,
            Storage::Fp8 => {
                let mut skip = vec!["pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$"];
                skip.extend_from_slice(class_patterns);
                cast(&skip)
            }
            Storage::Fp8Linears => cast(class_patterns),
            Storage::GgufQ8_0 => gguf(32, 34),
            Storage::GgufQ4K => gguf(256, 144),
        }
    }

    /// Bytes of the non-block weights.
    pub fn global_bytes(&self, elem: usize) -> u64 {
        self.globals.iter().map(|p| (p.numel() * elem) as u64).sum()
    }

    /// The case named `name`.
    pub fn case(&self, name: &str) -> Result<&Case, String> {
        self.cases.iter().find(|c| c.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.cases.iter().map(|c| c.name.as_str()).collect();
            format!("model {} has no case {name:?} (cases: {})", self.name, known.join(", "))
        })
    }
}

/// A model named `name` of hidden size `hidden`, `heads` heads of `head_dim` and
/// an MLP `mlp` wide, taking and giving 64 channels a latent token, one call a
/// step, no text, pooled embedding, guidance, blocks, globals, cases or reference:
/// each model's constructor fills in the rest.
fn base(name: &'static str, hidden: usize, heads: usize, head_dim: usize, mlp: usize) -> Model {
    Model {
        name,
        hidden,
        heads,
        head_dim,
        mlp,
        in_channels: 64,
        out_channels: 64,
        text_dim: 0,
        pooled_dim: None,
        guidance: false,
        calls_per_step: 1,
        stacks: Vec::new(),
        globals: Vec::new(),
        cases: Vec::new(),
        reference: Value::Null,
        storage: Storage::Bf16,
    }
}

/// A text encoder's case: `tokens` tokens, batch 1, no image.
fn text_case(tokens: usize) -> Case {
    Case { name: tokens.to_string(), resolution: 0, height: 0, frames: 0, image_tokens: 0, text_tokens: tokens, batch: 1 }
}

fn linear(out: &mut Vec<Param>, name: &str, i: usize, o: usize) {
    out.push(Param::new(format!("{name}.weight"), &[o, i]));
    out.push(Param::new(format!("{name}.bias"), &[o]));
}

/// Names of the parts of a dual-stream block that differ between models.
#[derive(Clone, Copy, Debug)]
pub struct DualNames {
    /// The image stream's modulation linear (`norm1.linear`, `img_mod.1`).
    pub img_mod: &'static str,
    /// The text stream's modulation linear.
    pub txt_mod: &'static str,
    /// The image stream's MLP (`ff`, `img_mlp`).
    pub img_mlp: &'static str,
    /// The text stream's MLP.
    pub txt_mlp: &'static str,
}

/// Flux's names (`FluxTransformerBlock`).
pub const FLUX_DUAL: DualNames =
    DualNames { img_mod: "norm1.linear", txt_mod: "norm1_context.linear", img_mlp: "ff", txt_mlp: "ff_context" };
/// Qwen-Image's names (`QwenImageTransformerBlock`).
pub const QWEN_DUAL: DualNames = DualNames { img_mod: "img_mod.1", txt_mod: "txt_mod.1", img_mlp: "img_mlp", txt_mlp: "txt_mlp" };

/// A dual-stream block's parameters.
pub fn dual_params(n: DualNames, h: usize, hd: usize, mlp: usize) -> Vec<Param> {
    let mut p = Vec::new();
    linear(&mut p, n.img_mod, h, 6 * h);
    linear(&mut p, n.txt_mod, h, 6 * h);
    for q in ["norm_q", "norm_k", "norm_added_q", "norm_added_k"] {
        p.push(Param::new(format!("attn.{q}.weight"), &[hd]));
    }
    for l in ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"] {
        linear(&mut p, &format!("attn.{l}"), h, h);
    }
    for m in [n.img_mlp, n.txt_mlp] {
        linear(&mut p, &format!("{m}.net.0.proj"), h, mlp);
        linear(&mut p, &format!("{m}.net.2"), mlp, h);
    }
    p
}

/// A Flux single-stream block's parameters.
pub fn single_params(h: usize, hd: usize, mlp: usize) -> Vec<Param> {
    let mut p = Vec::new();
    linear(&mut p, "norm.linear", h, 3 * h);
    linear(&mut p, "proj_mlp", h, mlp);
    linear(&mut p, "proj_out", h + mlp, h);
    p.push(Param::new("attn.norm_q.weight", &[hd]));
    p.push(Param::new("attn.norm_k.weight", &[hd]));
    for l in ["to_q", "to_k", "to_v"] {
        linear(&mut p, &format!("attn.{l}"), h, h);
    }
    p
}

/// `model` with only the first `k` blocks of each stack (their overrides kept
/// where they fall among them): short runs, such as a sanitizer's. A run of it
/// never merges with full runs (the sizes differ).
pub fn first_blocks(model: &Model, k: usize) -> Model {
    let mut m = model.clone();
    for s in &mut m.stacks {
        s.count = s.count.min(k.max(1));
        let count = s.count;
        s.overrides.retain(|(i, _)| *i < count);
    }
    m
}

/// An image case of `res`² pixels with the text tokens of `model`'s first case
/// (one token per 16 × 16 pixels), named by its side (`zoo run --res`).
pub fn extra_image_case(model: &Model, res: usize) -> Case {
    image_case(res, model.cases.first().map_or(512, |c| c.text_tokens))
}

fn image_case(res: usize, text_tokens: usize) -> Case {
    // An 8× VAE and 2 × 2 patches: one token per 16 × 16 pixels.
    Case { name: res.to_string(), resolution: res, height: res, frames: 1, image_tokens: (res / 16) * (res / 16), text_tokens, batch: 1 }
}

/// A case a user names (`zoo run --size WxH --batch N --frames F`): `width` ×
/// `height` pixels, `batch` samples per call (`None`: the model's own, 2 where it
/// batches classifier-free guidance), `frames` video frames (1 for an image).
/// Tokens follow the model's patching: 16 × 16 pixels a token (an 8× VAE, 2 × 2
/// patches); a video model (Wan) also compresses time 4× ((F − 1) / 4 + 1 latent
/// frames); a VAE decoder takes (H / 8) × (W / 8) latent pixels. Named by all of
/// it: `1344x768 b2 f1`.
pub fn user_case(model: &Model, width: usize, height: usize, batch: Option<usize>, frames: usize) -> Result<Case, String> {
    let at = format!("{} {width}x{height} f{frames}", model.name);
    let kinds = |k: BlockKind| model.stacks.iter().any(|s| s.kind == k);
    if model.in_channels == 0 {
        return Err(format!("{at}: a text encoder has no image size (its case is its text tokens)"));
    }
    let px = if kinds(BlockKind::VaeUp) { 8 } else { 16 };
    if width == 0 || height == 0 || width % px != 0 || height % px != 0 {
        return Err(format!("{at}: width and height are positive multiples of {px} pixels for {}", model.name));
    }
    let video = kinds(BlockKind::Wan);
    let latent_frames = match (video, frames) {
        (_, 0) => return Err(format!("{at}: at least one frame")),
        (false, 1) => 1,
        (false, _) => return Err(format!("{at}: {} makes images (--frames 1), not video", model.name)),
        (true, f) if (f - 1) % 4 == 0 => (f - 1) / 4 + 1,
        (true, f) => return Err(format!("{at}: {f} frames; Wan's VAE takes 4k + 1 frames (1, 5, 9, …, 81)")),
    };
    let batch = batch.unwrap_or_else(|| model.cases.first().map_or(1, |c| c.batch));
    if batch == 0 {
        return Err(format!("{at}: a batch of at least 1"));
    }
    Ok(Case {
        name: format!("{width}x{height} b{batch} f{frames}"),
        resolution: width,
        height,
        frames: latent_frames,
        image_tokens: (height / px) * (width / px) * latent_frames,
        text_tokens: model.cases.first().map_or(0, |c| c.text_tokens),
        batch,
    })
}

/// The case `--size WxH --batch N --frames F` name ([`user_case`]); `None` when
/// none of the three is given. A size left out is the model's first case's.
pub fn case_from_args(model: &Model, size: Option<&str>, batch: Option<&str>, frames: Option<&str>) -> Result<Option<Case>, String> {
    if size.is_none() && batch.is_none() && frames.is_none() {
        return Ok(None);
    }
    let first = model.cases.first().ok_or_else(|| format!("{} has no case", model.name))?;
    let (width, height) = match size {
        None => (first.resolution, first.height),
        Some(s) => {
            let (w, h) = s.split_once('x').ok_or_else(|| format!("--size {s}: WIDTHxHEIGHT in pixels (1344x768)"))?;
            let px = |v: &str| v.parse::<usize>().map_err(|_| format!("--size {s}: WIDTHxHEIGHT in pixels (1344x768)"));
            (px(w)?, px(h)?)
        }
    };
    let num = |name: &str, v: &str| v.parse::<usize>().map_err(|_| format!("{name}: not a number: {v}"));
    let batch = batch.map(|b| num("--batch", b)).transpose()?;
    let frames = frames.map_or(Ok(1), |f| num("--frames", f))?;
    user_case(model, width, height, batch, frames).map(Some)
}

/// Flux-dev: 19 dual-stream + 38 single-stream blocks, hidden 3072, T5 text
/// padded to 512 tokens, guidance-distilled (one call per step).
pub fn flux_dev() -> Model {
    let (h, hd, mlp) = (3072, 128, 12288);
    let mut globals = Vec::new();
    for e in ["timestep_embedder", "guidance_embedder"] {
        linear(&mut globals, &format!("time_text_embed.{e}.linear_1"), 256, h);
        linear(&mut globals, &format!("time_text_embed.{e}.linear_2"), h, h);
    }
    linear(&mut globals, "time_text_embed.text_embedder.linear_1", 768, h);
    linear(&mut globals, "time_text_embed.text_embedder.linear_2", h, h);
    linear(&mut globals, "context_embedder", 4096, h);
    linear(&mut globals, "x_embedder", 64, h);
    linear(&mut globals, "norm_out.linear", h, 2 * h);
    linear(&mut globals, "proj_out", h, 64);
    Model {
        text_dim: 4096,
        pooled_dim: Some(768),
        guidance: true,
        stacks: vec![
            stack("transformer_blocks", 19, BlockKind::DualStream, dual_params(FLUX_DUAL, h, hd, mlp)),
            stack("single_transformer_blocks", 38, BlockKind::SingleStream, single_params(h, hd, mlp)),
        ],
        globals,
        cases: vec![image_case(1024, 512), image_case(2048, 512)],
        reference: json!({
            "module": "diffusers", "class": "FluxTransformer2DModel",
            "config": {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                       "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
                       "guidance_embeds": true, "axes_dims_rope": [16, 56, 56]},
        }),
        ..base("flux-dev", h, 24, hd, mlp)
    }
}

/// Qwen-Image: 60 dual-stream blocks, hidden 3072, text from Qwen2.5-VL (3584
/// wide, 512 tokens: the pipeline's `max_sequence_length`), true classifier-free
/// guidance (two calls per step).
pub fn qwen_image() -> Model {
    let (h, hd, mlp) = (3072, 128, 12288);
    let mut globals = Vec::new();
    linear(&mut globals, "time_text_embed.timestep_embedder.linear_1", 256, h);
    linear(&mut globals, "time_text_embed.timestep_embedder.linear_2", h, h);
    globals.push(Param::new("txt_norm.weight", &[3584]));
    linear(&mut globals, "img_in", 64, h);
    linear(&mut globals, "txt_in", 3584, h);
    linear(&mut globals, "norm_out.linear", h, 2 * h);
    linear(&mut globals, "proj_out", h, 64);
    Model {
        text_dim: 3584,
        calls_per_step: 2,
        stacks: vec![stack("transformer_blocks", 60, BlockKind::DualStream, dual_params(QWEN_DUAL, h, hd, mlp))],
        globals,
        cases: vec![image_case(1024, 512), image_case(1328, 512)],
        reference: json!({
            "module": "diffusers", "class": "QwenImageTransformer2DModel",
            "config": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
                       "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": false, "axes_dims_rope": [16, 56, 56]},
        }),
        ..base("qwen-image", h, 24, hd, mlp)
    }
}

/// `model` with every width shrunk and two or three blocks per stack, the same
/// names and block kinds: what CPU tests run the backends' files on (models
/// whose blocks the files compute, [`Model::computed`]).
pub fn tiny(model: &Model) -> Model {
    // Z-Image's modulation reads min(hidden, 256) values and its time embedder
    // makes 256: a shrunk Z-Image keeps hidden 256 so both stay equal (diffusers and
    // candle-transformers size the modulation by the hidden size).
    let z_image = model.stacks.iter().any(|s| s.kind == BlockKind::ZImage);
    let (h, hd) = if z_image { (256, 32) } else { (64, 32) };
    // MLP ratios that candle-transformers' blocks fix stay so: 4 (SD3), 8/3 (Z-Image).
    let mlp = match model.mlp {
        m if m == 4 * model.hidden => 4 * h,
        m if m == model.hidden / 3 * 8 => h / 3 * 8,
        _ => 128,
    };
    if model.in_channels == 0 {
        return tiny_encoder(model, h, hd, mlp);
    }
    if model.stacks.iter().any(|s| s.kind == BlockKind::VaeUp) {
        // Group norms of 32 groups: 32 and 64 channels; a 64-pixel image.
        let mut m = vae_decoder(model.name, model.in_channels, [32, 32, 64, 64], 64, model.reference.clone());
        m.reference = model.reference.clone();
        return m;
    }
    let names = dual_names(model);
    let stacks = model
        .stacks
        .iter()
        .map(|s| {
            let params = match s.kind {
                BlockKind::DualStream => dual_params(names, h, hd, mlp),
                BlockKind::Wan => wan_params(h, mlp),
                BlockKind::ZImage => zimage_params(h, hd, mlp, s.params.iter().any(|p| p.name.starts_with("adaLN_modulation"))),
                _ => single_params(h, hd, mlp),
            };
            let count = s.count.min(2) + usize::from(s.kind == BlockKind::SingleStream);
            // SD3's last block projects the context only: kept, as the last of two.
            let overrides = if s.kind == BlockKind::DualStream && !s.overrides.is_empty() {
                vec![(count - 1, context_pre_only_params(h, hd, mlp))]
            } else {
                vec![]
            };
            Stack { prefix: s.prefix, count, kind: s.kind, params, overrides }
        })
        .collect();
    let (text_dim, pooled) = (48, model.pooled_dim.map(|_| 24));
    let scale = |n: usize| match n {
        n if n == model.hidden => h,
        n if n == 2 * model.hidden => 2 * h,
        n if n == 6 * model.hidden => 6 * h,
        n if n == model.text_dim => text_dim,
        n if Some(n) == model.pooled_dim => pooled.unwrap_or(24),
        n => n,
    };
    let globals =
        model.globals.iter().map(|p| Param::new(p.name.clone(), &p.shape.iter().map(|&d| scale(d)).collect::<Vec<_>>())).collect();
    Model {
        text_dim,
        pooled_dim: pooled,
        guidance: model.guidance,
        calls_per_step: model.calls_per_step,
        stacks,
        globals,
        // The real model's batch (SD3.5 runs two, for classifier-free guidance).
        cases: vec![Case { batch: model.cases.first().map_or(1, |c| c.batch), ..image_case(64, 8) }],
        ..base(model.name, h, h / hd, hd, mlp)
    }
}

/// [`tiny`] for a text encoder: its stacks at two blocks (heads of `hd`, key-value
/// heads half as many), a 50-token vocabulary, 8 tokens.
fn tiny_encoder(model: &Model, h: usize, hd: usize, mlp: usize) -> Model {
    let stacks = model
        .stacks
        .iter()
        .map(|s| match s.kind {
            BlockKind::T5 => t5_stack(2, h, mlp, h / hd),
            _ => stack(s.prefix, 2, s.kind, decoder_params(h, mlp, h / 2)),
        })
        .collect();
    let globals =
        model.globals.iter().map(|p| Param::new(p.name.clone(), &if p.shape.len() == 2 { vec![50, h] } else { vec![h] })).collect();
    Model {
        hidden: h,
        heads: h / hd,
        head_dim: hd,
        mlp,
        text_dim: h,
        stacks,
        globals,
        cases: vec![text_case(8)],
        reference: Value::Null,
        ..model.clone()
    }
}

fn stack(prefix: &'static str, count: usize, kind: BlockKind, params: Vec<Param>) -> Stack {
    Stack { prefix, count, kind, params, overrides: vec![] }
}

fn weight(out: &mut Vec<Param>, name: &str, shape: &[usize]) {
    out.push(Param::new(format!("{name}.weight"), shape));
}

/// SD3's last joint block (`context_pre_only`): the context is normalised and
/// projected for attention only (no output projection, MLP or gates for it).
fn context_pre_only_params(h: usize, hd: usize, mlp: usize) -> Vec<Param> {
    let mut last: Vec<Param> = dual_params(FLUX_DUAL, h, hd, mlp)
        .into_iter()
        .filter(|p| !p.name.starts_with("ff_context.") && !p.name.starts_with("attn.to_add_out.") && !p.name.starts_with("norm1_context."))
        .collect();
    linear(&mut last, "norm1_context.linear", h, 2 * h);
    last
}

/// SD3.5-large: 38 joint blocks (Flux's dual-stream names), hidden 2432, 38 heads
/// of 64; the last block only projects the context (`context_pre_only`).
pub fn sd35_large() -> Model {
    let (h, hd, mlp) = (2432, 64, 9728);
    let last = context_pre_only_params(h, hd, mlp);
    let mut g = vec![Param::new("pos_embed.proj.weight", &[h, 16, 2, 2]), Param::new("pos_embed.proj.bias", &[h])];
    linear(&mut g, "time_text_embed.timestep_embedder.linear_1", 256, h);
    linear(&mut g, "time_text_embed.timestep_embedder.linear_2", h, h);
    linear(&mut g, "time_text_embed.text_embedder.linear_1", 2048, h);
    linear(&mut g, "time_text_embed.text_embedder.linear_2", h, h);
    linear(&mut g, "context_embedder", 4096, h);
    linear(&mut g, "norm_out.linear", h, 2 * h);
    linear(&mut g, "proj_out", h, 64);
    let mut s = stack("transformer_blocks", 38, BlockKind::DualStream, dual_params(FLUX_DUAL, h, hd, mlp));
    s.overrides = vec![(37, last)];
    Model {
        text_dim: 4096,
        pooled_dim: Some(2048),
        stacks: vec![s],
        globals: g,
        // Text: 77 CLIP tokens + 256 T5 tokens; classifier-free guidance batched (2).
        cases: vec![Case { batch: 2, ..image_case(1024, 333) }],
        reference: json!({"module": "diffusers", "class": "SD3Transformer2DModel",
            "config": {"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38, "attention_head_dim": 64,
                       "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
                       "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192, "qk_norm": "rms_norm"}}),
        ..base("sd3.5-large", h, 38, hd, mlp)
    }
}

/// A Wan 2.1 block's parameters: its modulation table, self- and
/// cross-attention with q and k normalised across heads, the cross-attention's
/// affine norm, the FFN.
pub fn wan_params(h: usize, ffn: usize) -> Vec<Param> {
    let mut p = vec![Param::new("scale_shift_table", &[1, 6, h])];
    for a in ["attn1", "attn2"] {
        for l in ["to_q", "to_k", "to_v", "to_out.0"] {
            linear(&mut p, &format!("{a}.{l}"), h, h);
        }
        weight(&mut p, &format!("{a}.norm_q"), &[h]);
        weight(&mut p, &format!("{a}.norm_k"), &[h]);
    }
    p.push(Param::new("norm2.weight", &[h]));
    p.push(Param::new("norm2.bias", &[h]));
    linear(&mut p, "ffn.net.0.proj", h, ffn);
    linear(&mut p, "ffn.net.2", ffn, h);
    p
}

/// Wan 2.1 T2V 14B: 40 blocks, hidden 5120, 40 heads of 128, FFN 13824; text from
/// umT5 (4096 wide, 512 tokens); 480 × 832 at 5 and 21 latent frames.
pub fn wan21_t2v_14b() -> Model {
    let (h, ffn) = (5120, 13824);
    let p = wan_params(h, ffn);
    let mut g = vec![
        Param::new("scale_shift_table", &[1, 2, h]),
        Param::new("patch_embedding.weight", &[h, 16, 1, 2, 2]),
        Param::new("patch_embedding.bias", &[h]),
    ];
    linear(&mut g, "condition_embedder.time_embedder.linear_1", 256, h);
    linear(&mut g, "condition_embedder.time_embedder.linear_2", h, h);
    linear(&mut g, "condition_embedder.time_proj", h, 6 * h);
    linear(&mut g, "condition_embedder.text_embedder.linear_1", 4096, h);
    linear(&mut g, "condition_embedder.text_embedder.linear_2", h, h);
    linear(&mut g, "proj_out", h, 64);
    // 480 × 832 → latent 60 × 104 → 30 × 52 patches per latent frame.
    let case = |frames: usize| Case {
        name: format!("480x832x{frames}"),
        resolution: 832,
        height: 480,
        frames,
        image_tokens: 30 * 52 * frames,
        text_tokens: 512,
        batch: 1,
    };
    Model {
        text_dim: 4096,
        calls_per_step: 2,
        stacks: vec![stack("blocks", 40, BlockKind::Wan, p)],
        globals: g,
        cases: vec![case(5), case(21)],
        reference: json!({"module": "diffusers", "class": "WanTransformer3DModel",
            "config": {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16, "out_channels": 16,
                       "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40, "cross_attn_norm": true,
                       "qk_norm": "rms_norm_across_heads", "eps": 1e-6}}),
        ..base("wan2.1-t2v-14b", h, 40, 128, ffn)
    }
}

fn zimage_params(h: usize, hd: usize, ffn: usize, modulated: bool) -> Vec<Param> {
    let mut p = Vec::new();
    weight(&mut p, "attention.norm_q", &[hd]);
    weight(&mut p, "attention.norm_k", &[hd]);
    for l in ["to_q", "to_k", "to_v", "to_out.0"] {
        weight(&mut p, &format!("attention.{l}"), &[h, h]);
    }
    weight(&mut p, "feed_forward.w1", &[ffn, h]);
    weight(&mut p, "feed_forward.w2", &[h, ffn]);
    weight(&mut p, "feed_forward.w3", &[ffn, h]);
    for n in ["attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"] {
        weight(&mut p, n, &[h]);
    }
    if modulated {
        linear(&mut p, "adaLN_modulation.0", 256, 4 * h);
    }
    p
}

/// Z-Image-Turbo: 2 noise-refiner + 2 context-refiner + 30 main blocks, hidden
/// 3840, 30 heads of 128, SwiGLU 10240; captions from a 2560-wide encoder.
pub fn z_image_turbo() -> Model {
    let (h, ffn) = (3840, 10240);
    let mut g = vec![Param::new("x_pad_token", &[1, h]), Param::new("cap_pad_token", &[1, h])];
    linear(&mut g, "all_x_embedder.2-1", 64, h);
    linear(&mut g, "all_final_layer.2-1.linear", h, 64);
    linear(&mut g, "all_final_layer.2-1.adaLN_modulation.1", 256, h);
    linear(&mut g, "t_embedder.mlp.0", 256, 1024);
    linear(&mut g, "t_embedder.mlp.2", 1024, 256);
    weight(&mut g, "cap_embedder.0", &[2560]);
    linear(&mut g, "cap_embedder.1", 2560, h);
    Model {
        text_dim: 2560,
        stacks: vec![
            stack("noise_refiner", 2, BlockKind::ZImage, zimage_params(h, 128, ffn, true)),
            stack("context_refiner", 2, BlockKind::ZImage, zimage_params(h, 128, ffn, false)),
            stack("layers", 30, BlockKind::ZImage, zimage_params(h, 128, ffn, true)),
        ],
        globals: g,
        cases: vec![image_case(1024, 512)],
        reference: json!({"module": "diffusers", "class": "ZImageTransformer2DModel", "config": {}}),
        ..base("z-image-turbo", h, 30, 128, ffn)
    }
}

/// T5-XXL's encoder (Flux, SD3 and Wan's text encoder): 24 blocks, 4096 wide, 64
/// heads of 64, gated-GELU 10240; 512 tokens.
pub fn t5_xxl() -> Model {
    let (h, ff) = (4096, 10240);
    let s = t5_stack(24, h, ff, 64);
    Model {
        in_channels: 0,
        out_channels: 0,
        text_dim: h,
        stacks: vec![s],
        globals: vec![Param::new("shared.weight", &[32128, h]), Param::new("encoder.final_layer_norm.weight", &[h])],
        cases: vec![text_case(512)],
        reference: json!({"module": "transformers", "class": "T5EncoderModel", "config_class": "T5Config",
            "config": {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
                       "feed_forward_proj": "gated-gelu", "is_encoder_decoder": false}}),
        ..base("t5-xxl", h, 64, 64, ff)
    }
}

/// T5 encoder blocks: block 0 also holds the relative position bias table
/// (32 buckets × heads).
fn t5_stack(count: usize, h: usize, ff: usize, heads: usize) -> Stack {
    let mut p = Vec::new();
    for l in ["q", "k", "v", "o"] {
        weight(&mut p, &format!("layer.0.SelfAttention.{l}"), &[h, h]);
    }
    weight(&mut p, "layer.0.layer_norm", &[h]);
    weight(&mut p, "layer.1.DenseReluDense.wi_0", &[ff, h]);
    weight(&mut p, "layer.1.DenseReluDense.wi_1", &[ff, h]);
    weight(&mut p, "layer.1.DenseReluDense.wo", &[h, ff]);
    weight(&mut p, "layer.1.layer_norm", &[h]);
    let mut first = p.clone();
    first.insert(4, Param::new("layer.0.SelfAttention.relative_attention_bias.weight", &[32, heads]));
    let mut s = stack("encoder.block", count, BlockKind::T5, p);
    s.overrides = vec![(0, first)];
    s
}

/// A Qwen2-style decoder layer: biased q, k, v projections (k and v `kv` wide),
/// SwiGLU MLP `ff` wide, two RMS norms.
fn decoder_params(h: usize, ff: usize, kv: usize) -> Vec<Param> {
    let mut p = Vec::new();
    linear(&mut p, "self_attn.q_proj", h, h);
    linear(&mut p, "self_attn.k_proj", h, kv);
    linear(&mut p, "self_attn.v_proj", h, kv);
    weight(&mut p, "self_attn.o_proj", &[h, h]);
    weight(&mut p, "mlp.gate_proj", &[ff, h]);
    weight(&mut p, "mlp.up_proj", &[ff, h]);
    weight(&mut p, "mlp.down_proj", &[h, ff]);
    weight(&mut p, "input_layernorm", &[h]);
    weight(&mut p, "post_attention_layernorm", &[h]);
    p
}

/// Qwen2.5-VL-7B's language model used as Qwen-Image's text encoder: 28 decoder
/// layers, 3584 wide, 28 query heads and 4 key-value heads of 128, SwiGLU 18944.
pub fn qwen25_vl_7b_text() -> Model {
    let (h, ff, kv) = (3584, 18944, 512);
    let p = decoder_params(h, ff, kv);
    Model {
        in_channels: 0,
        out_channels: 0,
        text_dim: h,
        stacks: vec![stack("layers", 28, BlockKind::Decoder, p)],
        globals: vec![Param::new("embed_tokens.weight", &[152064, h]), Param::new("norm.weight", &[h])],
        cases: vec![text_case(512)],
        reference: json!({"module": "transformers", "class": "Qwen2_5_VLTextModel", "config_class": "Qwen2_5_VLTextConfig",
            "config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                       "num_key_value_heads": 4, "vocab_size": 152064}}),
        ..base("qwen2.5-vl-7b-text", h, 28, 128, ff)
    }
}
