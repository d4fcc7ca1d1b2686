//! The cost model: per block bytes and compute time, and host-to-device bandwidth.
//! It predicts the step time of a plan by replaying the ring's schedule.

use offload_core::{BlockLayout, ComponentInventory, Result};
use serde::{Deserialize, Serialize};

/// One block's cost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockCost {
    /// `"<stack>.<index>"`.
    pub id: String,
    /// Bytes streamed when the block is not resident.
    pub bytes: u64,
    /// Compute time of the block's forward, seconds.
    pub compute_s: f64,
    /// Compute time of the block's backward, seconds, where the step trains
    /// (the backward brings every streamed block again, in reverse order);
    /// `None`: the step is a forward alone. Every block has one, or none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_s: Option<f64>,
    /// The block held coded for the device, where measured (`None`: the block
    /// is never planned coded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coded: Option<CodedCost>,
    /// How long before the device reached the block (the end of the block
    /// before it, or of the step's gap) the host asked for it, seconds, as a
    /// traced step measured it (`None`: early enough never to matter, the
    /// replay's assumption where nothing was measured). The ring issues a
    /// block's copy when the block `depth` before it is asked for, so a block
    /// asked for late (the first of a step whose forward synchronises the host
    /// before it) holds back the copies issued with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask_lead_s: Option<f64>,
}

/// What a block costs held coded for the device: both measured together.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CodedCost {
    /// Bytes streamed.
    pub bytes: u64,
    /// Seconds the device takes to decode it (on a stream of its own, after the
    /// copy, before the compute).
    pub decode_s: f64,
}

impl BlockCost {
    /// A block of `bytes` computing for `compute_s`, with no coded form known.
    pub fn new(id: impl Into<String>, bytes: u64, compute_s: f64) -> Self {
        BlockCost { id: id.into(), bytes, compute_s, backward_s: None, coded: None, ask_lead_s: None }
    }

    /// The same block with a backward computing for `backward_s`.
    pub fn with_backward(mut self, backward_s: f64) -> Self {
        self.backward_s = Some(backward_s);
        self
    }
}

/// Calibration: what a short pass through a backend measured. Save it as JSON and
/// reload it to plan without the device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Pinned host-to-device bandwidth, bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Blocks in ring order (the order they run in a step).
    pub blocks: Vec<BlockCost>,
    /// Resident non-block bytes.
    #[serde(default)]
    pub non_block_bytes: u64,
    /// Where the numbers come from (device name, date), free text.
    #[serde(default)]
    pub source: String,
    /// Staging buffers a coded plan's decode engine holds (offload-cuda's
    /// `CodingOptions::staging_buffers`; [`DEFAULT_STAGING_BUFFERS`] when a
    /// calibration does not say): what [`staging_bytes`](Self::staging_bytes) counts.
    #[serde(default = "default_staging_buffers")]
    pub staging_buffers: usize,
    /// Device time between one step's last block and the next step's first,
    /// seconds: the model's own work outside its blocks (embeddings, a host
    /// synchronisation, the output's projection), measured between two traced
    /// steps (0 where not measured). The replay puts it before each step's
    /// first block; copies already issued run through it, and none is issued
    /// in it.
    #[serde(default)]
    pub step_gap_s: f64,
}

/// Whether block `i` is resident under `resident` (a block past its end is streamed).
fn held(resident: &[bool], i: usize) -> bool {
    resident.get(i).copied().unwrap_or(false)
}

/// The decode engine's staging buffers by default (offload-cuda's `STAGING_BUFFERS`).
pub const DEFAULT_STAGING_BUFFERS: usize = 2;

fn default_staging_buffers() -> usize {
    DEFAULT_STAGING_BUFFERS
}

impl CostModel {
    /// A model from an inventory's block sizes, with no compute time known
    /// (predictions are then pure transfer times) at `bandwidth_bytes_per_s`.
    pub fn from_inventory(inventory: &ComponentInventory, bandwidth_bytes_per_s: f64) -> Result<Self> {
        let blocks = inventory
            .blocks()
            .map(|b| Ok(BlockCost::new(b.id.to_string(), BlockLayout::new(b.tensors.clone())?.bytes as u64, 0.0)))
            .collect::<Result<_>>()?;
        let non_block_bytes = BlockLayout::new(inventory.non_block.clone())?.bytes as u64;
        Ok(CostModel {
            bandwidth_bytes_per_s,
            blocks,
            non_block_bytes,
            source: "block sizes only".into(),
            staging_buffers: DEFAULT_STAGING_BUFFERS,
            step_gap_s: 0.0,
        })
    }

    /// Read a calibration saved with [`to_json`](Self::to_json), refused where
    /// [`validate`](Self::validate) refuses it.
    pub fn from_json(text: &str) -> std::result::Result<Self, serde_json::Error> {
        let model: CostModel = serde_json::from_str(text)?;
        model.validate().map_err(<serde_json::Error as serde::de::Error>::custom)?;
        Ok(model)
    }

    /// An error naming the first number no replay can use: a bandwidth that is
    /// not finite and positive (0 would make every streamed step infinite and the
    /// planner's comparisons NaN), a compute or decode time that is not finite and
    /// at least 0, a block named twice, or staging buffers outside 1 ..= 64.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| offload_core::Error::Plan(format!("cost model ({}): {what}", self.source));
        if !(self.bandwidth_bytes_per_s.is_finite() && self.bandwidth_bytes_per_s > 0.0) {
            return Err(bad(format!("bandwidth {} bytes/s: a finite, positive rate", self.bandwidth_bytes_per_s)));
        }
        if !(self.step_gap_s.is_finite() && self.step_gap_s >= 0.0) {
            return Err(bad(format!("step gap {} s: finite and at least 0", self.step_gap_s)));
        }
        if !(1..=64).contains(&self.staging_buffers) {
            return Err(bad(format!("{} staging buffers: 1 to 64", self.staging_buffers)));
        }
        let mut seen = std::collections::HashSet::new();
        for b in &self.blocks {
            if !(b.compute_s.is_finite() && b.compute_s >= 0.0) {
                return Err(bad(format!("block {}: compute time {} s", b.id, b.compute_s)));
            }
            if let Some(t) = b.backward_s.filter(|t| !(t.is_finite() && *t >= 0.0)) {
                return Err(bad(format!("block {}: backward time {t} s", b.id)));
            }
            if b.backward_s.is_some() != self.blocks[0].backward_s.is_some() {
                return Err(bad(format!(
                    "block {} has a backward time and block {} not: a step trains every block or none",
                    if b.backward_s.is_some() { &b.id } else { &self.blocks[0].id },
                    if b.backward_s.is_some() { &self.blocks[0].id } else { &b.id }
                )));
            }
            if let Some(t) = b.ask_lead_s.filter(|t| !(t.is_finite() && *t >= 0.0)) {
                return Err(bad(format!("block {}: ask lead {t} s", b.id)));
            }
            if let Some(c) = b.coded.filter(|c| !(c.decode_s.is_finite() && c.decode_s >= 0.0)) {
                return Err(bad(format!("block {}: decode time {} s", b.id, c.decode_s)));
            }
            if !seen.insert(b.id.as_str()) {
                return Err(bad(format!("block {} named twice", b.id)));
            }
        }
        // Every sum and `(d + 1) ×` product the planner forms stays in range
        // (sizes past this are no measurement: 2^64 / 65537 bytes is 281 TB).
        let total = self
            .blocks
            .iter()
            .flat_map(|b| [b.bytes, b.coded.map_or(0, |c| c.bytes)])
            .try_fold(self.non_block_bytes, u64::checked_add)
            .and_then(|t| t.checked_mul(offload_core::MAX_PREFETCH_DEPTH as u64 + 1));
        if total.is_none() {
            return Err(bad("block sizes past what a device holds (their sums overflow)".into()));
        }
        Ok(())
    }

    /// The calibration as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Whether the step trains: a forward, then a backward bringing every
    /// streamed block again in reverse (every block has a backward time).
    pub fn trains(&self) -> bool {
        !self.blocks.is_empty() && self.blocks.iter().all(|b| b.backward_s.is_some())
    }

    /// Passes a streamed block crosses the link in a step: 2 where it trains.
    fn passes(&self) -> u64 {
        if self.trains() {
            2
        } else {
            1
        }
    }

    /// Total compute per step, seconds (the resident step): forward and, where
    /// the step trains, backward.
    pub fn compute_s(&self) -> f64 {
        self.blocks.iter().map(|b| b.compute_s + b.backward_s.unwrap_or(0.0)).sum()
    }

    /// Total block bytes.
    pub fn total_bytes(&self) -> u64 {
        self.blocks.iter().map(|b| b.bytes).sum()
    }

    /// The analytical bound of a plan at `depth`: `max(compute, streamed bytes ÷
    /// bandwidth)`, the streamed bytes as [`per_step`](Self::per_step) counts
    /// them (once a pass, less what stays in the ring's slots). `resident[i]`
    /// says whether block `i` is kept on the device; a block past the end of
    /// `resident` is streamed (here and in every method taking one).
    pub fn bound_s(&self, resident: &[bool], depth: usize) -> f64 {
        self.compute_s().max(self.per_step(resident, depth, |b| b.bytes as f64) / self.bandwidth_bytes_per_s)
    }

    /// A per-block quantity (`of`: bytes, coded bytes, decode time) summed over
    /// the copies of streamed blocks a step makes with a ring of `depth + 1`
    /// slots: none where every streamed block fits the slots (they stay there,
    /// asked for again and again); else each streamed block once a pass, and,
    /// where the step trains, twice, less the blocks still in their slots at
    /// the two turns: the forward's last `depth + 1` streamed blocks are the
    /// backward's first, the backward's last the next forward's first. So a
    /// bound below every replay of the step at that depth.
    pub fn per_step(&self, resident: &[bool], depth: usize, of: impl Fn(&BlockCost) -> f64) -> f64 {
        let streamed: Vec<f64> = (0..self.blocks.len()).filter(|&i| !held(resident, i)).map(|i| of(&self.blocks[i])).collect();
        let slots = depth.max(1).saturating_add(1);
        if streamed.len() <= slots {
            return 0.0;
        }
        let once: f64 = streamed.iter().sum();
        if self.passes() == 1 {
            return once;
        }
        let first: f64 = streamed[..slots].iter().sum();
        let last: f64 = streamed[streamed.len() - slots..].iter().sum();
        (2.0 * once - first - last).max(0.0)
    }

    /// Device bytes for weights under a plan: `(d + 1) ×` the largest streamed
    /// block, plus resident blocks, plus non-block tensors.
    pub fn device_bytes(&self, resident: &[bool], depth: usize) -> u64 {
        let largest = self.blocks.iter().enumerate().filter(|(i, _)| !held(resident, *i)).map(|(_, b)| b.bytes).max().unwrap_or(0);
        let res: u64 = self.blocks.iter().enumerate().filter(|(i, _)| held(resident, *i)).map(|(_, b)| b.bytes).sum();
        (depth as u64).saturating_add(1).saturating_mul(largest).saturating_add(res).saturating_add(self.non_block_bytes)
    }

    /// Predict the steady-state step time by replaying the ring's schedule over
    /// three steps: `d + 1` slots; the copy of a streamed block starts when the
    /// copy stream is free, its slot's previous block has computed and the
    /// block `d` before it in streaming order has been asked for (its
    /// [`ask_lead_s`](BlockCost::ask_lead_s) before the device reached it); a
    /// block computes when the previous one has and its copy has landed; each
    /// step begins with the [`step_gap_s`](Self::step_gap_s). Where the
    /// step trains, the blocks run forward, then backward in reverse order (each
    /// streamed block copied again), and a block asked for twice in a row (the
    /// last of the forward, first of the backward; the last of the backward,
    /// first of the next forward) is still in its slot: no copy.
    pub fn simulate_s(&self, resident: &[bool], depth: usize) -> f64 {
        self.simulate_coded_s(resident, depth, false)
    }

    /// Whether every block has a coded size (the planner may then code them).
    pub fn codable(&self) -> bool {
        !self.blocks.is_empty() && self.blocks.iter().all(|b| b.coded.is_some())
    }

    /// Staging device bytes of a coded plan: the decode engine's
    /// [`staging_buffers`](Self::staging_buffers) (at least one), each the largest
    /// coded block rounded up to 2 MiB (resident blocks are loaded through them too, and the
    /// buffers keep the largest size they grew to), whatever the depth (`_resident`
    /// and `_depth` are kept for engines that would hold one per copy in flight).
    pub fn staging_bytes(&self, _resident: &[bool], _depth: usize) -> u64 {
        let largest = self.blocks.iter().filter_map(|b| b.coded.map(|c| c.bytes)).max().unwrap_or(0);
        offload_core::codec::staging_bytes(self.staging_buffers.max(1), largest)
    }

    /// [`simulate_s`](Self::simulate_s), with the streamed blocks held coded
    /// when `coded` (and their coded size known): each copy moves the coded
    /// bytes, then the decode stream decodes it (one decode at a time, after its
    /// copy), and the block computes once decoded.
    pub fn simulate_coded_s(&self, resident: &[bool], depth: usize, coded: bool) -> f64 {
        let n = self.blocks.len();
        if n == 0 {
            return 0.0;
        }
        // The step's blocks in the order they run, each with its compute time.
        let mut order: Vec<(usize, f64)> = self.blocks.iter().enumerate().map(|(i, b)| (i, b.compute_s)).collect();
        if self.trains() {
            order.extend(self.blocks.iter().enumerate().rev().map(|(i, b)| (i, b.backward_s.unwrap_or(0.0))));
        }
        // More slots than streamed blocks hold nothing more (and a huge depth
        // allocates none).
        let streamed = (0..n).filter(|&i| !held(resident, i)).count();
        let slots = depth.max(1).saturating_add(1).min(streamed + 1);
        let mut copy_free = 0.0f64;
        let mut decode_free = 0.0f64;
        let mut compute_end = 0.0f64;
        // The ring's slots: the block each holds, when its copy landed (or its
        // decode ended) and when the last block that read it computed.
        let mut ring: Vec<(Option<usize>, f64, f64)> = vec![(None, 0.0, 0.0); slots];
        // The streamed blocks in the order they are asked for (hits included):
        // the block and when the host asked for it (the ring issues a copy
        // when the block `depth` before it in this walk is asked for).
        let mut walk: Vec<(usize, f64)> = Vec::new();
        let mut step_ends = Vec::new();
        let forward = self.blocks.len();
        for _step in 0..3 {
            compute_end += self.step_gap_s;
            for (at, &(i, t)) in order.iter().enumerate() {
                let b = &self.blocks[i];
                if held(resident, i) {
                    compute_end += t;
                    continue;
                }
                // The backward's blocks are asked for by autograd: no lead measured.
                let lead = if at < forward { b.ask_lead_s } else { None };
                let reached = compute_end;
                let q = walk.len();
                let s = match ring.iter().position(|r| r.0 == Some(i)) {
                    // Still in its slot (asked for twice in a row, a pass's
                    // turn, or every streamed block fitting the slots): no copy.
                    Some(s) => s,
                    None => {
                        // The least recently used slot holding none of the
                        // `depth` blocks asked for before this one.
                        let keep: Vec<usize> = walk[q.saturating_sub(depth.max(1))..].iter().map(|w| w.0).collect();
                        let s = (0..slots)
                            .filter(|&s| ring[s].0.is_none_or(|h| !keep.contains(&h)))
                            .min_by(|&a, &c| ring[a].2.total_cmp(&ring[c].2))
                            .unwrap_or(0);
                        let issued = if q >= depth.max(1) { walk[q - depth.max(1)].1 } else { f64::NEG_INFINITY };
                        let start = copy_free.max(ring[s].2).max(issued);
                        let landed = match b.coded.filter(|_| coded) {
                            None => {
                                copy_free = start + b.bytes as f64 / self.bandwidth_bytes_per_s;
                                copy_free
                            }
                            Some(c) => {
                                copy_free = start + c.bytes as f64 / self.bandwidth_bytes_per_s;
                                decode_free = decode_free.max(copy_free) + c.decode_s;
                                decode_free
                            }
                        };
                        ring[s] = (Some(i), landed, 0.0);
                        s
                    }
                };
                compute_end = compute_end.max(ring[s].1) + t;
                ring[s].2 = compute_end;
                walk.push((i, lead.map_or(f64::NEG_INFINITY, |l| reached - l)));
            }
            step_ends.push(compute_end);
        }
        step_ends[2] - step_ends[1]
    }
}
