"""Where a streamed step's host time goes (the sweep's host-bound
rows): for each model named (bench/anchors/sweep.py's), the host's time to
issue one step resident and streamed (the device synchronised before, not
after: the call's own time), each the median of five, then one streamed step
under cProfile (its 25 costliest functions by own time). One process, JSON.

    python3 host_cost.py OUT.json --models ltx-video,lumina2
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep  # noqa: E402


def host_times(m, x, n=5):
    out = []
    with torch.no_grad():
        for _ in range(2):
            m(**x)
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            m(**x)
            out.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return out


class _GcClock:
    """Time spent in Python's garbage collector, per generation, while on."""

    def __init__(self):
        self.s = {0: 0.0, 1: 0.0, 2: 0.0}
        self.n = {0: 0, 1: 0, 2: 0}
        self._t = None

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            g = info["generation"]
            self.s[g] += time.perf_counter() - self._t
            self.n[g] += 1
            self._t = None


def loop_s(m, x, n=10, collect=True):
    """Steady-state step: ``n`` steps back to back (the host may run ahead), the
    wall time over ``n``; and the garbage collector's time in them per generation."""
    import gc

    clock = _GcClock()
    with torch.no_grad():
        for _ in range(2):
            m(**x)
        torch.cuda.synchronize()
        if not collect:
            gc.disable()
        gc.callbacks.append(clock)
        try:
            t = time.perf_counter()
            for _ in range(n):
                m(**x)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / n
        finally:
            gc.callbacks.remove(clock)
            gc.enable()
    return {"step_s": wall, "gc_s": {str(k): v / n for k, v in clock.s.items()}, "gc_n": {str(k): v for k, v in clock.n.items()}}


def op_table(m, x) -> str:
    """One step under torch's profiler: its CPU ops by count and self time."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        m(**x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            m(**x)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=40)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--models", default="ltx-video")
    a = ap.parse_args()
    import offload

    res = {"gpu": torch.cuda.get_device_name(), "commit": os.environ.get("OFFLOAD_COMMIT", "?"), "models": {}}
    for name in a.models.split(","):
        x = sweep.inputs(name, "cuda")
        m = sweep.build(name, "cuda")
        r = {"resident_host_s": host_times(m, x)}
        r["resident_loop"] = loop_s(m, x)
        r["resident_loop_nogc"] = loop_s(m, x, collect=False)
        r["resident_ops"] = op_table(m, x)
        m.to("cpu")
        h = offload.enable(m, device="cuda")
        r["offload_host_s"] = host_times(m, x)
        r["offload_loop"] = loop_s(m, x)
        r["offload_loop_nogc"] = loop_s(m, x, collect=False)
        print(name, {k: r[k] for k in r if "loop" in k}, flush=True)
        r["plan"] = h.plan()
        r["offload_ops"] = op_table(m, x)
        print(name, "resident ops\n", r["resident_ops"][:2500], "\noffload ops\n", r["offload_ops"][:2500], flush=True)
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        with torch.no_grad():
            prof.enable()
            m(**x)
            prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        r["profile"] = s.getvalue()
        # The package's own functions and the engine's methods, by cumulative time.
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(r"offload|Streamer|torch/cuda|_tensor\.py", 30)
        r["profile_package"] = s.getvalue()
        offload.disable(m)
        r["blocks"] = sum(len(m.get_submodule(p)) for p in offload.find_blocks(m))
        res["models"][name] = r
        print(name, {k: statistics.median(v) for k, v in r.items() if k.endswith("_s")}, flush=True)
        print(r["profile"][:3000], flush=True)
        print(r["profile_package"][:4000], flush=True)
        del m
        torch.cuda.empty_cache()
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
