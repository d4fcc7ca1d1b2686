"""Merge the sweep's process files (``sweep.py``, one per process) into one
results file: per model, each figure the median over the processes of each
process's median step, with [min, max] over the processes; the ratio to the
bound per process (its own resident step and its own probed bandwidth), then
its median and range; diffusers' best offloaded mode per process; the targets
judged from those. Nothing is typed: every number comes from the process files.

    python3 sweep_merge.py OUT.json RUN1.json RUN2.json RUN3.json
"""

from __future__ import annotations

import json
import statistics

from merging import run, spread

GIB = float(1 << 30)



def merge(docs: list[dict], names: list[str], raw_dir: str = "") -> dict:
    probes = sorted({json.dumps(d.get("probe")) for d in docs})
    if len(probes) > 1:
        raise ValueError(f"the process files ran different probes ({', '.join(probes)}): merge each apart")
    order = []
    for d in docs:
        for m in d["models"]:
            if m["model"] not in order:
                order.append(m["model"])
    rows = []
    for name in order:
        runs = [next((m for m in d["models"] if m["model"] == name), None) for d in docs]
        row = {"model": name, "processes": sum(r is not None for r in runs)}
        ok = [r for r in runs if r is not None and "error" not in r]
        errors = sorted({r["error"] for r in runs if r is not None and "error" in r})
        if errors:
            row["error"] = errors[0]
        if not ok:
            rows.append(row)
            continue
        first = ok[0]
        row.update({k: first[k] for k in ("class", "library", "config", "case", "video", "weight_bytes", "block_lists")})
        row["resident_s"] = spread([r["resident"]["step"]["median_s"] for r in ok])
        row["activations_gib"] = statistics.median(r["activations_bytes"] for r in ok) / GIB
        ours = [r for r in ok if "error" not in r["offload"]]
        if len(ours) < len(ok):
            row["offload_error"] = next(r["offload"]["error"] for r in ok if "error" in r["offload"])
        if ours:
            bounds = [max(r["resident"]["step"]["median_s"], r["offload"]["bytes_copied"] / r["offload"]["bandwidth_bytes_per_s"]) for r in ours]
            steps = [r["offload"]["step"]["median_s"] for r in ours]
            row["offload_s"] = spread(steps)
            row["bound_s"] = spread(bounds)
            row["ratio"] = spread([s / b for s, b in zip(steps, bounds)])
            row["copy_bound"] = statistics.median(
                r["offload"]["bytes_copied"] / r["offload"]["bandwidth_bytes_per_s"] > r["resident"]["step"]["median_s"] for r in ours) >= 0.5
            row["bitwise_equal"] = all(r["offload"]["bitwise_equal"] for r in ours)
            row["offload_weights_gib"] = statistics.median(r["offload"]["weights_bytes"] for r in ours) / GIB
            row["verdicts"] = sorted({str(r["offload"]["diagnosis"]["verdict"]) for r in ours})
            row["plan"] = ours[0]["offload"]["plan"]
            # Each process chose its own plan: its depth and the blocks it kept.
            row["depths"] = [r["offload"]["plan"]["depth"] for r in ours]
            row["kept_blocks"] = [len(r["offload"]["plan"]["resident_blocks"]) for r in ours]
        for mode in ("block_stream", "leaf_stream"):
            done = [r[mode] for r in ok if mode in r and "error" not in r[mode]]
            if done:
                row[mode] = {"step_s": spread([m["step"]["median_s"] for m in done]), "bitwise_equal": all(m["bitwise_equal"] for m in done),
                             "weights_gib": statistics.median(m["weights_bytes"] for m in done) / GIB}
            else:
                row[mode] = {"error": next((r[mode]["error"] for r in ok if mode in r), "not run")}
        # diffusers' best mode: the faster median of the two, per process.
        best = []
        for r in ok:
            times = {m: r[m]["step"]["median_s"] for m in ("block_stream", "leaf_stream") if m in r and "error" not in r[m]}
            if times:
                best.append(min(times.items(), key=lambda kv: kv[1]))
        if best and ours:
            modes = [m for m, _ in best]
            row["diffusers_best_mode"] = max(set(modes), key=modes.count)
            row["diffusers_best_s"] = spread([s for _, s in best])
            row["ours_over_diffusers"] = spread([s / b for s, (_, b) in zip(steps, best)]) if len(best) == len(steps) else None
        if ours:
            at_bound = row["ratio"]["median"] <= 1.02
            not_slower = (not row["copy_bound"]) or "diffusers_best_s" not in row or row["offload_s"]["median"] <= row["diffusers_best_s"]["median"]
            finite = all(r["finite"] and r["not_constant"] for r in ok)
            row["targets"] = {"ratio_at_most_1.02": at_bound, "not_slower_than_diffusers_where_copy_bound": not_slower,
                              "bitwise_equal": row["bitwise_equal"], "finite_not_constant": finite}
            row["targets_met"] = all(row["targets"].values())
        rows.append(row)
    meta = docs[0]
    # The fields every results file holds (DESIGN.md, "Benchmark results"), per model.
    cases, anchors = [], []
    for r in rows:
        if "offload_s" not in r:
            continue
        ok = [m for d in docs for m in d["models"] if m["model"] == r["model"] and "error" not in m and "error" not in m["offload"]]
        cases.append({"model": r["model"], "resolution": r["case"], "batch": 1, "depth": r["plan"]["depth"], "budget_bytes": None,
                      "step_resident_s": r["resident_s"]["median"], "step_streamed_s": r["offload_s"]["median"],
                      "bandwidth_gbps": statistics.median(m["offload"]["bandwidth_bytes_per_s"] for m in ok) / 1e9,
                      "streamed_bytes": statistics.median(m["offload"]["bytes_copied"] for m in ok), "bound_s": r["bound_s"]["median"],
                      "ratio_to_bound": r["ratio"]["median"],
                      "peak_device_bytes": int((r["offload_weights_gib"] + r["activations_gib"]) * GIB),
                      "bitwise_equal": r["bitwise_equal"]})
        for mode in ("block_stream", "leaf_stream"):
            m = r.get(mode, {})
            anchors.append({"model": r["model"], "mode": mode, "error": m["error"]} if "error" in m else
                           {"model": r["model"], "mode": mode, "step_s": m["step_s"]["median"], "bitwise_equal": m["bitwise_equal"],
                            "peak_device_bytes": int((m["weights_gib"] + r["activations_gib"]) * GIB)})
    gpus, commits = sorted({d["gpu"] for d in docs}), sorted({d["commit"] for d in docs})
    out = {"what": "the sweep of diffusers and transformers classes beyond the registry (bench/anchors/sweep.py)",
           "date": min(d["started"] for d in docs)[:10], "commit": ", ".join(commits), "gpu": ", ".join(gpus),
           "backend": "python (cuda)", "model": "sweep", "torch": meta["torch"], "diffusers": meta["diffusers"],
           "transformers": meta["transformers"], "steps_per_process": meta["steps"], "processes": len(docs), "raw_dir": raw_dir, "raw": names,
           "rows": rows, "cases": cases, "anchors": anchors}
    if meta.get("probe"):
        # A forced depth or moved tables: not the defaults' sweep, never published as it.
        out["probe"], out["probe_args"] = True, meta["probe"]
    return out



if __name__ == "__main__":
    run(merge, lambda r: (r["model"], r.get("ratio", {}).get("median"), r.get("targets_met"), r.get("error", "")))
