//! The VAE decoders of the registry: their resnet and attention stacks, as the
//! checkpoints name them.

use super::*;

/// A group norm's scale and shift over `c` channels.
pub(super) fn norm(p: &mut Vec<Param>, name: &str, c: usize) {
    p.push(Param::new(format!("{name}.weight"), &[c]));
    p.push(Param::new(format!("{name}.bias"), &[c]));
}

/// A ResNet block of a VAE (diffusers' `ResnetBlock2D`, no time embedding):
/// `i` → `o` channels, a 1 × 1 shortcut where they differ.
pub(super) fn vae_resnet(p: &mut Vec<Param>, name: &str, i: usize, o: usize) {
    norm(p, &format!("{name}.norm1"), i);
    p.push(Param::new(format!("{name}.conv1.weight"), &[o, i, 3, 3]));
    p.push(Param::new(format!("{name}.conv1.bias"), &[o]));
    norm(p, &format!("{name}.norm2"), o);
    p.push(Param::new(format!("{name}.conv2.weight"), &[o, o, 3, 3]));
    p.push(Param::new(format!("{name}.conv2.bias"), &[o]));
    if i != o {
        p.push(Param::new(format!("{name}.conv_shortcut.weight"), &[o, i, 1, 1]));
        p.push(Param::new(format!("{name}.conv_shortcut.bias"), &[o]));
    }
}

/// The decoder of an image VAE (diffusers' `AutoencoderKL`, its `decoder.*`):
/// `latent` channels in, block channels `ch` (the encoder's order, as the config
/// gives them), three ResNet blocks per up block, one attention in the middle.
pub(super) fn vae_decoder(name: &'static str, latent: usize, ch: [usize; 4], side: usize, reference: Value) -> Model {
    let top = ch[3];
    let mut g = Vec::new();
    g.push(Param::new("decoder.conv_in.weight", &[top, latent, 3, 3]));
    g.push(Param::new("decoder.conv_in.bias", &[top]));
    let mid = "decoder.mid_block";
    norm(&mut g, &format!("{mid}.attentions.0.group_norm"), top);
    for l in ["to_q", "to_k", "to_v", "to_out.0"] {
        linear(&mut g, &format!("{mid}.attentions.0.{l}"), top, top);
    }
    vae_resnet(&mut g, &format!("{mid}.resnets.0"), top, top);
    vae_resnet(&mut g, &format!("{mid}.resnets.1"), top, top);
    norm(&mut g, "decoder.conv_norm_out", ch[0]);
    g.push(Param::new("decoder.conv_out.weight", &[3, ch[0], 3, 3]));
    g.push(Param::new("decoder.conv_out.bias", &[3]));
    let rev = [ch[3], ch[2], ch[1], ch[0]];
    let blocks: Vec<Vec<Param>> = (0..4)
        .map(|b| {
            let (i, o) = (if b == 0 { rev[0] } else { rev[b - 1] }, rev[b]);
            let mut p = Vec::new();
            for r in 0..3 {
                vae_resnet(&mut p, &format!("resnets.{r}"), if r == 0 { i } else { o }, o);
            }
            if b < 3 {
                p.push(Param::new("upsamplers.0.conv.weight", &[o, o, 3, 3]));
                p.push(Param::new("upsamplers.0.conv.bias", &[o]));
            }
            p
        })
        .collect();
    let mut up = stack("decoder.up_blocks", 4, BlockKind::VaeUp, blocks[0].clone());
    up.overrides = (1..4).map(|b| (b, blocks[b].clone())).collect();
    let lat = side / 8;
    Model {
        in_channels: latent,
        out_channels: 3,
        stacks: vec![up],
        globals: g,
        cases: vec![Case { image_tokens: lat * lat, ..image_case(side, 0) }],
        reference,
        ..base(name, top, 1, top, 0)
    }
}

/// Flux's VAE decoder (`AutoencoderKL` with 16 latent channels, blocks 128, 256,
/// 512, 512; no quantisation convolutions): the pipeline's last component, run
/// once per image. Its encoder is not part of a text-to-image pipeline.
pub fn flux_vae() -> Model {
    vae_decoder(
        "flux-vae",
        16,
        [128, 256, 512, 512],
        1024,
        json!({"module": "diffusers", "class": "AutoencoderKL", "prefix": "decoder.",
               "config": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
                          "layers_per_block": 2, "norm_num_groups": 32,
                          "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
                          "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
                          "use_quant_conv": false, "use_post_quant_conv": false, "scaling_factor": 0.3611, "shift_factor": 0.1159}}),
    )
}

/// Every model in the registry.
pub fn models() -> Vec<Model> {
    vec![flux_dev(), qwen_image(), sd35_large(), wan21_t2v_14b(), z_image_turbo(), t5_xxl(), qwen25_vl_7b_text(), flux_vae()]
}

/// The model named `name`.
pub fn model(name: &str) -> Result<Model, String> {
    models().into_iter().find(|m| m.name == name).ok_or_else(|| {
        let known: Vec<&str> = models().iter().map(|m| m.name).collect();
        match QUANTIZED.iter().find(|q| q.0 == name) {
            Some((_, of, storage)) => format!(
                "{name} is {of} stored {}: the Rust drivers stream bf16 models; quantized ones run through the Python package (bench/py-run.sh, PY_MODELS={name})",
                storage.tag()
            ),
            None => format!("no model {name:?} in the registry (models: {})", known.join(", ")),
        }
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
pub fn to_json(models: &[Model]) -> Value {
    Value::Array(
        models
            .iter()
            .map(|m| {
                let params: serde_json::Map<String, Value> = m.params().into_iter().map(|p| (p.name, json!(p.shape))).collect();
                json!({"name": m.name, "reference": m.reference, "params": params, "cases": m.cases,
                       "block_bytes_bf16": m.block_bytes(2), "largest_block_bytes_bf16": m.largest_block_bytes(2),
                       "storage": m.storage.tag(), "stored_bytes": m.stored_bytes()})
            })
            .collect(),
    )
}
