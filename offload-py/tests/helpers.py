"""What the package's tests share: the device rows (a CUDA row is skipped without a
GPU and fails with OFFLOAD_REQUIRE_DEVICE=1), bitwise views, module snapshots."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import offload
from models import MODELS


ROOT = Path(__file__).resolve().parents[2]


HAS_CUDA = torch.cuda.is_available()


if not HAS_CUDA and os.environ.get("OFFLOAD_REQUIRE_DEVICE") == "1":
    raise RuntimeError("OFFLOAD_REQUIRE_DEVICE=1 but torch sees no CUDA device")


# The CUDA rows are always collected; without a GPU each is skipped with its reason (`-rs` prints it).
NO_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="SKIPPED: torch sees no CUDA device")


DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


def exact_attention(dev: str):
    """The attention a bitwise training comparison runs under: on CUDA, SDPA's
    math backend (torch's fused attention backwards accumulate in any order;
    and on the GPU runner's torch 2.11, with torch's defaults, a small Flux's
    *resident* backward gave NaN, the fused attention backward the likeliest
    cause, not yet proven: bench/anchors/sdpa_probe.py probes each backend);
    on the CPU, torch's default."""
    import contextlib

    if dev != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def blocks_of(model) -> list:
    """The model's blocks, in its block lists' order (:func:`offload.find_blocks`)."""
    return [b for path in offload.find_blocks(model) for b in model.get_submodule(path)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t


def _out(o):
    while isinstance(o, (tuple, list)):
        o = o[0]
    return o.last_hidden_state if hasattr(o, "last_hidden_state") else o


def _to(inputs: dict, dev: str) -> dict:
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _snapshot(model):
    # A streamed parameter of an offloaded module holds no bytes to compare (its
    # placeholder refuses every read): its shape stands for them.
    def held(p):
        return torch.tensor(p.shape) if type(p).__name__ == "_Placeholder" else _bits(p).clone()

    return (
        {n: (id(p), p.device, p.dtype, held(p)) for n, p in model.named_parameters()},
        {n: (b.device, _bits(b).clone()) for n, b in model.named_buffers()},
    )


def _same_snapshot(a, b):
    (pa, ba), (pb, bb) = a, b
    assert pa.keys() == pb.keys() and ba.keys() == bb.keys()
    for n in pa:
        assert pa[n][:3] == pb[n][:3], f"{n}: object, device or dtype changed"
        assert torch.equal(pa[n][3], pb[n][3]), f"{n}: bytes changed"
    for n in ba:
        assert ba[n][0] == bb[n][0] and torch.equal(ba[n][1], bb[n][1]), f"buffer {n} changed"


def _zoo_anchor():
    sys.path.insert(0, str(ROOT / "bench" / "anchors"))
    try:
        import zoo_anchor
    finally:
        sys.path.pop(0)
    return zoo_anchor


_CAPTURE = """
import sys, torch, offload
sys.path.insert(0, {tests!r})
from models import MODELS
model, inputs, _ = MODELS["flux"]()
x = {{k: (v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}}
h = offload.enable(model, device="cuda", depth=1)
with torch.no_grad():
    model(**x)
if {sabotage}:
    offload._offloaded._capturing = lambda device: False  # the check on torch's stream gone
try:
    with torch.no_grad(), torch.cuda.graph(torch.cuda.CUDAGraph()):
        model(**x)
    print("OUTCOME captured without an error")
except Exception as e:
    print("OUTCOME", type(e).__name__, str(e).replace(chr(10), " ")[:300])
"""


class _Lin(torch.nn.Module):
    """Blocks of plain linear layers (the smallest model the package streams)."""

    def __init__(self, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Running(torch.nn.Module):
    """A block that updates a frozen parameter of its own in its forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.running = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(x) - self.running

