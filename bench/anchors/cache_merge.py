"""Merge `cache_loop.py`'s process files into one results file: per model and
case, each mode's whole loop the median over the processes with [min, max];
per process the bound, `max(resident loop with the cache, bytes the package
copied over the loop ÷ the bandwidth probed in that process)` (the blocks that
ran and the prefetches a skip decision wasted), the package's ratio to it, then
their median and range; the targets judged from those, among them that the
cache answered at least one step of the resident loop (a loop that computed
every step measures no cache). Nothing is typed: every number comes from the
process files.

    python3 cache_merge.py OUT.json RUN1.json RUN2.json ...
"""

from __future__ import annotations

from merging import one_commit, run, spread



def merge(docs: list[dict], names: list[str], raw_dir: str = "") -> dict:
    groups: dict = {}
    for d in docs:
        # Loops of another schedule, threshold or length are another row, never pooled.
        groups.setdefault((d["model"], d["case"]["name"], d.get("schedule", "descending"), d["threshold"], d["steps"], d.get("warmup", 0),
                                d.get("warmup_steps", d["steps"])), []).append(d)
    rows = []
    for (model, case, *_), runs in groups.items():
        row = {"model": model, "case": case, "processes": len(runs), "steps": runs[0]["steps"], "threshold": runs[0]["threshold"],
               "schedule": runs[0].get("schedule", "descending"), "warmup": runs[0].get("warmup", 0),
               "warmup_steps": runs[0].get("warmup_steps", runs[0]["steps"])}
        one_commit(row, runs)
        for mode in ("resident", "offload", "offload_streamed", "block_stream"):
            got = [r["modes"][mode] for r in runs if mode in r["modes"]]
            ok = [m for m in got if "error" not in m]
            entry = {"processes": len(ok)}
            errors = sorted({m["error"] for m in got if "error" in m})
            if errors:
                entry["error"] = errors[0]
            if ok:
                entry["loop_s"] = spread([m["loop_s"] for m in ok])
                entry["computed_steps"] = spread([sum(m["computed"]) for m in ok])
                entry["finite_not_constant"] = all(m["finite"] and m["not_constant"] for m in ok)
                # Device memory: the weights the mode holds where the file says
                # (resident: the model's; the package: its engine's peak, its kept
                # blocks and the module's resident parameters), and the loop's peak allocated
                # above what was allocated before it (diffusers' offloading: its
                # onloaded blocks are in it too).
                if all("weights_bytes" in m for m in ok):
                    entry["weights_bytes"] = spread([m["weights_bytes"] for m in ok])
                if all("peak_bytes" in m and "before_bytes" in m for m in ok):
                    entry["peak_above_before_bytes"] = spread([max(0, m["peak_bytes"] - m["before_bytes"]) for m in ok])
                if "bitwise_equal_steps" in ok[0]:
                    entry["bitwise_equal"] = all(all(m["bitwise_equal_steps"]) for m in ok)
                    entry["same_cache_decisions"] = all(m["same_cache_decisions"] for m in ok)
            row[mode] = entry
        res = [r["modes"].get("resident", {}) for r in runs]
        # The package's defaults judged on the row itself; with every block
        # streamed (where the files have it), the same judgement under "streamed".
        for mode, into in (("offload", row), ("offload_streamed", None)):
            off = [r["modes"].get(mode, {}) for r in runs]
            if not all("loop_s" in a and "loop_s" in b and r.get("bandwidth_bytes_per_s") for a, b, r in zip(res, off, runs)):
                continue
            if into is None:
                into = row["streamed"] = {}
            copied = [sum(m["bytes_copied"] for m in b["metrics"]) for b in off]
            bounds = [max(a["loop_s"], c / r["bandwidth_bytes_per_s"]) for a, c, r in zip(res, copied, runs)]
            into["bytes_copied"] = spread(copied)
            into["bound_s"] = spread(bounds)
            into["ratio"] = spread([b["loop_s"] / x for b, x in zip(off, bounds)])
            # Beside it, not judged: each step's own bound summed, Σ max(resident
            # step, that step's bytes ÷ bandwidth). The loop's bound above lets a
            # computed step's copies overlap the cached steps' compute; a step's
            # copies can only overlap its own (the ring holds `depth` blocks ahead).
            if all(len(a["step_s"]["runs_s"]) == len(b["metrics"]) for a, b in zip(res, off)):
                steps = [sum(max(t, m["bytes_copied"] / r["bandwidth_bytes_per_s"]) for t, m in zip(a["step_s"]["runs_s"], b["metrics"]))
                         for a, b, r in zip(res, off, runs)]
                into["stepwise_bound_s"] = spread(steps)
                into["stepwise_ratio"] = spread([b["loop_s"] / x for b, x in zip(off, steps)])
            into["targets"] = {
                "the_cache_answered": all(not all(a["computed"]) for a in res),
                "ratio_at_most_1.05": into["ratio"]["median"] <= 1.05,
                "bitwise_equal": row[mode].get("bitwise_equal", False),
                "same_cache_decisions": row[mode].get("same_cache_decisions", False),
                "finite_not_constant": row[mode].get("finite_not_constant", False),
            }
            into["targets_met"] = all(into["targets"].values())
        rows.append(row)
    meta = docs[0]
    return {"what": "a denoising loop with FirstBlockCache (bench/anchors/cache_loop.py)", "date": min(d["started"] for d in docs)[:10],
            "commit": ", ".join(sorted({d["commit"] for d in docs})), "gpu": ", ".join(sorted({d["gpu"] for d in docs})),
            "torch": meta["torch"], "diffusers": meta["diffusers"], "processes": len(docs), "raw_dir": raw_dir, "raw": names,
            "backend": "python (cuda)", "rows": rows,
            # One line per row, as every results file has (DESIGN.md, Benchmark results).
            "cases": [{"model": r["model"], "case": r["case"], "ratio_to_bound": r.get("ratio", {}).get("median"),
                       "bitwise_equal": r.get("offload", {}).get("bitwise_equal"), "targets_met": r.get("targets_met")} for r in rows]}



if __name__ == "__main__":
    run(merge, lambda r: (r["model"], r["case"], r.get("ratio", {}).get("median"), r.get("targets_met")))
