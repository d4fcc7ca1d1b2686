"""Streaming the real diffusers and transformers classes, tiny and random: every model
streams bitwise equal to its resident run, weights stream as stored (fp8, GGUF,
coded), and disabling puts the module back. CPU rows run on the simulated device; CUDA rows print SKIPPED
without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import sys

import pytest
import torch

import offload
from models import MODELS
from helpers import ROOT, DEVICES, _bits, _out, _to, _snapshot, _same_snapshot, _zoo_anchor


def _streamed_bitwise(model, inputs, dev: str, what: str, **enable):
    """The model's resident output on ``dev`` (finite, not constant), then two
    steps streamed through the package, each bitwise equal to it. Returns the
    handle (still enabled) and the module's snapshot from before."""
    before = _snapshot(model)
    with torch.no_grad():
        ref = _out(model(**_to(inputs, dev))).clone()
    assert torch.isfinite(ref.float()).all() and ref.float().std() > 0, "the resident output is not finite, or constant"
    model.to("cpu")
    if not {"depth", "budget_gib", "calibration"} & enable.keys():
        enable.setdefault("auto_resident_gib", 0)  # streamed throughout: a tiny model on CUDA is host-bound
    h = offload.enable(model, device=dev, **enable)
    with torch.no_grad():
        outs = [_out(model(**_to(inputs, dev))).clone() for _ in range(2)]
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref)), f"{what} on {dev}: the streamed output differs from the resident one"
    return h, before



class _LoRA(torch.nn.Module):
    """A frozen Linear with a trainable low-rank adapter inside it."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank, dtype=base.weight.dtype) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()



class _OneBuffer:
    """A sabotaged engine for the test below: every block lands in one
    persistent buffer, so a view kept past its block is overwritten."""

    def __init__(self, inner):
        self.inner, self.buf = inner, None

    def lend(self, stack, index):
        b = self.inner.lend(stack, index)
        if isinstance(b, (bytearray, bytes)):
            if self.buf is None or len(self.buf) < len(b):
                self.buf = bytearray(len(b))
            self.buf[: len(b)] = b
            return self.buf
        if self.buf is None or self.buf.numel() < b.numel():
            self.buf = torch.empty(b.numel(), dtype=b.dtype, device=b.device)
        self.buf[: b.numel()].copy_(b)
        return self.buf[: b.numel()]

    def __getattr__(self, name):
        return getattr(self.inner, name)



@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name,depth", [(n, 1) for n in MODELS] + [("flux", 2)])
def test_streams_bitwise_equal_and_disable_restores(name, depth, dev):
    model, inputs, _ = MODELS[name]()
    model.to(dev)
    before = _snapshot(model)
    with torch.no_grad():
        ref = _out(model(**_to(inputs, dev))).clone()
    assert torch.isfinite(ref.float()).all() and ref.float().std() > 0, "the resident output is not finite, or constant"
    model.to("cpu")
    h = offload.enable(model, device=dev, depth=depth)
    assert offload.offloaded(model) is h
    blocks = sum(len(model.get_submodule(s)) for s in offload.find_blocks(model))
    with torch.no_grad():
        outs = [_out(model(**_to(inputs, dev))).clone() for _ in range(3)]
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref)), f"{name} on {dev}: the streamed output differs from the resident one"
    m = h.metrics()
    assert m["blocks"] == blocks and m["bytes_copied"] > 0 and m["forgotten_guards"] == 0
    assert m["misses"] == 0, f"steady state: every block prefetched ({m})"
    assert h.violations() == []
    offload.disable(model)
    assert offload.offloaded(model) is None
    model.to(dev)
    _same_snapshot(before, _snapshot(model))



@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("name", ["flux", "wan", "sd3"])
def test_fp8_weights_stream_as_stored_and_upcast_per_layer_as_diffusers_layerwise_casting(name, dev):
    # diffusers' layerwise casting keeps the weights in fp8 and upcasts each layer
    # to bf16 for its forward: streamed, the blocks cross as fp8 (half the bytes),
    # and the same per-layer upcast computes bitwise the resident result.
    model, inputs, _ = MODELS[name]()
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    model.to(dev)
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert fp8, "layerwise casting left no fp8 weight"
    h, before = _streamed_bitwise(model, inputs, dev, f"{name} fp8")
    streamed = {n: p for n, p in h._params.items()}
    assert {n for n in fp8 if n in streamed} and all(streamed[n].dtype == torch.float8_e4m3fn for n in fp8 if n in streamed)
    # The bytes a step are the stored ones, fp8 weights at one byte each: fewer
    # than the same blocks in bf16.
    numel = lambda p: torch.Size(p.shape).numel()
    stored = sum(p.nbytes for p in streamed.values())
    assert stored == sum(numel(p) * (1 if p.dtype == torch.float8_e4m3fn else 2) for p in streamed.values())
    step = h.metrics()["bytes_copied"]
    assert stored <= step < sum(2 * numel(p) for p in streamed.values()), f"{step} bytes a step"
    assert h.violations() == []
    offload.disable(model)
    model.to(dev)
    _same_snapshot(before, _snapshot(model))
    assert all(p.dtype == torch.float8_e4m3fn for n, p in model.named_parameters() if n in fp8)



@pytest.mark.parametrize("name", ["flux", "wan"])
def test_the_benchs_fp8_storage_casts_what_enable_layerwise_casting_casts(name):
    # `zoo_anchor.py --storage fp8` casts what a diffusers user's
    # `enable_layerwise_casting` casts: diffusers' defaults plus the class's own
    # patterns. With the defaults alone Wan's `condition_embedder` went fp8 and its
    # forward raised (it casts the timestep to its weight's dtype; the H200 run at
    # 0b6eb55, bench/NOTES.md).
    sys.path.insert(0, str(ROOT / "bench" / "anchors"))
    try:
        from zoo_anchor import fp8_skip_patterns
    finally:
        sys.path.pop(0)
    from diffusers.hooks import apply_layerwise_casting

    ours, inputs, _ = MODELS[name]()
    theirs, _, _ = MODELS[name]()
    apply_layerwise_casting(ours, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16,
                            skip_modules_pattern=fp8_skip_patterns(ours, "fp8"))
    theirs.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    fp8 = lambda m: {n for n, p in m.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert fp8(ours) and fp8(ours) == fp8(theirs), sorted(fp8(ours) ^ fp8(theirs))[:5]
    if name == "wan":
        assert not any(n.startswith("condition_embedder.") for n in fp8(ours))
    with torch.no_grad():
        out = _out(ours(**inputs))
    assert torch.isfinite(out.float()).all()



@pytest.mark.parametrize("dev", DEVICES)
def test_flux_with_every_block_linear_in_fp8_streams_coded_bitwise(dev):
    # The bench's `--storage fp8-linears` (bench/anchors/zoo_anchor.py): Flux's own
    # skip patterns but `norm`, so its adaLN modulation Linears are fp8 as well
    # (diffusers' default keeps them bf16); streamed with the weights held coded.
    sys.path.insert(0, str(ROOT / "bench" / "anchors"))
    try:
        from zoo_anchor import fp8_skip_patterns
    finally:
        sys.path.pop(0)
    from diffusers.hooks import apply_layerwise_casting

    model, inputs, _ = MODELS["flux"]()
    skip = fp8_skip_patterns(model, "fp8-linears")
    assert "norm" in model._skip_layerwise_casting_patterns and skip == tuple(
        p for p in model._skip_layerwise_casting_patterns if p != "norm"), skip
    apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16, skip_modules_pattern=skip)
    model.to(dev)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["transformer_blocks.0.norm1.linear.weight"] == torch.float8_e4m3fn
    assert dtypes["single_transformer_blocks.0.norm.linear.weight"] == torch.float8_e4m3fn
    h, before = _streamed_bitwise(model, inputs, dev, "flux fp8-linears coded", coded=True)
    assert h.violations() == []
    offload.disable(model)
    model.to(dev)
    _same_snapshot(before, _snapshot(model))



@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_gguf_weights_stream_as_stored_under_diffusers_gguf_layers(quant, dev):
    # diffusers' GGUF quantization (GGUFLinear holding GGUFParameter bytes, what
    # from_single_file with GGUFQuantizationConfig builds): the blocks cross as
    # their stored quantized bytes, each view wrapped again with its quant type,
    # and GGUFLinear dequantises as it computes, bitwise the resident result.
    from models import flux, gguf_quantize

    model, inputs, _ = flux(64 if quant == "Q8_0" else 256)
    model = gguf_quantize(model, quant)
    gguf_names = {n for n, p in model.named_parameters() if type(p).__name__ == "GGUFParameter"}
    weights = {n: torch.Size(p.quant_shape).numel() for n, p in model.named_parameters() if n in gguf_names}
    assert gguf_names
    model.to(dev)
    h, before = _streamed_bitwise(model, inputs, dev, f"GGUF {quant}")
    streamed = {n for n in h._params if n in gguf_names}
    assert streamed, "no GGUF weight streamed"
    # The stored bytes cross: each GGUF weight at its quantized size (34 bytes
    # per 32 weights for Q8_0, 144 per 256 for Q4_K), not bf16's two a weight.
    per = {"Q8_0": 34 / 32, "Q4_K": 144 / 256}[quant]
    assert all(h._params[n].nbytes == weights[n] * per for n in streamed)
    assert h.violations() == []
    offload.disable(model)
    model.to(dev)
    _same_snapshot(before, _snapshot(model))
    assert {n for n, p in model.named_parameters() if type(p).__name__ == "GGUFParameter"} == gguf_names, "quant types lost"



@pytest.mark.parametrize("dev", DEVICES)
def test_the_benchs_q8_0_quantizer_makes_the_gguf_packages_bytes(dev):
    # bench/anchors/zoo_anchor.py quantizes Q8_0 with torch where the weights are
    # (seconds on the GPU for a 12 B model): the same bytes as the gguf package's
    # reference quantizer, zero blocks and halves included.
    import gguf
    import numpy as np

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 512, generator=g) * 0.05).to(torch.bfloat16)
    w[3, 64:96] = 0  # an all-zero block: scale 0
    # A block whose scale is exactly 1 (amax 127) and whose other values sit on
    # halves: gguf's rounding (half away from zero), not torch's (half to even).
    w[5, :31] = torch.arange(31) + 0.5
    w[5, 31] = 127
    want = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    got = _zoo_anchor().q8_0_bytes(w.to(dev)).cpu().numpy()
    assert got.shape == want.shape and np.array_equal(got, want)



def test_the_benchs_gguf_model_streams_bitwise():
    # gguf_quantize_blocks (the bench's `--storage gguf-q8_0`, `gguf-q4_k`): the
    # blocks' Linears as diffusers' GGUF layers, biases kept; streamed bitwise.
    from models import flux

    for quant, head_dim in [("q8_0", 64), ("q4_k", 256)]:
        model, inputs, _ = flux(head_dim)
        bias = {n: p.clone() for n, p in model.named_parameters() if n.endswith(".bias")}
        n = _zoo_anchor().gguf_quantize_blocks(model, quant)
        params = dict(model.named_parameters())
        gguf_names = {k for k, p in params.items() if type(p).__name__ == "GGUFParameter"}
        assert n == len(gguf_names) > 0 and all(k.split(".")[0] in ("transformer_blocks", "single_transformer_blocks") for k in gguf_names)
        assert all(torch.equal(params[k], v) for k, v in bias.items()), "a bias changed"
        h, before = _streamed_bitwise(model, inputs, "cpu", f"bench GGUF {quant}")
        assert h.violations() == []
        offload.disable(model)
        _same_snapshot(before, _snapshot(model))



@pytest.mark.parametrize("name", ["flux", "t5"])
def test_finds_the_block_lists_of_real_classes(name):
    model, _, _ = MODELS[name]()
    want = {"flux": ["transformer_blocks", "single_transformer_blocks"], "t5": ["encoder.block"]}[name]
    assert offload.find_blocks(model) == want



def test_slot_buffers_are_made_with_every_torch_mode_off_and_owning_their_memory():
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from offload._alloc import make, owns

    live = torch.arange(256, dtype=torch.uint8)

    class Aliasing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.empty, torch._C._VariableFunctions.empty):
                return live[: args[0]]
            return func(*args, **(kwargs or {}))

    class AliasingDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("empty"):
                return live[: args[0][0]]
            return func(*args, **(kwargs or {}))

    with Aliasing():
        assert torch.empty(16, dtype=torch.uint8).data_ptr() == live.data_ptr(), "the mode did not intercept"
        t = make(16, "cpu", None)
    assert t.data_ptr() != live.data_ptr() and t.untyped_storage().nbytes() == 16
    with AliasingDispatch():
        t = make(16, "cpu", None)
    assert t.data_ptr() != live.data_ptr() and t._base is None and t.untyped_storage().nbytes() == 16

    # The check after the allocation: a view, a slice of a larger tensor and a
    # subclass are refused; a fresh tensor passes.
    assert not owns(live[:16], 16) and not owns(live[16:32].clone()[0:8], 8) and not owns(live, 16)
    assert not owns(torch.nn.Parameter(torch.empty(16, dtype=torch.uint8), requires_grad=False), 16)
    assert owns(torch.empty(16, dtype=torch.uint8), 16)

    # Inside torch.func's transforms (a block's weight first used in
    # `torch.func.grad`, binding lazily there) a plain `torch.empty` is a
    # wrapper without storage, which the engine could not copy into: `make`
    # turns the transforms off, and `owns` refuses the wrapper.
    seen = {}

    def inside(x):
        wrapped = torch.empty(16, dtype=torch.uint8)
        seen["wrapped"] = owns(wrapped, 16)
        t = make(16, "cpu", None)
        seen["made"] = owns(t, 16)
        torch.utils.dlpack.to_dlpack(t)
        return (x * x).sum()

    torch.func.grad(inside)(torch.randn(3))
    assert seen == {"wrapped": False, "made": True}, seen



@pytest.mark.parametrize("dev", DEVICES)
def test_frozen_streamed_weights_with_a_trainable_adapter_give_the_resident_gradients(dev):
    model, inputs, _ = MODELS["t5"]()
    model.requires_grad_(False)
    for blk in model.encoder.block:
        ff = blk.layer[-1].DenseReluDense
        ff.wi = _LoRA(ff.wi)
    model.to(dev)

    def grads():
        for p in model.parameters():
            p.grad = None
        out = _out(model(**_to(inputs, dev)))
        out.float().square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref = grads()
    model.to("cpu")
    offload.enable(model, device=dev, auto_resident_gib=0)
    got = grads()
    # An update to the resident adapter while offloaded survives disable.
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5)
    want = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    offload.disable(model)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.device.type == "cpu" and torch.equal(_bits(p), _bits(want[n])), f"{n}: the adapter's update was lost"

    assert ref.keys() == got.keys() and len(ref) == 2 * len(model.encoder.block)
    for n in ref:
        assert torch.equal(_bits(ref[n]), _bits(got[n])), f"gradient of {n} differs"
        assert ref[n].float().abs().sum() > 0



def test_the_bitwise_check_catches_a_wrong_binding():
    """Sabotage: two same-sized tensors of one block bound to each other's bytes
    (what a wrong layout would do); the equality the tests above rely on fails."""
    model, inputs, _ = MODELS["flux"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    h = offload.enable(model, device="cpu")
    blk = next(iter(h._blocks.values()))
    a, b = next((p, q) for p in blk.params for q in blk.params if p is not q and p.nbytes == q.nbytes and p.shape == q.shape)
    a.offset, b.offset = b.offset, a.offset
    blk.prepare()  # the binding is worked out from the layout once, at enable
    with torch.no_grad():
        out = _out(model(**inputs))
    offload.disable(model)
    assert not torch.equal(_bits(out), _bits(ref))



@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_coded_streaming_is_bitwise_equal(dev, head_dim):
    # A block whose coding would not shrink it (each coded string carries its
    # table) is held raw: a step never sends more than the blocks hold. Blocks of
    # hundreds of KiB of bf16 weights shrink: the step sends fewer bytes.
    from models import flux

    model, inputs, _ = flux(head_dim)
    model.to(dev)
    with torch.no_grad():
        ref = _out(model(**_to(inputs, dev))).clone()
    model.to("cpu")
    # At a given depth: the depth the package would choose itself rebuilds the
    # ring after the second step, whose new slots' first copies the counters see.
    h = offload.enable(model, device=dev, coded=True, depth=1)
    outs = []
    with torch.no_grad():
        outs.append(_out(model(**_to(inputs, dev))).clone())
        # A steady step copies every block once: the bytes on the link, from the device's counters.
        before = h.counters()["bytes_copied"]
        outs.append(_out(model(**_to(inputs, dev))).clone())
        sent = h.counters()["bytes_copied"] - before
    # The step's metrics count the same bytes on the link as the device.
    assert h.metrics()["link_bytes"] == sent, (h.metrics(), sent)
    assert h.violations() == []
    stored = sum(p.nbytes for p in h._params.values())
    offload.disable(model)
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))
    # Never more than the blocks' bytes (a block coding would not shrink is held
    # raw; the layout's alignment padding aside); fewer where the blocks are large.
    assert sent <= stored + 256 * len(h._params), f"{sent} bytes sent for {stored}"
    if head_dim == 64:
        assert sent < 0.9 * stored, f"{sent} bytes sent for {stored}: coding did not shrink the blocks"



@pytest.mark.parametrize("dev", DEVICES)
def test_a_weight_kept_past_its_block_holds_its_own_bytes(dev):
    # A reference to block 0's streamed weight, taken inside its forward and kept
    # through the rest of the step and a second one (every slot reused, depth 1
    # over five blocks), still reads block 0's bytes; with every block landing
    # in one buffer (the sabotage) it would read another block's.
    from models import t5

    model, inputs, _ = t5(layers=5)
    lin = model.encoder.block[0].layer[0].SelfAttention.q
    want = _bits(lin.weight).clone()

    def run(sabotage):
        kept = []
        h = offload.enable(model, device=dev, depth=1)
        if sabotage:
            h._streamer = _OneBuffer(h._streamer)
        hook = lin.register_forward_hook(lambda m, a, o: kept.append(m.weight) if not kept else None)
        try:
            with torch.no_grad():
                for _ in range(2):
                    model(**_to(inputs, dev))
        finally:
            hook.remove()
            if sabotage:
                h._streamer = h._streamer.inner
            offload.disable(model)
        return _bits(kept[0])

    assert torch.equal(run(False), want)
    assert not torch.equal(run(True), want), "the sabotaged engine went unseen"



def test_the_benchs_fp8_storage_of_a_transformers_model_is_diffusers_defaults():
    # diffusers' casting never reads a transformers model's `_keep_in_fp32_modules`
    # (T5's `wo`): `--storage fp8` on t5-xxl keeps only diffusers' defaults out.
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    model, _, _ = MODELS["t5"]()
    assert getattr(model, "_keep_in_fp32_modules", None), "the tiny T5 has no fp32 modules to leave out"
    assert _zoo_anchor().fp8_skip_patterns(model, "fp8") == tuple(DEFAULT_SKIP_MODULES_PATTERN)



def test_disable_gives_a_channels_last_kernel_back_channels_last():
    class Convs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    torch.manual_seed(3)
    model = Convs().to(memory_format=torch.channels_last)
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        ref = model(x)
    before = _snapshot(model)
    offload.enable(model, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))
    for b in model.blocks:
        assert b.weight.is_contiguous(memory_format=torch.channels_last) and not b.weight.is_contiguous()

