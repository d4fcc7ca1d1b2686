"""Bad input is a named error and leaves the module as it was: what cannot stream,
what was changed while offloaded, bad arguments, refused nesting. CPU rows run on the simulated device; CUDA rows print SKIPPED
without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import pytest
import torch

import offload
from offload import OffloadError
from models import MODELS
from helpers import _bits, _out, _snapshot, _same_snapshot, _Lin, _Running


_CHANGES = {
    "replaced": lambda m: setattr(m.blocks[1], "weight", torch.nn.Parameter(torch.zeros(8, 8))),
    "data_set": lambda m: setattr(m.blocks[1].weight, "data", torch.zeros(8, 8)),
    "edited_in_place": lambda m: m.blocks[1].bias.zero_(),
    "initialised": lambda m: torch.nn.init.zeros_(m.blocks[2].weight),
    "removed": lambda m: setattr(m.blocks[1], "bias", None),
}



def test_a_tensor_subclass_the_package_cannot_stream_is_named():
    class Odd(torch.nn.Parameter):
        pass

    model, _, _ = MODELS["t5"]()
    before = _snapshot(model)
    blk = model.encoder.block[1].layer[0].SelfAttention.q
    blk.weight = Odd(blk.weight.detach(), requires_grad=False)
    with pytest.raises(OffloadError, match=r"encoder\.block\.1\.layer\.0\.SelfAttention\.q\.weight.*tensor subclass"):
        offload.enable(model, device="cpu")
    assert offload.offloaded(model) is None



def test_a_module_without_block_list_is_a_named_error():
    with pytest.raises(OffloadError, match=r"'Linear'.*no block list"):
        offload.enable(torch.nn.Linear(4, 4), device="cpu")



def test_enabling_twice_is_refused_and_leaves_the_module_as_it_was():
    model, inputs, _ = MODELS["t5"]()
    offload.enable(model, device="cpu")
    snap = _snapshot(model)
    with pytest.raises(OffloadError, match="already offloaded"):
        offload.enable(model, device="cpu")
    _same_snapshot(snap, _snapshot(model))
    offload.disable(model)
    with pytest.raises(OffloadError, match="not offloaded"):
        offload.disable(model)



def test_a_failed_enable_leaves_the_module_as_it_was():
    model, _, _ = MODELS["flux"]()
    before = _snapshot(model)
    calls = []

    def boom(done, total):
        calls.append(done)
        if len(calls) == 3:
            raise KeyboardInterrupt("stop")

    import contextlib

    import offload._enable as mod

    @contextlib.contextmanager
    def progress(update):
        real = mod._progress
        mod._progress = lambda desc, enabled: (None, update)
        try:
            yield
        finally:
            mod._progress = real

    # Ctrl-C inside the engine's call is raised again as itself, not folded into
    # an OffloadError that a caller's `except Exception` would swallow.
    with progress(boom), pytest.raises(KeyboardInterrupt, match="stop"):
        offload.enable(model, device="cpu")
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))
    assert not model._forward_hooks and not model.transformer_blocks[0]._forward_pre_hooks

    def bad(done, total):
        raise ValueError("a broken bar")

    with progress(bad), pytest.raises(OffloadError, match="progress callback.*a broken bar"):
        offload.enable(model, device="cpu")
    _same_snapshot(before, _snapshot(model))
    # Nothing kept from the interrupt above leaks into a later, unrelated error.
    with pytest.raises(OffloadError, match="no block list"):
        offload.enable(torch.nn.Linear(2, 2), device="cpu")



def test_bad_arguments_name_the_component():
    model, _, _ = MODELS["t5"]()
    with pytest.raises(OffloadError, match="T5EncoderModel"):
        offload.enable(model, device="cpu", depth=0)
    with pytest.raises(OffloadError, match="no block list 'nope'"):
        offload.enable(model, device="cpu", blocks=["nope"])
    with pytest.raises(OffloadError, match="T5EncoderModel.*/nonexistent.safetensors: No such file"):
        offload.enable(model, device="cpu", checkpoint="/nonexistent.safetensors")
    assert offload.offloaded(model) is None



def test_an_error_inside_a_block_leaves_the_ring_usable():
    model, inputs, _ = MODELS["t5"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    h = offload.enable(model, device="cpu")
    bad = dict(inputs, input_ids=torch.full((2, 9), 10_000))  # past the vocabulary
    with pytest.raises(IndexError), torch.no_grad():
        model(**bad)
    with torch.no_grad():
        out = _out(model(**inputs))
    assert torch.equal(_bits(out), _bits(ref))
    assert h.metrics()["forgotten_guards"] == 0
    offload.disable(model)



def test_tied_weights_are_a_named_error():
    class Block(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x)

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(torch.nn.ModuleList([Block(shared), Block(shared)]))
    with pytest.raises(OffloadError, match="tied"):
        offload.enable(model, device="cpu")



def test_named_block_items_and_a_bad_tensor_are_named_errors():
    from collections import OrderedDict

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    model = torch.nn.Module()
    model.blocks = torch.nn.Sequential(OrderedDict(a=Block(), b=Block()))
    with pytest.raises(OffloadError, match="names its item 0 'a'"):
        offload.enable(model, device="cpu")
    from offload._offload import Streamer

    with pytest.raises(OffloadError, match="blocks.0.w"):
        Streamer("c", [("blocks.0.w", "BF16", [2], "not a tensor"), ("blocks.1.w", "BF16", [2], "x")], ["blocks"])
    with pytest.raises(OffloadError, match="dtype Q4"):
        Streamer("c", [("blocks.0.w", "Q4", [2], None)], ["blocks"])



def test_a_tensor_of_another_dtype_than_declared_is_a_named_error():
    # The same byte count, other elements: bf16 bytes declared F32 (or fp8 over
    # u8, i32 over f32) would stream as another tensor, unseen.
    from offload._offload import Streamer

    for declared, tensor in [
        ("F32", torch.arange(8, dtype=torch.bfloat16)),
        ("I32", torch.zeros(4)),
        ("F8_E4M3", torch.zeros(4, dtype=torch.uint8)),
        ("U8", torch.zeros(4, dtype=torch.float8_e4m3fn)),
    ]:
        n = 4 if declared != "F32" else 4
        rest = ("blocks.1.w", declared, [n], tensor.clone())
        with pytest.raises(OffloadError, match=rf"blocks\.0\.w: declared .*{declared.split('_')[0]}"):
            Streamer("c", [("blocks.0.w", declared, [n], tensor), rest], ["blocks"])
    # Declared as held, each builds.
    for dt, name in [(torch.bfloat16, "BF16"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.bool, "BOOL"), (torch.int64, "I64")]:
        t = torch.zeros(4, dtype=dt)
        Streamer("c", [("blocks.0.w", name, [4], t), ("blocks.1.w", name, [4], t.clone())], ["blocks"]).close()



def test_streamed_weights_that_require_grad_make_the_backward_a_named_error():
    # Every parameter trainable (a loaded model's default): the forward is the
    # resident one, and a backward that would leave the streamed weights'
    # gradients None is an error naming one instead.
    model, inputs, _ = MODELS["t5"]()
    ref = _out(model(**inputs))
    assert ref.requires_grad
    with torch.no_grad():
        ref_no_grad = _out(model(**inputs))
    before = _snapshot(model)
    offload.enable(model, device="cpu")
    out = _out(model(**inputs))
    assert torch.equal(_bits(out), _bits(ref))
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*encoder\.block\.\d+\..*gets no gradient"):
        out.float().square().mean().backward()
    with torch.no_grad():
        assert torch.equal(_bits(_out(model(**inputs))), _bits(ref_no_grad))
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))



def test_state_dict_while_offloaded_is_a_named_error():
    model, _, _ = MODELS["t5"]()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*encoder\.block\.0 streams its weights"):
        model.state_dict()
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*encoder\.block\.1 streams its weights, so the state_dict of "):
        model.encoder.block[1].state_dict()
    with pytest.raises(OffloadError, match=r"encoder\.block\.0 streams its weights .* cannot load a state_dict"):
        model.load_state_dict(want)
    offload.disable(model)
    got = model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)



def test_converting_an_offloaded_module_is_a_named_error_and_disable_still_restores():
    model, inputs, _ = MODELS["t5"]()
    before = _snapshot(model)
    offload.enable(model, device="cpu")
    # Refused at the call, at the first streamed weight it reaches.
    with pytest.raises(OffloadError, match=r"encoder\.block\.0\..* cannot be converted.*disable .*then enable"):
        model.float()
    # The streamed weights come back as enabled; the tensors the conversion
    # reached (resident, on the simulated device) keep it, and convert back exactly.
    offload.disable(model)
    model.to(torch.bfloat16)
    _same_snapshot(before, _snapshot(model))



def test_enabling_a_module_inside_an_offloaded_one_is_refused():
    model, inputs, _ = MODELS["t5"]()
    before = _snapshot(model)
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"block\.0\..*already streams in component 'T5EncoderModel'"):
        offload.enable(model.encoder, device="cpu")
    offload.disable(model)
    _same_snapshot(before, _snapshot(model))
    # Once disabled, the inner module may stream on its own.
    offload.enable(model.encoder, device="cpu")
    offload.disable(model.encoder)
    _same_snapshot(before, _snapshot(model))



@pytest.mark.parametrize("kw", [{"depth": -1}, {"depth": 1.5}, {"depth": True}, {"budget_gib": float("nan")}, {"budget_gib": 0},
                                {"pin_budget_gib": -1}, {"budget_gib": "8"}])
def test_bad_numbers_are_named_errors(kw):
    model, _, _ = MODELS["t5"]()
    with pytest.raises(OffloadError, match=r"T5EncoderModel.*(depth|budget_gib|pin_budget_gib) must be"):
        offload.enable(model, device="cpu", **kw)
    assert offload.offloaded(model) is None



def test_a_stale_handle_does_not_disable_a_later_enable():
    model, _, _ = MODELS["t5"]()
    h1 = offload.enable(model, device="cpu")
    offload.disable(model)
    h2 = offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match="disabled already"):
        h1.disable()
    assert offload.offloaded(model) is h2
    h2.disable()
    with pytest.raises(OffloadError, match="disabled already"):
        h2.disable()



def test_block_parameters_sharing_one_storage_are_a_named_error():
    # Views of one tensor stream as separate bytes and would come back separate.
    model, _, _ = MODELS["t5"]()
    attn = model.encoder.block[1].layer[0].SelfAttention
    fused = torch.cat([attn.q.weight.detach(), attn.k.weight.detach()])
    n = attn.q.weight.shape[0]
    attn.q.weight = torch.nn.Parameter(fused[:n])
    attn.k.weight = torch.nn.Parameter(fused[n:])
    before = _snapshot(model)
    with pytest.raises(OffloadError, match=r"encoder\.block\.1\.layer\.0\.SelfAttention\.k\.weight' shares its storage with 'encoder\.block\.1\.layer\.0\.SelfAttention\.q\.weight"):
        offload.enable(model, device="cpu")
    assert offload.offloaded(model) is None
    _same_snapshot(before, _snapshot(model))



@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_streamed_parameter_changed_while_offloaded_is_a_named_error(change):
    # Its placeholder replaced, given other data, edited in place or removed:
    # the change would not stream (the block's bytes are the enabled ones), so
    # it is refused at the call (an edit, other data) or the next forward names
    # the tensor (replaced, removed); disable still puts the module back.
    m, x = _Lin(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x).clone()
    offload.enable(m, device="cpu")
    named = r"tensor 'blocks\.[12]\.(weight|bias)' (was (replaced|changed)|streams while offloaded and cannot be)"
    with pytest.raises(OffloadError, match=named), torch.no_grad():
        _CHANGES[change](m)
        m(x)
    offload.disable(m)
    with torch.no_grad():
        assert torch.equal(m(x), ref)



def test_converting_part_of_a_block_while_offloaded_is_a_named_error():
    # One layer of each block converted (not the block's first tensor): refused as
    # converting the whole module is, the output never the unconverted one.
    model, inputs, _ = MODELS["t5"]()
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match=r"DenseReluDense\.wo\.weight' streams while offloaded and cannot be converted"):
        model.encoder.block[0].layer[1].DenseReluDense.wo.float()
    with torch.no_grad():
        model(**inputs)
    offload.disable(model)



def test_a_block_writing_its_streamed_weights_in_place_is_a_named_error():
    # The write lands in the lent buffer, which the next step no longer holds:
    # the block is named after its forward, and the module still disables.
    m = torch.nn.Module()
    torch.manual_seed(0)
    m.blocks = torch.nn.ModuleList(_Running() for _ in range(2))
    m.forward = lambda x: m.blocks[1](m.blocks[0](x))
    offload.enable(m, device="cpu")
    with pytest.raises(OffloadError, match=r"block blocks\.0 wrote its streamed weights in place"), torch.no_grad():
        m(torch.randn(3, 4))
    offload.disable(m)
    assert torch.equal(m.blocks[0].running, torch.zeros(4))



def test_state_dict_of_a_layer_inside_a_block_is_a_named_error():
    model, _, _ = MODELS["t5"]()
    offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match="streams its weights"):
        model.encoder.block[0].layer[0].state_dict()
    offload.disable(model)
    assert all(t.numel() for t in model.encoder.block[0].layer[0].state_dict().values())



def test_a_block_tensor_sharing_storage_with_a_resident_one_is_a_named_error():
    # A fused tensor split between a block and the head: streamed, the two would
    # come back from disable as separate tensors.
    m = _Lin()
    fused = torch.randn(16, 8)
    m.blocks[0].weight = torch.nn.Parameter(fused[:8])
    m.head = torch.nn.Linear(8, 8)
    m.head.weight = torch.nn.Parameter(fused[8:])
    with pytest.raises(OffloadError, match=r"'blocks\.0\.weight' shares its storage with 'head\.weight'"):
        offload.enable(m, device="cpu")
    assert offload.offloaded(m) is None
    assert m.blocks[0].weight.untyped_storage().data_ptr() == m.head.weight.untyped_storage().data_ptr()



def test_a_layer_holding_only_a_resident_adapter_still_gives_its_state_dict():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8).requires_grad_(False)
            self.lora = torch.nn.Linear(8, 8)  # trainable: resident

        def forward(self, x):
            return self.a(x) + self.lora(x)

    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList(Block() for _ in range(2))
    m.forward = lambda x: m.blocks[1](m.blocks[0](x))
    offload.enable(m, device="cpu")
    assert list(m.blocks[0].lora.state_dict()) == ["weight", "bias"]
    with pytest.raises(OffloadError, match="streams its weights"):
        m.blocks[0].a.state_dict()
    with pytest.raises(OffloadError, match="streams its weights"):
        m.blocks[0].state_dict()
    offload.disable(m)

