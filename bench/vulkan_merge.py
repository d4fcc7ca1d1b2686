"""Merge the Vulkan bench's process runs (OUT/PREFIX-run*.json from `vulkan-bench`)
into OUT/PREFIX-<gpu>.json (`h200`, `h100`: named by the runs' GPU): per case the median streamed and resident steps with
min and max, the bound and the ratio; the pinned bandwidth beside the CUDA one
measured in the same runs. Run by bench/gpu-run.sh:
    python3 vulkan_merge.py OUT PREFIX
A run made without BENCH_DATE has no date: the merge's BENCH_DATE then."""
import glob, json, os, statistics, sys
out, prefix = sys.argv[1], sys.argv[2]
runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, prefix + "-run*.json")))]
# Nothing to merge, runs of two builds, or a CUDA bandwidth in some runs only would
# make a verdict of nothing, of a mix, or a ratio of medians over different runs.
if not runs:
    sys.exit(f"vulkan_merge: no {prefix}-run*.json in {out}")
if len({r["commit"] for r in runs}) > 1:
    sys.exit(f"vulkan_merge: runs of several commits: {sorted({r['commit'] for r in runs})}")
if len({r["gpu"] for r in runs}) > 1:
    sys.exit(f"vulkan_merge: runs on several GPUs: {sorted({r['gpu'] for r in runs})}")
if len({r["cuda_bandwidth_gbps"] is None for r in runs}) > 1:
    sys.exit("vulkan_merge: some runs measured the CUDA bandwidth and some did not")
def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
keys = [(c["case"], c["depth"]) for c in runs[0]["cases"]]
cases = []
for case, depth in keys:
    per = [next(c for c in r["cases"] if c["case"] == case and c["depth"] == depth) for r in runs]
    s, res, b, ratio = (spread([c[k] for c in per]) for k in ("step_streamed_s", "step_resident_s", "bound_s", "ratio_to_bound"))
    cases.append({"case": case, "resolution": None, "batch": 1, "depth": depth, "budget_bytes": None, "repeats": len(per),
        "step_resident_s": res["median"], "step_streamed_s": s["median"], "step_streamed_s_min": s["min"], "step_streamed_s_max": s["max"],
        "bandwidth_gbps": statistics.median([c["bandwidth_gbps"] for c in per]), "streamed_bytes": per[0]["streamed_bytes"],
        "bound_s": b["median"], "ratio_to_bound": ratio["median"], "ratio_to_bound_min": ratio["min"], "ratio_to_bound_max": ratio["max"],
        "peak_device_bytes": max(c["peak_device_bytes"] for c in per), "bitwise_equal": all(c["bitwise_equal"] for c in per),
        "misses": sum(c["misses"] for c in per)})
bw = spread([r["bandwidth_gbps"] for r in runs])
cu = [r["cuda_bandwidth_gbps"] for r in runs if r["cuda_bandwidth_gbps"] is not None]
cuda = spread(cu) if cu else None
# A run made without BENCH_DATE has no date: the merge's BENCH_DATE (the day of the device command) then.
doc = {"date": runs[0]["date"] or os.environ.get("BENCH_DATE", ""), "commit": runs[0]["commit"], "gpu": runs[0]["gpu"], "backend": "vulkan", "model": runs[0]["model"],
    "runs": [f"{prefix}-run{i + 1}.json" for i in range(len(runs))], "options": runs[0].get("options"),
    "bandwidth_gbps": bw["median"], "bandwidth_gbps_min": bw["min"], "bandwidth_gbps_max": bw["max"],
    "cuda_bandwidth_gbps": cuda and cuda["median"], "cuda_bandwidth_gbps_min": cuda and cuda["min"], "cuda_bandwidth_gbps_max": cuda and cuda["max"],
    "bandwidth_ratio_to_cuda": cuda and bw["median"] / cuda["median"],
    "meets_bandwidth_target": bool(cuda) and bw["median"] >= 0.9 * cuda["median"],
    "meets_step_target": bool(cases) and all(c["ratio_to_bound"] <= 1.03 and c["bitwise_equal"] for c in cases),
    "cases": cases}
# The file names the GPU its runs ran on (an H100's runs once went into "-h200.json").
gpu = runs[0]["gpu"]
card = next((c for c in ("H200", "H100") if c in gpu), None)
card = card.lower() if card else "".join(ch if ch.isalnum() else "-" for ch in gpu.lower()).strip("-") or "unknown-gpu"
with open(os.path.join(out, f"{prefix}-{card}.json"), "w") as f:
    json.dump(doc, f, indent=1)
print(json.dumps({k: doc[k] for k in ("bandwidth_gbps", "cuda_bandwidth_gbps", "bandwidth_ratio_to_cuda", "meets_bandwidth_target", "meets_step_target")}))
for c in cases:
    print(f'{c["case"]:<14} d={c["depth"]} resident {c["step_resident_s"]:.4f} streamed {c["step_streamed_s"]:.4f} [{c["step_streamed_s_min"]:.4f}, {c["step_streamed_s_max"]:.4f}] ratio {c["ratio_to_bound"]:.4f} equal {c["bitwise_equal"]}')
