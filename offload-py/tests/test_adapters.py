"""peft adapters trained over streamed weights, on the tiny real classes: a
LoRA added with ``add_adapter`` (diffusers' and transformers' own mixins)
stays resident and trains, the base streams in both passes, and five AdamW
steps give the resident run's losses, gradients and adapters bitwise, with
and without gradient checkpointing. Several adapters (``set_adapters``), one
loaded from a state dict (``load_lora_adapter``), and ``disable`` giving the
trained adapters back. CPU rows on the simulated device; CUDA rows print
SKIPPED without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import pytest
import torch

import offload

from helpers import NO_CUDA, exact_attention
from models import MODELS

peft = pytest.importorskip("peft", reason="peft is installed by scripts/python-env.sh")

DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]
# The attention projections of each class, by their names in it.
_TARGETS = {
    "flux": ["to_q", "to_k", "to_v", "to_out.0"],
    "sd3": ["to_q", "to_k", "to_v", "to_out.0"],
    "qwen-image": ["to_q", "to_k", "to_v", "to_out.0"],
    "wan": ["to_q", "to_k", "to_v", "to_out.0"],
    "t5": ["q", "k", "v", "o"],
    "qwen2.5-vl-text": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
_DIFFUSERS = ("flux", "sd3", "qwen-image", "wan")


def _first(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "last_hidden_state", getattr(out, "sample", out))


def _with_lora(name: str, adapters=("a",), gguf: bool = False):
    """The tiny model, frozen, with rank-4 LoRA adapters on its attention
    projections, their weights seeded random (peft starts B at zero);
    ``gguf``: its Linears quantized to Q8_0 first (diffusers' GGUF layers)."""
    torch.manual_seed(0)
    model, inputs, _ = MODELS[name]()
    if gguf:
        from models import gguf_quantize

        model = gguf_quantize(model)
    model.requires_grad_(False)
    for i, a in enumerate(adapters):
        cfg = peft.LoraConfig(r=4, lora_alpha=4, target_modules=_TARGETS[name], init_lora_weights="gaussian")
        model.add_adapter(cfg, adapter_name=a)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if f"lora_" in n and f".{a}." in n:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.05)
    if len(adapters) == 1 and name in _DIFFUSERS:
        model.set_adapters(adapters[0])
    return model, inputs


def _checkpointing(model, name: str) -> None:
    if name in _DIFFUSERS:
        model.enable_gradient_checkpointing()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def _train(model, inputs: dict, dev: str, steps: int = 5):
    """``steps`` AdamW steps on the trainable parameters: per step the loss,
    the input's gradient (a float input) and the adapters' gradients."""
    with exact_attention(dev):
        return _train_steps(model, inputs, dev, steps)


def _train_steps(model, inputs: dict, dev: str, steps: int):
    torch.manual_seed(7)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable, "no trainable adapter"
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    out = []
    for _ in range(steps):
        x = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        key = next((k for k in ("hidden_states", "inputs_embeds") if k in x), None)
        if key is not None:
            x[key] = x[key].clone().requires_grad_(True)
        opt.zero_grad()
        loss = _first(model(**x)).float().square().mean()
        loss.backward()
        opt.step()
        grads = {n: p.grad.detach().clone() for n, p in trainable}
        out.append((loss.detach().clone(), None if key is None else x[key].grad.clone(), grads))
    return out, {n: p.detach().clone() for n, p in trainable}


def _same(a, b, what: str):
    for i, ((la, xa, ga), (lb, xb, gb)) in enumerate(zip(a, b)):
        assert torch.equal(la, lb), f"{what}: step {i}: loss {la} != {lb}"
        assert (xa is None) == (xb is None) and (xa is None or torch.equal(xa, xb)), f"{what}: step {i}: the input's gradient"
        assert ga.keys() == gb.keys()
        for n in ga:
            assert torch.equal(ga[n], gb[n]), f"{what}: step {i}: gradient of {n}"


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("name", list(_TARGETS))
def test_a_peft_lora_trains_over_streamed_weights_as_it_does_resident(name, ckpt, dev):
    ref_model, inputs = _with_lora(name)
    if ckpt:
        _checkpointing(ref_model, name)
    ref, ref_adapters = _train(ref_model.to(dev), inputs, dev)
    assert all(torch.isfinite(l) for l, _, _ in ref) and len({float(l) for l, _, _ in ref}) > 1, "the reference does not train"

    model, inputs = _with_lora(name)
    if ckpt:
        _checkpointing(model, name)
    h = offload.enable(model, device=dev, depth=1)
    lora = [n for n, p in model.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad and p.device.type == torch.device(dev).type for n, p in model.named_parameters() if "lora_" in n)
    got, adapters = _train(model, inputs, dev)
    _same(got, ref, f"{name} ({'checkpointing' if ckpt else 'plain'}) on {dev}")
    if not ckpt:
        # The base streamed again for the backward (with checkpointing the
        # recompute asks for the blocks, as a forward does).
        back = h.metrics("backward")
        assert back["backward"] and back["blocks"] >= 1 and back["bytes_copied"] > 0, back
    offload.disable(model)
    # disable gives the module back with its trained adapters.
    now = {n: p.detach().to(dev) for n, p in model.named_parameters() if p.requires_grad}
    assert now.keys() == ref_adapters.keys() == adapters.keys()
    for n in now:
        assert torch.equal(now[n], ref_adapters[n]), f"{n}: not the trained adapter after disable"


@pytest.mark.parametrize("dev", DEVICES)
def test_a_lora_on_a_gguf_base_trains_over_streamed_weights_as_it_does_resident(dev):
    pytest.importorskip("gguf")
    ref, ref_adapters = _train(_with_lora("flux", gguf=True)[0].to(dev), _with_lora("flux", gguf=True)[1], dev)
    model, inputs = _with_lora("flux", gguf=True)
    h = offload.enable(model, device=dev, depth=1)
    got, _ = _train(model, inputs, dev)
    _same(got, ref, f"a GGUF base on {dev}")
    assert h.metrics("backward")["bytes_copied"] > 0  # the quantized blocks streamed again
    offload.disable(model)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach().to(dev), ref_adapters[n]), n


@pytest.mark.parametrize("dev", DEVICES)
def test_several_adapters_switched_with_set_adapters_stream_as_resident(dev):
    ref, inputs = _with_lora("flux", adapters=("a", "b"))
    model, _ = _with_lora("flux", adapters=("a", "b"))
    ref.to(dev)
    x = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    h = offload.enable(model, device=dev, depth=1)
    with torch.no_grad():
        for active in (["a"], ["b"], ["a", "b"]):
            ref.set_adapters(active)
            model.set_adapters(active)
            want = _first(ref(**x))
            for _ in range(2):
                assert torch.equal(_first(model(**x)), want), f"adapters {active}"
    assert h.violations() == []
    offload.disable(model)


@pytest.mark.parametrize("dev", DEVICES)
def test_an_adapter_loaded_from_a_state_dict_trains_as_resident(dev):
    from peft.utils import get_peft_model_state_dict

    donor, inputs = _with_lora("flux")
    sd = {k: v.clone() for k, v in get_peft_model_state_dict(donor, adapter_name="a").items()}

    def loaded():
        model, _ = MODELS["flux"]()[:2]
        model.requires_grad_(False)
        model.load_lora_adapter(sd, adapter_name="loaded", prefix=None)
        model.set_adapters("loaded")
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
        return model

    ref, ref_adapters = _train(loaded().to(dev), inputs, dev)
    model = loaded()
    offload.enable(model, device=dev, depth=1)
    got, adapters = _train(model, inputs, dev)
    _same(got, ref, f"a loaded adapter on {dev}")
    offload.disable(model)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach().to(dev), ref_adapters[n]), n


def test_the_equality_fails_when_the_backward_gets_another_blocks_weights(monkeypatch):
    # The check can fail: a backward handed the weights of the block lent now
    # (a slot reused before the backward read it), not of the block that saved
    # them, gives other gradients.
    from offload._module import Offloaded

    ref, _ = _train(_with_lora("flux")[0], _with_lora("flux")[1], "cpu")
    unpack = Offloaded._unpack

    def stale(self, saved):
        if type(saved).__name__ == "_Saved" and self._bound is not None and self._bound is not saved.block:
            saved.block = self._bound
        return unpack(self, saved)

    monkeypatch.setattr(Offloaded, "_unpack", stale)
    model, inputs = _with_lora("flux")
    offload.enable(model, device="cpu", depth=1)
    try:
        got, _ = _train(model, inputs, "cpu")
        with pytest.raises(AssertionError):
            _same(got, ref, "sabotaged")
    finally:
        offload.disable(model)


def _saved_weights_outside(model, inputs) -> int:
    """Bytes of 2-D frozen tensors that autograd saved past the package's hooks
    (to the hooks beneath them) in a forward and backward: weights that would
    stay on the device from the forward to the backward."""
    seen = []

    def pack(t):
        if t.dim() == 2 and min(t.shape) >= 32 and not t.requires_grad:
            seen.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _first(model(**inputs)).float().square().mean()
    loss.backward()
    return sum(seen)


def test_a_gguf_bases_dequantized_weights_are_not_kept_for_the_backward(monkeypatch):
    pytest.importorskip("gguf")
    plain, inputs = _with_lora("flux")
    offload.enable(plain, device="cpu", depth=1)
    base = _saved_weights_outside(plain, inputs)  # the resident tensors outside the blocks
    offload.disable(plain)
    model, inputs = _with_lora("flux", gguf=True)
    offload.enable(model, device="cpu", depth=1)
    assert _saved_weights_outside(model, inputs) == base
    offload.disable(model)
    # The check can fail: without the hooks around the GGUF layers, each layer's
    # dequantized weight is saved as itself and kept until the backward.
    import offload._enable as enabling

    monkeypatch.setattr(enabling, "_gguf_hooks", lambda *a: (lambda *b: None, lambda *b: None))
    model, inputs = _with_lora("flux", gguf=True)
    offload.enable(model, device="cpu", depth=1)
    assert _saved_weights_outside(model, inputs) > base + 10_000
    offload.disable(model)
