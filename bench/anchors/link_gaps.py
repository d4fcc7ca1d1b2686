"""Do kernels start late while a host-to-device copy holds the link?

Wan 2.1 at 21 frames (bench/NOTES.md, twenty-sixth session) showed 5–20 µs gaps
between kernels, most of them while a block's copy ran. This runs one chain of
short kernels on torch's current stream, timed by CUDA events, in each of:

- alone;
- beside one large pinned host-to-device copy on another stream (a block's copy);
- beside the same bytes as copies of CHUNK MiB each, issued back to back;

each REPEATS times, alternating, and writes the medians and every run to --out.
The device sleeps first while the host queues the chain, so the chain runs at
the device's pace; the copy outlasts sleep and chain (checked per run), so the
whole chain runs while the link is busy.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def chain(x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        x.add_(1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=1000, help="kernels in the chain")
    ap.add_argument("--elements", type=int, default=16 << 20, help="elements each kernel touches (bf16; ~15 µs a kernel on an H200)")
    ap.add_argument("--copy-gib", type=float, default=4.0)
    ap.add_argument("--chunk-mib", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--profile", action="store_true",
                    help="also one run of each mode under torch's profiler: per stream its gaps between kernels, "
                         "the device's and the host's (zoo_anchor.stream_summary), in --out under 'profiled'")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.zeros(a.elements, dtype=torch.bfloat16, device=dev)
    nbytes = int(a.copy_gib * 2**30)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream(device=dev)
    chunk = a.chunk_mib << 20

    def run(mode: str) -> dict:
        torch.cuda.synchronize()
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        k0, k1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if mode != "alone":
            with torch.cuda.stream(side):
                c0.record()
                if mode == "one copy":
                    dst.copy_(src, non_blocking=True)
                else:
                    for off in range(0, nbytes, chunk):
                        dst[off : off + chunk].copy_(src[off : off + chunk], non_blocking=True)
                c1.record()
        # The host queues the chain while the device sleeps: the chain then runs at
        # the device's pace, not the host's launches'.
        torch.cuda._sleep(50_000_000)
        k0.record()
        chain(x, a.kernels)
        k1.record()
        torch.cuda.synchronize()
        r = {"chain_ms": k0.elapsed_time(k1)}
        if mode != "alone":
            r["copy_ms"] = c0.elapsed_time(c1)
            r["copy_gbps"] = nbytes / (r["copy_ms"] / 1e3) / 1e9
            # The chain ran inside the copy only if the copy ended after it.
            r["chain_inside_copy"] = c0.elapsed_time(k1) < r["copy_ms"]
        return r

    modes = ["alone", "one copy", f"{a.chunk_mib} MiB copies"]
    for m in modes:  # warm-up
        run(m)
    runs = {m: [] for m in modes}
    for _ in range(a.repeats):
        for m in modes:
            runs[m].append(run(m))
    alone = statistics.median(r["chain_ms"] for r in runs["alone"])
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": a.kernels, "elements": a.elements,
           "copy_bytes": nbytes, "chunk_bytes": chunk, "repeats": a.repeats, "modes": {}}
    for m in modes:
        med = statistics.median(r["chain_ms"] for r in runs[m])
        row = {"chain_ms_median": med, "chain_ms_min": min(r["chain_ms"] for r in runs[m]),
               "chain_ms_max": max(r["chain_ms"] for r in runs[m]), "us_per_kernel_above_alone": (med - alone) * 1e3 / a.kernels,
               "runs": runs[m]}
        if m != "alone":
            row["copy_gbps_median"] = statistics.median(r["copy_gbps"] for r in runs[m])
            row["chain_inside_copy_every_run"] = all(r["chain_inside_copy"] for r in runs[m])
        out["modes"][m] = row
        print(f"{m}: chain {med:.3f} ms ({row['us_per_kernel_above_alone']:+.2f} µs a kernel against alone)"
              + (f", copy {row['copy_gbps_median']:.1f} GB/s, chain inside the copy: {row['chain_inside_copy_every_run']}" if m != "alone" else ""),
              flush=True)
    if a.profile:
        import os
        import sys
        import tempfile

        from torch.profiler import ProfilerActivity, profile

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from zoo_anchor import stream_summary

        out["profiled"] = {}
        for m in modes:
            # CUDA activity only (it carries the launch calls' records): the host
            # queues the chain as fast as unprofiled, inside the device's sleep.
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                r = run(m)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                prof.export_chrome_trace(f.name)
                summary = stream_summary(json.load(open(f.name)), gap_us=2.0)
            chain_stream = max(summary.values(), key=lambda v: v["kernels"])
            out["profiled"][m] = {"run": r, **{k: v for k, v in chain_stream.items() if k != "top_us"}}
            inside = f", chain inside the copy: {r['chain_inside_copy']}" if m != "alone" else ""
            print(f"{m}, profiled: chain {r['chain_ms']:.3f} ms, {chain_stream['long_gaps']} gaps of 2 µs or more "
                  f"({chain_stream['long_gaps_s'] * 1e3:.3f} ms), {chain_stream['long_gaps_host_late']} of them the host's{inside}",
                  flush=True)
    json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
