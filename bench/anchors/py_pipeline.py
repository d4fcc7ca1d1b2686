"""Issue 32's whole pipeline: diffusers' FluxPipeline built from configs with random
weights (Flux-dev's transformer and VAE from the registry; no text encoders or
tokenizers, the prompt embeddings passed in), one call of `--steps` denoising
steps at `--res`², per mode on the same pipeline object in one process:

    resident      every component on the device
    offload       offload.enable_pipeline(pipe, budget_gib=W): W the budget B less the resident
                  call's activations (and 0.25 GiB), so that the whole call's peak fits B
    model_cpu     diffusers' enable_model_cpu_offload()
    group_block   diffusers' group offloading of every component, block level, with streams
    group_leaf    the same, leaf level

    py_pipeline.py run --registry R [--res 1024] [--steps 4] [--budget-gib 8] [--calls 3] --out F
    py_pipeline.py merge --date D --out F RUN.json...

Each mode: `--calls` timed calls after one untimed, the whole call's seconds, the
device's peak allocated bytes over a call (weights and activations together, as
torch's allocator counts them; the package's slots are torch's too), the image
against the resident one bit for bit. The merge computes, by code: medians with
min and max, which of diffusers' modes fit the budget, the fastest of those, and
the package against it and against resident.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

MODES = ("resident", "offload", "model_cpu", "group_block", "group_leaf")


def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def merge(runs: list[dict], files: list[str], date: str, min_runs: int = 3) -> dict:
    """The results file of `runs` (from `files`): at least `min_runs` processes of
    one commit, case and budget; per mode the spreads, then the comparison."""
    if len(runs) < min_runs:
        raise SystemExit(f"py_pipeline merge: {len(runs)} run(s), at least {min_runs} wanted")
    head = lambda r: (r["commit"], r["res"], r["steps"], r["budget_gib"])  # noqa: E731
    for r, f in zip(runs, files):
        if head(r) != head(runs[0]):
            raise SystemExit(f"py_pipeline merge: {f} is {head(r)}, {files[0]} is {head(runs[0])}: merge runs of one commit and case")
    budget = runs[0]["budget_gib"] * (1 << 30)
    modes = {}
    for mode in MODES:
        rows = [r["modes"][mode] for r in runs if mode in r["modes"]]
        if not rows:
            continue
        if len(rows) != len(runs):
            raise SystemExit(f"py_pipeline merge: mode {mode} is in {len(rows)} of {len(runs)} runs")
        failed = [row["failed"] for row in rows if "failed" in row]
        if failed:
            modes[mode] = {"failed": failed[0], "processes": len(rows)}
            continue
        calls = [statistics.median(row["calls_s"]) for row in rows]
        peak = max(row["peak_device_bytes"] for row in rows)
        modes[mode] = {
            "call_s": spread(calls),
            "peak_device_bytes": peak,
            "weights_device_bytes": max(row["weights_device_bytes"] for row in rows),
            # On the simulated device no peak is read (0): nothing is judged to fit.
            "fits_budget": 0 < peak <= budget,
            "bitwise_equal_to_resident": all(row["bitwise_equal"] for row in rows),
            "output_finite": all(row["output_finite"] for row in rows),
            "output_nonconstant": all(row["output_nonconstant"] for row in rows),
        }
    ours, res = modes.get("offload"), modes.get("resident")
    if ours is None or res is None or "failed" in ours or "failed" in res:
        raise SystemExit("py_pipeline merge: the runs have no resident or no offload mode")
    fitting = {m: v for m, v in modes.items() if m not in ("resident", "offload") and "failed" not in v and v["fits_budget"]}
    best = min(fitting, key=lambda m: fitting[m]["call_s"]["median"], default=None)
    r0 = runs[0]

    # The results file's common fields (DESIGN.md, Benchmark results): a "step"
    # here is the whole call; a call's link bytes are not read, so no bound.
    def row(m: dict) -> dict:
        return dict(resolution=r0["res"], batch=1, depth=1, budget_bytes=int(budget), step_resident_s=res["call_s"]["median"],
                    step_streamed_s=m["call_s"]["median"], bandwidth_gbps=None, streamed_bytes=None, bound_s=None,
                    ratio_to_bound=None, peak_device_bytes=m["peak_device_bytes"], bitwise_equal=m["bitwise_equal_to_resident"])

    out = {
        "generated_by": "bench/anchors/py_pipeline.py merge",
        "date": date,
        "commit": r0["commit"],
        "gpu": r0["gpu"],
        "backend": "python",
        "model": "flux-dev",
        "cases": [row(ours)],
        "anchors": {m: row(v) for m, v in modes.items() if m not in ("resident", "offload") and "failed" not in v},
        "versions": r0["versions"],
        "case": {"pipeline": "FluxPipeline", "transformer": "flux-dev", "res": r0["res"], "steps": r0["steps"], "batch": 1},
        "budget_gib": r0["budget_gib"],
        "processes": len(runs),
        "runs": files,
        "modes": modes,
        "diffusers_best_within_budget": best,
        "offload_vs_resident": ours["call_s"]["median"] / res["call_s"]["median"],
        "offload_vs_diffusers_best": None if best is None else ours["call_s"]["median"] / fitting[best]["call_s"]["median"],
        "targets": {
            "offload_within_budget": ours["fits_budget"],
            "bitwise_equal": ours["bitwise_equal_to_resident"] and ours["output_finite"] and ours["output_nonconstant"],
            "faster_than_diffusers_best_within_budget": best is not None and ours["call_s"]["median"] < fitting[best]["call_s"]["median"],
        },
        "offload_weights_budget_gib": [r["modes"]["offload"].get("weights_budget_gib") for r in runs],
        "method": "call_s: one pipeline call of `steps` denoising steps and the VAE decode, the median over a process's timed calls, "
                  "then the median over processes; peak_device_bytes: torch.cuda.max_memory_allocated over a call (weights and "
                  "activations); weights_device_bytes: allocated before the call; fits_budget: peak within budget_gib; "
                  "cases and anchors: the common fields, a step being the whole call (bandwidth, bytes and bound not read: null)",
    }
    out["meets_targets"] = all(out["targets"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("run", "merge"))
    ap.add_argument("--registry")
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget-gib", type=float, default=8.0)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda", help="cpu: the simulated device (a dry run, as CI makes it; resident and offload only)")
    ap.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    ap.add_argument("--date", default=None)
    ap.add_argument("--out")
    ap.add_argument("runs", nargs="*")
    a = ap.parse_intermixed_args()
    if a.what == "merge":
        runs = [json.load(open(f)) for f in a.runs]
        json.dump(merge(runs, a.runs, a.date), open(a.out, "w"), indent=1)
        open(a.out, "a").write("\n")
        return

    import torch
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    import offload

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zoo_anchor import build, remove_group_offloading

    dev = a.device
    cuda = dev == "cuda"
    reg = {m["name"]: m for m in json.load(open(a.registry))}
    transformer = build(reg["flux-dev"]["reference"], dev)
    vae = build(reg["flux-vae"]["reference"], dev)
    # Flux-dev's scheduler config (shift by image size, as the released pipeline's).
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                        transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    cfg = transformer.config
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randn(1, 512, cfg.joint_attention_dim, generator=g).to(dev, torch.bfloat16)
    pooled = torch.randn(1, cfg.pooled_projection_dim, generator=g).to(dev, torch.bfloat16)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def call():
        """The image, and the latents the last denoising step left (the image is
        clamped to [0, 1]: a saturated pixel would hide a wrong weight; the
        latents do not)."""
        gen = torch.Generator(device="cpu").manual_seed(42)
        final = {}

        def keep(_pipe, _i, _t, kw):
            final["latents"] = kw["latents"]
            return kw

        with torch.no_grad():
            img = pipe(prompt_embeds=prompt, pooled_prompt_embeds=pooled, height=a.res, width=a.res, num_inference_steps=a.steps,
                       guidance_scale=3.5, generator=gen, output_type="pt", callback_on_step_end=keep,
                       callback_on_step_end_tensor_inputs=["latents"]).images
        return img, final["latents"]

    def measure(mode):
        call()  # untimed: hooks' first pass, cuBLAS plans
        sync()
        weights = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.calls):
            sync()
            t = time.perf_counter()
            img, latents = call()
            sync()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        print(f"{mode}: {statistics.median(times):.3f} s a call, peak {peak / 2**30:.2f} GiB (weights {weights / 2**30:.2f})", flush=True)
        # Finite and varied: the image and the latents both.
        fs = [img.float(), latents.float()]
        return dict(calls_s=times, peak_device_bytes=peak, weights_device_bytes=weights,
                    output_finite=all(bool(torch.isfinite(f).all()) for f in fs),
                    output_nonconstant=all(bool((f != f.flatten()[0]).any()) for f in fs)), (img.detach().cpu(), latents.detach().cpu())

    out = {}
    ref = None
    modes = a.modes.split(",")
    if modes[0] != "resident":
        raise SystemExit("--modes: resident first (the others are checked against it)")
    for mode in modes:
        try:
            if mode == "resident":
                pipe.to(dev)
            elif mode == "offload":
                # The budget holds the call's activations too: the package's (a weights
                # budget) is what the resident call left above its weights, taken off.
                act = out["resident"]["peak_device_bytes"] - out["resident"]["weights_device_bytes"]
                weights_gib = a.budget_gib - act / 2**30 - 0.25 if cuda else a.budget_gib
                t = time.perf_counter()
                offload.enable_pipeline(pipe, budget_gib=weights_gib, device=dev, progress=False)
                print(f"setup: enable_pipeline under {weights_gib:.2f} GiB of weights in {time.perf_counter() - t:.1f} s", flush=True)
            elif mode == "model_cpu":
                pipe.enable_model_cpu_offload()
            elif mode in ("group_block", "group_leaf"):
                kind = "block_level" if mode == "group_block" else "leaf_level"
                kw = dict(num_blocks_per_group=1) if kind == "block_level" else {}
                for name in ("transformer", "vae"):
                    getattr(pipe, name).enable_group_offload(torch.device(dev), offload_device=torch.device("cpu"), offload_type=kind,
                                                             use_stream=True, record_stream=True, **kw)
            else:
                raise SystemExit(f"--modes: {mode!r} is not one of {MODES}")
            row, img = measure(mode)
        except Exception as e:  # noqa: BLE001 - a diffusers mode that cannot run is named, not fatal
            if mode in ("resident", "offload"):
                raise
            print(f"{mode}: failed: {type(e).__name__}: {e}", flush=True)
            out[mode] = dict(failed=f"{type(e).__name__}: {str(e)[:300]}")
            continue
        finally:
            # Back to the host for the next mode.
            if mode == "offload":
                offload.disable_pipeline(pipe)
            elif mode == "model_cpu":
                pipe.remove_all_hooks()
            elif mode.startswith("group_"):
                for name in ("transformer", "vae"):
                    remove_group_offloading(getattr(pipe, name))
            pipe.to("cpu")
            if cuda:
                torch.cuda.empty_cache()
        if mode == "resident":
            ref = img
        # The image and the last step's latents, each bitwise the resident call's.
        row["bitwise_equal"] = all(bool(x.shape == r.shape and torch.equal(x, r)) for x, r in zip(img, ref))
        if mode == "offload":
            row["weights_budget_gib"] = weights_gib
        out[mode] = row
    doc = dict(commit=a.commit, gpu=torch.cuda.get_device_name() if cuda else "cpu (simulated device)",
               versions=f"diffusers {diffusers.__version__}, torch {torch.__version__}", res=a.res, steps=a.steps,
               budget_gib=a.budget_gib, modes=out)
    json.dump(doc, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
