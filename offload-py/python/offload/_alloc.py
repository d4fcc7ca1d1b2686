"""How the engine makes a slot buffer while a torch function or dispatch mode,
or one of torch.func's transforms, is active: every mode and transform off, so
none can answer for torch (inside ``torch.func.grad`` a plain ``torch.empty``
gives a wrapper with no storage of its own), and the result checked
to be a plain tensor that owns exactly its memory (a mode answering
``torch.empty`` with a view of a live tensor, or with memory of another stream,
would have the engine's copy write into that tensor)."""

from __future__ import annotations

import torch


def make(n: int, device, stream) -> torch.Tensor:
    """A fresh ``uint8`` tensor of ``n`` bytes on ``device``, allocated on
    ``stream`` (``None``: the current one) with every mode and transform off."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C._DisableFuncTorch(), torch._C.DisableTorchFunction(), _disable_current_modes(), torch.cuda.stream(stream):
        t = torch._C._VariableFunctions.empty(n, dtype=torch.uint8, device=device)
    if not owns(t, n):
        raise RuntimeError("torch.empty did not give a fresh tensor owning its memory")
    return t


def owns(t: torch.Tensor, n: int) -> bool:
    """Whether ``t`` is a plain tensor that is all of its storage, ``n`` bytes
    (not a view, not a subclass, not a torch.func wrapper, not part of another
    tensor's memory)."""
    if type(t) is not torch.Tensor or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    s = t.untyped_storage()
    return type(t) is torch.Tensor and t._base is None and t.storage_offset() == 0 and s.nbytes() == n and s.data_ptr() == t.data_ptr()
