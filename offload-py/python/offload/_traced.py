"""The package's hooks as ops a compiled graph holds: ``torch.compile(model,
fullgraph=True)`` of an offloaded module in inference.

Traced by dynamo, the module's hooks become four custom ops, ordered among
themselves as the hooks run (an ordered effect): ``begin`` and ``end`` around
the module's forward, ``lend`` at a block's start, which returns the block's
lent bytes as one ``uint8`` tensor, and ``unbind`` after it, which takes the
block's outputs (so every kernel that reads the block's weights is issued before
it). The block's parameters are views of ``lend``'s output made in the graph, so
the compiled code reads the slot the engine lent, and the graph holds no block
weight as an input. At run time each op does what its hook does eagerly; a
graph and the eager hooks may alternate (a block dynamo cannot trace this way
falls back to a graph break there).

Only in inference (grad mode off at trace time): in grad mode what autograd
saves of a block's weights goes through the package's saved-tensor hooks, which
a compiled graph does not call."""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from ._blocks import _Block
    from ._offloaded import Offloaded

# Every enabled module by its token (the int a graph's ops carry).
_STATES: "weakref.WeakValueDictionary[int, Offloaded]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register(state: Offloaded) -> int:
    """A token for ``state``, the only thing of it a graph holds."""
    token = next(_NEXT)
    _STATES[token] = state
    return token


def _state(token: int) -> Offloaded:
    state = _STATES.get(token)
    if state is None or state._streamer is None:
        from ._offload import OffloadError

        raise OffloadError("offload: a compiled graph ran an offloaded module that has been disabled since it was compiled; "
                           "compile the module again (torch._dynamo.reset() drops the old graphs)")
    return state


def _ops() -> Optional[tuple]:
    """The five ops, registered with torch (>= 2.4 for ``custom_op``; the
    ordered effect is torch's own, private, API), or None where this torch has
    not the parts: the hooks then break the graph as before."""
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
        custom_op = torch.library.custom_op
    except (ImportError, AttributeError):
        return None
    @custom_op("offload::begin", mutates_args=())
    def begin(token: int) -> None:
        from ._hooks import _begin_forward

        st = _state(token)
        _begin_forward(st)
        st._compiled_forward = True

    @begin.register_fake
    def _(token):
        return None

    @custom_op("offload::lend", mutates_args=())
    def lend(token: int, block: int, after: list[torch.Tensor]) -> torch.Tensor:
        st = _state(token)
        blk = st._order[block]
        if blk.kept is not None or not st._arm(blk):
            # Kept resident by the automatic plan: its buffer, bound for good.
            return blk.kept[: blk.nbytes]
        st._lend(blk)
        return st._buffer[: blk.nbytes]

    @lend.register_fake
    def _(token, block, after):
        st = _STATES[token]
        return torch.empty(st._order[block].nbytes, dtype=torch.uint8, device=st.device)

    @custom_op("offload::unbind", mutates_args=())
    def unbind(token: int, block: int, after: list[torch.Tensor]) -> torch.Tensor:
        from ._hooks import _after_block, _on_the_slot

        st = _state(token)
        blk = st._order[block]
        own = _on_the_slot(st, blk)
        if own is not None and any(own(t) for t in after):
            # Inside a graph its output cannot be copied off the slot as the
            # eager hook does: refused, given back all the same.
            from ._offload import OffloadError

            err = OffloadError(
                f"component {st.component!r}: block {blk.stack}.{blk.index} returns a view of its own streamed "
                "weights inside a compiled graph; its slot is reused by a later block, so the view would change. "
                "Return a copy (.clone()), or compile the blocks instead of the whole module")
            try:
                _after_block(st, blk)
            except Exception as e:
                raise err from e
            raise err
        _after_block(st, blk)
        return torch.empty(0, device=st.device)

    @unbind.register_fake
    def _(token, block, after):
        return torch.empty(0, device=_STATES[token].device)

    @custom_op("offload::skip", mutates_args=())
    def skip(token: int, block: int, after: list[torch.Tensor]) -> torch.Tensor:
        # A block a hook answers (the graph was traced on its decision): armed
        # and given back unlent, counted skipped, as an eager block it answers.
        st = _state(token)
        blk = st._order[block]
        if blk.kept is None and st._arm(blk):
            st._unbind()
        return torch.empty(0, device=st.device)

    @skip.register_fake
    def _(token, block, after):
        return torch.empty(0, device=_STATES[token].device)

    @custom_op("offload::end", mutates_args=())
    def end(token: int, after: list[torch.Tensor]) -> None:
        from ._hooks import _end_forward

        _end_forward(_state(token))

    @end.register_fake
    def _(token, after):
        return None

    for op in (begin, lend, unbind, end, skip):
        _register_effectful_op(op._opoverload, _EffectType.ORDERED)
    return begin, lend, unbind, end, skip


# Registered at import (dynamo cannot trace a registration).
try:
    _OPS: Optional[tuple] = _ops()
except Exception:  # a torch whose library refuses them: the hooks break the graph
    _OPS = None


def ops() -> Optional[tuple]:
    return _OPS


def _receipt(state: Offloaded) -> list:
    """The last ``unbind``'s output, which the next op takes: what keeps the
    compiler from dropping an ``unbind`` (its declared write to the bytes is
    never read) and orders the ops."""
    r = state._receipt
    return [] if r is None else [r]


def begin(state: Offloaded) -> None:
    _OPS[0](state._token)


def end(state: Offloaded) -> None:
    _OPS[3](state._token, _receipt(state))
    state._receipt = None


def traceable(blk: _Block) -> bool:
    """Whether ``blk`` can be bound inside a graph: its tensors are plain views
    of its bytes (no parameter subclass to wrap again, none at an offset its
    dtype cannot view)."""
    return not blk.eager and all(p.nbytes == 0 for p in blk.sliced)


def lend(state: Offloaded, blk: _Block) -> None:
    """Traced at a block's start: its bytes lent by an op, its parameters views
    of them made in the graph."""
    data = _OPS[1](state._token, blk.at, _receipt(state))
    n = blk.nbytes
    whole = {dt: data[: n - n % dt.itemsize].view(dt) for dt in blk.dtypes}
    for params, attr, dt, shape, stride, offset, _rewrap in blk.views:
        params[attr] = whole[dt].as_strided(shape, stride, offset)
    for p in blk.sliced:
        p.owner._parameters[p.attr] = torch.empty_strided(p.shape, p.layout, dtype=p.dtype, device=data.device)


def skip(state: Offloaded, blk: _Block) -> None:
    """Traced at the start of a block a hook answers: counted skipped by an op,
    nothing lent."""
    state._receipt = _OPS[4](state._token, blk.at, _receipt(state))


def outputs(output) -> Optional[list]:
    """A block's output as the tensors ``unbind`` takes (a tensor, or a tuple
    or list of tensors and None, one tensor at least), or None where it is
    another structure."""
    if isinstance(output, torch.Tensor):
        output = [output]
    if isinstance(output, (tuple, list)) and all(o is None or isinstance(o, torch.Tensor) for o in output):
        # None where no tensor comes out (a block that updates its input in place):
        # nothing would order the kernels reading its bytes before the give-back.
        return [o for o in output if o is not None] or None
    return None


def unbind(state: Offloaded, blk: _Block, after: list) -> None:
    """Traced after a block: given back once the kernels making its outputs
    are issued (every kernel that reads its bytes makes one of them), its
    placeholders put back in the module."""
    state._receipt = _OPS[2](state._token, blk.at, after)
    for params, attr, param in blk.restore:
        params[attr] = param
