"""Compiled blocks on an offloaded module: ``block.compile(fullgraph=True)``
and diffusers' ``compile_repeated_blocks(fullgraph=True)``, compiled before
``enable`` (and run) or after it; the package binds a compiled block's weights
outside its compiled region, so no graph break, no recompilation across steps,
and the resident compiled run's bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload

from models import Chain, flux
from helpers import DEVICES, _bits, _to


def _counting(backend: str, graphs: list):
    """``backend``, counting the graphs it is handed (a recompilation is one more)."""
    inner = torch._dynamo.lookup_backend(backend)

    def compile_fn(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return compile_fn


class _Block(nn.Module):
    """A block of a class of the test's own: dynamo compiles a module's call only
    where its code is not torch's (``nn.Sequential(...).compile()`` compiles
    nothing: torch's own modules are skipped, and run as they are)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def _Blocks() -> Chain:
    return Chain(_Block)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_blocks_stream_bitwise_equal_without_recompiling(backend, order, dev):
    torch._dynamo.reset()
    x = torch.randn(4, 16, device=dev)
    ref_model = _Blocks().to(dev)
    resident_backend = _counting(backend, [])
    for b in ref_model.blocks:
        b.compile(fullgraph=True, backend=resident_backend)
    with torch.no_grad():
        ref = ref_model(x).clone()
    graphs: list = []
    # One backend for the model's blocks, as compile_repeated_blocks gives them
    # (a backend each would recompile the blocks' shared code for each).
    counting = _counting(backend, graphs)
    m = _Blocks()
    if order == "before":
        # Compiled and run before enable: its graphs were made for resident weights.
        m.to(dev)
        for b in m.blocks:
            b.compile(fullgraph=True, backend=counting)
        with torch.no_grad():
            m(x)
        m.to("cpu")
        h = offload.enable(m, device=dev, auto_resident_gib=0)
    else:
        h = offload.enable(m, device=dev, auto_resident_gib=0)
        for b in m.blocks:
            b.compile(fullgraph=True, backend=counting)
    seen = []
    with torch.no_grad():
        for _ in range(5):
            assert torch.equal(_bits(m(x)), _bits(ref))
            seen.append(len(graphs))
    # The blocks were compiled (a graph each at least), and, warmed up after the
    # first streamed step, the slots' new tensors every step recompile nothing.
    assert seen[0] >= 1, "nothing was compiled: the check below would hold of an eager run"
    assert seen[1:] == [seen[0]] * 4, seen
    assert h.metrics()["blocks"] == 3 and h.violations() == []
    offload.disable(m)
    m.to(dev)
    with torch.no_grad():
        assert torch.equal(_bits(m(x)), _bits(ref))


@pytest.mark.parametrize("order", ["before", "after"])
def test_compile_repeated_blocks_with_fullgraph_on_a_streamed_flux(order):
    torch._dynamo.reset()
    model, inputs, _ = flux()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    with torch.no_grad():
        ref = model(**inputs)[0].clone()
    model, inputs, _ = flux()
    if order == "before":
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
        with torch.no_grad():
            model(**inputs)
        offload.enable(model, device="cpu")
    else:
        offload.enable(model, device="cpu")
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(_bits(model(**inputs)[0]), _bits(ref))
    offload.disable(model)


@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_whole_module_compiled_either_order_streams_bitwise_without_recompiling(backend, order, how):
    # torch.compile(model) / model.compile() (fullgraph=False), compiled before
    # enable (and run) or after: the package's hooks run outside the graphs,
    # the blocks' code is compiled, the output is the resident compiled run's,
    # and from the first streamed step on no graph is compiled again.
    torch._dynamo.reset()
    x = torch.randn(4, 16)
    ref_model = _Blocks()
    with torch.no_grad():
        ref = torch.compile(ref_model, backend=backend)(x).clone()
    graphs: list = []
    counting = _counting(backend, graphs)
    m = _Blocks()
    m.load_state_dict(ref_model.state_dict())

    def compiled():
        if how == "torch.compile":
            return torch.compile(m, backend=counting)
        m.compile(backend=counting)
        return m

    if order == "before":
        cm = compiled()
        with torch.no_grad():
            cm(x)
        h = offload.enable(m, device="cpu", auto_resident_gib=0)
    else:
        h = offload.enable(m, device="cpu", auto_resident_gib=0)
        cm = compiled()
    seen = []
    try:
        with torch.no_grad():
            for _ in range(4):
                assert torch.equal(_bits(cm(x)), _bits(ref))
                assert h.metrics()["blocks"] == 3
                seen.append(len(graphs))
        assert seen[0] >= 1, "nothing was compiled"
        assert seen[1:] == [seen[0]] * 3, seen
        assert h.violations() == []
    finally:
        offload.disable(m)
        torch._dynamo.reset()


def test_a_whole_compiled_module_still_streams_with_its_graph_breaks():
    # torch.compile(model) without fullgraph: the package's hooks run where
    # dynamo breaks the graph, as before; bitwise the resident run.
    torch._dynamo.reset()
    m, x = _Blocks(), torch.randn(4, 16)
    with torch.no_grad():
        ref = m(x).clone()
    h = offload.enable(m, device="cpu")
    cm = torch.compile(m, backend="eager")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(cm(x), ref)
    assert h.metrics()["blocks"] == 3
    offload.disable(m)


def test_a_whole_module_compiled_with_fullgraph_is_refused_with_the_packages_reason():
    # torch.compile(model, fullgraph=True): the package's hooks lend weights
    # between blocks, outside any graph. Dynamo's error gives the package's
    # reason and what to do instead, not a builtin of its internals.
    torch._dynamo.reset()
    m, x = _Blocks(), torch.randn(4, 16)
    offload.enable(m, device="cpu")
    try:
        cm = torch.compile(m, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="compile_repeated_blocks") as e, torch.no_grad():
            cm(x)
        assert "get_ident" not in str(e.value), str(e.value)
        # The module is not left stuck: run eagerly, it streams.
        with torch.no_grad():
            m(x)
    finally:
        offload.disable(m)
    torch._dynamo.reset()
