"""The Python package's published results file is what py_merge.py computes from
the kept runs it names, byte for byte: no figure in it was typed or merged by hand."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_published_results_file_rebuilds_from_its_runs(tmp_path):
    files = sorted((ROOT / "bench" / "results").glob("*-python-package.json"))
    assert files, "no Python package results file"
    for f in files:
        d = json.loads(f.read_text())
        args = [sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", d["date"], "--gpu", d["gpu"], "--out", str(tmp_path / f.name)]
        for commit, runs in d["at"].items():
            args += ["--at", commit, *runs]
        subprocess.run(args, cwd=ROOT, check=True, capture_output=True)
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f"{f.name} is not what py_merge.py makes of its runs"
