"""Is a re-run within the published spread? (bench/NOTES.md: a refactor that
touches a benchmark re-runs it on the H200.)

    python3 bench/rerun_check.py NEW.json PUBLISHED.json [--out F]

Both are `zoo merge` files. For every row of NEW (model, case, depth and who
chose the depth) that PUBLISHED has too, the new medians of the streamed and
the resident step are set against the published min and max. A new median
inside them is "within". The report lists every row, names those outside, and
names the published rows the re-run left out (`not_rerun`: the verdict covers
only the rows re-run). Beside each row, not judged: the link's bandwidth and
the streamed step's ratio to its bound, new and published (a step time compared
across machines of one kind moves with the link; the ratio divides it out). Files of two backends are refused. The exit status is 1
if a row is outside or no row matched, 2 if the backends differ.
"""

from __future__ import annotations

import argparse
import json
import sys


def key(c: dict) -> tuple:
    return (c["model"], c["case"], c["depth"], c.get("depth_chosen_by", "command line"))


def check(new: dict, published: dict) -> dict:
    if new["backend"] != published["backend"]:
        raise ValueError(f'a {new["backend"]} re-run set against a {published["backend"]} file')
    old = {key(c): c for c in published["cases"]}
    rerun = {key(c) for c in new["cases"]}
    rows = []
    for c in new["cases"]:
        p = old.get(key(c))
        if p is None:
            continue
        row = {"model": c["model"], "case": c["case"], "depth": c["depth"], "depth_chosen_by": key(c)[3]}
        for what in ("step_streamed_s", "step_resident_s"):
            lo, hi, m = p[f"{what}_min"], p[f"{what}_max"], c[what]
            row[what] = {"new": m, "published": p[what], "published_min": lo, "published_max": hi,
                         "within": lo <= m <= hi, "ratio_to_published": m / p[what]}
        row["within"] = all(row[w]["within"] for w in ("step_streamed_s", "step_resident_s"))
        row["beside"] = {w: {"new": c.get(w), "published": p.get(w)} for w in ("bandwidth_gbps", "ratio_to_bound")}
        row["bitwise_equal"] = c["bitwise_equal"]
        rows.append(row)
    return {
        "new": {"commit": new["commit"], "date": new["date"], "backend": new["backend"]},
        "published": {"commit": published["commit"], "date": published["date"], "backend": published["backend"]},
        "rows": rows,
        "outside": [f'{r["model"]} {r["case"]} d={r["depth"]}' for r in rows if not r["within"]],
        "not_rerun": [f"{k[0]} {k[1]} d={k[2]} ({k[3]})" for k in old if k not in rerun],
        "all_within": bool(rows) and all(r["within"] and r["bitwise_equal"] for r in rows),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("new")
    ap.add_argument("published")
    ap.add_argument("--out")
    a = ap.parse_args()
    with open(a.new) as f:
        new = json.load(f)
    with open(a.published) as f:
        published = json.load(f)
    try:
        doc = check(new, published)
    except ValueError as e:
        print(f"rerun_check: {e}", file=sys.stderr)
        return 2
    for r in doc["rows"]:
        s, q = r["step_streamed_s"], r["step_resident_s"]
        print(f'{r["model"]} {r["case"]} d={r["depth"]}: streamed {s["new"]:.4f} s in [{s["published_min"]:.4f}, '
              f'{s["published_max"]:.4f}]: {s["within"]}; resident {q["new"]:.4f} s in [{q["published_min"]:.4f}, '
              f'{q["published_max"]:.4f}]: {q["within"]}')
        b = r["beside"]
        if all(isinstance(b[w][k], (int, float)) for w in b for k in ("new", "published")):
            print(f'  beside: link {b["bandwidth_gbps"]["new"]:.2f} GB/s (published {b["bandwidth_gbps"]["published"]:.2f}), '
                  f'ratio to the bound {b["ratio_to_bound"]["new"]:.4f} (published {b["ratio_to_bound"]["published"]:.4f})')
    if not doc["rows"]:
        print("no row of the new file is in the published one", file=sys.stderr)
    if doc["not_rerun"]:
        print(f'not re-run (the verdict does not cover them): {", ".join(doc["not_rerun"])}')
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0 if doc["all_within"] else 1


if __name__ == "__main__":
    sys.exit(main())
