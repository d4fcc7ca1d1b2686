//! The model registry: each model's block stacks, every parameter's name and
//! shape as in the real checkpoint (diffusers' naming), its non-block weights,
//! its token counts per case and its batch.
//!
//! `zoo registry --json F` writes it for `bench/anchors/registry_check.py`, which
//! builds the reference class on the meta device and compares names and shapes.

use serde::Serialize;
use serde_json::{json, Value};

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
}

/// One measured case.
#[derive(Clone, Debug, Serialize)]
pub struct Case {
    /// Case name (`1024`, `1328`).
    pub name: String,
    /// Image side in pixels.
    pub resolution: usize,
    /// Image tokens (latent side / patch)².
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
}

impl Model {
    /// Every parameter, full names.
    pub fn params(&self) -> Vec<Param> {
        let mut out = self.globals.clone();
        for s in &self.stacks {
            for i in 0..s.count {
                out.extend(s.params.iter().map(|p| Param::new(format!("{}.{i}.{}", s.prefix, p.name), &p.shape)));
            }
        }
        out
    }

    /// Bytes of every block at `elem` bytes per element.
    pub fn block_bytes(&self, elem: usize) -> u64 {
        self.stacks.iter().map(|s| s.count as u64 * s.params.iter().map(|p| (p.numel() * elem) as u64).sum::<u64>()).sum()
    }

    /// Bytes of the largest block.
    pub fn largest_block_bytes(&self, elem: usize) -> u64 {
        self.stacks.iter().map(|s| s.params.iter().map(|p| (p.numel() * elem) as u64).sum::<u64>()).max().unwrap_or(0)
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

fn image_case(res: usize, text_tokens: usize) -> Case {
    // Both models: an 8× VAE and 2 × 2 patches, so one token per 16 × 16 pixels.
    Case { name: res.to_string(), resolution: res, image_tokens: (res / 16) * (res / 16), text_tokens, batch: 1 }
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
        name: "flux-dev",
        hidden: h,
        heads: 24,
        head_dim: hd,
        mlp,
        in_channels: 64,
        out_channels: 64,
        text_dim: 4096,
        pooled_dim: Some(768),
        guidance: true,
        calls_per_step: 1,
        stacks: vec![
            Stack { prefix: "transformer_blocks", count: 19, kind: BlockKind::DualStream, params: dual_params(FLUX_DUAL, h, hd, mlp) },
            Stack { prefix: "single_transformer_blocks", count: 38, kind: BlockKind::SingleStream, params: single_params(h, hd, mlp) },
        ],
        globals,
        cases: vec![image_case(1024, 512), image_case(2048, 512)],
        reference: json!({
            "module": "diffusers", "class": "FluxTransformer2DModel",
            "config": {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
                       "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
                       "guidance_embeds": true, "axes_dims_rope": [16, 56, 56]},
        }),
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
        name: "qwen-image",
        hidden: h,
        heads: 24,
        head_dim: hd,
        mlp,
        in_channels: 64,
        out_channels: 64,
        text_dim: 3584,
        pooled_dim: None,
        guidance: false,
        calls_per_step: 2,
        stacks: vec![Stack {
            prefix: "transformer_blocks",
            count: 60,
            kind: BlockKind::DualStream,
            params: dual_params(QWEN_DUAL, h, hd, mlp),
        }],
        globals,
        cases: vec![image_case(1024, 512), image_case(1328, 512)],
        reference: json!({
            "module": "diffusers", "class": "QwenImageTransformer2DModel",
            "config": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
                       "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": false, "axes_dims_rope": [16, 56, 56]},
        }),
    }
}

/// `model` with every width shrunk and two or three blocks per stack, the same
/// names and block kinds: what CPU tests run the backends' files on.
pub fn tiny(model: &Model) -> Model {
    let (h, hd, mlp) = (64, 32, 128);
    let names = dual_names(model);
    let stacks = model
        .stacks
        .iter()
        .map(|s| {
            let params = match s.kind {
                BlockKind::DualStream => dual_params(names, h, hd, mlp),
                BlockKind::SingleStream => single_params(h, hd, mlp),
            };
            Stack { prefix: s.prefix, count: s.count.min(2) + usize::from(s.kind == BlockKind::SingleStream), kind: s.kind, params }
        })
        .collect();
    let (text_dim, pooled) = (48, model.pooled_dim.map(|_| 24));
    let scale = |n: usize| match n {
        3072 => h,
        6144 => 2 * h,
        3584 | 4096 => text_dim,
        768 => pooled.unwrap_or(24),
        n => n,
    };
    let globals =
        model.globals.iter().map(|p| Param::new(p.name.clone(), &p.shape.iter().map(|&d| scale(d)).collect::<Vec<_>>())).collect();
    Model {
        name: model.name,
        hidden: h,
        heads: h / hd,
        head_dim: hd,
        mlp,
        in_channels: 64,
        out_channels: 64,
        text_dim,
        pooled_dim: pooled,
        guidance: model.guidance,
        calls_per_step: model.calls_per_step,
        stacks,
        globals,
        cases: vec![Case { name: "64".into(), resolution: 64, image_tokens: 16, text_tokens: 8, batch: 1 }],
        reference: Value::Null,
    }
}

/// Every model in the registry.
pub fn models() -> Vec<Model> {
    vec![flux_dev(), qwen_image()]
}

/// The model named `name`.
pub fn model(name: &str) -> Result<Model, String> {
    models().into_iter().find(|m| m.name == name).ok_or_else(|| {
        let known: Vec<&str> = models().iter().map(|m| m.name).collect();
        format!("no model {name:?} in the registry (models: {})", known.join(", "))
    })
}

/// The dual-stream names of `model`.
pub fn dual_names(model: &Model) -> DualNames {
    if model.name.starts_with("qwen") {
        QWEN_DUAL
    } else {
        FLUX_DUAL
    }
}

/// The registry as JSON: per model, every parameter's name and shape and the
/// reference to compare with.
pub fn to_json() -> Value {
    Value::Array(
        models()
            .iter()
            .map(|m| {
                let params: serde_json::Map<String, Value> = m.params().into_iter().map(|p| (p.name, json!(p.shape))).collect();
                json!({"name": m.name, "reference": m.reference, "params": params, "cases": m.cases,
                       "block_bytes_bf16": m.block_bytes(2), "largest_block_bytes_bf16": m.largest_block_bytes(2)})
            })
            .collect(),
    )
}
