"""A denoising loop with diffusers' FirstBlockCache over a registry model, in
one process: resident with the cache (the reference), this project's Python
package with the cache (defaults: `offload.enable(model, device=...)`, and
`offload_streamed`: every block streamed, `auto_resident_gib=0`), and
diffusers' group offloading (block level, streams on) with the cache, on the
same model object.

The loop: `--steps` Euler steps of a flow-matching sampler (the latents move by
`-(1/steps) × the model's output` each step), the timestep held at its first
value (`--schedule held`, the default) or from 1 down (`descending`). Held,
because the weights are random: under a descending schedule a random time
embedding changes the first block's residual past any threshold every step, so
the cache never answers (28 of 28 steps computed at threshold 0.2 on the
full-size Flux-dev on an H100 at 7f8bb4d, and on the tiny Flux on the CPU),
where a trained model's cache skips most steps; held, the latents' drift alone
moves the residual, and the cache skips as it does in use. The
cache enabled with `FirstBlockCacheConfig(threshold=--threshold)` in a
`cache_context`. Per mode: `--warmup` loops untimed (default 1, of
`--warmup-steps` steps, default the whole loop: first calls' set-up and the
package's automatic plan paid before), then the whole loop timed with CUDA events, each step's
time, whether each step computed its blocks (a Linear inside the last block
ran) or the cache answered, each step's output compared bitwise with the
resident loop's, and for the package each step's bytes copied (the blocks that
ran and the prefetches wasted on a skip decision). On CUDA, device memory per
mode: `weights_bytes` (resident: the model's; the package: the engine's peak
of slots and resident blocks, the blocks its automatic plan keeps, and the
module's parameters left resident), and
apart from it `before_bytes`/`peak_bytes` around the loop (its activations;
for diffusers' offloading its onloaded blocks too). A mode that fails is an
entry naming its error. The pinned host-to-device bandwidth is measured in
the same process.

    python3 cache_loop.py --registry REG.json --model flux-dev --case 1024 --out F.json
    python3 cache_loop.py --tiny --device cpu --out F.json   (a small Flux on the simulated device; --tiny wan: a small Wan)
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import zoo_anchor as za  # noqa: E402
from train_step import TINY, Clock, first, za_stats  # noqa: E402


# The tiny models `--tiny` names: Flux's (train_step.TINY), and a Wan of the
# same inputs as the registry's (16 latent channels, 4096-wide text), three
# blocks: the loop's Wan path (its timestep scale, its 5-D latents) run on the CPU.
TINIES = {"flux": TINY, "wan": {"name": "wan-tiny", "reference": {"module": "diffusers", "class": "WanTransformer3DModel", "config": {
    "attention_head_dim": 16, "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 32, "freq_dim": 32, "in_channels": 16,
    "num_attention_heads": 2, "num_layers": 3, "out_channels": 16, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads",
    "text_dim": 4096}},
    "cases": [{"name": "64x64x2", "batch": 1, "frames": 2, "height": 64, "resolution": 64, "image_tokens": 32, "text_tokens": 8}]}}


def last_linear(model):
    """A Linear inside the model's last block: it runs only where the blocks compute."""
    for name in ("single_transformer_blocks", "transformer_blocks", "blocks"):
        blocks = getattr(model, name, None)
        if blocks is not None and len(blocks):
            return next(m for m in blocks[-1].modules() if isinstance(m, torch.nn.Linear))
    raise SystemExit(f"{type(model).__name__}: no block list found")


def loop(model, x, steps, dev, scale, descending=False):
    """The denoising loop: per step its output (on the host), its time, and
    whether its blocks computed; the package's metrics per step where enabled."""
    import offload

    runs = []
    hook = last_linear(model).register_forward_hook(lambda *a: runs.append(1))
    lat = x["hidden_states"].clone()
    outs, computed, metrics, times = [], [], [], []
    clock = Clock(dev)
    evs, record, elapsed = clock.marks(steps + 1)
    clock.sync()
    if dev == "cuda":
        # Activations: the loop's peak allocated above what was allocated before it.
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    if record:
        record(evs[0])
    t_all = time.perf_counter()
    try:
        for i in range(steps):
            t = time.perf_counter()
            inp = dict(x)
            inp["hidden_states"] = lat
            inp["timestep"] = torch.full_like(x["timestep"], (1.0 - i / steps if descending else 1.0) * scale)
            n = len(runs)
            with torch.no_grad(), model.cache_context("cond"):
                out = first(model(**inp))
            lat = lat - out.to(lat.dtype) / steps
            if record:
                record(evs[i + 1])
            else:
                times.append(time.perf_counter() - t)
            computed.append(len(runs) > n)
            outs.append(out.detach().to("cpu", copy=True))
            st = offload.offloaded(model)
            metrics.append(None if st is None else {k: st.metrics()[k] for k in ("bytes_copied", "blocks", "skipped_blocks", "wasted_prefetches")})
        clock.sync()
    finally:
        hook.remove()
    total = time.perf_counter() - t_all
    if record:
        times = [elapsed(evs[i], evs[i + 1]) for i in range(steps)]
        total = elapsed(evs[0], evs[steps])
    f = torch.stack([o.float().flatten()[:1024] for o in outs])
    memory = {"before_bytes": before, "peak_bytes": torch.cuda.max_memory_allocated()} if dev == "cuda" else {}
    return {**memory, "loop_s": total, "step_s": za_stats(times), "computed": computed, "metrics": metrics,
            "finite": bool(torch.isfinite(f).all()), "not_constant": bool((f != f.flatten()[0]).any())}, outs


def measure(model, x, dev, args):
    import offload
    from diffusers import FirstBlockCacheConfig

    scale = 1000.0 if args.model.startswith("wan") else 1.0
    modes, ref = {}, None

    def run(steps=args.steps):
        return loop(model, x, steps, dev, scale, args.schedule == "descending")

    def with_cache(fn):
        model.enable_cache(FirstBlockCacheConfig(threshold=args.threshold))
        try:
            return fn()
        finally:
            model.disable_cache()

    def warm_then_timed():
        # `--warmup` loops first (`--warmup-steps` each), untimed, each with a fresh cache: the
        # first call's kernel set-up (a resident first step took 0.46–0.89 s
        # against 0.18 s for its next computed step on the H100), and the
        # package's automatic plan (its depth and kept blocks, chosen at the
        # second step, their copies), are paid once per process as in use, not
        # in the loop measured.
        for _ in range(args.warmup):
            with_cache(lambda: run(args.warmup_steps or args.steps))
        return with_cache(run)

    try:
        model.to(dev)
        r, ref = warm_then_timed()
        if dev == "cuda":
            r["weights_bytes"] = za.weights_on_device(model)
        modes["resident"] = r
    except Exception as e:
        modes["resident"] = za.error_entry(e)
    za.mark("resident")
    model.to("cpu")
    if dev == "cuda":
        torch.cuda.empty_cache()
    print("resident", json.dumps({k: v for k, v in modes["resident"].items() if k not in ("traceback", "metrics")})[:400], flush=True)

    def judged(r, outs):
        if ref is not None:
            r["bitwise_equal_steps"] = [torch.equal(a, b) for a, b in zip(outs, ref)]
            r["same_cache_decisions"] = r["computed"] == modes["resident"]["computed"]
        return r

    # The package with its defaults (the automatic plan may keep blocks resident
    # where a step is host-bound, as a cached step is), and with every block
    # streamed (auto_resident_gib=0): the ring's slots alone on the device.
    for mode, kw in (("offload", {}), ("offload_streamed", {"auto_resident_gib": 0})):
        if mode not in args.modes:
            continue
        try:
            h = offload.enable(model, device=dev, **kw)
            try:
                r, outs = warm_then_timed()
                r["plan"] = h.plan()
                if dev == "cuda":
                    # Weights on the device: the engine's slots and resident blocks
                    # (their peak), the blocks the automatic plan keeps outside the
                    # ring, and the module's own parameters left resident (not the
                    # streamed placeholders, not the kept blocks' views).
                    met = h.metrics()
                    r["kept_bytes"] = met["kept_bytes"]
                    r["engine_weight_bytes"] = met["peak_device_weight_bytes"] + met["kept_bytes"]
                    r["module_weight_bytes"] = za.weights_on_device(model)
                    r["weights_bytes"] = r["engine_weight_bytes"] + r["module_weight_bytes"]
                modes[mode] = judged(r, outs)
            finally:
                offload.disable(model)
        except Exception as e:
            modes[mode] = za.error_entry(e)
        za.mark(mode)
        print(mode, json.dumps({k: v for k, v in modes[mode].items() if k not in ("traceback", "metrics")})[:600], flush=True)

    if dev == "cuda" and "block_stream" in args.modes:
        modes["block_stream"] = za.group_offloaded(model, args.model, lambda: judged(*warm_then_timed()))
        za.mark("block_stream")
        print("block_stream", json.dumps({k: v for k, v in modes["block_stream"].items() if k not in ("traceback", "metrics")})[:400], flush=True)
    return modes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry")
    ap.add_argument("--model", default="flux-dev")
    ap.add_argument("--case", default=None, help="the case's name (default: the first)")
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--threshold", type=float, default=0.2, help="FirstBlockCache's threshold (diffusers' docs use 0.2)")
    ap.add_argument("--schedule", default="held", choices=["held", "descending"],
                    help="the timestep held at its first value (random weights: see above) or from 1 down")
    ap.add_argument("--warmup", type=int, default=1, help="loops run untimed before the timed one, per mode")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="steps of each warm-up loop (default: the loop's; three are enough for the first calls' set-up "
                         "and the automatic plan, chosen at the second step: Wan 14B's loop is minutes)")
    ap.add_argument("--modes", default="resident,offload,offload_streamed,block_stream")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", nargs="?", const="flux", default=None, choices=sorted(TINIES),
                    help="a tiny model of that class with random weights (flux when named alone): the loop on the CPU")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    entry = TINIES[args.tiny] if args.tiny else next(m for m in json.load(open(args.registry)) if m["name"] == args.model)
    args.model = entry["name"]
    # Mode names by the list's items (as a string, "offload" was found in "offload_streamed").
    args.modes = args.modes.split(",")
    case = next(c for c in entry["cases"] if args.case in (None, c["name"]))
    dev = args.device
    import diffusers

    doc = {"what": "a denoising loop with FirstBlockCache (bench/anchors/cache_loop.py)", "model": entry["name"], "case": case,
           "steps": args.steps, "warmup": args.warmup, "warmup_steps": args.warmup_steps or args.steps, "threshold": args.threshold, "schedule": args.schedule, "device": dev,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else "none", "torch": torch.__version__,
           "diffusers": diffusers.__version__, "commit": os.environ.get("OFFLOAD_COMMIT", "unknown"), "pid": os.getpid(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    za.mark("imported")
    doc["bandwidth_bytes_per_s"] = za.h2d_bandwidth() if dev == "cuda" else None
    model = za.build(entry["reference"], device=dev)
    x = za.inputs(entry["name"].replace("-tiny", "-dev"), case, dev)
    za.mark("built")
    doc["modes"] = measure(model, x, dev, args)
    doc["phases_s"] = za.PHASES
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
