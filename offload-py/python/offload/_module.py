"""Streaming one ``torch.nn.Module``: finding its blocks, the hooks around them,
and putting the module back exactly as it was."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from ._offload import OffloadError, Streamer, safetensors_read, safetensors_tensors

_STATE = "_offload_state"
# Set on a parameter while its bytes stream (the component's name), so that
# enabling a submodule of an offloaded module is refused.
_STREAMED_BY = "_offload_streamed_by"

_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

_GiB = 1 << 30


class _ArgumentTypeError(OffloadError, TypeError):
    """An argument of the wrong type: an :class:`OffloadError` that is also the
    ``TypeError`` Python raises for one."""


class _ArgumentValueError(OffloadError, ValueError):
    """An argument of the right type and a wrong value: an :class:`OffloadError`
    that is also the ``ValueError`` Python raises for one."""
# diffusers hooks that compose with streaming: layerwise casting (`enable_layerwise_casting`).
_COMPOSES = {"layerwise_casting", "peft_autocast_disable"}


def _verb(func) -> str:
    name = func.__name__.split(".")[0]
    if name in ("_to_copy", "to", "_has_compatible_shallow_copy_type"):
        return "converted"
    if name in ("clone", "_copy_from", "lift_fresh"):
        return "copied"
    if name.endswith("_") or name in ("set_", "copy_", "fill_"):
        return "edited in place"
    return "read"


class _Placeholder(torch.Tensor):
    """What a streamed parameter's place in the module holds while offloaded: a
    tensor of its shape, dtype and device with no bytes (``numel()``,
    ``model.num_parameters()``, ``.device`` and ``.dtype`` are the real ones).
    Its bytes are in the engine's store and reach the block only around its
    forward, so every operation on it — an edit in place (also through
    ``.data``), a read, a conversion, a copy, ``.untyped_storage()``,
    ``set_`` — raises :class:`OffloadError` naming it, instead of acting on
    nothing and being silently lost."""

    @staticmethod
    def __new__(cls, shape, dtype, device, requires_grad, component, name):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad)
        t._offload_where = (component, name)
        # The handle, the block and the parameter it stands for (set by enable):
        # the first use of a weight of the block being run binds that block.
        t._offload_lazy = None
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_bytes(func):
            state = _arming(args, kwargs)
            if state is not None:
                # Its block is bound now: the call runs on the views in its place.
                return func(*_swap(args, state), **{k: _swap1(v, state) for k, v in kwargs.items()})
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) and isinstance(first, _Placeholder):
            # `.detach()`, `.data`, `nn.Parameter(...)`: another placeholder of the same tensor.
            return _Placeholder(first.shape, first.dtype, first.device, False, *first._offload_where)
        if func is torch.ops.aten.is_pinned.default:
            return False
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        at = next((a for a in leaves if isinstance(a, _Placeholder)), None)
        component, name = at._offload_where if at is not None else ("?", "?")
        raise OffloadError(_refusal(component, name, f"{_verb(func)} ({func.__name__})"))

    def __repr__(self, *, tensor_contents=None) -> str:
        component, name = self._offload_where
        return (f"OffloadedParameter({name!r} of component {component!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}: streamed, its bytes in the engine's store)")

    @property
    def data(self):
        lazy = self._offload_lazy
        if lazy is not None and lazy[0]._armed is lazy[1] and lazy[0]._mine():
            lazy[0]._lend(lazy[1])
            return lazy[0]._view_of(self).data
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value):
        if value is self:  # `Module.to()` with nothing to change sets it to itself
            return
        lazy = self._offload_lazy
        if lazy is not None and lazy[0]._bound is lazy[1] and lazy[0]._mine():
            # Its block is bound (`Module._apply` bound it reading this placeholder,
            # as a layer's cast does around its forward): the view in its place takes it.
            lazy[0]._view_of(self).data = value
            return
        raise OffloadError(_refusal(*self._offload_where, "given other data (.data = ...)"))

    def untyped_storage(self):
        raise OffloadError(_refusal(*self._offload_where, "read through its storage (untyped_storage)"))

    def data_ptr(self):
        raise OffloadError(_refusal(*self._offload_where, "read through its address (data_ptr)"))

    def __reduce_ex__(self, protocol):
        raise OffloadError(_refusal(*self._offload_where, "copied, pickled or saved"))

    def __deepcopy__(self, memo):
        raise OffloadError(_refusal(*self._offload_where, "copied, pickled or saved"))


def _swap1(a, state):
    """``a`` with its placeholders (itself, or in a list or tuple, nested) the
    views in their place: a hand-written map, not pytree's (host time on the
    first weight use of every block of every step)."""
    if type(a) is _Placeholder:
        return state._view_of(a)
    if isinstance(a, (list, tuple)) and any(type(x) is _Placeholder or isinstance(x, (list, tuple)) for x in a):
        out = [_swap1(x, state) for x in a]
        return out if isinstance(a, list) else tuple(out) if type(a) is tuple else type(a)(*out)
    return a


def _swap(args: tuple, state) -> tuple:
    return tuple(_swap1(a, state) for a in args)


# What a placeholder answers without its bytes: reading them does not bind its block.
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "numel", "stride", "element_size", "is_floating_point",
                       "is_complex", "is_contiguous", "requires_grad_", "__repr__", "__format__", "is_pinned", "__hash__",
                       "nelement", "ndimension", "get_device"})


# Properties that compute from the bytes (`w.T` in `x @ w.T`): their access binds.
_COMPUTED_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def _reads_bytes(func) -> bool:
    """Whether a torch function on a placeholder needs its bytes (and binds its
    block): every one but its metadata (shape, dtype, device, requires_grad, ...)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", "") in _COMPUTED_PROPERTIES
    return name not in _METADATA


def _arming(args, kwargs) -> Optional["Offloaded"]:
    """Bind the block of the first placeholder among ``args`` whose block this
    thread is running and has not bound yet (lazily: a block whose forward never
    uses its weights, a cache returning its output, is never copied). Its
    handle, or None."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            found = _arming(a, {})
            if found is not None:
                return found
        elif type(a) is _Placeholder:
            lazy = a._offload_lazy
            if lazy is not None and lazy[0]._armed is lazy[1] and lazy[0]._mine():
                lazy[0]._lend(lazy[1])
                return lazy[0]
            if lazy is not None and lazy[0]._bound is lazy[1] and lazy[0]._mine():
                return lazy[0]  # bound already: a placeholder kept from before its bind
    return None


def _refusal(component: str, name: str, what: str) -> str:
    return (f"component {component!r}: tensor {name!r} streams while offloaded and cannot be {what}: its bytes are in the "
            "engine's store and reach the block only around its forward (a block is a module the model calls; one whose "
            "weights are used without calling it cannot stream). disable (which puts back the tensors as enabled), change "
            "the module, then enable again")


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


# Marks a value saved by the hooks beneath ours (`_pack` hands them what is not a weight).
_Outer = object()


class Offloaded:
    """A module whose blocks stream through the Rust engine. Made by
    :func:`enable`; :meth:`disable` (or :func:`disable` on the module) puts it
    back."""

    def __init__(self) -> None:
        self.component: str = ""
        self.device: torch.device = torch.device("cpu")
        self._streamer: Optional[Streamer] = None
        self._blocks: dict[nn.Module, _Block] = {}
        self._params: dict[str, _Param] = {}
        self._moved_tensors: list[_Moved] = []
        self._hooks: list = []
        self._engine_stream = None
        # The engine's compute stream as torch's raw handle and its device's index:
        # compared at every block, where making a `torch.cuda.Stream` costs host time.
        self._engine_raw = (0, 0)
        self._last_metrics: Optional[dict] = None
        self._steps = 0
        # The depth is the package's to choose (no depth, budget or calibration
        # given): the second step is traced, and the depth chosen at its end.
        self._auto = False
        self._traced_by_user = False
        self.module: Optional[nn.Module] = None
        self._bound: Optional[_Block] = None
        # Blocks run in the step under way: a block asked for again begins the
        # next step (a component the pipeline calls through another method than
        # forward, a VAE's decode, has no forward hook to end its steps).
        self._ran: set = set()
        # Inside the module's forward (its pre-hook to its step hook): there a
        # block run twice is the model's own doing, not the next step. A step hook
        # outside it (a pre-hook raised first) has no step to end.
        self._in_forward = False
        self._buffer = None
        self._version: Optional[int] = None
        self._stream = None
        # The thread inside the module (a forward, or a block bound outside one),
        # and whether a block's bind took it (given back at its unbind): the ring
        # serves one caller at a time, so a second thread is refused at entry.
        self._owner: Optional[int] = None
        self._owned_by_block = False
        self._lock = threading.Lock()
        # Lazy binding: the block whose forward runs and whose weights are not
        # bound yet, and how many blocks this step ran without using them.
        self._lazy = True
        self._armed: Optional[_Block] = None
        self._skipped = 0
        # Backward streaming: the saved-tensor hooks pushed while a block is bound
        # in grad mode (and the hooks they sit on), whether the engine serves a
        # backward now, and that backward's step metrics.
        self._saving: Optional[tuple] = None
        self._backward = False
        # The last step of each pass (forward, backward).
        self._by_pass: list = [None, None]
        # Host tensors a block moves to the device itself (a rotary table the
        # model makes on the host): learned in its first forward (`_Watch`), then
        # moved once a step, page-locked and without a host sync, before the
        # block's weights are lent, so the block's own copy finds them there
        # instead of queueing a pageable copy and a stream sync behind the
        # prefetch on the copy engine. Per block: the paths of those arguments;
        # the watch of the block being learned; this step's moved tensors.
        self._moves: dict = {}
        self._watch: Optional[tuple] = None
        self._moved: dict = {}

    @property
    def steps(self) -> int:
        """Steps ended since enabling (forward and backward passes alike)."""
        return self._steps

    def __reduce_ex__(self, protocol):
        raise OffloadError(f"component {self.component!r}: an offloaded module cannot be copied, pickled or saved (its block "
                           "weights are in the engine's store); disable it first")

    def __deepcopy__(self, memo):
        return self.__reduce_ex__(2)

    # -- public ---------------------------------------------------------------
    def metrics(self, which: str = "last") -> dict:
        """The last step's metrics (bytes streamed, prefetch hits, misses, host
        waits, device bytes, ...; a step is one forward of the module, or
        for a module called through another method, such as a VAE's
        ``decode``, one pass over its blocks: a block run again begins the
        next step; a backward that brings the blocks back is a step of its
        own, ``"backward": True``). ``which``: ``"last"``, or the last
        ``"forward"`` or ``"backward"`` step."""
        if which not in ("last", "forward", "backward"):
            raise _ArgumentValueError(f"component {self.component!r}: which must be 'last', 'forward' or 'backward', not {which!r}")
        m = self._last_metrics if which == "last" else self._by_pass[which == "backward"]
        if m is None:
            raise OffloadError(f"component {self.component!r}: no {'' if which == 'last' else which + ' '}step has ended yet")
        return dict(m)

    def counters(self) -> dict:
        """The device's counters since enabling: host synchronisations
        (``syncs``; none in a steady-state step), copies, bytes copied, slot
        bytes live and at peak."""
        return dict(self._engine().counters())

    def probe_bandwidth(self, passes: int = 3) -> float:
        """Host-to-device bytes per second: every streamed block copied, the
        best of ``passes`` passes (synchronises the host; call it between steps)."""
        self._refuse_capture("probe_bandwidth")
        return self._engine().probe_bandwidth(passes)

    def host_bytes(self) -> tuple[int, int]:
        """Host bytes the store holds, and how many are page-locked."""
        return self._engine().host_bytes()

    def host_tier(self) -> dict:
        """How the host store holds the blocks: ``{"in_place": n, "copied": m,
        "copy_reason": ...}``. With ``checkpoint=``, a block is served in place
        from the file's pages when its tensors lie in the file as the store lays
        them out (one after another, each a multiple of 256 bytes from the
        block's first); otherwise it is copied, and the reason says why."""
        mapped, copied, why = self._engine().host_tier()
        return {"in_place": mapped, "copied": copied, "copy_reason": why}

    def enable_trace(self) -> None:
        """Time both streams from now on (a few events per block, and a wait
        for them at each step's end; it synchronises once now): write the last
        step with :meth:`write_trace`, read it with :meth:`diagnose`. Leave it
        off when timing the steady state (:meth:`disable_trace`)."""
        self._refuse_capture("enable_trace")
        self._engine().enable_timeline()
        self._traced_by_user = True

    def disable_trace(self) -> None:
        """Stop timing the streams (the recorded steps are dropped)."""
        self._engine().disable_timeline()
        self._traced_by_user = False

    def diagnose(self, link_gbps: Optional[float] = None) -> dict:
        """Why the last traced step was slower than its bound: call
        :meth:`enable_trace`, run a step (the first one after enabling learns
        the block order: run two), then this.

        Each wait of the compute stream for a block's copy is charged to what
        held the copy back: ``"link"`` (copies back to back at the link's rate:
        a copy-bound step), ``"late"`` (the copy stream sat idle before the copy:
        issued too late behind a short block; a larger ``depth`` helps),
        ``"slot"`` (the copy waited for its slot's previous block to finish),
        ``"shared_link"`` (the copy ran slower than the link: the model's own
        host-to-device copies shared it); and ``"host"`` names a host that
        needed about the device's whole step (Python time per block, or a host
        synchronisation inside a block). Returns ``{"summary": str, "verdict":
        cause or None, "causes": {cause: seconds}, "waits": [{"block", "wait_s",
        "by_cause", "copy_gbps", ...}], "step_s", "compute_s", "wait_s",
        "between_s", "host_s", "host_blocks", "link_gbps", ...}`` and
        ``"host_tables"``: the host tensors the package moves once a step for
        the blocks (their bytes share the link). ``link_gbps``: the link's
        rate to measure copies against (:meth:`probe_bandwidth` ÷ 1e9), else
        the step's fastest copy."""
        if link_gbps is not None and (isinstance(link_gbps, bool) or not isinstance(link_gbps, numbers.Real)):
            raise _ArgumentTypeError(f"component {self.component!r}: link_gbps must be a number of GB/s, not {link_gbps!r}")
        if link_gbps is not None and not (math.isfinite(link_gbps) and link_gbps > 0):
            raise _ArgumentValueError(f"component {self.component!r}: link_gbps must be a finite number above 0, not {link_gbps!r}")
        raw = self._engine().diagnose(None if link_gbps is None else float(link_gbps) * 1e9)
        if raw is None:
            raise OffloadError(f"component {self.component!r}: no traced step to diagnose: call enable_trace(), run a step, "
                               "then diagnose()")
        d = json.loads(raw)
        d["causes"] = {c: s for c, s in d["causes"]}
        d["host_blocks"] = {b: s for b, s in d["host_blocks"]}
        for w in d["waits"]:
            w["by_cause"] = {c: s for c, s in w["by_cause"]}
        def where(path) -> str:
            kind, key, *inner = path
            return (f"args[{key}]" if kind == "a" else f"{key}=") + "".join(f"[{i}]" for i in inner)

        d["host_tables"] = {f"{b.stack}.{b.index}": [where(p) for p in self._moves[id(b)]]
                            for b in self._blocks.values() if self._moves.get(id(b))}
        d["host_table_bytes"] = sum(h[2].nbytes for h in self._moved.values())
        return d

    def write_trace(self, path: str) -> None:
        """Write the last step's Chrome trace (Perfetto opens it)."""
        self._engine().write_trace(str(path))

    def plan(self) -> dict:
        """The plan the ring runs and why: ``{"depth": d, "resident_blocks":
        [...], "chosen_by": "given" | "budget" | "auto", "why": str}``.
        ``"auto"`` (no ``depth`` given): the package timed its second step and
        chose the depth from it (the replay of that step at each depth, ``why``
        lists the predictions); until then the depth is 1 and ``why`` says the
        choice is pending. ``"budget"``: the planner's choice under
        ``budget_gib``; ``"given"``: what was asked."""
        depth, resident, chosen_by, why = self._engine().plan()
        if self._auto and chosen_by == "given":
            chosen_by, why = "auto", "depth 1 until the second step ends: the package then times it and chooses the depth"
        return {"depth": depth, "resident_blocks": list(resident), "chosen_by": chosen_by, "why": why}

    def calibration(self, compute_s: Optional[dict] = None) -> dict:
        """This module's cost model, for :func:`enable`'s ``calibration=``: each
        block's bytes and compute time and the link's bandwidth (probed now; it
        synchronises). The compute times are the traced steps' (call
        :meth:`enable_trace`, run a step, then this; CUDA), or ``compute_s``
        (``{"transformer_blocks.0": seconds, ...}``, every block). Take it from
        a ring that is not coded."""
        self._refuse_capture("calibration")
        return json.loads(self._engine().calibration(compute_s))

    def violations(self) -> list[str]:
        """Breaks of the ring's protocol the engine saw (expected: none)."""
        return self._engine().violations()

    def disable(self) -> None:
        """Put the module back: hooks removed, every parameter and buffer the
        same object with the same bytes on the device it was on. An error once
        this handle's offloading has ended (a later :func:`enable` of the same
        module has a handle of its own)."""
        if self.module is None or offloaded(self.module) is not self:
            raise OffloadError(f"component {self.component!r}: this handle's offloading was disabled already")
        disable(self.module)

    # -- hooks ----------------------------------------------------------------
    def _refuse_capture(self, what: str) -> None:
        """An error while torch's current stream on this device is being captured
        into a CUDA graph. The engine checks its own compute stream; this checks
        the caller's, which is where ``torch.cuda.graph`` captures (a side stream
        of its own), so that a capture is refused before the engine issues or
        waits on anything."""
        if self.device.type == "cuda" and _capturing(self.device):
            raise OffloadError(
                f"component {self.component!r}: {what} while torch's current stream is being captured into a CUDA graph "
                "(torch.cuda.graph, torch.compile's \"reduce-overhead\"): a replay would repeat the engine's copies from "
                "host memory it no longer holds; run the offloaded module outside capture"
            )

    def _claim(self, by_block: bool) -> None:
        """Take the module for this thread, or refuse it by name while another
        thread is inside (before anything is bound or lent)."""
        me = threading.get_ident()
        with self._lock:
            owner = self._owner
            if owner is None:
                self._owner, self._owned_by_block = me, by_block
                return
        if owner != me:
            raise OffloadError(
                f"component {self.component!r}: called from a second thread while another one is inside it: an offloaded "
                "module serves one caller at a time (its blocks share one ring of device slots). Call it from one thread, "
                "or enable one copy of the module per thread"
            )

    def _mine(self) -> bool:
        return self._owner == threading.get_ident()

    def _release(self) -> None:
        with self._lock:
            self._owner, self._owned_by_block = None, False

    def _changed(self, p: _Param, now: Any) -> str:
        """What happened to streamed tensor ``p`` since enable, as an error's text."""
        again = "disable (which puts back the tensors as enabled), change the module, then enable again"
        head = f"component {self.component!r}: tensor {p.name!r}"
        if now is not p.holder:
            what = "removed" if now is None else f"a {type(now).__name__} of {getattr(now, 'dtype', '?')}"
            return f"{head} was replaced while offloaded (the module now holds {what}); its block streams the enabled bytes, so {again}"
        if p.holder.dtype != p.dtype or p.holder.device != self.device:
            return (f"{head} was converted to {p.holder.dtype} on {p.holder.device} while offloaded (it streams as {p.dtype} to "
                    f"{self.device}); disable, convert, then enable again")
        return (f"{head} was changed while offloaded (edited in place or given other data: the module holds an empty "
                f"placeholder for it); its block streams the enabled bytes, so {again}")

    def _engine(self) -> Streamer:
        if self._streamer is None:
            raise OffloadError(f"component {self.component!r}: offloading is disabled")
        return self._streamer

    def _bind(self, block: _Block) -> None:
        """The block's pre-hook: armed, its weights bound at their first use
        (:func:`_arming`), or at once where ``lazy=False``."""
        self._arm(block)
        if not self._lazy or block.eager:
            self._lend(block)

    def _inputs(self, block: _Block, args, kwargs):
        """The block's pre-hook's new arguments on CUDA (or None): its host tensors
        that it moves to the device, moved once a step (learned in its first forward)."""
        paths = self._moves.get(id(block))
        if paths is None:
            if self._watch is not None:
                # A block called inside another's first forward: learned on a later call.
                return None
            hosts = _host_tensors(args, kwargs)
            self._moves[id(block)] = ()
            if hosts:
                watch = _Watch(hosts)
                watch.__enter__()
                self._watch = (block, watch)
            return None
        if not paths:
            return None
        args, kwargs = list(args), dict(kwargs)
        for path in paths:
            where, key, *inner = path
            box = args if where == "a" else kwargs
            if (key >= len(box)) if where == "a" else (key not in box):
                continue
            top = box[key]
            t = top[inner[0]] if inner and isinstance(top, (tuple, list)) and inner[0] < len(top) else (None if inner else top)
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            hit = self._moved.get(id(t))
            if hit is None or hit[0] is not t or hit[1] != t._version:
                # Page-locked first: the copy is then asynchronous, no host sync.
                hit = (t, t._version, t.pin_memory().to(self.device, non_blocking=True))
                self._moved[id(t)] = hit
            if inner:
                top = list(top)
                top[inner[0]] = hit[2]
                box[key] = tuple(top) if isinstance(box[key], tuple) else top
            else:
                box[key] = hit[2]
        return tuple(args), kwargs

    def _end_watch(self, block: _Block) -> None:
        if self._watch is not None and self._watch[0] is block:
            watch = self._watch[1]
            self._watch = None
            watch.__exit__(None, None, None)
            self._moves[id(block)] = tuple(sorted(watch.moved, key=str))

    def _view_of(self, ph: torch.Tensor) -> torch.Tensor:
        """What the module holds now in place of placeholder ``ph``: its view
        while its block is bound, else the placeholder."""
        lazy = ph._offload_lazy
        if lazy is None or self._bound is not lazy[1]:
            return ph
        p = lazy[2]
        return p.owner._parameters[p.attr]

    def _arm(self, block: _Block) -> None:
        self._claim(by_block=not self._in_forward)
        if self._bound is not None or self._armed is not None:
            self._unbind()
        if id(block) in self._ran and not self._in_forward:
            self._end_step()
        # Again: the unbind or the step's end above gave a block's claim back.
        self._claim(by_block=not self._in_forward)
        self._ran.add(id(block))
        hooks = block.module._forward_hooks
        if next(reversed(hooks), None) != block.post_hook:
            hooks.move_to_end(block.post_hook)
        for params, attr, prm, p in block.same:
            if params.get(attr) is not prm:
                raise OffloadError(self._changed(p, params.get(attr)))
        for params, attr, prm, version, dtype, device, shape, p in block.held:
            now = params.get(attr)
            if now is not prm or prm._version != version or prm.dtype != dtype or prm.device != device or prm.shape != shape:
                raise OffloadError(self._changed(p, now))
        self._refuse_capture(f"block {block.stack}.{block.index}")
        self._armed = block

    def _lend(self, block: _Block) -> None:
        """Bind ``block``'s weights: lent by the engine, views in the module."""
        self._armed = None
        buf = self._engine().lend(block.stack, block.index)
        if self.device.type == "cuda":
            raw, index = self._engine_raw
            if torch._C._cuda_getCurrentRawStream(index) != raw:
                cur = torch.cuda.current_stream(self.device)
                cur.wait_stream(self._engine_stream)
                self._stream = cur
            data = buf
        else:
            data = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        # Set first: if a view fails, the post hook's unbind still puts every
        # parameter back and gives the block back.
        self._bound = block
        self._buffer = data
        # Writes through the views bump the buffer's version counter (an inference
        # tensor has none: torch refuses in-place writes to it outside inference mode).
        self._version = None if data.is_inference() else data._version
        # One strided view per parameter over the buffer seen once per dtype
        # (slicing, reinterpreting and reshaping each would be three calls: host
        # time on every block of every step).
        n = data.numel()
        whole = {}
        for dt in block.dtypes:
            w = data[: n - n % dt.itemsize].view(dt)
            # as_strided counts its offset from the storage, not from the view.
            whole[dt] = (w.as_strided, w.storage_offset())
        for params, attr, dt, shape, stride, offset, rewrap in block.views:
            strided, base = whole[dt]
            view = strided(shape, stride, base + offset)
            params[attr] = view if rewrap is None else rewrap(view)
        for p in block.sliced:
            view = data[p.offset : p.offset + p.nbytes].view(p.dtype).as_strided(p.shape, p.layout)
            p.owner._parameters[p.attr] = view if p.rewrap is None else p.rewrap(view)
        if torch.is_grad_enabled():
            # What autograd saves of this block's weights for the backward is
            # saved as where it lies in the block, not as the block's buffer:
            # the buffer is let go after the forward, and the backward brings
            # the block back (`_unpack`). A recompute in the backward (gradient
            # checkpointing) saves the same way, so a checkpoint finds the same
            # tensors saved as in the forward.
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
            self._saving = (outer,)
        if torch.is_grad_enabled():
            # A streamed weight gets no gradient: one that asks for it makes the
            # backward an error naming it, never a gradient quietly left None.
            for p in block.params:
                if p.holder.requires_grad:
                    view = p.owner._parameters[p.attr]
                    if view.is_floating_point() and not view.requires_grad:
                        view.requires_grad_(True)
                        view.register_hook(_no_gradient(self.component, p.name))

    def _pack(self, t):
        """Autograd saves ``t`` for the backward: one of the bound block's
        weights (a view of its buffer, as `linear` saves `weight.t()`) is saved
        as its place in the block; anything else as the hooks below ours save it."""
        buf, block = self._buffer, self._bound
        if block is not None and buf is not None and type(t) is torch.Tensor and not t.requires_grad and t.device == buf.device:
            at = t.untyped_storage().data_ptr()
            if at == buf.untyped_storage().data_ptr():
                return _Saved(block, t.dtype, tuple(t.shape), t.stride(),
                              t.storage_offset() * t.element_size() - buf.storage_offset() * buf.element_size())
            # A weight a layer of the block cast for its compute (diffusers'
            # layerwise casting puts the cast in the parameter's place): saved as
            # that cast of its place in the block, made again in the backward.
            for p in block.params:
                now = p.owner._parameters.get(p.attr)
                if type(now) is torch.Tensor and now.dtype == t.dtype and now.untyped_storage().data_ptr() == at:
                    return _Cast(block, p, t.dtype, tuple(t.shape), t.stride(), t.storage_offset() - now.storage_offset())
        outer = self._saving[0] if self._saving else None
        return (_Outer, outer[1], outer[0](t)) if outer else t

    def _unpack(self, saved):
        """The backward asks for what `_pack` saved: a block's weight comes back
        from the block lent again (each block once, in the reverse order the
        engine learns for a backward), the rest from the hooks that saved it."""
        if isinstance(saved, tuple) and len(saved) == 3 and saved[0] is _Outer:
            return saved[1](saved[2])
        if isinstance(saved, _Cast):
            if self._bound is not saved.block:
                self._lend_for_backward(saved.block)
            cast = saved.param.owner._parameters[saved.param.attr].to(saved.dtype)
            return cast.as_strided(saved.shape, saved.stride, cast.storage_offset() + saved.offset)
        if not isinstance(saved, _Saved):
            return saved
        if self._bound is not saved.block:
            self._lend_for_backward(saved.block)
        buf = self._buffer
        n = buf.numel()
        size = saved.dtype.itemsize
        w = buf[: n - n % size].view(saved.dtype)
        return w.as_strided(saved.shape, saved.stride, w.storage_offset() + saved.offset // size)

    def _lend_for_backward(self, block: _Block) -> None:
        """Bind ``block`` for the backward (autograd's thread, between two of its
        nodes): the block bound before is given back (its kernels enqueued), the
        engine switched to its backward order at the backward's first block, and
        the backward's step ended when autograd's pass ends."""
        if self._bound is not None:
            self._unbind()
        if not self._backward:
            if self._ran or self._in_forward:
                self._end_step()
            self._claim(by_block=False)
            self._engine().set_backward(True)
            self._backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._ran.add(id(block))
        self._lend(block)

    def _end_abandoned_backward(self) -> None:
        """A backward that raised never reached its end (autograd runs its end
        callbacks only after a pass that completed): the next forward ends it,
        from whichever thread autograd used, so the module stays usable."""
        with self._lock:
            self._owner, self._owned_by_block = threading.get_ident(), False
        self._end_backward()

    def _end_backward(self) -> None:
        """Autograd's pass ended: the last block given back, the backward's step ended."""
        try:
            if self._bound is not None:
                self._unbind()
        finally:
            try:
                self._end_engine_step()
            finally:
                self._engine().set_backward(False)
                self._backward = False
                self._release()

    def _unbind(self) -> None:
        if self._saving is not None:
            self._saving = None
            torch._C._autograd._pop_saved_tensors_default_hooks()
        block, self._bound = self._bound, None
        if self._armed is not None:
            # Run without using its weights (a cache returned its output): never copied.
            self._armed = None
            self._skipped += 1
        if self._owned_by_block:
            # Given back even where nothing was bound (the bind raised first).
            self._release()
        if block is None:
            return
        for params, attr, param in block.restore:
            params[attr] = param
        if self._stream is not None:
            self._engine_stream.wait_stream(self._stream)
            self._buffer.record_stream(self._stream)
            self._stream = None
        wrote = self._version is not None and self._buffer._version != self._version
        self._buffer = None
        self._engine().give_back()
        if wrote:
            raise OffloadError(
                f"component {self.component!r}: block {block.stack}.{block.index} wrote its streamed weights in place during "
                "its forward; the write went to a lent copy that the next step no longer holds, so it would be lost. Keep "
                "state a block updates in a buffer (register_buffer), which stays resident, or make that parameter trainable"
            )

    def _end_step(self) -> None:
        try:
            if self._bound is not None or self._armed is not None:
                self._unbind()
        finally:
            self._end_engine_step()

    def _end_engine_step(self) -> None:
        self._ran.clear()
        self._moved.clear()
        self._in_forward = False
        if self.device.type == "cuda" and _capturing(self.device):
            # A forward refused under capture (nothing was lent): ending the
            # engine's step would poll its events, which a capture forbids; the
            # step goes on with the next forward outside capture.
            return
        self._last_metrics = json.loads(self._engine().end_step())
        # Blocks whose forward ran without reading their weights (a cache hit): not copied.
        self._last_metrics["skipped_blocks"], self._skipped = self._skipped, 0
        self._by_pass[bool(self._last_metrics.get("backward"))] = self._last_metrics
        self._steps += 1
        if self._auto:
            self._choose_depth()

    def _choose_depth(self) -> None:
        """The automatic depth: the second step timed, the depth chosen at its end."""
        engine = self._engine()
        if self._steps == 1:
            engine.enable_timeline()  # synchronises once
            return
        self._auto = False
        try:
            engine.choose_depth(4)
        finally:
            if not self._traced_by_user:
                engine.disable_timeline()


def _capturing(device: torch.device) -> bool:
    """Whether torch's current stream on ``device`` is being captured into a CUDA graph."""
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _no_gradient(component: str, name: str):
    def hook(grad):
        raise OffloadError(
            f"component {component!r}: tensor {name!r} streams and gets no gradient; freeze it "
            "(requires_grad_(False)) and train an adapter, or run the forward under torch.no_grad()"
        )

    return hook


def _refuse_state_dict(component: str, block: str):
    """The state_dict hook of a block and of each layer in it while offloaded:
    their parameters hold placeholders."""

    def hook(module, state_dict, prefix, local_metadata):
        raise OffloadError(
            f"component {component!r}: {block} streams its weights, so the state_dict of "
            f"{prefix.rstrip('.') or type(module).__name__} would hold empty placeholders; disable offloading first"
        )

    return hook


def _refuse_load_state_dict(component: str, block: str):
    def hook(state_dict, prefix, *args):
        raise OffloadError(
            f"component {component!r}: {block} streams its weights from the engine's store, so "
            f"{prefix.rstrip('.') or 'its layer'} cannot load a state_dict; disable offloading first"
        )

    return hook


# The deepest prefetch asked for: far beyond any model's block count (a depth at
# or above it streams every block ahead), and within every integer the engine takes.
_MOST_DEPTH = 1 << 16
# The largest budget in GiB: its bytes fit the engine's 64-bit counts.
_MOST_GIB = float(1 << 32)


def _count(component: str, what: str, value: Any, least: int, most: int = _MOST_DEPTH) -> int:
    if isinstance(value, bool):
        raise _ArgumentTypeError(f"component {component!r}: {what} must be an integer, not {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise _ArgumentTypeError(f"component {component!r}: {what} must be an integer, not {value!r}") from None
    if n < least or n > most:
        raise _ArgumentValueError(f"component {component!r}: {what} must be an integer from {least} to {most}, not {value!r}")
    return n


def _gib(component: str, what: str, value: Any, positive: bool) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _ArgumentTypeError(f"component {component!r}: {what} must be a number of GiB, not {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (positive and v == 0) or v > _MOST_GIB:
        raise _ArgumentValueError(
            f"component {component!r}: {what} must be a finite number of GiB{' above 0' if positive else ''}, at most "
            f"{_MOST_GIB:.0f}, not {value!r}"
        )
    return v


def _names(component: str, what: str, value: Any) -> list:
    """A list of names given as ``value`` (a string alone is refused: its letters would be taken as names)."""
    if isinstance(value, (str, bytes)):
        raise _ArgumentTypeError(f"component {component!r}: {what} must be a list of names, not the string {value!r} (give [{value!r}])")
    try:
        names = list(value)
    except TypeError:
        raise _ArgumentTypeError(f"component {component!r}: {what} must be a list of names, not {value!r}") from None
    for n in names:
        if not isinstance(n, str):
            raise _ArgumentTypeError(f"component {component!r}: {what} must hold names (strings), not {n!r}")
    return names


def _size(n: int) -> str:
    """Bytes for a person: in the largest unit that keeps a digit before the point."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


def _rewrap(p: torch.Tensor, component: str, name: str):
    """How a block's view of parameter ``p`` is bound: as it is for a plain
    parameter; wrapped again for diffusers' ``GGUFParameter`` (quantized bytes
    with their quant type, dequantised by ``GGUFLinear`` as it computes).
    Any other tensor subclass is refused by name: bound as plain bytes, its
    layer would compute with them as numbers."""
    if type(p) in (nn.Parameter, torch.Tensor):
        return None
    if type(p).__name__ == "GGUFParameter" and hasattr(p, "quant_type"):
        cls, qt = type(p), p.quant_type
        return lambda view: cls(view, requires_grad=False, quant_type=qt)
    raise OffloadError(
        f"component {component!r}: tensor {name!r} is a {type(p).__module__}.{type(p).__name__}, a tensor subclass "
        "the package cannot stream as stored (plain parameters, fp8 and diffusers' GGUF parameters can be)"
    )


def _refuse_other_offloading(module: nn.Module, component: str) -> None:
    for m in module.modules():
        if getattr(m, _STATE, None) is not None:
            raise OffloadError(f"component {component!r}: {type(m).__name__} is already offloaded by this package (disable it first)")
        reg = getattr(m, "_diffusers_hook", None)
        # Layerwise casting only changes a layer's dtype around its forward: it
        # composes with streaming (the blocks cross in the storage dtype, each
        # layer is upcast on the device as it would be resident).
        others = set(getattr(reg, "hooks", None) or ()) - _COMPOSES
        if others:
            names = ", ".join(sorted(others))
            raise OffloadError(f"component {component!r}: {type(m).__name__} has diffusers hooks ({names}); remove them first")
        if getattr(m, "_hf_hook", None) is not None:
            raise OffloadError(f"component {component!r}: {type(m).__name__} has an accelerate hook (remove_hook_from_module first)")


def _progress(desc: str, enabled: Optional[bool]):
    """A tqdm bar shown only once a build has run for a second (as diffusers shows one)."""
    if enabled is False:
        return None, None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=0, unit="B", unit_scale=True, desc=desc, delay=1.0, leave=False)

    def update(done: int, total: int) -> None:
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    return bar, update


@torch.inference_mode(False)
def enable(
    module: nn.Module,
    *,
    device: Any = None,
    depth: Optional[int] = None,
    budget_gib: Optional[float] = None,
    resident_blocks: Sequence[str] = (),
    coded: bool = False,
    checkpoint: Optional[str] = None,
    blocks: Optional[Iterable[str]] = None,
    pin_budget_gib: Optional[float] = None,
    pageable_fallback: bool = False,
    keep_host_copy: bool = False,
    name: Optional[str] = None,
    progress: Optional[bool] = None,
    calibration: Optional[dict] = None,
    lazy: bool = True,
) -> Offloaded:
    """Stream ``module``'s blocks from host memory to ``device``.

    The blocks are the items of the module's block lists (:func:`find_blocks`,
    or the attribute paths in ``blocks``); their weights move into the
    engine's host store (page-locked) and reach the device one block ahead of
    its forward (``depth`` blocks ahead), each copy overlapping the previous
    block's compute. Every other parameter and buffer moves to ``device`` and
    stays there. Parameters that require grad in a module whose other
    parameters are frozen (a trainable adapter) stay resident too.

    ``depth``: how many blocks ahead the copies run. Not given (and no
    ``budget_gib`` or ``calibration``), the package chooses it: it streams the
    first step at depth 1, times the second (a wait for the device at its end),
    replays that step at depths 1 to 4 and keeps the smallest within 1 % of the
    fastest (:meth:`Offloaded.plan` says what it chose and why).

    ``budget_gib``: device memory for the module's weights: the resident
    tensors, the ring's slots, and the blocks the planner keeps resident with
    what is left (those saving the most streamed bytes; it plans for a
    transfer-bound step, measuring no compute time). ``calibration``: what
    :meth:`Offloaded.calibration` returned for this module; with
    ``budget_gib`` the planner then replays the ring with its measured compute
    times and bandwidth and picks the depth (``depth`` or up to three deeper)
    and resident blocks that make the step shortest: the blocks kept are those
    whose copies the step would wait for. ``resident_blocks``: blocks kept on the device
    (``"transformer_blocks.0"``). ``coded``: the weights held coded for the
    device (lossless exponent coding, fewer bytes on the link; CUDA).
    ``checkpoint``: a safetensors file with the same tensors, served in place
    from its pages (no second copy in host memory); where the module holds
    its weights, each block tensor's bytes are compared with the file's, and
    one that differs (a fine-tuned or fused module) is an error naming it. A module built on the meta
    device (``with torch.device("meta"):``) takes its weights from it: the
    blocks' served from the file, the others read onto ``device``; a meta
    tensor the file lacks is an error naming it, and :func:`disable` puts the
    module back on the meta device. ``device=None``:
    the current CUDA device, or the simulated device in host memory without
    one. Enabling either completes or leaves the module as it was.

    ``lazy``: a block's weights are bound at their first use in its forward,
    not when it starts, so a block whose forward never reads them (a cache
    such as diffusers' FirstBlockCache returned its output) is never copied
    (``metrics()["skipped_blocks"]``). ``lazy=False`` binds at the block's
    start, for code that reads a block's weights outside torch's dispatch (an
    extension handed the parameter itself).

    The streamed weights are held once in host memory, in the engine's store:
    the module's own host tensors are let go, and :func:`disable` makes them
    again from the store's bytes (``keep_host_copy=True`` keeps them instead,
    at twice the host memory).
    """
    component = name or type(module).__name__
    auto = depth is None and budget_gib is None and calibration is None
    depth, resident_blocks, budget_gib, pin_budget_gib, dev, stacks = _arguments(
        module, component, depth, resident_blocks, budget_gib, pin_budget_gib, device, blocks, lazy)
    state = Offloaded()
    state.component, state.device, state.module = component, dev, module
    state._lazy = lazy
    state._auto = auto
    block_modules = _block_modules(state, module, stacks)
    all_params, in_block, tensors = _streamed_tensors(state, module, block_modules, checkpoint)
    from_file = _meta_from_file(module, component, all_params, in_block, checkpoint)
    budget_bytes = _budget_bytes(module, component, budget_gib, all_params, in_block)
    _start_engine(state, tensors, stacks, block_modules, depth=depth, budget_bytes=budget_bytes, resident_blocks=resident_blocks,
                  coded=coded, pin_budget_gib=pin_budget_gib, pageable_fallback=pageable_fallback, checkpoint=checkpoint,
                  progress=progress, calibration=calibration, keep_host_copy=keep_host_copy)
    _install(state, module, block_modules, all_params, from_file, checkpoint, keep_host_copy)
    return state


def _arguments(module, component, depth, resident_blocks, budget_gib, pin_budget_gib, device, blocks, lazy):
    """``enable``'s arguments checked, each error naming the component: the
    depth, resident blocks, budgets, the device and the block lists."""
    depth = _count(component, "depth", 1 if depth is None else depth, 1)
    resident_blocks = _names(component, "resident_blocks", resident_blocks)
    budget_gib = _gib(component, "budget_gib", budget_gib, positive=True)
    pin_budget_gib = _gib(component, "pin_budget_gib", pin_budget_gib, positive=False)
    _refuse_other_offloading(module, component)
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise OffloadError(f"component {component!r}: device {dev} is neither cpu (simulated) nor cuda")
    stacks = _names(component, "blocks", blocks) if blocks is not None else find_blocks(module)
    for i, a in enumerate(stacks):
        if not a:
            raise _ArgumentValueError(
                f"component {component!r}: blocks=['']: the module itself as its block list cannot stream (its blocks "
                "need a name to live under); hold the list in an attribute of a module (self.blocks = ...) and name that"
            )
        for b in stacks[:i]:
            if a == b:
                raise _ArgumentValueError(f"component {component!r}: block list {a!r} is named twice in blocks=")
            if a.startswith(b + ".") or b.startswith(a + "."):
                raise _ArgumentValueError(f"component {component!r}: block lists {b!r} and {a!r} overlap (one holds the other)")
    if not stacks:
        raise OffloadError(
            f"component {component!r}: {type(module).__name__} has no block list (no ModuleList of two or more "
            "modules of one class); name one with blocks=[...]"
        )
    if not isinstance(lazy, bool):
        raise _ArgumentTypeError(f"component {component!r}: lazy must be True or False, not {lazy!r}")
    if not isinstance(lazy, bool):
        raise _ArgumentTypeError(f"component {component!r}: lazy must be True or False, not {lazy!r}")
    return depth, resident_blocks, budget_gib, pin_budget_gib, dev, stacks


def _block_modules(state: Offloaded, module: nn.Module, stacks: list) -> list:
    """Every block of the block lists with its `_Block`, each list checked
    (every item a called module, numbered 0, 1, ...)."""
    component = state.component
    block_modules: list[tuple[nn.Module, _Block]] = []
    for prefix in stacks:
        try:
            lst = module.get_submodule(prefix)
        except AttributeError as e:
            raise OffloadError(f"component {component!r}: no block list {prefix!r} ({e})") from None
        for i, (cname, child) in enumerate(lst.named_children()):
            if not _called(child):
                raise OffloadError(
                    f"component {component!r}: block list {prefix!r} holds a {type(child).__name__} at {i}, which has no "
                    "forward and is never called, so its weights could not be bound around one; name the lists inside it"
                )
            if cname != str(i):
                raise OffloadError(f"component {component!r}: block list {prefix!r} names its item {i} {cname!r}; blocks are numbered 0, 1, ...")
            block_modules.append((child, _Block(prefix, i)))
            state._blocks[child] = block_modules[-1][1]
    return block_modules


def _streamed_tensors(state: Offloaded, module: nn.Module, block_modules: list, checkpoint):
    """The blocks' parameters that stream, each checked (dtype, ties, shared
    storage, already streamed) and recorded as a `_Param`: every parameter by
    name, the streamed ones' ids, and the engine's tensor list."""
    component = state.component
    all_params = dict(module.named_parameters(remove_duplicate=False))
    frozen_some = any(not p.requires_grad for p in all_params.values())
    in_block: dict[int, str] = {}
    # Storages of the streamed parameters: two views of one tensor would come back
    # from disable as two tensors, no longer sharing their bytes.
    storages: dict[int, str] = {}
    tensors = []
    for child, blk in block_modules:
        base = f"{blk.stack}.{blk.index}."
        for pname, p in child.named_parameters(remove_duplicate=False):
            full = base + pname
            if frozen_some and p.requires_grad:
                continue  # a trainable adapter: resident
            if p.dtype not in _DTYPES:
                raise OffloadError(f"component {component!r}: tensor {full!r} has dtype {p.dtype}, which cannot be streamed")
            if id(p) in in_block:
                raise OffloadError(f"component {component!r}: tensor {full!r} is tied to {in_block[id(p)]!r}; tied weights cannot be streamed")
            if getattr(p, _STREAMED_BY, None) is not None:
                raise OffloadError(
                    f"component {component!r}: tensor {full!r} already streams in component {getattr(p, _STREAMED_BY)!r} "
                    "(a module around this one is offloaded: disable it first)"
                )
            in_block[id(p)] = full
            if not p.is_meta and p.numel():
                at = p.untyped_storage().data_ptr()
                if at in storages:
                    raise OffloadError(
                        f"component {component!r}: tensor {full!r} shares its storage with {storages[at]!r} (views of one "
                        "tensor); streamed, they would come back from disable as two tensors: give each its own storage first"
                    )
                storages[at] = full
            rewrap = _rewrap(p, component, full)
            owner, attr = _owner(module, full)
            if p.is_meta:
                # Built on the meta device: the weights are the checkpoint's, served from
                # its pages; disable() puts the module back on the meta device.
                if checkpoint is None:
                    raise OffloadError(f"component {component!r}: tensor {full!r} is on the meta device; give checkpoint= to serve it from a file")
                tensors.append((full, _DTYPES[p.dtype], list(p.shape), None))
                prm = _Param(owner, attr, p, p.data, p.device, p.dtype, tuple(p.shape), rewrap=rewrap, name=full,
                             layout=_contiguous(p.shape))
            else:
                host = p.detach().as_subclass(torch.Tensor)
                if host.device.type != "cpu":
                    host = host.to("cpu")  # keeps a dense tensor's strides
                layout = _contiguous(p.shape)
                if checkpoint is None and host.stride() != layout and host.numel() and _dense(host):
                    # Dense in another order: its bytes as they lie, bound with its strides.
                    layout = tuple(host.stride())
                    host = host.as_strided((host.numel(),), (1,), host.storage_offset())
                else:
                    host = host.contiguous()
                tensors.append((full, _DTYPES[p.dtype], list(p.shape), host))
                # The bytes to restore, in host memory (a parameter on the device gives its memory back).
                prm = _Param(owner, attr, p, p.data if p.device.type == "cpu" else host, p.device, p.dtype, tuple(p.shape),
                             pinned=p.device.type == "cpu" and torch.cuda.is_available() and p.is_pinned(), rewrap=rewrap, name=full,
                             layout=layout)
            state._params[full] = prm
            blk.params.append(prm)
    if not tensors and frozen_some and any(p.requires_grad for child, _ in block_modules for p in child.parameters()):
        raise OffloadError(
            f"component {component!r}: every block parameter requires grad while others are frozen, so all of them "
            "stay resident as trainable adapters and none would stream; freeze the block weights (requires_grad_(False))"
        )
    for full, p in all_params.items():
        if id(p) in in_block and in_block[id(p)] != full:
            raise OffloadError(f"component {component!r}: tensor {in_block[id(p)]!r} is tied to {full!r} outside the blocks; tied weights cannot be streamed")
    # A tensor that stays resident viewing a streamed one's storage (a fused tensor
    # split between a block and the head) would no longer share it after disable.
    kept = [(n, t) for n, t in all_params.items() if id(t) not in in_block]
    kept += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None]
    for full, t in kept:
        if not t.is_meta and t.numel() and t.untyped_storage().data_ptr() in storages:
            raise OffloadError(
                f"component {component!r}: tensor {storages[t.untyped_storage().data_ptr()]!r} shares its storage with {full!r}, "
                "which stays resident (views of one tensor); streamed, they would come back from disable as two tensors: "
                "give each its own storage first"
            )

    return all_params, in_block, tensors


def _meta_from_file(module: nn.Module, component: str, all_params: dict, in_block: dict, checkpoint) -> dict:
    """Per resident tensor built on the meta device, the name ``checkpoint``
    holds it under, checked before anything is built."""
    # Tensors outside the blocks built on the meta device come from the checkpoint
    # (checked here, before anything is built); a meta buffer the file does not
    # hold (a rotary table made at construction) cannot be made here.
    meta: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for full, t in list(all_params.items()) + list(module.named_buffers(remove_duplicate=False)):
        if t is not None and t.is_meta and id(t) not in in_block:
            meta.setdefault(id(t), (t, []))[1].append(full)
    # Per meta tensor, the name the file holds it under: a tensor shared by two
    # modules (T5's tied embedding) is saved once, under any of its names.
    from_file: dict[int, str] = {}
    if meta:
        if checkpoint is None:
            first = next(iter(meta.values()))[1][0]
            raise OffloadError(f"component {component!r}: tensor {first!r} is on the meta device; give checkpoint= to serve it from a file")
        in_file = {n: (d, tuple(sh)) for n, d, sh in safetensors_tensors(str(checkpoint))}
        for key, (t, names) in meta.items():
            want = (_DTYPES.get(t.dtype), tuple(t.shape))
            held = [n for n in names if n in in_file]
            if not held:
                also = f" (nor as {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
                raise OffloadError(f"component {component!r}: tensor {names[0]!r} is on the meta device and not in {checkpoint}{also}")
            if in_file[held[0]] != want:
                raise OffloadError(f"component {component!r}: tensor {held[0]!r} is {want[0]} {list(want[1])} in the module, "
                                   f"{in_file[held[0]][0]} {list(in_file[held[0]][1])} in {checkpoint}")
            from_file[key] = held[0]

    return from_file


def _budget_bytes(module: nn.Module, component: str, budget_gib, all_params: dict, in_block: dict):
    """The device budget left to the blocks once the resident tensors are held, or None."""
    budget_bytes = None
    if budget_gib is not None:
        # The budget holds the resident tensors first; the blocks get the rest.
        resident = sum(p.numel() * p.element_size() for p in {id(p): p for p in all_params.values()}.values() if id(p) not in in_block)
        resident += sum(b.numel() * b.element_size() for _, b in module.named_buffers())
        budget_bytes = int(budget_gib * _GiB) - resident
        if budget_bytes <= 0:
            raise OffloadError(
                f"component {component!r}: a budget of {budget_gib} GiB does not hold its resident tensors "
                f"({resident} bytes outside the blocks, {resident / _GiB:.3f} GiB)"
            )

    return budget_bytes


def _start_engine(state: Offloaded, tensors: list, stacks: list, block_modules: list, *, depth, budget_bytes, resident_blocks, coded,
                  pin_budget_gib, pageable_fallback, checkpoint, progress, calibration, keep_host_copy) -> None:
    """The engine built over the streamed tensors (the host store filled), each
    parameter's place in its block and its placeholder made."""
    component, dev = state.component, state.device
    if dev.type == "cuda":
        # The engine computes on torch's current stream and allocates its buffers there.
        state._engine_stream = torch.cuda.current_stream(dev)
        state._engine_raw = (state._engine_stream.cuda_stream, state._engine_stream.device.index)

    bar, update = _progress(f"offload {component}: host store", progress)
    try:
        state._streamer = Streamer(
            component,
            tensors,
            stacks,
            device=dev.index if dev.type == "cuda" else None,
            stream=state._engine_stream,
            depth=depth,
            budget_bytes=budget_bytes,
            resident_blocks=list(resident_blocks),
            coded=coded,
            pin_budget_bytes=None if pin_budget_gib is None else int(pin_budget_gib * _GiB),
            pageable_fallback=pageable_fallback,
            checkpoint=None if checkpoint is None else str(checkpoint),
            progress=update,
            calibration=None if calibration is None else json.dumps(calibration),
        )
    finally:
        if bar is not None:
            bar.close()
    tensors.clear()
    if not keep_host_copy:
        # One host copy: the store's. disable() reads the bytes back from it.
        for p in state._params.values():
            p.saved = None
    for stack, index, layout in state._streamer.layouts():
        for tname, offset, nbytes in layout:
            p = state._params[tname]
            p.offset, p.nbytes = offset, nbytes
    for p in state._params.values():
        p.holder = _Placeholder(p.shape, p.dtype, dev, p.param.requires_grad, component, p.name)
        # What frameworks set on a parameter (diffusers' GGUF quant type, ...).
        for k, v in vars(p.param).items():
            with contextlib.suppress(Exception):
                setattr(p.holder, k, v)
        p.holder._is_param = True  # isinstance(..., nn.Parameter), as the parameter it stands for
    for _, blk in block_modules:
        blk.prepare()
        for p in blk.params:
            p.holder._offload_lazy = (state, blk, p)



def _install(state: Offloaded, module: nn.Module, block_modules: list, all_params: dict, from_file: dict, checkpoint,
             keep_host_copy: bool) -> None:
    """The module changed: placeholders in the blocks, the resident tensors on
    the device, the hooks on; any failure puts back what changed."""
    component, dev = state.component, state.device
    # From here the module changes; any failure puts back what changed.
    try:
        with torch.no_grad():
            for p in state._params.values():
                if not p.param.is_meta:
                    # The parameter object lets its bytes go (the store holds them);
                    # its place in the module holds the placeholder.
                    p.param.data = torch.empty(0, dtype=p.dtype, device=dev)
                p.owner._parameters[p.attr] = p.holder

            def placed_on(full: str, t: torch.Tensor) -> torch.Tensor:
                if not t.is_meta:
                    return t.to(dev)
                raw = safetensors_read(str(checkpoint), from_file.get(id(t), full))
                data = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
                return data.view(t.dtype).view(t.shape).to(dev)

            # On the simulated device the resident tensors stay where they are, but
            # those built on the meta device are made from the checkpoint.
            def moves(t: torch.Tensor) -> bool:
                return dev.type == "cuda" or t.is_meta

            seen = set(id(p.param) for p in state._params.values())
            swaps: dict[int, nn.Parameter] = {}
            for full, prm in all_params.items():
                if prm.is_meta and id(prm) not in seen:
                    # Every name a meta parameter has gets the one new parameter.
                    owner, attr = _owner(module, full)
                    state._moved_tensors.append(_Moved(owner, attr, True, prm, swapped=True))
                    if id(prm) not in swaps:
                        swaps[id(prm)] = nn.Parameter(placed_on(full, prm), requires_grad=prm.requires_grad)
                    owner._parameters[attr] = swaps[id(prm)]
                    continue
                if id(prm) in seen or not moves(prm):
                    continue
                seen.add(id(prm))
                owner, attr = _owner(module, full)
                state._moved_tensors.append(_Moved(owner, attr, True, prm.data))
                prm.data = placed_on(full, prm)
            placed: dict[int, torch.Tensor] = {}
            for full, buf in module.named_buffers(remove_duplicate=False):
                if buf is None or not moves(buf):
                    continue
                owner, attr = _owner(module, full)
                state._moved_tensors.append(_Moved(owner, attr, False, buf))
                # A buffer shared by two modules stays one tensor on the device.
                if id(buf) not in placed:
                    placed[id(buf)] = placed_on(full, buf)
                owner._buffers[attr] = placed[id(buf)]
        for child, blk in block_modules:
            blk.seal()
            # First among the block's pre-hooks: one registered before enable reads the weights.
            state._hooks.append(child.register_forward_pre_hook(_pre_hook(state, blk), prepend=True, with_kwargs=True))
            state._hooks.append(child.register_forward_hook(_post_hook(state, blk), always_call=True))
            blk.module, blk.post_hook = child, state._hooks[-1].id
            # On the block and every layer in it holding a streamed tensor (a layer of
            # resident adapter weights alone gives its state_dict as before).
            name = f"{blk.stack}.{blk.index}"
            for sub in dict.fromkeys([child, *(p.owner for p in blk.params)]):
                state._hooks.append(sub._register_state_dict_hook(_refuse_state_dict(component, name)))
                state._hooks.append(sub._register_load_state_dict_pre_hook(_refuse_load_state_dict(component, name)))
        for p in state._params.values():
            setattr(p.param, _STREAMED_BY, component)
            setattr(p.holder, _STREAMED_BY, component)
        state._hooks.append(module.register_forward_pre_hook(_forward_pre_hook(state)))
        state._hooks.append(module.register_forward_hook(_step_hook(state), always_call=True))
        setattr(module, _STATE, state)
        _wrap_compiled(state)
        if not keep_host_copy and any(p.pinned for p in state._params.values()):
            # The page-locked host tensors let go sit in torch's pinned-memory cache
            # until it is emptied: without this the host would still hold two copies.
            empty = getattr(torch._C, "_host_emptyCache", None)  # torch >= 2.5
            if empty is not None:
                empty()
    except BaseException:
        try:
            _restore(state)
        finally:
            with contextlib.suppress(Exception):
                state._streamer.close()
        raise


class _Hook:
    """One of the package's hooks on the module: a callable that refuses, by
    name, to be pickled or copied with it (``copy.deepcopy``, ``pickle``,
    ``torch.save`` of an offloaded module), as its placeholders do."""

    __slots__ = ("fn", "component")

    def __init__(self, fn, component: str):
        self.fn, self.component = fn, component

    def __call__(self, *args):
        return self.fn(*args)

    def __reduce_ex__(self, protocol):
        raise OffloadError(f"component {self.component!r}: an offloaded module cannot be copied, pickled or saved (its block "
                           "weights are in the engine's store); disable it first")

    def __deepcopy__(self, memo):
        return self.__reduce_ex__(2)


def _pre_hook(state: Offloaded, blk: _Block):
    def hook(mod, args, kwargs):
        if torch.compiler.is_compiling() and _wrapped(mod):
            # Traced into a compiled block: its binding is `_Compiled`'s, outside.
            # (Traced into a compiled model, the hook runs, as a graph break.)
            return None
        state._bind(blk)
        if state.device.type == "cuda":
            return state._inputs(blk, args, kwargs)
        return None

    return _Hook(hook, state.component)


def _host_tensors(args, kwargs) -> dict:
    """The floating-point host tensors among a block's arguments (and in tuples
    or lists among them, one level down), by the storage they view: where each
    is, as a path."""
    found = {}

    def visit(t, path):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point() and t.numel():
            with contextlib.suppress(Exception):
                found.setdefault(t.untyped_storage().data_ptr(), path)

    for i, a in enumerate(args):
        visit(a, ("a", i))
        if isinstance(a, (tuple, list)):
            for j, b in enumerate(a):
                visit(b, ("a", i, j))
    for k, a in kwargs.items():
        visit(a, ("k", k))
        if isinstance(a, (tuple, list)):
            for j, b in enumerate(a):
                visit(b, ("k", k, j))
    return found


class _Watch(torch.overrides.TorchFunctionMode):
    """Around a block's first forward: which of its host tensor arguments it
    moves to the device itself (``.to(device)``, ``.cuda()``, a view of one
    first, as ``apply_rotary_emb`` does with ``cos[None, None].to(x.device)``)."""

    def __init__(self, hosts: dict):
        super().__init__()
        self.hosts, self.moved = hosts, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _MOVES and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu" \
                and isinstance(out, torch.Tensor) and out.device.type == "cuda":
            with contextlib.suppress(Exception):
                path = self.hosts.get(args[0].untyped_storage().data_ptr())
                if path is not None:
                    self.moved.add(path)
        return out


_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.type_as}


def _post_hook(state: Offloaded, blk: _Block):
    def hook(mod, args, output):
        if torch.compiler.is_compiling() and _wrapped(mod):
            return
        # torch calls it even when the pre-hook raised: a thread refused there
        # leaves the block another thread has bound alone.
        if state._mine():
            try:
                state._unbind()
            finally:
                state._end_watch(blk)

    return _Hook(hook, state.component)


class _Compiled:
    """A compiled block's call (``block.compile()``, diffusers'
    ``compile_repeated_blocks``), wrapped so that the package binds the block's
    weights outside the compiled region: the compiled code sees plain tensors
    in the block's parameters (views of its slot), and no hook of ours."""

    def __init__(self, state: Offloaded, blk: _Block, fn):
        self.state, self.blk, self.fn = state, blk, fn

    def __call__(self, *args, **kwargs):
        st, blk = self.state, self.blk
        st._arm(blk)
        try:
            st._lend(blk)
            return self.fn(*args, **kwargs)
        finally:
            if st._mine():
                st._unbind()


def _wrapped(block: nn.Module) -> bool:
    """Whether ``block``'s compiled call is wrapped by :class:`_Compiled`."""
    return isinstance(block.__dict__.get("_compiled_call_impl"), _Compiled)


def _wrap_compiled(state: Offloaded) -> None:
    """Wrap each block compiled since the last look (before ``enable``, or
    after it and before this forward)."""
    for blk in state._blocks.values():
        fn = blk.module.__dict__.get("_compiled_call_impl")
        if fn is not None and not isinstance(fn, _Compiled):
            blk.module._compiled_call_impl = _Compiled(state, blk, fn)


def _unwrap_compiled(state: Offloaded) -> None:
    for blk in state._blocks.values():
        fn = blk.module.__dict__.get("_compiled_call_impl")
        if isinstance(fn, _Compiled):
            blk.module._compiled_call_impl = fn.fn


def _forward_pre_hook(state: Offloaded):
    def hook(mod, args):
        _wrap_compiled(state)
        if state._backward:
            state._end_abandoned_backward()
        state._claim(by_block=False)
        state._owned_by_block = False
        if state._in_forward or state._ran:
            # The last forward never reached its step hook (a KeyboardInterrupt
            # skips torch's always_call hooks), or blocks ran outside a forward
            # since the last step (a gradient checkpointing recompute in the
            # backward, a decode): that step ends here, apart from this one.
            # Should that fail (a block of it wrote its weights), this forward
            # never starts.
            try:
                state._end_step()
            except BaseException:
                state._release()
                raise
        state._in_forward = True

    return _Hook(hook, state.component)


def _step_hook(state: Offloaded):
    def hook(mod, args, output):
        # torch calls an always_call hook even when a pre-hook raised (ours ending
        # an interrupted step or refusing a second thread, or a user's before
        # it): that forward began no step.
        if not state._in_forward or not state._mine():
            return
        try:
            state._end_step()
        finally:
            state._release()

    return _Hook(hook, state.component)


def _restore(state: Offloaded) -> list:
    """Put the module back. Every copy is made before anything is assigned, so a
    failed copy (out of device memory) leaves the module as it is, still
    offloaded. Resident tensors keep what they hold now (a trained adapter, a
    recomputed buffer), copied back into the very tensors they came from.

    A block whose bytes the store can no longer give (served in place from a
    checkpoint rewritten since) has its tensors put back on the meta device:
    returned as ``(tensor names, why)`` per block, for the caller to raise once
    the rest is back."""
    lost = []
    with torch.no_grad():
        back = []
        for blk in state._blocks.values():
            # Without a kept host copy, the bytes come back from the host store.
            raw = None
            gone = False
            if any(p.saved is None and p.where.type != "meta" for p in blk.params):
                try:
                    buf = state._engine().block_bytes(blk.stack, blk.index)
                except OffloadError as e:
                    gone = True
                    lost.append(([p.name for p in blk.params if p.saved is None and p.where.type != "meta"], str(e)))
                else:
                    raw = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
            for p in blk.params:
                if p.saved is not None:
                    data = p.saved
                elif p.where.type == "meta" or gone:
                    data = torch.empty(p.shape, dtype=p.dtype, device="meta")
                else:
                    # Page-locked again where it was (diffusers' streams need it so), in
                    # the layout it had (a channels-last kernel stays channels-last).
                    data = torch.empty_strided(p.shape, p.layout, dtype=p.dtype, pin_memory=p.pinned)
                    if p.nbytes:
                        data.copy_(raw[p.offset : p.offset + p.nbytes].view(p.dtype).as_strided(p.shape, p.layout))
                back.append((p, data if data.device == p.where or data.is_meta else data.to(p.where)))
        for m in state._moved_tensors:
            # Into the host tensor it came from (not in use while offloaded).
            now = m.owner._parameters[m.attr] if m.is_param else m.owner._buffers[m.attr]
            # A tensor built on the meta device goes back there (it held no bytes).
            if now is not None and now is not m.saved and not m.saved.is_meta:
                m.saved.copy_(now.detach())
        for h in state._hooks:
            h.remove()
        state._hooks.clear()
        for p, data in back:
            p.owner._parameters[p.attr] = p.param
            if p.holder is not None and p.param.requires_grad != p.holder.requires_grad:
                # Frozen or unfrozen while offloaded (`requires_grad_` on its placeholder).
                p.param.requires_grad_(p.holder.requires_grad)
            if data.is_meta and not p.param.is_meta:
                # A meta tensor cannot be the data of a parameter on another device.
                p.param = p.owner._parameters[p.attr] = nn.Parameter(data, requires_grad=p.param.requires_grad)
                continue
            p.param.data = data
            if getattr(p.param, _STREAMED_BY, None) is not None:
                delattr(p.param, _STREAMED_BY)
        for m in reversed(state._moved_tensors):
            if m.swapped:
                m.owner._parameters[m.attr] = m.saved
            elif m.is_param:
                m.owner._parameters[m.attr].data = m.saved
            else:
                m.owner._buffers[m.attr] = m.saved
    state._moved_tensors.clear()
    return lost


@torch.inference_mode(False)
def disable(module: nn.Module) -> None:
    """Stop streaming ``module``: hooks removed, every parameter and buffer the
    same object with the same bytes where it was (resident ones with what they
    hold now), the engine closed; in any grad or inference mode it is called in.

    Where the bytes of a block are gone (served in place from a checkpoint
    rewritten since; a file renamed over the path leaves them readable), the
    rest is put back all the same, those tensors become new parameters on the
    meta device, and an :class:`OffloadError` names them: load them again
    (``module.load_state_dict(..., strict=False, assign=True)``)."""
    state = getattr(module, _STATE, None)
    if state is None:
        raise OffloadError(f"{type(module).__name__} is not offloaded")
    if state._owner not in (None, threading.get_ident()):
        raise OffloadError(f"component {state.component!r}: disable called from a second thread while another one is inside the module")
    if state._bound is not None or state._armed is not None:
        state._unbind()
    _unwrap_compiled(state)
    lost = _restore(state)
    delattr(module, _STATE)
    streamer, state._streamer = state._streamer, None
    closed = None
    if streamer is not None:
        try:
            streamer.close()
        except OffloadError as e:
            if not lost:
                raise
            closed = e  # the same file's change, said below
    if lost:
        names = [n for ns, _ in lost for n in ns]
        raise OffloadError(
            f"component {state.component!r}: disabled, but {len(names)} streamed tensors could not be put back (their bytes "
            f"are gone from the store): {', '.join(repr(n) for n in names)}; each is now a parameter on the meta device, to "
            f"load again. The store said: {lost[0][1]}"
        ) from closed


def offloaded(module: nn.Module) -> Optional[Offloaded]:
    """The module's :class:`Offloaded`, if its blocks stream."""
    return getattr(module, _STATE, None)


def _calls_per_step(name: str) -> int:
    """How often a pipeline component runs in a generation: the denoiser once a step."""
    return 2 if name in ("transformer", "unet", "prior") else 1


def enable_pipeline(
    pipe: Any,
    *,
    budget_gib: Optional[float] = None,
    device: Any = None,
    depth: int = 1,
    coded: bool = False,
    progress: Optional[bool] = None,
) -> dict:
    """Stream every ``torch.nn.Module`` of a pipeline (diffusers'
    ``pipe.components``, or a dict of modules) under one device budget: text
    encoders, transformer and VAE each layer by layer, their non-block tensors
    resident. A module without block lists is moved to the device whole. With
    ``budget_gib``, each component first gets what it needs to stream (its
    resident tensors and ``depth + 1`` slots of its largest block); what is left
    goes to the denoiser (``transformer`` or ``unet``), whose planner keeps the
    blocks worth keeping resident there. Returns ``{name: Offloaded}``; on any
    error every component enabled so far is disabled again."""
    who = type(pipe).__name__
    # Checked as enable checks them, before anything is sized or moved.
    depth = _count(who, "depth", depth, 1)
    budget_gib = _gib(who, "budget_gib", budget_gib, positive=True)
    comps = getattr(pipe, "components", pipe)
    try:
        comps = dict(comps)
    except (TypeError, ValueError):
        raise OffloadError(f"{who}: not a pipeline (no .components) nor a dict of modules") from None
    modules = {n: m for n, m in comps.items() if isinstance(m, nn.Module)}
    if not modules:
        raise OffloadError(f"{type(pipe).__name__}: no torch modules among its components")

    def size(m: nn.Module) -> int:
        ps = {id(p): p for p in m.parameters()}.values()
        return sum(p.numel() * p.element_size() for p in ps) + sum(b.numel() * b.element_size() for b in m.buffers())

    need, streamed = {}, {}
    for n, m in modules.items():
        stacks = find_blocks(m)
        if not stacks:
            need[n] = size(m)
            continue
        blocks = [c for s in stacks for c in m.get_submodule(s).children()]
        # As enable counts: a block's buffers and trainable adapters stay resident;
        # the rest of its parameters stream, each at a 256-byte-aligned offset of its slot.
        frozen_some = any(not p.requires_grad for p in m.parameters())
        moving = [[p for p in b.parameters() if not (frozen_some and p.requires_grad)] for b in blocks]
        largest = max(sum(-(-p.numel() * p.element_size() // 256) * 256 for p in ps) for ps in moving)
        each = {id(p): p.numel() * p.element_size() for ps in moving for p in ps}
        need[n] = size(m) - sum(each.values()) + (depth + 1) * largest
        streamed[n] = need[n]
    if budget_gib is not None and sum(need.values()) > budget_gib * _GiB:
        parts = ", ".join(f"{n} {_size(v)}" for n, v in need.items())
        raise OffloadError(f"{type(pipe).__name__}: a budget of {budget_gib} GiB is below what streaming needs ({parts})")
    denoiser = max(streamed, key=lambda n: (_calls_per_step(n), need[n]), default=None)
    done: dict = {}
    moved: dict = {}
    try:
        for n, m in modules.items():
            if n not in streamed:
                p0 = next(iter(m.parameters()), None)
                m._offload_moved_from = p0.device if p0 is not None else None
                moved[n] = m
                m.to(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
                continue
            b = None
            if budget_gib is not None:
                b = (need[n] if n != denoiser else budget_gib * _GiB - sum(v for k, v in need.items() if k != n)) / _GiB
            done[n] = enable(m, device=device, depth=depth, budget_gib=b, coded=coded, name=n, progress=progress)
    except BaseException:
        # Only what this call changed: a component the caller enabled before stays so.
        with contextlib.suppress(Exception):
            disable_pipeline({**moved, **{n: modules[n] for n in done}})
        raise
    return done


def disable_pipeline(pipe: Any) -> None:
    """Disable every offloaded component of ``pipe`` (see :func:`enable_pipeline`):
    the pipeline, the dict of modules given to :func:`enable_pipeline`, or the
    handles it returned. Components moved to the device whole (no block lists)
    go back where they were only when given the pipeline or the modules: the
    handles name the streamed components alone."""
    comps = getattr(pipe, "components", pipe)
    for m in dict(comps).values():
        if isinstance(m, Offloaded):
            # What enable_pipeline returned: a handle whose offloading has ended
            # (its module disabled, perhaps enabled again since) has nothing to undo.
            if m.module is None or offloaded(m.module) is not m:
                continue
            m = m.module
        if isinstance(m, nn.Module) and offloaded(m) is not None:
            disable(m)
        elif isinstance(m, nn.Module) and hasattr(m, "_offload_moved_from"):
            where = m.__dict__.pop("_offload_moved_from")
            if where is not None:
                m.to(where)
