//! The simulated backend: a device made of host memory, with a copy stream on a
//! worker thread whose copies finish after random delays. It poisons released
//! and in-flight slots and records a violation whenever the protocol is broken:
//!
//! - a slot read by compute before compute waited for the copy that filled it
//!   (invariant 1, "ready before read");
//! - a copy into, or release of, a slot not ordered after its last read
//!   (invariant 2, "free after last use");
//! - device memory beyond a configured capacity (invariant 5), reported as an
//!   out-of-memory error.
//!
//! Compute is the calling thread: [`SimBackend::read_slot`] is a kernel reading
//! a slot, [`OffloadBackend::compute_wait`] blocks the caller until the copy is
//! done (so the simulated compute stream really waits).

use crate::backend::{MemoryInfo, OffloadBackend, StreamKind};
use crate::error::{Error, Result};
use crate::host::{Fill, HostBuffer, HostCapabilities, HostKind, HostMemory};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Byte written into released slots and slots with a copy in flight.
pub const POISON: u8 = 0xDB;

/// How the simulated device behaves.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Each copy finishes after a random delay in `0..=max_copy_delay_us`.
    pub max_copy_delay_us: u64,
    /// Seed of the delay generator.
    pub seed: u64,
    /// Device capacity in bytes; allocation beyond it is out of memory.
    pub device_bytes: u64,
    /// Fail the n-th slot allocation (0-based), for transactional tests.
    pub fail_alloc_at: Option<u64>,
    /// Page-locked host memory available; `alloc_host` beyond it fails.
    pub pinned_host_bytes: Option<u64>,
    /// Every `alloc_host` holds its block coded for the device (as
    /// `alloc_host_coded` does), and copies decode it on the copy thread.
    pub coded: bool,
    /// Whether the device decodes coded blocks at all: `false` simulates one that
    /// cannot (`alloc_host_coded` is then unsupported).
    pub decodes: bool,
    /// Whether `host_in_region` works: the simulator "registers" a region by
    /// reading the block's range into its own memory with
    /// [`HostRegion::read_at`](crate::source::HostRegion::read_at) (it has no device to
    /// register with; what it tests is the store's choices and the protocol).
    /// `false` simulates a device that cannot register host memory.
    pub registers_regions: bool,
    /// Whether `refill_host` waits for every copy from the buffer to land before
    /// it writes the buffer again (the trait's contract). `false` is a deliberate
    /// break: a refill that finds a copy in flight is then a protocol violation
    /// (the simulator writes the new bytes beside the old ones, so the copy
    /// still lands what it was issued with, but the log says what a device
    /// would have torn).
    pub refill_waits: bool,
    /// Whether [`HostKind::Pinned`] buffers count as page-locked (within
    /// `pinned_host_bytes`). `false` for a device that is host memory itself
    /// (candle's CPU device): its buffers are ordinary memory, pinned nowhere.
    pub page_locked: bool,
    /// Device staging buffers a coded copy goes through, as offload-cuda's
    /// decode engine holds them: each [`staging_buffer_bytes`](crate::codec::staging_buffer_bytes)
    /// of the largest coded block copied so far, counted in the device's live
    /// bytes from the first coded copy on (and never freed). 0 (the default): the
    /// simulated device decodes straight into the slot.
    pub staging_buffers: usize,
    /// The link's rate: each copy takes its bytes over this many bytes per
    /// second on the copy thread (beside the random delay), twice that while
    /// [`SimBackend::share_link`] says something else uses the link. `None`:
    /// copies take no modelled time.
    pub link_bytes_per_s: Option<f64>,
}

/// Raw bytes per segment of the simulated device's coded blocks.
pub const SIM_SEGMENT_BYTES: usize = 64 << 10;

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            max_copy_delay_us: 200,
            seed: 0x00ff_10ad,
            device_bytes: 1 << 40,
            fail_alloc_at: None,
            pinned_host_bytes: None,
            coded: false,
            decodes: true,
            registers_regions: true,
            refill_waits: true,
            page_locked: true,
            staging_buffers: 0,
            link_bytes_per_s: None,
        }
    }
}

impl SimConfig {
    /// No delays: copies still run on the worker thread, as fast as memcpy.
    pub fn fast() -> Self {
        SimConfig { max_copy_delay_us: 0, ..Default::default() }
    }
}

/// Counters of the simulated device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Device bytes allocated now.
    pub live_bytes: u64,
    /// Peak of `live_bytes`.
    pub peak_bytes: u64,
    /// Slots allocated now.
    pub live_slots: u64,
    /// Host-to-device copies.
    pub copies: u64,
    /// Bytes copied host to device.
    pub bytes_copied: u64,
    /// Host synchronisations (`synchronize` calls).
    pub syncs: u64,
    /// Protocol violations seen, in order.
    pub violations: Vec<String>,
    /// "Page-locked" host bytes held now: given back as a buffer drops (a mapped
    /// region, registered on first use, stays counted while the simulator lives).
    pub pinned_bytes: u64,
    /// Copies of coded blocks (decoded on the copy thread).
    pub coded_copies: u64,
}

/// Host memory standing in for a pinned (or, as a fallback, pageable) buffer:
/// the block's bytes, whether pinned, and the block coded for the device where
/// it is held coded (what a copy then moves and decodes; the simulator keeps the
/// raw bytes too, for `host_bytes`).
pub struct SimHostBuffer {
    raw: Arc<[u8]>,
    pinned: bool,
    coded: Option<Arc<[u8]>>,
    /// The region a buffer "registered" in place stands for: `block_bytes`
    /// checks it, as a device's buffer served from a mapping reads the file.
    region: Option<Arc<dyn crate::source::HostRegion>>,
    /// The simulator it came from (refills wait, or report, there).
    sim: Arc<Inner>,
    /// The page-locked bytes this buffer holds in the simulator's count, given
    /// back when it drops (a region's registration is counted once, and kept).
    counted: u64,
}

impl Drop for SimHostBuffer {
    fn drop(&mut self) {
        if self.counted > 0 {
            lock(&self.sim.state).stats.pinned_bytes -= self.counted;
        }
    }
}

/// A slot of simulated device memory.
pub struct SimSlot {
    id: u64,
    bytes: usize,
    mem: Arc<Mutex<Vec<u8>>>,
}

/// An event on the simulated copy or compute stream.
#[derive(Clone)]
pub struct SimEvent(Arc<EventInner>);

struct EventInner {
    tick: u64,
    /// For a copy event, the slot it fills.
    slot: Option<u64>,
    done: Mutex<bool>,
    at: Mutex<Option<Instant>>,
    cv: Condvar,
}

impl SimEvent {
    fn new(tick: u64, slot: Option<u64>, done: bool) -> Self {
        let at = Mutex::new(done.then(Instant::now));
        SimEvent(Arc::new(EventInner { tick, slot, done: Mutex::new(done), at, cv: Condvar::new() }))
    }
    fn set(&self) {
        *lock(&self.0.at) = Some(Instant::now());
        let mut d = lock(&self.0.done);
        *d = true;
        self.0.cv.notify_all();
    }
    fn completed_at(&self) -> Option<Instant> {
        self.wait();
        *lock(&self.0.at)
    }
    fn wait(&self) {
        let mut d = lock(&self.0.done);
        while !*d {
            d = self.0.cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }
    /// Whether the event has completed.
    pub fn is_done(&self) -> bool {
        *lock(&self.0.done)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Default)]
struct SlotInfo {
    bytes: u64,
    last_copy_tick: Option<u64>,
    waited_tick: u64,
    last_read_tick: Option<u64>,
}

#[derive(Default)]
struct State {
    tick: u64,
    next_slot: u64,
    allocs: u64,
    sync_tick: u64,
    slots: HashMap<u64, SlotInfo>,
    stats: SimStats,
    /// Regions "registered" (by address), and the regions themselves, kept so
    /// no address is reused while the simulator lives.
    registered: Vec<usize>,
    keep: Vec<Arc<dyn crate::source::HostRegion>>,
    /// Device bytes the staging buffers hold (see [`SimConfig::staging_buffers`]).
    staging_bytes: u64,
}

struct Pending {
    count: Mutex<u64>,
    cv: Condvar,
}

struct Job {
    after: Option<SimEvent>,
    /// The raw bytes, or the coded block to decode (`coded`).
    src: Arc<[u8]>,
    coded: bool,
    dst: Arc<Mutex<Vec<u8>>>,
    bytes: usize,
    delay_us: u64,
    done: SimEvent,
}

struct Inner {
    cfg: SimConfig,
    /// Until when another transfer shares the link ([`SimBackend::share_link`]).
    shared_until: Arc<Mutex<Option<Instant>>>,
    state: Mutex<State>,
    pending: Arc<Pending>,
    tx: Mutex<Sender<Job>>,
    rng: Mutex<rand::rngs::StdRng>,
}

/// The simulated backend. Cheap to clone (an `Arc`).
#[derive(Clone)]
pub struct SimBackend {
    inner: Arc<Inner>,
}

impl SimBackend {
    /// "Page-locked" host memory of `bytes`, filled by `fill` (within the
    /// configured pinned capacity).
    /// Ordinary memory: not page-locked, not counted.
    fn alloc_ordinary(&self, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<SimHostBuffer> {
        let mut v = crate::host::zeroed("sim", bytes, purpose)?;
        fill(&mut v)?;
        Ok(SimHostBuffer { raw: v.into(), pinned: false, coded: None, region: None, sim: self.inner.clone(), counted: 0 })
    }

    fn alloc_locked(&self, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<SimHostBuffer> {
        if !self.inner.cfg.page_locked {
            return self.alloc_ordinary(bytes, purpose, fill);
        }
        {
            let mut st = lock(&self.inner.state);
            if let Some(cap) = self.inner.cfg.pinned_host_bytes {
                let free = cap.saturating_sub(st.stats.pinned_bytes);
                if bytes as u64 > free {
                    return Err(Error::HostAlloc {
                        backend: "sim".into(),
                        requested: bytes as u64,
                        purpose: purpose.into(),
                        reason: format!("page-locked memory exhausted ({free} bytes left)"),
                    });
                }
            }
            st.stats.pinned_bytes += bytes as u64;
        }
        let filled = crate::host::zeroed("sim", bytes, purpose).and_then(|mut v| fill(&mut v).map(|()| v));
        let v = match filled {
            Ok(v) => v,
            Err(e) => {
                lock(&self.inner.state).stats.pinned_bytes -= bytes as u64;
                return Err(e);
            }
        };
        Ok(SimHostBuffer { raw: v.into(), pinned: true, coded: None, region: None, sim: self.inner.clone(), counted: bytes as u64 })
    }

    /// A simulated device with `cfg`.
    pub fn new(cfg: SimConfig) -> Self {
        let (tx, rx) = channel::<Job>();
        let pending = Arc::new(Pending { count: Mutex::new(0), cv: Condvar::new() });
        let p = pending.clone();
        let shared_until: Arc<Mutex<Option<Instant>>> = Arc::default();
        let (shared, rate) = (shared_until.clone(), cfg.link_bytes_per_s.filter(|r| *r > 0.0));
        std::thread::Builder::new()
            .name("offload-sim-copy".into())
            .spawn(move || {
                for job in rx {
                    if let Some(a) = &job.after {
                        a.wait();
                    }
                    if job.delay_us > 0 {
                        std::thread::sleep(Duration::from_micros(job.delay_us));
                    }
                    if let (Some(rate), true) = (rate, job.bytes > 0) {
                        let shared = lock(&shared).is_some_and(|until| Instant::now() < until);
                        let secs = job.bytes as f64 / rate * if shared { 2.0 } else { 1.0 };
                        std::thread::sleep(Duration::from_secs_f64(secs));
                    }
                    let mut dst = lock(&job.dst);
                    match job.coded {
                        false => dst[..job.bytes].copy_from_slice(&job.src[..job.bytes]),
                        // The device's decode: a block that does not decode leaves poison.
                        true => {
                            if let Err(e) = crate::codec::decode_device_block(&job.src, &mut dst[..job.bytes], "a simulated coded copy") {
                                tracing::error!("{e}");
                                dst[..job.bytes].fill(POISON);
                            }
                        }
                    }
                    drop(dst);
                    job.done.set();
                    let mut c = lock(&p.count);
                    *c -= 1;
                    p.cv.notify_all();
                }
            })
            .map(drop)
            .unwrap_or_else(|e| tracing::error!("cannot start the simulated copy thread: {e}"));
        let rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
        SimBackend {
            inner: Arc::new(Inner { cfg, shared_until, state: Mutex::default(), pending, tx: Mutex::new(tx), rng: Mutex::new(rng) }),
        }
    }

    /// A simulated device with the default configuration.
    pub fn default_device() -> Self {
        Self::new(SimConfig::default())
    }

    /// Another transfer shares the link for `dur` from now (a model's own
    /// host-to-device copies): the copies that run meanwhile take twice their
    /// time (with [`SimConfig::link_bytes_per_s`]).
    pub fn share_link(&self, dur: Duration) {
        *lock(&self.inner.shared_until) = Some(Instant::now() + dur);
    }

    /// Counters so far.
    pub fn stats(&self) -> SimStats {
        lock(&self.inner.state).stats.clone()
    }

    /// Reset the peak-memory and traffic counters (not the violations).
    pub fn reset_counters(&self) {
        let mut st = lock(&self.inner.state);
        st.stats.peak_bytes = st.stats.live_bytes;
        st.stats.copies = 0;
        st.stats.bytes_copied = 0;
        st.stats.coded_copies = 0;
        st.stats.syncs = 0;
    }

    /// `Ok` if no violation was seen, else the first ones.
    pub fn check(&self) -> Result<()> {
        let v = &lock(&self.inner.state).stats.violations;
        if v.is_empty() {
            Ok(())
        } else {
            Err(Error::Protocol(format!("{} violation(s); first: {}", v.len(), v[..v.len().min(3)].join("; "))))
        }
    }

    fn violate(st: &mut State, what: String) {
        tracing::error!("simulated device: {what}");
        st.stats.violations.push(what);
    }

    fn covered(st: &State, info: &SlotInfo, after: Option<&SimEvent>) -> bool {
        match info.last_read_tick {
            None => true,
            Some(r) => st.sync_tick > r || after.is_some_and(|a| a.0.slot.is_none() && a.0.tick > r),
        }
    }

    /// Run `kernel` over the bytes of `slot`, as a compute kernel would read it.
    /// Records a violation if compute did not wait for the copy that filled it.
    pub fn read_slot<R>(&self, slot: &SimSlot, kernel: impl FnOnce(&[u8]) -> R) -> R {
        {
            let mut st = lock(&self.inner.state);
            st.tick += 1;
            let tick = st.tick;
            let Some(info) = st.slots.get_mut(&slot.id) else {
                Self::violate(&mut st, format!("slot {} read after release", slot.id));
                return kernel(&lock(&slot.mem)[..slot.bytes]);
            };
            info.last_read_tick = Some(tick);
            let ok = info.last_copy_tick.is_none_or(|c| info.waited_tick >= c);
            if !ok {
                let id = slot.id;
                Self::violate(&mut st, format!("slot {id} read before compute waited for its copy (invariant 1)"));
            }
        }
        kernel(&lock(&slot.mem)[..slot.bytes])
    }

    /// Bytes of a slot, as a test would inspect them (not a weight copy-back:
    /// it does not count as a read by compute).
    pub fn peek_slot(&self, slot: &SimSlot) -> Vec<u8> {
        lock(&slot.mem).clone()
    }
}

impl HostBuffer for SimHostBuffer {
    fn is_pinned(&self) -> bool {
        self.pinned
    }

    fn held_bytes(&self) -> Option<usize> {
        self.coded.as_ref().map(|coded| coded.len())
    }

    fn block_bytes(&self) -> Result<&[u8]> {
        // Served in place: the opened file must still hold what the buffer was
        // made from (its path may name another file since).
        if let Some(region) = &self.region {
            region.held()?;
        }
        Ok(&self.raw)
    }

    fn refill(&mut self, fill: Fill<'_>) -> Result<()> {
        if self.coded.is_some() {
            return Err(Error::unsupported("sim", "refilling a coded host buffer"));
        }
        // A copy in flight holds the bytes (an `Arc`) until it has landed: wait for
        // every one, as a device's refill must, then write the buffer in place.
        if self.sim.cfg.refill_waits {
            while Arc::strong_count(&self.raw) > 1 {
                std::thread::sleep(Duration::from_micros(20));
            }
        } else if Arc::strong_count(&self.raw) > 1 {
            let mut st = lock(&self.sim.state);
            SimBackend::violate(&mut st, "a host buffer refilled while a copy from it was in flight (invariant 2, the disk tier)".into());
        }
        match Arc::get_mut(&mut self.raw) {
            Some(bytes) => fill(bytes),
            // Only without the wait: the in-flight copy keeps the old bytes.
            None => {
                let mut v = vec![0u8; self.raw.len()];
                fill(&mut v)?;
                self.raw = v.into();
                Ok(())
            }
        }
    }
}

impl SimBackend {
    fn alloc_coded(&self, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<SimHostBuffer> {
        let mut host = self.alloc_locked(bytes, purpose, fill)?;
        // The simulated device decodes with the CPU reference, which reads every code.
        let codes = crate::codec::DeviceCodes { fp8_e4m3: true };
        let coded = crate::codec::code_for_device_with(&host.raw, SIM_SEGMENT_BYTES, 2, codes);
        if coded.len() >= bytes {
            // Coding does not shrink this block (dense bytes: GGUF blocks, random
            // data): held raw, so a coded store never sends more than the raw bytes.
            return Ok(host);
        }
        // The page-locked bytes are the coded ones (the raw copy is the simulator's own).
        if host.pinned {
            let mut st = lock(&self.inner.state);
            st.stats.pinned_bytes = st.stats.pinned_bytes - host.counted + coded.len() as u64;
            host.counted = coded.len() as u64;
        }
        // On an error the buffer drops, and gives its count back.
        crate::codec::device_segments(&coded, purpose)?;
        host.coded = Some(coded.into());
        Ok(host)
    }

    fn alloc_precoded(&self, bytes: usize, coded_len: usize, purpose: &str, fill: Fill<'_>) -> Result<SimHostBuffer> {
        // The coded bytes are what is page-locked; the raw ones (the simulator's
        // own, for `block_bytes`) are decoded from them on the host.
        let mut host = self.alloc_locked(coded_len, purpose, fill)?;
        let coded = host.raw.clone();
        let structure = crate::codec::device_segments(&coded, purpose).and_then(|(len, _)| match len == bytes {
            true => Ok(()),
            false => Err(Error::BadTensor { tensor: purpose.into(), fault: format!("coded from {len} bytes, {bytes} expected") }),
        });
        let mut raw = vec![0u8; bytes];
        if let Err(e) = structure.and_then(|()| crate::codec::decode_device_block(&coded, &mut raw, purpose)) {
            // Under the store's deliberate break (`Sabotage::TrustCodedFile`) the
            // simulator holds the coded bytes as a device does, unchecked (a device
            // decodes at copy time and checks nothing): the case's own check sees
            // the forged file built, not this decode's refusal.
            if !crate::sabotage::trusts_coded() {
                // The buffer drops here, and gives its count back.
                return Err(e);
            }
        }
        host.raw = raw.into();
        host.coded = Some(coded);
        Ok(host)
    }

    fn in_region(&self, region: &Arc<dyn crate::source::HostRegion>, offset: usize, bytes: usize, purpose: &str) -> Result<SimHostBuffer> {
        region.check()?;
        // "Registered" as a device registers it: the whole region page-locked on
        // first use, counted once (`HostRegion::registered_len`); the block's own
        // bytes are then not counted again.
        {
            let mut st = lock(&self.inner.state);
            let key = Arc::as_ptr(region) as *const u8 as usize;
            if self.inner.cfg.page_locked && !st.registered.contains(&key) {
                let n = region.registered_len() as u64;
                if let Some(cap) = self.inner.cfg.pinned_host_bytes {
                    let free = cap.saturating_sub(st.stats.pinned_bytes);
                    if n > free {
                        return Err(Error::HostAlloc {
                            backend: "sim".into(),
                            requested: n,
                            purpose: purpose.into(),
                            reason: format!("registering {}: page-locked memory exhausted ({free} bytes left)", region.origin()),
                        });
                    }
                }
                st.registered.push(key);
                // Kept registered while the simulator lives (it does not track frees).
                st.keep.push(region.clone());
                st.stats.pinned_bytes += n;
            }
        }
        let mut v = vec![0u8; bytes];
        region.read_at(offset, &mut v)?;
        Ok(SimHostBuffer {
            raw: v.into(),
            pinned: self.inner.cfg.page_locked,
            coded: None,
            region: Some(region.clone()),
            sim: self.inner.clone(),
            counted: 0,
        })
    }
}

/// The simulator is its own host memory: page-locked buffers within
/// [`SimConfig::pinned_host_bytes`], pageable ones, coded ones where
/// [`SimConfig::decodes`], mapped regions where [`SimConfig::registers_regions`].
impl HostMemory for SimBackend {
    type Buffer = SimHostBuffer;

    fn capabilities(&self) -> HostCapabilities {
        let cfg = &self.inner.cfg;
        HostCapabilities {
            pinned: cfg.page_locked,
            pageable: true,
            coded: cfg.decodes,
            mapped: cfg.registers_regions && !cfg.coded,
            refill: !cfg.coded,
        }
    }

    fn decoder_staging_bytes(&self, largest_coded: usize) -> u64 {
        crate::codec::staging_bytes(self.inner.cfg.staging_buffers, largest_coded as u64)
    }

    fn alloc(&self, kind: HostKind<'_>, bytes: usize, purpose: &str, fill: Fill<'_>) -> Result<SimHostBuffer> {
        let cfg = &self.inner.cfg;
        match kind {
            HostKind::Pinned if cfg.coded => self.alloc(HostKind::Coded, bytes, purpose, fill),
            HostKind::Pinned => self.alloc_locked(bytes, purpose, fill),
            HostKind::Pageable => self.alloc_ordinary(bytes, purpose, fill),
            HostKind::Coded | HostKind::Precoded { .. } if !cfg.decodes => {
                Err(Error::unsupported("sim", format!("a device without a decoder (for {purpose})")))
            }
            HostKind::Coded => self.alloc_coded(bytes, purpose, fill),
            HostKind::Precoded { coded_len } => self.alloc_precoded(bytes, coded_len, purpose, fill),
            HostKind::Mapped { .. } if !cfg.registers_regions => {
                Err(Error::unsupported("sim", format!("registering host memory (for {purpose})")))
            }
            HostKind::Mapped { .. } if cfg.coded => {
                Err(Error::unsupported("sim", format!("blocks served in place while every block is coded (for {purpose})")))
            }
            HostKind::Mapped { region, offset } => self.in_region(region, offset, bytes, purpose),
        }
    }
}

impl OffloadBackend for SimBackend {
    type Host = SimBackend;
    type Slot = SimSlot;
    type Event = SimEvent;
    type Wait = ();

    fn name(&self) -> &'static str {
        "sim"
    }

    fn compute_on_host(&self) -> bool {
        true
    }

    fn host(&self) -> SimBackend {
        self.clone()
    }

    fn alloc_slot(&self, bytes: usize, purpose: &str) -> Result<SimSlot> {
        let mut st = lock(&self.inner.state);
        let n = st.allocs;
        st.allocs += 1;
        if self.inner.cfg.fail_alloc_at == Some(n) {
            return Err(Error::Injected(format!("allocation {n} ({bytes} bytes for {purpose})")));
        }
        let free = self.inner.cfg.device_bytes.saturating_sub(st.stats.live_bytes);
        if bytes as u64 > free {
            return Err(Error::OutOfDeviceMemory { backend: "sim".into(), requested: bytes as u64, free, purpose: purpose.into() });
        }
        let id = st.next_slot;
        st.next_slot += 1;
        st.slots.insert(id, SlotInfo { bytes: bytes as u64, ..Default::default() });
        st.stats.live_bytes += bytes as u64;
        st.stats.live_slots += 1;
        st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.live_bytes);
        Ok(SimSlot { id, bytes, mem: Arc::new(Mutex::new(vec![POISON; bytes])) })
    }

    fn free_slot(&self, slot: SimSlot, after: Option<&SimEvent>) -> Result<()> {
        let mut st = lock(&self.inner.state);
        let Some(info) = st.slots.remove(&slot.id) else {
            return Err(Error::Protocol(format!("slot {} released twice", slot.id)));
        };
        if !Self::covered(&st, &info, after) {
            Self::violate(&mut st, format!("slot {} released before its last use (invariant 2)", slot.id));
        }
        st.stats.live_bytes -= info.bytes;
        st.stats.live_slots -= 1;
        drop(st);
        // The copy thread may still hold the memory; poison what it leaves.
        lock(&slot.mem).fill(POISON);
        Ok(())
    }

    fn copy_to_slot(&self, src: &SimHostBuffer, dst: &mut SimSlot, bytes: usize, after: Option<&SimEvent>) -> Result<SimEvent> {
        if bytes > src.raw.len() || bytes > dst.bytes {
            return Err(Error::Protocol(format!(
                "copy of {bytes} bytes from a {}-byte buffer into a {}-byte slot",
                src.raw.len(),
                dst.bytes
            )));
        }
        let done = {
            let mut st = lock(&self.inner.state);
            if let Some(coded) = &src.coded {
                // The staging buffers grow to the largest coded block, as the decode engine's do.
                let want = self.decoder_staging_bytes(coded.len());
                if want > st.staging_bytes {
                    let (grow, free) = (want - st.staging_bytes, self.inner.cfg.device_bytes.saturating_sub(st.stats.live_bytes));
                    if grow > free {
                        let purpose = "the decoder's staging buffers".to_string();
                        return Err(Error::OutOfDeviceMemory { backend: "sim".into(), requested: grow, free, purpose });
                    }
                    st.staging_bytes = want;
                    st.stats.live_bytes += grow;
                    st.stats.peak_bytes = st.stats.peak_bytes.max(st.stats.live_bytes);
                }
            }
            st.tick += 1;
            let tick = st.tick;
            let Some(info) = st.slots.get(&dst.id) else {
                return Err(Error::Protocol(format!("copy into released slot {}", dst.id)));
            };
            if !Self::covered(&st, info, after) {
                let id = dst.id;
                Self::violate(&mut st, format!("slot {id} overwritten before its last use (invariant 2)"));
            }
            if let Some(info) = st.slots.get_mut(&dst.id) {
                info.last_copy_tick = Some(tick);
                info.last_read_tick = None;
            }
            st.stats.copies += 1;
            st.stats.bytes_copied += src.coded.as_ref().map_or(bytes, |c| c.len()) as u64;
            st.stats.coded_copies += u64::from(src.coded.is_some());
            SimEvent::new(tick, Some(dst.id), false)
        };
        let delay_us = match self.inner.cfg.max_copy_delay_us {
            0 => 0,
            m => lock(&self.inner.rng).gen_range(0..=m),
        };
        // Until the copy lands the slot holds garbage: poison it now so an early
        // read sees poison, not the previous block's bytes.
        if after.is_none_or(|a| a.is_done()) {
            lock(&dst.mem)[..bytes].fill(POISON);
        }
        *lock(&self.inner.pending.count) += 1;
        let (from, coded) = match &src.coded {
            Some(c) => (c.clone(), true),
            None => (src.raw.clone(), false),
        };
        let job = Job { after: after.cloned(), src: from, coded, dst: dst.mem.clone(), bytes, delay_us, done: done.clone() };
        lock(&self.inner.tx).send(job).map_err(|_| Error::device("sim", "copy", "the copy thread is gone"))?;
        Ok(done)
    }

    fn compute_wait(&self, event: &SimEvent) -> Result<()> {
        event.wait();
        if let Some(slot) = event.0.slot {
            let mut st = lock(&self.inner.state);
            if let Some(info) = st.slots.get_mut(&slot) {
                info.waited_tick = info.waited_tick.max(event.0.tick);
            }
        }
        Ok(())
    }

    fn record_compute(&self) -> Result<SimEvent> {
        let mut st = lock(&self.inner.state);
        st.tick += 1;
        Ok(SimEvent::new(st.tick, None, true))
    }

    fn synchronize(&self) -> Result<()> {
        let p = &self.inner.pending;
        let mut c = lock(&p.count);
        while *c > 0 {
            c = p.cv.wait(c).unwrap_or_else(|e| e.into_inner());
        }
        drop(c);
        let mut st = lock(&self.inner.state);
        st.tick += 1;
        st.sync_tick = st.tick;
        st.stats.syncs += 1;
        Ok(())
    }

    fn record_timing(&self, on: StreamKind) -> Result<Option<SimEvent>> {
        let tick = {
            let mut st = lock(&self.inner.state);
            st.tick += 1;
            st.tick
        };
        match on {
            // Compute is the calling thread: the event completes now.
            StreamKind::Compute => Ok(Some(SimEvent::new(tick, None, true))),
            // On the copy stream: a marker the copy thread completes in order.
            StreamKind::Copy => {
                let done = SimEvent::new(tick, None, false);
                *lock(&self.inner.pending.count) += 1;
                let job = Job {
                    after: None,
                    src: Arc::from(Vec::new()),
                    coded: false,
                    dst: Arc::new(Mutex::new(Vec::new())),
                    bytes: 0,
                    delay_us: 0,
                    done: done.clone(),
                };
                lock(&self.inner.tx).send(job).map_err(|_| Error::device("sim", "timing", "the copy thread is gone"))?;
                Ok(Some(done))
            }
        }
    }

    fn elapsed_s(&self, from: &SimEvent, to: &SimEvent) -> Result<Option<f64>> {
        Ok(match (from.completed_at(), to.completed_at()) {
            (Some(a), Some(b)) => Some(b.saturating_duration_since(a).as_secs_f64()),
            _ => None,
        })
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        let st = lock(&self.inner.state);
        Ok(MemoryInfo { free: self.inner.cfg.device_bytes - st.stats.live_bytes, total: self.inner.cfg.device_bytes })
    }
}
