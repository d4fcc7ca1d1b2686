//! Where tensor bytes come from when the host store is built: memory, or a
//! safetensors file read block by block (no second full copy of the model), or
//! served in place from the file's own bytes ([`HostRegion`], [`RegionSource`]:
//! the mapped host tier, `HostStore::build_mapped`).

use crate::error::{Error, Result};
use crate::tensor::{DType, TensorSpec};
use serde::de::{Deserializer, MapAccess, Visitor};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A set of named tensors whose bytes can be read into a destination buffer.
pub trait TensorSource {
    /// Every tensor, in source order.
    fn specs(&self) -> &[TensorSpec];
    /// Write the bytes of tensor `index` (of [`specs`](Self::specs)) into `dst`,
    /// whose length is exactly the tensor's size.
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()>;
    /// Where the tensors come from, for errors (`"checkpoint /path/m.safetensors"`).
    fn origin(&self) -> String {
        "the tensors given".into()
    }
}

/// Tensors held in memory (tests, models built in code).
#[derive(Clone, Debug, Default)]
pub struct MemoryTensors {
    specs: Vec<TensorSpec>,
    data: Vec<Vec<u8>>,
}

impl MemoryTensors {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a tensor; its bytes must match its shape and dtype.
    pub fn push(&mut self, spec: TensorSpec, bytes: Vec<u8>) -> Result<()> {
        let want = spec.nbytes()?;
        if bytes.len() != want {
            return Err(Error::BadTensor { tensor: spec.name, fault: format!("{} bytes given, shape and dtype need {want}", bytes.len()) });
        }
        self.specs.push(spec);
        self.data.push(bytes);
        Ok(())
    }

    /// The bytes of the tensor named `name`.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        self.specs.iter().position(|s| s.name == name).map(|i| self.data[i].as_slice())
    }
}

impl TensorSource for MemoryTensors {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        dst.copy_from_slice(&self.data[index]);
        Ok(())
    }
}

/// A safetensors checkpoint: the header is parsed and checked at open; tensor
/// bytes are read with positioned reads straight into the destination (a pinned
/// block buffer), so the model is never held twice in memory.
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    specs: Vec<TensorSpec>,
    /// Absolute file offsets of each tensor's data.
    offsets: Vec<u64>,
    /// The whole file as a region the host store can serve blocks from: read with
    /// positioned reads ([`FileRegion`]) until a backend maps it
    /// ([`set_region`](SafetensorsFile::set_region)).
    region: Arc<dyn HostRegion>,
    /// The file's identity when the header was read (what every region of it checks against).
    opened: FileIdentity,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile").field("path", &self.path).field("tensors", &self.specs.len()).finish_non_exhaustive()
    }
}

struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Entries, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = map.next_entry()? {
                    v.push(e);
                }
                Ok(Entries(v))
            }
        }
        d.deserialize_map(V)
    }
}

/// Largest header accepted (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

impl SafetensorsFile {
    /// Open `path` and check its header: dtypes known, shapes agree with byte
    /// ranges, ranges inside the file and not overlapping, names unique.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_then(path.as_ref(), &|| ())
    }

    /// [`open`](Self::open), calling `after_header` once the header is read
    /// (tests change the file there). The file's identity is taken before the
    /// header is read and compared after: a file rewritten in between (same
    /// length, other offsets) is an error, not a header of other bytes.
    pub(crate) fn open_then(path: &Path, after_header: &dyn Fn()) -> Result<Self> {
        let path = path.to_path_buf();
        let io = |source| Error::Io { path: path.clone(), source };
        let bad = |tensor: &str, fault: String| Error::BadCheckpoint { path: path.clone(), tensor: tensor.to_owned(), fault };
        let file = File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        let (len, read_from) = (meta.len(), FileIdentity::of(&meta));
        if len < 8 {
            return Err(bad("", format!("file is {len} bytes, shorter than the 8-byte header length")));
        }
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(io)?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n > len - 8 {
            return Err(bad("", format!("header length {n} runs past the end of the {len}-byte file")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(io)?;
        let entries: Entries = serde_json::from_slice(&header).map_err(|e| bad("", format!("header is not valid JSON: {e}")))?;
        let data_start = 8 + n;
        let data_len = len - data_start;
        let mut specs = Vec::new();
        let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
        let mut names = std::collections::HashSet::new();
        for (name, v) in entries.0 {
            if name == "__metadata__" {
                continue;
            }
            if !names.insert(name.clone()) {
                return Err(bad(&name, "named twice in the header".into()));
            }
            let dtype_s = v.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad(&name, "no dtype".into()))?;
            let dtype = DType::parse(dtype_s).ok_or_else(|| bad(&name, format!("unknown dtype {dtype_s:?}")))?;
            let shape: Vec<usize> = v
                .get("shape")
                .and_then(|s| s.as_array())
                .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
                .ok_or_else(|| bad(&name, "shape is missing or not a list of sizes".into()))?;
            let offs: Vec<u64> = v
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
                .filter(|o: &Vec<u64>| o.len() == 2)
                .ok_or_else(|| bad(&name, "data_offsets is missing or not [begin, end]".into()))?;
            let (a, b) = (offs[0], offs[1]);
            if a > b || b > data_len {
                return Err(bad(&name, format!("data_offsets [{a}, {b}] outside the {data_len} bytes of data")));
            }
            let spec = TensorSpec::new(name.clone(), dtype, shape);
            let nbytes = spec.nbytes().map_err(|e| bad(&name, e.to_string()))?;
            if (b - a) as usize != nbytes {
                return Err(bad(&name, format!("shape {:?} of {dtype_s} needs {nbytes} bytes, data_offsets give {}", spec.shape, b - a)));
            }
            ranges.push((a, b, specs.len()));
            specs.push(spec);
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(bad(&specs[w[1].2].name, format!("bytes overlap tensor {:?}", specs[w[0].2].name)));
            }
        }
        let mut offsets = vec![0; specs.len()];
        for (a, _, i) in ranges {
            offsets[i] = data_start + a;
        }
        after_header();
        let region = FileRegion::new(&path, file.try_clone().map_err(io)?)?;
        let opened = region.identity;
        read_from.compare(&path, &opened)?;
        Ok(SafetensorsFile { path, file, specs, offsets, region: Arc::new(region), opened })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where tensor `index`'s bytes start in the file.
    pub fn data_offset(&self, index: usize) -> u64 {
        self.offsets[index]
    }

    /// The file as a [`FileRegion`], with the identity recorded when the header
    /// was read (so a file rewritten since fails its `check`).
    pub fn file_region(&self) -> Result<FileRegion> {
        let file = self.file.try_clone().map_err(|source| Error::Io { path: self.path.clone(), source })?;
        Ok(FileRegion { path: self.path.clone(), file, identity: self.opened })
    }

    /// Serve the host store's blocks from `region` (the file mapped by a backend,
    /// e.g. `offload_cuda::map_checkpoint`) instead of positioned reads. It must
    /// hold this file's bytes: its length and its file's identity (device, inode,
    /// length, modification and change times, [`HostRegion::file_identity`]) are
    /// checked against the file's when its header was read, so a mapping of
    /// another file of the same length, or of this one written since, is refused.
    pub fn set_region(&mut self, region: Arc<dyn HostRegion>) -> Result<()> {
        check_region_is(&self.path, &self.opened, &region)?;
        self.region = region;
        Ok(())
    }
}

impl RegionSource for SafetensorsFile {
    fn region(&self) -> Arc<dyn HostRegion> {
        self.region.clone()
    }
    fn tensor_offset(&self, index: usize) -> Option<usize> {
        Some(self.offsets[index] as usize)
    }
}

/// A read-only byte region the host store can serve blocks from without copying
/// them (the mapped host tier): a checkpoint file, mapped by a backend that can
/// register it with its device, or read with positioned reads where none can.
///
/// Host code reads it only through [`read_at`](Self::read_at), never through a
/// mapping, so a file truncated under the mapping is an error there, not a
/// `SIGBUS`. A backend registers only a region type of its own that it knows to be
/// mapped (found through [`as_any`](Self::as_any), e.g. `offload_cuda::MappedFile`),
/// never an address a trait implementation hands it.
pub trait HostRegion: Send + Sync + 'static {
    /// Bytes in the region.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy `dst.len()` bytes from `offset` into `dst`; an error if the region no
    /// longer holds them (the file truncated or replaced since it was opened).
    fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// The region as `Any`, so a backend can find a region type of its own (a
    /// mapping it made) and register it.
    fn as_any(&self) -> &dyn std::any::Any;
    /// What it is, for errors (`"checkpoint /path/m.safetensors"`).
    fn origin(&self) -> String;
    /// Whether the region still holds the bytes it was opened with: for a file,
    /// the same file (device and inode behind the path), the same length,
    /// modification and change times ([`FileIdentity`]). Checked before a store
    /// registers it, before a read, and by a ring at every step boundary
    /// ([`HostStore::check_sources`](crate::store::HostStore::check_sources)).
    fn check(&self) -> Result<()>;
    /// Whether the bytes the region reads are still those it was opened with,
    /// wherever its path points now: a file renamed over the path (or the path
    /// deleted) leaves the opened file, unlinked, holding what it held, and no
    /// one can open it by path to write it. What puts a module back after its
    /// checkpoint was replaced asks this, not [`check`](Self::check), which
    /// refuses a path that names another file. [`check`](Self::check) by default.
    fn held(&self) -> Result<()> {
        self.check()
    }
    /// The identity of the file the region holds, as recorded when it was
    /// opened; `None` for a region that is not a file. A checkpoint accepts a
    /// region only of its own file ([`SafetensorsFile::set_region`]).
    fn file_identity(&self) -> Option<FileIdentity> {
        None
    }
    /// Bytes a backend page-locks when it registers the region for DMA (the
    /// mapping's whole pages, [`len`](Self::len) by default). Registration is
    /// all or nothing: the host store charges this to its pin budget once, with
    /// the first block it serves in place, whatever share of the region it serves.
    fn registered_len(&self) -> usize {
        self.len()
    }
    /// How a backend registered the region, once it has (`"read-only"`, or a
    /// fallback a driver's refusal led to); `None` before, or for a region no
    /// backend registers. [`HostTier::registration`](crate::store::HostTier::registration) reports it.
    fn registration(&self) -> Option<String> {
        None
    }
}

/// That `region` holds the file at `path` as it was when `opened` was recorded:
/// its length and its file's identity (device, inode, length, modification and
/// change times) checked, so a mapping of another file of the same length, or of
/// this one written since, is refused.
pub fn check_region_is(path: &Path, opened: &FileIdentity, region: &Arc<dyn HostRegion>) -> Result<()> {
    let want = opened.len as usize;
    let bad = |fault: String| Error::BadCheckpoint { path: path.to_path_buf(), tensor: String::new(), fault };
    if region.len() != want {
        return Err(bad(format!("a region of {} bytes given for a {want}-byte file", region.len())));
    }
    match region.file_identity() {
        None => return Err(bad(format!("{} is not a file whose identity can be checked", region.origin()))),
        Some(id) => opened.compare(path, &id).map_err(|e| bad(format!("{} is not this file as opened: {e}", region.origin())))?,
    }
    region.check()
}

/// A source whose tensors lie in one [`HostRegion`]: the host store can serve a
/// block from the region in place when its tensors lie there as the store would
/// lay them out ([`HostStore::build_mapped`](crate::store::HostStore::build_mapped)).
pub trait RegionSource: TensorSource {
    /// The region holding every tensor.
    fn region(&self) -> Arc<dyn HostRegion>;
    /// Where tensor `index`'s bytes start in the region; `None` where they are
    /// not one range of it (a tensor a renaming joins from parts): the mapped
    /// tier copies a block holding one, and the disk tier refuses it by name.
    fn tensor_offset(&self, index: usize) -> Option<usize>;
}

/// A checkpoint file whose blocks the disk tier reads from it as the ring needs
/// them ([`HostStore::build_tiered`](crate::store::HostStore::build_tiered)): a
/// [`RegionSource`] over one file, with the file's path and its identity when
/// its header was read, so a file replaced or written since is refused:
/// safetensors ([`SafetensorsFile`]), GGUF (`GgufFile`, in `offload-formats`) and
/// either under other names (`Renamed`, in `offload-formats`).
///
/// The contract an implementation keeps: [`RegionSource::tensor_offset`] is an
/// offset into the file at [`file_path`](Self::file_path), where that tensor's
/// bytes lie as [`TensorSource::read_into`] reads them. The disk tier reads
/// the file at those offsets; an offset into anything else would stream other
/// bytes than the tensor's.
pub trait CheckpointFile: RegionSource {
    /// The file's path.
    fn file_path(&self) -> &Path;
    /// The file's identity when its header was read.
    fn opened_identity(&self) -> FileIdentity;
}

impl CheckpointFile for SafetensorsFile {
    fn file_path(&self) -> &Path {
        &self.path
    }
    fn opened_identity(&self) -> FileIdentity {
        self.opened
    }
}

/// What identifies a file's contents cheaply: which file it is (device and
/// inode), how long, and when its data (`mtime`) and its inode (`ctime`) last
/// changed.
///
/// `ctime` is what catches a write whose modification time was put back
/// afterwards (`cp -p` onto the file, `touch -r`, `rsync -t --inplace`): no
/// process can set it. What no identity catches is a change within the file
/// system's timestamp granularity of the moment the identity was recorded (a few
/// milliseconds on Linux's coarse clock); the disk tier and the mapped tier check
/// it at every step boundary, so such a change is also one a step was already
/// reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    /// The device holding the file.
    pub dev: u64,
    /// The file's inode.
    pub ino: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Its data's last modification, in nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Its inode's last change (any write, or a change of its times or
    /// permissions), in nanoseconds since the epoch.
    pub ctime_ns: i128,
}

impl FileIdentity {
    /// Whether the open `file` at `path` still holds what it held when this
    /// identity was recorded (same file, length, modification and change times):
    /// a named error if not.
    pub(crate) fn check_contents(&self, path: &Path, file: &File) -> Result<()> {
        let now = FileIdentity::of(&file.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?);
        self.compare(path, &now)
    }

    /// Whether the open `file` still holds what it held when this identity was
    /// recorded, wherever `path` points now: as
    /// [`check_contents`](Self::check_contents), but a file unlinked since (no
    /// link left: replaced by a rename, or deleted) may have moved its change
    /// time, which the unlink itself does; its length and modification time
    /// must not have moved. A write with its modification time put back before
    /// the unlink is what this cannot see.
    pub(crate) fn check_held(&self, path: &Path, file: &File) -> Result<()> {
        let m = file.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let now = FileIdentity::of(&m);
        if m.nlink() == 0 {
            return self.compare(path, &FileIdentity { ctime_ns: self.ctime_ns, ..now });
        }
        self.compare(path, &now)
    }

    /// A named error saying how `now` differs from this identity, if it does.
    pub fn compare(&self, path: &Path, now: &FileIdentity) -> Result<()> {
        let bad = |fault: String| Error::BadCheckpoint { path: path.to_path_buf(), tensor: String::new(), fault };
        if (now.dev, now.ino) != (self.dev, self.ino) {
            return Err(bad("another file (device and inode differ from the one opened)".into()));
        }
        if now.len != self.len {
            return Err(bad(format!(
                "the file is now {} bytes, {} when opened: truncated or rewritten under the store",
                now.len, self.len
            )));
        }
        if now.mtime_ns != self.mtime_ns {
            return Err(bad("the file was written since it was opened (its modification time changed)".into()));
        }
        if now.ctime_ns != self.ctime_ns {
            return Err(bad(
                "the file was changed since it was opened (its inode change time moved: written with its modification time put back, \
                 or its times or permissions changed)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The identity `m` describes.
    pub fn of(m: &std::fs::Metadata) -> Self {
        FileIdentity {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
            ctime_ns: m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128,
        }
    }
}

/// A file as a [`HostRegion`] read with positioned reads, its identity recorded
/// when opened and checked before every read.
#[derive(Debug)]
pub struct FileRegion {
    path: PathBuf,
    file: File,
    identity: FileIdentity,
}

impl FileRegion {
    /// `file` (opened from `path`) as a region; its identity is recorded now.
    pub fn new(path: &Path, file: File) -> Result<Self> {
        let m = file.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Ok(FileRegion { path: path.to_path_buf(), file, identity: FileIdentity::of(&m) })
    }

    /// The identity recorded when the region was made.
    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// The open file (for a backend that maps it).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl HostRegion for FileRegion {
    fn len(&self) -> usize {
        self.identity.len as usize
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    /// Reads through the open file: its bytes as opened ([`held`](HostRegion::held)),
    /// even where the path has named another file since.
    fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.held()?;
        if offset.checked_add(dst.len()).is_none_or(|end| end > self.len()) {
            return Err(Error::BadCheckpoint {
                path: self.path.clone(),
                tensor: String::new(),
                fault: format!("{} bytes at {offset} asked of a {}-byte file", dst.len(), self.len()),
            });
        }
        // A read that fails because the file changed after the check says so; a
        // read that succeeds while the file changed is refused too.
        self.file.read_exact_at(dst, offset as u64).map_err(|source| match self.held() {
            Err(changed) => changed,
            Ok(()) => Error::Io { path: self.path.clone(), source },
        })?;
        self.held()
    }
    fn held(&self) -> Result<()> {
        self.identity.check_held(&self.path, &self.file)
    }
    fn origin(&self) -> String {
        format!("checkpoint {}", self.path.display())
    }
    fn file_identity(&self) -> Option<FileIdentity> {
        Some(self.identity)
    }
    fn check(&self) -> Result<()> {
        let bad = |fault: String| Error::BadCheckpoint { path: self.path.clone(), tensor: String::new(), fault };
        // The path first: a file renamed over it also moves the old file's change time.
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == (self.identity.dev, self.identity.ino) => {}
            Ok(_) => return Err(bad("the path now names another file: replaced since it was opened".into())),
            Err(source) => return Err(Error::Io { path: self.path.clone(), source }),
        }
        self.identity.check_contents(&self.path, &self.file)
    }
}

impl TensorSource for SafetensorsFile {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }
    fn origin(&self) -> String {
        format!("checkpoint {}", self.path.display())
    }
    /// Reads the tensor, then checks the file is still the one whose header was
    /// read (device, inode, length, modification and change times, and the path
    /// still naming it): bytes read from a file changed before or during the
    /// read are an error naming the file and the tensor, never a weight.
    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let name = &self.specs[index].name;
        let read = self.file.read_exact_at(dst, self.offsets[index]);
        self.region_check().map_err(|e| naming(e, name))?;
        read.map_err(|source| naming(Error::Io { path: self.path.clone(), source }, name))
    }
}

/// A checkpoint's error while reading `tensor`, naming it: a file changed, and a
/// file that can no longer be read (deleted, unreadable), which named no tensor.
pub fn naming(e: Error, tensor: &str) -> Error {
    match e {
        Error::BadCheckpoint { path, fault, .. } => Error::BadCheckpoint { path, tensor: tensor.to_owned(), fault },
        Error::Io { path, source } => Error::BadCheckpoint { path, tensor: tensor.to_owned(), fault: format!("reading it: {source}") },
        e => e,
    }
}

impl SafetensorsFile {
    /// The file behind the open handle and behind the path is still the one
    /// whose header was read.
    fn region_check(&self) -> Result<()> {
        // The path first: a file renamed over it also moves the old file's change time.
        match std::fs::metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == (self.opened.dev, self.opened.ino) => {}
            Ok(_) => {
                return Err(Error::BadCheckpoint {
                    path: self.path.clone(),
                    tensor: String::new(),
                    fault: "the path now names another file: replaced since it was opened".into(),
                })
            }
            Err(source) => return Err(Error::Io { path: self.path.clone(), source }),
        }
        self.opened.check_contents(&self.path, &self.file)
    }
}

/// Where tensor `t` of the model lies in `source` (`by_name`: the source's
/// tensors by name): an error naming it where the source lacks it or holds it
/// with another dtype or shape.
pub(crate) fn source_index(source: &dyn TensorSource, by_name: &std::collections::HashMap<&str, usize>, t: &TensorSpec) -> Result<usize> {
    let i = *by_name.get(t.name.as_str()).ok_or_else(|| Error::BadTensor {
        tensor: t.name.clone(),
        fault: format!("the model expects it but {} lacks it", source.origin()),
    })?;
    let have = &source.specs()[i];
    if have.dtype != t.dtype || have.shape != t.shape {
        return Err(Error::BadTensor {
            tensor: t.name.clone(),
            fault: format!("expected {:?} {:?}, {} has {:?} {:?}", t.dtype, t.shape, source.origin(), have.dtype, have.shape),
        });
    }
    Ok(i)
}
