"""Issue 32's host RAM at 1 x, through the Python package: a model object built on
the meta device, its weights served from a safetensors checkpoint's pages.

    py_start.py write --registry R --model flux-dev --checkpoint CKPT
        the checkpoint, random weights as zoo_anchor.build makes them (one process;
        the start processes find it in the page cache)
    py_start.py run --registry R --model flux-dev --checkpoint CKPT --out F
        one process: the model built on the meta device, then timed from
        `offload.enable(model, checkpoint=CKPT)` to the end of its first streamed
        step, host memory beyond the page cache (RssAnon + RssShmem) read there;
        then more streamed steps, the resident model loaded from the same file and
        its steps, its output against the first streamed step's, bit for bit
    py_start.py merge --date D --out F RUN.json...
        medians with min and max over the processes, the targets judged by code:
        start <= 2 s, host memory beyond the page cache <= 1 GiB, every block
        served in place, bitwise equal
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

START_TARGET_S = 2.0
RSS_TARGET_BYTES = 1 << 30


def rss_beyond_page_cache() -> int:
    """This process's resident memory that is not file pages (RssAnon + RssShmem), bytes; 0 where unknown."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    except OSError:
        return 0
    kib = lambda k: int(fields.get(k, "0 kB").split()[0])  # noqa: E731
    return (kib("RssAnon") + kib("RssShmem")) * 1024


def dirty_and_writeback() -> tuple[int, int]:
    """The machine's page-cache bytes not yet written to disk and being written
    (/proc/meminfo `Dirty`, `Writeback`); (0, 0) where unknown. A start just after
    the checkpoint was written can share the disk with its write-back."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return 0, 0
    kib = lambda k: int(fields.get(k, "0 kB").split()[0]) * 1024  # noqa: E731
    return kib("Dirty"), kib("Writeback")


# The phases of the start each run records since 83fb05d (whose first process
# missed the 2 s target with no way to tell where the time went): the host's
# time in `enable` (the file opened, registered, the hooks placed; device work
# it queued runs on into the next phase, not drained here, so the start is
# timed as before) and from its return to the end of the first streamed step;
# with the page cache's dirty and write-back bytes when `enable` began.
PHASES = ("enable_s", "first_step_s", "dirty_bytes_at_enable", "writeback_bytes_at_enable")


def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def merge(runs: list[dict], files: list[str], date: str, min_runs: int = 3) -> dict:
    """The results file of `runs` (read from `files`, named in it): refused unless
    there are `min_runs`, all of one model, case, commit and checkpoint size."""
    if len(runs) < min_runs:
        raise SystemExit(f"py_start merge: {len(runs)} run(s), at least {min_runs} wanted")
    head = lambda r: (r["model"], r["case"], r["commit"], r["file_bytes"])  # noqa: E731
    for r, f in zip(runs, files):
        if head(r) != head(runs[0]):
            raise SystemExit(f"py_start merge: {f} is {head(r)}, {files[0]} is {head(runs[0])}: merge runs of one model, commit and file")
    per_run = []
    for r in runs:
        streamed = statistics.median(r["steps_streamed_s"])
        resident = statistics.median(r["steps_resident_s"])
        bound = max(resident, r["step_bytes"] / r["bandwidth_bytes_per_s"])
        per_run.append(dict(start_s=r["start_s"], rss=r["host_rss_first_step_bytes"], streamed=streamed, resident=resident,
                            ratio=streamed / bound))
    col = lambda k: spread([p[k] for p in per_run])  # noqa: E731
    start, rss = col("start_s"), col("rss")
    # Runs made before the phases were recorded carry none: the file then has none.
    phases = {k: spread([r[k] for r in runs]) for k in PHASES} if all(k in r for r in runs for k in PHASES) else {}
    if phases and any(abs(r["enable_s"] + r["first_step_s"] - r["start_s"]) > 1e-3 for r in runs):
        raise SystemExit("py_start merge: a run's enable_s + first_step_s is not its start_s")
    in_place = all(r["in_place"] > 0 and r["copied"] == 0 for r in runs)
    bitwise = all(r["bitwise_equal"] and r["output_finite"] and r["output_nonconstant"] for r in runs)
    targets = {
        "start_within_2_s": start["max"] <= START_TARGET_S,
        "host_rss_within_1_gib": rss["max"] <= RSS_TARGET_BYTES and rss["min"] > 0,
        "every_block_in_place": in_place,
        "bitwise_equal": bitwise,
    }
    r0 = runs[0]
    gbps = statistics.median(r["bandwidth_bytes_per_s"] for r in runs) / 1e9
    resident_s, streamed_s = col("resident")["median"], col("streamed")["median"]
    bound_s = max(resident_s, r0["step_bytes"] / (gbps * 1e9))
    # The results file's common fields (DESIGN.md, Benchmark results): the one
    # case, medians over the processes; the start's own figures follow.
    case = dict(model=r0["model"], case=r0["case"], resolution=int(r0["case"]), batch=1, depth=1, budget_bytes=None, step_resident_s=resident_s,
                step_streamed_s=streamed_s, bandwidth_gbps=gbps, streamed_bytes=r0["step_bytes"], bound_s=bound_s,
                ratio_to_bound=streamed_s / bound_s, peak_device_bytes=None, bitwise_equal=bitwise)
    return {
        "generated_by": "bench/anchors/py_start.py merge",
        "date": date,
        "commit": r0["commit"],
        "gpu": r0["gpu"],
        "backend": "python",
        "versions": r0["versions"],
        "model": r0["model"],
        "cases": [case],
        "case": r0["case"],
        "file_bytes": r0["file_bytes"],
        "processes": len(runs),
        "runs": files,
        "start_s": start,
        **({"start_phases": phases} if phases else {}),
        "host_rss_first_step_bytes": rss,
        "host_rss_before_enable_bytes": spread([r["host_rss_before_enable_bytes"] for r in runs]),
        "step_streamed_s": col("streamed"),
        "step_resident_s": col("resident"),
        "ratio_to_bound": col("ratio"),
        "in_place": r0["in_place"],
        "copied": r0["copied"],
        "copy_reason": r0["copy_reason"],
        "bitwise_equal": bitwise,
        "targets": targets,
        "meets_targets": all(targets.values()),
        "method": "start_s: from offload.enable(model, checkpoint=...) on a model built on the meta device to the end of its "
                  "first streamed step (inputs made before); host_rss_first_step_bytes: RssAnon + RssShmem then (the process's "
                  "own memory: torch, the CUDA context, the resident tensors; not the checkpoint's page-cache pages); "
                  "ratio_to_bound: the median streamed step over max(resident step, bytes a step / the engine's probed bandwidth); "
                  "cases[0]: the common fields from the medians (its ratio_to_bound the median streamed step over the bound of "
                  "the median resident step and bandwidth, so it may differ from the median of the processes' ratios above); "
                  "its peak_device_bytes not read by this bench (null)",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("write", "run", "merge"))
    ap.add_argument("--registry")
    ap.add_argument("--model", default="flux-dev")
    ap.add_argument("--case", default="1024")
    ap.add_argument("--checkpoint")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: the simulated device (a dry run of this script, as CI makes it)")
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

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from zoo_anchor import build, inputs

    spec = next(m for m in json.load(open(a.registry)) if m["name"] == a.model)
    ref = spec["reference"]
    if a.what == "write":
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        m = build(ref, a.device)
        state = {k: v.detach().to("cpu").contiguous() for k, v in m.state_dict().items()}
        del m
        save_file(state, a.checkpoint)
        print(f"setup: {a.checkpoint} written ({os.path.getsize(a.checkpoint) / 2**30:.2f} GiB) in {time.perf_counter() - t0:.1f} s", flush=True)
        return

    import importlib

    import diffusers
    import offload

    case = next(c for c in spec["cases"] if c["name"] == a.case)
    dev = a.device
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = inputs(a.model, case, dev)
    cls = getattr(importlib.import_module(ref["module"]), ref["class"])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = cls(**ref["config"]).eval()
    torch.set_default_dtype(torch.float32)
    sync()
    before = rss_beyond_page_cache()
    # The model object exists: from here to the end of the first streamed step.
    dirty, writeback = dirty_and_writeback()
    t0 = time.perf_counter()
    h = offload.enable(model, device=dev, checkpoint=a.checkpoint, progress=False)
    t1 = time.perf_counter()
    with torch.no_grad():
        first = model(**x)[0]
    sync()
    t2 = time.perf_counter()
    start = t2 - t0
    rss = rss_beyond_page_cache()
    tier = h.host_tier()
    first = first.detach().cpu()
    print(f"start: {start:.3f} s to the first streamed step ({t1 - t0:.3f} s enable, {t2 - t1:.3f} s the step; "
          f"{dirty / 2**30:.2f} GiB dirty, {writeback / 2**30:.2f} GiB in write-back at enable), host memory beyond the page cache {rss / 2**30:.2f} GiB "
          f"({before / 2**30:.2f} before enable), blocks in place {tier['in_place']}, copied {tier['copied']}"
          f"{' (' + tier['copy_reason'] + ')' if tier['copy_reason'] else ''}", flush=True)

    def timed(steps):
        with torch.no_grad():
            model(**x)
            if not cuda:
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    out = model(**x)[0]
                    times.append(time.perf_counter() - t)
                return times, out
            evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            evs[0].record()
            for i in range(steps):
                out = model(**x)[0]
                evs[i + 1].record()
        torch.cuda.synchronize()
        return [evs[i].elapsed_time(evs[i + 1]) / 1e3 for i in range(steps)], out

    streamed, last = timed(a.steps)
    last = last.detach().cpu()
    step_bytes = h.metrics()["bytes_copied"]
    bandwidth = h.probe_bandwidth(3)
    offload.disable(model)
    # The resident model from the same file, on the device whole.
    from safetensors.torch import load_file

    model = model.to_empty(device=dev)
    model.load_state_dict(load_file(a.checkpoint, device=dev))
    resident, out = timed(a.steps)
    out = out.detach().cpu()
    # Finite and varied, on the streamed outputs (the first step's and the last
    # timed one's), each bitwise the resident output.
    fs = [first.float(), last.float()]
    row = dict(model=a.model, case=a.case, commit=a.commit, gpu=torch.cuda.get_device_name() if cuda else "cpu (simulated device)",
               versions=f"diffusers {diffusers.__version__}, torch {torch.__version__}", file_bytes=os.path.getsize(a.checkpoint),
               start_s=start, enable_s=t1 - t0, first_step_s=t2 - t1, dirty_bytes_at_enable=dirty,
               writeback_bytes_at_enable=writeback, host_rss_before_enable_bytes=before, host_rss_first_step_bytes=rss, in_place=tier["in_place"],
               copied=tier["copied"], copy_reason=tier["copy_reason"], steps_streamed_s=streamed, steps_resident_s=resident,
               step_bytes=step_bytes, bandwidth_bytes_per_s=bandwidth,
               bitwise_equal=bool(torch.equal(out, first) and torch.equal(out, last)),
               output_finite=all(bool(torch.isfinite(f).all()) for f in fs),
               output_nonconstant=all(bool((f != f.flatten()[0]).any()) for f in fs))
    print(f"streamed {statistics.median(streamed):.4f} s, resident {statistics.median(resident):.4f} s, "
          f"bitwise {row['bitwise_equal']}", flush=True)
    json.dump(row, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
