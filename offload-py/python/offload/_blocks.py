"""The module's blocks as the package sees them: block lists found in the module
tree, each block's streamed parameters and how they are bound over its buffer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ._placeholder import _Placeholder


def find_blocks(module: nn.Module) -> list[str]:
    """The module's block lists: the outermost ``nn.ModuleList`` and
    ``nn.Sequential`` children, at any depth, whose items are at least two
    modules of one class that hold parameters and have a forward of their own
    (``transformer_blocks``, ``encoder.block``, ``layers``). Their items are
    the blocks; everything else stays resident. A list of lists (diffusers'
    ``StableCascadeUNet``'s ``down_blocks``) is not one: its items are never
    called; the lists inside it are looked into instead."""
    found: list[str] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.Sequential)) and _is_block_list(child):
                found.append(path)
                continue
            walk(path + ".", child)

    walk("", module)
    return found


def _is_block_list(m: nn.Module) -> bool:
    items = list(m.children())
    if len(items) < 2 or len({type(c) for c in items}) != 1 or not _called(items[0]):
        return False
    return all(any(True for _ in c.parameters()) for c in items)


def _called(m: nn.Module) -> bool:
    """Whether ``m`` has a forward of its own: a container without one
    (``nn.ModuleList``, ``nn.ModuleDict``) is never called, so a block of it
    would never have its weights bound."""
    return type(m).forward is not nn.Module.forward


def _contiguous(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    return tuple(torch.empty(tuple(shape), device="meta").stride())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one span of its storage (any order): what
    ``empty_like`` keeps the strides of."""
    return tuple(torch.empty_like(t, device="meta").stride()) == tuple(t.stride())


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


@dataclass
class _Param:
    """A streamed parameter: where it sits, its placeholder, its data to restore."""

    owner: nn.Module
    attr: str
    param: nn.Parameter
    saved: Optional[torch.Tensor]
    where: torch.device
    dtype: torch.dtype
    shape: tuple
    offset: int = 0
    nbytes: int = 0
    pinned: bool = False
    # A parameter subclass the block's views are wrapped in again (diffusers'
    # GGUFParameter, which carries its quant type), or None for a plain one.
    rewrap: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    # Its name in the module, for errors.
    name: str = ""
    # Its strides: contiguous, or those it had when enabled where it was dense in
    # another order (a channels-last kernel), its bytes then streamed in that
    # order, so that each kernel reads them as it did resident; made again on disable.
    layout: tuple = ()
    # What the module holds in its place while offloaded (`_Placeholder`).
    holder: Optional[torch.Tensor] = None


@dataclass
class _Moved:
    """A resident tensor moved to the device: put back on disable."""

    owner: nn.Module
    attr: str
    is_param: bool
    saved: torch.Tensor
    # A parameter built on the meta device is swapped for a new one holding the
    # checkpoint's bytes (a meta tensor cannot take real data): `saved` is then
    # the parameter object itself, put back on disable.
    swapped: bool = False


@dataclass
class _Block:
    stack: str
    index: int
    params: list = field(default_factory=list)
    # How the block is bound, worked out once from its layout (`prepare`): it
    # runs for every block of every step, so the loops touch tuples only.
    dtypes: tuple = ()
    views: list = field(default_factory=list)
    sliced: list = field(default_factory=list)
    restore: list = field(default_factory=list)
    # Per tensor, what its placeholder was once the module was offloaded: the
    # dict holding it, its name there, the object, its version counter, dtype,
    # device and shape (`seal`). A tensor replaced, edited or converted since
    # would not stream: the block's bytes are the enabled ones.
    held: list = field(default_factory=list)
    same: list = field(default_factory=list)
    # The block's module and the id of the package's post-hook on it, moved to the
    # end of the module's forward hooks at each bind: a hook the user adds while
    # offloaded runs before the block is given back, and sees its weights.
    module: Optional[nn.Module] = None
    post_hook: int = -1
    # Bound at the block's start, not at the first use of a weight: a block
    # holding a parameter subclass (diffusers' GGUFParameter), whose layer calls
    # the subclass's own methods, which a placeholder does not have.
    eager: bool = False
    # The handles of the package's pre- and post-hook on the block's module.
    handles: tuple = ()
    # Kept resident by the automatic plan (a host-bound step): its buffer, bound
    # for good, and per tensor the view the module holds (`Offloaded._keep`).
    kept: Optional[torch.Tensor] = None
    kept_views: list = field(default_factory=list)
    # Its bytes (the span its tensors cover in its buffer) and its place among
    # the module's blocks: what a compiled graph's ops name it by (`_traced`).
    nbytes: int = 0
    at: int = -1
    # Where the block keeps a view of its lent bytes as a plain attribute of one
    # of its modules (`self.cache = self.weight`): (module, name) pairs, looked
    # for after its first lent forward (None before), copied off the slot after
    # each forward (`_hooks._off_the_slot`).
    stashes: Optional[list] = None

    def prepare(self) -> None:
        """Split the parameters into those bound by one strided view over the
        buffer seen as their dtype (offset a multiple of the item size) and
        those sliced first (any other offset, or no bytes)."""
        self.views, self.sliced = [], []
        for p in self.params:
            size = p.dtype.itemsize
            if p.nbytes == 0 or p.offset % size:
                self.sliced.append(p)
            else:
                self.views.append((p.owner._parameters, p.attr, p.dtype, p.shape, p.layout, p.offset // size, p.rewrap))
        self.dtypes = tuple(dict.fromkeys(v[2] for v in self.views))
        self.eager = any(p.rewrap is not None for p in self.params)
        self.restore = [(p.owner._parameters, p.attr, p.holder) for p in self.params]
        self.nbytes = max((p.offset + p.nbytes for p in self.params), default=0)

    def seal(self) -> None:
        """Record every placeholder as it is now, once the module is offloaded.
        A plain placeholder cannot change (it refuses every edit, conversion and
        new data): its block checks it is still the one in its place. Another
        holder (one rewrapped in a parameter class of its own) is checked for
        edits and conversions as well: each of those reads is a torch function
        call on a subclass, host time on every block of every step."""
        self.same = [(p.owner._parameters, p.attr, p.holder, p) for p in self.params if type(p.holder) is _Placeholder]
        self.held = [(p.owner._parameters, p.attr, p.holder, p.holder._version, p.holder.dtype, p.holder.device, p.holder.shape, p)
                     for p in self.params if type(p.holder) is not _Placeholder]


class _Saved:
    """A block weight autograd saved for the backward: where it lies in its block."""

    __slots__ = ("block", "dtype", "shape", "stride", "offset")

    def __init__(self, block, dtype, shape, stride, offset):
        self.block, self.dtype, self.shape, self.stride, self.offset = block, dtype, shape, stride, offset


class _Cast:
    """A cast of a block weight autograd saved for the backward (layerwise
    casting's compute copy): the parameter, the dtype, and where in the cast."""

    __slots__ = ("block", "param", "dtype", "shape", "stride", "offset")

    def __init__(self, block, param, dtype, shape, stride, offset):
        self.block, self.param, self.dtype, self.shape, self.stride, self.offset = block, param, dtype, shape, stride, offset


class _Dequant:
    """A GGUF layer's dequantized weight autograd saved for the backward
    (diffusers' ``GGUFLinear`` dequantizes its weight into a new tensor at each
    forward): the layer, its parameter, and where in the dequantized tensor."""

    __slots__ = ("block", "layer", "param", "shape", "stride", "offset")

    def __init__(self, block, layer, param, shape, stride, offset):
        self.block, self.layer, self.param, self.shape, self.stride, self.offset = block, layer, param, shape, stride, offset


class _SavedParam:
    """A block weight autograd saved as the module held it: the placeholder in
    its place, which a hand-written autograd function is given where its block
    binds at the weight's first use (inside the function's forward). Its
    parameter's view comes back in the backward."""

    __slots__ = ("block", "param")

    def __init__(self, block, param):
        self.block, self.param = block, param


# Marks a value saved by the hooks beneath ours (`_pack` hands them what is not a weight).
_Outer = object()
