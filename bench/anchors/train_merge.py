"""Merge `train_step.py`'s process files into one results file: per model,
case and checkpointing, each mode's figure the median over the processes of
each process's median step, with [min, max]; the bound per process
(`max(resident step, bytes crossing the link in a step ÷ the bandwidth
probed in that process)`), the ratio to it per process, then their median and
range; the targets judged from those. Nothing is typed: every number comes
from the process files.

    python3 train_merge.py OUT.json RUN1.json RUN2.json ...
"""

from __future__ import annotations

from merging import one_commit, run, spread



def judge(row: dict, mode: str, res: list[dict], off: list[dict], runs: list[dict]) -> dict | None:
    """The bound per process (`max(resident step, bytes `mode` copied in the
    step ÷ bandwidth)`), `mode`'s ratio to it, and the targets judged from
    them and `row[mode]`; None where a process lacks a step or a bandwidth."""
    if not all("step" in a and "step" in b and r.get("bandwidth_bytes_per_s") for a, b, r in zip(res, off, runs)):
        return None
    bounds = [max(a["step"]["median_s"], b["bytes_per_step"] / r["bandwidth_bytes_per_s"]) for a, b, r in zip(res, off, runs)]
    out = {"bound_s": spread(bounds), "ratio": spread([b["step"]["median_s"] / x for b, x in zip(off, bounds)])}
    repeatable = all(a["repeatable"]["grads_bitwise_equal"] for a in res)
    spread_diff = max(a["repeatable"]["max_abs_grad_diff"] for a in res)
    entry = row[mode]
    out["targets"] = {
        "ratio_at_most_1.05": out["ratio"]["median"] <= 1.05,
        # Bitwise where the resident backward repeats itself; else within its own spread.
        "gradients_equal": entry.get("grads_bitwise_equal", False) if repeatable
        else entry.get("max_abs_grad_diff", float("inf")) <= spread_diff,
        "finite_not_constant": entry.get("finite_not_constant", False),
    }
    if repeatable:
        # The timed steps' losses too, where the resident steps repeat themselves.
        out["targets"]["losses_equal"] = entry.get("losses_equal_resident", False)
    out["targets_met"] = all(out["targets"].values())
    if mode == "offload":
        out["resident_repeatable"] = repeatable
    return out


def pass_bound(res: dict, off: dict, run: dict) -> float | None:
    """The resident step plus, for each pass of ours' traced step, the time its
    copies (the engine's bytes for that pass ÷ bandwidth) outlast that pass's
    blocks' compute; None where the process traced no step."""
    diag, bw = off.get("diagnosed", {}), run.get("bandwidth_bytes_per_s")
    if not bw or not all("compute_s" in diag.get(p, {}) and p in off for p in ("forward", "backward")):
        return None
    return res["step"]["median_s"] + sum(max(0.0, off[p]["bytes_copied"] / bw - diag[p]["compute_s"]) for p in ("forward", "backward"))


def merge(docs: list[dict], names: list[str], raw_dir: str = "") -> dict:
    groups: dict = {}
    for d in docs:
        # Processes under another attention backend are another row, never pooled.
        # So are processes at another depth (given, or "auto": the package's choice).
        groups.setdefault((d["model"], d["case"]["name"], d["checkpointing"], d.get("attention", "math" if d.get("deterministic") else "default"),
                           str(d.get("depth")), str(d.get("budget_gib"))), []).append(d)
    rows = []
    for (model, case, ckpt, attention, depth, _budget), runs in groups.items():
        row = {"model": model, "case": case, "checkpointing": ckpt, "attention": attention, "depth": depth, "processes": len(runs)}
        one_commit(row, runs)
        for mode in ("resident", "offload", "offload_planned", "block_stream"):
            if mode == "offload_planned" and not any(mode in r["modes"] for r in runs):
                continue
            ok = [r["modes"][mode] for r in runs if mode in r["modes"] and "error" not in r["modes"][mode]]
            errors = sorted({r["modes"][mode]["error"] for r in runs if mode in r["modes"] and "error" in r["modes"][mode]})
            entry = {"processes": len(ok)}
            if errors:
                entry["error"] = errors[0]
            if ok:
                entry["step_s"] = spread([m["step"]["median_s"] for m in ok])
                entry["finite_not_constant"] = all(m["finite"] and m["not_constant"] for m in ok)
                # Device memory, weights and activations apart: the weights the
                # mode holds (resident: the model's; the package: the engine's
                # peak of streamed weights on the device), and the peak allocated
                # above what was allocated before the timed steps.
                weights = [m.get("weights_bytes", m.get("device_weight_bytes")) for m in ok]
                if all(isinstance(w, int) for w in weights):
                    entry["weights_bytes"] = spread(weights)
                if all("peak_bytes" in m and "before_bytes" in m for m in ok):
                    entry["activations_bytes"] = spread([max(0, m["peak_bytes"] - m["before_bytes"]) for m in ok])
                if "vs_resident" in ok[0]:
                    entry["grads_bitwise_equal"] = all(m["vs_resident"]["grads_bitwise_equal"] and m["vs_resident"]["loss_equal"] for m in ok)
                    entry["max_abs_grad_diff"] = max(m["vs_resident"]["max_abs_grad_diff"] for m in ok)
                    # The timed steps' losses, each process's against its own resident
                    # steps from the same adapters: the optimizer's steps reached the forward alike.
                    pairs = [(r["modes"][mode], r["modes"].get("resident", {})) for r in runs
                             if mode in r["modes"] and "error" not in r["modes"][mode]]
                    entry["losses_equal_resident"] = all("losses" in res and m["losses"] == res["losses"] for m, res in pairs)
            row[mode] = entry
        res = [r["modes"].get("resident", {}) for r in runs]
        off = [r["modes"].get("offload", {}) for r in runs]
        # The depth each process's ring ran at (the package's choice under "auto").
        row["depths"] = [b["plan"]["depth"] for b in off if "plan" in b]
        # Why each pass was slower than its bound, from each process's traced step
        # (`train_step.py --trace`): the verdicts seen ("None": at its bound),
        # or a diagnosis's refusal; absent where no process traced one.
        traced = [b["diagnosed"] for b in off if "diagnosed" in b]
        if traced:
            row["verdicts"] = {p: sorted({str(t[p].get("verdict", t[p].get("error"))) for t in traced if p in t})
                               for p in ("forward", "backward")}
        judged = judge(row, "offload", res, off, runs)
        if judged:
            row.update(judged)
            # Where each pass's copies outlast that pass's own blocks' compute (a
            # forward copy-bound, a backward compute-bound), a ring holding only its
            # slots cannot spend one pass's spare link time on the other's copies:
            # the resident step plus each pass's copies not hidden under its own
            # compute (ours' traced step). Said beside the bound, not a target.
            passes = [pass_bound(a, b, r) for a, b, r in zip(res, off, runs)]
            if all(x is not None for x in passes):
                row["pass_bound_s"] = spread(passes)
                row["ratio_to_pass_bound"] = spread([b["step"]["median_s"] / x for b, x in zip(off, passes)])
        planned = [r["modes"].get("offload_planned", {}) for r in runs]
        if "offload_planned" in row:
            # The package planned under a device budget from its ring's traced step:
            # the bound counts the bytes that plan copies; the weights it holds
            # (slots and the blocks it keeps) judged against the budget.
            judged = judge(row, "offload_planned", res, planned, runs) or {}
            budgets = {r["modes"]["offload_planned"].get("budget_gib") for r in runs if "offload_planned" in r["modes"]}
            row["planned"] = {"budget_gib": sorted(b for b in budgets if b is not None),
                              "resident_blocks": [len(b["plan"]["resident_blocks"]) for b in planned if "plan" in b],
                              "depths": [b["plan"]["depth"] for b in planned if "plan" in b], **judged}
            if judged and len(row["planned"]["budget_gib"]) == 1:
                cap = row["planned"]["budget_gib"][0] * (1 << 30)
                row["planned"]["targets"]["weights_within_budget"] = all(b["device_weight_bytes"] <= cap for b in planned)
                row["planned"]["targets_met"] = all(row["planned"]["targets"].values())
        rows.append(row)
    meta = docs[0]
    return {"what": "a LoRA training step (bench/anchors/train_step.py)", "date": min(d["started"] for d in docs)[:10],
            "commit": ", ".join(sorted({d["commit"] for d in docs})), "gpu": ", ".join(sorted({d["gpu"] for d in docs})),
            "torch": meta["torch"], "diffusers": meta["diffusers"], "peft": meta["peft"], "rank": meta["rank"], "depth": meta["depth"],
            "steps_per_process": meta["steps"], "processes": len(docs), "raw_dir": raw_dir, "raw": names,
            "backend": "python (cuda)", "rows": rows,
            # One line per row, as every results file has (DESIGN.md, Benchmark results).
            "cases": [{"model": r["model"], "case": r["case"], "checkpointing": r["checkpointing"],
                       "ratio_to_bound": r.get("ratio", {}).get("median"), "targets_met": r.get("targets_met")} for r in rows]}



if __name__ == "__main__":
    run(merge, lambda r: (r["model"], r["case"], r["checkpointing"], r.get("ratio", {}).get("median"), r.get("targets_met")))
