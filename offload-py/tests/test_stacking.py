"""What users stack on an offloaded module: a cache that skips blocks (their
weights never cross the link), and the counters that say so."""

from __future__ import annotations

import pytest
import torch

import offload

from models import MODELS, Chain, flux
from helpers import DEVICES, _bits, _to, blocks_of

# Drift of the input across eight denoising steps: a cache with threshold 0.05
# computes steps 0, 3 and 6 (a large change) and returns its output on the rest.
_DRIFT = [0, 0.001, 0.002, 0.2, 0.201, 0.202, 0.5, 0.5005]


def _steps(model, inputs, dev):
    """The eight steps' outputs, and per step whether the blocks after the
    first computed (a layer inside the last block ran) or the cache answered."""
    runs = []
    last = next(m for m in blocks_of(model)[-1].modules() if isinstance(m, torch.nn.Linear))
    h = last.register_forward_hook(lambda *a: runs.append(1))
    outs, computed, metrics = [], [], []
    for d in _DRIFT:
        inp = _to(dict(inputs), dev)
        inp["hidden_states"] = inp["hidden_states"] * (1 + d)
        n = len(runs)
        with torch.no_grad(), model.cache_context("cond"):
            outs.append(model(**inp)[0].clone())
        computed.append(len(runs) > n)
        st = offload.offloaded(model)
        metrics.append(st.metrics() if st is not None else None)
    h.remove()
    return outs, computed, metrics


def _same_steps_copying_what_ran(model, outs, ref, computed, ref_computed, metrics, ran: tuple, ahead: int) -> None:
    """The streamed steps under a cache: the cache decided as resident, every
    output is the resident one bitwise, a computed step ran every block, and a
    cached step ran as many as ``ran`` allows, the rest skipped, copying at most
    ``ahead`` blocks' bytes (the largest's)."""
    assert computed == ref_computed, "the cache decided otherwise than resident"
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert torch.equal(_bits(o), _bits(r)), f"step {i}: the streamed output differs from the resident one with the cache"
    blocks = len(blocks_of(model))
    largest = max(sum(-(-p.numel() * p.element_size() // 256) * 256 for p in b.parameters()) for b in blocks_of(model))
    for i, (m, c) in enumerate(zip(metrics, computed)):
        if c:
            assert m["blocks"] == blocks and m["skipped_blocks"] == 0, (i, m)
        else:
            assert m["blocks"] in ran and m["skipped_blocks"] == blocks - m["blocks"], (i, m)
            assert m["bytes_copied"] <= ahead * largest, (i, m)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dev", DEVICES)
def test_blocks_a_cache_skips_are_never_copied_and_the_steps_stay_bitwise_equal(dev, depth):
    from diffusers import FirstBlockCacheConfig

    model, inputs, _ = flux()
    model.to(dev)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    ref, ref_computed, _ = _steps(model, inputs, dev)
    model.disable_cache()
    assert ref_computed == [True, False, False, True, False, False, True, False], ref_computed
    model.to("cpu")
    h = offload.enable(model, device=dev, depth=depth)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    outs, computed, metrics = _steps(model, inputs, dev)
    # The first block ran (the cache's test); the others were called and
    # answered by the cache: none of their weights crossed the link, but for
    # the blocks copied ahead of the skip decision.
    _same_steps_copying_what_ran(model, outs, ref, computed, ref_computed, metrics, ran=(1,), ahead=depth)
    # Learned: a cached step after a cached step copies nothing.
    assert metrics[2]["bytes_copied"] == 0 and metrics[5]["bytes_copied"] == 0, metrics
    # A prefetch is wasted when its slot is reused before the block ran: here the
    # block copied ahead of each skip runs at the next computed step, so few are.
    wasted = sum(m["wasted_prefetches"] for m in metrics)
    assert wasted <= 3 * depth, [m["wasted_prefetches"] for m in metrics]
    assert h.violations() == []
    model.disable_cache()
    offload.disable(model)


@pytest.mark.parametrize("name", ["wan", "qwen-image"])
def test_a_cache_over_wan_or_qwen_image_copies_only_the_blocks_that_ran(name):
    # Beyond Flux, the other diffusers classes with a cache (their blocks
    # return one tensor, or a pair in the other order): FirstBlockCache decides
    # as resident, every step is the resident one bitwise, and a step the cache
    # answered copies its first block at most; one after another such step, nothing.
    from diffusers import FirstBlockCacheConfig

    model, inputs, _ = MODELS[name]()
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    ref, ref_computed, _ = _steps(model, inputs, "cpu")
    model.disable_cache()
    assert ref_computed[0] and ref_computed.count(False) >= 4, ref_computed
    h = offload.enable(model, device="cpu", depth=1)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    outs, computed, metrics = _steps(model, inputs, "cpu")
    _same_steps_copying_what_ran(model, outs, ref, computed, ref_computed, metrics, ran=(1,), ahead=1)
    again = [m["bytes_copied"] for i, m in enumerate(metrics) if i and not computed[i] and not computed[i - 1]]
    assert again and set(again) == {0}, metrics
    assert h.violations() == []
    model.disable_cache()
    offload.disable(model)


def test_eager_binding_copies_every_called_block():
    # lazy=False binds at the block's start: the same run copies every block a
    # cache answers (what the counters above would show without lazy binding).
    from diffusers import FirstBlockCacheConfig

    model, inputs, _ = flux()
    offload.enable(model, device="cpu", lazy=False)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    _, computed, metrics = _steps(model, inputs, "cpu")
    blocks = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert computed[2] is False and metrics[2]["blocks"] == blocks and metrics[2]["skipped_blocks"] == 0, metrics[2]
    model.disable_cache()
    offload.disable(model)


class _Transposing(torch.nn.Module):
    """A block that reads its weight through properties that compute (`w.T`,
    `w.mT`) and through metadata (`w.shape`) first."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        assert self.w.shape == (8, 8) and self.w.dtype == torch.float32
        return x @ self.w.T + self.w.mT.sum(0)


@pytest.mark.parametrize("dev", DEVICES)
def test_a_weight_read_through_a_computing_property_binds_its_block(dev):
    m, x = Chain(_Transposing).to(dev), torch.randn(2, 8, device=dev)
    with torch.no_grad():
        ref = m(x).clone()
    m.to("cpu")
    h = offload.enable(m, device=dev, auto_resident_gib=0)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(_bits(m(x)), _bits(ref))
    assert h.metrics()["blocks"] == 3 and h.metrics()["skipped_blocks"] == 0
    offload.disable(m)


def _block_cache(kind: str):
    """diffusers' block cache ``kind`` ("first-block" or "mag") for eight
    steps of the tiny Flux, and the name of its hook on the first block."""
    if kind == "first-block":
        from diffusers import FirstBlockCacheConfig
        from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

        return FirstBlockCacheConfig(threshold=0.05), _FBC_LEADER_BLOCK_HOOK
    from diffusers import MagCacheConfig
    from diffusers.hooks.mag_cache import _MAG_CACHE_LEADER_BLOCK_HOOK, FLUX_MAG_RATIOS

    # A threshold that lets MagCache skip up to its limit once it may (after its
    # retention steps): its decision follows the step, not the values.
    config = MagCacheConfig(threshold=10.0, max_skip_steps=3, retention_ratio=0.2, num_inference_steps=len(_DRIFT),
                            mag_ratios=FLUX_MAG_RATIOS)
    return config, _MAG_CACHE_LEADER_BLOCK_HOOK


def _compile(model, how: str, backend, fullgraph: bool) -> None:
    """``model``'s repeated blocks compiled (``how="blocks"``), or the whole module."""
    if how == "blocks":
        model.compile_repeated_blocks(fullgraph=fullgraph, backend=backend)
    else:
        model.compile(fullgraph=fullgraph, backend=backend)


def _cache_decisions(model, inputs, dev, graphs: list, hook_name: str):
    """The eight steps' outputs under a block cache, with per step whether the
    cache let the other blocks compute (its own state, read after the step),
    the package's metrics and how many graphs had been compiled."""
    head = model.transformer_blocks[0]._diffusers_hook.get_hook(hook_name)
    outs, computed, metrics, seen = [], [], [], []
    for d in _DRIFT:
        inp = _to(dict(inputs), dev)
        inp["hidden_states"] = inp["hidden_states"] * (1 + d)
        with torch.no_grad(), model.cache_context("cond"):
            outs.append(model(**inp)[0].clone())
            computed.append(head.state_manager.get_state().should_compute)
        st = offload.offloaded(model)
        metrics.append(st.metrics() if st is not None else None)
        seen.append(len(graphs))
    return outs, computed, metrics, seen


@pytest.mark.parametrize("how", ["blocks", "module"])
@pytest.mark.parametrize("cache", ["first-block", "mag"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dev", DEVICES)
def test_blocks_a_cache_skips_are_never_copied_when_compiled(dev, backend, cache, how):
    # diffusers' FirstBlockCache or MagCache over compile_repeated_blocks or
    # the whole module compiled (fullgraph=False: each cache's own decision is
    # compiler-disabled). A compiled block's weights are bound before its
    # compiled call, and a traced block's by an op at its start, so the package
    # reads the cache's decision first: a block it answers is never lent.
    from test_compile import _counting

    config, hook_name = _block_cache(cache)

    def compiled(model, graphs):
        _compile(model, how, _counting(backend, graphs), fullgraph=False)

    torch._dynamo.reset()
    model, inputs, _ = flux()
    model.to(dev)
    model.enable_cache(config)
    ref_graphs: list = []
    compiled(model, ref_graphs)
    ref, ref_computed, _, ref_seen = _cache_decisions(model, inputs, dev, ref_graphs, hook_name)
    assert ref_computed.count(False) >= 3, ref_computed
    torch._dynamo.reset()
    model, inputs, _ = flux()
    h = offload.enable(model, device=dev, depth=1)
    model.enable_cache(config)
    graphs: list = []
    compiled(model, graphs)
    outs, computed, metrics, seen = _cache_decisions(model, inputs, dev, graphs, hook_name)
    # The first block where the cache runs it (FirstBlockCache's test); none
    # under MagCache, whose first block's hook decides before the block runs:
    # that block is armed, not bound, before its compiled call.
    ran = (1,) if cache == "first-block" else (0,)
    _same_steps_copying_what_ran(model, outs, ref, computed, ref_computed, metrics, ran=ran, ahead=1)
    # Compiled (MagCache's block hooks are compiler-disabled: under
    # compile_repeated_blocks its blocks run eagerly inside their compiled call,
    # resident or streamed, no graph made), and no graph again once the cache's
    # own state has stopped recompiling (a second computed step): the slots'
    # new tensors recompile nothing. Compiled blocks make, step by step, as
    # many graphs as the resident compiled run.
    assert len(set(seen[4:])) == 1, (seen, ref_seen)
    if how == "blocks":
        assert seen == ref_seen and (seen[0] >= 1) == (cache == "first-block"), (seen, ref_seen)
    else:
        # The whole module: the resident run's graphs, and two more, the
        # module's own ops (begin, end) each a graph where the cache's graph
        # break parts the forward. None else: a block's hooks run eagerly
        # between graphs (never a graph of their own), and a block the cache
        # lets run binds at its hook, not inside a frame dynamo traces.
        assert seen == [n + 2 for n in ref_seen], (seen, ref_seen)
    assert h.violations() == []
    model.disable_cache()
    offload.disable(model)


def _skipping(kind: str, model) -> None:
    """Hooks of diffusers that answer whole blocks by a decision of their own:
    TaylorSeer's lite mode (every block predicted between its compute steps)
    or LayerSkip (the second double block never run)."""
    if kind == "taylorseer-lite":
        from diffusers import TaylorSeerCacheConfig

        model.enable_cache(TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=1, max_order=1,
                                                 taylor_factors_dtype=torch.float32, use_lite_mode=True))
    else:
        from diffusers.hooks import LayerSkipConfig, apply_layer_skip

        apply_layer_skip(model, LayerSkipConfig(indices=[1], fqn="transformer_blocks"))


def _skipping_steps(model, inputs, dev, graphs: list):
    """The eight steps' outputs, the package's (blocks run, skipped) per step,
    and how many graphs had been compiled after each."""
    outs, ran, seen = [], [], []
    for d in _DRIFT:
        inp = _to(dict(inputs), dev)
        inp["hidden_states"] = inp["hidden_states"] * (1 + d)
        with torch.no_grad(), model.cache_context("cond"):
            outs.append(model(**inp)[0].clone())
        st = offload.offloaded(model)
        ran.append(None if st is None else (st.metrics()["blocks"], st.metrics()["skipped_blocks"]))
        seen.append(len(graphs))
    return outs, ran, seen


@pytest.mark.parametrize("how", ["blocks", "module"])
@pytest.mark.parametrize("kind", ["taylorseer-lite", "layer-skip"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("dev", DEVICES)
def test_blocks_a_hook_answers_by_its_own_decision_are_never_copied_when_compiled(dev, backend, kind, how):
    # TaylorSeer decides as it counts its steps, compiler-disabled in diffusers
    # (fullgraph=False): the package reads the count's next value before a
    # compiled block's call, or at an eager hook's call inside a compiled
    # module, and binds the blocks it lets run there. LayerSkip's decision is
    # its dropout, read before the block binds: fullgraph=True holds. Either
    # way the blocks they answer copy nothing, as eager.
    from test_compile import _counting

    def compiled(model, graphs):
        _compile(model, how, _counting(backend, graphs), fullgraph=kind == "layer-skip")

    torch._dynamo.reset()
    model, inputs, _ = flux()
    model.to(dev)
    _skipping(kind, model)
    ref_graphs: list = []
    compiled(model, ref_graphs)
    ref, _, ref_seen = _skipping_steps(model, inputs, dev, ref_graphs)
    # Eager, the package binds at the first weight's use: what ran is what the hooks let run.
    model, inputs, _ = flux()
    offload.enable(model, device=dev, depth=1)
    _skipping(kind, model)
    _, eager_ran, _ = _skipping_steps(model, inputs, dev, [])
    offload.disable(model)
    assert any(s for _, s in eager_ran), eager_ran  # the hooks answered blocks
    torch._dynamo.reset()
    model, inputs, _ = flux()
    h = offload.enable(model, device=dev, depth=1)
    _skipping(kind, model)
    graphs: list = []
    compiled(model, graphs)
    outs, ran, seen = _skipping_steps(model, inputs, dev, graphs)
    assert ran == eager_ran, (ran, eager_ran)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert torch.equal(_bits(o), _bits(r)), f"step {i}: differs from the resident compiled run"
    # Compiled, and nothing recompiled once warm: compiled blocks make, step
    # by step, the resident compiled run's graphs; the whole module two more,
    # its own begin and end ops (each a graph where a hook's graph break parts
    # the forward). (Before TaylorSeer's decision was read ahead, a block it
    # let run bound at its first weight's use, a graph break inside the block:
    # 20 graphs against 11 for the module.)
    assert seen == (ref_seen if how == "blocks" else [n + 2 for n in ref_seen]), (seen, ref_seen)
    assert seen[0] >= 1 and len(set(seen[6:])) == 1, seen
    assert h.violations() == []
    offload.disable(model)


def test_compiled_blocks_bind_at_their_start_where_binding_is_eager():
    # lazy=False (and a GGUF block, which binds eagerly) binds a block at its
    # start, compiled or not, unless a hook whose decision the package reads
    # answers the call. MagCache's first block's hook decides from the block's
    # input, which the package cannot read ahead: with lazy=False that block
    # is lent at its compiled call's start on every step, those MagCache
    # answers included, as eager; with lazy binding, never on those.
    config, hook_name = _block_cache("mag")
    for lazy, lent_when_answered in ((False, 1), (True, 0)):
        torch._dynamo.reset()
        model, inputs, _ = flux()
        offload.enable(model, device="cpu", depth=1, lazy=lazy)
        model.enable_cache(config)
        model.compile_repeated_blocks(fullgraph=False, backend="eager")
        _, computed, metrics, _ = _cache_decisions(model, inputs, "cpu", [], hook_name)
        lent = [m["blocks"] for m in metrics]
        answered = [b for c, b in zip(computed, lent) if not c]
        assert answered and all(b == lent_when_answered for b in answered), (lazy, computed, lent)
        model.disable_cache()
        offload.disable(model)
