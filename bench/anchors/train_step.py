"""A LoRA training step over a registry model, in one process: the resident
step (the reference), this project's Python package, and diffusers' group
offloading (block level, streams on) on the same model object, each from the
same adapters and optimizer state, one model and case a process.

The step: a rank-16 LoRA (peft, `add_adapter`) on the attention projections
(`to_q`, `to_k`, `to_v`, `to_out.0`), the base frozen, AdamW on the adapters;
forward, `out.float().square().mean()`, backward, optimizer step. With
`--checkpointing`, diffusers' `enable_gradient_checkpointing()`.

Per mode: a check step from the initial adapters (its loss and every adapter
gradient compared with the resident check step, bitwise, and the largest
difference), then `--warmup` steps and `--steps` timed with CUDA events. The
resident check step runs twice: where the two differ (an attention backward
that accumulates in any order), the run says so and a mode is judged against
that spread. After ours' timed steps, one more forward and backward with
the streams traced (`--trace 1`, the default): each pass's `diagnose()` (why
it was slower than its bound) in the file as `diagnosed`. `--deterministic`:
`torch.use_deterministic_algorithms(True)` and PyTorch's math attention; `--attention`: SDPA's backend alone (`math`,
`cudnn`, ...), recorded in the file. A mode that breaks the process's CUDA
context (an illegal address in a library's kernel) is named with
`context_lost`, and the file is written with what ran. Memory as in `zoo_anchor.py`: weights on the device
apart from the step's activations (peak allocated above what was allocated
before the timed steps). Bytes crossing the link in a step: the engine's
metrics of the last forward and the last backward. The pinned host-to-device
bandwidth is measured in the same process. A mode that fails (out of memory,
a library's error) is an entry naming its error, never a silent gap.

    python3 train_step.py --registry REG.json --model flux-dev --case 1024 --out F.json [--checkpointing]
    python3 train_step.py --tiny --device cpu --out F.json   (a small Flux on the simulated device: the script's own check)

`train_merge.py` merges the process files.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import zoo_anchor as za  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
RANK = 16

# A small Flux for `--tiny` (the registry's inputs: 64 latent channels, 4096-wide text).
TINY = {"name": "flux-tiny", "reference": {"module": "diffusers", "class": "FluxTransformer2DModel", "config": {
    "attention_head_dim": 16, "axes_dims_rope": [4, 6, 6], "guidance_embeds": True, "in_channels": 64, "joint_attention_dim": 4096,
    "num_attention_heads": 2, "num_layers": 2, "num_single_layers": 2, "patch_size": 1, "pooled_projection_dim": 768}},
    "cases": [{"name": "64", "batch": 1, "frames": 1, "height": 64, "resolution": 64, "image_tokens": 16, "text_tokens": 8}]}


# SDPA's backends by the names `--attention` takes ("default": torch's own choice).
BACKENDS = {"default": None, "math": "MATH", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def attention(args):
    """The SDPA backend every mode runs under: `--attention`, or math with `--deterministic`."""
    import contextlib

    name = BACKENDS["math" if args.deterministic else args.attention]
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name))


def first(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "sample", out)


def add_lora(model):
    """The base frozen, a rank-16 LoRA on the attention projections with seeded
    random weights (peft starts B at zero); its initial state, to start every mode from."""
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS))
    g = torch.Generator(device="cpu").manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def reset(model, initial):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in initial:
                p.copy_(initial[n].to(p.device))
            p.grad = None


class Clock:
    """CUDA events on a GPU, the host's clock on the simulated device."""

    def __init__(self, dev):
        self.cuda = dev == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def marks(self, n):
        if self.cuda:
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            return evs, lambda e: e.record(), lambda a, b: a.elapsed_time(b) / 1e3
        return [None] * n, None, None


def one_step(model, x, opt):
    opt.zero_grad(set_to_none=True)
    loss = first(model(**x)).float().square().mean()
    loss.backward()
    opt.step()
    return loss


def run_mode(model, x, initial, dev, warmup, steps):
    """The check step (loss, adapter gradients on the host) from the initial
    adapters, then the timed steps from them again."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    reset(model, initial)
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    loss = one_step(model, x, opt)
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    check = (float(loss.detach()), grads)
    reset(model, initial)
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    for _ in range(warmup):
        one_step(model, x, opt)
    clock = Clock(dev)
    clock.sync()
    before = torch.cuda.memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    evs, record, elapsed = clock.marks(steps + 1)
    if record:
        record(evs[0])
    for i in range(steps):
        t = time.perf_counter()
        losses.append(one_step(model, x, opt))
        if record:
            record(evs[i + 1])
        else:
            times.append(time.perf_counter() - t)
    clock.sync()
    if record:
        times = [elapsed(evs[i], evs[i + 1]) for i in range(steps)]
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else 0
    losses = [float(v) for v in losses]
    return check, {"step": za_stats(times), "losses": losses, "finite": all(v == v and abs(v) != float("inf") for v in losses),
                   "not_constant": len(set(losses)) > 1, "peak_bytes": peak, "before_bytes": before}


def za_stats(ts):
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "runs_s": ts}


def compare(check, ref):
    (la, ga), (lb, gb) = check, ref
    diffs = [float((ga[n].float() - gb[n].float()).abs().max()) for n in ga]
    return {"loss_equal": la == lb, "grads_bitwise_equal": all(torch.equal(ga[n], gb[n]) for n in ga),
            "max_abs_grad_diff": max(diffs) if diffs else 0.0}


def spread_of(checks):
    """`compare` over every pair of `checks` (the resident runs from one
    state): equal only where every pair is, the largest difference of any pair."""
    pairs = [compare(a, b) for i, a in enumerate(checks) for b in checks[i + 1:]]
    return {"loss_equal": all(p["loss_equal"] for p in pairs),
            "grads_bitwise_equal": all(p["grads_bitwise_equal"] for p in pairs),
            "max_abs_grad_diff": max(p["max_abs_grad_diff"] for p in pairs), "runs": len(checks)}


def context_lost(e: BaseException) -> bool:
    """Whether `e` is a CUDA error that may leave the process's CUDA context
    unusable (an illegal address, a kernel's failure; any `AcceleratorError`,
    erring on the side of running nothing more on it): no later mode runs."""
    text = f"{type(e).__name__}: {e}"
    return type(e).__name__ == "AcceleratorError" or "illegal memory access" in text or "EXECUTION_FAILED" in text


DIAGNOSED = ("summary", "verdict", "causes", "step_s", "compute_s", "wait_s", "between_s", "host_s", "link_gbps")


def traced_step(model, x, h, bandwidth, calibrate=False):
    """One more forward and backward with the streams timed (no optimizer
    step): why each pass was slower than its own bound (`Offloaded.diagnose`,
    the forward's read when the forward returns, the backward's when it ends),
    or the error that refused it (every block kept resident: nothing copied).
    With `calibrate`, also `Offloaded.calibration()` read from this step
    (before the trace stops: stopping drops the recorded steps), or the error
    that refused it, as (diagnosed, calibration or None, error or None)."""
    import offload

    link = bandwidth / 1e9 if bandwidth else None
    out = {}
    for p in model.parameters():
        p.grad = None
    h.enable_trace()
    try:
        loss = first(model(**x)).float().square().mean()
        for name, run in (("forward", None), ("backward", loss.backward)):
            if run is not None:
                run()
            try:
                d = h.diagnose(link_gbps=link)
                out[name] = {k: d[k] for k in DIAGNOSED if k in d}
            except offload.OffloadError as e:
                out[name] = {"error": f"{type(e).__name__}: {e}"}
        cal, refused = None, None
        if calibrate:
            try:
                cal = h.calibration()
            except offload.OffloadError as e:
                refused = f"{type(e).__name__}: {e}"
    finally:
        h.disable_trace()
        for p in model.parameters():
            p.grad = None
    return (out, cal, refused) if calibrate else out


def ours_mode(model, x, initial, dev, args, bandwidth, ref, modes, key, enable_kw, calibrate):
    """This package's mode `key`, enabled with `enable_kw`, measured into
    `modes[key]`; with `calibrate`, the traced step's cost model is returned
    (`Offloaded.calibration`: each block's forward and backward time) for a
    plan under a budget."""
    import offload

    cal = None
    try:
        h = offload.enable(model, device=dev, **enable_kw)
        check, r = run_mode(model, x, initial, dev, args.warmup, args.steps)
        fwd, bwd = h.metrics("forward"), h.metrics("backward")
        r["bytes_per_step"] = fwd["bytes_copied"] + bwd["bytes_copied"]
        r["forward"], r["backward"] = fwd, bwd
        r["plan"] = h.plan()
        # The ring's slots and resident blocks, and the blocks the automatic plan keeps outside it.
        r["device_weight_bytes"] = bwd.get("peak_device_weight_bytes") + bwd.get("kept_bytes", 0)
        r["adapter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if calibrate:
            r["diagnosed"], cal, refused = traced_step(model, x, h, bandwidth, calibrate=True)
            if refused:
                r["calibration_error"] = refused
            else:
                # Each block's bytes and traced forward and backward times: what
                # the plan below replays, kept for replays off the device.
                r["calibration"] = cal
        elif args.trace:
            r["diagnosed"] = traced_step(model, x, h, bandwidth)
        if ref is not None:
            r["vs_resident"] = compare(check, ref)
        offload.disable(model)
        modes[key] = r
        za.mark(key)
    except Exception as e:
        modes[key] = za.error_entry(e)
        try:
            offload.disable(model)
        except Exception:
            pass
        if context_lost(e):
            modes[key]["context_lost"] = True
            print(key, modes[key]["error"], flush=True)
            return None
    print(key, json.dumps({k: v for k, v in modes[key].items() if k not in ("traceback", "forward", "backward")})[:600], flush=True)
    return cal


def measure(model, x, dev, args, bandwidth, modes):
    """The modes measured into `modes`, each as it ends (so a process whose
    CUDA context a library's kernel broke still leaves what ran)."""
    initial = add_lora(model)
    if args.checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    ref = None
    # The reference: resident, three times from the same state (is its backward
    # repeatable? where not, its spread over the three is what ours is held to).
    try:
        model.to(dev)
        ref, res = run_mode(model, x, initial, dev, args.warmup, args.steps)
        again = [run_mode(model, x, initial, dev, 0, 1)[0] for _ in range(2)]
        res["repeatable"] = spread_of([ref, *again])
        res["weights_bytes"] = za.weights_on_device(model) if dev == "cuda" else 0
        res["activations_bytes"] = max(0, res["peak_bytes"] - res["before_bytes"])
        modes["resident"] = res
        za.mark("resident")
    except Exception as e:  # out of memory, a library's own error: named
        modes["resident"] = za.error_entry(e)
        if context_lost(e):
            # The reference's own kernels broke the context: nothing else runs here.
            modes["resident"]["context_lost"] = True
            print("resident", modes["resident"]["error"], flush=True)
            return modes
    model.to("cpu")
    if dev == "cuda":
        torch.cuda.empty_cache()
    print("resident", json.dumps({k: v for k, v in modes["resident"].items() if k != "traceback"})[:400], flush=True)

    depth = None if args.depth == "auto" else int(args.depth)
    cal = ours_mode(model, x, initial, dev, args, bandwidth, ref, modes, "offload", dict(depth=depth),
                    calibrate=args.budget_gib is not None)
    if modes["offload"].get("context_lost"):
        return modes
    if args.budget_gib is not None:
        # The package planned under a device budget from the traced training
        # step above (both passes replayed): the blocks whose copies the step
        # waited for kept resident, as trainers' block swap keeps some blocks.
        if cal is None:
            why = modes["offload"].get("calibration_error", modes["offload"].get("error", "no step traced"))
            modes["offload_planned"] = {"error": f"no calibration from the ring above: {why}"}
        else:
            ours_mode(model, x, initial, dev, args, bandwidth, ref, modes, "offload_planned",
                      dict(depth=depth or 2, budget_gib=args.budget_gib, calibration=cal), calibrate=False)
            modes["offload_planned"]["budget_gib"] = args.budget_gib
            if modes["offload_planned"].get("context_lost"):
                return modes

    if dev == "cuda" and "block_stream" in args.modes:
        def group_step():
            check, r = run_mode(model, x, initial, dev, args.warmup, args.steps)
            if ref is not None:
                r["vs_resident"] = compare(check, ref)
            return r
        modes["block_stream"] = za.group_offloaded(model, args.model, group_step)
        za.mark("block_stream")
        print("block_stream", json.dumps({k: v for k, v in modes["block_stream"].items() if k != "traceback"})[:400], flush=True)
    return modes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--registry")
    ap.add_argument("--model", default="flux-dev")
    ap.add_argument("--case", default=None, help="the case's name (default: the first)")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--attention", default="default", choices=sorted(BACKENDS),
                    help="SDPA's backend for every mode (`--deterministic` implies math)")
    ap.add_argument("--depth", default="2", help="the ring's depth, or auto (the package's choice from a traced training step)")
    ap.add_argument("--modes", default="resident,offload,block_stream")
    ap.add_argument("--budget-gib", type=float, default=None,
                    help="also the package planned under this device budget (GiB of weights) from the ring's traced "
                         "training step (`enable(budget_gib=, calibration=)`): mode offload_planned")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", type=int, default=1, help="1: after ours' timed steps, one more traced forward and backward, each "
                    "pass diagnosed (Offloaded.diagnose) into the file; 0: none")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.deterministic and args.attention not in ("default", "math"):
        ap.error("--deterministic runs math attention: give no other --attention")
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    entry = TINY if args.tiny else next(m for m in json.load(open(args.registry)) if m["name"] == args.model)
    args.model = entry["name"]
    case = next(c for c in entry["cases"] if args.case in (None, c["name"]))
    dev = args.device
    import diffusers
    import peft

    doc = {"what": "a LoRA training step (bench/anchors/train_step.py)", "model": entry["name"], "case": case,
           "checkpointing": args.checkpointing, "deterministic": args.deterministic,
           "attention": "math" if args.deterministic else args.attention, "depth": args.depth if args.depth == "auto" else int(args.depth), "rank": RANK,
           "budget_gib": args.budget_gib,
           "targets": TARGETS, "warmup": args.warmup, "steps": args.steps, "device": dev,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else "none", "torch": torch.__version__,
           "diffusers": diffusers.__version__, "peft": peft.__version__,
           "commit": os.environ.get("OFFLOAD_COMMIT", "unknown"), "pid": os.getpid(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    za.mark("imported")
    doc["bandwidth_bytes_per_s"] = za.h2d_bandwidth() if dev == "cuda" else None
    model = za.build(entry["reference"], device=dev)
    x = za.inputs(entry["name"].replace("-tiny", "-dev"), case, dev)
    za.mark("built")
    doc["modes"] = {}
    try:
        with attention(args):
            measure(model, x, dev, args, doc["bandwidth_bytes_per_s"], doc["modes"])
    except Exception as e:  # the file still says what ran, and what broke
        doc["error"] = za.error_entry(e)
    doc["phases_s"] = za.PHASES
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
