//! fp8 weights in safetensors checkpoints and the scales that go with them.
//!
//! A checkpoint's fp8 tensors (`F8_E4M3`, `F8_E5M2`) stream as stored, one byte
//! a weight; compute dequantises. How a weight finds its scale depends on who
//! wrote the file. The conventions recognised ([`Fp8Convention`]):
//!
//! | convention | how it is recognised | weight | scale |
//! | --- | --- | --- | --- |
//! | unscaled (diffusers' layerwise casting, plain fp8 releases) | fp8 tensors and none of the markers below | `X.weight` | none (1) |
//! | ComfyUI `scaled_fp8` | a tensor named `scaled_fp8` (or `P.scaled_fp8`, under a model's prefix) | `X.weight` | `X.scale_weight`, per tensor |
//! | `weight_scale` (ComfyUI's newer quantized files, compressed-tensors) | a tensor named `*.weight_scale` | `X.weight` | `X.weight_scale`, per tensor or per output channel |
//! | torchao float8 weight-only | a tensor named `*._weight_qdata` | `X._weight_qdata` | `X._weight_scale`, per tensor or per output channel |
//!
//! A weight its convention gives a scale and whose scale is missing, a scale of
//! the wrong size or type, a scale with no fp8 weight, or a scale beside an fp8
//! weight under no convention recognised (`X.weight_scale_inv`) is an error
//! naming the tensor. The dequantised value is `bf16(f32(w) × f32(scale))`
//! ([`dequantize_to_bf16`], the CPU reference a device kernel must match).

use offload_core::error::{Error, Result};
pub use offload_core::tensor::{f32_to_fp8, fp8_to_f32};
use offload_core::tensor::{DType, TensorSpec};
use std::collections::HashMap;

/// How a checkpoint's fp8 weights carry their scales (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Convention {
    /// No scales: each weight is its fp8 value.
    Unscaled,
    /// ComfyUI's `scaled_fp8` files: `X.scale_weight`, one f32 per tensor.
    ComfyScaledFp8,
    /// `X.weight_scale`: one per tensor or one per output channel.
    WeightScale,
    /// torchao's float8 weight-only tensors flattened: `X._weight_qdata`, `X._weight_scale`.
    TorchAo,
}

/// How many scales a weight has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    /// One for the whole tensor.
    PerTensor,
    /// One per output channel (the outermost dimension).
    PerChannel,
}

/// One fp8 weight and its scale.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Weight {
    /// The weight's tensor name.
    pub weight: String,
    /// Its dtype (`F8_E4M3` or `F8_E5M2`).
    pub dtype: DType,
    /// Its scale's tensor name (none when unscaled).
    pub scale: Option<String>,
    /// How many scales it has.
    pub granularity: Granularity,
}

/// The fp8 weights of a checkpoint and their scales, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Weights {
    /// The convention the file follows.
    pub convention: Fp8Convention,
    /// Every fp8 weight, in the order of the specs given.
    pub weights: Vec<Fp8Weight>,
}

/// The fp8 weights of `specs` with their scales, under the convention the
/// tensor names show.
pub fn fp8_weights(specs: &[TensorSpec]) -> Result<Fp8Weights> {
    let by_name: HashMap<&str, &TensorSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
    let is_fp8 = |d: DType| matches!(d, DType::F8_E4M3 | DType::F8_E5M2);
    // ComfyUI's marker, bare or under a model's prefix (`model.diffusion_model.scaled_fp8`).
    let is_marker = |name: &str| name == "scaled_fp8" || name.ends_with(".scaled_fp8");
    let convention = if specs.iter().any(|s| is_marker(&s.name)) {
        Fp8Convention::ComfyScaledFp8
    } else if specs.iter().any(|s| s.name.ends_with(".weight_scale")) {
        Fp8Convention::WeightScale
    } else if specs.iter().any(|s| s.name.ends_with("._weight_qdata")) {
        Fp8Convention::TorchAo
    } else {
        Fp8Convention::Unscaled
    };
    // (weight suffix, scale suffix) of the convention.
    let (w_suffix, s_suffix) = match convention {
        Fp8Convention::Unscaled => ("", ""),
        Fp8Convention::ComfyScaledFp8 => (".weight", ".scale_weight"),
        Fp8Convention::WeightScale => (".weight", ".weight_scale"),
        Fp8Convention::TorchAo => ("._weight_qdata", "._weight_scale"),
    };
    let bad = |tensor: &str, fault: String| Error::BadTensor { tensor: tensor.to_owned(), fault };
    let mut weights = Vec::new();
    let mut claimed = std::collections::HashSet::new();
    for s in specs {
        if !is_fp8(s.dtype) || is_marker(&s.name) {
            continue;
        }
        if convention == Fp8Convention::Unscaled {
            weights.push(Fp8Weight { weight: s.name.clone(), dtype: s.dtype, scale: None, granularity: Granularity::PerTensor });
            continue;
        }
        let Some(stem) = s.name.strip_suffix(w_suffix) else {
            return Err(bad(&s.name, format!("an fp8 tensor not named *{w_suffix}, in a file following the {convention:?} convention")));
        };
        let scale_name = format!("{stem}{s_suffix}");
        let scale = by_name.get(scale_name.as_str()).ok_or_else(|| {
            bad(&s.name, format!("fp8 weight without its scale {scale_name:?} (the file follows the {convention:?} convention)"))
        })?;
        if !matches!(scale.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(bad(&scale_name, format!("scale of dtype {:?}; f32, bf16 or f16 expected", scale.dtype)));
        }
        let n = scale.numel()?;
        let out = s.shape.first().copied().unwrap_or(1);
        let granularity = if n == 1 {
            Granularity::PerTensor
        } else if n == out && (scale.shape.len() == 1 || scale.shape[1..].iter().all(|&d| d == 1)) {
            Granularity::PerChannel
        } else {
            return Err(bad(
                &scale_name,
                format!(
                    "scale of shape {:?} for weight {:?} of shape {:?}: one value or one per output channel ({out}) expected",
                    scale.shape, s.name, s.shape
                ),
            ));
        };
        if convention == Fp8Convention::ComfyScaledFp8 && granularity != Granularity::PerTensor {
            return Err(bad(&scale_name, "ComfyUI's scale_weight is one value per tensor".into()));
        }
        claimed.insert(scale_name.clone());
        weights.push(Fp8Weight { weight: s.name.clone(), dtype: s.dtype, scale: Some(scale_name), granularity });
    }
    if convention != Fp8Convention::Unscaled {
        if let Some(orphan) = specs.iter().find(|s| s.name.ends_with(s_suffix) && !claimed.contains(&s.name)) {
            return Err(bad(
                &orphan.name,
                format!("a scale with no fp8 weight {:?}", format!("{}{w_suffix}", orphan.name.strip_suffix(s_suffix).unwrap_or(""))),
            ));
        }
    }
    if convention == Fp8Convention::Unscaled {
        refuse_unread_scales(specs, &weights)?;
    }
    Ok(Fp8Weights { convention, weights })
}

/// A file read as unscaled must hold no scale beside an fp8 weight: one under a
/// name no convention reads (`X.weight_scale_inv`, `X.scale_weight` without
/// ComfyUI's marker) would be dropped, every weight then off by its scale.
fn refuse_unread_scales(specs: &[TensorSpec], weights: &[Fp8Weight]) -> Result<()> {
    let stems: HashMap<&str, &str> = weights
        .iter()
        .filter_map(|w| {
            let stem = w.weight.strip_suffix(".weight").or_else(|| w.weight.strip_suffix("._weight_qdata"))?;
            Some((stem, w.weight.as_str()))
        })
        .collect();
    for s in specs {
        let Some((stem, last)) = s.name.rsplit_once('.') else { continue };
        let Some(weight) = stems.get(stem) else { continue };
        if s.name != *weight && last.to_ascii_lowercase().contains("scale") {
            return Err(Error::BadTensor {
                tensor: s.name.clone(),
                fault: format!(
                    "a scale beside fp8 weight {weight:?} under no convention this reads (ComfyUI's scaled_fp8 marker with \
                     X.scale_weight, X.weight_scale, torchao's X._weight_scale): its weights would be read unscaled"
                ),
            });
        }
    }
    Ok(())
}

/// `f32` to `bf16` bits, rounded to nearest even (NaN kept a quiet NaN).
pub fn f32_to_bf16(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The bf16 weights (as bits) of an fp8 tensor of `rows` output channels:
/// `bf16(f32(w) × scale)`, where `scales` holds one value (per tensor) or one per
/// row (per channel). The CPU reference of the device's dequantisation.
pub fn dequantize_to_bf16(bytes: &[u8], dtype: DType, rows: usize, scales: &[f32]) -> Result<Vec<u16>> {
    let bad = |fault: String| Error::BadTensor { tensor: "<fp8 weight>".into(), fault };
    if fp8_to_f32(0, dtype).is_none() {
        return Err(bad(format!("{dtype:?} is not an fp8 dtype")));
    }
    if rows == 0 || bytes.len() % rows != 0 {
        return Err(bad(format!("{} bytes are not {rows} equal rows", bytes.len())));
    }
    if scales.len() != 1 && scales.len() != rows {
        return Err(bad(format!("{} scales for {rows} rows: one, or one per row", scales.len())));
    }
    let table: Vec<f32> = (0..=255u8).map(|b| fp8_to_f32(b, dtype).unwrap_or(f32::NAN)).collect();
    let cols = bytes.len() / rows;
    Ok(bytes
        .iter()
        .enumerate()
        .map(|(i, &b)| f32_to_bf16(table[b as usize] * scales[if scales.len() == 1 { 0 } else { i / cols }]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, dtype: DType, shape: &[usize]) -> TensorSpec {
        TensorSpec::new(name, dtype, shape)
    }

    #[test]
    fn fp8_values_are_decoded_as_ml_dtypes_defines_them() {
        use DType::{F8_E4M3 as E4, F8_E5M2 as E5};
        for (b, d, v) in [
            (0x38u8, E4, 1.0f32),
            (0x7e, E4, 448.0),
            (0x01, E4, 2f32.powi(-9)),
            (0x08, E4, 2f32.powi(-6)),
            (0xc0, E4, -2.0),
            (0x3c, E5, 1.0),
            (0x7b, E5, 57344.0),
            (0x01, E5, 2f32.powi(-16)),
            (0x7c, E5, f32::INFINITY),
        ] {
            assert_eq!(fp8_to_f32(b, d), Some(v), "{b:#x} as {d:?}");
        }
        assert!(fp8_to_f32(0x7f, E4).unwrap().is_nan() && fp8_to_f32(0xff, E4).unwrap().is_nan());
        assert!(fp8_to_f32(0x7d, E5).unwrap().is_nan());
        assert_eq!(fp8_to_f32(0, DType::BF16), None);
        // Every e4m3 value but the NaNs is exact in bf16: the unscaled upcast loses nothing.
        for b in 0..=255u8 {
            let v = fp8_to_f32(b, E4).unwrap();
            if !v.is_nan() {
                assert_eq!(f32::from_bits((f32_to_bf16(v) as u32) << 16), v, "{b:#x}");
            }
        }
    }

    #[test]
    fn the_fp8_cast_is_nearest_ties_to_even_and_saturates() {
        for d in [DType::F8_E4M3, DType::F8_E5M2] {
            for b in 0..=255u8 {
                let v = fp8_to_f32(b, d).unwrap();
                if v.is_finite() && !(v == 0.0 && b == 0x80) {
                    assert_eq!(f32_to_fp8(v, d), Some(b), "{b:#x} as {d:?} round trips");
                }
            }
        }
        let e4 = DType::F8_E4M3;
        // 1.0 (0x38) and 1.125 (0x39): halfway goes to the even code, 1.0.
        assert_eq!(f32_to_fp8(1.0625, e4), Some(0x38));
        // 1.125 (0x39) and 1.25 (0x3a): halfway to 1.25.
        assert_eq!(f32_to_fp8(1.1875, e4), Some(0x3a));
        assert_eq!(f32_to_fp8(1.05, e4), Some(0x38));
        assert_eq!(f32_to_fp8(1.07, e4), Some(0x39));
        assert_eq!(f32_to_fp8(-1.2, e4), Some(0xba));
        assert_eq!(f32_to_fp8(1e6, e4), Some(0x7e));
        assert_eq!(f32_to_fp8(2f32.powi(-12), e4), Some(0x00));
        assert_eq!(f32_to_fp8(0.5, DType::BF16), None);
    }

    #[test]
    fn dequantisation_scales_per_tensor_and_per_row_and_rounds_to_nearest_even() {
        let w = [0x38u8, 0x40, 0xb8, 0x00]; // 1, 2, -1, 0 in e4m3
        let per_tensor = dequantize_to_bf16(&w, DType::F8_E4M3, 2, &[0.5]).unwrap();
        assert_eq!(per_tensor, [f32_to_bf16(0.5), f32_to_bf16(1.0), f32_to_bf16(-0.5), 0]);
        let per_row = dequantize_to_bf16(&w, DType::F8_E4M3, 2, &[3.0, 0.25]).unwrap();
        assert_eq!(per_row, [f32_to_bf16(3.0), f32_to_bf16(6.0), f32_to_bf16(-0.25), 0]);
        // 1 + 2^-8 is halfway between two bf16 values: to the even one, 1.0.
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert!(dequantize_to_bf16(&w, DType::F8_E4M3, 2, &[1.0, 2.0, 3.0]).is_err());
        assert!(dequantize_to_bf16(&w, DType::F8_E4M3, 3, &[1.0]).is_err());
        assert!(dequantize_to_bf16(&w, DType::BF16, 2, &[1.0]).is_err());
    }

    #[test]
    fn each_convention_is_recognised_with_its_scales() {
        let f = DType::F8_E4M3;
        let plain = fp8_weights(&[t("blocks.0.w.weight", f, &[4, 8]), t("blocks.0.norm.weight", DType::BF16, &[8])]).unwrap();
        assert_eq!(plain.convention, Fp8Convention::Unscaled);
        assert_eq!(plain.weights.len(), 1);
        assert_eq!(plain.weights[0].scale, None);

        let comfy = fp8_weights(&[
            t("scaled_fp8", f, &[0]),
            t("double_blocks.0.img_attn.qkv.weight", f, &[12, 8]),
            t("double_blocks.0.img_attn.qkv.scale_weight", DType::F32, &[]),
        ])
        .unwrap();
        assert_eq!(comfy.convention, Fp8Convention::ComfyScaledFp8);
        assert_eq!(comfy.weights[0].scale.as_deref(), Some("double_blocks.0.img_attn.qkv.scale_weight"));

        let ws =
            fp8_weights(&[t("blocks.0.ff.weight", DType::F8_E5M2, &[4, 8]), t("blocks.0.ff.weight_scale", DType::F32, &[4, 1])]).unwrap();
        assert_eq!((ws.convention, ws.weights[0].granularity), (Fp8Convention::WeightScale, Granularity::PerChannel));

        let ao = fp8_weights(&[t("blocks.0.ff._weight_qdata", f, &[4, 8]), t("blocks.0.ff._weight_scale", DType::BF16, &[4])]).unwrap();
        assert_eq!((ao.convention, ao.weights[0].granularity), (Fp8Convention::TorchAo, Granularity::PerChannel));
    }

    #[test]
    fn a_missing_or_wrong_scale_is_an_error_naming_the_tensor() {
        let f = DType::F8_E4M3;
        let e = fp8_weights(&[
            t("scaled_fp8", f, &[0]),
            t("double_blocks.0.a.weight", f, &[4, 8]),
            t("double_blocks.0.a.scale_weight", DType::F32, &[]),
            t("double_blocks.0.b.weight", f, &[4, 8]),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("double_blocks.0.b.weight") && e.contains("double_blocks.0.b.scale_weight"), "{e}");
        let e = fp8_weights(&[t("l.weight", f, &[4, 8]), t("l.weight_scale", DType::F32, &[3])]).unwrap_err().to_string();
        assert!(e.contains("l.weight_scale") && e.contains("[3]"), "{e}");
        let e = fp8_weights(&[t("l.weight", f, &[4, 8]), t("l.weight_scale", DType::I32, &[])]).unwrap_err().to_string();
        assert!(e.contains("l.weight_scale") && e.contains("I32"), "{e}");
        let e = fp8_weights(&[t("l.weight", f, &[4, 8]), t("l.weight_scale", DType::F32, &[]), t("m.weight_scale", DType::F32, &[])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("m.weight_scale") && e.contains("no fp8 weight"), "{e}");
        let e = fp8_weights(&[t("scaled_fp8", f, &[0]), t("a.weight", f, &[4, 8]), t("a.scale_weight", DType::F32, &[4])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("a.scale_weight") && e.contains("per tensor"), "{e}");
    }

    /// ComfyUI's full-pipeline files put the marker under the model's prefix
    /// (`model.diffusion_model.scaled_fp8`): its scales are read all the same.
    #[test]
    fn a_prefixed_scaled_fp8_marker_is_the_comfy_convention() {
        let f = DType::F8_E4M3;
        let w = fp8_weights(&[
            t("model.diffusion_model.scaled_fp8", f, &[0]),
            t("model.diffusion_model.a.weight", f, &[4, 8]),
            t("model.diffusion_model.a.scale_weight", DType::F32, &[]),
        ])
        .unwrap();
        assert_eq!(w.convention, Fp8Convention::ComfyScaledFp8);
        assert_eq!(w.weights.len(), 1, "the marker is no weight: {w:?}");
        assert_eq!(w.weights[0].scale.as_deref(), Some("model.diffusion_model.a.scale_weight"));
    }

    /// A scale beside an fp8 weight under no convention recognised (Hugging
    /// Face's block-wise `weight_scale_inv`, a `scale_weight` without ComfyUI's
    /// marker) is an error naming it, never read as an unscaled file.
    #[test]
    fn a_scale_no_convention_reads_is_an_error_not_unscaled() {
        let f = DType::F8_E4M3;
        for scale in ["l.weight_scale_inv", "l.scale_weight", "l.weight_scale_2", "l.input_scale"] {
            let e = fp8_weights(&[t("l.weight", f, &[4, 8]), t(scale, DType::F32, &[1, 1])]).unwrap_err().to_string();
            assert!(e.contains(scale) && e.contains("l.weight"), "{scale}: {e}");
        }
        // torchao's own naming recognised, its scale under another name: the weight is named.
        let e = fp8_weights(&[t("l._weight_qdata", f, &[4, 8]), t("l._weight_scale_inv", DType::F32, &[4])]).unwrap_err().to_string();
        assert!(e.contains("l._weight_qdata") && e.contains("without its scale"), "{e}");
        // A scale-like name beside a weight that is not fp8 is none of this.
        assert!(fp8_weights(&[t("l.weight", DType::BF16, &[4, 8]), t("l.scale_weight", DType::F32, &[])]).unwrap().weights.is_empty());
    }
}
