"""The training bench (``bench/anchors/train_step.py``) runs its whole step on
the simulated device, and its merge (``train_merge.py``) judges the bound and
the equality from the process files, failing a row that misses them."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytest.importorskip("peft", reason="peft is installed by scripts/python-env.sh")


def _run(tmp_path, i):
    out = tmp_path / f"train-{i}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, str(ROOT / "bench/anchors/train_step.py"), "--tiny", "--device", "cpu", "--steps", "2", "--out", str(out)],
                   check=True, capture_output=True, env=env)
    return json.loads(out.read_text())


def test_the_training_bench_runs_on_the_simulated_device_and_its_merge_judges_each_row(tmp_path):
    sys.path.insert(0, str(ROOT / "bench/anchors"))
    import train_merge

    docs = [_run(tmp_path, i) for i in range(2)]
    for d in docs:
        off = d["modes"]["offload"]
        assert "error" not in off and "error" not in d["modes"]["resident"], d["modes"]
        assert off["vs_resident"]["grads_bitwise_equal"] and off["vs_resident"]["loss_equal"]
        assert off["bytes_per_step"] > 0 and off["backward"]["backward"]
        # The reference's own spread: three resident runs from one state.
        assert d["modes"]["resident"]["repeatable"]["runs"] == 3, d["modes"]["resident"]
        # Where the process's time went, phase by phase, in order.
        assert list(d["phases_s"]) == ["imported", "built", "resident", "offload"], d["phases_s"]
        assert sorted(d["phases_s"].values()) == list(d["phases_s"].values()), d["phases_s"]
        # One traced step after the timed ones: each pass diagnosed apart.
        for p in ("forward", "backward"):
            diag = off["diagnosed"][p]
            assert diag["step_s"] > 0 and diag["summary"].startswith("FluxTransformer2DModel: step"), off["diagnosed"]
    # The simulated device has no link to probe: a rate given here, the bound
    # and the ratio follow from the files.
    for d in docs:
        d["bandwidth_bytes_per_s"] = 1e9
    row = train_merge.merge(docs, ["a", "b"])["rows"][0]
    bounds = [max(d["modes"]["resident"]["step"]["median_s"], d["modes"]["offload"]["bytes_per_step"] / 1e9) for d in docs]
    assert row["bound_s"]["runs"] == bounds and row["targets"]["gradients_equal"]
    # The traced passes' verdicts, as the processes gave them.
    assert row["verdicts"] == {p: sorted({str(d["modes"]["offload"]["diagnosed"][p]["verdict"]) for d in docs})
                               for p in ("forward", "backward")}, row
    # Memory apart: the engine's streamed weights for ours, the activations for each mode.
    assert row["offload"]["weights_bytes"]["runs"] == [d["modes"]["offload"]["device_weight_bytes"] for d in docs]
    assert all("activations_bytes" in row[m] for m in ("resident", "offload")), row
    # The timed steps' losses equal the resident steps', and a row whose losses differ is not met.
    assert row["offload"]["losses_equal_resident"] and row["targets"]["losses_equal"], row
    docs[1]["modes"]["offload"]["losses"] = docs[1]["modes"]["offload"]["losses"][::-1]
    row = train_merge.merge(docs, ["a", "b"])["rows"][0]
    assert not row["offload"]["losses_equal_resident"] and row["targets_met"] is False, row
    docs[1]["modes"]["offload"]["losses"] = docs[1]["modes"]["offload"]["losses"][::-1]
    # A row whose gradients differ is not met.
    docs[0]["modes"]["offload"]["vs_resident"]["grads_bitwise_equal"] = False
    assert train_merge.merge(docs, ["a", "b"])["rows"][0]["targets"]["gradients_equal"] is False
    # Processes at another depth (the package's own choice here) are another
    # row, with the depth each ran at; never pooled with the given depth's.
    assert row["depth"] == "2" and row["depths"] == [2, 2], row
    docs[1]["depth"] = "auto"
    rows = train_merge.merge(docs, ["a", "b"])["rows"]
    assert [(r["depth"], r["processes"]) for r in rows] == [("2", 1), ("auto", 1)], rows
    # A row pools the processes of one commit (rows of a file may differ,
    # each measured in its own session): two commits in one row are refused.
    assert [r["commit"] for r in rows] == [docs[0]["commit"]] * 2
    docs[1]["depth"], docs[1]["commit"] = docs[0]["depth"], "another"
    with pytest.raises(ValueError, match="2 commits"):
        train_merge.merge(docs, ["a", "b"])
    docs[1]["commit"], docs[1]["gpu"] = docs[0]["commit"], "another card"
    with pytest.raises(ValueError, match="2 cards"):
        train_merge.merge(docs, ["a", "b"])


def test_the_package_planned_under_a_budget_from_its_traced_training_step_is_a_mode_of_its_own(tmp_path):
    # `--budget-gib`: after the ring's timed steps, the traced training step's
    # calibration plans the package under the budget (both passes replayed);
    # the planned mode is measured beside the ring, its bound counting the
    # bytes it copies, its weights judged against the budget.
    sys.path.insert(0, str(ROOT / "bench/anchors"))
    import train_merge

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    docs = []
    for i in range(2):
        out = tmp_path / f"train-planned-{i}.json"
        subprocess.run([sys.executable, str(ROOT / "bench/anchors/train_step.py"), "--tiny", "--device", "cpu", "--steps", "2",
                        "--budget-gib", "0.001", "--out", str(out)], check=True, capture_output=True, env=env)
        docs.append(json.loads(out.read_text()))
    for d in docs:
        off, pl = d["modes"]["offload"], d["modes"]["offload_planned"]
        assert "error" not in pl and "calibration_error" not in off, pl
        assert pl["plan"]["chosen_by"] == "budget" and "training step" in pl["plan"]["why"], pl["plan"]
        # The tiny model fits the budget: every block kept, nothing copied, the same gradients.
        assert pl["plan"]["resident_blocks"] and pl["bytes_per_step"] < off["bytes_per_step"], pl
        assert pl["vs_resident"]["grads_bitwise_equal"] and pl["losses"] == d["modes"]["resident"]["losses"]
        d["bandwidth_bytes_per_s"] = 1e6
    row = train_merge.merge(docs, ["a", "b"])["rows"][0]
    planned = row["planned"]
    want = [max(d["modes"]["resident"]["step"]["median_s"], d["modes"]["offload_planned"]["bytes_per_step"] / 1e6) for d in docs]
    assert planned["bound_s"]["runs"] == want and planned["budget_gib"] == [0.001], planned
    assert planned["resident_blocks"] == [len(d["modes"]["offload_planned"]["plan"]["resident_blocks"]) for d in docs]
    assert planned["targets"]["weights_within_budget"] and planned["targets"]["gradients_equal"], planned
    # The ring's own row is unchanged by it, and gains the per-pass bound: the
    # resident step plus each pass's copies not hidden under its own compute.
    want = [d["modes"]["resident"]["step"]["median_s"] + sum(
        max(0.0, d["modes"]["offload"][p]["bytes_copied"] / 1e6 - d["modes"]["offload"]["diagnosed"][p]["compute_s"])
        for p in ("forward", "backward")) for d in docs]
    assert row["pass_bound_s"]["runs"] == want, row
    assert row["ratio_to_pass_bound"]["runs"] == [d["modes"]["offload"]["step"]["median_s"] / w for d, w in zip(docs, want)]
    # A plan holding more than its budget misses its target.
    docs[0]["modes"]["offload_planned"]["device_weight_bytes"] = 2 * (1 << 30)
    planned = train_merge.merge(docs, ["a", "b"])["rows"][0]["planned"]
    assert planned["targets"]["weights_within_budget"] is False and planned["targets_met"] is False, planned
    # Processes under another budget are another row.
    docs[1]["budget_gib"] = 0.002
    assert len(train_merge.merge(docs, ["a", "b"])["rows"]) == 2


def test_the_references_spread_is_the_largest_difference_of_any_pair_of_its_three_runs():
    # Where the resident backward does not repeat itself, ours is held to its
    # spread: every pair of the three runs counts, not only the first pair.
    sys.path.insert(0, str(ROOT / "bench/anchors"))
    import train_step

    g = torch.tensor([1.0, 2.0])
    runs = [(0.5, {"w": g}), (0.5, {"w": g.clone()}), (0.5, {"w": g + torch.tensor([0.0, 0.25])})]
    spread = train_step.spread_of(runs)
    assert spread == {"loss_equal": True, "grads_bitwise_equal": False, "max_abs_grad_diff": 0.25, "runs": 3}, spread
    assert train_step.spread_of(runs[:2])["grads_bitwise_equal"] is True


def test_a_reference_that_breaks_the_cuda_context_is_named_and_nothing_runs_after_it(tmp_path, monkeypatch):
    # A resident step whose kernel leaves an illegal address (the GPU runner's
    # resident Flux-dev backward did): the mode names it, no later mode runs on
    # the broken context, and the modes measured so far reach the file's dict.
    sys.path.insert(0, str(ROOT / "bench/anchors"))
    import train_step
    import zoo_anchor as za

    def broken(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(train_step, "run_mode", broken)
    model = za.build(train_step.TINY["reference"], device="cpu")
    x = za.inputs("flux-dev", train_step.TINY["cases"][0], "cpu")
    args = type("A", (), {"checkpointing": False, "depth": 1, "warmup": 0, "steps": 1, "modes": "resident,offload",
                         "budget_gib": None, "trace": 1})()
    modes = {}
    train_step.measure(model, x, "cpu", args, None, modes)
    assert modes["resident"].get("context_lost") is True and "illegal memory access" in modes["resident"]["error"], modes
    assert "offload" not in modes, modes
    # The package's mode breaking it is named the same way (the resident mode's
    # three runs real, the fourth call the package's).
    monkeypatch.undo()
    real, calls = train_step.run_mode, []

    def third_breaks(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            broken()
        return real(*a, **k)

    monkeypatch.setattr(train_step, "run_mode", third_breaks)
    model = za.build(train_step.TINY["reference"], device="cpu")
    modes = {}
    train_step.measure(model, x, "cpu", args, None, modes)
    assert "error" not in modes["resident"] and modes["offload"].get("context_lost") is True, modes
    # Any other failure of the reference is named and the other modes still run.
    monkeypatch.setattr(train_step, "run_mode", lambda *a, **k: (_ for _ in ()).throw(MemoryError("out of memory")))
    model = za.build(train_step.TINY["reference"], device="cpu")
    modes = {}
    train_step.measure(model, x, "cpu", args, None, modes)
    assert "context_lost" not in modes["resident"] and "offload" in modes, modes


def test_the_cache_loop_bench_runs_on_the_simulated_device_and_its_merge_judges_each_row(tmp_path):
    sys.path.insert(0, str(ROOT / "bench/anchors"))
    import cache_merge

    out = tmp_path / "cache.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # diffusers' documented threshold (the default): with the timestep held,
    # the latents' drift stays under it on most steps, and the cache skips.
    subprocess.run([sys.executable, str(ROOT / "bench/anchors/cache_loop.py"), "--tiny", "--device", "cpu", "--steps", "8",
                    "--warmup-steps", "3", "--out", str(out)], check=True, capture_output=True, env=env)
    d = json.loads(out.read_text())
    res, off = d["modes"]["resident"], d["modes"]["offload"]
    assert "error" not in res and "error" not in off, d["modes"]
    assert res["computed"][0] and not all(res["computed"]), res["computed"]  # some steps answered by the cache
    assert all(off["bitwise_equal_steps"]) and off["same_cache_decisions"]
    # Every block streamed (auto_resident_gib=0): the same steps, judged apart.
    st = d["modes"]["offload_streamed"]
    assert "error" not in st and all(st["bitwise_equal_steps"]) and st["same_cache_decisions"], st
    assert st["plan"]["resident_blocks"] == [], st["plan"]
    assert list(d["phases_s"]) == ["imported", "built", "resident", "offload", "offload_streamed"], d["phases_s"]
    skipped = [m["bytes_copied"] for m, c in zip(off["metrics"], off["computed"]) if not c]
    # A step the cache answered copies less than every block (at most its first
    # block and the prefetches ahead of it), and nothing once the ring holds them.
    assert skipped and min(skipped) == 0 and max(skipped) < off["metrics"][0]["bytes_copied"], off["metrics"]
    d["bandwidth_bytes_per_s"] = 1e9
    row = cache_merge.merge([d], ["a"])["rows"][0]
    want = max(res["loop_s"], sum(m["bytes_copied"] for m in off["metrics"]) / 1e9)
    assert row["bound_s"]["runs"] == [want] and row["targets"]["bitwise_equal"] and row["targets"]["same_cache_decisions"]
    want = max(res["loop_s"], sum(m["bytes_copied"] for m in st["metrics"]) / 1e9)
    assert row["streamed"]["bound_s"]["runs"] == [want] and row["streamed"]["targets"]["bitwise_equal"], row["streamed"]
    # Beside it, each step's own bound summed (a step's copies overlap its own compute only).
    want = sum(max(t, m["bytes_copied"] / 1e9) for t, m in zip(res["step_s"]["runs_s"], st["metrics"]))
    assert row["streamed"]["stepwise_bound_s"]["runs"] == [want], row["streamed"]
    # One untimed loop of three steps first (set-up and the automatic plan paid before), recorded and a key of the row.
    assert d["warmup"] == 1 and row["warmup"] == 1 and d["warmup_steps"] == 3 and row["warmup_steps"] == 3
    d["modes"]["offload"]["same_cache_decisions"] = False
    assert cache_merge.merge([d], ["a"])["rows"][0]["targets_met"] is False
    # A loop whose every step computed measured no cache: its row fails.
    # (The ratio target hangs on the host's timing here: only the cache's is judged.)
    d["modes"]["offload"]["same_cache_decisions"] = True
    assert cache_merge.merge([d], ["a"])["rows"][0]["targets"]["the_cache_answered"] is True
    d["modes"]["resident"]["computed"] = [True] * len(res["computed"])
    row = cache_merge.merge([d], ["a"])["rows"][0]
    assert row["targets"]["the_cache_answered"] is False and row["targets_met"] is False
    # A row pools one commit's processes: a second process at another commit is refused.
    assert row["commit"] == d["commit"]
    with pytest.raises(ValueError, match="2 commits"):
        cache_merge.merge([d, {**d, "commit": "another"}], ["a", "b"])


def test_the_cache_loop_bench_runs_a_tiny_wan_as_its_gpu_row_will(tmp_path):
    # The Wan row's own path (its timestep scale, its 5-D latents, its
    # one-tensor blocks) before the GPU runs Wan 14B's loop: the cache decides
    # as resident, every step bitwise, and a step it answered copies less than
    # the first step's every block.
    out = tmp_path / "wan.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, str(ROOT / "bench/anchors/cache_loop.py"), "--tiny", "wan", "--device", "cpu", "--steps", "8",
                    "--warmup-steps", "3", "--modes", "resident,offload_streamed", "--out", str(out)],
                   check=True, capture_output=True, env=env)
    d = json.loads(out.read_text())
    assert d["model"] == "wan-tiny" and list(d["modes"]) == ["resident", "offload_streamed"], d["modes"].keys()
    res, st = d["modes"]["resident"], d["modes"]["offload_streamed"]
    assert res["finite"] and res["not_constant"] and res["computed"][0] and not all(res["computed"]), res
    assert all(st["bitwise_equal_steps"]) and st["same_cache_decisions"], st
    skipped = [m["bytes_copied"] for m, c in zip(st["metrics"], st["computed"]) if not c]
    assert skipped and max(skipped) < st["metrics"][0]["bytes_copied"], st["metrics"]


def test_the_attention_backend_is_run_recorded_and_refused_beside_deterministic(tmp_path):
    # The training bench under SDPA's math backend on the simulated device:
    # recorded in its file, the modes still equal; --deterministic (math) with
    # another backend is refused, not silently overridden.
    out = tmp_path / "train-math.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, str(ROOT / "bench/anchors/train_step.py"), "--tiny", "--device", "cpu", "--steps", "1"]
    subprocess.run(cmd + ["--attention", "math", "--out", str(out)], check=True, capture_output=True, env=env)
    doc = json.loads(out.read_text())
    assert doc["attention"] == "math" and doc["modes"]["offload"]["vs_resident"]["grads_bitwise_equal"], doc["modes"]
    refused = subprocess.run(cmd + ["--deterministic", "--attention", "flash", "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "--deterministic runs math attention" in refused.stderr, refused.stderr


def test_the_sdpa_probe_runs_each_backend_in_its_own_process_and_names_what_fails(tmp_path):
    # The probe's own check at small shapes on the CPU (on the GPU runner it
    # names the backend whose backward breaks a resident Flux): every backend
    # has a row, each part either measured or its error named.
    out = tmp_path / "sdpa.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, str(ROOT / "bench/anchors/sdpa_probe.py"), str(out), "--device", "cpu"], check=True,
                   capture_output=True, env=env)
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"default", "cudnn", "flash", "efficient", "math"}, rows
    for r in rows.values():
        for part in ("flux_dev_attention", "small_flux_lora"):
            got = r[part]
            assert ("error" in got) != ("finite" in got), (r["backend"], part, got)
    for part in ("flux_dev_attention", "small_flux_lora"):
        assert rows["math"][part]["finite"] and rows["math"][part]["repeatable"], rows["math"]
    # A backend the CPU lacks is named, not passed over.
    assert "No viable backend" in rows["cudnn"]["flux_dev_attention"]["error"]


def test_the_benches_weights_on_the_device_count_no_streamed_placeholder_nor_kept_view(monkeypatch):
    # An offloaded module's streamed weights are placeholders reporting the
    # device they stream to, and its kept blocks are views of the engine's
    # buffers (counted by its metrics): the benches' count of the module's own
    # weights on the device is the parameters left resident, before and after
    # the plan keeps blocks. Whether the traced step is host-bound is the
    # machine's (CI's once was not, and no block was kept): the verdict is
    # made host-bound here, so the plan keeps blocks on every machine.
    import offload._offloaded as offloaded

    monkeypatch.setattr(offloaded, "_host_bound", lambda d, cuda: True)
    sys.path.insert(0, str(ROOT / "bench/anchors"))
    import zoo_anchor as za
    import torch
    from models import flux

    import offload

    model, inputs, _ = flux()
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)
    assert 0 < resident < za.weights_on_device(model, "cpu")
    h = offload.enable(model, device="cpu", auto_resident_gib=1)
    assert za.weights_on_device(model, "cpu") == resident
    with torch.no_grad():
        for _ in range(4):
            model(**inputs)
    assert h.plan()["resident_blocks"], "no block was kept: the check below would not see a kept view"
    assert za.weights_on_device(model, "cpu") == resident
    offload.disable(model)


@pytest.mark.parametrize("name", ["flux", "sd3", "qwen-image", "wan", "t5", "qwen2.5-vl-text"])
def test_the_compiled_registry_rows_compile_every_block_of_each_class(name):
    # zoo_anchor --compile's blocks: diffusers' repeated blocks, else every
    # block of the block lists at any depth (T5's are encoder.block: a look at
    # the model's children alone compiled none, and its row would run eager).
    sys.path.insert(0, str(ROOT / "bench/anchors"))
    import torch
    import zoo_anchor as za
    from models import MODELS

    model, _, blocks = MODELS[name]()
    assert za.compile_blocks(model, "default", fullgraph=True) == blocks
    compiled = [m for m in model.modules() if "_compiled_call_impl" in m.__dict__]
    assert all(type(m).__name__.endswith(("Block", "Layer", "DecoderLayer")) for m in compiled), compiled
    torch._dynamo.reset()
