"""The hooks the package puts on a module and its blocks: around each block's
forward, around the module's step, and around compiled blocks."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ._offload import OffloadError

from ._blocks import _Block
from . import _traced
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ._offloaded import Offloaded


_OUTSIDE_GRAPH = (
    "offload: here the package lends a block's weights between blocks, outside any compiled graph: in grad mode, "
    "for a block holding a parameter subclass (diffusers' GGUFParameter) or returning other than tensors, or where "
    "this torch has no custom ops. Compile the whole module under torch.no_grad() or torch.inference_mode(), "
    "compile the blocks (block.compile(fullgraph=True), diffusers' compile_repeated_blocks(fullgraph=True)), or "
    "compile the whole module with fullgraph=False (the package's hooks then run between graphs)"
)


def _outside_graph(fn, *args):
    """``fn(*args)`` run eagerly where dynamo traces a hook of ours: a graph
    break under ``torch.compile(model)``, and under ``fullgraph=True`` dynamo's
    error giving :data:`_OUTSIDE_GRAPH` as its reason (torch >= 2.8; before,
    dynamo names the disabled function), never a builtin of the package's
    internals."""
    return fn(*args)


try:
    _outside_graph = torch.compiler.disable(_outside_graph, reason=_OUTSIDE_GRAPH)
except TypeError:  # torch < 2.8: no reason
    _outside_graph = torch.compiler.disable(_outside_graph)


def _in_autograd_pass() -> bool:
    """Whether autograd's engine is running a node on this thread (a
    checkpoint's recompute in the backward); False on a torch without the query."""
    node = getattr(torch._C, "_current_autograd_node", None)
    return node is not None and node() is not None


# A hook's trace that cannot make ops of it (the hook then breaks the graph).
_UNTRACED = object()


class _Hook:
    """One of the package's hooks on the module: a callable that refuses, by
    name, to be pickled or copied with it (``copy.deepcopy``, ``pickle``,
    ``torch.save`` of an offloaded module), as its placeholders do. Traced by
    dynamo (a compiled model), it runs outside the graph, unless ``traced(args)``
    says it is a no-op there (a block whose compiled call binds outside), or
    ``trace`` makes it ops the graph holds (in inference: :mod:`._traced`; it
    returns ``_UNTRACED`` where it cannot)."""

    __slots__ = ("fn", "component", "traced", "trace")

    def __init__(self, fn, component: str, traced=None, trace=None):
        self.fn, self.component, self.traced, self.trace = fn, component, traced, trace

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            if self.traced is not None and self.traced(args):
                return None
            if self.trace is not None and not torch.is_grad_enabled() and _traced.ops() is not None:
                r = self.trace(*args)
                if r is not _UNTRACED:
                    return r
            return _outside_graph(self.fn, *args)
        return self.fn(*args)

    def __reduce_ex__(self, protocol):
        raise OffloadError(f"component {self.component!r}: an offloaded module cannot be copied, pickled or saved (its block "
                           "weights are in the engine's store); disable it first")

    def __deepcopy__(self, memo):
        return self.__reduce_ex__(2)


class _BlockHook(_Hook):
    """A block's hook (:class:`_Hook`) that dynamo never compiles as a frame of
    its own, nor what it calls: where torch calls it from eager code under a
    compiled module (a frame dynamo resumed after a graph break), it runs
    eagerly, as it would uncompiled, not as a graph of a few ops compiled again
    for each hook and block (a graph break's worth each). Inlined into a frame
    dynamo traces, it is traced as before. (The module's own hooks stay
    :class:`_Hook`: ``torch.compile(model)`` runs them as frames dynamo
    compiles, where they become the ``begin`` and ``end`` ops.)"""

    __slots__ = ()

    def __call__(self, *args):
        return _Hook.__call__(self, *args)


def _no_frame_of_its_own(code) -> None:
    # Torch's private API (present in the 2.11 CI runs; not checked on older
    # torches): without it such a hook becomes a small graph, as before:
    # correct, with more graphs.
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except (ImportError, AttributeError):
        return
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


_no_frame_of_its_own(_BlockHook.__call__.__code__)


def _bind_now(state: Offloaded, block: nn.Module) -> bool:
    """Whether a block armed by its eager pre-hook binds now rather than at its
    first weight's use: inside a forward begun by a compiled graph (the
    module's ``begin`` op), where torch called the hook from eager code between
    two graphs and dynamo may trace the block's forward as a frame of its own
    (after a graph break around the block's call): a bind inside that frame
    would break its graph. Then it binds now unless a hook of diffusers answers
    the call (a cache's skipped block), or may answer it by a decision that
    cannot be read ahead. Uncompiled, never: its first weight's use binds it,
    as cheaply."""
    if not state._compiled_forward:
        return False
    decided = _decision(block)
    if decided is not None:
        return not decided
    return not _may_be_answered(block)


def _pre_hook(state: Offloaded, blk: _Block):
    def hook(mod, args, kwargs):
        if state._calling is blk:
            return None  # bound by its compiled call (`_Compiled`), outside
        state._bind(blk)
        if state._armed is blk and _bind_now(state, mod):
            state._lend(blk)
        # Its keywords, for the grad-off graph check at its end (the post-hook
        # gets only the positional arguments).
        state._kwargs_of = (blk, kwargs)
        if state.device.type == "cuda":
            moved = state._inputs(blk, args, kwargs)
            if moved is not None:
                state._kwargs_of = (blk, moved[1])
            return moved
        return None

    def trace(mod, args, kwargs):
        if not _traced.traceable(blk) or _may_be_answered(blk.module):
            # (A hook whose decision the package does not read may answer the
            # call: the block armed outside the graph, bound at its first use.)
            return _UNTRACED
        if _answered_by_cache(blk.module):
            # Answered by a hook (dynamo guards on its decision): counted
            # skipped by an op, nothing copied.
            _traced.skip(state, blk)
            return None
        _traced.lend(state, blk)
        return None

    # Traced into a compiled block, the hook is a no-op: the block's binding is
    # `_Compiled`'s, outside. (Traced into a compiled model, an op in inference,
    # else it runs outside the graph.)
    return _BlockHook(hook, state.component, traced=_in_compiled_block, trace=trace)


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


def _gguf_hooks(state: Offloaded, blk: _Block, layer: nn.Module, p) -> tuple:
    """Around a GGUF layer of a streamed block (diffusers' ``GGUFLinear``, which
    dequantizes its weight into a new tensor at each forward): in grad mode,
    while it runs, what autograd saves is its dequantized weight, saved as the
    layer's and made again in the backward (`Offloaded._pack`)."""

    def pre(mod, args):
        # Bound, or armed to bind at its first weight's use (the layer's own).
        if (state._bound is blk or state._armed is blk) and torch.is_grad_enabled():
            state._gguf = (layer, p, blk)

    def post(mod, args, output):
        state._gguf = None

    # Traced by dynamo, they are no-ops: a compiled graph's saved tensors are
    # its own, not packed by autograd's hooks.
    def traced(args):
        return True

    return _Hook(pre, state.component, traced=traced), _Hook(post, state.component, traced=traced)


def _after_block(state: Offloaded, blk: _Block) -> None:
    # torch calls the post-hook even when the pre-hook raised: a thread refused
    # there leaves the block another thread has bound alone.
    if state._mine():
        try:
            state._unbind()
        finally:
            state._end_watch(blk)


def _on_the_slot(state: Offloaded, blk: _Block):
    """Whether a tensor views ``blk``'s lent bytes (a predicate), or None where
    ``blk`` is not bound from a lent slot."""
    buf = state._buffer
    if state._bound is not blk or buf is None:
        return None
    at = buf.untyped_storage().data_ptr()

    def own(t) -> bool:
        if type(t) is not torch.Tensor or t.device != buf.device:
            return False
        try:
            return t.untyped_storage().data_ptr() == at
        except Exception:
            return False

    return own


def _off_the_slot(state: Offloaded, blk: _Block, output):
    """``output`` with each tensor in it that views the block's lent bytes
    copied off them (a block returning ``self.weight``, or a view of it): the
    slot is reused by a later block, so such a tensor would change under its
    holder. Looked for at any depth of what torch's pytree flattens (tuples,
    lists, dicts, namedtuples, diffusers' output classes). None where none
    does (the common case: nothing to replace)."""
    own = _on_the_slot(state, blk)
    if own is None:
        return None
    _stashes_off_the_slot(blk, own)
    if isinstance(output, torch.Tensor):
        return output.clone() if own(output) else None
    leaves, spec = pytree.tree_flatten(output)
    if not any(own(t) for t in leaves):
        return None
    return pytree.tree_unflatten([t.clone() if own(t) else t for t in leaves], spec)


def _stashes_off_the_slot(blk: _Block, own) -> None:
    """Each plain tensor attribute of the block's modules that views its lent
    bytes (``self.cache = self.weight.t()``) replaced by a copy off the slot,
    as an output is: found once, after the block's first lent forward, then
    looked at after each."""
    if blk.stashes is None:
        blk.stashes = [(mod, name) for mod in blk.module.modules()
                       for name, v in vars(mod).items() if isinstance(v, torch.Tensor) and own(v)]
    for mod, name in blk.stashes:
        v = mod.__dict__.get(name)
        if isinstance(v, torch.Tensor) and own(v):
            mod.__dict__[name] = v.clone()


def _graph_built_unsaved(state: Offloaded, blk: _Block, args, output) -> Optional[str]:
    """Why ``blk``'s forward is refused, or None: bound with grad off (so its
    weights are not saved as their places) and its output carries a graph
    built inside it (``torch.enable_grad()`` within a block run under
    ``no_grad``): autograd saved views of the lent buffer, which the ring
    refills. Its own inputs passed through are not its graph, nor a graph
    that saved none of the block's bytes (over its adapters alone)."""
    if state._bound is not blk or state._saving is not None:
        return None
    # Every block of an inference step comes here: a tensor or a flat tuple
    # (the common outputs) is looked at without flattening.
    leaves = (output,) if isinstance(output, torch.Tensor) else output if type(output) is tuple else pytree.tree_leaves(output)
    graphs = [t for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not graphs:
        return None
    kw = state._kwargs_of[1] if state._kwargs_of is not None and state._kwargs_of[0] is blk else None
    given = [a for a in pytree.tree_leaves((args, kw)) if isinstance(a, torch.Tensor)]
    inputs = {id(a) for a in given}
    if all(id(t) in inputs for t in graphs):
        return None
    # A graph over the adapters alone (inputs that do not require grad) saved
    # nothing of the block's bytes: only a graph that saved a view of the lent
    # buffer is refused. The walk stops at the graphs the inputs brought.
    buf = state._buffer
    if buf is None or not _saves_a_view_of(state, graphs, {a.grad_fn for a in given if a.grad_fn is not None}, buf):
        return None
    return (f"component {state.component!r}: block {blk.stack}.{blk.index} ran with grad off but returned a tensor with a "
            "graph built inside it (torch.enable_grad() within a block run under torch.no_grad(), or a torch.func "
            "transform over the model, where the package's saved-tensor hooks cannot run): its weights were "
            "saved for that graph's backward as views of a buffer the ring reuses, so the backward would read other "
            "weights. Run the block with grad on (call the model outside no_grad), or detach what it returns")


class _SavedByUs(Exception):
    """Raised by our unpack while the grad-off graph check walks a graph: what
    our hooks saved is a weight's place, never read back there."""


# The most autograd nodes the grad-off graph check walks; past it the block is
# refused as though a saved view had been found (nothing told either way).
_WALK_LIMIT = 4096


def _saves_a_view_of(state: Offloaded, outputs, stop, buf: torch.Tensor) -> bool:
    """Whether a node of the graph behind ``outputs`` (not past the nodes in
    ``stop``) saved for its backward a tensor on ``buf``'s memory: a node's
    ``_saved_*`` tensors, a custom Function's ``saved_tensors`` and the
    tensors it keeps on its ctx; torch.func's wrappers looked through. Walked
    only where a block run with grad off returned a graph built inside it.
    What our own hooks saved (a block's weight saved as its place) is not read
    back (``state._walking``: our unpack refuses, bringing nothing back); a
    graph too large to walk, or a save that cannot be looked at, counts as
    found."""
    at = buf.untyped_storage().data_ptr()
    wrapped, unwrap = torch._C._functorch.is_functorch_wrapped_tensor, torch._C._functorch.get_unwrapped

    def on_buf(v) -> bool:
        if isinstance(v, torch.Tensor):
            while wrapped(v):
                v = unwrap(v)
            return v.device == buf.device and v.untyped_storage().data_ptr() == at
        return isinstance(v, (tuple, list)) and any(on_buf(x) for x in v)

    def saved(node) -> list:
        out = []
        names = [n for n in dir(node) if n.startswith("_saved_")]
        function = isinstance(node, torch.autograd.function.BackwardCFunction)
        for name in names + (["saved_tensors"] if function else []):
            try:
                out.append(getattr(node, name))
            except _SavedByUs:
                continue  # a weight saved as its place: no view of the buffer
            except RuntimeError:
                continue  # freed by a backward already run, or modified in place (its backward fails anyway)
        if function:
            out.extend(vars(node).values())  # tensors kept on the ctx itself
        return out

    todo, seen = [t.grad_fn for t in outputs], set()
    state._walking = True
    try:
        while todo:
            node = todo.pop()
            if node is None or node in seen or node in stop:
                continue
            seen.add(node)
            if len(seen) > _WALK_LIMIT:
                return True
            try:
                if on_buf(saved(node)):
                    return True
            except Exception:  # a save that cannot be looked at
                return True
            todo.extend(f for f, _ in node.next_functions)
    finally:
        state._walking = False
    return False


def _post_hook(state: Offloaded, blk: _Block):
    def hook(mod, args, output):
        if state._calling is blk:
            return None  # given back by its compiled call (`_Compiled`), outside
        try:
            refused = _graph_built_unsaved(state, blk, args, output)
            if refused is not None:
                raise OffloadError(refused)
            return _off_the_slot(state, blk, output)
        finally:
            if state._kwargs_of is not None and state._kwargs_of[0] is blk:
                state._kwargs_of = None  # its inputs not held past the block
            _after_block(state, blk)

    def trace(mod, args, output):
        after = _traced.outputs(output)
        if after is None or not _traced.traceable(blk) or _may_be_answered(blk.module):
            return _UNTRACED
        if _answered_by_cache(blk.module):
            return None  # never lent (the pre-hook's trace read the same decision)
        _traced.unbind(state, blk, after)
        return None

    return _BlockHook(hook, state.component, traced=_in_compiled_block, trace=trace)


class _Compiled:
    """A compiled block's call (``block.compile()``, diffusers'
    ``compile_repeated_blocks``), wrapped so that the package binds the block's
    weights outside the compiled region: the compiled code sees plain tensors
    in the block's parameters (views of its slot), and no hook of ours."""

    def __init__(self, state: Offloaded, blk: _Block, fn):
        self.state, self.blk, self.fn = state, blk, fn

    def __call__(self, *args, **kwargs):
        st, blk = self.state, self.blk
        if blk.kept is not None or not st._arm(blk):
            # Kept resident (before, or by the step that arming ended): its
            # views are bound for good, nothing to lend.
            return self._call(args, kwargs)
        try:
            if _answered_by_cache(blk.module):
                # Armed and never lent: counted as skipped, nothing copied.
                return self._call(args, kwargs)
            if blk.eager or not st._lazy or not _may_be_answered(blk.module):
                st._lend(blk)
            # Else armed: bound at its first weight's use inside the call, as an
            # eager block is (a graph break there), never where the hook
            # answers the call without the block's forward.
            out = self._call(args, kwargs)
            copied = _off_the_slot(st, blk, out)
            return out if copied is None else copied
        finally:
            if st._mine():
                st._unbind()

    def _call(self, args, kwargs):
        # The compiled call, the block's own hooks a no-op inside it (where they
        # run eagerly, around a graph break in it): its binding is this call's.
        st = self.state
        st._calling = self.blk
        try:
            return self.fn(*args, **kwargs)
        finally:
            st._calling = None


def _cache_answers(hook) -> bool:
    # FirstBlockCache's and MagCache's blocks after the first: their shared
    # state, set by the first block's hook.
    return not hook.state_manager.get_state().should_compute


def _skip_answers(hook) -> bool:
    # LayerSkip: a block dropped whole (dropout 1) is never run; one with a
    # smaller dropout always is.
    return math.isclose(hook.dropout, 1.0)


def _taylorseer_answers(hook) -> bool:
    # TaylorSeer: its hook advances the block's own step counter as it
    # decides (diffusers' TaylorSeerCacheHook._measure_should_compute), so the
    # call about to come decides at the counter's next value: computed in the
    # warm-up, at each interval and in the cool-down, predicted otherwise.
    # Read in eager code only: that decision is compiler-disabled in diffusers,
    # so a block under it is never traced whole into a graph (were it, dynamo
    # would guard on the count and compile again at each step).
    step = hook.state_manager.get_state().current_step + 1
    before, after = hook.disable_cache_before_step, hook.disable_cache_after_step
    computes = step < before or (step - before - 1) % hook.cache_interval == 0 or (after is not None and step >= after)
    return not computes


def _runs(hook) -> bool:
    # FirstBlockCache's first block: its hook runs the block, then decides for the rest.
    return False


# Hooks of diffusers whose decision the package reads before the block binds:
# whether the hook answers the block's call without its forward (per class name).
_READ = {"FBCBlockHook": _cache_answers, "MagCacheBlockHook": _cache_answers, "TransformerBlockSkipHook": _skip_answers,
         "FBCHeadBlockHook": _runs, "TaylorSeerCacheHook": _taylorseer_answers}


def _decision(block: nn.Module) -> Optional[bool]:
    """What the hooks of diffusers on ``block`` decided for its call, read
    before it binds: True where one (:data:`_READ`) answers the call without
    the block's forward, False where each such hook lets it run, None where
    the block has none, or one whose decision cannot be read ahead
    (:data:`_MAY_ANSWER`), or its state cannot be read yet."""
    registry = block.__dict__.get("_diffusers_hook")
    if registry is None:
        return None
    decided, unread = None, False
    for hook in getattr(registry, "hooks", {}).values():
        name = type(hook).__name__
        read = _READ.get(name)
        if read is not None:
            try:
                if read(hook):
                    return True
            except Exception:
                unread = True  # no cache context yet: the hook decides
            decided = False
        elif name in _MAY_ANSWER:
            unread = True
    return None if unread else decided


def _answered_by_cache(block: nn.Module) -> bool:
    """Whether a hook of diffusers on ``block`` (:data:`_READ`) will answer its
    call without its forward: read before a compiled block's call, and where a
    block's hooks are traced into a graph (dynamo guards on what it read),
    whose binding cannot wait for the first weight's use as an eager block's
    does. False where the block has no such hook, or its state cannot be read."""
    return _decision(block) is True


# Hooks of diffusers that may answer a block's call without its forward by a
# decision the package cannot read ahead, each compiler-disabled in diffusers
# (a graph break there already): MagCache's first block's (it decides from
# the block's input). (Not SeaCache's: it did not skip a block of the tiny
# Flux here, so it is untested.)
_MAY_ANSWER = ("MagCacheHeadHook",)


def _may_be_answered(block: nn.Module) -> bool:
    """Whether ``block``'s call goes through one of :data:`_MAY_ANSWER`: a
    compiled or traced block is then armed, not bound, before its call, and
    bound at its first weight's use inside it as an eager block is (a graph
    break there, beside the one the hook's decision makes)."""
    registry = getattr(block, "_diffusers_hook", None)
    return any(type(h).__name__ in _MAY_ANSWER for h in getattr(registry, "hooks", {}).values())


def _in_compiled_block(args) -> bool:
    """Whether a block hook's call (its module first) is traced inside the
    block's own compiled call, which :class:`_Compiled` binds outside."""
    return _wrapped(args[0])


def _wrapped(block: nn.Module) -> bool:
    """Whether ``block``'s compiled call is wrapped by :class:`_Compiled`."""
    return isinstance(block.__dict__.get("_compiled_call_impl"), _Compiled)


def _wrap_compiled(state: Offloaded) -> None:
    """Wrap each block compiled since the last look (before ``enable``, or
    after it and before this forward)."""
    for blk in state._blocks.values():
        fn = blk.module.__dict__.get("_compiled_call_impl")
        if fn is not None and not isinstance(fn, _Compiled) and blk.kept is None:
            blk.module._compiled_call_impl = _Compiled(state, blk, fn)


def _unwrap_compiled(state: Offloaded) -> None:
    for blk in state._blocks.values():
        fn = blk.module.__dict__.get("_compiled_call_impl")
        if isinstance(fn, _Compiled):
            blk.module._compiled_call_impl = fn.fn


def _begin_forward(state: Offloaded) -> None:
    _wrap_compiled(state)
    if _in_autograd_pass():
        # A forward inside autograd's pass (a checkpoint of the whole module
        # recomputed): its blocks are the backward's step, begun here if the
        # pass has not begun it, ended with the pass; no step of its own.
        if not state._backward:
            state._begin_backward(None)
        return
    if state._backward:
        state._end_abandoned_backward()
    state._claim(by_block=False)
    state._owned_by_block = False
    if state._in_forward or state._ran:
        # The last forward never reached its step hook (a KeyboardInterrupt
        # skips torch's always_call hooks, an error inside a compiled graph
        # skips the rest of its ops), or blocks ran outside a forward since the
        # last step (a gradient checkpointing recompute in the backward, a
        # decode): that step ends here, apart from this one. Should that fail
        # (a block of it wrote its weights), this forward never starts.
        try:
            state._end_step()
        except BaseException:
            state._release()
            raise
    state._in_forward = True


def _forward_pre_hook(state: Offloaded):
    def hook(mod, args):
        _begin_forward(state)
        state._compiled_forward = False

    def trace(mod, args):
        _traced.begin(state)
        return None

    return _Hook(hook, state.component, trace=trace)


def _end_forward(state: Offloaded) -> None:
    # torch calls an always_call hook even when a pre-hook raised (ours ending
    # an interrupted step or refusing a second thread, or a user's before it):
    # that forward began no step.
    if not state._in_forward or not state._mine():
        return
    try:
        state._end_step()
    finally:
        state._release()


def _step_hook(state: Offloaded):
    def hook(mod, args, output):
        _end_forward(state)

    def trace(mod, args, output):
        _traced.end(state)
        return None

    return _Hook(hook, state.component, trace=trace)
