"""The Python package on the real diffusers and transformers classes, tiny and
random: every model streams bitwise equal to its resident run, disabling puts
the module back, bad input is a named error. CPU tests run on the simulated
device (host memory standing in for the GPU, the ring's protocol checked);
the CUDA ones print SKIPPED without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload import OffloadError

from models import MODELS

ROOT = Path(__file__).resolve().parents[2]


HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and os.environ.get("OFFLOAD_REQUIRE_DEVICE") == "1":
    raise RuntimeError("OFFLOAD_REQUIRE_DEVICE=1 but torch sees no CUDA device")
# The CUDA rows are always collected; without a GPU each is skipped with its reason (`-rs` prints it).
NO_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="SKIPPED: torch sees no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


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


def _streamed_bitwise(model, inputs, dev: str, what: str, **enable):
    """The model's resident output on ``dev`` (finite, not constant), then two
    steps streamed through the package, each bitwise equal to it. Returns the
    handle (still enabled) and the module's snapshot from before."""
    before = _snapshot(model)
    with torch.no_grad():
        ref = _out(model(**_to(inputs, dev))).clone()
    assert torch.isfinite(ref.float()).all() and ref.float().std() > 0, "the resident output is not finite, or constant"
    model.to("cpu")
    h = offload.enable(model, device=dev, **enable)
    with torch.no_grad():
        outs = [_out(model(**_to(inputs, dev))).clone() for _ in range(2)]
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref)), f"{what} on {dev}: the streamed output differs from the resident one"
    return h, before


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


def _zoo_anchor():
    sys.path.insert(0, str(ROOT / "bench" / "anchors"))
    try:
        import zoo_anchor
    finally:
        sys.path.pop(0)
    return zoo_anchor


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


def test_a_tensor_subclass_the_package_cannot_stream_is_named():
    class Odd(torch.nn.Parameter):
        pass

    model, _, _ = MODELS["t5"]()
    before = _snapshot(model)
    blk = model.encoder.block[1].layer[0].SelfAttention.q
    blk.weight = Odd(blk.weight.detach(), requires_grad=False)
    with pytest.raises(OffloadError, match=r"encoder\.block\.1\.layer\.0\.SelfAttention\.q\.weight.*tensor subclass"):
        offload.enable(model, device="cpu")
    assert offload.offloaded(model) is None


@pytest.mark.parametrize("name", ["flux", "t5"])
def test_finds_the_block_lists_of_real_classes(name):
    model, _, _ = MODELS[name]()
    want = {"flux": ["transformer_blocks", "single_transformer_blocks"], "t5": ["encoder.block"]}[name]
    assert offload.find_blocks(model) == want


def test_a_module_without_block_list_is_a_named_error():
    with pytest.raises(OffloadError, match=r"'Linear'.*no block list"):
        offload.enable(torch.nn.Linear(4, 4), device="cpu")


def test_enabling_twice_is_refused_and_leaves_the_module_as_it_was():
    model, inputs, _ = MODELS["t5"]()
    offload.enable(model, device="cpu")
    snap = _snapshot(model)
    with pytest.raises(OffloadError, match="already offloaded"):
        offload.enable(model, device="cpu")
    _same_snapshot(snap, _snapshot(model))
    offload.disable(model)
    with pytest.raises(OffloadError, match="not offloaded"):
        offload.disable(model)


def test_a_failed_enable_leaves_the_module_as_it_was():
    model, _, _ = MODELS["flux"]()
    before = _snapshot(model)
    calls = []

    def boom(done, total):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt("stop")

    import contextlib

    import offload._module as mod

    @contextlib.contextmanager
    def progress(update):
        real = mod._progress
        mod._progress = lambda desc, enabled: (None, update)
        try:
            yield
        finally:
            mod._progress = real

    # Ctrl-C inside the engine's call is raised again as itself, not folded into
    # an OffloadError that a caller's `except Exception` would swallow.
    with progress(boom), pytest.raises(KeyboardInterrupt, match="stop"):
        offload.enable(model, device="cpu")
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))
    assert not model._forward_hooks and not model.transformer_blocks[0]._forward_pre_hooks

    def bad(done, total):
        raise ValueError("a broken bar")

    with progress(bad), pytest.raises(OffloadError, match="progress callback.*a broken bar"):
        offload.enable(model, device="cpu")
    _same_snapshot(before, _snapshot(model))
    # Nothing kept from the interrupt above leaks into a later, unrelated error.
    with pytest.raises(OffloadError, match="no block list"):
        offload.enable(torch.nn.Linear(2, 2), device="cpu")


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


def test_bad_arguments_name_the_component():
    model, _, _ = MODELS["t5"]()
    with pytest.raises(OffloadError, match="T5EncoderModel"):
        offload.enable(model, device="cpu", depth=0)
    with pytest.raises(OffloadError, match="no block list 'nope'"):
        offload.enable(model, device="cpu", blocks=["nope"])
    with pytest.raises(OffloadError, match="T5EncoderModel.*/nonexistent.safetensors: No such file"):
        offload.enable(model, device="cpu", checkpoint="/nonexistent.safetensors")
    assert offload.offloaded(model) is None


def test_an_error_inside_a_block_leaves_the_ring_usable():
    model, inputs, _ = MODELS["t5"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    h = offload.enable(model, device="cpu")
    bad = dict(inputs, input_ids=torch.full((2, 9), 10_000))  # past the vocabulary
    with pytest.raises(IndexError), torch.no_grad():
        model(**bad)
    with torch.no_grad():
        out = _out(model(**inputs))
    assert torch.equal(_bits(out), _bits(ref))
    assert h.metrics()["forgotten_guards"] == 0
    offload.disable(model)


def test_tied_weights_are_a_named_error():
    class Block(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x)

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(torch.nn.ModuleList([Block(shared), Block(shared)]))
    with pytest.raises(OffloadError, match="tied"):
        offload.enable(model, device="cpu")


class _LoRA(torch.nn.Module):
    """A frozen Linear with a trainable low-rank adapter inside it."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2):
        super().__init__()
        self.base = base
        self.lora_a = torch.nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(base.out_features, rank, dtype=base.weight.dtype) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


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
    offload.enable(model, device=dev)
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


def test_a_long_host_wait_lets_other_python_threads_run():
    # The engine's host-side waits (here the bandwidth probe's copies and
    # synchronisations) run with the GIL released: another thread keeps running
    # through the call. Held, no line of the other thread runs between the call's
    # first and last 50 ms.
    import threading
    import time

    model, _, _ = MODELS["flux"]()
    h = offload.enable(model, device="cpu")
    stamps, stop = [], threading.Event()

    def other():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=other)
    th.start()
    try:
        time.sleep(0.02)
        # A call long enough to tell, however fast or busy this machine: the
        # passes doubled until one call takes at least 0.3 s.
        passes = 100
        for _ in range(16):
            t0 = time.perf_counter()
            h.probe_bandwidth(passes)
            t1 = time.perf_counter()
            if t1 - t0 >= 0.3:
                break
            passes *= 2
    finally:
        stop.set()
        th.join()
        offload.disable(model)
    assert t1 - t0 >= 0.3, f"the probe took {t1 - t0:.3f} s at {passes} passes: too short to tell"
    inside = [s for s in stamps if t0 + 0.05 < s < t1 - 0.05]
    # Held, none; released, the other thread wakes about once a millisecond: ask
    # for a tenth of that (a busy machine wakes it less often).
    want = max(10, int((t1 - t0 - 0.1) * 100))
    assert len(inside) >= want, f"the other thread ran {len(inside)} times in the {t1 - t0:.2f} s call (want {want})"


def test_metrics_before_any_step_is_a_named_error():
    model, _, _ = MODELS["t5"]()
    h = offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match="no step has ended"):
        h.metrics()
    offload.disable(model)


def test_no_host_sync_in_steady_state_on_the_simulated_device():
    # The CUDA row's check, on the CPU: after the first step (which learns the
    # order), a step synchronises the host nowhere, and computes as resident.
    model, inputs, _ = MODELS["flux"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    h = offload.enable(model, device="cpu", depth=1)
    with torch.no_grad():
        _out(model(**inputs))
        syncs = h.counters()["syncs"]
        out = _out(model(**inputs)).clone()
        out2 = _out(model(**inputs)).clone()
    assert h.counters()["syncs"] == syncs, "a steady-state step synchronised the host"
    assert torch.equal(_bits(out), _bits(ref)) and torch.equal(_bits(out2), _bits(ref))
    offload.disable(model)


@NO_CUDA
def test_cuda_user_stream_and_no_host_sync_in_steady_state():
    model, inputs, _ = MODELS["flux"]()
    model.to("cuda")
    with torch.no_grad():
        ref = _out(model(**_to(inputs, "cuda"))).clone()
    model.to("cpu")
    h = offload.enable(model, device="cuda", depth=1)
    with torch.no_grad():
        _out(model(**_to(inputs, "cuda")))
        syncs = h.counters()["syncs"]
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            out = _out(model(**_to(inputs, "cuda"))).clone()
        torch.cuda.current_stream().wait_stream(s)
        out2 = _out(model(**_to(inputs, "cuda"))).clone()
    assert h.counters()["syncs"] == syncs, "a steady-state step synchronised the host"
    assert torch.equal(_bits(out), _bits(ref)) and torch.equal(_bits(out2), _bits(ref))
    assert h.violations() == []
    offload.disable(model)


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
    offload._module._capturing = lambda device: False  # the check on torch's stream gone
try:
    with torch.no_grad(), torch.cuda.graph(torch.cuda.CUDAGraph()):
        model(**x)
    print("OUTCOME captured without an error")
except Exception as e:
    print("OUTCOME", type(e).__name__, str(e).replace(chr(10), " ")[:300])
"""


def _capture_outcome(sabotage: bool) -> str:
    import subprocess

    script = _CAPTURE.format(tests=str(Path(__file__).parent), sabotage=sabotage)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    lines = [l for l in r.stdout.splitlines() if l.startswith("OUTCOME")]
    assert lines, f"the capture script printed no outcome (rc {r.returncode}): {r.stderr[-2000:]}"
    return lines[-1]


@NO_CUDA
def test_cuda_a_forward_probe_or_calibration_under_graph_capture_is_refused_and_the_module_runs_on():
    """torch.cuda.graph captures on a side stream of its own: a forward, a probe
    or a calibration under it is a named error before the engine issues
    anything, and the same module runs bitwise equal outside capture after."""
    model, inputs, _ = MODELS["flux"]()
    x = _to(inputs, "cuda")
    model.to("cuda")
    with torch.no_grad():
        ref = _out(model(**x)).clone()
    model.to("cpu")
    h = offload.enable(model, device="cuda", depth=1)
    with torch.no_grad():
        _out(model(**x))
    calls = {
        "forward": lambda: model(**x),
        "probe_bandwidth": lambda: h.probe_bandwidth(1),
        "calibration": lambda: h.calibration(),
    }
    for name, call in calls.items():
        with pytest.raises(OffloadError, match="captured into a CUDA graph") as e, torch.no_grad():
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                call()
        said = str(e.value)
        assert said.startswith(f"component {h.component!r}: "), said
        assert (said.split(": ")[1].startswith("block ") if name == "forward" else name in said), said
    with torch.no_grad():
        out = _out(model(**x)).clone()
    assert torch.equal(_bits(out), _bits(ref))
    assert h.violations() == []
    assert h.metrics()["forgotten_guards"] == 0
    offload.disable(model)


@NO_CUDA
def test_cuda_the_capture_test_fails_without_the_check_on_torchs_stream():
    """Sabotage of the test above, each in its own process (a capture gone wrong
    may leave the device unusable to the rest): with the check on torch's
    current stream, the capture is refused by name; without it, it is not (the
    engine's own check looks at its compute stream, which torch.cuda.graph does
    not capture)."""
    assert "captured into a CUDA graph" in _capture_outcome(sabotage=False)
    broken = _capture_outcome(sabotage=True)
    assert "captured into a CUDA graph" not in broken, broken
    print("without the check:", broken)


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


def test_a_calibration_taken_from_a_checkpoint_plans_the_module_with_or_without_it(tmp_path):
    # A ring served from a checkpoint lays its blocks out as the file does, with
    # other padding than the host store's own layout: its calibration still
    # plans the same module, served from the file or not (bytes within the
    # tensors' alignment), and another module's is still refused.
    from safetensors.torch import save_file

    model, inputs, _ = MODELS["flux"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    h = offload.enable(model, device="cpu", checkpoint=str(path))
    names = list(offload.find_blocks(model))
    blocks = [f"{n}.{i}" for n in names for i in range(len(model.get_submodule(n)))]
    cal = h.calibration(compute_s={b: 0.01 for b in blocks})
    offload.disable(model)
    plain = offload.enable(model, device="cpu")
    own = plain.calibration(compute_s={b: 0.01 for b in blocks})
    offload.disable(model)
    # The file's layout is not the store's: the case this test is for.
    assert [b["bytes"] for b in cal["blocks"]] != [b["bytes"] for b in own["blocks"]], (cal, own)
    for kw in ({}, {"checkpoint": str(path)}):
        h = offload.enable(model, device="cpu", budget_gib=1.0, calibration=cal, **kw)
        with torch.no_grad():
            out = _out(model(**inputs))
        offload.disable(model)
        assert torch.equal(_bits(out), _bits(ref)), kw
    # Bytes beyond the tensors' alignment are another module's.
    bad = dict(cal, blocks=[dict(b, bytes=b["bytes"] + (1 << 20)) if i == 1 else b for i, b in enumerate(cal["blocks"])])
    with pytest.raises(OffloadError, match=r"calibration block .* bytes.*calibrate this module"):
        offload.enable(model, device="cpu", budget_gib=1.0, calibration=bad)


def _t5_block_and_resident(model):
    """A T5 encoder block's bytes in its slot (each tensor 256-byte aligned), and
    the bytes that stay resident (the tensors outside the blocks)."""
    block = sum(-(-p.numel() * p.element_size() // 256) * 256 for p in model.encoder.block[1].parameters())
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".block." not in n)
    resident += sum(b.numel() * b.element_size() for b in model.buffers())
    return block, resident


def test_a_budget_keeps_the_blocks_it_holds_resident():
    from models import t5

    model, inputs, blocks = t5(layers=5)
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    block, resident = _t5_block_and_resident(model)
    # Room for the two slots at depth 1 and one more block: one block stays resident.
    h = offload.enable(model, device="cpu", budget_gib=(resident + 3 * block + 1024) / 2**30)
    with torch.no_grad():
        model(**inputs)
        out = _out(model(**inputs))
    m = h.metrics()
    offload.disable(model)
    assert torch.equal(_bits(out), _bits(ref))
    assert m["resident_hits"] == 1 and m["blocks"] == blocks, m
    with pytest.raises(OffloadError, match="does not hold its resident tensors"):
        offload.enable(model, device="cpu", budget_gib=resident / 2**31)
    with pytest.raises(OffloadError, match="below what the plan needs|budget"):
        offload.enable(model, device="cpu", budget_gib=(resident + block) / 2**30)
    assert offload.offloaded(model) is None


def test_a_calibration_plans_with_the_blocks_compute_times():
    from models import t5

    model, inputs, blocks = t5(layers=6)
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    block, resident = _t5_block_and_resident(model)
    budget = (resident + 3 * block + 1024) / 2**30
    h = offload.enable(model, device="cpu")
    # Block 3 computes for a second, the others not at all; each copy takes half a
    # second: the ring's replay is shortest with block 3 resident (2.5 s a step
    # against 3.0 for any other), where byte counts alone cannot tell the blocks apart.
    cal = h.calibration(compute_s={f"encoder.block.{i}": (1.0 if i == 3 else 0.0) for i in range(blocks)})
    offload.disable(model)
    assert [b["id"] for b in cal["blocks"]] == [f"encoder.block.{i}" for i in range(blocks)]
    assert cal["bandwidth_bytes_per_s"] > 0
    cal["bandwidth_bytes_per_s"] = cal["blocks"][0]["bytes"] / 0.5
    h = offload.enable(model, device="cpu", budget_gib=budget)
    bytes_only = h.plan()
    offload.disable(model)
    h = offload.enable(model, device="cpu", budget_gib=budget, calibration=cal)
    plan = h.plan()
    assert (plan["depth"], plan["resident_blocks"], plan["chosen_by"]) == (1, ["encoder.block.3"], "budget"), (plan, bytes_only)
    assert "replaying the calibration" in plan["why"] and "by bytes alone" in bytes_only["why"], (plan, bytes_only)
    assert bytes_only["resident_blocks"] != plan["resident_blocks"]
    with torch.no_grad():
        out = _out(model(**inputs))
    m = h.metrics()
    offload.disable(model)
    assert torch.equal(_bits(out), _bits(ref))
    assert m["resident_hits"] == 1, m

    # Named errors: another module's calibration, no budget, a block without a time.
    bad = dict(cal, blocks=[dict(b, bytes=b["bytes"] + (1 << 20)) if b["id"] == "encoder.block.2" else b for b in cal["blocks"]])
    with pytest.raises(OffloadError, match=r"calibration block encoder\.block\.2 .*calibrate this module"):
        offload.enable(model, device="cpu", budget_gib=budget, calibration=bad)
    with pytest.raises(OffloadError, match="has 5 blocks, the module 6"):
        offload.enable(model, device="cpu", budget_gib=budget, calibration=dict(cal, blocks=cal["blocks"][:5]))
    with pytest.raises(OffloadError, match="plans under a device budget"):
        offload.enable(model, device="cpu", calibration=cal)
    with pytest.raises(OffloadError, match="give coded=False"):
        offload.enable(model, device="cpu", budget_gib=budget, calibration=cal, coded=True)
    assert offload.offloaded(model) is None
    h = offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"block encoder\.block\.5 has no time in compute_s"):
        h.calibration(compute_s={f"encoder.block.{i}": 0.1 for i in range(5)})
    with pytest.raises(OffloadError, match="ran in no traced step"):
        h.calibration()
    offload.disable(model)


def test_a_pipeline_streams_every_component_under_one_budget():
    t5, t5_in, _ = MODELS["t5"]()
    flux, flux_in, _ = MODELS["flux"]()
    head = torch.nn.Linear(8, 8).to(torch.bfloat16)
    with torch.no_grad():
        refs = (_out(t5(**t5_in)).clone(), _out(flux(**flux_in)).clone())
    before = (_snapshot(t5), _snapshot(flux))
    pipe = {"text_encoder": t5, "transformer": flux, "vae": head, "scheduler": object()}
    handles = offload.enable_pipeline(pipe, device="cpu", budget_gib=1.0)
    assert set(handles) == {"text_encoder", "transformer"}
    with torch.no_grad():
        outs = (_out(t5(**t5_in)), _out(flux(**flux_in)))
    for o, r in zip(outs, refs):
        assert torch.equal(_bits(o), _bits(r))
    assert handles["transformer"].metrics()["resident_hits"] > 0, "the denoiser keeps blocks resident with the budget left"
    assert handles["text_encoder"].metrics()["resident_hits"] == 0
    offload.disable_pipeline(pipe)
    _same_snapshot(before[0], _snapshot(t5))
    _same_snapshot(before[1], _snapshot(flux))
    with pytest.raises(OffloadError, match="below what streaming needs"):
        offload.enable_pipeline(pipe, device="cpu", budget_gib=1e-6)
    assert offload.offloaded(t5) is None and offload.offloaded(flux) is None


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


@NO_CUDA
def test_cuda_a_mapped_checkpoint_and_the_trace(tmp_path):
    from safetensors.torch import save_file

    model, inputs, _ = MODELS["flux"]()
    model.to("cuda")
    with torch.no_grad():
        ref = _out(model(**_to(inputs, "cuda"))).clone()
    model.to("cpu")
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    h = offload.enable(model, device="cuda", checkpoint=str(path))
    h.enable_trace()
    with torch.no_grad():
        out = _out(model(**_to(inputs, "cuda"))).clone()
    h.write_trace(str(tmp_path / "trace.json"))
    # The traced step's compute times make a calibration the planner takes.
    cal = h.calibration()
    offload.disable(model)
    assert torch.equal(_bits(out), _bits(ref))
    assert cal["bandwidth_bytes_per_s"] > 0 and all(b["compute_s"] > 0 for b in cal["blocks"]), cal
    h = offload.enable(model, device="cuda", budget_gib=1.0, calibration=cal)
    with torch.no_grad():
        again = _out(model(**_to(inputs, "cuda"))).clone()
    offload.disable(model)
    assert torch.equal(_bits(again), _bits(ref))
    import json

    events = json.load(open(tmp_path / "trace.json"))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any("transformer_blocks.0" in str(e.get("name", "")) for e in events), "the trace names the blocks"
    with pytest.raises(OffloadError, match="not in"):
        other, _, _ = MODELS["t5"]()
        offload.enable(other, device="cuda", checkpoint=str(path))


def test_named_block_items_and_a_bad_tensor_are_named_errors():
    from collections import OrderedDict

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    model = torch.nn.Module()
    model.blocks = torch.nn.Sequential(OrderedDict(a=Block(), b=Block()))
    with pytest.raises(OffloadError, match="names its item 0 'a'"):
        offload.enable(model, device="cpu")
    from offload._offload import Streamer

    with pytest.raises(OffloadError, match="blocks.0.w"):
        Streamer("c", [("blocks.0.w", "BF16", [2], "not a tensor"), ("blocks.1.w", "BF16", [2], "x")], ["blocks"])
    with pytest.raises(OffloadError, match="dtype Q4"):
        Streamer("c", [("blocks.0.w", "Q4", [2], None)], ["blocks"])


def test_a_tensor_of_another_dtype_than_declared_is_a_named_error():
    # The same byte count, other elements: bf16 bytes declared F32 (or fp8 over
    # u8, i32 over f32) would stream as another tensor, unseen.
    from offload._offload import Streamer

    for declared, tensor in [
        ("F32", torch.arange(8, dtype=torch.bfloat16)),
        ("I32", torch.zeros(4)),
        ("F8_E4M3", torch.zeros(4, dtype=torch.uint8)),
        ("U8", torch.zeros(4, dtype=torch.float8_e4m3fn)),
    ]:
        n = 4 if declared != "F32" else 4
        rest = ("blocks.1.w", declared, [n], tensor.clone())
        with pytest.raises(OffloadError, match=rf"blocks\.0\.w: declared .*{declared.split('_')[0]}"):
            Streamer("c", [("blocks.0.w", declared, [n], tensor), rest], ["blocks"])
    # Declared as held, each builds.
    for dt, name in [(torch.bfloat16, "BF16"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.bool, "BOOL"), (torch.int64, "I64")]:
        t = torch.zeros(4, dtype=dt)
        Streamer("c", [("blocks.0.w", name, [4], t), ("blocks.1.w", name, [4], t.clone())], ["blocks"]).close()


@pytest.mark.parametrize("keep", [False, True])
def test_one_host_copy_unless_asked_and_disable_rebuilds_the_same_bytes(keep):
    model, inputs, _ = MODELS["t5"]()
    before = _snapshot(model)
    h = offload.enable(model, device="cpu", keep_host_copy=keep)
    # Between steps a streamed parameter holds an empty placeholder, and the
    # package keeps its old bytes only when asked: the store is the one host copy.
    assert all(p.param.numel() == 0 for p in h._params.values())
    assert all((p.saved is not None) == keep for p in h._params.values())
    with torch.no_grad():
        model(**inputs)
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))


@NO_CUDA
def test_pinned_host_weights_are_let_go_and_come_back_pinned():
    # As a user who moved the model to page-locked memory (and as the bench does):
    # with one host copy, torch's pinned cache gives the let-go tensors back to the
    # system, and disable restores each parameter page-locked, with the same bytes.
    model, inputs, _ = MODELS["flux"]()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.pin_memory()
    before = _snapshot(model)
    owned = lambda: torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    held = owned()
    h = offload.enable(model, device="cuda")
    streamed_bytes = sum(p.nbytes for p in h._params.values())
    assert streamed_bytes > 0 and held - owned() >= streamed_bytes, "the let-go page-locked tensors are still held by torch's cache"
    with torch.no_grad():
        model(**_to(inputs, "cuda"))
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))
    assert all(p.is_pinned() for p in model.parameters()), "a parameter came back pageable"


def test_a_failure_while_the_module_changes_puts_it_back_from_the_store(monkeypatch):
    model, _, _ = MODELS["t5"]()
    before = _snapshot(model)
    calls = {"n": 0}
    real = torch.nn.Module.register_forward_pre_hook

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", failing)
    with pytest.raises(RuntimeError, match="injected"):
        offload.enable(model, device="cpu")
    monkeypatch.undo()
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))
    assert not model.encoder.block[0]._forward_pre_hooks


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


@pytest.mark.parametrize("dev", DEVICES)
def test_a_module_built_on_the_meta_device_runs_from_its_checkpoint(dev, tmp_path):
    # Host RAM at 1 ×: the model object holds no weights (built on the
    # meta device), the blocks are served from the checkpoint's pages and the
    # other tensors read from it onto the device; the output is the model's with
    # those weights, bit for bit, and disable() puts it back on the meta device.
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from models import flux

    # Heads of 128, as Flux's: every block tensor a multiple of 256 bytes, so each
    # block lies in the file as the store lays it out and is served in place.
    model, inputs, _ = flux(128)
    model.to(dev)
    with torch.no_grad():
        ref = _out(model(**_to(inputs, dev))).clone()
    model.to("cpu")
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.device("meta"):
        empty = FluxTransformer2DModel.from_config(model.config).to(torch.bfloat16).eval()
    assert all(p.is_meta for p in empty.parameters())
    names = [n for n, _ in empty.named_parameters()]
    h = offload.enable(empty, device=dev, checkpoint=str(path))
    assert h.host_tier() == {"in_place": 5, "copied": 0, "copy_reason": None}, h.host_tier()
    with torch.no_grad():
        outs = [_out(empty(**_to(inputs, dev))).clone() for _ in range(2)]
    assert h.violations() == []
    offload.disable(empty)
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))
    assert [n for n, _ in empty.named_parameters()] == names and all(p.is_meta for p in empty.parameters())
    # Without a checkpoint, or with one that lacks a tensor outside the blocks or
    # holds it in another dtype: named errors, the module left on the meta device.
    with pytest.raises(OffloadError, match="meta device; give checkpoint="):
        offload.enable(empty, device=dev)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    del state["proj_out.weight"]
    save_file(state, str(tmp_path / "lacking.safetensors"))
    with pytest.raises(OffloadError, match="'proj_out.weight' is on the meta device and not in"):
        offload.enable(empty, device=dev, checkpoint=str(tmp_path / "lacking.safetensors"))
    state["proj_out.weight"] = model.state_dict()["proj_out.weight"].float()
    save_file(state, str(tmp_path / "f32.safetensors"))
    with pytest.raises(OffloadError, match=r"'proj_out.weight' is BF16 .* F32"):
        offload.enable(empty, device=dev, checkpoint=str(tmp_path / "f32.safetensors"))
    assert offload.offloaded(empty) is None and all(p.is_meta for p in empty.parameters())
    # Heads of 16: a block's norm weights are 32 bytes, the next tensor is not where
    # the store would lay it: the block is copied, and the reason names it.
    small, _, _ = flux(16)
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, str(tmp_path / "small.safetensors"))
    with torch.device("meta"):
        empty = FluxTransformer2DModel.from_config(small.config).to(torch.bfloat16).eval()
    h = offload.enable(empty, device=dev, checkpoint=str(tmp_path / "small.safetensors"))
    tier = h.host_tier()
    offload.disable(empty)
    assert tier["in_place"] == 0 and tier["copied"] == 5 and "not a multiple of 256" in tier["copy_reason"], tier


def test_a_component_called_through_another_method_than_forward_ends_its_steps():
    # A pipeline calls its VAE through decode(), which no forward hook sees: a
    # block asked for again begins the next step, so its steps end and have
    # metrics (before, none ever did), the output bitwise the resident one.
    from diffusers import AutoencoderKL

    from models import _randomize

    vae = _randomize(AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32, 32], layers_per_block=1,
                                   norm_num_groups=32, down_block_types=["DownEncoderBlock2D"] * 2,
                                   up_block_types=["UpDecoderBlock2D"] * 2), 3)
    z = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        ref = vae.decode(z).sample.clone()
    before = _snapshot(vae)
    h = offload.enable(vae, device="cpu")
    with torch.no_grad():
        outs = [vae.decode(z).sample.clone() for _ in range(3)]
    m = h.metrics()
    offload.disable(vae)
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))
    # The decoder's blocks (its up blocks and its mid block's resnets), once each a step, all prefetched.
    assert m["blocks"] == 4 and m["misses"] == 0 and h.steps == 2, (m, h.steps)
    _same_snapshot(before, _snapshot(vae))


def test_a_meta_module_with_tied_weights_runs_from_a_checkpoint_that_saved_them_once(tmp_path):
    # T5's embedding is shared by `shared` and `encoder.embed_tokens`; a checkpoint
    # saves it under one name (safetensors' save_model): the meta module takes it
    # for both, one tensor on the device, bitwise the resident output.
    from safetensors.torch import save_model
    from transformers import T5EncoderModel

    model, inputs, _ = MODELS["t5"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    path = tmp_path / "t5.safetensors"
    save_model(model, str(path))
    with torch.device("meta"):
        empty = T5EncoderModel(model.config).to(torch.bfloat16).eval()
    assert empty.shared.weight is empty.encoder.embed_tokens.weight
    h = offload.enable(empty, device="cpu", checkpoint=str(path))
    assert empty.shared.weight is empty.encoder.embed_tokens.weight and not empty.shared.weight.is_meta
    with torch.no_grad():
        out = _out(empty(**inputs)).clone()
    assert h.violations() == []
    offload.disable(empty)
    assert torch.equal(_bits(out), _bits(ref))
    assert empty.shared.weight is empty.encoder.embed_tokens.weight and empty.shared.weight.is_meta


def test_a_block_run_twice_inside_one_forward_is_one_step():
    # Inside the module's forward a block asked for again is the model's own
    # doing: one step a forward, whatever it repeats.
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for b in list(self.blocks) + [self.blocks[0]]:
                x = b(x)
            return x

    torch.manual_seed(0)
    m = Twice().to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m(x).clone()
    h = offload.enable(m, device="cpu")
    with torch.no_grad():
        outs = [m(x).clone() for _ in range(2)]
    assert h.steps == 2 and h.metrics()["blocks"] == 4, (h.steps, h.metrics())
    offload.disable(m)
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))


def test_stream_summary_tells_the_hosts_gaps_from_the_devices():
    # `zoo_anchor.py --kernels` reads a profiled step: a gap of 5 µs or more before
    # a kernel launched after the stream ran dry is the host's; one before a kernel
    # queued long before is the device's (a wait, the front end).
    za = _zoo_anchor()

    def kernel(ts, dur, corr, stream=7, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": corr}}

    def launch(ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        launch(0, 2, 1), launch(3, 2, 2), launch(120, 2, 3), launch(130, 1, 4),
        kernel(10, 50, 1),
        kernel(70, 40, 2),  # 10 µs after k1 ended at 60, launched at 5: the device's
        kernel(125, 10, 3),  # 15 µs after k2 ended at 110, its launch returned at 122: the host's
        kernel(137, 3, 4),  # 2 µs: not a long gap
        kernel(0, 500, 9, stream=29, cat="gpu_memcpy"),
        # Stream 8: a short kernel inside a long one (launched early) leaves no gap
        # after it; the next starts 6 µs after the long one ends.
        kernel(0, 100, 11, stream=8), kernel(10, 5, 12, stream=8), kernel(106, 4, 13, stream=8),
    ]}
    s = za.stream_summary(trace)
    k = s["7"]
    assert (k["kernels"], k["long_gaps"], k["long_gaps_with_launch"], k["long_gaps_host_late"]) == (4, 2, 2, 1)
    assert k["long_gaps_s"] == pytest.approx(25e-6) and k["long_gaps_host_late_s"] == pytest.approx(15e-6)
    assert k["gaps_s"] == pytest.approx(27e-6) and k["busy_s"] == pytest.approx(103e-6)
    assert (s["29"]["memcpys"], s["29"]["kernels"]) == (1, 0)
    assert (s["8"]["long_gaps"], s["8"]["gaps_s"]) == (1, pytest.approx(6e-6))
    # Two devices' streams of one number are two streams.
    two = za.stream_summary({"traceEvents": [dict(kernel(0, 5, 1), args={"stream": 7, "device": d}) for d in (0, 1)]})
    assert sorted(two) == ["0:7", "1:7"]


def test_the_benchs_fp8_storage_of_a_transformers_model_is_diffusers_defaults():
    # diffusers' casting never reads a transformers model's `_keep_in_fp32_modules`
    # (T5's `wo`): `--storage fp8` on t5-xxl keeps only diffusers' defaults out.
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    model, _, _ = MODELS["t5"]()
    assert getattr(model, "_keep_in_fp32_modules", None), "the tiny T5 has no fp32 modules to leave out"
    assert _zoo_anchor().fp8_skip_patterns(model, "fp8") == tuple(DEFAULT_SKIP_MODULES_PATTERN)


def test_a_checkpoint_whose_bytes_differ_from_the_modules_is_refused(tmp_path):
    # The store serves the file's bytes and disable gives them back: a module
    # holding other weights (fine-tuned, fused) would compute with the file's and
    # lose its own. Refused by name, the module as it was.
    from safetensors.torch import save_file

    model, _, _ = MODELS["flux"]()
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.no_grad():
        model.transformer_blocks[0].attn.to_q.weight.add_(1)
    before = _snapshot(model)
    with pytest.raises(OffloadError, match=r"transformer_blocks\.0\.attn\.to_q\.weight.*bytes differ from .*flux\.safetensors"):
        offload.enable(model, device="cpu", checkpoint=str(path))
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))


def test_streamed_weights_that_require_grad_make_the_backward_a_named_error():
    # Every parameter trainable (a loaded model's default): the forward is the
    # resident one, and a backward that would leave the streamed weights'
    # gradients None is an error naming one instead.
    model, inputs, _ = MODELS["t5"]()
    ref = _out(model(**inputs))
    assert ref.requires_grad
    with torch.no_grad():
        ref_no_grad = _out(model(**inputs))
    before = _snapshot(model)
    offload.enable(model, device="cpu")
    out = _out(model(**inputs))
    assert torch.equal(_bits(out), _bits(ref))
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*encoder\.block\.\d+\..*gets no gradient"):
        out.float().square().mean().backward()
    with torch.no_grad():
        assert torch.equal(_bits(_out(model(**inputs))), _bits(ref_no_grad))
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))


def test_state_dict_while_offloaded_is_a_named_error():
    model, _, _ = MODELS["t5"]()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*encoder\.block\.0 streams its weights"):
        model.state_dict()
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*encoder\.block\.1 streams its weights, so the state_dict of "):
        model.encoder.block[1].state_dict()
    with pytest.raises(OffloadError, match=r"encoder\.block\.0 streams its weights .* cannot load a state_dict"):
        model.load_state_dict(want)
    offload.disable(model)
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)


def test_converting_an_offloaded_module_is_a_named_error_and_disable_still_restores():
    model, inputs, _ = MODELS["t5"]()
    before = _snapshot(model)
    offload.enable(model, device="cpu")
    # Refused at the call, at the first streamed weight it reaches.
    with pytest.raises(OffloadError, match=r"encoder\.block\.0\..* cannot be converted.*disable .*then enable"):
        model.float()
    # The streamed weights come back as enabled; the tensors the conversion
    # reached (resident, on the simulated device) keep it, and convert back exactly.
    offload.disable(model)
    model.to(torch.bfloat16)
    _same_snapshot(before, _snapshot(model))


def test_enabling_a_module_inside_an_offloaded_one_is_refused():
    model, inputs, _ = MODELS["t5"]()
    before = _snapshot(model)
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"block\.0\..*already streams in component 'T5EncoderModel'"):
        offload.enable(model.encoder, device="cpu")
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))
    # Once disabled, the inner module may stream on its own.
    offload.enable(model.encoder, device="cpu")
    offload.disable(model.encoder)
    _same_snapshot(before, _snapshot(model))


def test_a_failed_pipeline_enable_leaves_what_the_caller_enabled():
    t5, _, _ = MODELS["t5"]()
    flux, _, _ = MODELS["flux"]()
    h = offload.enable(t5, device="cpu")
    with pytest.raises(OffloadError, match="already offloaded"):
        offload.enable_pipeline({"transformer": flux, "text_encoder": t5}, device="cpu")
    assert offload.offloaded(t5) is h, "the caller's component was disabled"
    assert offload.offloaded(flux) is None, "the pipeline's own component was left enabled"
    offload.disable(t5)


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


@pytest.mark.parametrize("kw", [{"depth": -1}, {"depth": 1.5}, {"depth": True}, {"budget_gib": float("nan")}, {"budget_gib": 0},
                                {"pin_budget_gib": -1}, {"budget_gib": "8"}])
def test_bad_numbers_are_named_errors(kw):
    model, _, _ = MODELS["t5"]()
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*(depth|budget_gib|pin_budget_gib) must be"):
        offload.enable(model, device="cpu", **kw)
    assert offload.offloaded(model) is None


def test_a_stale_handle_does_not_disable_a_later_enable():
    model, _, _ = MODELS["t5"]()
    h1 = offload.enable(model, device="cpu")
    offload.disable(model)
    h2 = offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match="disabled already"):
        h1.disable()
    assert offload.offloaded(model) is h2
    h2.disable()
    with pytest.raises(OffloadError, match="disabled already"):
        h2.disable()


def test_a_pipeline_budget_counts_the_buffers_blocks_keep_resident():
    # Buffers in blocks stay resident (as a per-layer rotary table does): the
    # pipeline's share for a component counts them, so a budget that holds every
    # component's resident tensors and slots is enough.
    t5, t5_in, _ = MODELS["t5"]()
    flux, flux_in, _ = MODELS["flux"]()
    for blk in t5.encoder.block:
        blk.register_buffer("table", torch.randn(64 << 10))  # 256 KiB a block, resident
    with torch.no_grad():
        refs = (_out(t5(**t5_in)).clone(), _out(flux(**flux_in)).clone())

    def need(m, blocks):
        slot = max(sum(-(-p.numel() * p.element_size() // 256) * 256 for p in b.parameters()) for b in blocks)
        params = sum(p.numel() * p.element_size() for p in m.parameters())
        buffers = sum(b.numel() * b.element_size() for b in m.buffers())
        in_blocks = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
        return params + buffers - in_blocks + 2 * slot

    total = need(t5, list(t5.encoder.block)) + need(flux, list(flux.transformer_blocks) + list(flux.single_transformer_blocks))
    handles = offload.enable_pipeline({"text_encoder": t5, "transformer": flux}, device="cpu", budget_gib=(total + 4096) / (1 << 30))
    with torch.no_grad():
        outs = (_out(t5(**t5_in)), _out(flux(**flux_in)))
    for o, r in zip(outs, refs):
        assert torch.equal(_bits(o), _bits(r))
    offload.disable_pipeline(handles)


TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2
REQUIRE_TWO = os.environ.get("OFFLOAD_REQUIRE_TWO_GPUS") == "1"


# A row of its own, as the relay's: bench/py-run.sh deselects it on one GPU and
# runs it with PY_TWO_GPUS=1 (OFFLOAD_REQUIRE_TWO_GPUS=1) on two.
@pytest.mark.skipif(not TWO_GPUS and not REQUIRE_TWO, reason="SKIPPED: needs two CUDA devices")
def test_a_module_on_the_second_gpu_leaves_torchs_current_device_alone():
    # The engine binds its device's context to the calling thread; every call
    # puts the caller's back, so torch's current device stays what it was.
    assert TWO_GPUS, "OFFLOAD_REQUIRE_TWO_GPUS=1 but torch sees fewer than two CUDA devices"
    model, inputs, _ = MODELS["t5"]()
    with torch.cuda.device(0):
        h = offload.enable(model, device="cuda:1")
        assert torch.cuda.current_device() == 0
        with torch.no_grad():
            model(**_to(inputs, "cuda:1"))
        h.metrics()
        assert torch.cuda.current_device() == 0, "a step left device 1 current"
        offload.disable(model)
        assert torch.cuda.current_device() == 0


def test_block_parameters_sharing_one_storage_are_a_named_error():
    # Views of one tensor stream as separate bytes and would come back separate.
    model, _, _ = MODELS["t5"]()
    attn = model.encoder.block[1].layer[0].SelfAttention
    fused = torch.cat([attn.q.weight.detach(), attn.k.weight.detach()])
    n = attn.q.weight.shape[0]
    attn.q.weight = torch.nn.Parameter(fused[:n])
    attn.k.weight = torch.nn.Parameter(fused[n:])
    before = _snapshot(model)
    with pytest.raises(OffloadError, match=r"encoder\.block\.1\.layer\.0\.SelfAttention\.k\.weight' shares its storage with 'encoder\.block\.1\.layer\.0\.SelfAttention\.q\.weight"):
        offload.enable(model, device="cpu")
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))



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


_CHANGES = {
    "replaced": lambda m: setattr(m.blocks[1], "weight", torch.nn.Parameter(torch.zeros(8, 8))),
    "data_set": lambda m: setattr(m.blocks[1].weight, "data", torch.zeros(8, 8)),
    "edited_in_place": lambda m: m.blocks[1].bias.zero_(),
    "initialised": lambda m: torch.nn.init.zeros_(m.blocks[2].weight),
    "removed": lambda m: setattr(m.blocks[1], "bias", None),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_streamed_parameter_changed_while_offloaded_is_a_named_error(change):
    # Its placeholder replaced, given other data, edited in place or removed:
    # the change would not stream (the block's bytes are the enabled ones), so
    # it is refused at the call (an edit, other data) or the next forward names
    # the tensor (replaced, removed); disable still puts the module back.
    m, x = _Lin(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x).clone()
    offload.enable(m, device="cpu")
    named = r"tensor 'blocks\.[12]\.(weight|bias)' (was (replaced|changed)|streams while offloaded and cannot be)"
    with pytest.raises(OffloadError, match=named), torch.no_grad():
        _CHANGES[change](m)
        m(x)
    offload.disable(m)
    with torch.no_grad():
        assert torch.equal(m(x), ref)


def test_converting_part_of_a_block_while_offloaded_is_a_named_error():
    # One layer of each block converted (not the block's first tensor): refused as
    # converting the whole module is, the output never the unconverted one.
    model, inputs, _ = MODELS["t5"]()
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"DenseReluDense\.wo\.weight' streams while offloaded and cannot be converted"):
        model.encoder.block[0].layer[1].DenseReluDense.wo.float()
    with torch.no_grad():
        model(**inputs)
    offload.disable(model)


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


def test_a_block_writing_its_streamed_weights_in_place_is_a_named_error():
    # The write lands in the lent buffer, which the next step no longer holds:
    # the block is named after its forward, and the module still disables.
    m = torch.nn.Module()
    torch.manual_seed(0)
    m.blocks = torch.nn.ModuleList(_Running() for _ in range(2))
    m.forward = lambda x: m.blocks[1](m.blocks[0](x))
    offload.enable(m, device="cpu")
    with pytest.raises(OffloadError, match=r"block blocks\.0 wrote its streamed weights in place"), torch.no_grad():
        m(torch.randn(3, 4))
    offload.disable(m)
    assert torch.equal(m.blocks[0].running, torch.zeros(4))


def test_state_dict_of_a_layer_inside_a_block_is_a_named_error():
    model, _, _ = MODELS["t5"]()
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match="streams its weights"):
        model.encoder.block[0].layer[0].state_dict()
    offload.disable(model)
    assert all(t.numel() for t in model.encoder.block[0].layer[0].state_dict().values())


def test_disable_pipeline_takes_what_enable_pipeline_returned():
    t5, _, _ = MODELS["t5"]()
    flux, _, _ = MODELS["flux"]()
    handles = offload.enable_pipeline({"text_encoder": t5, "transformer": flux}, device="cpu")
    offload.disable_pipeline(handles)
    assert offload.offloaded(t5) is None and offload.offloaded(flux) is None


def test_a_block_tensor_sharing_storage_with_a_resident_one_is_a_named_error():
    # A fused tensor split between a block and the head: streamed, the two would
    # come back from disable as separate tensors.
    m = _Lin()
    fused = torch.randn(16, 8)
    m.blocks[0].weight = torch.nn.Parameter(fused[:8])
    m.head = torch.nn.Linear(8, 8)
    m.head.weight = torch.nn.Parameter(fused[8:])
    with pytest.raises(OffloadError, match=r"'blocks\.0\.weight' shares its storage with 'head\.weight'"):
        offload.enable(m, device="cpu")
    assert offload.offloaded(m) is None
    assert m.blocks[0].weight.untyped_storage().data_ptr() == m.head.weight.untyped_storage().data_ptr()


def test_an_interrupted_forward_ends_its_step_when_the_next_begins():
    # KeyboardInterrupt skips torch's always_call hooks: the next forward still
    # starts a step of its own, computing as resident.
    m, x = _Lin(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x).clone()
    h = offload.enable(m, device="cpu")

    def interrupt(mod, args):
        raise KeyboardInterrupt

    hook = m.blocks[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        m(x)
    hook.remove()
    with torch.no_grad():
        out = m(x)
    assert torch.equal(out, ref)
    assert h.metrics()["blocks"] == 3, h.metrics()
    offload.disable(m)


def test_an_interrupted_block_that_wrote_its_weights_is_named_and_closes_only_its_step():
    # Ctrl-C inside a block that had written its streamed weights in place: the
    # next forward names the write, and its failed start closes no second,
    # empty step (the last step's metrics stay the interrupted one's).
    class Interrupted(_Running):
        stop = False

        def forward(self, x):
            out = super().forward(x)
            if self.stop:
                raise KeyboardInterrupt
            return out

    m = torch.nn.Module()
    torch.manual_seed(0)
    m.blocks = torch.nn.ModuleList([Interrupted(), Interrupted()])
    m.blocks[0].stop = True
    m.forward = lambda x: m.blocks[1](m.blocks[0](x))
    h = offload.enable(m, device="cpu")
    x = torch.randn(3, 4)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        m(x)
    with pytest.raises(OffloadError, match=r"block blocks\.0 wrote its streamed weights in place"), torch.no_grad():
        m(x)
    assert (h.steps, h.metrics()["blocks"]) == (1, 1), (h.steps, h.metrics())
    offload.disable(m)


def test_a_users_pre_hook_that_raises_closes_no_empty_step():
    # A pre-hook registered before enable runs before ours; when it raises, the
    # forward never began a step, and torch's always_call step hook ends none.
    m, x = _Lin(), torch.randn(2, 8)
    fail = [False]

    def guard(mod, args):
        if fail[0]:
            raise ValueError("refused by the user's hook")

    m.register_forward_pre_hook(guard)
    h = offload.enable(m, device="cpu")
    with torch.no_grad():
        m(x)
    before = (h.steps, h.metrics())
    fail[0] = True
    with pytest.raises(ValueError, match="refused"), torch.no_grad():
        m(x)
    assert (h.steps, h.metrics()) == before, "a forward that never began closed a step"
    fail[0] = False
    with torch.no_grad():
        m(x)
    assert h.steps == before[0] + 1
    offload.disable(m)


def test_a_users_pre_hook_registered_before_enable_sees_the_weights():
    m, x = _Lin(), torch.randn(2, 8)
    seen = []
    m.blocks[1].register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.sum().item()))
    with torch.no_grad():
        m(x)
    offload.enable(m, device="cpu")
    with torch.no_grad():
        m(x)
    offload.disable(m)
    assert seen[0] == seen[1], seen


def test_a_users_forward_hook_registered_after_enable_sees_the_weights():
    # The package's post-hook gives the block back: it runs last, after a hook
    # the user adds while the module is offloaded.
    m, x = _Lin(), torch.randn(2, 8)
    seen = []

    def look(mod, args, out):
        seen.append(mod.weight.sum().item())

    with torch.no_grad():
        m(x)
    resident = m.blocks[1].weight.sum().item()
    offload.enable(m, device="cpu")
    hook = m.blocks[1].register_forward_hook(look)
    with torch.no_grad():
        m(x)
    hook.remove()
    offload.disable(m)
    assert seen == [resident], (seen, resident)


def test_a_resident_block_is_planned_under_its_own_name():
    m = _Lin()
    h = offload.enable(m, device="cpu", resident_blocks=["blocks.01"])
    assert h.plan()["resident_blocks"] == ["blocks.1"], h.plan()
    offload.disable(m)


def test_disable_pipeline_leaves_a_later_enable_of_the_same_module_alone():
    m = _Lin()
    handles = offload.enable_pipeline({"transformer": m}, device="cpu")
    offload.disable_pipeline({"transformer": m})
    again = offload.enable(m, device="cpu")
    offload.disable_pipeline(handles)  # an ended handle: nothing to do
    assert offload.offloaded(m) is again
    offload.disable(m)


def test_a_layer_holding_only_a_resident_adapter_still_gives_its_state_dict():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8).requires_grad_(False)
            self.lora = torch.nn.Linear(8, 8)  # trainable: resident

        def forward(self, x):
            return self.a(x) + self.lora(x)

    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList(Block() for _ in range(2))
    m.forward = lambda x: m.blocks[1](m.blocks[0](x))
    offload.enable(m, device="cpu")
    assert list(m.blocks[0].lora.state_dict()) == ["weight", "bias"]
    with pytest.raises(OffloadError, match="streams its weights"):
        m.blocks[0].a.state_dict()
    with pytest.raises(OffloadError, match="streams its weights"):
        m.blocks[0].state_dict()
    offload.disable(m)
