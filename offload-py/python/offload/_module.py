"""Streaming one ``torch.nn.Module`` (`enable`, `disable`, in `_enable`) and a
diffusers pipeline's components (`enable_pipeline`, `disable_pipeline`)."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from torch import nn

from ._offload import OffloadError

from ._placeholder import _GiB
from ._blocks import find_blocks
from ._offloaded import Offloaded
from ._enable import _count, _gib, _size, disable, enable, offloaded


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
