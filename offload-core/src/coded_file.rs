//! A component's blocks coded for the device ahead of time, in a file next to
//! the checkpoint: what a coded store reads at start instead of coding every
//! block on the host (the coding is the slow part of a coded start; reading and
//! hashing are not).
//!
//! [`CodedFile::write`] lays each block out as the store does
//! ([`BlockLayout::new`]), codes it with [`codec::code_for_device`] and writes
//! the coded bytes; [`HostStore::build_from_coded_file`](crate::store::HostStore::build_from_coded_file)
//! reads them back into the backend's coded host buffers
//! ([`HostKind::Precoded`](crate::host::HostKind::Precoded)).
//! Nothing in the file is trusted to stand for the weights: at load each
//! block's coded bytes are checked against the hashes the index holds of them
//! (damage on disk), and each segment's stored hash of its original bytes
//! against the hash of the checkpoint's bytes as the store lays them out
//! ([`codec::coded_matches`]: a file made from other weights, or a checkpoint
//! changed since). Either is an [`Error::CodedFile`] naming the file and the
//! block, never a wrong weight. The hashes catch damage, not tampering.
//!
//! Layout (all integers little-endian):
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `OFCODED1` |
//! | … | each entry's coded bytes, at a multiple of 4096 |
//! | n | the index, JSON ([`CodedEntry`] per block, the component, the segment and piece sizes) |
//! | 8 | n |
//! | 8 | magic `OFCODED1` |
//!
//! The file is written to a temporary name beside the target (the writer's own)
//! and renamed into place once whole, so a write cut short never leaves a file
//! that opens; every block's coded bytes are decoded on the host and compared
//! with its bytes before they are written.

use crate::codec;
use crate::discovery::{BlockId, ComponentInventory};
use crate::error::{Error, Result};
use crate::source::{FileIdentity, TensorSource};
use crate::tensor::BlockLayout;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"OFCODED1";
/// Where entries start: a multiple of this.
const ENTRY_ALIGN: u64 = 4096;
/// Bytes of coded data per integrity hash in the index.
pub const PIECE_BYTES: usize = 16 << 20;
/// The index's format version. 2: every block decoded back and compared before
/// it is written, and decoded again and compared with the checkpoint at every
/// load (`HostStore::build_from_coded_file`). Files of format 1 were written
/// before the decode-back check and are refused: write them again.
const FORMAT: u32 = 2;
/// The largest index accepted (a component has at most a few thousand blocks).
const MAX_INDEX: u64 = 64 << 20;

/// The name of the non-block tensors' entry.
pub const NON_BLOCK: &str = "<non-block>";

/// One block's coded bytes in a [`CodedFile`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodedEntry {
    /// The block (`stack.index`, as [`BlockId`] prints), or [`NON_BLOCK`].
    pub block: String,
    /// Bytes of the block as the store lays it out.
    pub raw_bytes: u64,
    /// Where its coded bytes start in the file.
    pub at: u64,
    /// How many.
    pub len: u64,
    /// [`codec::hash64`] of each piece ([`PIECE_BYTES`]) of the coded bytes, in order.
    pub pieces: Vec<u64>,
}

#[derive(Serialize, Deserialize)]
struct Index {
    format: u32,
    component: String,
    segment_bytes: u64,
    /// Bytes of coded data per piece hash ([`PIECE_BYTES`] as written by [`CodedFile::write`]).
    piece_bytes: u64,
    entries: Vec<CodedEntry>,
}

/// What [`CodedFile::write`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct CodedFileStats {
    /// Blocks written (the non-block entry included).
    pub entries: usize,
    /// Bytes of the blocks as laid out.
    pub raw_bytes: u64,
    /// Bytes of their coded forms.
    pub coded_bytes: u64,
    /// Seconds the write took.
    pub write_s: f64,
}

/// An open coded file ([`CodedFile::open`]): its index, read and checked.
///
/// ```
/// # #[cfg(feature = "sim")] fn main() -> offload_core::Result<()> {
/// use offload_core::{sim::SimBackend, *};
/// let mut tensors = MemoryTensors::new();
/// for i in 0..3 {
///     let w: Vec<u8> = (0..65536u32).flat_map(|v| (0x3c00u16 + (v * 7 + i) as u16 % 200).to_le_bytes()).collect();
///     tensors.push(TensorSpec::new(format!("blocks.{i}.w"), DType::BF16, [65536]), w)?;
/// }
/// let inventory = NameDiscovery.discover("transformer", tensors.specs())?;
/// let path = CodedFile::path_for(std::env::temp_dir().join(format!("doc-{}.safetensors", std::process::id())));
/// CodedFile::write(&path, &inventory, &tensors, 64 << 10, 2)?; // once, ahead of time
/// let backend = SimBackend::default_device();
/// let store = HostStore::build_from_coded_file(&backend, &inventory, &tensors, PinOptions::default(), &CodedFile::open(&path)?)?;
/// assert_eq!(store.coded_blocks(), 3);
/// # std::fs::remove_file(&path).ok();
/// # Ok(()) }
/// # #[cfg(not(feature = "sim"))] fn main() {}
/// ```
#[derive(Debug)]
pub struct CodedFile {
    path: PathBuf,
    file: File,
    identity: FileIdentity,
    component: String,
    segment_bytes: usize,
    piece_bytes: usize,
    /// Where the entries' data ends (the index starts).
    data_end: u64,
    entries: Vec<CodedEntry>,
    by_block: HashMap<String, usize>,
}

fn hash_pieces(bytes: &[u8], piece_bytes: usize, threads: usize) -> Vec<u64> {
    let pieces: Vec<&[u8]> = bytes.chunks(piece_bytes).collect();
    let threads = threads.clamp(1, pieces.len().max(1));
    let per = pieces.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> =
            pieces.chunks(per).map(|group| scope.spawn(move || group.iter().map(|p| codec::hash64(p)).collect::<Vec<_>>())).collect();
        // A hashing thread that panicked takes the caller down with it.
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

/// A block's bytes as the store lays them out, read from `source` (`by_name`:
/// its tensors by name).
fn laid_out(
    source: &dyn TensorSource,
    by_name: &HashMap<&str, usize>,
    specs: &[crate::tensor::TensorSpec],
) -> Result<(BlockLayout, Vec<u8>)> {
    let layout = BlockLayout::new(specs.to_vec())?;
    let mut raw = vec![0u8; layout.bytes];
    for placed in &layout.tensors {
        let i = crate::source::source_index(source, by_name, &placed.spec)?;
        source.read_into(i, &mut raw[placed.offset..placed.offset + placed.nbytes])?;
    }
    Ok((layout, raw))
}

impl CodedFile {
    /// Where the coded file of `checkpoint` goes by default: beside it, named
    /// `<checkpoint>.offload-coded`.
    pub fn path_for(checkpoint: impl AsRef<Path>) -> PathBuf {
        let mut p = checkpoint.as_ref().as_os_str().to_owned();
        p.push(".offload-coded");
        PathBuf::from(p)
    }

    /// Code every block of `inventory` (and its non-block tensors) from `source`
    /// and write them to `path`: segments of `segment_bytes` raw bytes, each
    /// coded on up to `threads` host threads ([`codec::code_for_device`]). One
    /// block in memory at a time, each decoded back on the host and compared
    /// before it is written. Written to `<path>.partial-<pid>-<nonce>` and
    /// renamed over `path` once complete; on an error nothing is left at either name.
    pub fn write(
        path: impl AsRef<Path>,
        inventory: &ComponentInventory,
        source: &dyn TensorSource,
        segment_bytes: usize,
        threads: usize,
    ) -> Result<CodedFileStats> {
        Self::write_pieces(path, inventory, source, segment_bytes, threads, PIECE_BYTES)
    }

    /// [`write`](Self::write) with `piece_bytes` of coded data per hash (tests
    /// use small pieces to have several in a small block).
    pub(crate) fn write_pieces(
        path: impl AsRef<Path>,
        inventory: &ComponentInventory,
        source: &dyn TensorSource,
        segment_bytes: usize,
        threads: usize,
        piece_bytes: usize,
    ) -> Result<CodedFileStats> {
        Self::write_with(path, inventory, source, segment_bytes, threads, piece_bytes, FORMAT, &|_, _| {})
    }

    /// [`write_pieces`](Self::write_pieces) with the index's `format` given and
    /// `alter` run on each block's coded bytes after they are checked and before
    /// they are hashed and written (tests: a file forged so that its own hashes
    /// hold, or one of an older format).
    #[allow(clippy::too_many_arguments)]
    #[doc(hidden)]
    pub fn write_with(
        path: impl AsRef<Path>,
        inventory: &ComponentInventory,
        source: &dyn TensorSource,
        segment_bytes: usize,
        threads: usize,
        piece_bytes: usize,
        format: u32,
        alter: &dyn Fn(&str, &mut Vec<u8>),
    ) -> Result<CodedFileStats> {
        let t0 = std::time::Instant::now();
        let path = path.as_ref();
        if piece_bytes == 0 {
            return Err(Error::Plan(format!("writing {}: hashed pieces of at least one byte", path.display())));
        }
        // A name of this writer's own: two writers at once never share a file.
        let mut partial = path.as_os_str().to_owned();
        let nonce = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        partial.push(format!(".partial-{}-{nonce}", std::process::id()));
        let partial = PathBuf::from(partial);
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| Error::Io { path: p, source }
        };
        let result = (|| {
            let created = std::fs::OpenOptions::new().write(true).create_new(true).open(&partial).map_err(io(&partial))?;
            let mut out = std::io::BufWriter::with_capacity(8 << 20, created);
            out.write_all(MAGIC).map_err(io(&partial))?;
            let mut at = MAGIC.len() as u64;
            let mut entries = Vec::new();
            let mut stats = CodedFileStats { entries: 0, raw_bytes: 0, coded_bytes: 0, write_s: 0.0 };
            let blocks = inventory.blocks().map(|b| (b.id.to_string(), b.tensors.as_slice()));
            let non_block = (!inventory.non_block.is_empty()).then(|| (NON_BLOCK.to_string(), inventory.non_block.as_slice()));
            let by_name: HashMap<&str, usize> = source.specs().iter().enumerate().map(|(i, s)| (s.name.as_str(), i)).collect();
            for (block, specs) in blocks.chain(non_block) {
                let (layout, raw) = laid_out(source, &by_name, specs)?;
                let mut coded = codec::code_for_device(&raw, segment_bytes, threads);
                // What is written is checked to decode to the block's bytes (the
                // device's decoder checks no hash): an encoder fault, or memory
                // damaged between coding and hashing, never becomes a file.
                let mut back = vec![0u8; raw.len()];
                codec::decode_device_block_on(&coded, &mut back, threads, &format!("{}/{block}", inventory.name))?;
                if back != raw {
                    return Err(Error::Protocol(format!("{}/{block}: coded bytes that do not decode to the block's", inventory.name)));
                }
                alter(&block, &mut coded);
                let start = at.next_multiple_of(ENTRY_ALIGN);
                out.write_all(&vec![0u8; (start - at) as usize]).map_err(io(&partial))?;
                out.write_all(&coded).map_err(io(&partial))?;
                at = start + coded.len() as u64;
                stats.raw_bytes += layout.bytes as u64;
                stats.coded_bytes += coded.len() as u64;
                let pieces = hash_pieces(&coded, piece_bytes, threads);
                entries.push(CodedEntry { block, raw_bytes: layout.bytes as u64, at: start, len: coded.len() as u64, pieces });
            }
            stats.entries = entries.len();
            let index = Index {
                format,
                component: inventory.name.clone(),
                segment_bytes: segment_bytes as u64,
                piece_bytes: piece_bytes as u64,
                entries,
            };
            let json = serde_json::to_vec(&index).map_err(|e| Error::Protocol(format!("writing the index of {}: {e}", path.display())))?;
            out.write_all(&json).map_err(io(&partial))?;
            out.write_all(&(json.len() as u64).to_le_bytes()).map_err(io(&partial))?;
            out.write_all(MAGIC).map_err(io(&partial))?;
            let file = out.into_inner().map_err(|e| Error::Io { path: partial.clone(), source: e.into_error() })?;
            file.sync_all().map_err(io(&partial))?;
            std::fs::rename(&partial, path).map_err(io(path))?;
            stats.write_s = t0.elapsed().as_secs_f64();
            Ok(stats)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        result
    }

    /// Open the coded file at `path` and read its index: a named error for a
    /// file that is not one, is cut short, or whose index does not hold
    /// together (entries outside the file or overlapping, a block named twice,
    /// piece hashes of the wrong count).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let bad = |fault: String| Error::CodedFile { path: path.clone(), block: String::new(), fault };
        let file = File::open(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        let identity = FileIdentity::of(&file.metadata().map_err(|source| Error::Io { path: path.clone(), source })?);
        let len = identity.len;
        let read = |at: u64, n: usize| -> Result<Vec<u8>> {
            let mut v = vec![0u8; n];
            file.read_exact_at(&mut v, at).map_err(|source| Error::Io { path: path.clone(), source })?;
            Ok(v)
        };
        if len < 24 || read(0, 8)? != MAGIC || read(len - 8, 8)? != MAGIC {
            return Err(bad(format!("not a coded file, or cut short ({len} bytes; no OFCODED1 magic at both ends)")));
        }
        let n = u64::from_le_bytes(read(len - 16, 8)?.try_into().unwrap_or_default());
        if n > MAX_INDEX || n > len - 24 {
            return Err(bad(format!("an index of {n} bytes in a {len}-byte file")));
        }
        let index_at = len - 16 - n;
        let index: Index =
            serde_json::from_slice(&read(index_at, n as usize)?).map_err(|e| bad(format!("its index does not parse: {e}")))?;
        if index.format == 1 {
            return Err(bad("format 1, written before every block was decoded back and checked: write it again (CodedFile::write)".into()));
        }
        if index.format != FORMAT {
            return Err(bad(format!("format {}, this build reads {FORMAT}", index.format)));
        }
        let piece_bytes = usize::try_from(index.piece_bytes)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| bad(format!("pieces of {} bytes", index.piece_bytes)))?;
        let mut by_block = HashMap::new();
        let mut end = MAGIC.len() as u64;
        for (i, e) in index.entries.iter().enumerate() {
            let fault = |f: String| Error::CodedFile { path: path.clone(), block: format!("{}/{}", index.component, e.block), fault: f };
            if e.at < end || e.at % ENTRY_ALIGN != 0 || e.at.checked_add(e.len).is_none_or(|x| x > index_at) {
                return Err(fault(format!("{} bytes at {}: misaligned, overlapping or outside the data", e.len, e.at)));
            }
            if e.len < 16 {
                return Err(fault(format!("{} coded bytes: shorter than a coded block's header", e.len)));
            }
            if e.pieces.len() as u64 != e.len.div_ceil(piece_bytes as u64) {
                return Err(fault(format!("{} piece hashes for {} bytes", e.pieces.len(), e.len)));
            }
            if by_block.insert(e.block.clone(), i).is_some() {
                return Err(fault("named twice in the index".into()));
            }
            end = e.at + e.len;
        }
        Ok(CodedFile {
            path,
            file,
            identity,
            component: index.component,
            segment_bytes: usize::try_from(index.segment_bytes).unwrap_or(usize::MAX),
            piece_bytes,
            data_end: index_at,
            entries: index.entries,
            by_block,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The component it was written for.
    pub fn component(&self) -> &str {
        &self.component
    }

    /// Raw bytes per coded segment it was written with.
    pub fn segment_bytes(&self) -> usize {
        self.segment_bytes
    }

    /// Its entries, in the order written.
    pub fn entries(&self) -> &[CodedEntry] {
        &self.entries
    }

    /// The entry of `block` ([`NON_BLOCK`] for the non-block tensors).
    pub fn entry(&self, block: &str) -> Option<&CodedEntry> {
        self.by_block.get(block).map(|&i| &self.entries[i])
    }

    /// The entry of block `id`.
    pub fn entry_of(&self, id: &BlockId) -> Option<&CodedEntry> {
        self.entry(&id.to_string())
    }

    /// Read `entry`'s coded bytes into `dst` (exactly its length) and check them
    /// against the index's piece hashes, each piece read and hashed in one pass
    /// on one of up to `threads` host threads: a named error for a file written
    /// since it was opened, a read that fails, or bytes that are not the ones
    /// written (the first such piece).
    pub fn read_entry(&self, entry: &CodedEntry, dst: &mut [u8], threads: usize) -> Result<()> {
        let block = format!("{}/{}", self.component, entry.block);
        let fault = |f: String| Error::CodedFile { path: self.path.clone(), block: block.clone(), fault: f };
        if dst.len() as u64 != entry.len {
            return Err(fault(format!("a {}-byte buffer for {} coded bytes", dst.len(), entry.len)));
        }
        // An entry from elsewhere (another file, built by hand) is checked as `open` checks its own.
        if entry.at.checked_add(entry.len).is_none_or(|end| end > self.data_end)
            || entry.pieces.len() as u64 != entry.len.div_ceil(self.piece_bytes as u64)
        {
            return Err(fault(format!("an entry of {} bytes at {} that this file's index does not hold", entry.len, entry.at)));
        }
        self.identity.check_contents(&self.path, &self.file).map_err(|e| fault(e.to_string()))?;
        let len = dst.len();
        let piece_bytes = self.piece_bytes;
        let mut pieces: Vec<(usize, &mut [u8])> = dst.chunks_mut(piece_bytes).enumerate().collect();
        let per = pieces.len().div_ceil(threads.clamp(1, pieces.len().max(1))).max(1);
        // Per piece that failed: its index, and the read's error (None: a hash that differs).
        let failed: Option<(usize, Option<std::io::Error>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = pieces
                .chunks_mut(per)
                .map(|group| {
                    scope.spawn(move || {
                        for (k, piece) in group.iter_mut() {
                            if let Err(e) = self.file.read_exact_at(piece, entry.at + (*k * piece_bytes) as u64) {
                                return Some((*k, Some(e)));
                            }
                            if codec::hash64(piece) != entry.pieces[*k] {
                                return Some((*k, None));
                            }
                        }
                        None
                    })
                })
                .collect();
            // A reading thread that panicked takes the caller down with it.
            handles.into_iter().filter_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).min_by_key(|f| f.0)
        });
        match failed {
            None => Ok(()),
            // A read that fails because the file changed since the check says so.
            Some((k, Some(e))) => Err(match self.identity.check_contents(&self.path, &self.file) {
                Err(changed) => fault(changed.to_string()),
                Ok(()) => fault(format!("reading piece {k} of {} bytes at {}: {e}", entry.len, entry.at)),
            }),
            Some((k, None)) => Err(fault(format!(
                "coded bytes damaged: piece {k} (bytes {} to {} of the entry) is not what was written",
                k * piece_bytes,
                ((k + 1) * piece_bytes).min(len)
            ))),
        }
    }
}
