"""The sweep of the classes people run, beyond the registry: one process, one
JSON. Each model is built from its diffusers or transformers class and config
(the class's defaults, or a named release's config) on the GPU, filled with
seeded random bf16 weights at the real size, and measured on the same object:

- ``resident``: the model on the device;
- ``offload``: this package with defaults (``offload.enable(m, device="cuda")``),
  its output compared bitwise with the resident one, its link probed
  (``probe_bandwidth``) and, after the timed steps, one traced step diagnosed
  (``Offloaded.diagnose``);
- ``block_stream`` / ``leaf_stream``: diffusers' group offloading (block level,
  one block per group; leaf level), streams on, pinned; its error named where it
  raises.

Each mode: 2 warm-up steps, then ``--steps`` timed with CUDA events; the
resident mode again after the others, its steps pooled with the first's. Memory as
in the zoo's anchors: the resident step's activations are its peak above what
was allocated before it; a mode's weights on the device are its steps' peak
above the inputs, less those activations.

    python3 sweep.py OUT.json [--models a,b] [--steps 3] [--device cuda|meta] [--depth N] [--tables-on-device] [--copy-beside]

``--depth``, ``--tables-on-device`` and ``--copy-beside`` make a probe, not the
defaults' sweep (its files say so, and ``sweep_merge.py`` refuses to pool them
with the defaults'): the depth given to ``enable``; the host tensors a module
keeps in lists (Lumina2's rotary tables) put on the device before any mode, for
every mode alike; and the resident step timed once more while a side stream
copies a pinned host buffer to the device back to back for the whole timed
span (``resident.step_copy_beside``): how much a link-rate copy alone slows
the blocks' compute, with no package involved.

``--device meta`` builds every model and runs its forward on the meta device:
a check of the classes, configs and inputs on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
import traceback

import torch

# name -> (module, class, config, case, video). Configs: the class's defaults
# unless a release is named (its published config's sizes).
MODELS = {
    "cogview4": ("diffusers", "CogView4Transformer2DModel", {}, "1024², 256 text tokens", False),
    "ltx-video": ("diffusers", "LTXVideoTransformer3DModel", {}, "480×704×121 frames (5280 tokens), 128 text tokens", True),
    "sana-1600m": ("diffusers", "SanaTransformer2DModel", {}, "1024² (1024 tokens), 300 text tokens", False),
    "lumina2": ("diffusers", "Lumina2Transformer2DModel", {}, "1024², 256 text tokens", False),
    "cogvideox-2b": ("diffusers", "CogVideoXTransformer3DModel", {}, "480×720×49 frames (17550 tokens), 226 text tokens", True),
    "mochi-1": ("diffusers", "MochiTransformer3DModel", {}, "480×848×31 frames (9540 tokens), 256 text tokens", True),
    "hunyuanvideo": ("diffusers", "HunyuanVideoTransformer3DModel", {}, "320×512×33 frames (5760 tokens), 256 text tokens", True),
    "chroma": ("diffusers", "ChromaTransformer2DModel", {}, "1024² (4096 tokens), 512 text tokens", False),
    "skyreels-v2-1.3b": ("diffusers", "SkyReelsV2Transformer3DModel",
                         dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, num_layers=30),
                         "480×832×17 frames (7800 tokens), 512 text tokens", True),
    "pixart-sigma": ("diffusers", "PixArtTransformer2DModel", dict(caption_channels=4096, interpolation_scale=2, use_additional_conditions=False),
                     "1024² (4096 tokens), 300 text tokens", False),
    "allegro": ("diffusers", "AllegroTransformer3DModel", {}, "352×640×40 frames (8800 tokens), 512 text tokens", True),
    "llama-3.2-3b": ("transformers", "LlamaModel",
                     dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                          num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                          tie_word_embeddings=True),
                     "prefill, 1024 tokens", False),
    "qwen3-4b": ("transformers", "Qwen3Model",
                 dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                      max_position_embeddings=40960, tie_word_embeddings=True),
                 "prefill, 1024 tokens", False),
    "llama-3-8b": ("transformers", "LlamaModel",
                   dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
                   "prefill, 1024 tokens", False),
    "qwen3-8b": ("transformers", "Qwen3Model",
                 dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                      max_position_embeddings=40960),
                 "prefill, 1024 tokens", False),
}


def inputs(name: str, dev: str) -> dict:
    """Seeded inputs of each model's case (latents as the pipeline hands them)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(dev)
    t = lambda v: torch.tensor([v], device=dev)
    ones = lambda n: torch.ones(1, n, dtype=torch.bool, device=dev)
    if name == "cogview4":
        return dict(hidden_states=r(1, 16, 128, 128), encoder_hidden_states=r(1, 256, 4096), timestep=t(500),
                    original_size=torch.tensor([[1024, 1024]], device=dev), target_size=torch.tensor([[1024, 1024]], device=dev),
                    crop_coords=torch.tensor([[0, 0]], device=dev), return_dict=False)
    if name == "ltx-video":
        f, h, w = 16, 15, 22
        return dict(hidden_states=r(1, f * h * w, 128), encoder_hidden_states=r(1, 128, 4096), timestep=t(500),
                    encoder_attention_mask=ones(128).to(torch.bfloat16), num_frames=f, height=h, width=w, return_dict=False)
    if name == "sana-1600m":
        return dict(hidden_states=r(1, 32, 32, 32), encoder_hidden_states=r(1, 300, 2304), timestep=t(500), return_dict=False)
    if name == "lumina2":
        return dict(hidden_states=r(1, 16, 128, 128), timestep=t(0.5).to(torch.bfloat16), encoder_hidden_states=r(1, 256, 1024),
                    encoder_attention_mask=ones(256), return_dict=False)
    if name == "cogvideox-2b":
        return dict(hidden_states=r(1, 13, 16, 60, 90), encoder_hidden_states=r(1, 226, 4096), timestep=t(500), return_dict=False)
    if name == "mochi-1":
        return dict(hidden_states=r(1, 12, 6, 60, 106), encoder_hidden_states=r(1, 256, 4096), timestep=t(500),
                    encoder_attention_mask=ones(256), return_dict=False)
    if name == "hunyuanvideo":
        return dict(hidden_states=r(1, 16, 9, 40, 64), timestep=t(500), encoder_hidden_states=r(1, 256, 4096),
                    encoder_attention_mask=ones(256), pooled_projections=r(1, 768), guidance=t(6000.0).to(torch.bfloat16),
                    return_dict=False)
    if name == "chroma":
        ids = torch.zeros(4096, 3, device=dev)
        ids[:, 1] = torch.arange(4096, device=dev) // 64
        ids[:, 2] = torch.arange(4096, device=dev) % 64
        return dict(hidden_states=r(1, 4096, 64), encoder_hidden_states=r(1, 512, 4096), timestep=t(0.5).to(torch.bfloat16),
                    img_ids=ids, txt_ids=torch.zeros(512, 3, device=dev), return_dict=False)
    if name == "pixart-sigma":
        return dict(hidden_states=r(1, 4, 128, 128), encoder_hidden_states=r(1, 300, 4096), timestep=t(500),
                    added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
    if name == "allegro":
        return dict(hidden_states=r(1, 4, 10, 44, 80), encoder_hidden_states=r(1, 512, 4096), timestep=t(500), return_dict=False)
    if name.startswith("skyreels"):
        return dict(hidden_states=r(1, 16, 5, 60, 104), timestep=t(500), encoder_hidden_states=r(1, 512, 4096), return_dict=False)
    # A decoder LLM's prefill: seeded token ids.
    vocab = MODELS[name][2]["vocab_size"]
    return dict(input_ids=torch.randint(vocab, (1, 1024), generator=g).to(dev), use_cache=False, return_dict=False)


def build(name: str, dev: str):
    import importlib

    mod_name, cls_name, config, _, _ = MODELS[name]
    mod = importlib.import_module(mod_name)
    cls = getattr(mod, cls_name)
    with torch.device(dev):
        if mod_name == "transformers":
            cfg = getattr(mod, cls_name.replace("Model", "Config"))(**config)
            cfg._attn_implementation = "sdpa"
            m = cls(cfg)
        else:
            m = cls(**config)
    m = m.to(torch.bfloat16).eval()
    if dev == "meta":
        return m
    # Seeded weights, filled on the device: linear weights at +-1/sqrt(fan-in),
    # vectors (biases, norm scales) in [0.5, 1.5] for weights, +-0.01 for biases.
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                lo, hi = (0.5, 1.5) if n.endswith("weight") else (-0.01, 0.01)
            else:
                a = 1.0 / (p[0].numel() ** 0.5)
                lo, hi = -a, a
            p.copy_(torch.empty(p.shape, device=dev, dtype=torch.float32).uniform_(lo, hi, generator=g))
    return m


def first(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "last_hidden_state", getattr(out, "sample", out))


def timed(m, x, steps: int):
    with torch.no_grad():
        for _ in range(2):
            out = first(m(**x))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        evs[0].record()
        for i in range(steps):
            out = first(m(**x))
            evs[i + 1].record()
        torch.cuda.synchronize()
    times = [evs[i].elapsed_time(evs[i + 1]) / 1e3 for i in range(steps)]
    return out, times, torch.cuda.max_memory_allocated(), before


def stats(ts):
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "runs_s": ts}


def equal(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b))


def tables_to(m, dev) -> list[str]:
    """The host tensors `m`'s modules keep in lists of tensors (neither
    parameters nor buffers: Lumina2's `rope_embedder.freqs_cis`), moved to
    `dev` (the same bits); their names."""
    moved = []
    for path, mod in m.named_modules():
        for k, v in list(vars(mod).items()):
            if isinstance(v, list) and v and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in v):
                setattr(mod, k, [t.to(dev) for t in v])
                moved.append(f"{path}.{k}" if path else k)
    return moved


def timed_copy_beside(m, x, steps: int, step_s: float) -> tuple[list[float], float]:
    """The resident step timed while a side stream copies a 256 MiB pinned
    host buffer to the device back to back, queued for 4 × the expected span
    (warm-up included) before the first step; the timed steps and the copies'
    rate."""
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):  # the rate, alone
        t0.record()
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        t1.record()
    torch.cuda.synchronize()
    rate = 4 * n / (t0.elapsed_time(t1) / 1e3)
    copies = max(4, int(4 * (steps + 2) * step_s * rate / n) + 1)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        a.record()
        for _ in range(copies):
            dst.copy_(src, non_blocking=True)
        b.record()
    _, ts, _, _ = timed(m, x, steps)  # synchronises every stream at its end
    side_s = a.elapsed_time(b) / 1e3
    # The copies ran from before the warm-up steps: they covered the timed ones
    # where they lasted the whole span (the warm-ups taken as long as the slowest timed step).
    if side_s < sum(ts) + 2 * max(ts):
        raise RuntimeError(f"the side copies ({copies} of 256 MiB, {side_s:.3f} s) ended before the timed steps did")
    return ts, rate


def measure(name: str, steps: int, depth: int | None = None, tables: bool = False, copy_beside: bool = False) -> dict:
    import offload

    row = {"model": name, "class": MODELS[name][1], "library": MODELS[name][0], "config": MODELS[name][2] or "the class's defaults",
           "case": MODELS[name][3], "video": MODELS[name][4]}
    torch.cuda.empty_cache()
    x = inputs(name, "cuda")
    base = torch.cuda.memory_allocated()
    m = build(name, "cuda")
    if tables:
        row["tables_on_device"] = tables_to(m, "cuda")
    try:
        stacks = offload.find_blocks(m)
    except Exception as e:  # named, never hidden
        stacks = f"{type(e).__name__}: {e}"
    row["block_lists"] = stacks
    row["weight_bytes"] = sum(p.numel() * p.element_size() for p in m.parameters())
    ref, res_ts, peak, before = timed(m, x, steps)
    ts = res_ts
    ref = ref.detach().clone()
    f = ref.float()
    row["finite"], row["not_constant"] = bool(torch.isfinite(f).all()), bool((f != f.flatten()[0]).any())
    row["activations_bytes"] = peak - before
    row["resident"] = {"step": stats(ts), "weights_bytes": row["weight_bytes"]}
    del f
    if copy_beside:
        beside, rate = timed_copy_beside(m, x, steps, statistics.median(ts))
        row["resident"]["step_copy_beside"] = stats(beside)
        row["resident"]["copy_beside_bytes_per_s"] = rate
        print(name, "resident", f"{statistics.median(ts):.4f} s; with a copy beside {statistics.median(beside):.4f} s "
              f"({rate / 1e9:.1f} GB/s alone)", flush=True)
    m.to("cpu")
    torch.cuda.empty_cache()

    def weights_of(peak):
        return max(0, peak - base - row["activations_bytes"])

    try:
        h = offload.enable(m, device="cuda", **({} if depth is None else {"depth": depth}))
        bw = h.probe_bandwidth()
        out, ts, peak, _ = timed(m, x, steps)
        met = h.metrics()
        r = {"step": stats(ts), "bandwidth_bytes_per_s": bw, "bytes_copied": met["bytes_copied"], "metrics": met,
             "bitwise_equal": equal(out, ref), "weights_bytes": weights_of(peak), "plan": h.plan()}
        h.enable_trace()
        timed(m, x, 1)
        try:
            d = h.diagnose(link_gbps=bw / 1e9)
            r["diagnosis"] = {k: d[k] for k in ("verdict", "causes", "step_s", "compute_s", "wait_s", "between_s", "host_s", "summary")}
        except offload.OffloadError as e:  # every block kept resident: no copy to diagnose
            r["diagnosis"] = {"verdict": None, "causes": {}, "summary": f"OffloadError: {e}"}
        offload.disable(m)
    except Exception as e:
        r = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400], "traceback": traceback.format_exc()[-2000:]}
        try:
            offload.disable(m)
        except Exception:
            pass
    row["offload"] = r
    print(name, "offload", json.dumps({k: v for k, v in r.items() if k not in ("metrics", "traceback")}, default=str)[:600], flush=True)
    torch.cuda.empty_cache()

    from diffusers.hooks import apply_group_offloading

    for mode, kind in (("block_stream", "block_level"), ("leaf_stream", "leaf_level")):
        try:
            kw = dict(num_blocks_per_group=1) if kind == "block_level" else {}
            apply_group_offloading(m, onload_device=torch.device("cuda"), offload_device=torch.device("cpu"), offload_type=kind,
                                   use_stream=True, record_stream=True, **kw)
            out, ts, peak, _ = timed(m, x, steps)
            row[mode] = {"step": stats(ts), "bitwise_equal": equal(out, ref), "weights_bytes": weights_of(peak)}
        except Exception as e:
            row[mode] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400]}
        _remove_group_offloading(m)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(name, mode, json.dumps(row[mode], default=str)[:300], flush=True)
    # The resident step again, after the offloaded modes: the host's speed drifts
    # within a process (a host-bound model's resident step moved by up to 70 %
    # between processes), so the reference pools the steps timed before and after.
    m.to("cuda")
    again, ts2, _, _ = timed(m, x, steps)
    row["resident"]["step_before"], row["resident"]["step_after"] = row["resident"]["step"], stats(ts2)
    row["resident"]["step"] = stats(res_ts + ts2)
    row["resident"]["after_bitwise_equal"] = equal(again, ref)
    m.to("cpu")
    del m, x, ref, again
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _remove_group_offloading(m) -> None:
    """diffusers' hooks off every submodule, the weights back on the host."""
    from diffusers.hooks import HookRegistry

    for sub in m.modules():
        reg = getattr(sub, "_diffusers_hook", None)
        if isinstance(reg, HookRegistry):
            for hook_name in list(reg.hooks.keys()):
                reg.remove_hook(hook_name, recurse=False)
    m.to("cpu")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--depth", type=int, help="the depth given to enable (a probe)")
    ap.add_argument("--tables-on-device", action="store_true", help="host tensor lists put on the device first (a probe)")
    ap.add_argument("--copy-beside", action="store_true", help="the resident step timed again beside a link-rate copy (a probe)")
    a = ap.parse_args()
    names = a.models.split(",")
    if a.device == "meta":
        for n in names:
            try:
                m = build(n, "meta")
                with torch.no_grad():
                    out = first(m(**inputs(n, "meta")))
                print(n, "ok", tuple(out.shape), f"{sum(p.numel() for p in m.parameters()) * 2 / 2**30:.2f} GiB", flush=True)
            except Exception as e:
                print(n, "FAILED", f"{type(e).__name__}: {e}"[:500], flush=True)
        return
    import diffusers
    import transformers

    import offload

    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "offload": offload.__version__,
           "commit": os.environ.get("OFFLOAD_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                                        text=True).stdout.strip(),
           "steps": a.steps, "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "models": []}
    if a.depth is not None or a.tables_on_device or a.copy_beside:
        doc["probe"] = {"depth": a.depth, "tables_on_device": a.tables_on_device, "copy_beside": a.copy_beside}
    for n in names:
        try:
            doc["models"].append(measure(n, a.steps, a.depth, a.tables_on_device, a.copy_beside))
        except Exception as e:  # the model's row names its failure; the sweep goes on
            doc["models"].append({"model": n, "error": f"{type(e).__name__}: {e}".splitlines()[0][:400],
                                  "traceback": traceback.format_exc()[-2000:]})
            print(n, "FAILED", doc["models"][-1]["error"], flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
