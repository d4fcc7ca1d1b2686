//! Tensor descriptions: dtype, shape, and where a tensor sits inside a block.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Element types found in checkpoints. Names follow safetensors; the
/// block-quantized types (`Q8_0`, `Q4_K`, `Q5_K`, `Q6_K`) follow GGUF, whose
/// tensors store a run of elements of the innermost dimension as one block of
/// bytes (scales and packed values together).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[allow(missing_docs, non_camel_case_types)]
pub enum DType {
    BOOL,
    U8,
    I8,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
    F8_E4M3,
    F8_E5M2,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl DType {
    /// Bytes per element; for a block-quantized type, bytes per block of
    /// [`block_elems`](Self::block_elems) elements. A tensor's size is
    /// [`TensorSpec::nbytes`].
    pub fn size(self) -> usize {
        use DType::*;
        match self {
            BOOL | U8 | I8 | F8_E4M3 | F8_E5M2 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            F64 | I64 | U64 => 8,
            // GGUF's layouts (ggml-common.h): an f16 scale and 32 i8; the K-quants'
            // 256 elements with f16 super-scales, packed sub-block scales and values.
            Q8_0 => 34,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
        }
    }

    /// Elements per stored block: 1 for an element type, 32 (`Q8_0`) or 256 (the K-quants).
    pub fn block_elems(self) -> usize {
        match self {
            DType::Q8_0 => 32,
            DType::Q4_K | DType::Q5_K | DType::Q6_K => 256,
            _ => 1,
        }
    }

    /// Whether elements are stored in blocks with their scales (GGUF's quant types).
    pub fn is_block_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Parse a safetensors dtype name (`"BF16"`, `"F32"`, …).
    pub fn parse(name: &str) -> Option<DType> {
        use DType::*;
        Some(match name {
            "BOOL" => BOOL,
            "U8" => U8,
            "I8" => I8,
            "I16" => I16,
            "U16" => U16,
            "F16" => F16,
            "BF16" => BF16,
            "I32" => I32,
            "U32" => U32,
            "F32" => F32,
            "F64" => F64,
            "I64" => I64,
            "U64" => U64,
            "F8_E4M3" => F8_E4M3,
            "F8_E5M2" => F8_E5M2,
            _ => return None,
        })
    }
}

/// A tensor's name, dtype and shape (contiguous, row-major).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Full name as in the checkpoint (`double_blocks.7.img_attn.qkv.weight`).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape; strides are row-major contiguous.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A new spec.
    pub fn new(name: impl Into<String>, dtype: DType, shape: impl Into<Vec<usize>>) -> Self {
        TensorSpec { name: name.into(), dtype, shape: shape.into() }
    }

    /// Number of elements (1 for a scalar), or an error naming the tensor on overflow.
    pub fn numel(&self) -> Result<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::BadTensor { tensor: self.name.clone(), fault: format!("shape {:?} overflows", self.shape) })
    }

    /// Size in bytes, or an error naming the tensor on overflow or, for a
    /// block-quantized dtype, when the innermost dimension is not a whole number
    /// of blocks.
    pub fn nbytes(&self) -> Result<usize> {
        let per = self.dtype.block_elems();
        if per > 1 {
            let inner = self.shape.last().copied().unwrap_or(1);
            if self.shape.is_empty() || inner % per != 0 {
                return Err(Error::BadTensor {
                    tensor: self.name.clone(),
                    fault: format!(
                        "shape {:?} of {:?}: the innermost dimension does not divide into blocks of {per} elements",
                        self.shape, self.dtype
                    ),
                });
            }
        }
        (self.numel()? / per)
            .checked_mul(self.dtype.size())
            .ok_or_else(|| Error::BadTensor { tensor: self.name.clone(), fault: format!("shape {:?} overflows", self.shape) })
    }
}

/// A tensor placed in a block's buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedTensor {
    /// The tensor.
    pub spec: TensorSpec,
    /// Byte offset in the block buffer (a multiple of [`TENSOR_ALIGN`]).
    pub offset: usize,
    /// Size in bytes.
    pub nbytes: usize,
}

impl PlacedTensor {
    /// The tensor's bytes in `block` (a block buffer laid out as its layout says):
    /// an error naming the tensor where they lie past its end (a slot and a layout
    /// of different blocks), never a panic.
    pub fn bytes_in<'a>(&self, block: &'a [u8]) -> Result<&'a [u8]> {
        Ok(&block[self.range_in(block.len())?])
    }

    /// The tensor's byte range in a block buffer of `len` bytes (a host slice or a
    /// device slot): an error naming the tensor where it reaches past the end, or
    /// where the placement is not one a [`BlockLayout`] makes (`nbytes` other than
    /// the spec's size, an offset off [`TENSOR_ALIGN`]): a view of it would read
    /// another tensor's bytes, or past the range.
    pub fn range_in(&self, len: usize) -> Result<std::ops::Range<usize>> {
        let bad = |fault: String| Error::BadTensor { tensor: self.spec.name.clone(), fault };
        let size = self.spec.nbytes()?;
        if self.nbytes != size {
            return Err(bad(format!("placed as {} bytes, a tensor of {size}", self.nbytes)));
        }
        if self.offset % TENSOR_ALIGN != 0 {
            return Err(bad(format!("at offset {}, not a multiple of {TENSOR_ALIGN}", self.offset)));
        }
        match self.offset.checked_add(self.nbytes) {
            Some(end) if end <= len => Ok(self.offset..end),
            _ => Err(Error::BadTensor {
                tensor: self.spec.name.clone(),
                fault: format!("{} bytes at offset {} lie past the {len}-byte block buffer", self.nbytes, self.offset),
            }),
        }
    }
}

/// Alignment of every tensor inside a block buffer, in bytes.
pub const TENSOR_ALIGN: usize = 256;

/// Round `n` up to a multiple of [`TENSOR_ALIGN`].
pub fn align_up(n: usize) -> usize {
    n.div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN
}

/// Where every tensor of one block lives inside the block's contiguous buffer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockLayout {
    /// Tensors, in checkpoint order, at aligned offsets (increasing, except in a
    /// block served in place from a file: [`placed`](Self::placed)).
    pub tensors: Vec<PlacedTensor>,
    /// Exact buffer size: the end of the last tensor.
    pub bytes: usize,
}

impl BlockLayout {
    /// Lay tensors out one after another at 256-byte-aligned offsets; the size is
    /// exactly the end of the last tensor (no rounding beyond alignment).
    pub fn new(specs: Vec<TensorSpec>) -> Result<Self> {
        let mut offset = 0usize;
        let mut tensors = Vec::with_capacity(specs.len());
        let mut end = 0usize;
        for spec in specs {
            let nbytes = spec.nbytes()?;
            offset = offset.checked_next_multiple_of(TENSOR_ALIGN).ok_or_else(|| crate::error::Error::BadTensor {
                tensor: spec.name.clone(),
                fault: "the block's bytes before it overflow".into(),
            })?;
            end = offset
                .checked_add(nbytes)
                .ok_or_else(|| crate::error::Error::BadTensor { tensor: spec.name.clone(), fault: "its end overflows the block".into() })?;
            tensors.push(PlacedTensor { spec, offset, nbytes });
            offset = end;
        }
        Ok(BlockLayout { tensors, bytes: end })
    }

    /// A layout with the tensors at the offsets given (a block served in place from
    /// a checkpoint: the file's own offsets, relative to the block's first byte).
    /// Every offset must be a multiple of [`TENSOR_ALIGN`], every `nbytes` its
    /// spec's size, and no two tensors may overlap; the size is the end of the last.
    pub fn placed(tensors: Vec<PlacedTensor>) -> Result<Self> {
        let bad = |t: &PlacedTensor, fault: String| crate::error::Error::BadTensor { tensor: t.spec.name.clone(), fault };
        let mut spans: Vec<(usize, usize, usize)> = Vec::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if t.offset % TENSOR_ALIGN != 0 {
                return Err(bad(t, format!("at offset {}, not a multiple of {TENSOR_ALIGN}", t.offset)));
            }
            if t.nbytes != t.spec.nbytes()? {
                return Err(bad(t, format!("{} bytes placed for a {}-byte tensor", t.nbytes, t.spec.nbytes()?)));
            }
            let end = t.offset.checked_add(t.nbytes).ok_or_else(|| bad(t, "its end overflows".into()))?;
            spans.push((t.offset, end, i));
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(bad(&tensors[w[1].2], format!("overlaps {:?}", tensors[w[0].2].spec.name)));
            }
        }
        let bytes = spans.iter().map(|s| s.1).max().unwrap_or(0);
        Ok(BlockLayout { tensors, bytes })
    }

    /// The tensor named `name`: its full name, or a trailing part of it after a
    /// `.` (`attn.to_q.weight`). Where several tensors end so, the one whose name
    /// has the fewest parts before it (`blocks.0.norm.weight`, not
    /// `blocks.0.attn.norm.weight`, for `norm.weight`); where two tie, none.
    pub fn get(&self, name: &str) -> Option<&PlacedTensor> {
        if let Some(t) = self.tensors.iter().find(|t| t.spec.name == name) {
            return Some(t);
        }
        let depth = |t: &PlacedTensor| {
            let n = &t.spec.name;
            let head = n.strip_suffix(name).filter(|h| h.ends_with('.'))?;
            Some(head.matches('.').count())
        };
        let mut found = self.tensors.iter().filter_map(|t| depth(t).map(|d| (d, t))).collect::<Vec<_>>();
        found.sort_by_key(|(d, _)| *d);
        match found.as_slice() {
            [(d0, t), (d1, _), ..] if d0 < d1 => Some(t),
            [(_, t)] => Some(t),
            _ => None,
        }
    }

    /// Sum of tensor sizes without alignment padding.
    pub fn payload_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.nbytes).sum()
    }
}

/// The value of an fp8 byte (`F8_E4M3`: ml_dtypes' `float8_e4m3fn`, no
/// infinities, `S.1111.111` NaN; `F8_E5M2`: IEEE-like with infinities and NaNs).
/// `None` for a dtype that is not fp8.
pub fn fp8_to_f32(byte: u8, dtype: DType) -> Option<f32> {
    let (exp_bits, bias) = match dtype {
        DType::F8_E4M3 => (4u32, 7i32),
        DType::F8_E5M2 => (5, 15),
        _ => return None,
    };
    let man_bits = 7 - exp_bits;
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((byte >> man_bits) & ((1 << exp_bits) - 1) as u8) as i32;
    let m = (byte & ((1 << man_bits) - 1) as u8) as f32;
    let max_e = (1 << exp_bits) - 1;
    let v = match (dtype, e) {
        (DType::F8_E4M3, 15) if m as u32 == 7 => f32::NAN,
        (DType::F8_E5M2, e) if e == max_e => {
            if m == 0.0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        }
        (_, 0) => m / (1 << man_bits) as f32 * 2f32.powi(1 - bias),
        (_, e) => (1.0 + m / (1 << man_bits) as f32) * 2f32.powi(e - bias),
    };
    Some(sign * v)
}

/// The fp8 byte nearest `v` (ties to the even code, as a hardware cast rounds),
/// saturating at the largest finite value; NaN to NaN. `None` for a dtype that
/// is not fp8.
pub fn f32_to_fp8(v: f32, dtype: DType) -> Option<u8> {
    // The finite non-negative codes in increasing value (codes 0.. up to the largest finite).
    static TABLES: std::sync::OnceLock<[Vec<(u8, f32)>; 2]> = std::sync::OnceLock::new();
    let tables = TABLES.get_or_init(|| {
        [DType::F8_E4M3, DType::F8_E5M2]
            .map(|d| (0..=0x7fu8).filter_map(|b| fp8_to_f32(b, d).filter(|x| x.is_finite()).map(|x| (b, x))).collect())
    });
    let finite = match dtype {
        DType::F8_E4M3 => &tables[0],
        DType::F8_E5M2 => &tables[1],
        _ => return None,
    };
    if v.is_nan() {
        return Some(if dtype == DType::F8_E4M3 { 0x7f } else { 0x7e });
    }
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    let i = finite.partition_point(|&(_, x)| x < a);
    let code = match (finite.get(i.wrapping_sub(1)), finite.get(i)) {
        (_, Some(&(c, x))) if x == a => c,
        (Some(&(lo, xl)), Some(&(hi, xh))) => match (a - xl).partial_cmp(&(xh - a)) {
            Some(std::cmp::Ordering::Less) => lo,
            Some(std::cmp::Ordering::Greater) => hi,
            _ => {
                if lo % 2 == 0 {
                    lo
                } else {
                    hi
                }
            }
        },
        (Some(&(c, _)), None) => c,
        (None, Some(&(c, _))) => c,
        (None, None) => return None,
    };
    Some(sign | code)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes declared by a caller (the Python package's tensors, a checkpoint's
    /// header) that add up past the address space are a named error, not an
    /// overflow: a panic in a debug build, a wrapped layout in a release one.
    #[test]
    fn a_block_whose_tensors_overflow_the_address_space_is_a_named_error() {
        let half = usize::MAX / 2 + 1;
        let specs = vec![TensorSpec::new("b.0.a", DType::U8, [half]), TensorSpec::new("b.0.b", DType::U8, [half])];
        let e = BlockLayout::new(specs).expect_err("a layout past usize::MAX").to_string();
        assert!(e.contains("b.0.b") && e.contains("overflow"), "{e}");
        let specs = vec![TensorSpec::new("b.0.a", DType::U8, [usize::MAX - 10]), TensorSpec::new("b.0.b", DType::U8, [1])];
        let e = BlockLayout::new(specs).expect_err("an aligned offset past usize::MAX").to_string();
        assert!(e.contains("b.0.b") && e.contains("overflow"), "{e}");
        let fine = BlockLayout::new(vec![TensorSpec::new("b.0.a", DType::U8, [3]), TensorSpec::new("b.0.b", DType::U8, [5])]).unwrap();
        assert_eq!((fine.tensors[1].offset, fine.bytes), (TENSOR_ALIGN, TENSOR_ALIGN + 5));
    }

    /// A placement no layout makes (a hand-built `PlacedTensor`: fewer bytes than
    /// its spec, an offset off the alignment) is a named error from `bytes_in`:
    /// a backend making a tensor of the spec's size from those bytes would read
    /// past them.
    #[test]
    fn a_placement_no_layout_makes_is_a_named_error_not_a_short_read() {
        let block = vec![0u8; 8192];
        let spec = TensorSpec::new("b.0.w", DType::F32, [1024]);
        let short = PlacedTensor { spec: spec.clone(), offset: 0, nbytes: 4 };
        let e = short.bytes_in(&block).unwrap_err().to_string();
        assert!(e.contains("b.0.w") && e.contains("placed as 4 bytes, a tensor of 4096"), "{e}");
        let off = PlacedTensor { spec: spec.clone(), offset: 4, nbytes: 4096 };
        assert!(off.bytes_in(&block).unwrap_err().to_string().contains("not a multiple of 256"));
        assert_eq!(PlacedTensor { spec, offset: 256, nbytes: 4096 }.bytes_in(&block).unwrap().len(), 4096);
    }

    /// A short name is the part after the block prefix: where a nested tensor
    /// ends the same way (in name order, as checkpoints list them, first), the
    /// block's own is meant; two equally nested ones are no answer, not a guess.
    #[test]
    fn a_short_name_finds_the_blocks_own_tensor_not_a_nested_one() {
        let l = BlockLayout::new(
            ["b.0.attn.norm.weight", "b.0.norm.weight", "b.0.x.w", "b.0.y.w", "b.0.z.q"]
                .into_iter()
                .map(|n| TensorSpec::new(n, DType::U8, [4]))
                .collect(),
        )
        .unwrap();
        let name = |n: &str| l.get(n).map(|t| t.spec.name.as_str());
        assert_eq!(name("norm.weight"), Some("b.0.norm.weight"));
        assert_eq!(name("attn.norm.weight"), Some("b.0.attn.norm.weight"));
        assert_eq!(name("b.0.attn.norm.weight"), Some("b.0.attn.norm.weight"));
        assert_eq!(name("q"), Some("b.0.z.q"));
        assert_eq!(name("w"), None, "two equally nested tensors end in w");
        assert_eq!(name("orm.weight"), None, "a part is whole segments");
    }
}
