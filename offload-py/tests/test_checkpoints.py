"""The host store and checkpoints: one host copy, pinned weights let go and back,
a module on the meta device served from its file, a file that differs refused. CPU rows run on the simulated device; CUDA rows print SKIPPED
without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import pytest
import torch

import offload
from offload import OffloadError
from models import MODELS
from helpers import NO_CUDA, DEVICES, _bits, _out, _to, _snapshot, _same_snapshot


@NO_CUDA
def test_cuda_a_mapped_checkpoint_and_the_trace(tmp_path):
    from safetensors.torch import save_file

    model, inputs, _ = MODELS["flux"]()
    model.to("cuda")
    with torch.no_grad():
        ref = _out(model(**_to(inputs, "cuda"))).clone()
    model.to("cpu")
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    h = offload.enable(model, device="cuda", checkpoint=str(path), auto_resident_gib=0)
    h.enable_trace()
    with torch.no_grad():
        out = _out(model(**_to(inputs, "cuda"))).clone()
    h.write_trace(str(tmp_path / "trace.json"))
    # The traced step's compute times make a calibration the planner takes.
    cal = h.calibration()
    offload.disable(model)
    assert torch.equal(_bits(out), _bits(ref))
    assert cal["bandwidth_bytes_per_s"] > 0 and all(b["compute_s"] > 0 for b in cal["blocks"]), cal
    h = offload.enable(model, device="cuda", budget_gib=1.0, calibration=cal)
    with torch.no_grad():
        again = _out(model(**_to(inputs, "cuda"))).clone()
    offload.disable(model)
    assert torch.equal(_bits(again), _bits(ref))
    import json

    events = json.load(open(tmp_path / "trace.json"))
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any("transformer_blocks.0" in str(e.get("name", "")) for e in events), "the trace names the blocks"
    with pytest.raises(OffloadError, match="not in"):
        other, _, _ = MODELS["t5"]()
        offload.enable(other, device="cuda", checkpoint=str(path), auto_resident_gib=0)



@pytest.mark.parametrize("keep", [False, True])
def test_one_host_copy_unless_asked_and_disable_rebuilds_the_same_bytes(keep):
    model, inputs, _ = MODELS["t5"]()
    before = _snapshot(model)
    h = offload.enable(model, device="cpu", keep_host_copy=keep)
    # Between steps a streamed parameter holds an empty placeholder, and the
    # package keeps its old bytes only when asked: the store is the one host copy.
    assert all(p.param.numel() == 0 for p in h._params.values())
    assert all((p.saved is not None) == keep for p in h._params.values())
    with torch.no_grad():
        model(**inputs)
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))



@NO_CUDA
def test_pinned_host_weights_are_let_go_and_come_back_pinned():
    # As a user who moved the model to page-locked memory (and as the bench does):
    # with one host copy, torch's pinned cache gives the let-go tensors back to the
    # system, and disable restores each parameter page-locked, with the same bytes.
    model, inputs, _ = MODELS["flux"]()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.pin_memory()
    before = _snapshot(model)
    owned = lambda: torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    held = owned()
    h = offload.enable(model, device="cuda", auto_resident_gib=0)
    streamed_bytes = sum(p.nbytes for p in h._params.values())
    assert streamed_bytes > 0 and held - owned() >= streamed_bytes, "the let-go page-locked tensors are still held by torch's cache"
    with torch.no_grad():
        model(**_to(inputs, "cuda"))
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))
    assert all(p.is_pinned() for p in model.parameters()), "a parameter came back pageable"



def test_a_failure_while_the_module_changes_puts_it_back_from_the_store(monkeypatch):
    model, _, _ = MODELS["t5"]()
    before = _snapshot(model)
    calls = {"n": 0}
    real = torch.nn.Module.register_forward_pre_hook

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook", failing)
    with pytest.raises(RuntimeError, match="injected"):
        offload.enable(model, device="cpu")
    monkeypatch.undo()
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))
    assert not model.encoder.block[0]._forward_pre_hooks



@pytest.mark.parametrize("dev", DEVICES)
def test_a_module_built_on_the_meta_device_runs_from_its_checkpoint(dev, tmp_path):
    # Host RAM at 1 ×: the model object holds no weights (built on the
    # meta device), the blocks are served from the checkpoint's pages and the
    # other tensors read from it onto the device; the output is the model's with
    # those weights, bit for bit, and disable() puts it back on the meta device.
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from models import flux

    # Heads of 128, as Flux's: every block tensor a multiple of 256 bytes, so each
    # block lies in the file as the store lays it out and is served in place.
    model, inputs, _ = flux(128)
    model.to(dev)
    with torch.no_grad():
        ref = _out(model(**_to(inputs, dev))).clone()
    model.to("cpu")
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.device("meta"):
        empty = FluxTransformer2DModel.from_config(model.config).to(torch.bfloat16).eval()
    assert all(p.is_meta for p in empty.parameters())
    names = [n for n, _ in empty.named_parameters()]
    h = offload.enable(empty, device=dev, checkpoint=str(path), auto_resident_gib=0)
    assert h.host_tier() == {"in_place": 5, "copied": 0, "copy_reason": None}, h.host_tier()
    with torch.no_grad():
        outs = [_out(empty(**_to(inputs, dev))).clone() for _ in range(2)]
    assert h.violations() == []
    offload.disable(empty)
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))
    assert [n for n, _ in empty.named_parameters()] == names and all(p.is_meta for p in empty.parameters())
    # Without a checkpoint, or with one that lacks a tensor outside the blocks or
    # holds it in another dtype: named errors, the module left on the meta device.
    with pytest.raises(OffloadError, match="meta device; give checkpoint="):
        offload.enable(empty, device=dev, auto_resident_gib=0)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    del state["proj_out.weight"]
    save_file(state, str(tmp_path / "lacking.safetensors"))
    with pytest.raises(OffloadError, match="'proj_out.weight' is on the meta device and not in"):
        offload.enable(empty, device=dev, checkpoint=str(tmp_path / "lacking.safetensors"), auto_resident_gib=0)
    state["proj_out.weight"] = model.state_dict()["proj_out.weight"].float()
    save_file(state, str(tmp_path / "f32.safetensors"))
    with pytest.raises(OffloadError, match=r"'proj_out.weight' is BF16 .* F32"):
        offload.enable(empty, device=dev, checkpoint=str(tmp_path / "f32.safetensors"), auto_resident_gib=0)
    assert offload.offloaded(empty) is None and all(p.is_meta for p in empty.parameters())
    # Heads of 16: a block's norm weights are 32 bytes, the next tensor is not where
    # the store would lay it: the block is copied, and the reason names it.
    small, _, _ = flux(16)
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, str(tmp_path / "small.safetensors"))
    with torch.device("meta"):
        empty = FluxTransformer2DModel.from_config(small.config).to(torch.bfloat16).eval()
    h = offload.enable(empty, device=dev, checkpoint=str(tmp_path / "small.safetensors"), auto_resident_gib=0)
    tier = h.host_tier()
    offload.disable(empty)
    assert tier["in_place"] == 0 and tier["copied"] == 5 and "not a multiple of 256" in tier["copy_reason"], tier



def test_a_meta_module_with_tied_weights_runs_from_a_checkpoint_that_saved_them_once(tmp_path):
    # T5's embedding is shared by `shared` and `encoder.embed_tokens`; a checkpoint
    # saves it under one name (safetensors' save_model): the meta module takes it
    # for both, one tensor on the device, bitwise the resident output.
    from safetensors.torch import save_model
    from transformers import T5EncoderModel

    model, inputs, _ = MODELS["t5"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    path = tmp_path / "t5.safetensors"
    save_model(model, str(path))
    with torch.device("meta"):
        empty = T5EncoderModel(model.config).to(torch.bfloat16).eval()
    assert empty.shared.weight is empty.encoder.embed_tokens.weight
    h = offload.enable(empty, device="cpu", checkpoint=str(path))
    assert empty.shared.weight is empty.encoder.embed_tokens.weight and not empty.shared.weight.is_meta
    with torch.no_grad():
        out = _out(empty(**inputs)).clone()
    assert h.violations() == []
    offload.disable(empty)
    assert torch.equal(_bits(out), _bits(ref))
    assert empty.shared.weight is empty.encoder.embed_tokens.weight and empty.shared.weight.is_meta



def test_a_checkpoint_whose_bytes_differ_from_the_modules_is_refused(tmp_path):
    # The store serves the file's bytes and disable gives them back: a module
    # holding other weights (fine-tuned, fused) would compute with the file's and
    # lose its own. Refused by name, the module as it was.
    from safetensors.torch import save_file

    model, _, _ = MODELS["flux"]()
    path = tmp_path / "flux.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    with torch.no_grad():
        model.transformer_blocks[0].attn.to_q.weight.add_(1)
    before = _snapshot(model)
    with pytest.raises(OffloadError, match=r"transformer_blocks\.0\.attn\.to_q\.weight.*bytes differ from .*flux\.safetensors"):
        offload.enable(model, device="cpu", checkpoint=str(path))
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))

