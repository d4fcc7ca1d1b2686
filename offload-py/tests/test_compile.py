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

from models import MODELS, Chain, flux
from helpers import DEVICES, _bits, _to, blocks_of


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


def _graphs_each_step(cm, x, ref, h, graphs: list) -> list:
    """Four steps of the compiled ``cm`` over the three-block chain, each the
    resident compiled run's bytes with its three blocks streamed: how many
    graphs had been compiled after each."""
    seen = []
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(_bits(cm(x)), _bits(ref))
            assert h.metrics()["blocks"] == 3
            seen.append(len(graphs))
    return seen


def _compiled_whole(m: nn.Module, how: str, order: str, backend, x, dev: str = "cpu", **kw):
    """``m`` compiled whole (``torch.compile(m)`` or ``m.compile()``) with
    ``backend`` and ``kw``, before ``enable`` (and run once on ``dev``) or
    after it: the compiled callable and the handle."""

    def compiled():
        if how == "torch.compile":
            return torch.compile(m, backend=backend, **kw)
        m.compile(backend=backend, **kw)
        return m

    if order == "before":
        m.to(dev)
        cm = compiled()
        with torch.no_grad():
            cm(x)
        m.to("cpu")
        return cm, offload.enable(m, device=dev, auto_resident_gib=0)
    h = offload.enable(m, device=dev, auto_resident_gib=0)
    return compiled(), h


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
    m = _Blocks()
    m.load_state_dict(ref_model.state_dict())
    cm, h = _compiled_whole(m, how, order, _counting(backend, graphs), x)
    try:
        seen = _graphs_each_step(cm, x, ref, h, graphs)
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


def _ops_in(graphs: list) -> dict:
    """How many of each of the package's ops the graphs handed to a backend
    call. Each ``unbind`` must take its block's outputs: what orders every
    kernel reading the block's bytes before the block is given back."""
    seen: dict = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and name.startswith("offload."):
                key = name.split(".")[1]
                seen[key] = seen.get(key, 0) + 1
                if key == "unbind":
                    assert len(node.args[2]) >= 1, f"{node} is given back before anything reads its block"
    return seen


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("how", ["torch.compile", "module.compile"])
@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_whole_module_compiled_with_fullgraph_streams_its_blocks_inside_the_graph(backend, order, how, dev):
    # torch.compile(model, fullgraph=True) in inference: the package's hooks
    # are ops the graph holds (a lend and an unbind a block, between the
    # module's begin and end), the blocks' parameters views of what lend gives;
    # no graph break, nothing compiled again after the first streamed step, and
    # the resident compiled run's bytes. (Before: dynamo refused the hooks.)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graph breaks counted by earlier tests
    x = torch.randn(4, 16, device=dev)
    ref_model = _Blocks().to(dev)
    with torch.no_grad():
        ref = torch.compile(ref_model, backend=backend, fullgraph=True)(x).clone()
    graphs: list = []
    m = _Blocks()
    m.load_state_dict(ref_model.state_dict())
    cm, h = _compiled_whole(m, how, order, _counting(backend, graphs), x, dev, fullgraph=True)
    try:
        seen = _graphs_each_step(cm, x, ref, h, graphs)
        assert seen[1:] == [seen[0]] * 3, seen
        assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
        ops = _ops_in(graphs)
        assert ops.get("lend") == 3 and ops.get("unbind") == 3, ops
        assert ops.get("begin") == 1 and ops.get("end") == 1, ops
        assert h.violations() == []
        # Between steps the module holds its placeholders, not a graph's views.
        assert type(m.blocks[0].up.weight).__name__ == "_Placeholder"
    finally:
        offload.disable(m)
        torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(_bits(m.to(dev)(x)), _bits(ref_model(x)))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_whole_flux_compiled_with_fullgraph_streams_bitwise(backend):
    # The tiny Flux (double and single blocks, rotary tables, adaLN) under
    # torch.compile(model, fullgraph=True): bitwise the resident compiled run
    # from the first step on, one graph, nothing compiled again.
    torch._dynamo.reset()
    model, inputs, _ = flux()
    with torch.no_grad():
        ref = torch.compile(model, backend=backend, fullgraph=True)(**inputs)[0].clone()
    torch._dynamo.reset()
    model, inputs, _ = flux()
    graphs: list = []
    h = offload.enable(model, device="cpu")
    cm = torch.compile(model, backend=_counting(backend, graphs), fullgraph=True)
    seen = []
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(_bits(cm(**inputs)[0]), _bits(ref))
                seen.append(len(graphs))
        assert seen[1:] == [seen[0]] * 2, seen
        assert _ops_in(graphs).get("unbind") == 5
        assert h.metrics()["blocks"] == 5 and h.violations() == []
    finally:
        offload.disable(model)
        torch._dynamo.reset()


def test_a_whole_module_compiled_with_fullgraph_in_grad_mode_is_refused_with_the_packages_reason():
    # In grad mode what autograd saves of a block's weights goes through the
    # package's saved-tensor hooks, which a graph does not call: its hooks stay
    # outside the graph, and under fullgraph=True dynamo's error gives the
    # package's reason and what to do instead, not a builtin of its internals.
    torch._dynamo.reset()
    m, x = _Blocks(), torch.randn(4, 16)
    offload.enable(m, device="cpu")
    try:
        cm = torch.compile(m, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="torch.no_grad") as e:
            cm(x)
        assert "get_ident" not in str(e.value), str(e.value)
        # The module is not left stuck: run eagerly, it streams.
        with torch.no_grad():
            m(x)
    finally:
        offload.disable(m)
    torch._dynamo.reset()


class _DictBlock(nn.Module):
    """A block returning a dict: the ops cannot take its outputs."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 16)

    def forward(self, x):
        return {"x": nn.functional.gelu(self.up(x))}


class _DictBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_DictBlock() for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)["x"]
        return x


def test_a_block_the_ops_cannot_give_back_breaks_the_graph_and_still_streams_bitwise():
    # A block whose output is not tensors: its post-hook cannot be an op, so
    # dynamo breaks the graph at the block's call (fullgraph=False); the
    # block's hooks then run eagerly around it, binding before its forward
    # (which dynamo compiles as a frame of its own), while the module's ops
    # stay in graphs; bitwise the resident compiled run, no recompiles; with
    # fullgraph=True dynamo gives the package's reason.
    torch._dynamo.reset()
    x = torch.randn(4, 16)
    ref_model = _DictBlocks()
    with torch.no_grad():
        ref = torch.compile(ref_model, backend="aot_eager")(x).clone()
    torch._dynamo.reset()
    m = _DictBlocks()
    m.load_state_dict(ref_model.state_dict())
    h = offload.enable(m, device="cpu", auto_resident_gib=0)
    graphs: list = []
    try:
        cm = torch.compile(m, backend=_counting("aot_eager", graphs))
        seen = []
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(_bits(cm(x)), _bits(ref))
                assert h.metrics()["blocks"] == 3
                seen.append(len(graphs))
        ops = _ops_in(graphs)
        assert ops.get("begin") == 1 and ops.get("end") == 1 and ops.get("unbind", 0) == 0, ops
        assert seen[1:] == [seen[0]] * 2, seen
        assert h.violations() == []
        torch._dynamo.reset()
        with pytest.raises(Exception, match="returning other than tensors"), torch.no_grad():
            torch.compile(m, backend="eager", fullgraph=True)(x)
        with torch.no_grad():
            assert torch.equal(_bits(m(x)), _bits(ref_model(x)))
    finally:
        offload.disable(m)
        torch._dynamo.reset()


@pytest.mark.parametrize("when", ["between", "inside"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_block_kept_resident_between_compiled_calls_stays_kept(backend, when):
    # The automatic plan keeps a block resident at a step's end (here called
    # as the plan calls it, between compiled calls): its views are bound for
    # good and its hooks gone. The graph's next calls must not put the
    # placeholders back over them (dynamo replays what a trace wrote into the
    # module); eager calls and disable then find the kept tensors.
    torch._dynamo.reset()
    x = torch.randn(4, 16)
    ref_model = _Blocks()
    with torch.no_grad():
        ref = torch.compile(ref_model, backend=backend, fullgraph=True)(x).clone()
    m = _Blocks()
    m.load_state_dict(ref_model.state_dict())
    h = offload.enable(m, device="cpu", auto_resident_gib=0)
    cm = torch.compile(m, backend=backend, fullgraph=True)
    try:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(_bits(cm(x)), _bits(ref))
            if when == "between":
                h._keep(h._order[1])
            else:
                # At the step's end, inside the graph's last op, as the plan keeps it.
                end = h._end_engine_step

                def end_and_keep():
                    end()
                    h._keep(h._order[1])
                    h._end_engine_step = end

                h._end_engine_step = end_and_keep
            for _ in range(4):
                assert torch.equal(_bits(cm(x)), _bits(ref))
                assert type(m.blocks[1].up.weight) is torch.Tensor, type(m.blocks[1].up.weight)
            assert h.metrics()["blocks"] == 2
            assert torch.equal(_bits(m(x)), _bits(ref))
    finally:
        offload.disable(m)
        torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(_bits(m(x)), _bits(ref_model(x)))


class _ScaledBlock(nn.Module):
    """A block ending in a pointwise read of a weight (LayerScale): inductor
    may fuse it with what follows the block."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.gamma = nn.Parameter(torch.randn(16))

    def forward(self, x):
        return x + self.gamma * nn.functional.gelu(self.up(x))


class _ScaledBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_ScaledBlock() for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum(-1)


def test_inductor_reads_no_block_after_its_give_back():
    # Inductor over the whole module (fp32, where fusing rounds nothing): each
    # block's bytes are filled with NaN as it is given back, so a kernel that
    # read them after its unbind would put NaN in the output. Bitwise the
    # resident compiled run, three steps.
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    ref_model = _ScaledBlocks()
    with torch.no_grad():
        ref = torch.compile(ref_model, fullgraph=True)(x).clone()
    torch._dynamo.reset()
    m = _ScaledBlocks()
    m.load_state_dict(ref_model.state_dict())
    h = offload.enable(m, device="cpu", auto_resident_gib=0)
    unbind = h._unbind

    def poisoned():
        if h._buffer is not None:
            h._buffer.view(torch.float32).fill_(float("nan"))
            # Our own write, not the block's: not the error a block writing its weights gets.
            h._version = None if h._version is None else h._buffer._version
        unbind()

    h._unbind = poisoned
    try:
        cm = torch.compile(m, fullgraph=True)
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(_bits(cm(x)), _bits(ref))
        assert h.metrics()["blocks"] == 4
    finally:
        offload.disable(m)
        torch._dynamo.reset()


@pytest.mark.parametrize("dev", DEVICES)
def test_a_compiled_block_returning_a_view_of_its_own_weight_gets_a_copy(dev):
    # A compiled block's call binds outside its graph: its outputs that view
    # the slot are copied off it there, as the eager hook does.
    from test_quiet_paths import _views_of_own_weights_outlive_the_slot

    def compile_blocks(m):
        for b in m.blocks:
            b.compile(backend="eager", fullgraph=True)

    torch._dynamo.reset()
    _views_of_own_weights_outlive_the_slot(dev, compile_blocks)


@pytest.mark.parametrize("dev", DEVICES)
def test_a_compiled_block_bound_inside_its_call_returning_a_view_of_its_own_weight_gets_a_copy(dev, monkeypatch):
    # Under a hook whose decision the package cannot read ahead a compiled
    # block is bound at its first weight's use inside its call: what it returns
    # or keeps that views the slot is copied off it all the same. The one such
    # hook of diffusers the package knows is MagCache's, on the first block
    # only; TaylorSeer's (read ahead since) stands in for it here on every
    # block, taken as unreadable, in its warm-up, so every block computes.
    from diffusers import TaylorSeerCacheConfig
    from diffusers.hooks.hooks import CacheContext, _set_cache_context
    from diffusers.hooks.taylorseer_cache import apply_taylorseer_cache

    from offload import _hooks
    from test_quiet_paths import _views_of_own_weights_outlive_the_slot

    monkeypatch.setattr(_hooks, "_MAY_ANSWER", (*_hooks._MAY_ANSWER, "TaylorSeerCacheHook"))
    monkeypatch.delitem(_hooks._READ, "TaylorSeerCacheHook")

    def hooked_and_compiled(m):
        apply_taylorseer_cache(m, TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=100, max_order=1,
                                                        taylor_factors_dtype=torch.float32, use_lite_mode=True))
        _set_cache_context(m, CacheContext("c"))
        assert all(_hooks._may_be_answered(b) for b in m.blocks)  # the path bound inside the call
        for b in m.blocks:
            b.compile(backend="eager", fullgraph=False)

    torch._dynamo.reset()
    # The cache keeps what each block returned before the package copied it
    # off the slot: those blocks' bytes are retained, and said so.
    with pytest.warns(UserWarning, match="lent weights of"):
        _views_of_own_weights_outlive_the_slot(dev, hooked_and_compiled)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_whole_compiled_block_returning_a_view_of_its_own_weight_is_refused_by_name(backend):
    # Inside a whole-module graph the output cannot be copied off the slot:
    # the block is named, and the module still disables whole.
    from test_quiet_paths import _LeakyBlocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    m, x = _LeakyBlocks(), torch.randn(2, 8)
    with torch.no_grad():
        ref, _ = m(x)
    offload.enable(m, device="cpu", auto_resident_gib=0)
    cm = torch.compile(m, backend=backend, fullgraph=True)
    with pytest.raises(offload.OffloadError, match=r"block blocks\.0 returns a view of its own streamed weights"), torch.no_grad():
        cm(x)
    offload.disable(m)
    with torch.no_grad():
        assert torch.equal(_bits(m(x)[0]), _bits(ref))


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_real_class_compiled_block_by_block_with_fullgraph_streams_bitwise_without_recompiling(name, order):
    # Beyond Flux, each tiny real class (diffusers' and transformers' own block
    # code: their rotary tables, masks, keyword inputs and tuple outputs): every
    # block compiled with fullgraph=True (a graph break inside one raises),
    # before enable (and run) or after it, gives the resident compiled run's
    # bytes over three steps, and after the first streamed step compiles
    # nothing more.
    torch._dynamo.reset()
    model, inputs, _ = MODELS[name]()
    for b in blocks_of(model):
        b.compile(fullgraph=True, backend=_counting("aot_eager", []))
    with torch.no_grad():
        ref = model(**inputs)[0].clone()
    torch._dynamo.reset()
    graphs: list = []
    counting = _counting("aot_eager", graphs)
    model, inputs, blocks = MODELS[name]()
    if order == "before":
        for b in blocks_of(model):
            b.compile(fullgraph=True, backend=counting)
        with torch.no_grad():
            model(**inputs)
        h = offload.enable(model, device="cpu", depth=1)
    else:
        h = offload.enable(model, device="cpu", depth=1)
        for b in blocks_of(model):
            b.compile(fullgraph=True, backend=counting)
    seen = []
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(_bits(model(**inputs)[0]), _bits(ref)), name
            seen.append(len(graphs))
    assert seen[0] >= 1, "nothing was compiled: the check below would hold of an eager run"
    assert seen[1:] == [seen[0]] * 2, (name, seen)
    assert h.metrics()["blocks"] == blocks and h.violations() == []
    offload.disable(model)


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"flux"}))
def test_each_real_class_compiled_whole_with_fullgraph_streams_bitwise(name):
    # torch.compile(model, fullgraph=True) over each tiny real class beside
    # Flux (above): its blocks' streaming inside the one graph, bitwise the
    # resident compiled run, nothing compiled again after the first step.
    torch._dynamo.reset()
    model, inputs, _ = MODELS[name]()
    with torch.no_grad():
        ref = torch.compile(model, backend="aot_eager", fullgraph=True)(**inputs)[0].clone()
    torch._dynamo.reset()
    model, inputs, blocks = MODELS[name]()
    graphs: list = []
    h = offload.enable(model, device="cpu", depth=1)
    cm = torch.compile(model, backend=_counting("aot_eager", graphs), fullgraph=True)
    seen = []
    try:
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(_bits(cm(**inputs)[0]), _bits(ref)), name
                seen.append(len(graphs))
        assert seen[0] >= 1 and seen[1:] == [seen[0]] * 2, seen
        assert _ops_in(graphs).get("unbind") == blocks, _ops_in(graphs)
        assert h.metrics()["blocks"] == blocks and h.violations() == []
    finally:
        offload.disable(model)
        torch._dynamo.reset()
