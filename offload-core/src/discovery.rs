//! Finding the blocks of a model: declared by the model, or discovered from tensor
//! names of the form `<stack>.<index>.<rest>`.

use crate::error::{Error, Result};
use crate::tensor::TensorSpec;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet};

/// A block's address: its stack and its index in that stack.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId {
    /// Stack name (`double_blocks`, `model.layers`).
    pub stack: String,
    /// Index within the stack.
    pub index: usize,
}

impl BlockId {
    /// A new id.
    pub fn new(stack: impl Into<String>, index: usize) -> Self {
        BlockId { stack: stack.into(), index }
    }

    /// Parse `"<stack>.<index>"`.
    pub fn parse(s: &str) -> Option<Self> {
        let (stack, index) = s.rsplit_once('.')?;
        Some(BlockId::new(stack, index.parse().ok()?))
    }
}

impl std::fmt::Display for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.stack, self.index)
    }
}

/// One block: its id and its tensors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSpec {
    /// Where the block sits.
    pub id: BlockId,
    /// Its tensors, full names.
    pub tensors: Vec<TensorSpec>,
}

/// An ordered list of blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackSpec {
    /// Stack name.
    pub name: String,
    /// Blocks in index order.
    pub blocks: Vec<BlockSpec>,
}

/// What a component holds: its stacks and its non-block tensors.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentInventory {
    /// Component name (`transformer`, `text_encoder`).
    pub name: String,
    /// Stacks in the order the model declares or first names them.
    pub stacks: Vec<StackSpec>,
    /// Tensors that belong to no block; they stay resident.
    pub non_block: Vec<TensorSpec>,
}

impl ComponentInventory {
    /// All blocks, stack by stack.
    pub fn blocks(&self) -> impl Iterator<Item = &BlockSpec> {
        self.stacks.iter().flat_map(|s| s.blocks.iter())
    }
}

/// Turns a component's tensor list into stacks of blocks.
///
/// A model can implement this to declare its stacks; [`NameDiscovery`] finds them
/// from names, [`DeclaredStacks`] takes a list of stack prefixes.
pub trait BlockDiscovery {
    /// Group `tensors` of component `component` into stacks and non-block tensors.
    fn discover(&self, component: &str, tensors: &[TensorSpec]) -> Result<ComponentInventory>;
}

/// Discovery from names: a tensor `<stack>.<index>.<rest>` (the first all-digit
/// segment is the index) belongs to block `index` of `stack`. A candidate stack is
/// kept only if its indices run `0..n` with `n ≥ 2`; anything else
/// (`final_layer.adaLN_modulation.1.weight`) is a non-block tensor.
#[derive(Clone, Copy, Debug, Default)]
pub struct NameDiscovery;

/// Discovery from stack prefixes the model declares (`["double_blocks", "single_blocks"]`).
#[derive(Clone, Debug, Default)]
pub struct DeclaredStacks {
    /// Stack prefixes, in invocation order.
    pub stacks: Vec<String>,
}

impl DeclaredStacks {
    /// Stacks named by `prefixes`.
    pub fn new<S: Into<String>>(prefixes: impl IntoIterator<Item = S>) -> Self {
        DeclaredStacks { stacks: prefixes.into_iter().map(Into::into).collect() }
    }
}

/// A block index as checkpoints write it: decimal digits, no sign, no leading
/// zero (`"01"` and `"+1"` would otherwise join block 1).
fn canonical_index(seg: &str) -> bool {
    !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) && (seg == "0" || !seg.starts_with('0'))
}

fn split_block_name(name: &str) -> Option<(&str, usize)> {
    let mut start = 0;
    for seg in name.split('.') {
        let end = start + seg.len();
        if start > 0 && canonical_index(seg) && end < name.len() {
            return Some((&name[..start - 1], seg.parse().ok()?));
        }
        start = end + 1;
    }
    None
}

fn check_unique(tensors: &[TensorSpec]) -> Result<()> {
    let mut seen = HashSet::new();
    for t in tensors {
        if !seen.insert(t.name.as_str()) {
            return Err(Error::BadTensor { tensor: t.name.clone(), fault: "named twice".into() });
        }
    }
    Ok(())
}

fn assemble(
    component: &str,
    order: Vec<String>,
    mut groups: HashMap<String, BTreeMap<usize, Vec<TensorSpec>>>,
    non_block: Vec<TensorSpec>,
) -> ComponentInventory {
    let stacks = order
        .into_iter()
        .map(|name| {
            let blocks = groups
                .remove(&name)
                .unwrap_or_default()
                .into_iter()
                .map(|(index, tensors)| BlockSpec { id: BlockId::new(name.clone(), index), tensors })
                .collect();
            StackSpec { name, blocks }
        })
        .collect();
    ComponentInventory { name: component.to_owned(), stacks, non_block }
}

impl BlockDiscovery for NameDiscovery {
    fn discover(&self, component: &str, tensors: &[TensorSpec]) -> Result<ComponentInventory> {
        check_unique(tensors)?;
        let mut order: Vec<String> = Vec::new();
        let mut groups: HashMap<String, BTreeMap<usize, Vec<TensorSpec>>> = HashMap::new();
        for t in tensors {
            if let Some((stack, index)) = split_block_name(&t.name) {
                if !groups.contains_key(stack) {
                    order.push(stack.to_owned());
                }
                groups.entry(stack.to_owned()).or_default().entry(index).or_default().push(t.clone());
            }
        }
        let mut non_block = Vec::new();
        let mut kept = Vec::new();
        for name in order {
            let g = &groups[&name];
            let contiguous = g.len() >= 2 && g.keys().copied().eq(0..g.len());
            if contiguous {
                kept.push(name);
            } else {
                let g = groups.remove(&name).unwrap_or_default();
                non_block.extend(g.into_values().flatten());
            }
        }
        // Non-block tensors in checkpoint order.
        let blocked: HashSet<&str> = groups.values().flat_map(|g| g.values().flatten()).map(|t| t.name.as_str()).collect();
        let non_block_names: HashSet<String> = non_block.iter().map(|t| t.name.clone()).collect();
        let non_block =
            tensors.iter().filter(|t| !blocked.contains(t.name.as_str()) || non_block_names.contains(&t.name)).cloned().collect();
        Ok(assemble(component, kept, groups, non_block))
    }
}

impl BlockDiscovery for DeclaredStacks {
    fn discover(&self, component: &str, tensors: &[TensorSpec]) -> Result<ComponentInventory> {
        check_unique(tensors)?;
        let mut groups: HashMap<String, BTreeMap<usize, Vec<TensorSpec>>> = HashMap::new();
        let mut non_block = Vec::new();
        'next: for t in tensors {
            for stack in &self.stacks {
                if let Some(rest) = t.name.strip_prefix(stack.as_str()).and_then(|r| r.strip_prefix('.')) {
                    if let Some((index, _)) = rest.split_once('.').filter(|(i, _)| canonical_index(i)) {
                        if let Ok(index) = index.parse::<usize>() {
                            groups.entry(stack.clone()).or_default().entry(index).or_default().push(t.clone());
                            continue 'next;
                        }
                    }
                }
            }
            non_block.push(t.clone());
        }
        for stack in &self.stacks {
            let g = groups
                .get(stack)
                .ok_or_else(|| Error::Plan(format!("component {component:?}: declared stack {stack:?} has no tensors")))?;
            if let Some(missing) = (0..g.len()).find(|i| !g.contains_key(i)) {
                return Err(Error::Plan(format!("component {component:?}: stack {stack:?} has no block {missing} but has later ones")));
            }
        }
        Ok(assemble(component, self.stacks.clone(), groups, non_block))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    fn t(name: &str) -> TensorSpec {
        TensorSpec::new(name, DType::BF16, [4, 4])
    }

    #[test]
    fn names_from_flux_diffusers_and_llama() {
        let names = [
            "img_in.weight",
            "double_blocks.0.img_attn.qkv.weight",
            "double_blocks.1.img_attn.qkv.weight",
            "double_blocks.0.img_mlp.0.weight",
            "single_blocks.0.linear1.weight",
            "single_blocks.1.linear1.weight",
            "final_layer.adaLN_modulation.1.weight",
            "transformer_blocks.0.ff.net.0.proj.weight",
            "transformer_blocks.1.ff.net.0.proj.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
        ];
        let tensors: Vec<_> = names.iter().map(|n| t(n)).collect();
        let inv = NameDiscovery.discover("transformer", &tensors).unwrap();
        let stacks: Vec<_> = inv.stacks.iter().map(|s| (s.name.as_str(), s.blocks.len())).collect();
        assert_eq!(stacks, [("double_blocks", 2), ("single_blocks", 2), ("transformer_blocks", 2), ("model.layers", 2)]);
        assert_eq!(inv.stacks[0].blocks[0].tensors.len(), 2);
        let nb: Vec<_> = inv.non_block.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(nb, ["img_in.weight", "final_layer.adaLN_modulation.1.weight"]);
    }

    #[test]
    fn duplicate_names_are_errors() {
        let err = NameDiscovery.discover("c", &[t("a.0.w"), t("a.0.w")]).unwrap_err();
        assert!(err.to_string().contains("a.0.w"), "{err}");
    }

    #[test]
    fn declared_stacks_report_gaps() {
        let d = DeclaredStacks::new(["blocks"]);
        let err = d.discover("c", &[t("blocks.0.w"), t("blocks.2.w")]).unwrap_err();
        assert!(err.to_string().contains("no block 1"), "{err}");
        let inv = d.discover("c", &[t("blocks.0.w"), t("blocks.1.w"), t("head.w")]).unwrap();
        assert_eq!(inv.stacks[0].blocks.len(), 2);
        assert_eq!(inv.non_block.len(), 1);
    }

    /// `01` and `+1` are no block index: read as numbers they would join block
    /// 1's tensors to another's, and a short name could then bind the wrong one.
    #[test]
    fn only_canonical_indices_name_blocks() {
        let names = [t("blocks.0.w"), t("blocks.1.w"), t("blocks.01.w"), t("blocks.+1.v")];
        for inv in [NameDiscovery.discover("c", &names).unwrap(), DeclaredStacks::new(["blocks"]).discover("c", &names).unwrap()] {
            let blocks = &inv.stacks[0].blocks;
            assert_eq!(blocks.len(), 2);
            assert!(blocks.iter().all(|b| b.tensors.len() == 1), "a block took another index's tensor: {blocks:?}");
            assert_eq!(inv.non_block.len(), 2, "{:?}", inv.non_block);
        }
    }
}
