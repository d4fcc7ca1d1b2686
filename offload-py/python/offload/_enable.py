"""`enable` and `disable`: a module's blocks moved into the engine and hooked, and
the module put back exactly as it was."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import operator
import threading
from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from ._offload import OffloadError, Streamer, safetensors_read, safetensors_tensors

from ._placeholder import _ArgumentTypeError, _ArgumentValueError, _COMPOSES, _DTYPES, _GiB, _Placeholder, _STATE, _STREAMED_BY
from ._blocks import _Block, _Moved, _Param, _called, _contiguous, _dense, _owner, find_blocks
from ._hooks import _forward_pre_hook, _gguf_hooks, _post_hook, _pre_hook, _step_hook, _unwrap_compiled, _wrap_compiled
from ._offloaded import Offloaded, _refuse_load_state_dict, _refuse_state_dict


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
    auto_resident_gib: Optional[float] = None,
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
    first two steps at depth 1 and times them (a wait for the device at
    ``enable``), replays the second at depths 1 to 4 with the gap between the
    two and keeps the smallest within 1 % of the fastest, one deeper where the
    forward asks for its first block only after synchronising the host
    (:meth:`Offloaded.plan` says what it chose and why). Where that
    traced step was host-bound (the host needed about the device's whole step
    to issue it: Python time per block on a model whose blocks are short), the
    package also keeps blocks resident, as many as ``auto_resident_gib`` holds
    (counted with those of the most host time per byte first, the ones left
    to stream spread evenly over the run order): each is copied once,
    bound for good as plain device tensors, and runs with none of the
    package's per-block hooks, as it would unoffloaded. Not given, that
    allowance is a quarter of the device's free memory at the choice (none on
    the simulated device); ``0`` keeps every block streamed.

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
    allowance = _gib(component, "auto_resident_gib", auto_resident_gib, positive=False)
    if allowance is not None and not auto:
        raise _ArgumentValueError(
            f"component {component!r}: auto_resident_gib is the allowance of the plan the package chooses itself; with depth, "
            "budget_gib or calibration given the plan is yours: name the blocks to keep in resident_blocks instead"
        )
    depth, resident_blocks, budget_gib, pin_budget_gib, dev, stacks = _arguments(
        module, component, depth, resident_blocks, budget_gib, pin_budget_gib, device, blocks, lazy)
    state = Offloaded()
    state.component, state.device, state.module = component, dev, module
    state._lazy = lazy
    state._auto = auto
    state._allowance = None if allowance is None else int(allowance * _GiB)
    block_modules = _block_modules(state, module, stacks)
    all_params, in_block, tensors = _streamed_tensors(state, module, block_modules, checkpoint)
    from_file = _meta_from_file(module, component, all_params, in_block, checkpoint)
    budget_bytes = _budget_bytes(module, component, budget_gib, all_params, in_block)
    _start_engine(state, tensors, stacks, block_modules, depth=depth, budget_bytes=budget_bytes, resident_blocks=resident_blocks,
                  coded=coded, pin_budget_gib=pin_budget_gib, pageable_fallback=pageable_fallback, checkpoint=checkpoint,
                  progress=progress, calibration=calibration, keep_host_copy=keep_host_copy)
    _install(state, module, block_modules, all_params, from_file, checkpoint, keep_host_copy)
    if auto:
        # Timed from the first step (synchronises once, now): the depth's
        # choice at the second step's end reads the gap between the two.
        state._engine().enable_timeline()
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
            blk.at = len(state._order)
            state._order.append(blk)
            # First among the block's pre-hooks: one registered before enable reads the weights.
            state._hooks.append(child.register_forward_pre_hook(_pre_hook(state, blk), prepend=True, with_kwargs=True))
            state._hooks.append(child.register_forward_hook(_post_hook(state, blk), always_call=True))
            blk.module, blk.post_hook, blk.handles = child, state._hooks[-1].id, tuple(state._hooks[-2:])
            for p in blk.params:
                if p.attr == "weight" and type(p.owner).__name__ == "GGUFLinear" and hasattr(p.owner, "compute_dtype"):
                    pre, post = _gguf_hooks(state, blk, p.owner, p)
                    state._hooks.append(p.owner.register_forward_pre_hook(pre))
                    state._hooks.append(p.owner.register_forward_hook(post, always_call=True))
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


def _kept_back(blk) -> list:
    """A block the automatic plan kept resident comes back as a resident
    tensor does, with what its module holds now (an edit made while
    offloaded), into its parameter objects; a tensor replaced by one of
    another shape or dtype stays the replacement."""
    back = []
    for p, _view in blk.kept_views:
        now = p.owner._parameters.get(p.attr)
        if not isinstance(now, torch.Tensor) or now.shape != p.shape or now.dtype != p.dtype:
            continue
        if p.holder is not None and p.holder.requires_grad != now.requires_grad:
            # Frozen or unfrozen while kept: the parameter comes back so.
            p.holder.requires_grad_(now.requires_grad)
        data = torch.empty_strided(p.shape, p.layout, dtype=p.dtype, pin_memory=p.pinned)
        data.copy_(now.detach())
        back.append((p, data if data.device == p.where else data.to(p.where)))
    return back


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
            if blk.kept is not None:
                back.extend(_kept_back(blk))
                continue
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
        for blk in state._blocks.values():
            # The kept buffers let go with the module put back.
            blk.kept, blk.kept_views = None, []
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
    state._surface()
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
