"""The Python package's published results file is what py_merge.py computes from
the kept runs it names, byte for byte: no figure in it was typed or merged by hand."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def _raw_runs():
    """The raw runs these merges read, unpacked from ``bench/raw.tar.gz`` into ``bench/raw/``."""
    subprocess.run(["bash", str(ROOT / "bench" / "raw.sh")], check=True)


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


@pytest.mark.parametrize("kind", ["start", "pipeline"])
def test_the_start_and_pipeline_results_files_rebuild_from_their_runs(tmp_path, kind):
    # The host-RAM start and whole-pipeline files: each names its runs, and
    # is what `py_start.py merge` / `py_pipeline.py merge` make of them, byte for byte.
    files = sorted((ROOT / "bench" / "results").glob(f"*-python-{kind}.json"))
    assert files, f"no python-{kind} results file"
    for f in files:
        d = json.loads(f.read_text())
        out = tmp_path / f.name
        subprocess.run([sys.executable, str(ROOT / f"bench/anchors/py_{kind}.py"), "merge", "--date", d["date"], "--out", str(out),
                        *d["runs"]], cwd=ROOT, check=True, capture_output=True)
        assert out.read_bytes() == f.read_bytes(), f"{f.name} is not what py_{kind}.py makes of its runs"


def test_a_comparison_with_diffusers_covers_every_merged_process(tmp_path):
    # A row compares with diffusers only where every merged process ran a
    # diffusers mode (else the verdict rests on fewer processes than the row), and
    # a diffusers failure is named only where a merged process saw it.
    def run(k, modes, failed=None):
        common = dict(model="flux-dev", case="1024", tokens=4608, batch=1, weights_device_bytes=1, activations_peak_bytes=1,
                      output_finite=True, output_nonconstant=True)
        rows = [dict(common, mode="resident", steps_s=[0.2] * 3),
                dict(common, mode="offload", steps_s=[0.43] * 3, depth=1, bytes_per_step=22e9, h2d_bytes_per_s=55e9,
                     bitwise_equal=True, host_syncs_in_timed_steps=0)]
        rows += [dict(common, mode=m, steps_s=[0.5] * 3) for m in modes]
        if failed:
            rows.append(dict(model="flux-dev", case="1024", mode=failed, error="out of memory"))
        p = tmp_path / f"r{k}.json"
        p.write_text(json.dumps(dict(versions="test", cases=rows)))
        return str(p)

    def merge(*at):
        out = tmp_path / "m.json"
        args = [sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", "2026-12-03", "--out", str(out)]
        for commit, runs in at:
            args += ["--at", commit, *runs]
        r = subprocess.run(args, capture_output=True, text=True)
        return r, (json.loads(out.read_text()) if r.returncode == 0 else None)

    r, doc = merge(("c1", [run(0, ["leaf_stream"]), run(1, ["leaf_stream"]), run(2, [])]))
    row = doc["cases"][0]
    assert row["diffusers_not_compared"] == "2 of 3 processes ran a diffusers mode", row
    assert "vs_diffusers_best" not in row and row["targets"]["faster_than_diffusers_best"] is None, row
    # An older command's failure is not the newer row's.
    old = [run(k + 10, ["leaf_stream"], failed="block_stream") for k in range(3)]
    new = [run(k + 20, ["leaf_stream", "block_stream"]) for k in range(3)]
    r, doc = merge(("c1", old), ("c2", new))
    assert r.returncode == 0 and doc["cases"][0]["commit"] == "c2" and "diffusers_failed" not in doc["cases"][0], (r, doc)
    r, doc = merge(("c1", old))
    assert doc["cases"][0]["diffusers_failed"] == {"block_stream": "out of memory"}
    # A mode that ran in two of three processes is named with its count, and no
    # spread of two is shown beside the row's three.
    r, doc = merge(("c1", [run(30, ["leaf_stream", "block_stream"]), run(31, ["leaf_stream", "block_stream"]), run(32, ["leaf_stream"])]))
    row = doc["cases"][0]
    assert set(row["diffusers_s"]) == {"leaf_stream"} and row["diffusers_partial"] == {"block_stream": "2 of 3 processes"}, row


def test_a_merge_of_fewer_than_three_processes_is_a_marked_probe_or_refused(tmp_path):
    common = dict(model="flux-dev", case="1024", tokens=4608, batch=1, weights_device_bytes=1, activations_peak_bytes=1,
                  output_finite=True, output_nonconstant=True)
    rows = [dict(common, mode="resident", steps_s=[0.2] * 3),
            dict(common, mode="offload", steps_s=[0.43] * 3, depth=1, bytes_per_step=22e9, h2d_bytes_per_s=55e9,
                 bitwise_equal=True, host_syncs_in_timed_steps=0)]
    run = tmp_path / "r.json"
    run.write_text(json.dumps(dict(versions="test", cases=rows)))
    out = tmp_path / "m.json"
    args = [sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", "2026-12-05", "--out", str(out),
            "--min-runs", "1", "--at", "c1", str(run)]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode != 0 and "at least three processes" in r.stderr and not out.exists(), r.stderr
    r = subprocess.run(args + ["--probe"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["probe"] is True


def test_the_fp8_target_is_computed_against_the_resident_step(tmp_path):
    # flux-dev-fp8 at 1024²: the package's step over the resident fp8 step, per
    # process, its median held to 1.05, computed by py_merge.py.
    def run(k, ours, resident, model="flux-dev-fp8"):
        common = dict(model=model, case="1024", tokens=4608, batch=1, weights_device_bytes=1, activations_peak_bytes=1,
                      output_finite=True, output_nonconstant=True)
        rows = [dict(common, mode="resident", steps_s=[resident] * 3),
                dict(common, mode="offload", steps_s=[ours] * 3, depth=1, bytes_per_step=11e9, h2d_bytes_per_s=55e9,
                     bitwise_equal=True, host_syncs_in_timed_steps=0),
                dict(common, mode="leaf_stream", steps_s=[0.3] * 3)]
        p = tmp_path / f"r{k}.json"
        p.write_text(json.dumps(dict(versions="test", cases=rows)))
        return str(p)

    # Every Flux-dev fp8 variant (which Linears are fp8, coded or not) is held to
    # it; a bf16 row is not.
    for model, ours, met in [("flux-dev-fp8", 0.205, True), ("flux-dev-fp8", 0.215, False),
                             ("flux-dev-fp8-linears-coded", 0.209, True), ("flux-dev-fp8-linears", 0.211, False),
                             ("flux-dev", 0.205, None)]:
        runs = [run(k, ours, 0.2, model) for k in range(3)]
        out = tmp_path / "m.json"
        subprocess.run([sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", "2026-12-03", "--out", str(out),
                        "--at", "c0ffee", *runs], check=True, capture_output=True)
        row = json.loads(out.read_text())["cases"][0]
        assert abs(row["vs_resident"]["median"] - ours / 0.2) < 1e-9, model
        if met is None:
            assert "within_1_05_of_resident" not in row["targets"], model
            continue
        assert abs(row["vs_resident"]["median"] - ours / 0.2) < 1e-9, model
        assert row["targets"]["within_1_05_of_resident"] is met, model


def test_a_diffusers_mode_that_failed_is_named_and_no_target_is_met_without_an_anchor(tmp_path):
    def run(k, leaf_fails):
        common = dict(model="flux-dev-gguf-q4_k", case="1024", tokens=4608, batch=1, weights_device_bytes=1, activations_peak_bytes=1,
                      output_finite=True, output_nonconstant=True)
        rows = [dict(common, mode="resident", steps_s=[0.1] * 3),
                dict(common, mode="offload", steps_s=[0.25] * 3, depth=1, bytes_per_step=11e9, link_bytes_per_step=10e9,
                     h2d_bytes_per_s=50e9, bitwise_equal=True, host_syncs_in_timed_steps=0),
                dict(model="flux-dev-gguf-q4_k", case="1024", mode="block_stream", error="RuntimeError: boom")]
        rows.append(dict(model="flux-dev-gguf-q4_k", case="1024", mode="leaf_stream", error="TypeError: no") if leaf_fails
                    else dict(common, mode="leaf_stream", steps_s=[0.3] * 3))
        p = tmp_path / f"r{k}-{leaf_fails}.json"
        p.write_text(json.dumps(dict(versions="test", cases=rows)))
        return str(p)

    for leaf_fails in (True, False):
        out = tmp_path / "m.json"
        subprocess.run([sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", "2026-12-03", "--out", str(out),
                        "--at", "c0ffee", *[run(k, leaf_fails) for k in range(3)]], check=True, capture_output=True)
        row = json.loads(out.read_text())["cases"][0]
        assert row["diffusers_failed"]["block_stream"] == "RuntimeError: boom"
        # The bound from the bytes on the link: max(0.1, 10e9 / 50e9) = 0.2 s (not 11e9's 0.22).
        assert row["link_bytes_per_step"] == 10e9 and abs(row["bound_s"]["median"] - 0.2) < 1e-12
        if leaf_fails:
            assert row["diffusers_failed"]["leaf_stream"] == "TypeError: no"
            assert row["targets"]["faster_than_diffusers_best"] is None and "vs_diffusers_best" not in row
        else:
            assert row["diffusers_best_mode"] == "leaf_stream" and row["targets"]["faster_than_diffusers_best"] is True


def _flux_run(path, offload_fields=(), gpu=None):
    """A process's run file of flux-dev 1024 (resident, ours, diffusers' block mode),
    ours with ``offload_fields`` set, recording ``gpu`` where given; its path."""
    common = dict(model="flux-dev", case="1024", tokens=4608, batch=1, weights_device_bytes=1, activations_peak_bytes=1,
                  output_finite=True, output_nonconstant=True)
    off = dict(common, mode="offload", steps_s=[0.2] * 3, depth=1, bytes_per_step=10e9, h2d_bytes_per_s=50e9,
               bitwise_equal=True, host_syncs_in_timed_steps=0, **dict(offload_fields))
    doc = dict(versions="test", cases=[dict(common, mode="resident", steps_s=[0.1] * 3), off, dict(common, mode="block_stream", steps_s=[0.3] * 3)])
    if gpu:
        doc["gpu"] = gpu
    path.write_text(json.dumps(doc))
    return str(path)


def _py_merge(tmp_path, runs):
    out = tmp_path / "m.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", "2026-12-05", "--out", str(out),
                        "--at", "c0ffee", *runs], capture_output=True, text=True)
    return r, (json.loads(out.read_text()) if r.returncode == 0 else None)


def test_a_compiled_row_is_asked_to_beat_diffusers_only_where_its_bound_is_the_links(tmp_path):
    # A compiled row is asked to be faster than diffusers' best compiled offloaded mode wherever the
    # bound is above the resident compiled step. Copy-bound (10e9 B at 50e9 B/s:
    # 0.2 s over a 0.1 s resident step) it is asked; compute-bound (a 0.3 s
    # resident step) not, and the row says why; an uncompiled row always is.
    for name, resident, asked in (("flux-dev-compiled", 0.1, True), ("flux-dev-compiled", 0.3, False), ("flux-dev", 0.3, True)):
        runs = []
        for k in range(3):
            p = tmp_path / f"{name}-{resident}-{k}.json"
            _flux_run(p)
            d = json.loads(p.read_text())
            for r in d["cases"]:
                r["model"] = name
                if r["mode"] == "offload":
                    r["steps_s"] = [max(resident, 0.2) * 1.01] * 3
                if r["mode"] == "resident":
                    r["steps_s"] = [resident] * 3
                if r["mode"] == "block_stream":
                    r["steps_s"] = [max(resident, 0.2) * 1.5] * 3
            p.write_text(json.dumps(d))
            runs.append(str(p))
        r, merged = _py_merge(tmp_path, runs)
        assert r.returncode == 0, r.stderr
        row = merged["cases"][0]
        if asked:
            assert row["targets"]["faster_than_diffusers_best"] is True and "diffusers_not_asked" not in row, row
        else:
            assert "faster_than_diffusers_best" not in row["targets"] and "compute-bound" in row["diffusers_not_asked"], row
            assert row["vs_diffusers_best"]["median"] < 1.0
        if "-compiled" in name:
            # Runs that did not count dynamo's frames judge no recompilation: not met.
            assert row["targets"]["no_recompiles_after_warmup"] is None, row
    # Counted: met where no process compiled a frame in its timed steps, not where one did.
    for frames, met in (([0, 0, 0], True), ([0, 2, 0], False)):
        for k, n in enumerate(frames):
            p = tmp_path / f"flux-dev-compiled-0.1-{k}.json"
            d = json.loads(p.read_text())
            for r in d["cases"]:
                r["frames_compiled_in_timed_steps"] = n
            p.write_text(json.dumps(d))
        r, merged = _py_merge(tmp_path, [str(tmp_path / f"flux-dev-compiled-0.1-{k}.json") for k in range(3)])
        row = merged["cases"][0]
        assert row["frames_compiled_in_timed_steps"] == frames and row["targets"]["no_recompiles_after_warmup"] is met, row



def test_a_constant_or_non_finite_output_misses_its_target(tmp_path):
    # Bitwise equal is not enough: an output equal to a constant (or non-finite)
    # resident one meets no target of its own.
    for field in (None, "output_finite", "output_nonconstant"):
        runs = [_flux_run(tmp_path / f"r{k}-{field}.json", {field: False} if field and k == 1 else {}) for k in range(3)]
        row = _py_merge(tmp_path, runs)[1]["cases"][0]
        assert row["targets"]["outputs_finite_and_nonconstant"] is (field is None), (field, row["targets"])
        assert row["outputs_finite_and_nonconstant"] is (field is None)


def test_modes_that_timed_different_step_counts_are_not_compared(tmp_path):
    runs = [_flux_run(tmp_path / f"s{k}.json") for k in range(3)]
    assert _py_merge(tmp_path, runs)[0].returncode == 0
    doc = json.loads(pathlib.Path(runs[1]).read_text())
    doc["cases"][1]["steps_s"] = [0.2] * 5
    pathlib.Path(runs[1]).write_text(json.dumps(doc))
    r, _ = _py_merge(tmp_path, runs)
    assert r.returncode != 0 and "timed different numbers of steps" in r.stderr, r.stderr


def test_the_merge_takes_the_gpu_from_the_runs(tmp_path):
    def merge(gpus):
        r, doc = _py_merge(tmp_path, [_flux_run(tmp_path / f"g{k}-{g}.json", gpu=g) for k, g in enumerate(gpus)])
        return r, (doc["gpu"] if doc else None)

    assert merge(["NVIDIA B200"] * 3)[1] == "NVIDIA B200", "the runs' GPU, not --gpu's default"
    assert merge([None] * 3)[1] == "NVIDIA H200", "runs from before they recorded it: --gpu"
    r, _ = merge(["NVIDIA B200", "NVIDIA H200", "NVIDIA H200"])
    assert r.returncode != 0 and "different GPUs" in r.stderr
    r, _ = merge(["NVIDIA B200", None, None])
    assert r.returncode != 0 and "some runs record their GPU" in r.stderr


def test_a_step_under_its_bound_names_the_term_that_read_wrong(tmp_path):
    # One process's resident step read slow (its bound is that step): the row says
    # so, rather than blaming the bandwidth; a bandwidth that read low is named too.
    def run(k, resident, h2d):
        common = dict(model="m", case="1024", tokens=1, batch=1, weights_device_bytes=1, activations_peak_bytes=1,
                      output_finite=True, output_nonconstant=True)
        rows = [dict(common, mode="resident", steps_s=[resident] * 3),
                dict(common, mode="offload", steps_s=[0.22] * 3, depth=1, bytes_per_step=11e9, h2d_bytes_per_s=h2d,
                     bitwise_equal=True, host_syncs_in_timed_steps=0)]
        p = tmp_path / f"r{k}-{resident}-{h2d}.json"
        p.write_text(json.dumps(dict(versions="test", cases=rows)))
        return str(p)

    for runs, said in [([run(0, 0.25, 100e9), run(1, 0.216, 100e9), run(2, 0.216, 100e9)], "resident step (0.2500 s"),
                       ([run(0, 0.1, 11e9 / 0.25), run(1, 0.1, 11e9 / 0.22), run(2, 0.1, 11e9 / 0.22)], "bandwidth probe read below")]:
        out = tmp_path / "m.json"
        subprocess.run([sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", "2026-12-04", "--out", str(out),
                        "--at", "c0ffee", *runs], check=True, capture_output=True)
        row = json.loads(out.read_text())["cases"][0]
        assert said in row["bound_suspect"], row["bound_suspect"]
        assert row["targets"]["within_1_02_of_bound"] is False


def _anchor(name):
    """The bench's anchor script `bench/anchors/NAME.py`, imported."""
    import importlib

    sys.path.insert(0, str(ROOT / "bench" / "anchors"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_the_start_merge_judges_each_target_from_the_runs():
    # Host RAM at 1 x: start <= 2 s, host memory beyond the page cache
    # <= 1 GiB (a failed reading, 0, is not a pass), every block in place, bitwise.
    m = _anchor("py_start")

    def run(k, start=1.2, rss=900 << 20, **kw):
        r = dict(model="flux-dev", case="1024", commit="abc", gpu="H200", versions="v", file_bytes=23 << 30, start_s=start,
                 host_rss_before_enable_bytes=700 << 20, host_rss_first_step_bytes=rss, in_place=57, copied=0, copy_reason=None,
                 steps_streamed_s=[0.43 + k * 1e-3] * 3, steps_resident_s=[0.17] * 3, step_bytes=22 << 30,
                 bandwidth_bytes_per_s=55e9, bitwise_equal=True, output_finite=True, output_nonconstant=True)
        r.update(kw)
        return r

    files = ["r1.json", "r2.json", "r3.json"]
    d = m.merge([run(0), run(1, start=1.5), run(2, start=1.1)], files, "2026-12-04")
    assert d["meets_targets"] is True and d["start_s"] == {"median": 1.2, "min": 1.1, "max": 1.5}, d
    assert abs(d["ratio_to_bound"]["median"] - 0.431 / ((22 << 30) / 55e9)) < 1e-9, d
    assert d["runs"] == files
    for bad, target in [(dict(start=2.1), "start_within_2_s"), (dict(rss=(1 << 30) + 1), "host_rss_within_1_gib"),
                        (dict(rss=0), "host_rss_within_1_gib"), (dict(copied=1), "every_block_in_place"),
                        (dict(bitwise_equal=False), "bitwise_equal")]:
        d = m.merge([run(0), run(1, **bad), run(2)], files, "2026-12-04")
        assert d["targets"][target] is False and d["meets_targets"] is False, (bad, d["targets"])
    assert "start_phases" not in d, "runs without phases make a file without them (the published files rebuild)"
    phased = lambda k, start, enable: run(k, start=start, enable_s=enable, first_step_s=start - enable,  # noqa: E731
                                          dirty_bytes_at_enable=0, writeback_bytes_at_enable=0)
    d = m.merge([phased(0, 1.2, 0.7), phased(1, 1.5, 1.0), phased(2, 1.1, 0.6)], files, "2026-12-04")
    assert d["start_phases"]["enable_s"] == {"median": 0.7, "min": 0.6, "max": 1.0}, d["start_phases"]
    with pytest.raises(SystemExit, match="enable_s \\+ first_step_s"):
        m.merge([phased(0, 1.2, 0.7), dict(phased(1, 1.5, 1.0), first_step_s=0.1), phased(2, 1.1, 0.6)], files, "2026-12-04")
    with pytest.raises(SystemExit, match="at least 3"):
        m.merge([run(0), run(1)], files[:2], "2026-12-04")
    with pytest.raises(SystemExit, match="r2.json is .*def"):
        m.merge([run(0), run(1, commit="def"), run(2)], files, "2026-12-04")


def test_every_python_results_file_holds_the_common_fields():
    # DESIGN.md, Benchmark results: the fields every results file holds.
    case_keys = {"resolution", "batch", "depth", "budget_bytes", "step_resident_s", "step_streamed_s", "bandwidth_gbps",
                 "streamed_bytes", "bound_s", "ratio_to_bound", "peak_device_bytes", "bitwise_equal"}
    for f in sorted((ROOT / "bench" / "results").glob("*-python-*.json")):
        d = json.loads(f.read_text())
        if f.name.endswith("-python-package.json"):
            continue  # py_merge.py's rows: its own table of per-case fields
        missing = {"date", "commit", "gpu", "backend", "model", "cases"} - d.keys()
        assert not missing, f"{f.name}: {missing}"
        assert d["cases"] and all(case_keys <= c.keys() for c in d["cases"]), f"{f.name}: a case lacks {case_keys}"


def test_the_start_bench_runs_end_to_end_on_the_simulated_device(tmp_path):
    # bench/anchors/py_start.py as the GPU runner runs it (write, three processes,
    # merge), on the simulated device and a small Flux of the real class whose
    # block tensors are multiples of 256 bytes: every block served in place from
    # the checkpoint, each process's first streamed step bitwise equal to the
    # resident model loaded from the same file.
    reg = [dict(name="flux-dev", reference=dict(module="diffusers", **{"class": "FluxTransformer2DModel"}, config=dict(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])),
        cases=[dict(name="64", resolution=64, height=64, frames=1, batch=1, text_tokens=8, image_tokens=16)])]
    (tmp_path / "registry.json").write_text(json.dumps(reg))
    script = str(ROOT / "bench/anchors/py_start.py")
    common = ["--registry", str(tmp_path / "registry.json"), "--case", "64", "--checkpoint", str(tmp_path / "f.safetensors"),
              "--device", "cpu"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "offload-py" / "python"), os.environ.get("PYTHONPATH", "")]))

    def run(*args):
        r = subprocess.run([sys.executable, script, *args], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    run("write", *common)
    runs = [str(tmp_path / f"r{k}.json") for k in range(3)]
    for f in runs:
        assert "blocks in place 4, copied 0" in run("run", *common, "--steps", "2", "--commit", "c0ffee", "--out", f)
    run("merge", "--date", "2026-12-04", "--out", str(tmp_path / "m.json"), *runs)
    d = json.loads((tmp_path / "m.json").read_text())
    assert d["processes"] == 3 and d["bitwise_equal"] is True and d["in_place"] == 4 and d["copied"] == 0, d
    assert d["targets"]["every_block_in_place"] and d["targets"]["bitwise_equal"], d["targets"]
    assert d["start_s"]["min"] > 0 and d["host_rss_first_step_bytes"]["min"] > 0 and d["ratio_to_bound"]["median"] > 0, d
    # The start's phases, each run's adding up to its start.
    ph = d["start_phases"]
    assert ph["enable_s"]["min"] > 0 and ph["first_step_s"]["min"] > 0 and ph["dirty_bytes_at_enable"]["min"] >= 0, ph
    for f in runs:
        r = json.loads(open(f).read())
        assert abs(r["enable_s"] + r["first_step_s"] - r["start_s"]) < 1e-3, r


def test_the_pipeline_bench_runs_end_to_end_on_the_simulated_device(tmp_path):
    # bench/anchors/py_pipeline.py as the GPU runner runs it (processes, then the
    # merge), on the simulated device with a small FluxPipeline of the real classes
    # (transformer and VAE from configs, prompt embeddings passed in): the package's
    # image bitwise equal to the resident one; the merge's comparison computed.
    flux = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=128, num_attention_heads=2,
                joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])
    vae = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32, 32], layers_per_block=1, norm_num_groups=32,
               down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, use_quant_conv=False,
               use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159)
    reg = [dict(name="flux-dev", reference={"module": "diffusers", "class": "FluxTransformer2DModel", "config": flux}, cases=[]),
           dict(name="flux-vae", reference={"module": "diffusers", "class": "AutoencoderKL", "config": vae}, cases=[])]
    (tmp_path / "registry.json").write_text(json.dumps(reg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "offload-py" / "python"), os.environ.get("PYTHONPATH", "")]))
    script = str(ROOT / "bench/anchors/py_pipeline.py")
    runs = [str(tmp_path / f"p{k}.json") for k in range(3)]
    for f in runs:
        r = subprocess.run([sys.executable, script, "run", "--registry", str(tmp_path / "registry.json"), "--res", "32", "--steps", "2",
                            "--calls", "1", "--modes", "resident,offload", "--device", "cpu", "--budget-gib", "1", "--commit", "c0ffee",
                            "--out", f], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, script, "merge", "--date", "2026-12-04", "--out", str(tmp_path / "m.json"), *runs],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "m.json").read_text())
    assert d["processes"] == 3 and d["modes"]["offload"]["bitwise_equal_to_resident"] is True, d
    assert d["targets"]["bitwise_equal"] is True and d["offload_vs_resident"] > 0, d
    # No peak is read on the simulated device: nothing fits, and no diffusers mode ran.
    assert d["targets"]["offload_within_budget"] is False and d["diffusers_best_within_budget"] is None, d


def test_the_pipeline_merge_picks_the_fastest_diffusers_mode_within_the_budget():
    m = _anchor("py_pipeline")
    gib = 1 << 30

    def row(call, peak, equal=True):
        return dict(calls_s=[call] * 3, peak_device_bytes=peak, weights_device_bytes=peak // 2, bitwise_equal=equal, output_finite=True,
                    output_nonconstant=True)

    def run(ours=2.0, equal=True):
        return dict(commit="abc", gpu="H200", versions="v", res=1024, steps=4, budget_gib=8.0,
                    modes=dict(resident=row(1.0, 30 * gib), offload=row(ours, 7 * gib, equal), model_cpu=row(1.5, 25 * gib),
                               group_block=row(2.5, 6 * gib), group_leaf=dict(failed="RuntimeError: x")))

    files = ["a", "b", "c"]
    d = m.merge([run(), run(), run()], files, "2026-12-04")
    # model_cpu is faster but does not fit 8 GiB: the comparison is against group_block.
    assert d["diffusers_best_within_budget"] == "group_block" and d["offload_vs_diffusers_best"] == 2.0 / 2.5, d
    assert d["modes"]["group_leaf"] == {"failed": "RuntimeError: x", "processes": 3}
    assert d["meets_targets"] is True and d["offload_vs_resident"] == 2.0
    assert m.merge([run(3.0), run(3.0), run(3.0)], files, "2026-12-04")["targets"]["faster_than_diffusers_best_within_budget"] is False
    assert m.merge([run(), run(equal=False), run()], files, "2026-12-04")["targets"]["bitwise_equal"] is False
    with pytest.raises(SystemExit, match="at least 3"):
        m.merge([run()], files[:1], "2026-12-04")


def test_a_process_with_profiled_steps_is_not_merged(tmp_path):
    # `zoo_anchor.py --kernels` profiles a step after each mode, between the timed
    # ones: its file says so, and py_merge.py refuses it by name.
    common = dict(model="flux-dev", case="1024", tokens=4608, batch=1, weights_device_bytes=1, activations_peak_bytes=1,
                  output_finite=True, output_nonconstant=True)
    rows = [dict(common, mode="resident", steps_s=[0.2] * 3),
            dict(common, mode="offload", steps_s=[0.43] * 3, depth=1, bytes_per_step=22e9, h2d_bytes_per_s=55e9,
                 bitwise_equal=True, host_syncs_in_timed_steps=0),
            dict(common, mode="leaf_stream", steps_s=[0.5] * 3)]
    runs = []
    for k in range(3):
        p = tmp_path / f"r{k}.json"
        p.write_text(json.dumps(dict(versions="test", cases=rows, **({"kernels_profiled": True} if k == 1 else {}))))
        runs.append(str(p))
    out = tmp_path / "m.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/anchors/py_merge.py"), "--date", "2026-12-03", "--out", str(out),
                           "--at", "c0ffee", *runs], capture_output=True, text=True)
    assert done.returncode != 0 and "r1.json" in done.stderr and "--kernels" in done.stderr, done.stderr
    assert not out.exists()


def test_the_sabotage_tables_rebuild_from_their_conformance_runs(tmp_path):
    # Each published sabotage table is what bench/sabotage_table.py makes of the
    # per-binary tables its GPU run wrote (bench/raw/*-conformance-COMMIT/), byte
    # for byte, and says every break was caught or names it n/a.
    files = sorted((ROOT / "bench" / "results").glob("*-sabotage-h[0-9]*.json"))
    assert files, "no sabotage table"
    for f in files:
        d = json.loads(f.read_text())
        raw = sorted((ROOT / "bench" / "raw").glob(f"*-conformance-{d['commit']}"))
        assert len(raw) == 1, f"{f.name}: raw runs for {d['commit']}: {raw}"
        work = tmp_path / d["commit"]
        work.mkdir()
        for part in raw[0].glob("sabotage-*.json"):
            (work / part.name).write_bytes(part.read_bytes())
        subprocess.run([sys.executable, str(ROOT / "bench/sabotage_table.py"), str(work), d["date"]], check=True, capture_output=True)
        card = f.name.rsplit("-", 1)[1]  # h200.json, h100.json
        assert (work / f"sabotage-{card}").read_bytes() == f.read_bytes(), f"{f.name} is not what sabotage_table.py makes of {raw[0].name}"
        assert d["all_caught"] and all(r["caught"] in (True, "n/a") for r in d["rows"])
        assert d["not_applicable"] == [f'{r["backend"]} {r["sabotage"]}' for r in d["rows"] if r["caught"] == "n/a"]


@pytest.mark.parametrize("name,runs,prefix,date", [
    ("2026-11-30-vulkan-h200-1c120c6.json", [f"2026-11-30-vulkan-run{k}-1c120c6.json" for k in (1, 2, 3)], "vulkan", ""),
    ("2026-11-30-vulkan-h200-d9f43c7.json", [f"2026-12-01-gpu-d9f43c7/vulkan-run{k}.json" for k in (1, 2, 3)], "vulkan", ""),
    ("2026-12-01-vulkan-h200-e366cc3.json", [f"2026-12-01-vulkan-split-e366cc3/vulkan-split-run{k}.json" for k in (1, 2, 3)],
     "vulkan-split", "2026-12-01"),
])
def test_the_vulkan_results_files_rebuild_from_their_runs(tmp_path, name, runs, prefix, date):
    # Each published Vulkan file is what bench/vulkan_merge.py makes of its three
    # `vulkan-bench` runs (kept in bench/raw/, some renamed with their commit),
    # byte for byte; runs made without BENCH_DATE take the merge's.
    for k, run in enumerate(runs, 1):
        (tmp_path / f"{prefix}-run{k}.json").write_bytes((ROOT / "bench" / "raw" / run).read_bytes())
    env = dict(os.environ, BENCH_DATE=date)
    subprocess.run([sys.executable, str(ROOT / "bench/vulkan_merge.py"), str(tmp_path), prefix], env=env, check=True, capture_output=True)
    got = (tmp_path / f"{prefix}-h200.json").read_bytes()
    assert got == (ROOT / "bench" / "results" / name).read_bytes(), f"{name} is not what vulkan_merge.py makes of its runs"


def test_the_rerun_check_sets_new_medians_against_the_published_spread(tmp_path):
    # bench/rerun_check.py on a published zoo file: a re-run whose medians sit at
    # the published ones is within; one whose streamed step left the published
    # [min, max] is named, and the command fails; a file with no common row fails.
    published = ROOT / "bench/results/2026-12-02-zoo-tch.json"
    doc = json.loads(published.read_text())

    def run(new):
        p = tmp_path / "new.json"
        p.write_text(json.dumps(new))
        r = subprocess.run([sys.executable, str(ROOT / "bench/rerun_check.py"), str(p), str(published), "--out", str(tmp_path / "out.json")],
                           capture_output=True, text=True)
        return r.returncode, json.loads((tmp_path / "out.json").read_text())

    rc, out = run(doc)
    assert rc == 0 and out["all_within"] and len(out["rows"]) == len(doc["cases"]), out
    # The link and the ratio to the bound beside each row, new and published, not judged.
    c0 = doc["cases"][0]
    assert out["rows"][0]["beside"] == {w: {"new": c0[w], "published": c0[w]} for w in ("bandwidth_gbps", "ratio_to_bound")}, out
    faster_link = json.loads(json.dumps(doc))
    faster_link["cases"][0]["bandwidth_gbps"] = c0["bandwidth_gbps"] * 1.1
    rc, out = run(faster_link)
    assert rc == 0 and out["rows"][0]["beside"]["bandwidth_gbps"]["new"] == c0["bandwidth_gbps"] * 1.1, out
    slower = json.loads(json.dumps(doc))
    c = slower["cases"][0]
    c["step_streamed_s"] = c["step_streamed_s_max"] * 1.01
    rc, out = run(slower)
    assert rc == 1 and out["outside"] == [f'{c["model"]} {c["case"]} d={c["depth"]}'], out
    assert out["rows"][0]["step_streamed_s"]["within"] is False and out["rows"][0]["step_resident_s"]["within"] is True
    none = dict(doc, cases=[dict(c, model="no-such-model")])
    rc, out = run(none)
    assert rc == 1 and out["rows"] == [] and not out["all_within"], out
    # A partial re-run: its verdict names the published rows it does not cover.
    first = dict(doc, cases=doc["cases"][:1])
    rc, out = run(first)
    assert rc == 0 and len(out["rows"]) == 1 and len(out["not_rerun"]) == len(doc["cases"]) - 1, out
    # Another backend's file is refused, not compared.
    p = tmp_path / "new.json"
    p.write_text(json.dumps(dict(doc, backend="cuda")))
    r = subprocess.run([sys.executable, str(ROOT / "bench/rerun_check.py"), str(p), str(published)], capture_output=True, text=True)
    assert r.returncode == 2 and "backend" not in r.stdout and "cuda re-run" in r.stderr, r


def test_the_vulkan_and_sabotage_merges_refuse_what_would_pass_vacuously(tmp_path):
    # vulkan_merge.py: runs of two commits (or none) are no one figure; sabotage_table.py:
    # backends that ran different breaks (or none) cannot be "all caught".
    def vk(k, commit, gpu="NVIDIA H100 80GB HBM3"):
        case = dict(case="1024", depth=1, step_streamed_s=0.3, step_resident_s=0.2, bound_s=0.29, ratio_to_bound=1.03,
                    bandwidth_gbps=50.0, streamed_bytes=1, peak_device_bytes=1, bitwise_equal=True, misses=0)
        doc = dict(date="2026-12-04", commit=commit, gpu=gpu, model="m", bandwidth_gbps=50.0, cuda_bandwidth_gbps=54.0, cases=[case])
        (tmp_path / f"vk-run{k}.json").write_text(json.dumps(doc))

    def vulkan():
        return subprocess.run([sys.executable, str(ROOT / "bench/vulkan_merge.py"), str(tmp_path), "vk"], capture_output=True, text=True)

    assert vulkan().returncode != 0, "no runs merged"
    for k, c in enumerate(["a", "a", "a"]):
        vk(k, c)
    assert vulkan().returncode == 0
    # The file names the runs' GPU (an H100's runs once went into "-h200.json").
    assert (tmp_path / "vk-h100.json").exists() and not (tmp_path / "vk-h200.json").exists()
    vk(2, "a", gpu="NVIDIA H200")
    r = vulkan()
    assert r.returncode != 0 and "several GPUs" in r.stderr, r
    vk(2, "a")
    vk(3, "b")
    r = vulkan()
    assert r.returncode != 0 and "several commits" in r.stderr, r

    sab = tmp_path / "sab"
    sab.mkdir()

    def table(rows):
        (sab / "sabotage-x.json").write_text(json.dumps(dict(commit="a", gpu="g", rows=rows)))
        return subprocess.run([sys.executable, str(ROOT / "bench/sabotage_table.py"), str(sab)], capture_output=True, text=True)

    assert table([]).returncode != 0, "an empty table passed"
    row = lambda b, s: dict(backend=b, sabotage=s, caught=True)
    assert table([row("cuda", "SkipWait"), row("vulkan", "SkipWait")]).returncode == 0
    r = table([row("cuda", "SkipWait"), row("cuda", "EarlyRelease"), row("vulkan", "SkipWait")])
    assert r.returncode != 0 and "the same breaks" in r.stderr, r

