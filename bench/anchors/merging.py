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
    """``python3 X_merge.py OUT.json RUN1.json ...``: the process files of one
    run directory merged by ``merge(docs, names, raw_dir)`` into OUT.json (the
    directory as the repository names it, ``bench/raw/…``), then ``line(row)``
    printed for each row."""
    out, *paths = sys.argv[1:]
    docs = [json.load(open(p)) for p in paths]
    dirs = {os.path.relpath(os.path.dirname(os.path.abspath(p)), os.path.dirname(os.path.abspath(__file__)) + "/../..") for p in paths}
    if len(dirs) != 1:
        sys.exit(f"the process files lie in {len(dirs)} directories ({sorted(dirs)}): merge the files of one run directory")
    res = merge(docs, [os.path.basename(p) for p in paths], dirs.pop())
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    for r in res["rows"]:
        print(*line(r))
