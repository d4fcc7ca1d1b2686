//! The disk tier: blocks left in the checkpoint file when host memory is smaller
//! than the model.
//!
//! A block on disk has no host buffer of its own. For each copy of it, a reader
//! thread reads its range of the file ([`DiskFile`], `O_DIRECT` where the file
//! system allows it) into one of a few page-locked *bounce buffers*, refilled
//! through [`HostBuffer::refill`](crate::host::HostBuffer::refill),
//! which first waits for the buffer's last copy. The ring issues each block's
//! copy from its bounce buffer once the read is done, so a read that fails is an
//! error naming the block, and the block is never served. Reads run ahead of the
//! ring in its learned order, on their own threads: they overlap the copies, and
//! the copies overlap compute.

use crate::backend::HostBufferOf;
use crate::backend::OffloadBackend;
use crate::error::{Error, Result};
use crate::host::{HostBuffer, HostMemory};
use crate::source::FileIdentity;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

/// Alignment of `O_DIRECT` reads: offsets, lengths and buffer addresses.
pub const DIRECT_ALIGN: usize = 4096;

/// Reader threads of a ring's [`DiskStream`]: two reads in flight, so the disk
/// has the next request while the last one's bytes land.
pub const DISK_READERS: usize = 2;

/// A checkpoint file the disk tier reads blocks from, with positioned reads that
/// bypass the page cache (`O_DIRECT`) where the file system allows it, and
/// buffered ones where it does not (or where the destination is not aligned).
///
/// Its identity (length and modification time) is recorded at open and checked
/// before every read: a file written since is an error, never a block of new
/// bytes. A file replaced by a rename is refused too (the old file's change time moves).
#[derive(Debug)]
pub struct DiskFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    identity: FileIdentity,
}

impl DiskFile {
    /// Open `path` for the disk tier; `O_DIRECT` is tried and left off where the
    /// file system refuses it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| Error::Io { path: path.clone(), source };
        let buffered = File::open(&path).map_err(io)?;
        let identity = FileIdentity::of(&buffered.metadata().map_err(io)?);
        // The direct handle must name the same file as the buffered one.
        let direct = Self::open_direct(&path).filter(|d| {
            d.metadata().is_ok_and(|m| {
                let i = FileIdentity::of(&m);
                (i.dev, i.ino) == (identity.dev, identity.ino)
            })
        });
        Ok(DiskFile { direct, path, buffered, identity })
    }

    /// [`open`](Self::open), refusing a file other than the one `expected` names
    /// (another file at the path, or the same one written since).
    pub(crate) fn open_expecting(path: &Path, expected: FileIdentity) -> Result<Self> {
        let f = Self::open(path)?;
        if f.identity != expected {
            return Err(Error::BadCheckpoint {
                path: path.to_path_buf(),
                tensor: String::new(),
                fault: "the file at the path is not the one whose header was read (replaced or written since)".into(),
            });
        }
        Ok(f)
    }

    #[cfg(target_os = "linux")]
    fn open_direct(path: &Path) -> Option<File> {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).ok()
    }

    #[cfg(not(target_os = "linux"))]
    fn open_direct(_path: &Path) -> Option<File> {
        None
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its length when opened.
    pub fn len(&self) -> u64 {
        self.identity.len
    }

    /// Whether it was empty when opened.
    pub fn is_empty(&self) -> bool {
        self.identity.len == 0
    }

    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Bytes a destination must have for [`read_block`](Self::read_block) to read
    /// `len` bytes at any offset with `O_DIRECT` (the aligned range around them).
    pub fn span(len: usize) -> usize {
        len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN + DIRECT_ALIGN
    }

    /// Whether the file still holds the bytes it was opened with: the same file,
    /// length, modification and change times ([`FileIdentity`], of the open
    /// file). A file renamed over the path moves the old file's change time, so
    /// it is refused too, though the open handle would still read the old bytes.
    pub fn check(&self) -> Result<()> {
        self.identity.check_contents(&self.path, &self.buffered)
    }

    /// Read the `len` bytes at `offset` into the first `len` bytes of `dst`,
    /// which must hold at least `len` (and [`span`](Self::span)`(len)` with a
    /// [`DIRECT_ALIGN`]-aligned start for the read to bypass the page cache).
    /// `what` names the block for errors.
    pub fn read_block(&self, offset: u64, len: usize, dst: &mut [u8], what: &str) -> Result<()> {
        self.read_block_with(offset, len, dst, what, &|| ())
    }

    /// [`read_block`](Self::read_block), running `between` after the file is
    /// checked and before it is read (for tests: the file changed in that window).
    fn read_block_with(&self, offset: u64, len: usize, dst: &mut [u8], what: &str, between: &dyn Fn()) -> Result<()> {
        let fail = |fault: String| Error::DiskRead { path: self.path.clone(), block: what.to_owned(), offset, bytes: len, fault };
        if dst.len() < len {
            return Err(fail(format!("a {}-byte buffer for it", dst.len())));
        }
        self.check().map_err(|e| fail(e.to_string()))?;
        if offset.checked_add(len as u64).is_none_or(|end| end > self.identity.len) {
            return Err(fail(format!("past the end of the {}-byte file", self.identity.len)));
        }
        between();
        // A read that fails because the file was cut or written since the check
        // above says so (the cause), not only what the read saw.
        let fail = |fault: String| match self.check() {
            Err(changed) => fail(changed.to_string()),
            Ok(()) => fail(fault),
        };
        let a = DIRECT_ALIGN as u64;
        let start = offset / a * a;
        let lead = (offset - start) as usize;
        let n = (lead + len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let direct = match &self.direct {
            Some(direct) if dst.as_ptr() as usize % DIRECT_ALIGN == 0 && dst.len() >= n => {
                // The aligned range may run past the end of the file: a short read there is fine.
                let mut got = 0;
                let mut result = Ok(true);
                while got < lead + len {
                    match direct.read_at(&mut dst[got..n], start + got as u64) {
                        Ok(0) => return Err(fail(format!("the file ended {got} bytes into the read"))),
                        Ok(k) => got += k,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        // A file system that took O_DIRECT at open but refuses this read:
                        // read it through the page cache instead.
                        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                            result = Ok(false);
                            break;
                        }
                        Err(e) => result = Err(fail(e.to_string())),
                    }
                    if result.is_err() {
                        break;
                    }
                }
                result?
            }
            _ => false,
        };
        match direct {
            true => dst.copy_within(lead..lead + len, 0),
            false => self.buffered.read_exact_at(&mut dst[..len], offset).map_err(|e| fail(e.to_string()))?,
        }
        // Written while it was read: the bytes may be torn.
        self.check().map_err(|e| fail(e.to_string()))
    }
}

/// One read the disk stream can be asked for: a block's range of the file.
#[derive(Clone, Debug)]
pub(crate) struct Read {
    /// The block's position in the store.
    pub block: usize,
    /// Where its bytes start in the file.
    pub offset: u64,
    /// How many.
    pub len: usize,
    /// The block's name, for errors.
    pub name: String,
}

type Reply<B> = (Result<()>, HostBufferOf<B>);

struct Job<B: OffloadBackend> {
    read: Read,
    buffer: HostBufferOf<B>,
    reply: mpsc::Sender<Reply<B>>,
}

struct Pending<B: OffloadBackend> {
    block: usize,
    rx: mpsc::Receiver<Reply<B>>,
    /// The reply, once `is_ready` has received it.
    done: Option<Reply<B>>,
}

impl<B: OffloadBackend> Pending<B> {
    /// The read's reply, waiting for it if it has not come.
    fn wait(self) -> Result<Reply<B>> {
        match self.done {
            Some(r) => Ok(r),
            None => self.rx.recv().map_err(|_| Error::Protocol("disk tier: a reader thread died".into())),
        }
    }
}

/// A ring's reads from the disk tier: a few bounce buffers, reader threads, and
/// the reads in flight in the order they were asked for.
pub(crate) struct DiskStream<B: OffloadBackend> {
    free: Vec<HostBufferOf<B>>,
    pending: Vec<Pending<B>>,
    jobs: Option<mpsc::Sender<Job<B>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// How many there are.
    pub bounces: usize,
    /// Seconds the ring waited for reads since the last `take_waited` (the bytes
    /// read the ring counts itself, in the step that serves each block).
    waited_s: f64,
}

impl<B: OffloadBackend> DiskStream<B> {
    /// `count` bounce buffers of `bytes` each, `readers` reader threads over `file`.
    pub(crate) fn new(backend: &B, file: Arc<DiskFile>, count: usize, bytes: usize, readers: usize, component: &str) -> Result<Self> {
        let host = backend.host();
        let needs = |what: String| format!("{what}: the disk tier of {component} needs it");
        if !host.capabilities().refill {
            return Err(Error::unsupported(backend.name(), needs("refilling a host buffer (bounce buffers)".into())));
        }
        let mut free = Vec::with_capacity(count);
        for k in 0..count {
            let mut b = host.alloc_pinned(bytes, &format!("{component}/disk bounce buffer {k}"), &mut |_| Ok(()))?;
            if k == 0 {
                // Ask once, before any read: a buffer that cannot be refilled (coded,
                // say) fails here, by name.
                b.refill(&mut |_| Ok(())).map_err(|e| match e {
                    Error::Unsupported { what, .. } => Error::Unsupported { backend: backend.name().into(), what: needs(what) },
                    e => e,
                })?;
            }
            free.push(b);
        }
        let (tx, rx) = mpsc::channel::<Job<B>>();
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::new();
        for k in 0..readers.max(1) {
            let (rx, file) = (rx.clone(), file.clone());
            let t = std::thread::Builder::new()
                .name(format!("offload-disk-{k}"))
                .spawn(move || loop {
                    let job = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                    let Job { read, mut buffer, reply } = job;
                    let r = buffer.refill(&mut |dst| file.read_block(read.offset, read.len, dst, &read.name));
                    // The ring may have gone: the buffer is then dropped here.
                    let _ = reply.send((r, buffer));
                })
                .map_err(|e| Error::device(backend.name(), "starting a disk reader thread", e))?;
            threads.push(t);
        }
        Ok(DiskStream { free, pending: Vec::new(), jobs: Some(tx), threads, bounces: count, waited_s: 0.0 })
    }

    fn issue(&mut self, read: &Read) -> Result<()> {
        let buffer = self.free.pop().ok_or_else(|| Error::Protocol("disk tier: no free bounce buffer".into()))?;
        let (reply, rx) = mpsc::channel();
        let block = read.block;
        let jobs = self.jobs.as_ref().ok_or_else(|| Error::Protocol("disk tier: the readers are gone".into()))?;
        if let Err(mpsc::SendError(job)) = jobs.send(Job { read: read.clone(), buffer, reply }) {
            self.free.push(job.buffer);
            return Err(Error::Protocol("disk tier: the readers are gone".into()));
        }
        self.pending.push(Pending { block, rx, done: None });
        Ok(())
    }

    /// Wait for a read in flight (one not in `upcoming` where there is one, else
    /// the oldest) and keep its buffer; its result is dropped (a read no longer wanted).
    fn drop_oldest(&mut self, upcoming: &[Read]) -> Result<()> {
        if self.pending.is_empty() {
            return Err(Error::Protocol("disk tier: no bounce buffer is free and no read is in flight".into()));
        }
        // A read no longer predicted first, else the oldest.
        let at = self.pending.iter().position(|p| !upcoming.iter().any(|r| r.block == p.block)).unwrap_or(0);
        let p = self.pending.remove(at);
        let (_, buffer) = p.wait()?;
        self.free.push(buffer);
        Ok(())
    }

    /// Issue reads for `upcoming` (in order) while bounce buffers are free.
    pub(crate) fn top_up(&mut self, upcoming: &[Read]) -> Result<()> {
        for r in upcoming {
            if self.free.is_empty() {
                break;
            }
            if !self.pending.iter().any(|p| p.block == r.block) {
                self.issue(r)?;
            }
        }
        Ok(())
    }

    /// The bounce buffer holding `want`'s bytes, once read: issued now if it was
    /// not in flight (a read nobody needs any more gives up its buffer first), then
    /// reads for `upcoming` while buffers are free, then waited for on this
    /// thread. A failed read is an error naming the block; the block is not
    /// served. Give the buffer back with [`put_back`](Self::put_back) once its copy
    /// is issued. `stale` (a deliberate break, `Sabotage::StaleBounce`) serves the
    /// oldest read in flight instead, whichever block it is for.
    pub(crate) fn take(&mut self, want: &Read, upcoming: &[Read], stale: bool) -> Result<HostBufferOf<B>> {
        if !self.pending.iter().any(|p| p.block == want.block) {
            while self.free.is_empty() {
                self.drop_oldest(upcoming)?;
            }
            self.issue(want)?;
        }
        self.top_up(upcoming)?;
        let at = if stale { 0 } else { self.pending.iter().position(|p| p.block == want.block).expect("issued above") };
        let p = self.pending.remove(at);
        let t = Instant::now();
        let got = p.wait();
        self.waited_s += t.elapsed().as_secs_f64();
        let (r, buffer) = got?;
        if let Err(e) = r {
            self.free.push(buffer);
            return Err(e);
        }
        Ok(buffer)
    }

    /// Whether the read of block `block` is in flight and done (never blocks): the
    /// ring copies a prefetched block on disk only then, so the thread that
    /// computes never waits for a read it does not need yet.
    pub(crate) fn is_ready(&mut self, block: usize) -> bool {
        let Some(p) = self.pending.iter_mut().find(|p| p.block == block) else { return false };
        if p.done.is_some() {
            return true;
        }
        match p.rx.try_recv() {
            Ok(reply) => {
                p.done = Some(reply);
                true
            }
            Err(mpsc::TryRecvError::Empty) => false,
            // A reader died: `take` reports it.
            Err(mpsc::TryRecvError::Disconnected) => true,
        }
    }

    /// Return a bounce buffer after its copy was issued, and read ahead into it.
    pub(crate) fn put_back(&mut self, buffer: HostBufferOf<B>, upcoming: &[Read]) -> Result<()> {
        self.free.push(buffer);
        self.top_up(upcoming)
    }

    /// Seconds waited for reads since the last [`take_waited`](Self::take_waited).
    pub(crate) fn waited(&self) -> f64 {
        self.waited_s
    }

    /// Seconds waited for reads since the last call.
    pub(crate) fn take_waited(&mut self) -> f64 {
        std::mem::take(&mut self.waited_s)
    }
}

impl<B: OffloadBackend> Drop for DiskStream<B> {
    fn drop(&mut self) {
        // Let the readers finish what they hold, then stop them.
        self.jobs = None;
        for p in self.pending.drain(..) {
            let _ = p.wait();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A `len`-byte slice of `v` starting at a `DIRECT_ALIGN`-aligned address.
    fn aligned(v: &mut [u8], len: usize) -> &mut [u8] {
        let skip = (DIRECT_ALIGN - v.as_ptr() as usize % DIRECT_ALIGN) % DIRECT_ALIGN;
        &mut v[skip..skip + len]
    }

    #[test]
    fn reads_any_range_bit_for_bit_direct_or_not() {
        let dir = std::env::temp_dir().join(format!("offload-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let data: Vec<u8> = (0..3 * DIRECT_ALIGN as u32 + 777).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        std::fs::File::create(&path).unwrap().write_all(&data).unwrap();
        let f = DiskFile::open(&path).unwrap();
        assert_eq!(f.len(), data.len() as u64);
        for (offset, len) in [(0usize, 10usize), (1, 4096), (4095, 2), (5000, data.len() - 5000), (0, data.len()), (data.len() - 1, 1)] {
            let mut v = vec![0u8; DiskFile::span(len) + DIRECT_ALIGN];
            let dst = aligned(&mut v, DiskFile::span(len));
            f.read_block(offset as u64, len, dst, "b").unwrap();
            assert_eq!(&dst[..len], &data[offset..offset + len], "offset {offset} len {len} (direct {})", f.is_direct());
            // Unaligned and exactly sized: buffered.
            let mut w = vec![0u8; len + 1];
            f.read_block(offset as u64, len, &mut w[1..], "b").unwrap();
            assert_eq!(&w[1..], &data[offset..offset + len]);
        }
        // Past the end, a short buffer, a file written since: errors naming the block.
        let e = f.read_block(data.len() as u64 - 4, 8, &mut [0u8; 8], "blocks.7").unwrap_err().to_string();
        assert!(e.contains("blocks.7") && e.contains("past the end"), "{e}");
        assert!(f.read_block(0, 8, &mut [0u8; 4], "b").is_err());
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
        let e = f.read_block(0, 8, &mut [0u8; 8], "blocks.1").unwrap_err().to_string();
        assert!(e.contains("blocks.1") && e.contains("truncated"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_cut_between_the_check_and_the_read_is_named_truncated() {
        // The window a disk-stream thread can hit: the file was whole when checked
        // and cut before the read. The error says why the read came up short.
        let dir = std::env::temp_dir().join(format!("offload-disk-cut-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        let data: Vec<u8> = (0..4 * DIRECT_ALIGN as u32).map(|i| (i.wrapping_mul(2654435761) >> 11) as u8).collect();
        for direct_dst in [true, false] {
            std::fs::File::create(&path).unwrap().write_all(&data).unwrap();
            let f = DiskFile::open(&path).unwrap();
            let cut = || std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
            let len = 2 * DIRECT_ALIGN;
            let mut v = vec![0u8; DiskFile::span(len) + DIRECT_ALIGN];
            let dst = if direct_dst { aligned(&mut v, DiskFile::span(len)) } else { &mut v[1..len + 1] };
            let e = f.read_block_with(DIRECT_ALIGN as u64 + 8, len, dst, "blocks.3", &cut).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, Error::DiskRead { .. }), "{msg}");
            assert!(msg.contains("blocks.3") && msg.contains("truncated"), "direct destination {direct_dst}: {msg}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
