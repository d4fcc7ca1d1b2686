"""Planning: a device budget, a calibration from a traced step, a pipeline under one
budget, resident blocks by name. CPU rows run on the simulated device; CUDA rows print SKIPPED
without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import pytest
import torch

import offload
from offload import OffloadError
from models import MODELS
from helpers import _bits, _out, _snapshot, _same_snapshot, _Lin


def _t5_block_and_resident(model):
    """A T5 encoder block's bytes in its slot (each tensor 256-byte aligned), and
    the bytes that stay resident (the tensors outside the blocks)."""
    block = sum(-(-p.numel() * p.element_size() // 256) * 256 for p in model.encoder.block[1].parameters())
    resident = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".block." not in n)
    resident += sum(b.numel() * b.element_size() for b in model.buffers())
    return block, resident



def test_a_calibration_taken_from_a_checkpoint_plans_the_module_with_or_without_it(tmp_path):
    # A ring served from a checkpoint lays its blocks out as the file does, with
    # other padding than the host store's own layout: its calibration still
    # plans the same module, served from the file or not (bytes within the
    # tensors' alignment), and another module's is still refused.
    from safetensors.torch import save_file

    model, inputs, _ = MODELS["flux"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    h = offload.enable(model, device="cpu", checkpoint=str(path))
    names = list(offload.find_blocks(model))
    blocks = [f"{n}.{i}" for n in names for i in range(len(model.get_submodule(n)))]
    cal = h.calibration(compute_s={b: 0.01 for b in blocks})
    offload.disable(model)
    plain = offload.enable(model, device="cpu")
    own = plain.calibration(compute_s={b: 0.01 for b in blocks})
    offload.disable(model)
    # The file's layout is not the store's: the case this test is for.
    assert [b["bytes"] for b in cal["blocks"]] != [b["bytes"] for b in own["blocks"]], (cal, own)
    for kw in ({}, {"checkpoint": str(path)}):
        h = offload.enable(model, device="cpu", budget_gib=1.0, calibration=cal, **kw)
        with torch.no_grad():
            out = _out(model(**inputs))
        offload.disable(model)
        assert torch.equal(_bits(out), _bits(ref)), kw
    # Bytes beyond the tensors' alignment are another module's.
    bad = dict(cal, blocks=[dict(b, bytes=b["bytes"] + (1 << 20)) if i == 1 else b for i, b in enumerate(cal["blocks"])])
    with pytest.raises(OffloadError, match=r"calibration block .* bytes.*calibrate this module"):
        offload.enable(model, device="cpu", budget_gib=1.0, calibration=bad)



def test_a_budget_keeps_the_blocks_it_holds_resident():
    from models import t5

    model, inputs, blocks = t5(layers=5)
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    block, resident = _t5_block_and_resident(model)
    # Room for the two slots at depth 1 and one more block: one block stays resident.
    h = offload.enable(model, device="cpu", budget_gib=(resident + 3 * block + 1024) / 2**30)
    with torch.no_grad():
        model(**inputs)
        out = _out(model(**inputs))
    m = h.metrics()
    offload.disable(model)
    assert torch.equal(_bits(out), _bits(ref))
    assert m["resident_hits"] == 1 and m["blocks"] == blocks, m
    with pytest.raises(OffloadError, match="does not hold its resident tensors"):
        offload.enable(model, device="cpu", budget_gib=resident / 2**31)
    with pytest.raises(OffloadError, match="below what the plan needs|budget"):
        offload.enable(model, device="cpu", budget_gib=(resident + block) / 2**30)
    assert offload.offloaded(model) is None



def test_a_calibration_plans_with_the_blocks_compute_times():
    from models import t5

    model, inputs, blocks = t5(layers=6)
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    block, resident = _t5_block_and_resident(model)
    budget = (resident + 3 * block + 1024) / 2**30
    h = offload.enable(model, device="cpu")
    # Block 3 computes for a second, the others not at all; each copy takes half a
    # second: the ring's replay is shortest with block 3 resident (2.5 s a step
    # against 3.0 for any other), where byte counts alone cannot tell the blocks apart.
    cal = h.calibration(compute_s={f"encoder.block.{i}": (1.0 if i == 3 else 0.0) for i in range(blocks)})
    offload.disable(model)
    assert [b["id"] for b in cal["blocks"]] == [f"encoder.block.{i}" for i in range(blocks)]
    assert cal["bandwidth_bytes_per_s"] > 0
    cal["bandwidth_bytes_per_s"] = cal["blocks"][0]["bytes"] / 0.5
    h = offload.enable(model, device="cpu", budget_gib=budget)
    bytes_only = h.plan()
    offload.disable(model)
    h = offload.enable(model, device="cpu", budget_gib=budget, calibration=cal)
    plan = h.plan()
    assert (plan["depth"], plan["resident_blocks"], plan["chosen_by"]) == (1, ["encoder.block.3"], "budget"), (plan, bytes_only)
    assert "replaying the calibration" in plan["why"] and "by bytes alone" in bytes_only["why"], (plan, bytes_only)
    assert bytes_only["resident_blocks"] != plan["resident_blocks"]
    with torch.no_grad():
        out = _out(model(**inputs))
    m = h.metrics()
    offload.disable(model)
    assert torch.equal(_bits(out), _bits(ref))
    assert m["resident_hits"] == 1, m

    # Named errors: another module's calibration, no budget, a block without a time.
    bad = dict(cal, blocks=[dict(b, bytes=b["bytes"] + (1 << 20)) if b["id"] == "encoder.block.2" else b for b in cal["blocks"]])
    with pytest.raises(OffloadError, match=r"calibration block encoder\.block\.2 .*calibrate this module"):
        offload.enable(model, device="cpu", budget_gib=budget, calibration=bad)
    with pytest.raises(OffloadError, match="has 5 blocks, the module 6"):
        offload.enable(model, device="cpu", budget_gib=budget, calibration=dict(cal, blocks=cal["blocks"][:5]))
    with pytest.raises(OffloadError, match="plans under a device budget"):
        offload.enable(model, device="cpu", calibration=cal)
    with pytest.raises(OffloadError, match="give coded=False"):
        offload.enable(model, device="cpu", budget_gib=budget, calibration=cal, coded=True)
    assert offload.offloaded(model) is None
    h = offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"block encoder\.block\.5 has no time in compute_s"):
        h.calibration(compute_s={f"encoder.block.{i}": 0.1 for i in range(5)})
    with pytest.raises(OffloadError, match="ran in no traced step"):
        h.calibration()
    offload.disable(model)



def test_a_pipeline_streams_every_component_under_one_budget():
    t5, t5_in, _ = MODELS["t5"]()
    flux, flux_in, _ = MODELS["flux"]()
    head = torch.nn.Linear(8, 8).to(torch.bfloat16)
    with torch.no_grad():
        refs = (_out(t5(**t5_in)).clone(), _out(flux(**flux_in)).clone())
    before = (_snapshot(t5), _snapshot(flux))
    pipe = {"text_encoder": t5, "transformer": flux, "vae": head, "scheduler": object()}
    handles = offload.enable_pipeline(pipe, device="cpu", budget_gib=1.0)
    assert set(handles) == {"text_encoder", "transformer"}
    with torch.no_grad():
        outs = (_out(t5(**t5_in)), _out(flux(**flux_in)))
    for o, r in zip(outs, refs):
        assert torch.equal(_bits(o), _bits(r))
    assert handles["transformer"].metrics()["resident_hits"] > 0, "the denoiser keeps blocks resident with the budget left"
    assert handles["text_encoder"].metrics()["resident_hits"] == 0
    offload.disable_pipeline(pipe)
    _same_snapshot(before[0], _snapshot(t5))
    _same_snapshot(before[1], _snapshot(flux))
    with pytest.raises(OffloadError, match="below what streaming needs"):
        offload.enable_pipeline(pipe, device="cpu", budget_gib=1e-6)
    assert offload.offloaded(t5) is None and offload.offloaded(flux) is None



def test_a_failed_pipeline_enable_leaves_what_the_caller_enabled():
    t5, _, _ = MODELS["t5"]()
    flux, _, _ = MODELS["flux"]()
    h = offload.enable(t5, device="cpu")
    with pytest.raises(OffloadError, match="already offloaded"):
        offload.enable_pipeline({"transformer": flux, "text_encoder": t5}, device="cpu")
    assert offload.offloaded(t5) is h, "the caller's component was disabled"
    assert offload.offloaded(flux) is None, "the pipeline's own component was left enabled"
    offload.disable(t5)



def test_a_pipeline_budget_counts_the_buffers_blocks_keep_resident():
    # Buffers in blocks stay resident (as a per-layer rotary table does): the
    # pipeline's share for a component counts them, so a budget that holds every
    # component's resident tensors and slots is enough.
    t5, t5_in, _ = MODELS["t5"]()
    flux, flux_in, _ = MODELS["flux"]()
    for blk in t5.encoder.block:
        blk.register_buffer("table", torch.randn(64 << 10))  # 256 KiB a block, resident
    with torch.no_grad():
        refs = (_out(t5(**t5_in)).clone(), _out(flux(**flux_in)).clone())

    def need(m, blocks):
        slot = max(sum(-(-p.numel() * p.element_size() // 256) * 256 for p in b.parameters()) for b in blocks)
        params = sum(p.numel() * p.element_size() for p in m.parameters())
        buffers = sum(b.numel() * b.element_size() for b in m.buffers())
        in_blocks = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
        return params + buffers - in_blocks + 2 * slot

    total = need(t5, list(t5.encoder.block)) + need(flux, list(flux.transformer_blocks) + list(flux.single_transformer_blocks))
    handles = offload.enable_pipeline({"text_encoder": t5, "transformer": flux}, device="cpu", budget_gib=(total + 4096) / (1 << 30))
    with torch.no_grad():
        outs = (_out(t5(**t5_in)), _out(flux(**flux_in)))
    for o, r in zip(outs, refs):
        assert torch.equal(_bits(o), _bits(r))
    offload.disable_pipeline(handles)



def test_disable_pipeline_takes_what_enable_pipeline_returned():
    t5, _, _ = MODELS["t5"]()
    flux, _, _ = MODELS["flux"]()
    handles = offload.enable_pipeline({"text_encoder": t5, "transformer": flux}, device="cpu")
    offload.disable_pipeline(handles)
    assert offload.offloaded(t5) is None and offload.offloaded(flux) is None



def test_a_resident_block_is_planned_under_its_own_name():
    m = _Lin()
    h = offload.enable(m, device="cpu", resident_blocks=["blocks.01"])
    assert h.plan()["resident_blocks"] == ["blocks.1"], h.plan()
    offload.disable(m)



def test_disable_pipeline_leaves_a_later_enable_of_the_same_module_alone():
    m = _Lin()
    handles = offload.enable_pipeline({"transformer": m}, device="cpu")
    offload.disable_pipeline({"transformer": m})
    again = offload.enable(m, device="cpu")
    offload.disable_pipeline(handles)  # an ended handle: nothing to do
    assert offload.offloaded(m) is again
    offload.disable(m)

