//! Plans (what the user declares) and the resolver that applies a plan to a
//! concrete inventory. The result, a [`ResolvedPlan`], is pure data: no device work.

use crate::discovery::{BlockId, ComponentInventory};
use crate::error::{Error, Result};
use crate::tensor::BlockLayout;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};

/// How a component's blocks are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Every block stays on the device.
    Resident,
    /// Blocks stream through a ring of `depth + 1` slots (some may stay resident).
    #[default]
    Layerwise,
    /// The whole component is copied before use and released after (a VAE, a text encoder).
    OnDemand,
}

/// How the planner picks the blocks that stay resident under a budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResidentPolicy {
    /// The planner chooses how many and which (spread evenly over the ring).
    #[default]
    Auto,
    /// The first blocks of the ring.
    Leading,
    /// Blocks spread evenly over the ring.
    Strided,
    /// Exactly `resident_blocks`, nothing added.
    Explicit,
}

/// What to do when host memory cannot be page-locked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinFallback {
    /// Fail with an error naming the block and the bytes asked for.
    #[default]
    Fail,
    /// Use pageable memory for that block, with a warning (copies are slower).
    Pageable,
}

/// The plan of one component.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ComponentPlan {
    /// How its blocks are held.
    pub strategy: Strategy,
    /// Blocks in flight ahead of the one computing (`d ≥ 1`).
    pub prefetch_depth: usize,
    /// Hard limit on device bytes for this component's weights, if any.
    pub device_budget_bytes: Option<u64>,
    /// Alternatively: the device's free memory minus this margin, at plan time.
    /// One reading, shared: the rings of every component resolved together must
    /// fit it together (on-demand components count their largest).
    pub device_budget_free_minus_bytes: Option<u64>,
    /// Limit on page-locked host bytes, if any.
    pub host_pin_budget_bytes: Option<u64>,
    /// When pinning fails or the pin budget is spent.
    pub pin_fallback: PinFallback,
    /// How the planner (`offload_plan`) chooses resident blocks when it fills
    /// `resident_blocks`; [`resolve`] keeps exactly `resident_blocks` and reads
    /// no policy.
    pub resident_policy: ResidentPolicy,
    /// Blocks kept on the device for good (`"double_blocks.3"`).
    pub resident_blocks: Vec<String>,
    /// Hold the streamed blocks coded for the device (exponents entropy-coded,
    /// lossless) and decode them as they are copied: fewer bytes on the wire, for
    /// a component whose step is transfer-bound. Where the backend cannot decode,
    /// the blocks are held as they are, with a warning.
    pub coded: bool,
    /// Host memory for this component's weights, if less than the model (the disk
    /// tier): the blocks held in memory, the non-block tensors, and the ring's
    /// `d + 2` bounce buffers for the blocks read from the checkpoint file at each
    /// use. Store it with [`HostStore::build_tiered`](crate::store::HostStore::build_tiered).
    pub host_ram_budget_bytes: Option<u64>,
    /// Blocks left on disk (`"double_blocks.3"`). Empty with a host RAM budget:
    /// the resolver keeps blocks in memory in inventory order while they fit and
    /// leaves the rest on disk; `offload_plan::plan_host_tier` chooses with the
    /// cost model instead.
    pub disk_blocks: Vec<String>,
}

impl Default for ComponentPlan {
    fn default() -> Self {
        ComponentPlan {
            strategy: Strategy::Layerwise,
            prefetch_depth: 1,
            device_budget_bytes: None,
            device_budget_free_minus_bytes: None,
            host_pin_budget_bytes: None,
            pin_fallback: PinFallback::Fail,
            resident_policy: ResidentPolicy::Auto,
            resident_blocks: Vec::new(),
            coded: false,
            host_ram_budget_bytes: None,
            disk_blocks: Vec::new(),
        }
    }
}

/// What the user declares, per component; components not named take `default`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Plan {
    /// The plan of components not named in `components`.
    pub default: ComponentPlan,
    /// Per-component plans.
    pub components: BTreeMap<String, ComponentPlan>,
}

impl Plan {
    /// Every component streams layer by layer with depth 1.
    pub fn layerwise() -> Self {
        Plan::default()
    }

    /// Every component stays resident.
    pub fn resident() -> Self {
        Plan { default: ComponentPlan { strategy: Strategy::Resident, ..Default::default() }, ..Default::default() }
    }

    /// Set the default prefetch depth.
    pub fn prefetch_depth(mut self, depth: usize) -> Self {
        self.default.prefetch_depth = depth;
        self
    }

    /// Set the default device budget in GiB.
    pub fn device_budget_gib(mut self, gib: f64) -> Self {
        self.default.device_budget_bytes = Some((gib * (1u64 << 30) as f64) as u64);
        self
    }

    /// Set the plan of one component.
    pub fn component(mut self, name: impl Into<String>, plan: ComponentPlan) -> Self {
        self.components.insert(name.into(), plan);
        self
    }

    /// The plan that applies to `component`.
    pub fn for_component(&self, component: &str) -> &ComponentPlan {
        self.components.get(component).unwrap_or(&self.default)
    }
}

/// A plan applied to one component's inventory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResolvedComponent {
    /// Component name.
    pub name: String,
    /// Strategy.
    pub strategy: Strategy,
    /// Prefetch depth (≥ 1).
    pub depth: usize,
    /// Every block with its size, in inventory order.
    pub blocks: Vec<(BlockId, usize)>,
    /// Blocks kept resident (all of them for [`Strategy::Resident`]).
    pub resident: Vec<BlockId>,
    /// Largest streamed block, bytes.
    pub largest_streamed_bytes: usize,
    /// Upper bound on device bytes for weights: `(d + 1) ×` largest streamed block
    /// plus resident blocks plus non-block tensors.
    pub device_weight_bound: u64,
    /// Non-block tensor bytes (resident).
    pub non_block_bytes: u64,
    /// The budget, if any.
    pub budget: Option<u64>,
    /// Blocks left on disk (the disk tier), read from the file at each use.
    #[serde(default)]
    pub on_disk: Vec<BlockId>,
    /// Host bytes the component's weights take: blocks in memory, non-block
    /// tensors, and the bounce buffers of the blocks on disk.
    #[serde(default)]
    pub host_ram_bytes: u64,
    /// The page-locked host budget (`host_pin_budget_bytes`), if any: the store's
    /// page-locked bytes and the ring's page-locked bounce buffers count against it.
    #[serde(default)]
    pub pin_budget: Option<u64>,
    /// The host RAM budget (`host_ram_budget_bytes`), if any: `host_ram_bytes`
    /// fits it, with the blocks `on_disk` on disk and no others.
    #[serde(default)]
    pub host_ram_budget: Option<u64>,
}

impl ResolvedComponent {
    /// Whether block `id` stays resident.
    pub fn is_resident(&self, id: &BlockId) -> bool {
        self.strategy == Strategy::Resident || self.resident.contains(id)
    }

    /// Whether block `id` is left on disk (the disk tier).
    pub fn is_on_disk(&self, id: &BlockId) -> bool {
        self.on_disk.contains(id)
    }

    /// Bytes streamed per pass over every block.
    pub fn streamed_bytes_per_pass(&self) -> u64 {
        self.blocks.iter().filter(|(id, _)| !self.is_resident(id)).map(|(_, b)| *b as u64).sum()
    }
}

/// A plan applied to a model: pure data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResolvedPlan {
    /// One entry per component of the inventory.
    pub components: Vec<ResolvedComponent>,
}

impl ResolvedPlan {
    /// The resolved component named `name`.
    pub fn component(&self, name: &str) -> Option<&ResolvedComponent> {
        self.components.iter().find(|c| c.name == name)
    }
}

fn layout_bytes(inv: &ComponentInventory) -> Result<Vec<(BlockId, usize)>> {
    inv.blocks().map(|b| Ok((b.id.clone(), BlockLayout::new(b.tensors.clone())?.bytes))).collect()
}

/// The deepest prefetch a plan may ask for (deeper than any model's blocks; the
/// bound keeps the slot arithmetic from wrapping).
pub const MAX_PREFETCH_DEPTH: usize = 1 << 16;

/// Apply `plan` to the components of `inventory`.
///
/// Errors name what is wrong: a plan for a component the model lacks, a component
/// or tensor owned twice, a resident block that does not exist or is named twice,
/// a depth of 0 or past [`MAX_PREFETCH_DEPTH`], a budget below `(d + 1) ×` the
/// largest streamed block plus the resident set. A coded store's decoder
/// staging buffers are counted against the budget when the ring is built
/// ([`Ring::new`](crate::ring::Ring::new)): only the store knows the coded sizes.
pub fn resolve(plan: &Plan, inventory: &[ComponentInventory]) -> Result<ResolvedPlan> {
    resolve_on(plan, inventory, None)
}

/// [`resolve`] against a device whose memory is `memory` (as
/// [`OffloadBackend::memory_info`](crate::backend::OffloadBackend::memory_info) reports it),
/// so that budgets given as "free memory minus a margin" become bytes. Pure data:
/// the caller asks the device once and passes the answer in.
pub fn resolve_on(plan: &Plan, inventory: &[ComponentInventory], memory: Option<crate::backend::MemoryInfo>) -> Result<ResolvedPlan> {
    let mut names = HashSet::new();
    let mut owner: HashMap<&str, String> = HashMap::new();
    for c in inventory {
        if !names.insert(c.name.as_str()) {
            return Err(Error::Plan(format!("component {:?} appears twice in the inventory", c.name)));
        }
        for b in c.blocks() {
            for t in &b.tensors {
                if let Some(prev) = owner.insert(t.name.as_str(), format!("{}/{}", c.name, b.id)) {
                    return Err(Error::Plan(format!("tensor {:?} is owned by both {prev} and {}/{}", t.name, c.name, b.id)));
                }
            }
        }
    }
    for name in plan.components.keys() {
        if !names.contains(name.as_str()) {
            let known: Vec<_> = inventory.iter().map(|c| c.name.as_str()).collect();
            return Err(Error::Plan(format!("plan names component {name:?}, the model has {known:?}")));
        }
    }
    let mut components = Vec::new();
    for inv in inventory {
        let cp = plan.for_component(&inv.name);
        let c = &inv.name;
        // A ring deeper than its blocks holds a slot per block (harmless); past
        // MAX_PREFETCH_DEPTH the slot arithmetic below would wrap.
        if !(1..=MAX_PREFETCH_DEPTH).contains(&cp.prefetch_depth) {
            return Err(Error::Plan(format!("component {c:?}: prefetch_depth {} must be 1 to {MAX_PREFETCH_DEPTH}", cp.prefetch_depth)));
        }
        let blocks = layout_bytes(inv)?;
        let size: HashMap<&BlockId, usize> = blocks.iter().map(|(id, b)| (id, *b)).collect();
        let mut resident = Vec::new();
        for r in &cp.resident_blocks {
            let id = BlockId::parse(r)
                .filter(|id| size.contains_key(id))
                .ok_or_else(|| Error::Plan(format!("component {c:?}: resident block {r:?} does not exist")))?;
            if resident.contains(&id) {
                return Err(Error::Plan(format!("component {c:?}: resident block {r:?} named twice")));
            }
            resident.push(id);
        }
        if cp.strategy == Strategy::Resident {
            resident = blocks.iter().map(|(id, _)| id.clone()).collect();
        }
        let non_block_bytes = BlockLayout::new(inv.non_block.clone())?.bytes as u64;
        let resident_bytes: u64 = resident.iter().map(|id| size[id] as u64).sum();
        let largest_streamed_bytes = blocks.iter().filter(|(id, _)| !resident.contains(id)).map(|(_, b)| *b).max().unwrap_or(0);
        let device_weight_bound = match cp.strategy {
            Strategy::Layerwise => (cp.prefetch_depth as u64 + 1) * largest_streamed_bytes as u64 + resident_bytes + non_block_bytes,
            Strategy::Resident | Strategy::OnDemand => blocks.iter().map(|(_, b)| *b as u64).sum::<u64>() + non_block_bytes,
        };
        if cp.strategy == Strategy::Layerwise && blocks.len() < 2 {
            return Err(Error::Plan(format!("component {c:?}: layerwise streaming needs at least 2 blocks, it has {}", blocks.len())));
        }
        let budget = match (cp.device_budget_bytes, cp.device_budget_free_minus_bytes, memory) {
            (Some(_), Some(_), _) => {
                return Err(Error::Plan(format!("component {c:?}: give device_budget_bytes or device_budget_free_minus_bytes, not both")))
            }
            (Some(b), None, _) => Some(b),
            (None, Some(margin), Some(m)) => Some(m.free.checked_sub(margin).ok_or_else(|| {
                Error::Plan(format!("component {c:?}: the device has {} bytes free, less than the margin of {margin} bytes", m.free))
            })?),
            (None, Some(_), None) => {
                return Err(Error::Plan(format!(
                    "component {c:?}: a budget of free memory minus a margin needs the device's free memory (use resolve_on)"
                )))
            }
            (None, None, _) => None,
        };
        if let Some(budget) = budget {
            if device_weight_bound > budget {
                return Err(Error::Plan(format!(
                    "component {c:?}: device budget {budget} bytes is below what the plan needs: {device_weight_bound} bytes \
                     ((d + 1) = {} × largest streamed block {largest_streamed_bytes} + resident {resident_bytes} + non-block {non_block_bytes})",
                    cp.prefetch_depth + 1
                )));
            }
        }
        let (on_disk, host_ram_bytes) = resolve_disk(c, cp, &blocks, &resident, non_block_bytes)?;
        components.push(ResolvedComponent {
            name: c.clone(),
            strategy: cp.strategy,
            depth: cp.prefetch_depth,
            blocks,
            resident,
            largest_streamed_bytes,
            device_weight_bound,
            non_block_bytes,
            budget,
            on_disk,
            host_ram_bytes,
            pin_budget: cp.host_pin_budget_bytes,
            host_ram_budget: cp.host_ram_budget_bytes,
        });
    }
    check_shared_margin(plan, &components, memory)?;
    Ok(ResolvedPlan { components })
}

/// A budget of free memory minus a margin reads the device once for every
/// component: their rings coexist on it, so together they must fit (on-demand
/// components, loaded one at a time around their use, count their largest).
fn check_shared_margin(plan: &Plan, components: &[ResolvedComponent], memory: Option<crate::backend::MemoryInfo>) -> Result<()> {
    let Some(memory) = memory else { return Ok(()) };
    let margin = components.iter().filter_map(|c| plan.for_component(&c.name).device_budget_free_minus_bytes).max();
    let Some(margin) = margin else { return Ok(()) };
    let held = components.iter().filter(|c| c.strategy != Strategy::OnDemand);
    let on_demand = components.iter().filter(|c| c.strategy == Strategy::OnDemand).map(|c| c.device_weight_bound).max();
    let total = held.clone().map(|c| c.device_weight_bound).fold(on_demand.unwrap_or(0), u64::saturating_add);
    let shared = memory.free.saturating_sub(margin);
    if total <= shared {
        return Ok(());
    }
    let each: Vec<String> = components
        .iter()
        .map(|c| format!("{:?} {}{}", c.name, c.device_weight_bound, if c.strategy == Strategy::OnDemand { " (on demand)" } else { "" }))
        .collect();
    Err(Error::Plan(format!(
        "the components' rings together hold {total} device bytes ({}), over the device's {} free bytes minus the \
         margin of {margin}, {shared}: the margin is shared, not given to each; lower a depth, keep fewer blocks \
         resident, or give the components device_budget_bytes of their own",
        each.join(", "),
        memory.free
    )))
}

/// Host memory of a ring with the blocks `on_disk` left on disk: the blocks in
/// memory, the non-block tensors, and the larger of `d + 2` bounce buffers of the
/// largest streamed block on disk (each [`DiskFile::span`](crate::disk::DiskFile::span)
/// bytes) and the one-off buffer of the largest device-resident block on disk.
pub fn host_ram_bytes(blocks: &[(BlockId, usize)], resident: &[BlockId], on_disk: &[BlockId], depth: usize, non_block_bytes: u64) -> u64 {
    let each = blocks.iter().map(|(id, b)| (*b as u64, on_disk.contains(id), resident.contains(id)));
    host_ram_of(each, depth, non_block_bytes).0
}

/// The rule behind [`host_ram_bytes`], over `(bytes, on disk, device-resident)`
/// per block: the host bytes, and the bounce buffers among them (the planner in
/// `offload-plan` counts with it too).
pub fn host_ram_of(blocks: impl Iterator<Item = (u64, bool, bool)>, depth: usize, non_block_bytes: u64) -> (u64, u64) {
    let (mut held, mut largest, mut once) = (0u64, None::<u64>, 0u64);
    for (bytes, on_disk, resident) in blocks {
        match (on_disk, resident) {
            (false, _) => held += bytes,
            (true, false) => largest = largest.max(Some(bytes)),
            // Kept on the device but left on disk: read once, when the ring is built,
            // into a buffer of its size (before the bounce buffers exist).
            (true, true) => once = once.max(bytes),
        }
    }
    let bounce = largest.map_or(0, |b| ((depth + 2) * crate::disk::DiskFile::span(b as usize)) as u64);
    (held + non_block_bytes + bounce.max(once), bounce)
}

/// The blocks left on disk and the host memory the component then takes: the
/// plan's `disk_blocks`, or with a host RAM budget and none named, the blocks that
/// do not fit in inventory order; an error naming the bytes when the budget
/// cannot hold what the choice needs.
fn resolve_disk(
    c: &str,
    cp: &ComponentPlan,
    blocks: &[(BlockId, usize)],
    resident: &[BlockId],
    non_block_bytes: u64,
) -> Result<(Vec<BlockId>, u64)> {
    let mut on_disk = Vec::new();
    for d in &cp.disk_blocks {
        let id = BlockId::parse(d)
            .filter(|id| blocks.iter().any(|(b, _)| b == id))
            .ok_or_else(|| Error::Plan(format!("component {c:?}: disk block {d:?} does not exist")))?;
        if on_disk.contains(&id) {
            return Err(Error::Plan(format!("component {c:?}: disk block {d:?} named twice")));
        }
        on_disk.push(id);
    }
    let depth = cp.prefetch_depth;
    let Some(budget) = cp.host_ram_budget_bytes else {
        return Ok((on_disk.clone(), host_ram_bytes(blocks, resident, &on_disk, depth, non_block_bytes)));
    };
    let in_memory = host_ram_bytes(blocks, resident, &[], depth, non_block_bytes);
    if cp.disk_blocks.is_empty() && in_memory > budget {
        // Everything on disk first; then bring blocks back into memory, in
        // inventory order, while the budget holds them. (Where every block fits
        // in memory none goes to disk: with few blocks the bounce buffers alone
        // can outweigh them.)
        on_disk = blocks.iter().map(|(id, _)| id.clone()).collect();
        if host_ram_bytes(blocks, resident, &on_disk, depth, non_block_bytes) <= budget {
            for (id, _) in blocks {
                let without: Vec<BlockId> = on_disk.iter().filter(|d| *d != id).cloned().collect();
                if host_ram_bytes(blocks, resident, &without, depth, non_block_bytes) <= budget {
                    on_disk = without;
                }
            }
        }
    }
    let need = host_ram_bytes(blocks, resident, &on_disk, depth, non_block_bytes);
    if need > budget {
        let each = blocks.iter().map(|(id, b)| (*b as u64, on_disk.contains(id), resident.contains(id)));
        let (_, bounce) = host_ram_of(each, depth, non_block_bytes);
        let held: u64 = blocks.iter().filter(|(id, _)| !on_disk.contains(id)).map(|(_, b)| *b as u64).sum();
        let rest = need - held - non_block_bytes;
        return Err(Error::Plan(format!(
            "component {c:?}: host RAM budget {budget} bytes is below what the plan needs: {need} bytes (the {} blocks in \
             memory {held} + non-block tensors {non_block_bytes} + for the {} on disk {rest}{}); raise \
             host_ram_budget_bytes{}",
            blocks.len() - on_disk.len(),
            on_disk.len(),
            match rest == bounce && bounce > 0 {
                true => format!(", d + 2 = {} bounce buffers", depth + 2),
                false => String::new(),
            },
            match depth > 1 && bounce > 0 {
                true => " or lower prefetch_depth",
                false => "",
            }
        )));
    }
    Ok((on_disk, need))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::{BlockDiscovery, NameDiscovery};
    use crate::tensor::{DType, TensorSpec};

    fn inv(name: &str, blocks: usize, elems: usize) -> ComponentInventory {
        let t: Vec<_> = (0..blocks).map(|i| TensorSpec::new(format!("{name}_blocks.{i}.w"), DType::U8, [elems])).collect();
        NameDiscovery.discover(name, &t).unwrap()
    }

    #[test]
    fn budget_below_ring_is_an_error_naming_sizes() {
        let i = [inv("transformer", 4, 1024)];
        let plan = Plan::layerwise()
            .prefetch_depth(2)
            .component("transformer", ComponentPlan { device_budget_bytes: Some(2048), prefetch_depth: 2, ..Default::default() });
        let e = resolve(&plan, &i).unwrap_err().to_string();
        assert!(e.contains("transformer") && e.contains("3072"), "{e}");
        let ok = Plan::layerwise().component("transformer", ComponentPlan { device_budget_bytes: Some(2048), ..Default::default() });
        let r = resolve(&ok, &i).unwrap();
        assert_eq!(r.components[0].device_weight_bound, 2048);
        assert_eq!(r.components[0].streamed_bytes_per_pass(), 4096);
    }

    #[test]
    fn unknown_component_and_bad_resident_blocks() {
        let i = [inv("transformer", 4, 16)];
        let e = resolve(&Plan::layerwise().component("vae", ComponentPlan::default()), &i).unwrap_err().to_string();
        assert!(e.contains("\"vae\""), "{e}");
        let p = Plan::layerwise()
            .component("transformer", ComponentPlan { resident_blocks: vec!["transformer_blocks.9".into()], ..Default::default() });
        assert!(resolve(&p, &i).unwrap_err().to_string().contains("transformer_blocks.9"));
        let p = Plan::layerwise().component(
            "transformer",
            ComponentPlan { resident_blocks: vec!["transformer_blocks.1".into(), "transformer_blocks.1".into()], ..Default::default() },
        );
        assert!(resolve(&p, &i).unwrap_err().to_string().contains("twice"));
        assert!(resolve(&Plan::layerwise().prefetch_depth(0), &i).is_err());
        // Deeper than the 4 blocks is a slot per block; past the limit `(depth + 1)
        // ×` the largest block wrapped to a budget that passed (usize::MAX / 2 + 1).
        assert!(resolve(&Plan::layerwise().prefetch_depth(6), &i).is_ok());
        for depth in [MAX_PREFETCH_DEPTH + 1, usize::MAX / 2 + 1, usize::MAX] {
            let e = resolve(&Plan::layerwise().prefetch_depth(depth), &i).unwrap_err().to_string();
            assert!(e.contains("must be 1 to"), "{depth}: {e}");
        }
    }

    #[test]
    fn tensor_owned_twice_and_component_twice() {
        let a = inv("a", 2, 4);
        let mut b = a.clone();
        b.name = "b".into();
        let e = resolve(&Plan::layerwise(), &[a.clone(), b]).unwrap_err().to_string();
        assert!(e.contains("owned by both"), "{e}");
        let e = resolve(&Plan::layerwise(), &[a.clone(), a]).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn free_minus_margin_budgets() {
        let i = [inv("transformer", 4, 1024)];
        let cp = ComponentPlan { device_budget_free_minus_bytes: Some(1000), ..Default::default() };
        let plan = Plan::layerwise().component("transformer", cp);
        assert!(resolve(&plan, &i).unwrap_err().to_string().contains("resolve_on"));
        let mem = |free| Some(crate::backend::MemoryInfo { free, total: 1 << 20 });
        assert_eq!(resolve_on(&plan, &i, mem(3048)).unwrap().components[0].budget, Some(2048));
        let e = resolve_on(&plan, &i, mem(2500)).unwrap_err().to_string();
        assert!(e.contains("device budget 1500 bytes is below"), "{e}");
        assert!(resolve_on(&plan, &i, mem(500)).unwrap_err().to_string().contains("less than the margin"));
    }

    /// A host RAM budget that holds every block in memory leaves none on disk,
    /// even where the bounce buffers of a disk tier would outweigh the blocks
    /// (few, small blocks).
    #[test]
    fn a_host_budget_that_holds_every_block_puts_none_on_disk() {
        let i = [inv("t", 3, 1024)];
        let all = resolve(&Plan::layerwise(), &i).unwrap().components[0].host_ram_bytes;
        let cp = ComponentPlan { host_ram_budget_bytes: Some(all), ..Default::default() };
        let r = resolve(&Plan::layerwise().component("t", cp), &i).unwrap();
        assert!(r.components[0].on_disk.is_empty() && r.components[0].host_ram_bytes == all, "{:?}", r.components[0]);
    }

    /// One reading of free memory is shared: components resolved together, each
    /// within free minus the margin alone, are refused when their rings together
    /// are not (on-demand components count their largest, loaded one at a time).
    #[test]
    fn a_free_minus_margin_budget_is_shared_by_the_components() {
        let i = [inv("a", 4, 1024), inv("b", 4, 1024), inv("c", 4, 512)];
        let mem = |free| Some(crate::backend::MemoryInfo { free, total: 1 << 20 });
        let on_demand = ComponentPlan { strategy: Strategy::OnDemand, ..Default::default() };
        let plan =
            Plan { default: ComponentPlan { device_budget_free_minus_bytes: Some(1000), ..Default::default() }, ..Default::default() }
                .component("c", on_demand.clone());
        // a and b: 2048 each (d = 1); c on demand, 2048 whole: 6144 in all.
        let e = resolve_on(&plan, &i, mem(7000)).unwrap_err().to_string();
        assert!(e.contains("6144") && e.contains("\"a\" 2048") && e.contains("\"b\" 2048") && e.contains("6000"), "{e}");
        assert!(resolve_on(&plan, &i, mem(7144)).is_ok());
        // Without a margin budget the components' own budgets stand alone.
        let plan = Plan::layerwise().component("c", on_demand);
        assert!(resolve_on(&plan, &i, mem(10)).is_ok());
    }

    #[test]
    fn one_block_cannot_stream() {
        let e = resolve(&Plan::layerwise(), &[inv("t", 1, 4)]);
        // A single-index stack is not discovered as a stack at all, so there are no blocks.
        assert!(e.unwrap_err().to_string().contains("at least 2 blocks"));
    }
}
