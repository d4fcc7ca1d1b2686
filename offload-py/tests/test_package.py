"""What users of a typed binding expect of the package itself: a version, a
type stub for the extension that lists exactly what it holds, a typed marker."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import offload
from offload import _offload

PKG = Path(offload.__file__).parent


def test_the_version_is_the_packages_own():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    want = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    assert offload.__version__ == _offload.__version__ == want


def test_the_extensions_stub_lists_exactly_what_it_holds():
    stub = ast.parse((PKG / "_offload.pyi").read_text())
    top = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    top |= {n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)}
    held = {n for n in dir(_offload) if not n.startswith("__")} | {"__version__"}
    assert top == held, (top ^ held)
    streamer = next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "Streamer")
    methods = {n.name for n in streamer.body if isinstance(n, ast.FunctionDef)} - {"__init__"}
    assert methods == {n for n in vars(_offload.Streamer) if not n.startswith("__")}
    assert (PKG / "py.typed").exists()


def test_the_project_metadata_names_its_readme_licenses_and_links():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert (root / project["readme"]).read_text().startswith("# offload")
    assert project["license"] == "MIT OR Apache-2.0"
    texts = [(root / f).read_text() for f in project["license-files"]]
    assert any("Permission is hereby granted" in t for t in texts) and any("Apache License" in t for t in texts)
    assert {"Homepage", "Documentation", "Repository"} <= set(project["urls"])
    assert "Typing :: Typed" in project["classifiers"]
