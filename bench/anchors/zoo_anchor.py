"""Anchor for the bench room: diffusers' group offloading on the real diffusers
class of a registry model (random bf16 weights, fixed seed), timed with CUDA
events in the same command as offload's runs. One process measures the resident
step of every case and then each offloaded mode asked for, in the order given
(between two modes diffusers' hooks are removed; the weights stay in the same
pinned host tensors, so the second mode starts without a second copy):

  block_stream: block level, one block per group, use_stream, record_stream, pinned
  leaf_stream:  leaf level, use_stream, record_stream, pinned
  offload:      this project's Python package (`offload.enable`, --depth) on the same
                model object, its output compared bitwise with the resident one; the
                package is removed (`offload.disable`) before the next mode

python3 zoo_anchor.py --registry REG.json --model flux-dev --mode block_stream,leaf_stream --cases 1024,2048 --steps 5 --out F.json
python3 zoo_anchor.py --registry REG.json --model flux-dev --mode block_stream --size 1344x768 --batch 2 --out F.json
  (a user's case: REG.json from `zoo registry --json REG.json --size 1344x768 --batch 2`)

Text encoders (transformers' T5EncoderModel, Qwen2_5_VLTextModel with SDPA
attention) take seeded token ids and diffusers' `apply_group_offloading`.

Writes what `zoo merge --anchors` reads (AnchorDoc): per case and mode every timed
step, weights on the device and the resident step's activations, the output
checked finite and not constant. Memory is measured as in offload's runs: the
activations of a resident step are its peak allocated bytes above what was
allocated before it; weights on the device while diffusers offloads are the
offloaded step's peak minus what was allocated before it other than weights,
minus those activations; the package's are the module's resident tensors and
the engine's slots and resident blocks (`peak_device_weight_bytes`), allocated
when it is enabled, before any step.
"""
import argparse
import importlib
import json
import math
import os
import time
import traceback

import torch


def fp8_skip_patterns(model, storage):
    """The modules `--storage` keeps out of layerwise casting: `fp8`, those
    `ModelMixin.enable_layerwise_casting` keeps out (diffusers' defaults
    `pos_embed`, `patch_embed`, `norm`, the top-level `proj_in`/`proj_out`, then
    the class's `_keep_in_fp32_modules` and `_skip_layerwise_casting_patterns`:
    Wan's `condition_embedder` casts its input to its weight's dtype and cannot
    run fp8; Flux names its adaLN modulation Linears norm*, so they stay bf16);
    `fp8-linears`, the class's own patterns but `norm`, so those Linears are fp8
    too (norms proper are not cast by layerwise casting)."""
    if storage == "fp8-linears":
        return tuple(p for p in (getattr(model, "_skip_layerwise_casting_patterns", None) or ()) if p != "norm")
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN
    pats = tuple(DEFAULT_SKIP_MODULES_PATTERN)
    # `enable_layerwise_casting` is diffusers' (a transformers model has its own
    # `_keep_in_fp32_modules`, T5's `wo`, which diffusers' casting never reads).
    attrs = ("_keep_in_fp32_modules", "_skip_layerwise_casting_patterns") if hasattr(model, "enable_layerwise_casting") else ()
    for attr in attrs:
        pats += tuple(getattr(model, attr, None) or ())
    return tuple(dict.fromkeys(pats))


def q8_0_bytes(w):
    """GGUF Q8_0 blocks of the 2-D weight `w` (fan-in a multiple of 32), as the
    `gguf` package's `Q8_0.quantize_blocks` makes them (its rounding, half away
    from zero), computed with torch where `w` lives: per 32 values an f16 scale
    amax / 127 and 32 int8. uint8 of shape (out, in / 32 * 34)."""
    b = w.detach().float().reshape(-1, 32)
    # Both divisions in float64, rounded once to float32: the IEEE float32
    # quotients numpy computes (torch on CUDA divides by a Python scalar as a
    # multiplication by its reciprocal, a different rounding).
    d = (b.abs().amax(dim=1, keepdim=True).double() / 127).float()
    inv = torch.where(d == 0, torch.zeros_like(d), (1 / d.double()).float())
    x = b * inv
    a = x.abs()
    fl = torch.floor(a)
    q = torch.sign(x) * (fl + torch.floor(2 * (a - fl)))
    out = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
    return out.reshape(w.shape[0], -1)


def gguf_quantize_blocks(model, quant):
    """`model` with the Linears of its block lists (fan-in whole GGUF blocks)
    swapped for diffusers' `GGUFLinear` holding `GGUFParameter` bytes, as
    `from_single_file(..., quantization_config=GGUFQuantizationConfig(...))`
    builds from a GGUF release (which quantizes the blocks; embedders and final
    layers stay 16-bit): Q8_0 quantized from the weights (`q8_0_bytes`); Q4_K
    blocks of random bytes under small finite super-scales (the `gguf` package
    has no K-quant quantizer; dequantised and multiplied all the same). Returns
    the count of weights quantized."""
    from diffusers.quantizers.gguf.utils import GGUFParameter, _replace_with_gguf_linear
    import gguf

    qt = getattr(gguf.GGMLQuantizationType, quant.upper())
    block, size = gguf.GGML_QUANT_SIZES[qt]
    lists = [n for n, c in model.named_children() if isinstance(c, (torch.nn.ModuleList, torch.nn.Sequential))]
    g = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(7)
    state = {}
    for name, m in model.named_modules():
        if not (isinstance(m, torch.nn.Linear) and m.in_features % block == 0 and name.split(".")[0] in lists):
            continue
        if qt == gguf.GGMLQuantizationType.Q8_0:
            q = q8_0_bytes(m.weight)
        else:
            q = torch.randint(0, 256, (m.out_features, m.in_features // block, size), generator=g, device=g.device,
                              dtype=torch.uint8).to(m.weight.device)
            q[..., 0:2] = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8).to(q.device)
            q[..., 2:4] = torch.tensor([0.001], dtype=torch.float16).view(torch.uint8).to(q.device)
            q = q.reshape(m.out_features, -1)
        state[f"{name}.weight"] = GGUFParameter(q, quant_type=qt)
    biases = {f"{n}.weight": m.bias for n, m in model.named_modules() if f"{n}.weight" in state}
    # The new layers on the meta device: their own weights (float32, initialised)
    # would cost seconds and 4 bytes a weight on the host before being replaced.
    with torch.device("meta"):
        _replace_with_gguf_linear(model, torch.bfloat16, state)
    for name, m in model.named_modules():
        if f"{name}.weight" in state:
            m.weight = state[f"{name}.weight"]
            if biases[f"{name}.weight"] is not None:
                m.bias = biases[f"{name}.weight"]
    return len(state)


def failed(out, a, cases, mode, e):
    """diffusers' `mode` raised on this model (`e`): a row per case naming the
    failure, so the merge names it in the table instead of timing nothing."""
    why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    print(f"diffusers {mode} {a.model}: failed: {why}", flush=True)
    for c in cases:
        out.append(dict(model=a.model, case=c["name"], mode=mode, error=why))


def build(ref, device="cuda"):
    mod = importlib.import_module(ref["module"])
    cls = getattr(mod, ref["class"])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        if "config_class" in ref:
            # transformers' text encoders, with PyTorch's SDPA as attention.
            cfg = getattr(mod, ref["config_class"])(**ref["config"])
            cfg._attn_implementation = "sdpa"
            m = cls(cfg)
        else:
            m = cls(**ref["config"])
    torch.set_default_dtype(torch.float32)
    # Materialised once on the GPU and filled there (filling 12-20 B parameters on
    # the runner's CPU takes minutes); the same scheme as offload's runs: linear
    # weights at +-1/sqrt(fan-in), biases +-0.01, norm scales in [0.5, 1.5].
    m = m.to_empty(device=device)
    # Buffers come out of to_empty uninitialised (NaN is possible): zeros first,
    # then the tables this script knows are remade with their real values.
    with torch.no_grad():
        for buf in m.buffers():
            buf.zero_()
    # Tables a module computes at construction outside its buffers (Qwen-Image's
    # QwenEmbedRope.pos_freqs) stay on the meta device: build that module again.
    pe = getattr(m, "pos_embed", None)
    if pe is not None and any(getattr(getattr(pe, a, None), "is_meta", False) for a in ("pos_freqs", "neg_freqs")):
        m.pos_embed = type(pe)(theta=pe.theta, axes_dim=list(pe.axes_dim), scale_rope=pe.scale_rope).to(device)
    rope = getattr(m, "rope", None)
    if rope is not None and type(rope).__name__ == "WanRotaryPosEmbed":
        m.rope = type(rope)(rope.attention_head_dim, rope.patch_size, rope.max_seq_len).to(device)
    # transformers' rotary tables are buffers made at construction: made again.
    for name, sub in list(m.named_modules()):
        if hasattr(sub, "inv_freq") and hasattr(sub, "rope_init_fn"):
            inv, _ = sub.rope_init_fn(sub.config, torch.device(device))
            sub.inv_freq = inv
            sub.original_inv_freq = inv
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if n.endswith(".weight") else p.uniform_(-0.01, 0.01)
            else:
                a = 1.0 / math.sqrt(p.shape[1])
                p.uniform_(-a, a)
    return m.eval()


def inputs(model_name, case, dev, vocab=None):
    """Seeded inputs of a registry case: `batch` samples of `height` x `resolution`
    (the width) pixels, `frames` latent frames for video; text tokens as the case says."""
    torch.manual_seed(case["resolution"])
    b, t = case["batch"], case["text_tokens"]
    if case["image_tokens"] == 0:
        # A text encoder: seeded token ids.
        return dict(input_ids=torch.randint(vocab, (b, t), device=dev))
    r = lambda *s: torch.randn(*s, device=dev).to(torch.bfloat16)
    # Registry files before --size have no height: their cases are square.
    w, h = case["resolution"], case.get("height") or case["resolution"]
    n, ts = case["image_tokens"], torch.full((b,), 500.0, device=dev, dtype=torch.bfloat16)
    if model_name.startswith("z-image"):
        # Lists per sample: latents [16, 1, H/8, W/8] and caption features [L, 2560].
        return dict(x=[r(16, 1, h // 8, w // 8) for _ in range(b)], t=torch.full((b,), 0.5, device=dev),
                    cap_feats=[r(t, 2560) for _ in range(b)], return_dict=False)
    if model_name.startswith("wan"):
        # Video latents: 16 channels, the case's latent frames, H/8 x W/8.
        return dict(hidden_states=r(b, 16, case["frames"], h // 8, w // 8), encoder_hidden_states=r(b, t, 4096), timestep=ts,
                    return_dict=False)
    if model_name.startswith("sd3"):
        # Latents as an image (16 channels at 1/8 the size), classifier-free guidance batched.
        return dict(hidden_states=r(b, 16, h // 8, w // 8), encoder_hidden_states=r(b, t, 4096), pooled_projections=r(b, 2048),
                    timestep=ts, return_dict=False)
    half = torch.full((b,), 0.5, device=dev, dtype=torch.bfloat16)
    if model_name.startswith("flux"):
        ids = torch.zeros(n, 3, device=dev)
        ids[:, 1] = torch.arange(n, device=dev) // (w // 16)
        ids[:, 2] = torch.arange(n, device=dev) % (w // 16)
        return dict(hidden_states=r(b, n, 64), encoder_hidden_states=r(b, t, 4096), pooled_projections=r(b, 768), timestep=half,
                    img_ids=ids, txt_ids=torch.zeros(t, 3, device=dev), guidance=torch.full((b,), 3.5, device=dev, dtype=torch.bfloat16),
                    return_dict=False)
    return dict(hidden_states=r(b, n, 64), encoder_hidden_states=r(b, t, 3584), encoder_hidden_states_mask=None, timestep=half,
                img_shapes=[(1, h // 16, w // 16)] * b, return_dict=False)


def user_cases(cases, size, batch, frames):
    """The cases `--size WxH --batch N --frames F` name, as `zoo registry --json F
    --size ...` wrote them (named `WxH bN fF`); every case when none is given."""
    if size is None and batch is None and frames is None:
        return cases
    w, h = (int(v) for v in size.split("x")) if size else (None, None)
    keep = []
    for c in cases:
        parts = c["name"].split(" ")
        if len(parts) != 3 or not parts[1].startswith("b") or not parts[2].startswith("f"):
            continue
        if w is not None and (c["resolution"], c["height"]) != (w, h):
            continue
        if batch is not None and c["batch"] != batch:
            continue
        if frames is not None and parts[2] != f"f{frames}":
            continue
        keep.append(c)
    if not keep:
        raise SystemExit(f"no case of size {size}, batch {batch}, frames {frames} in the registry file: write it with "
                         "`zoo registry --json F` and the same --size/--batch/--frames")
    return keep


def weights_on_device(model, device_type: str = "cuda"):
    """Bytes of the module's parameters on the device: real parameters only.
    An offloaded module's streamed weights are placeholders that report the
    device they stream to (no bytes there), and its kept or lent blocks are
    plain views of the engine's buffers, which its metrics count
    (`peak_device_weight_bytes`): neither is counted here."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if p.device.type == device_type and isinstance(p, torch.nn.Parameter) and type(p).__name__ != "_Placeholder")


def dynamo_frames() -> int:
    """How many frames dynamo has compiled in this process (its counters)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def time_case(model, x, warmup, steps):
    with torch.no_grad():
        for _ in range(warmup):
            out = model(**x)[0]
        torch.cuda.synchronize()
        before, weights = torch.cuda.memory_allocated(), weights_on_device(model)
        torch.cuda.reset_peak_memory_stats()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        evs[0].record()
        # The host's own time a step (the call returning, nothing waited for): near
        # the device's step where the step is host-bound, well under it otherwise.
        host = []
        frames = dynamo_frames()
        for i in range(steps):
            t = time.perf_counter()
            out = model(**x)[0]
            host.append(time.perf_counter() - t)
            evs[i + 1].record()
        torch.cuda.synchronize()
    time_case.host = host
    # Frames dynamo compiled during the timed steps (a recompilation each): none
    # once warmed up, where nothing a step changes is guarded on.
    time_case.frames_compiled = dynamo_frames() - frames
    times = [evs[i].elapsed_time(evs[i + 1]) / 1e3 for i in range(steps)]
    if isinstance(out, (list, tuple)):  # Z-Image returns one tensor per sample
        out = torch.cat([o.flatten() for o in out])
    f = out.float()
    time_case.last = out
    return times, torch.cuda.max_memory_allocated(), before, weights, bool(torch.isfinite(f).all()), bool((f != f.flatten()[0]).any())


def stream_summary(trace: dict, gap_us: float = 5.0) -> dict:
    """Per CUDA stream of a Chrome trace from torch's profiler: its kernels, copies, busy time and the
    gaps between them, the 15 names with the most time; and for the gaps of at least `gap_us` µs,
    how many (and how long) were the host's: the next kernel's launch call (matched by its
    `correlation`) returned only after the previous work on the stream had ended, so the device had
    nothing queued. The others are the device's own (a wait on an event, the front end)."""
    launches = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"]) + float(e.get("dur", 0.0))
    streams = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args", {})
        key = str(args.get("stream", e.get("tid")))
        if "device" in args:
            key = f"{args['device']}:{key}"
        s = streams.setdefault(key, [])
        s.append((float(e["ts"]), float(e["dur"]), e["cat"], e["name"], launches.get(args.get("correlation"))))
    summary = {}
    for sid, evs in streams.items():
        evs.sort(key=lambda ev: ev[0])
        busy = sum(ev[1] for ev in evs)
        gaps, host_late, host_late_s, matched = 0.0, 0, 0.0, 0
        big = []
        # From the latest end so far: work on one stream may overlap (a kernel
        # launched early by programmatic dependent launch), and a short event
        # inside a long one leaves no gap.
        end = evs[0][0] + evs[0][1]
        for nxt in evs[1:]:
            gap = max(0.0, nxt[0] - end)
            gaps += gap
            if gap >= gap_us:
                big.append(gap)
                if nxt[4] is not None:
                    matched += 1
                    if nxt[4] >= end:
                        host_late += 1
                        host_late_s += gap
            end = max(end, nxt[0] + nxt[1])
        by_name = {}
        for ev in evs:
            by_name[ev[3]] = by_name.get(ev[3], 0.0) + ev[1]
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
        summary[sid] = dict(events=len(evs), kernels=sum(ev[2] == "kernel" for ev in evs),
                            memcpys=sum(ev[2] == "gpu_memcpy" for ev in evs), busy_s=busy / 1e6,
                            span_s=(evs[-1][0] + evs[-1][1] - evs[0][0]) / 1e6, gaps_s=gaps / 1e6,
                            gaps_at_least_us=gap_us, long_gaps=len(big), long_gaps_s=sum(big) / 1e6,
                            long_gaps_with_launch=matched, long_gaps_host_late=host_late,
                            long_gaps_host_late_s=host_late_s / 1e6, top_us={k: v for k, v in top})
    return summary


def kernel_profile(model, x, path):
    """One more step under torch's profiler (CUPTI): per CUDA stream its
    [`stream_summary`], written to `path` (JSON) beside the step's Chrome trace (`path` .trace.json.gz).
    Two modes' files side by side say whether a streamed step's extra time is in its kernels (slower
    kernels: the copies' traffic) or between them, and whether a gap was the host's (the next
    kernel launched after the stream ran dry) or the device's (a stream waiting)."""
    import gzip
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    # CUPTI detached when the profiler stops: left attached (torch's default) it
    # would slow every step timed after this one.
    os.environ["TEARDOWN_CUPTI"] = "1"
    with torch.no_grad():
        model(**x)
        torch.cuda.synchronize()
        # CUDA activity only: it carries the launch calls' records too, and
        # recording every aten op would slow the host whose gaps are counted.
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(**x)
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        raw = open(f.name).read()
    trace = json.loads(raw)
    with gzip.open(path.removesuffix(".json") + ".trace.json.gz", "wt") as f:
        f.write(raw)
    summary = stream_summary(trace)
    json.dump(summary, open(path, "w"), indent=1)
    line = ", ".join(f"stream {k}: {v['kernels']} kernels busy {v['busy_s']:.4f} s, gaps {v['gaps_s']:.4f} s "
                     f"({v['long_gaps']} of 5 µs or more, {v['long_gaps_host_late']} the host's), {v['memcpys']} copies"
                     for k, v in summary.items())
    print(f"  kernels of one more step: {line} ({path})", flush=True)


# Seconds from this module's import (a script's start) to the end of each
# phase a script marks (set-up, each mode): where a process's time goes, to
# plan the GPU runner's commands. Scripts write ``PHASES`` into their file.
T0 = time.perf_counter()
PHASES: dict = {}


def mark(name: str) -> None:
    """The seconds since this module's import, as phase ``name``'s end."""
    PHASES[name] = round(time.perf_counter() - T0, 2)


def h2d_bandwidth(gib=2, passes=5):
    """Pinned host-to-device bandwidth in this process (bytes/s), the median of `passes` copies of `gib` GiB."""
    src = torch.empty(gib << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(passes):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        torch.cuda.synchronize()
        rates.append((gib << 30) / (a.elapsed_time(b) / 1e3))
    del src, dst
    torch.cuda.empty_cache()
    return sorted(rates)[len(rates) // 2]


def block_modules(model):
    """Top-level children that are not block lists but hold one: diffusers'
    block-level offloading streams only top-level ModuleLists unless such children
    are named in `block_modules` (it then recurses into them)."""
    lists = (torch.nn.ModuleList, torch.nn.Sequential)
    return [n for n, c in model.named_children() if not isinstance(c, lists) and any(isinstance(g, lists) for g in c.children())]


def compile_blocks(model, how, fullgraph, whole=False):
    """`--compile`: the model's repeated blocks compiled (diffusers'
    `compile_repeated_blocks`, else `block.compile()` on every block of its block
    lists), or with `whole` the whole module (`model.compile()`), dynamo's caches
    reset first so that each mode compiles afresh and no mode runs on another's
    graphs (or past dynamo's recompile limit, in eager). Returns how many
    modules were compiled; none is an error (a row named compiled would run
    eager: T5's blocks are `encoder.block`, not a child of the model)."""
    torch._dynamo.reset()
    kw = dict(fullgraph=fullgraph) if how == "default" else dict(fullgraph=fullgraph, mode=how)
    if whole:
        model.compile(**kw)
        return 1
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**kw)
    else:
        import offload as ours

        # The blocks as the package finds them (its block lists at any depth).
        for path in ours.find_blocks(model):
            for b in model.get_submodule(path):
                b.compile(**kw)
    n = sum(1 for m in model.modules() if "_compiled_call_impl" in m.__dict__)
    if n == 0:
        raise SystemExit(f"{type(model).__name__}: --compile compiled no module (no repeated blocks, no block list)")
    return n


def offload(model, mode, name):
    """diffusers' group offloading in `mode` on `model` (its weights on the host)."""
    t0 = time.perf_counter()
    kind = "block_level" if mode == "block_stream" else "leaf_level"
    kw = dict(num_blocks_per_group=1) if kind == "block_level" else {}
    nested = block_modules(model) if kind == "block_level" else []
    if nested:
        # Block lists one level down (T5EncoderModel's encoder.block): without
        # block_modules diffusers loads that whole child at once, synchronously.
        kw["block_modules"] = nested
        print(f"diffusers block_stream {name}: block_modules {nested}", flush=True)
    if hasattr(model, "enable_group_offload"):
        model.enable_group_offload(torch.device("cuda"), torch.device("cpu"), offload_type=kind, use_stream=True, record_stream=True, **kw)
    else:
        # transformers' encoders: the same hooks through diffusers' function.
        from diffusers.hooks import apply_group_offloading
        apply_group_offloading(model, onload_device=torch.device("cuda"), offload_device=torch.device("cpu"), offload_type=kind,
                               use_stream=True, record_stream=True, **kw)
    print(f"setup: {mode} applied in {time.perf_counter() - t0:.1f} s", flush=True)


def remove_group_offloading(model):
    """The three hooks group offloading installs, removed the way diffusers'
    `_maybe_remove_and_reapply_group_offloading` removes them."""
    from diffusers.hooks import group_offloading as go
    from diffusers.hooks.hooks import HookRegistry
    registry = HookRegistry.check_if_exists_or_initialize(model)
    for hook in (go._GROUP_OFFLOADING, go._LAYER_EXECUTION_TRACKER, go._LAZY_PREFETCH_GROUP_OFFLOADING):
        registry.remove_hook(hook, recurse=True)


def error_entry(e: BaseException) -> dict:
    """A mode's failure as its results entry: the error's first line and the
    traceback's end (a mode that fails is named, never a silent gap)."""
    return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400], "traceback": traceback.format_exc()[-1500:]}


def group_offloaded(model, name, run) -> dict:
    """`run()` under diffusers' block-level group offloading (streams on) on
    `model`, its weights on the host: the entry `run` returns, or its error
    named; the hooks removed and the model back on the host after."""
    try:
        offload(model, "block_stream", name)
        entry = run()
    except Exception as e:
        entry = error_entry(e)
    try:
        remove_group_offloading(model)
    except Exception:
        pass
    try:
        model.to("cpu")
        torch.cuda.empty_cache()
    except Exception as e:  # a context the mode broke: the entry still names the mode's own error
        entry.setdefault("cleanup_error", error_entry(e)["error"])
    return entry


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", required=True, help="block_stream, leaf_stream, or both in the order given (comma-separated)")
    ap.add_argument("--cases", default="")
    ap.add_argument("--size", default=None, help="WIDTHxHEIGHT: the user's case, as zoo run --size takes it")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--depth", type=int, default=1, help="the package's prefetch depth (mode offload)")
    ap.add_argument("--storage", choices=("bf16", "fp8", "fp8-linears", "gguf-q8_0", "gguf-q4_k"), default=None,
                    help="fp8: diffusers' layerwise casting (float8_e4m3fn storage, bf16 compute) on every mode, "
                         "resident included, with its default skip patterns (`auto`: Flux's adaLN modulation "
                         "linears, named norm*, stay bf16); fp8-linears: the class's patterns but `norm`, so "
                         "every Linear of the blocks is fp8; gguf-q8_0, gguf-q4_k: the blocks' Linears as diffusers' "
                         "GGUF layers (gguf_quantize_blocks); the rows name the model MODEL-STORAGE. A quantized registry "
                         "model (flux-dev-gguf-q8_0, ...) says its own storage: its rows keep its name")
    ap.add_argument("--coded", action="store_true",
                    help="the package holds the weights coded (offload.enable(coded=True)); the rows name the model MODEL-...-coded")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="the package under this device budget, planned from a calibration: the module streamed once at "
                         "--depth, one step traced on the first case, Offloaded.calibration(), disabled, then enabled with "
                         "budget_gib and calibration= (the planner keeps the blocks whose copies the step waits for); the "
                         "rows name the model MODEL-...-budgetB")
    ap.add_argument("--trace", action="store_true",
                    help="after the package's timed steps, one more step traced on both streams (its blocks' copy, wait and "
                         "compute spans), written beside --out as trace-OUT-CASE.json (Chrome trace); one case a process (the "
                         "timeline stays on once enabled)")
    ap.add_argument("--profile", action="store_true",
                    help="after the package's timed steps, three more under cProfile (profile-OUT-CASE.txt beside --out)")
    ap.add_argument("--kernels", action="store_true",
                    help="after each mode's timed steps (resident included), one more step under torch's profiler: "
                         "kernels-OUT-CASE-MODE.json beside --out (per stream: kernels, busy time, gaps, the host's and "
                         "the device's) and its Chrome trace; the file is marked kernels_profiled and py_merge.py refuses it")
    ap.add_argument("--compile", choices=("none", "default", "max-autotune-no-cudagraphs"), default="none",
                    help="each mode with its repeated blocks compiled (compile_blocks): resident and the package with "
                         "fullgraph=True, diffusers' group offloading with fullgraph=False as diffusers documents; the rows "
                         "name the model MODEL-compiled (MODEL-compiled-max-autotune); warm up at least twice")
    ap.add_argument("--compile-whole", action="store_true",
                    help="with --compile: resident and the package compile the whole module (model.compile(fullgraph=True), "
                         "the package's hooks then ops in the graph); diffusers' modes as --compile gives them; the rows "
                         "name the model MODEL-compiled-whole")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.warmup < 1:
        # A cold first step (allocator, first kernel launches) would be timed, and a
        # slow resident step flatters every ratio to its bound.
        raise SystemExit("--warmup 0: warm up at least once")
    modes = a.mode.split(",")
    if a.budget_gib is not None and a.coded:
        ap.error("--budget-gib plans from a calibration, which plans a ring that is not coded: not with --coded")
    if not modes or any(m not in ("block_stream", "leaf_stream", "offload") for m in modes) or len(set(modes)) != len(modes):
        ap.error(f"--mode: block_stream, leaf_stream and/or offload, each once, not {a.mode!r}")
    import diffusers

    spec = next(m for m in json.load(open(a.registry)) if m["name"] == a.model)
    # A quantized registry model names its storage (and its name carries it already).
    stored = spec.get("storage", "bf16")
    if stored != "bf16" and a.storage not in (None, stored):
        ap.error(f"--storage {a.storage}: {a.model} is stored {stored}")
    suffix = stored == "bf16"
    a.storage = a.storage or stored
    cases = [c for c in user_cases(spec["cases"], a.size, a.batch, a.frames) if not a.cases or c["name"] in a.cases.split(",")]
    if a.trace and len(cases) != 1:
        # The timeline stays on once enabled: later cases' timed steps would wait on its events.
        ap.error(f"--trace traces one case a process: give --cases with one of {[c['name'] for c in cases]}")
    t0 = time.perf_counter()
    model = build(spec["reference"])
    torch.cuda.synchronize()
    print(f"setup: model built and filled on the device in {time.perf_counter() - t0:.1f} s", flush=True)
    if a.storage.startswith("gguf-"):
        n = gguf_quantize_blocks(model, a.storage.split("-", 1)[1])
        torch.cuda.synchronize()
        a.model = f"{a.model}-{a.storage}" if suffix else a.model
        print(f"setup: {n} Linears of the blocks as GGUF {a.storage[5:].upper()} in {time.perf_counter() - t0:.1f} s", flush=True)
    elif a.storage != "bf16":
        # The weights stored as fp8, each layer upcast to bf16 for its forward, in
        # every mode (resident, the package, diffusers' group offloading).
        from diffusers.hooks import apply_layerwise_casting
        skip = fp8_skip_patterns(model, a.storage)
        apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16, skip_modules_pattern=skip)
        a.model = f"{a.model}-{a.storage}" if suffix else a.model
        print(f"setup: layerwise casting to fp8 (skipping {skip}), "
              f"{sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn) / 1e9:.2f} G weights fp8", flush=True)
    if a.coded:
        a.model = f"{a.model}-coded"
    if a.budget_gib is not None:
        a.model = f"{a.model}-budget{a.budget_gib:g}"
    if a.compile_whole and a.compile == "none":
        ap.error("--compile-whole: name how with --compile")
    if a.compile != "none":
        if a.warmup < 2:
            ap.error("--compile: warm up at least twice (the first step compiles)")
        a.model = f"{a.model}-compiled" + ("-max-autotune" if a.compile != "default" else "") + ("-whole" if a.compile_whole else "")
        n = compile_blocks(model, a.compile, fullgraph=True, whole=a.compile_whole)
        print(f"setup: {n} module(s) compiled ({a.compile}{', whole' if a.compile_whole else ''})", flush=True)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if stored != "bf16" and model_bytes != spec["stored_bytes"]:
        # The registry's cost of this storage (what the planners count) is not what it made.
        raise SystemExit(f"{a.model}: stored as {stored} the model holds {model_bytes} bytes, the registry says {spec['stored_bytes']}")
    out, act, ref = [], {}, {}
    for c in cases:
        x = inputs(a.model, c, "cuda", vocab)
        times, peak, before, _, finite, nonconst = time_case(model, x, a.warmup, a.steps)
        ref[c["name"]] = time_case.last.detach().cpu()
        act[c["name"]] = peak - before
        if a.kernels:
            head, tail = os.path.split(a.out)
            kernel_profile(model, x, os.path.join(head, f"kernels-{tail.removesuffix('.json')}-{c['name']}-resident.json"))
        print(f"diffusers resident {a.model} {c['name']}: {sorted(times)[len(times) // 2]:.4f} s, activations {act[c['name']] / 2**30:.2f} GiB, "
              f"host {sorted(time_case.host)[len(time_case.host) // 2]:.4f} s a step", flush=True)
        out.append(dict(model=a.model, case=c["name"], resolution=c["resolution"], height=c.get("height", c["resolution"]), frames=c["frames"],
                        tokens=c["image_tokens"] + c["text_tokens"], batch=c["batch"],
                        mode="resident", steps_s=times, host_steps_s=time_case.host, model_bytes=model_bytes, weights_device_bytes=model_bytes,
                        activations_peak_bytes=act[c["name"]], output_finite=finite, output_nonconstant=nonconst,
                        frames_compiled_in_timed_steps=time_case.frames_compiled))
        del x
    # To the host straight into page-locked tensors: one device-to-host copy each,
    # where `model.to("cpu")` would copy into pageable memory and diffusers' hooks
    # would then copy that again into pinned memory (`pin_memory()` returns a
    # tensor that is pinned already as it is). The hooks keep the same pinned
    # tensors either way; only the setup is shorter.
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t.data)
            t.data = host
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(f"setup: weights to pinned host memory in {time.perf_counter() - t0:.1f} s", flush=True)
    bandwidth = h2d_bandwidth() if "offload" in modes else None
    handle = None
    for i, mode in enumerate(modes):
        if handle is not None:
            # The package removed: every parameter and buffer back in the same
            # pinned host tensors, as before it was enabled.
            import offload as ours
            ours.disable(model)
            handle = None
            stray = [n for n, p in model.named_parameters() if p.device.type != "cpu"]
            assert not stray, f"parameters left on the device after offload: {stray[:3]}"
            torch.cuda.empty_cache()
        elif i > 0:
            # The next mode on the same model: diffusers' own removal of its hooks
            # (as `_maybe_remove_and_reapply_group_offloading` does). Every group
            # offloads after its forward: the streamed groups into the same pinned
            # host tensors, which the next mode's hooks keep as they are; block
            # level's unmatched group (no stream) into new pageable tensors, as
            # in a fresh process after its first forward (leaf level pins them).
            remove_group_offloading(model)
            stray = [n for n, p in model.named_parameters() if p.device.type != "cpu"]
            assert not stray, f"parameters left on the device after {modes[i - 1]}: {stray[:3]}"
            torch.cuda.empty_cache()
        if mode == "offload":
            import offload as ours
            t0 = time.perf_counter()
            cal = None
            if a.budget_gib is not None:
                # The blocks' compute times from one traced step of a plain ring.
                h0 = ours.enable(model, device="cuda", depth=a.depth, name=a.model, progress=False)
                x = inputs(a.model, cases[0], "cuda", vocab)
                with torch.no_grad():
                    model(**x)
                    h0.enable_trace()
                    model(**x)
                torch.cuda.synchronize()
                cal = h0.calibration()
                ours.disable(model)
                del x
                torch.cuda.empty_cache()
            handle = ours.enable(model, device="cuda", depth=a.depth, coded=a.coded, name=a.model, progress=False,
                                 budget_gib=a.budget_gib, calibration=cal)
            plan = handle.plan()
            kept = len(plan["resident_blocks"])
            planned = f", budget {a.budget_gib:g} GiB, calibrated, {kept} blocks resident" if cal else ""
            print(f"setup: the offload package enabled (depth {plan['depth']}{', coded' if a.coded else ''}{planned}) "
                  f"in {time.perf_counter() - t0:.1f} s", flush=True)
            if cal:
                print(f"  resident: {', '.join(plan['resident_blocks'])}", flush=True)
            # The bound's bandwidth as the Rust drivers measure it: every block of the
            # store copied through the engine, the best of three passes.
            engine_bandwidth = handle.probe_bandwidth(3)
            print(f"setup: the engine's probe {engine_bandwidth / 1e9:.1f} GB/s, one 2 GiB torch copy {bandwidth / 1e9:.1f} GB/s", flush=True)
            if a.compile != "none":
                compile_blocks(model, a.compile, fullgraph=True, whole=a.compile_whole)
        else:
            try:
                offload(model, mode, a.model)
                if a.compile != "none":
                    compile_blocks(model, a.compile, fullgraph=False)
            except Exception as e:  # noqa: BLE001 - an anchor that cannot run is named, not fatal
                failed(out, a, cases, mode, e)
                continue
        for c in cases:
            x = inputs(a.model, c, "cuda", vocab)
            syncs = handle.counters()["syncs"] if handle is not None else None
            try:
                times, peak, before, weights, finite, nonconst = time_case(model, x, a.warmup, a.steps)
            except Exception as e:  # noqa: BLE001 - diffusers' mode failing on this model is named
                if mode == "offload":
                    raise
                failed(out, a, [c], mode, e)
                del x
                continue
            w = peak - (before - weights) - act[c["name"]]
            if handle is not None:
                # The package's slots and resident blocks are allocated when it is
                # enabled, before the step: the peak above does not see them. Its
                # weights on the device are the module's resident tensors and what
                # the engine holds for the blocks (its slots and resident blocks),
                # and the blocks the automatic plan keeps outside the ring.
                met = handle.metrics()
                w = weights + met["peak_device_weight_bytes"] + met.get("kept_bytes", 0)
                # Coded, the decoder's staging buffers hold device memory the
                # engine's count leaves out: the row says so, and is not reported.
                measured = "engine" if not a.coded else "engine, without the decoder's staging buffers"
            label = "offload package" if mode == "offload" else f"diffusers {mode}"
            host = sorted(time_case.host)[len(time_case.host) // 2]
            print(f"{label} {a.model} {c['name']}: {sorted(times)[len(times) // 2]:.4f} s, weights {w / 2**30:.2f} GiB, "
                  f"host {host:.4f} s a step", flush=True)
            row = dict(model=a.model, case=c["name"], resolution=c["resolution"], height=c.get("height", c["resolution"]), frames=c["frames"],
                       tokens=c["image_tokens"] + c["text_tokens"], batch=c["batch"],
                       mode=mode, steps_s=times, host_steps_s=time_case.host, model_bytes=model_bytes, weights_device_bytes=w,
                       activations_peak_bytes=act[c["name"]], output_finite=finite, output_nonconstant=nonconst,
                       frames_compiled_in_timed_steps=time_case.frames_compiled)
            if handle is not None:
                m = handle.metrics()
                got = time_case.last.detach().cpu()
                if a.budget_gib is not None:
                    row.update(budget_gib=a.budget_gib, resident_blocks=handle.plan()["resident_blocks"])
                row.update(weights_from=measured, depth=handle.plan()["depth"], bitwise_equal=bool(got.shape == ref[c["name"]].shape and torch.equal(got, ref[c["name"]])),
                           bytes_per_step=m["bytes_copied"], link_bytes_per_step=m.get("link_bytes", m["bytes_copied"]), blocks=m["blocks"], misses=m["misses"], prefetch_hits=m["prefetch_hits"],
                           host_wait_s=m["host_wait_s"], host_syncs_in_timed_steps=handle.counters()["syncs"] - syncs,
                           h2d_bytes_per_s=engine_bandwidth, torch_copy_bytes_per_s=bandwidth, violations=handle.violations())
                link = row["link_bytes_per_step"]
                print(f"  bitwise {row['bitwise_equal']}, {m['bytes_copied'] / 2**30:.2f} GiB a step ({link / 2**30:.2f} on the link), "
                      f"its copy alone {link / engine_bandwidth:.4f} s at {engine_bandwidth / 1e9:.1f} GB/s, "
                      f"host syncs {row['host_syncs_in_timed_steps']}", flush=True)
                if a.trace:
                    # Outside the timed steps: the timeline's events are read at the step's end.
                    handle.enable_trace()
                    with torch.no_grad():
                        model(**x)
                    torch.cuda.synchronize()
                    head, tail = os.path.split(a.out)
                    path = os.path.join(head, f"trace-{tail.removesuffix('.json')}-{c['name']}.json")
                    handle.write_trace(path)
                    print(f"  trace of one more step: {path}", flush=True)
                if a.profile:
                    # Outside the timed steps: where the host's time a step goes.
                    import cProfile
                    import io
                    import pstats
                    prof = cProfile.Profile()
                    with torch.no_grad():
                        prof.enable()
                        for _ in range(3):
                            model(**x)
                        prof.disable()
                    torch.cuda.synchronize()
                    head, tail = os.path.split(a.out)
                    path = os.path.join(head, f"profile-{tail.removesuffix('.json')}-{c['name']}.txt")
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
                    open(path, "w").write(f"3 steps of {a.model} {c['name']}, the package's hooks profiled\n" + text.getvalue())
                    print(f"  profile of three more steps: {path}", flush=True)
            if a.kernels:
                head, tail = os.path.split(a.out)
                kernel_profile(model, x, os.path.join(head, f"kernels-{tail.removesuffix('.json')}-{c['name']}-{mode}.json"))
            out.append(row)
            del x
    if handle is not None:
        import offload as ours
        ours.disable(model)
    versions = f"diffusers {diffusers.__version__}, torch {torch.__version__}"
    if "offload" in modes:
        import offload as ours
        versions += f", offload {getattr(ours, '__version__', '0.1.0')}"
    doc = dict(versions=versions, cases=out)
    if torch.cuda.is_available():
        doc["gpu"] = torch.cuda.get_device_name()  # py_merge.py takes the GPU from the runs
        try:  # the machine's boot: zoo merge takes anchors only from a boot that ran our runs too
            with open("/proc/sys/kernel/random/boot_id") as f:
                doc["boot"] = f.read().strip()
        except OSError:
            pass
    if a.kernels:
        doc["kernels_profiled"] = True  # py_merge.py refuses it: profiled steps ran between the timed ones
    json.dump(doc, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
