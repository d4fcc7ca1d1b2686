"""Why CogView4 streams slower than its bound (issue 54): one process, one JSON.

CogView4Transformer2DModel() at its default config (random bf16 weights at the
real size), 1024² (4096 image tokens) with 256 text tokens, on CUDA:

- resident: the step, and torch's profiler over one step counting what the
  model does between kernels (host-to-device copies from pageable memory and
  stream synchronisations), per block;
- the package with every block copy in one piece (``OFFLOAD_COPY_CHUNK_BYTES=0``,
  the engine before this change) and in its default pieces, each checked
  bitwise equal to resident, with its metrics and the link's bandwidth;
- diffusers' group offloading, block level, streams on, on the same object.

    python3 cogview4_probe.py OUT.json [--steps 5] [--trace DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch


def build():
    from diffusers import CogView4Transformer2DModel

    with torch.device("meta"):
        m = CogView4Transformer2DModel()
    m = m.to_empty(device="cuda").to(torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32).mul_(0.02).to(p.dtype))
        for b in m.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g, device="cuda").to(b.dtype))
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 128, 128, generator=g, device="cuda").to(torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 256, 4096, generator=g, device="cuda").to(torch.bfloat16),
        timestep=torch.tensor([500], device="cuda"),
        original_size=torch.tensor([[1024, 1024]], device="cuda"),
        target_size=torch.tensor([[1024, 1024]], device="cuda"),
        crop_coords=torch.tensor([[0, 0]], device="cuda"),
        return_dict=False,
    )
    return m, inputs


def timed(m, inputs, steps):
    out, times = None, []
    with torch.no_grad():
        for i in range(steps + 2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = m(**inputs)[0]
            torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t)
    return out, times


def model_copies(m, inputs):
    """What the resident step does beside kernels, from torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        m(**inputs)
        torch.cuda.synchronize()
    counts = {}
    for e in prof.events():
        n = e.name
        if "Memcpy HtoD" in n or n in ("cudaStreamSynchronize", "cudaMemcpyAsync", "aten::_to_copy", "cudaDeviceSynchronize"):
            counts[n] = counts.get(n, 0) + 1
    return counts


def stats(ts):
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "runs_s": ts}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--rope-on-device", action="store_true",
                    help="pass the rotary tables made on the device (the model makes them on the host, and each block moves them)")
    ap.add_argument("--chunks", default="0,default", help="copy pieces to run: 0 (one piece), default, or a byte count")
    a = ap.parse_args()
    import offload

    m, inputs = build()
    if a.rope_on_device:
        cos, sin = m.rope(inputs["hidden_states"])
        inputs["image_rotary_emb"] = (cos.to("cuda"), sin.to("cuda"))
    blocks = len(m.transformer_blocks)
    block_bytes = sum(p.numel() * p.element_size() for p in m.transformer_blocks.parameters())
    ref, t_res = timed(m, inputs, a.steps)
    ref = ref.clone()
    f = ref.float()
    assert torch.isfinite(f).all() and f.std() > 0, "the resident output is not finite, or constant"
    res = {
        "gpu": torch.cuda.get_device_name(),
        "commit": os.environ.get("OFFLOAD_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "rope_on_device": a.rope_on_device,
        "torch": torch.__version__,
        "model": "CogView4Transformer2DModel() default config, bf16, random",
        "case": "1024x1024 (4096 image tokens), 256 text tokens, batch 1",
        "blocks": blocks,
        "block_bytes": block_bytes,
        "resident": stats(t_res),
        "resident_model_copies_per_step": model_copies(m, inputs),
        "package": {},
    }
    m.to("cpu")
    torch.cuda.empty_cache()
    runs = {"0": ("one-piece", "0"), "default": ("default-pieces", None)}
    for label, chunk in [runs.get(c, (f"pieces-{c}", c)) for c in a.chunks.split(",")]:
        if chunk is None:
            os.environ.pop("OFFLOAD_COPY_CHUNK_BYTES", None)
        else:
            os.environ["OFFLOAD_COPY_CHUNK_BYTES"] = chunk
        h = offload.enable(m, device="cuda")
        bw = h.probe_bandwidth()
        out, ts = timed(m, inputs, a.steps)
        met = h.metrics()
        row = {"step": stats(ts), "bandwidth_bytes_per_s": bw, "metrics": met,
               "bitwise_equal": bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))}
        row["bound_s"] = max(statistics.median(t_res), met["bytes_copied"] / bw)
        row["ratio_to_bound"] = statistics.median(ts) / row["bound_s"]
        if a.trace:
            h.enable_trace()
            timed(m, inputs, 1)
            h.write_trace(os.path.join(a.trace, f"cogview4-{label}.json"))
        offload.disable(m)
        torch.cuda.empty_cache()
        res["package"][label] = row
        print(label, json.dumps({k: v for k, v in row.items() if k != "metrics"}, default=str)[:400], flush=True)
    try:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(m, onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True)
        out, ts = timed(m, inputs, a.steps)
        res["diffusers_block_stream"] = {"step": stats(ts), "bitwise_equal": bool(torch.equal(out.view(torch.int16), ref.view(torch.int16)))}
    except Exception as e:  # named in the file, never hidden
        res["diffusers_block_stream"] = {"error": f"{type(e).__name__}: {e}"}
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(json.dumps({k: v for k, v in res.items() if k != "package"}, default=str)[:1500])


if __name__ == "__main__":
    main()
