"""Merge the per-binary sabotage tables a GPU run wrote (sabotage-<part>.json from
`conformance --sabotage`) into OUT/sabotage-CARD.json (CARD from the GPU's name:
h200, h100), in DESIGN's schema (date, commit, gpu, backend, model, cases) with
`rows` the same objects. Run by bench/gpu-run.sh: python3 sabotage_table.py OUT [DATE]."""
import glob
import json
import os
import re
import sys

out = sys.argv[1]
date = sys.argv[2] if len(sys.argv) > 2 else os.environ.get("BENCH_DATE", "")
# The merged tables this script writes (sabotage-h200.json, …) are not parts.
MERGED = re.compile(r"sabotage-(gpu|[a-z]\d+)\.json$")
parts = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "sabotage-*.json"))) if not MERGED.search(p)]
rows = [r for p in parts for r in p["rows"]]
backends = []
for r in rows:
    if r["backend"] not in backends:
        backends.append(r["backend"])
# An empty table or a backend that ran only some breaks would pass "all caught"
# for breaks never run.
breaks = {b: sorted(r["sabotage"] for r in rows if r["backend"] == b) for b in backends}
if not rows or len({tuple(v) for v in breaks.values()}) > 1:
    sys.exit(f"sabotage_table: every backend must run the same breaks: {breaks}")
doc = {
    "date": date,
    "commit": parts[0]["commit"],
    "gpu": parts[0]["gpu"],
    "backend": ",".join(backends),
    "model": "the conformance suite's random test models; each break run against the cases that guard its invariant",
    # A row that refuses what a break breaks reports it "n/a": not run, so not
    # caught either; listed by name rather than counted as caught.
    "all_caught": all(r["caught"] is True or r["caught"] == "n/a" for r in rows),
    "not_applicable": [f'{r["backend"]} {r["sabotage"]}' for r in rows if r["caught"] == "n/a"],
    "cases": rows,
    "rows": rows,
}
card = re.search(r"\b([A-Z]\d{2,4})\b", doc["gpu"])
json.dump(doc, open(os.path.join(out, f"sabotage-{card.group(1).lower() if card else 'gpu'}.json"), "w"), indent=1)
for r in rows:
    print(f'{r["backend"]:<12} {r["sabotage"]:<16} caught={r["caught"]}')
