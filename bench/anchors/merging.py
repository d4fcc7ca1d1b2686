"""What the merges of process files share (``sweep_merge.py``,
``train_merge.py``, ``cache_merge.py``): a figure's spread over the processes,
and the command line that reads the files of one run directory and writes the
results file."""

from __future__ import annotations

import json
import os
import statistics
import sys


def spread(values):
    """The median of ``values`` with their min and max, and every value kept."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def run(merge, line) -> None:
    """``python3 X_merge.py OUT.json RUN1.json ...``: process files merged by
    ``merge(docs, names, raw_dir)`` into OUT.json, then ``line(row)`` printed
    for each row. The files of one run directory are named by their file
    names under ``raw_dir``, the directory as the repository names it
    (``bench/raw/…``). Files from several run directories (rows measured in
    different sessions) are named by their paths under ``bench/raw``, which is
    then ``raw_dir``; the merge keeps each row's processes to one commit."""
    out, *paths = sys.argv[1:]
    docs = [json.load(open(p)) for p in paths]
    root = os.path.dirname(os.path.abspath(__file__)) + "/../.."
    dirs = {os.path.relpath(os.path.dirname(os.path.abspath(p)), root) for p in paths}
    if len(dirs) == 1:
        raw_dir, names = dirs.pop(), [os.path.basename(p) for p in paths]
    else:
        raw_dir = "bench/raw"
        names = [os.path.relpath(os.path.abspath(p), os.path.join(root, raw_dir)) for p in paths]
        outside = [n for n in names if n.startswith("..")]
        if outside:
            sys.exit(f"{len(outside)} process files lie outside bench/raw ({outside[0]}): merge the committed raw runs")
    try:
        res = merge(docs, names, raw_dir)
    except ValueError as e:
        sys.exit(str(e))
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    for r in res["rows"]:
        print(*line(r))


def one_commit(row: dict, runs: list[dict]) -> None:
    """``row["commit"]`` and ``row["gpu"]``: the commit its processes ran at,
    on which card. A row pools only processes of one commit on one kind of
    card (a figure is published from processes at one commit, compared within
    one card): a row given two of either is a ``ValueError`` naming both."""
    for key, what in (("commit", "commits"), ("gpu", "cards")):
        seen = sorted({r[key] for r in runs})
        if len(seen) != 1:
            raise ValueError(f"the row {row['model']} {row['case']} pools processes at {len(seen)} {what} "
                             f"({', '.join(seen)}): merge the processes of one commit and one card per row")
        row[key] = seen[0]
