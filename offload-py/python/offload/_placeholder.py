"""What an offloaded module holds in place of a streamed weight while its block
is not running (`_Placeholder`), and the errors and dtypes every part shares."""

from __future__ import annotations

from typing import Optional

import torch

from ._offload import OffloadError


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
    forward, so every operation on it outside that forward — an edit in
    place (also through ``.data``), a read, a conversion, a copy,
    ``.untyped_storage()``, ``.data_ptr()``, ``set_`` — raises
    :class:`OffloadError` naming it, instead of acting on nothing and being
    silently lost. Inside its block's forward (the block binding at its
    weights' first use) it stands for the bound view: an operation, ``.data``,
    or a kernel reading its address or storage reads the bound bytes."""

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

    def _in_its_block(self) -> Optional[torch.Tensor]:
        """The view in this placeholder's place where its block is running on
        this thread (armed: bound now, as any first use binds it; or bound
        already), else None."""
        lazy = self._offload_lazy
        if lazy is None or not lazy[0]._mine():
            return None
        if lazy[0]._armed is lazy[1]:
            lazy[0]._lend(lazy[1])
        return lazy[0]._view_of(self) if lazy[0]._bound is lazy[1] else None

    def untyped_storage(self):
        # Inside its block's forward (a kernel reading the weight's storage, as
        # fused and Triton kernels do, its block binding at first use): the
        # view's, valid while the block is bound. Elsewhere refused.
        view = self._in_its_block()
        if view is not None:
            return view.untyped_storage()
        raise OffloadError(_refusal(*self._offload_where, "read through its storage (untyped_storage)"))

    def data_ptr(self):
        view = self._in_its_block()
        if view is not None:
            return view.data_ptr()
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
