"""Merge the Python package's runs (zoo_anchor.py --mode offload,block_stream,leaf_stream,
one process each): per model and case, the median of the per-process medians
with min and max, for resident, the package and diffusers' modes; the bound
max(resident step, bytes a step / the process's pinned bandwidth); the ratios
to it and to diffusers' best mode; the targets checked. Everything computed
here from the files named; nothing typed.

python3 py_merge.py --out bench/results/DATE-python-package.json --date DATE \
    --at COMMIT1 RUN1.json RUN2.json RUN3.json [--at COMMIT2 RUN4.json ...] [--min-runs 3]

Each `--at` names the commit its runs were made at. A case is merged from the
runs of one commit only: the last `--at` group holding enough processes for it
(so a re-run at a newer commit supersedes the older runs, which stay listed).
"""
import argparse
import json
import statistics


def spread(xs):
    xs = sorted(xs)
    return dict(median=statistics.median(xs), min=xs[0], max=xs[-1], n=len(xs))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-runs", type=int, default=3)
    ap.add_argument("--at", nargs="+", action="append", required=True, metavar="COMMIT RUN",
                    help="a commit, then the run files made at it")
    ap.add_argument("--date", required=True, help="the day the runs were made (YYYY-MM-DD)")
    ap.add_argument("--gpu", default="NVIDIA H200", help="the GPU of runs that do not record theirs (before 2026-12-05)")
    ap.add_argument("--probe", action="store_true",
                    help="a diagnostic merge: fewer than three processes allowed, the file marked so (never published)")
    a = ap.parse_args()
    if a.min_runs < 3 and not a.probe:
        raise SystemExit(f"--min-runs {a.min_runs}: a published figure is a median of at least three processes "
                         "(give --probe for a diagnostic merge, marked so and never published)")
    commit_of, order = {}, []
    for group in a.at:
        if len(group) < 2:
            raise SystemExit(f"--at {group[0]}: no run files after the commit")
        order.append(group[0])
        for f in group[1:]:
            if f in commit_of:
                raise SystemExit(f"{f}: named twice")
            commit_of[f] = group[0]
    docs = [(f, json.load(open(f))) for f in commit_of]
    for f, d in docs:
        # `zoo_anchor.py --kernels` profiles steps between the timed ones: not a measurement.
        if d.get("kernels_profiled"):
            raise SystemExit(f"{f}: a process run with --kernels (profiled steps between the timed ones): not merged")
    groups, failures = {}, {}
    for f, d in docs:
        seen = set()
        for r in d["cases"]:
            key = (r["model"], r["case"])
            if "error" in r:
                # diffusers' mode failed on this model (zoo_anchor.py names it): kept by name.
                failures.setdefault(key, {}).setdefault(f, {}).setdefault(r["mode"], r["error"])
                continue
            med = statistics.median(r["steps_s"])
            g = groups.setdefault(key, {})
            if (key, r["mode"]) in seen:
                raise SystemExit(f"{f}: {key} {r['mode']} twice in one process")
            seen.add((key, r["mode"]))
            g.setdefault(f, {})[r["mode"]] = dict(r, median_s=med)
    rows, incomplete = [], []
    for (model, case), per in sorted(groups.items()):
        complete = {f: m for f, m in per.items() if {"resident", "offload"} <= m.keys()}
        at = [c for c in order if sum(commit_of[f] == c for f in complete) >= a.min_runs]
        commit = at[-1] if at else None
        full = {f: m for f, m in complete.items() if commit_of[f] == commit}
        superseded = sorted(f for f in complete if f not in full)
        if len(full) < a.min_runs:
            full = complete
            incomplete.append(dict(model=model, case=case, processes=len(full), files=sorted(full),
                                   why=f"{len(full)} processes with resident and offload runs, {a.min_runs} needed"))
            print(f"{model} {case}: not merged, {incomplete[-1]['why']}")
            continue
        res, ours, bound, ratio, vs, best_modes, dmodes = [], [], [], [], [], [], {}
        bitwise, syncs, finite = True, 0, True
        for f, m in full.items():
            # Like for like: every mode of a process timed as many steps.
            counts = {k: len(v["steps_s"]) for k, v in m.items()}
            if len(set(counts.values())) > 1:
                raise SystemExit(f"{f}: {model} {case}: the modes timed different numbers of steps: {counts}")
            o = m["offload"]
            # The bytes that crossed the link (fewer than the block's when coded).
            b = max(m["resident"]["median_s"], o.get("link_bytes_per_step", o["bytes_per_step"]) / o["h2d_bytes_per_s"])
            res.append(m["resident"]["median_s"])
            ours.append(o["median_s"])
            bound.append(b)
            ratio.append(o["median_s"] / b)
            diff = {k: v["median_s"] for k, v in m.items() if k in ("block_stream", "leaf_stream")}
            for k, v in diff.items():
                dmodes.setdefault(k, []).append(v)
            if diff:
                best = min(diff, key=diff.get)
                best_modes.append(best)
                vs.append(o["median_s"] / diff[best])
            bitwise &= bool(o["bitwise_equal"])
            syncs = max(syncs, o["host_syncs_in_timed_steps"])
            finite &= all(v["output_finite"] and v["output_nonconstant"] for v in m.values())
        # A diffusers mode's spread over fewer processes than the row's is no
        # figure beside it: such a mode is named with its count, not spread.
        partial = {k: f"{len(v)} of {len(full)} processes" for k, v in dmodes.items() if len(v) != len(full)}
        dmodes = {k: v for k, v in dmodes.items() if k not in partial}
        o0 = next(iter(full.values()))["offload"]
        # The package's plan (its depth, the blocks it kept resident) is the planner's
        # in each process: the processes merged must agree on it.
        plans = {f: (m["offload"].get("depth"), tuple(m["offload"].get("resident_blocks") or ())) for f, m in full.items()}
        if len(set(plans.values())) > 1:
            raise SystemExit(f"{model} {case}: the processes ran different plans (depth, resident blocks): {plans}")
        row = dict(
            model=model, case=case, commit=commit, superseded_runs=superseded, tokens=o0["tokens"], batch=o0["batch"], depth=o0["depth"], processes=len(full),
            files=sorted(full), resident_s=spread(res), offload_s=spread(ours), bound_s=spread(bound),
            ratio_to_bound=spread(ratio), bytes_per_step=o0["bytes_per_step"],
            h2d_gb_per_s=spread([m["offload"]["h2d_bytes_per_s"] / 1e9 for m in full.values()]),
            # The package's weights on the device, where the run counted its slots and
            # resident blocks (`weights_from: engine`); earlier runs counted neither
            # (allocated before the step, outside its peak): not reported.
            weights_device_gib=dict(offload=spread([m["offload"]["weights_device_bytes"] / 2**30 for m in full.values()])
                                    if all(m["offload"].get("weights_from") == "engine" for m in full.values()) else None,
                                    **{k: spread([m[k]["weights_device_bytes"] / 2**30 for m in full.values() if k in m]) for k in dmodes}),
            activations_gib=spread([m["resident"]["activations_peak_bytes"] / 2**30 for m in full.values()]),
            diffusers_s={k: spread(v) for k, v in dmodes.items()},
            **({"diffusers_partial": partial} if partial else {}),
            bitwise_equal=bitwise, host_syncs_in_timed_steps=syncs, outputs_finite_and_nonconstant=finite,
        )
        # Against diffusers only where every merged process ran a diffusers mode: a
        # comparison over fewer processes than the row's is no comparison of it (a
        # mode that failed in one process, say): this row says so, the others merge.
        if vs and len(vs) != len(full):
            row["diffusers_not_compared"] = f"{len(vs)} of {len(full)} processes ran a diffusers mode"
            print(f"{model} {case}: not compared with diffusers, {row['diffusers_not_compared']}")
            vs = []
        if vs:
            row["vs_diffusers_best"] = spread(vs)
            row["diffusers_best_mode"] = statistics.mode(best_modes)
        if "budget_gib" in o0:
            # Planned under a device budget from a calibration: the blocks it kept resident.
            row["budget_gib"] = o0["budget_gib"]
            row["resident_blocks"] = o0["resident_blocks"]
        if o0.get("link_bytes_per_step", o0["bytes_per_step"]) != o0["bytes_per_step"]:
            row["link_bytes_per_step"] = o0["link_bytes_per_step"]
        # diffusers' failures in the merged processes only (a superseded run's is not this row's).
        failed = {}
        for f, modes in failures.get((model, case), {}).items():
            if f in full:
                for mode, err in modes.items():
                    failed.setdefault(mode, err)
        if failed:
            row["diffusers_failed"] = failed
        if row["ratio_to_bound"]["min"] < 0.99:
            # A step faster than its bound: the bound is not one. Say which term read
            # wrong in that process: its resident step (slow) or its bandwidth (low).
            k = ratio.index(min(ratio))
            why = (f"its process's resident step ({res[k]:.4f} s, the processes' median {statistics.median(res):.4f}) read slow"
                   if bound[k] == res[k] else "the bandwidth probe read below the achieved rate")
            row["bound_suspect"] = f"a step ran at {row['ratio_to_bound']['min']:.3f} x its bound: {why}"
        # A compiled row (zoo_anchor --compile: MODEL-compiled...) is asked to beat
        # diffusers' best compiled offloaded mode only where its bound is the link's
        # (above the resident compiled step): at the resident step both sides run
        # the same compiled blocks, and which is faster is the run's noise.
        row["targets"] = dict(within_1_02_of_bound=row["ratio_to_bound"]["median"] <= 1.02 and "bound_suspect" not in row,
                              # None where no diffusers mode ran (each failure named in diffusers_failed).
                              faster_than_diffusers_best=(row["vs_diffusers_best"]["max"] < 1.0) if vs else None,
                              bitwise_equal=bitwise, no_host_sync=syncs == 0,
                              # Equal is not enough: a constant or non-finite output equals itself.
                              outputs_finite_and_nonconstant=finite)
        if vs and "-compiled" in model and statistics.median(bound) <= statistics.median(res):
            # Not a target of this row (the comparison stays in vs_diffusers_best).
            del row["targets"]["faster_than_diffusers_best"]
            row["diffusers_not_asked"] = "compiled and compute-bound (its bound is the resident compiled step): not asked to be faster"
        if "-compiled" in model:
            # Compiled: nothing compiled again once warmed up (dynamo's frame count
            # over the timed steps, in every process; runs before it was counted: None).
            frames = [m["offload"].get("frames_compiled_in_timed_steps") for m in full.values()]
            row["frames_compiled_in_timed_steps"] = frames
            row["targets"]["no_recompiles_after_warmup"] = None if None in frames else not any(frames)
        # Each process's streamed step over its own resident one (what the docs quote).
        row["vs_resident"] = spread([o / r for o, r in zip(ours, res)])
        if model.startswith("flux-dev-fp8") and case == "1024":
            # The fp8 target: Flux-dev in fp8 at 1024², batch 1, at or under 1.05 x
            # its resident step (the same fp8 weights resident, upcast per layer),
            # whichever Linears are fp8 (MODEL-fp8, -fp8-linears) and coded or not.
            row["targets"]["within_1_05_of_resident"] = row["vs_resident"]["median"] <= 1.05
        rows.append(row)
    versions = sorted({d.get("versions", "") for _, d in docs})
    # The GPU the runs recorded (runs from before they did: --gpu); runs on two GPUs are not one file.
    recorded = {d["gpu"] for _, d in docs if d.get("gpu")}
    if len(recorded) > 1:
        raise SystemExit(f"the runs ran on different GPUs: {sorted(recorded)}")
    if recorded and any(not d.get("gpu") for _, d in docs):
        raise SystemExit("some runs record their GPU and some do not: merge runs of one kind")
    gpu = recorded.pop() if recorded else a.gpu
    json.dump(dict(generated_by="bench/anchors/py_merge.py", date=a.date,
                   commit=", ".join(c for c in order if any(r["commit"] == c for r in rows)), gpu=gpu, backend="python",
                   versions=versions, at={c: [f for f in commit_of if commit_of[f] == c] for c in order}, cases=rows,
                   not_merged=incomplete, **({"probe": True} if a.probe else {})),
              open(a.out, "w"), indent=1)
    for r in rows:
        print(f"{r['model']} {r['case']}: offload {r['offload_s']['median']:.4f} s [{r['offload_s']['min']:.4f}, {r['offload_s']['max']:.4f}], "
              f"{r['ratio_to_bound']['median']:.4f} x bound, {r.get('vs_diffusers_best', {}).get('median', float('nan')):.3f} x diffusers' best, "
              f"bitwise {r['bitwise_equal']}, targets {r['targets']}")


if __name__ == "__main__":
    main()
