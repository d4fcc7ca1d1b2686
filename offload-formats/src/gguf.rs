//! GGUF files read as stored: header, metadata and tensor index parsed and
//! checked at open; tensor bytes (quantized blocks included) read as they are,
//! never dequantised here.
//!
//! The layout (`ggml/docs/gguf.md`): magic `GGUF`, a version (2 or 3), the
//! tensor and metadata counts, the metadata as typed key–value pairs, then one
//! entry per tensor (name, dimensions innermost first, type id, offset), and
//! the data from the next multiple of `general.alignment` (32 by default).
//! Each tensor's offset is relative to the data's start and aligned the same.
//!
//! Types read: F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K. Any other type is an
//! error naming the tensor and the type.

use offload_core::error::{Error, Result};
use offload_core::source::{check_region_is, CheckpointFile, FileIdentity, FileRegion, HostRegion, RegionSource, TensorSource};
use offload_core::tensor::{DType, TensorSpec};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The metadata key prefix under which ComfyUI-GGUF's converter names the shape
/// a tensor had before it stored it reshaped (rows re-cut to whole quant blocks
/// of 256).
pub const ORIG_SHAPE: &str = "comfy.gguf.orig_shape.";

/// `spec` in the shape `v` names, where its bytes are the same in it: as many
/// elements, and for a quantized tensor rows of whole blocks (a block of the
/// stored rows then lies in one row of the original shape). Otherwise the
/// fault: such a tensor cannot be streamed as stored under its real shape.
fn original_shape(spec: TensorSpec, v: &GgufValue, nbytes: usize) -> std::result::Result<TensorSpec, String> {
    let dims = match v {
        GgufValue::Array(a) => a.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect::<Option<Vec<usize>>>(),
        _ => None,
    }
    .ok_or_else(|| format!("{ORIG_SHAPE}{} is {v:?}, not a list of dimensions", spec.name))?;
    let count = |s: &[usize]| s.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    if count(&dims) != count(&spec.shape) {
        return Err(format!("stored as {:?}, its original shape {dims:?} holds another number of elements", spec.shape));
    }
    let original = TensorSpec::new(spec.name.clone(), spec.dtype, dims.clone());
    match original.nbytes() {
        Ok(n) if n == nbytes => Ok(original),
        _ => Err(format!(
            "stored as {:?} in {:?} blocks that run across the rows of its original shape {dims:?}: it cannot be streamed as stored in that shape",
            spec.shape, spec.dtype
        )),
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// The GGUF type id of `dtype`, for the types this reader takes.
pub fn gguf_type_id(dtype: DType) -> Option<u32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q8_0 => 8,
        DType::Q4_K => 12,
        DType::Q5_K => 13,
        DType::Q6_K => 14,
        DType::BF16 => 30,
        _ => return None,
    })
}

/// The dtype of GGUF type id `id`, or its name (when it has one) for the error.
fn dtype_of(id: u32) -> std::result::Result<DType, String> {
    Ok(match id {
        0 => DType::F32,
        1 => DType::F16,
        8 => DType::Q8_0,
        12 => DType::Q4_K,
        13 => DType::Q5_K,
        14 => DType::Q6_K,
        30 => DType::BF16,
        _ => {
            const NAMES: [&str; 31] = [
                "F32", "F16", "Q4_0", "Q4_1", "4", "5", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
                "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
                "BF16",
            ];
            let name = NAMES.get(id as usize).filter(|n| n.len() > 1).map_or(String::new(), |n| format!("{n} "));
            return Err(format!("quant type {name}(id {id}) is not one this reader takes (F32, F16, BF16, Q8_0, Q4_K, Q5_K, Q6_K)"));
        }
    })
}

/// Longest string accepted in the header (a key, a value, a tensor name).
const MAX_STRING: u64 = 1 << 24;
/// Most dimensions a tensor may have. ggml computes with four, but GGUF files
/// hold more: ComfyUI-GGUF's `fix_5d_tensors` writes Wan's Conv3d patch
/// embedding back as a five-dimensional F32 tensor.
const MAX_DIMS: u32 = 8;

/// A GGUF file: its metadata, its tensors as [`TensorSpec`]s (shapes
/// outermost first, as everywhere else in offload), and their bytes read as
/// stored with positioned reads, the file checked unchanged after each.
pub struct GgufFile {
    path: PathBuf,
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    specs: Vec<TensorSpec>,
    /// Absolute file offsets of each tensor's data.
    offsets: Vec<u64>,
    alignment: u64,
    /// The whole file as a region: positioned reads until a backend maps it
    /// ([`set_region`](GgufFile::set_region)).
    region: Arc<dyn HostRegion>,
    /// The file's identity when the header was read.
    opened: FileIdentity,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.specs.len())
            .finish_non_exhaustive()
    }
}

/// The header reader: every length checked against what is left of the file.
struct Header<'a> {
    r: BufReader<&'a File>,
    pos: u64,
    len: u64,
    path: &'a Path,
}

impl Header<'_> {
    fn bad(&self, tensor: &str, fault: String) -> Error {
        Error::BadCheckpoint { path: self.path.to_path_buf(), tensor: tensor.to_owned(), fault }
    }

    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > self.len - self.pos {
            return Err(self.bad("", format!("{what} of {n} bytes at byte {} runs past the end of the {}-byte file", self.pos, self.len)));
        }
        let mut v = vec![0; n as usize];
        self.r.read_exact(&mut v).map_err(|source| Error::Io { path: self.path.to_path_buf(), source })?;
        self.pos += n;
        Ok(v)
    }

    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.bytes(N as u64, what)?.try_into().expect("N bytes read"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        if n > MAX_STRING {
            return Err(self.bad("", format!("{what} of {n} bytes at byte {} is longer than the {MAX_STRING} accepted", self.pos)));
        }
        String::from_utf8(self.bytes(n, what)?).map_err(|_| self.bad("", format!("{what} before byte {} is not UTF-8", self.pos)))
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<GgufValue> {
        use GgufValue as V;
        Ok(match ty {
            0 => V::U8(u8::from_le_bytes(self.arr(key)?)),
            1 => V::I8(i8::from_le_bytes(self.arr(key)?)),
            2 => V::U16(u16::from_le_bytes(self.arr(key)?)),
            3 => V::I16(i16::from_le_bytes(self.arr(key)?)),
            4 => V::U32(self.u32(key)?),
            5 => V::I32(i32::from_le_bytes(self.arr(key)?)),
            6 => V::F32(f32::from_le_bytes(self.arr(key)?)),
            7 => match self.arr::<1>(key)?[0] {
                0 => V::Bool(false),
                1 => V::Bool(true),
                b => return Err(self.bad("", format!("metadata {key:?}: bool byte {b}"))),
            },
            8 => V::Str(self.string(key)?),
            9 if depth == 0 => {
                let item = self.u32(key)?;
                let n = self.u64(key)?;
                // Every item takes at least one byte: a count beyond the file is a lie.
                if n > self.len - self.pos {
                    return Err(self.bad("", format!("metadata {key:?}: an array of {n} items in {} bytes left", self.len - self.pos)));
                }
                (0..n).map(|_| self.value(item, key, depth + 1)).collect::<Result<Vec<_>>>().map(V::Array)?
            }
            9 => return Err(self.bad("", format!("metadata {key:?}: an array of arrays"))),
            10 => V::U64(self.u64(key)?),
            11 => V::I64(i64::from_le_bytes(self.arr(key)?)),
            12 => V::F64(f64::from_le_bytes(self.arr(key)?)),
            t => return Err(self.bad("", format!("metadata {key:?}: unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Open `path` and check its header: magic and version, metadata well
    /// formed, every tensor's type one this reader takes, its innermost
    /// dimension a whole number of blocks, its bytes aligned, inside the file
    /// and not overlapping another's, names unique.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_then(path.as_ref(), &|| ())
    }

    /// [`open`](Self::open), calling `after_header` once the header is read
    /// (tests change the file there); the identity is taken before the header
    /// is read and compared after, as `SafetensorsFile` does.
    pub(crate) fn open_then(path: &Path, after_header: &dyn Fn()) -> Result<Self> {
        let path = path.to_path_buf();
        let io = |source| Error::Io { path: path.clone(), source };
        let file = File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let (len, read_from) = (meta.len(), offload_core::source::FileIdentity::of(&meta));
        let mut h = Header { r: BufReader::with_capacity(1 << 16, &file), pos: 0, len, path: &path };
        let magic = h.arr::<4>("the magic")?;
        if &magic != b"GGUF" {
            return Err(h.bad("", format!("not a GGUF file: it starts with {magic:?}, not \"GGUF\"")));
        }
        let version = h.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(h.bad("", format!("GGUF version {version}: versions 2 and 3 are read")));
        }
        let n_tensors = h.u64("the tensor count")?;
        let n_kv = h.u64("the metadata count")?;
        // Each entry takes at least 8 bytes: counts beyond the file are not believed.
        if n_tensors > len / 8 || n_kv > len / 8 {
            return Err(h.bad("", format!("{n_tensors} tensors and {n_kv} metadata entries cannot fit in {len} bytes")));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = h.string("a metadata key")?;
            let ty = h.u32(&key)?;
            let v = h.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(h.bad("", format!("metadata {key:?} given twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => return Err(h.bad("", format!("general.alignment {v:?} is not a power of two"))),
            },
        };
        // The count is the header's word: grown as tensors are read, not reserved
        // up front (a damaged count must be an error, not an allocation abort).
        let reserve = (n_tensors as usize).min(1 << 16);
        let mut specs = Vec::with_capacity(reserve);
        let mut rel = Vec::with_capacity(reserve);
        let mut names = std::collections::HashSet::new();
        for _ in 0..n_tensors {
            let name = h.string("a tensor name")?;
            if !names.insert(name.clone()) {
                return Err(h.bad(&name, "named twice in the tensor index".into()));
            }
            let n_dims = h.u32(&name)?;
            if n_dims > MAX_DIMS {
                return Err(h.bad(&name, format!("{n_dims} dimensions, at most {MAX_DIMS}")));
            }
            let mut dims = (0..n_dims).map(|_| h.u64(&name)).collect::<Result<Vec<_>>>()?;
            let ty = h.u32(&name)?;
            let offset = h.u64(&name)?;
            let dtype = dtype_of(ty).map_err(|fault| h.bad(&name, fault))?;
            // GGUF lists dimensions innermost first.
            dims.reverse();
            let shape = dims
                .into_iter()
                .map(|d| usize::try_from(d).map_err(|_| h.bad(&name, format!("dimension {d} does not fit in memory"))))
                .collect::<Result<Vec<_>>>()?;
            if offset % alignment != 0 {
                return Err(h.bad(&name, format!("data offset {offset} is not a multiple of the file's alignment {alignment}")));
            }
            let spec = TensorSpec::new(name.clone(), dtype, shape);
            let nbytes = spec.nbytes().map_err(|e| h.bad(&name, e.to_string()))?;
            let spec = match metadata.get(&format!("{ORIG_SHAPE}{name}")) {
                Some(v) => original_shape(spec, v, nbytes).map_err(|fault| h.bad(&name, fault))?,
                None => spec,
            };
            specs.push(spec);
            rel.push((offset, nbytes as u64));
        }
        let data_start = h.pos.div_ceil(alignment) * alignment;
        let data_len = len.saturating_sub(data_start);
        let mut ranges: Vec<(u64, u64, usize)> = Vec::with_capacity(rel.len());
        for (i, &(a, n)) in rel.iter().enumerate() {
            let b = a
                .checked_add(n)
                .filter(|&b| b <= data_len)
                .ok_or_else(|| h.bad(&specs[i].name, format!("{n} bytes at data offset {a} run past the {data_len} bytes of data")))?;
            ranges.push((a, b, i));
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(h.bad(&specs[w[1].2].name, format!("bytes overlap tensor {:?}", specs[w[0].2].name)));
            }
        }
        let offsets = rel.iter().map(|&(a, _)| data_start + a).collect();
        after_header();
        let region = FileRegion::new(&path, file.try_clone().map_err(io)?)?;
        let opened = region.identity();
        read_from.compare(&path, &opened)?;
        Ok(GgufFile { path, version, metadata, specs, offsets, alignment, region: Arc::new(region), opened })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The metadata, by key (`general.architecture`, `general.alignment`, …).
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// The model architecture the file names (`general.architecture`: `flux`,
    /// `wan`, `qwen_image`, ...), which [`crate::rename::gguf_to_diffusers`] maps by.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata.get("general.architecture").and_then(GgufValue::as_str)
    }

    /// The alignment of every tensor's data in the file.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Where tensor `index`'s bytes start in the file.
    pub fn data_offset(&self, index: usize) -> u64 {
        self.offsets[index]
    }

    /// Serve the tensors from `region` (the file mapped by a backend) instead of
    /// positioned reads. It must be this file as its header was read (length and
    /// identity checked), as [`SafetensorsFile::set_region`](offload_core::source::SafetensorsFile::set_region) requires.
    pub fn set_region(&mut self, region: Arc<dyn HostRegion>) -> Result<()> {
        check_region_is(&self.path, &self.opened, &region)?;
        self.region = region;
        Ok(())
    }
}

/// The mapped host tier serves a block from the file in place where its tensors
/// lie as the store lays them out (each at a multiple of 256 bytes from the
/// block's first). GGUF aligns tensors to 32 bytes, so that holds where the
/// tensors' sizes are whole multiples of 256 (the common shapes); any other block
/// is copied from the file, counted, with the reason.
impl RegionSource for GgufFile {
    fn region(&self) -> Arc<dyn HostRegion> {
        self.region.clone()
    }
    fn tensor_offset(&self, index: usize) -> Option<usize> {
        Some(self.offsets[index] as usize)
    }
}

/// The disk tier reads a block from the file where its tensors lie as the store
/// lays them out, as for the mapped tier; a block planned on disk that does not
/// is an error naming it and the tensor.
impl CheckpointFile for GgufFile {
    fn file_path(&self) -> &Path {
        &self.path
    }
    fn opened_identity(&self) -> FileIdentity {
        self.opened
    }
}

impl TensorSource for GgufFile {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn origin(&self) -> String {
        format!("GGUF file {}", self.path.display())
    }
    /// The tensor's stored bytes; the file is checked to be the one whose header
    /// was read before and after the read (a changed file is an error naming it
    /// and the tensor, never a weight).
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let name = &self.specs[index].name;
        self.region.read_at(self.offsets[index] as usize, dst).map_err(|e| offload_core::source::naming(e, name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF file in memory: (name, dims outermost first, type id, bytes), with `align`.
    fn write(meta: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, Vec<u8>)], align: u64, version: u32) -> Vec<u8> {
        let s = |v: &mut Vec<u8>, x: &str| {
            v.extend((x.len() as u64).to_le_bytes());
            v.extend(x.as_bytes());
        };
        let mut v = b"GGUF".to_vec();
        v.extend(version.to_le_bytes());
        v.extend((tensors.len() as u64).to_le_bytes());
        v.extend((meta.len() as u64).to_le_bytes());
        for (k, ty, val) in meta {
            s(&mut v, k);
            v.extend(ty.to_le_bytes());
            v.extend(val);
        }
        let mut off = 0u64;
        let mut offs = vec![];
        for (name, dims, ty, bytes) in tensors {
            s(&mut v, name);
            v.extend((dims.len() as u32).to_le_bytes());
            for d in dims.iter().rev() {
                v.extend(d.to_le_bytes());
            }
            v.extend(ty.to_le_bytes());
            v.extend(off.to_le_bytes());
            offs.push(off);
            off = (off + bytes.len() as u64).div_ceil(align) * align;
        }
        v.resize((v.len() as u64).div_ceil(align) as usize * align as usize, 0);
        let start = v.len();
        for ((.., bytes), o) in tensors.iter().zip(offs) {
            v.resize(start + o as usize, 0);
            v.extend(bytes);
        }
        v
    }

    fn random(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn file(bytes: &[u8]) -> (tempfile_path::Tmp, PathBuf) {
        let t = tempfile_path::Tmp::new();
        let p = t.0.join("m.gguf");
        std::fs::write(&p, bytes).unwrap();
        (t, p)
    }

    mod tempfile_path {
        pub struct Tmp(pub std::path::PathBuf);
        impl Tmp {
            pub fn new() -> Self {
                static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let d = std::env::temp_dir().join(format!("offload-gguf-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&d).unwrap();
                Tmp(d)
            }
        }
        impl Drop for Tmp {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn u32v(x: u32) -> Vec<u8> {
        x.to_le_bytes().to_vec()
    }

    fn strv(x: &str) -> Vec<u8> {
        let mut v = (x.len() as u64).to_le_bytes().to_vec();
        v.extend(x.as_bytes());
        v
    }

    fn err(bytes: &[u8]) -> String {
        let (_t, p) = file(bytes);
        GgufFile::open(&p).unwrap_err().to_string()
    }

    #[test]
    fn every_type_reads_as_stored_with_shapes_outermost_first() {
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend(2u64.to_le_bytes());
        arr.extend(strv("a"));
        arr.extend(strv("b"));
        let meta = vec![("general.architecture", 8, strv("flux")), ("general.alignment", 4, u32v(64)), ("tokens", 9, arr)];
        let t: Vec<(&str, &[u64], u32, Vec<u8>)> = vec![
            ("double_blocks.0.img_attn.qkv.weight", &[3, 64], 8, random(3 * 2 * 34, 1)),
            ("double_blocks.0.img_mlp.0.weight", &[2, 256], 12, random(2 * 144, 2)),
            ("double_blocks.1.img_attn.qkv.weight", &[3, 512], 13, random(3 * 2 * 176, 3)),
            ("double_blocks.1.img_mlp.0.weight", &[1, 256], 14, random(210, 4)),
            ("double_blocks.0.norm.scale", &[5], 0, random(20, 5)),
            ("double_blocks.1.norm.scale", &[2, 3], 1, random(12, 6)),
            ("img_in.weight", &[7], 30, random(14, 7)),
        ];
        let (_t, p) = file(&write(&meta, &t, 64, 3));
        let g = GgufFile::open(&p).unwrap();
        assert_eq!((g.version(), g.alignment()), (3, 64));
        assert_eq!(g.metadata()["general.architecture"].as_str(), Some("flux"));
        assert_eq!(g.architecture(), Some("flux"));
        assert_eq!(g.metadata()["tokens"], GgufValue::Array(vec![GgufValue::Str("a".into()), GgufValue::Str("b".into())]));
        let want = [DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::F32, DType::F16, DType::BF16];
        for (i, ((name, dims, _, bytes), dt)) in t.iter().zip(want).enumerate() {
            let spec = &g.specs()[i];
            assert_eq!((spec.name.as_str(), spec.dtype), (*name, dt));
            assert_eq!(spec.shape, dims.iter().map(|&d| d as usize).collect::<Vec<_>>());
            assert_eq!(spec.nbytes().unwrap(), bytes.len(), "{name}");
            assert_eq!(g.data_offset(i) % 64, 0);
            let mut got = vec![0; bytes.len()];
            g.read_into(i, &mut got).unwrap();
            assert!(got == *bytes, "{name}: bytes differ");
        }
    }

    #[test]
    fn a_tensor_stored_reshaped_reads_in_its_original_shape_where_its_bytes_allow() {
        // ComfyUI-GGUF's `comfy.gguf.orig_shape.<name>`: arrays of INT32 (type 5).
        let shape = |dims: &[u32]| {
            let mut v = 5u32.to_le_bytes().to_vec();
            v.extend((dims.len() as u64).to_le_bytes());
            for d in dims {
                v.extend(d.to_le_bytes());
            }
            v
        };
        let meta = vec![
            ("comfy.gguf.orig_shape.patch.weight", 9, shape(&[2, 3, 1, 2, 2])),
            ("comfy.gguf.orig_shape.blocks.0.w", 9, shape(&[4, 32])),
        ];
        let t: Vec<(&str, &[u64], u32, Vec<u8>)> =
            vec![("patch.weight", &[24], 0, random(96, 1)), ("blocks.0.w", &[2, 64], 8, random(2 * 2 * 34, 2))];
        let (_t, p) = file(&write(&meta, &t, 32, 3));
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.specs()[0].shape, [2, 3, 1, 2, 2], "its original shape");
        assert_eq!(g.specs()[1].shape, [4, 32], "Q8_0 rows of whole blocks: the same bytes");
        let mut got = vec![0; 2 * 2 * 34];
        g.read_into(1, &mut got).unwrap();
        assert!(got == t[1].3);
        // Blocks of 256 that run across rows of 128, and a shape of another size, are named.
        let e = err(&write(&[("comfy.gguf.orig_shape.w", 9, shape(&[2, 128]))], &[("w", &[1, 256], 12, random(144, 3))], 32, 3));
        assert!(e.contains("\"w\"") && e.contains("run across the rows"), "{e}");
        let e = err(&write(&[("comfy.gguf.orig_shape.w", 9, shape(&[5]))], &[("w", &[4], 0, random(16, 4))], 32, 3));
        assert!(e.contains("another number of elements"), "{e}");
        let e = err(&write(&[("comfy.gguf.orig_shape.w", 8, strv("4"))], &[("w", &[4], 0, random(16, 4))], 32, 3));
        assert!(e.contains("not a list of dimensions"), "{e}");
        // Five dimensions stored as such (ComfyUI-GGUF's fix_5d_tensors: Wan's Conv3d weight in F32).
        let (_t5, p5) = file(&write(&[], &[("patch.weight", &[2, 3, 1, 2, 2], 0, random(96, 5))], 32, 3));
        assert_eq!(GgufFile::open(&p5).unwrap().specs()[0].shape, [2, 3, 1, 2, 2]);
        let e = err(&write(&[], &[("w", &[1; 9], 0, random(4, 6))], 32, 3));
        assert!(e.contains("9 dimensions, at most 8"), "{e}");
    }

    #[test]
    fn bad_files_are_named_errors() {
        let q8 = |dims: &'static [u64], n| vec![("blocks.0.w", dims, 8u32, random(n, 9))];
        let good = write(&[], &q8(&[2, 32], 68), 32, 3);
        assert!(err(b"GGU").contains("runs past the end"));
        let mut m = good.clone();
        m[..4].copy_from_slice(b"GGML");
        assert!(err(&m).contains("not a GGUF file"));
        assert!(err(&write(&[], &q8(&[2, 32], 68), 32, 1)).contains("GGUF version 1"));
        let e = err(&write(&[], &[("blocks.0.w", &[32], 2, random(18, 1))], 32, 3));
        assert!(e.contains("blocks.0.w") && e.contains("Q4_0") && e.contains("id 2"), "{e}");
        let e = err(&write(&[], &q8(&[2, 48], 102), 32, 3));
        assert!(e.contains("blocks.0.w") && e.contains("blocks of 32"), "{e}");
        // The data cut short: the tensor runs past the end.
        let e = err(&good[..good.len() - 1]);
        assert!(e.contains("blocks.0.w") && e.contains("run past"), "{e}");
        let e = err(&write(&[("general.alignment", 4, u32v(24))], &q8(&[2, 32], 68), 32, 3));
        assert!(e.contains("general.alignment"), "{e}");
        let e = err(&write(&[("k", 4, u32v(1)), ("k", 4, u32v(2))], &[], 32, 3));
        assert!(e.contains("\"k\" given twice"), "{e}");
        let two = vec![("blocks.0.w", &[32u64][..], 8u32, random(34, 1)), ("blocks.0.w", &[32u64][..], 8, random(34, 2))];
        assert!(err(&write(&[], &two, 32, 3)).contains("named twice"));
        // A lying array count and string length are refused before any allocation.
        let mut lie = 8u32.to_le_bytes().to_vec();
        lie.extend(u64::MAX.to_le_bytes());
        assert!(err(&write(&[("a", 9, lie)], &[], 32, 3)).contains("items in"));
        let mut s = (u64::MAX).to_le_bytes().to_vec();
        s.extend(b"x");
        assert!(err(&write(&[("s", 8, s)], &[], 32, 3)).contains("longer than"));
        assert!(err(&write(&[("s", 77, vec![])], &[], 32, 3)).contains("unknown value type 77"));
    }

    #[test]
    fn a_file_rewritten_while_its_header_is_read_is_refused() {
        let (_t, p) = file(&write(&[], &[("blocks.0.w", &[32], 8, random(34, 1))], 32, 3));
        let rewrite = || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let mut bytes = std::fs::read(&p).unwrap();
            let n = bytes.len();
            bytes[n - 1] ^= 1;
            std::fs::write(&p, &bytes).unwrap();
        };
        let e = GgufFile::open_then(&p, &rewrite).map(drop).expect_err("refused").to_string();
        assert!(e.contains("m.gguf") && e.contains("written since"), "{e}");
        assert!(GgufFile::open(&p).is_ok());
    }

    #[test]
    fn a_file_changed_after_open_is_an_error_naming_it_and_the_tensor() {
        let (_t, p) = file(&write(&[], &[("blocks.0.w", &[32], 8, random(34, 1))], 32, 3));
        let g = GgufFile::open(&p).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let mut dst = vec![0; 34];
        let e = g.read_into(0, &mut dst).unwrap_err().to_string();
        assert!(e.contains("blocks.0.w") && e.contains("m.gguf") && e.contains("written since"), "{e}");
    }
}
