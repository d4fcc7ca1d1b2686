"""GGUF files written by the `gguf` package (the writer GGUF releases come from),
read by offload's reader and mapped onto diffusers' names by the architecture
each names: exactly the parameters of diffusers' own class, names and shapes."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest

import offload
from offload import OffloadError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _write(path, arch, tensors, recut=()):
    """`tensors`: (name, shape); 2-D ones whose fan-in is whole blocks of 32 as
    Q8_0 (the gguf package's quantizer), the others F32, all seeded random (a
    5-D one as ComfyUI-GGUF's `fix_5d_tensors` writes Wan's Conv3d weight: F32,
    five dimensions). Those named in `recut` are stored as ComfyUI-GGUF's
    converter re-cuts rows for quantizing: (n / 256, 256), their shape under
    `comfy.gguf.orig_shape.<name>`."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch=arch)
    for name, shape in tensors:
        a = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if name in recut:
            w.add_array(f"comfy.gguf.orig_shape.{name}", [int(d) for d in shape])
            a = a.reshape(-1, 256)
            shape = a.shape
        if len(shape) == 2 and shape[1] % 32 == 0:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _params(m):
    return sorted((n, list(p.shape)) for n, p in m.named_parameters())


def _mapped(path):
    return sorted((n, shape) for n, _, shape in offload.gguf_tensors(str(path)))


def test_a_bfl_named_flux_gguf_maps_onto_diffusers_flux(tmp_path):
    from diffusers import FluxTransformer2DModel

    h, hd, mlp = 64, 32, 256
    m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=hd,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                               guidance_embeds=True, axes_dims_rope=(8, 8, 16))
    t = []

    def lin(name, o, i):
        t.extend([(f"{name}.weight", (o, i)), (f"{name}.bias", (o,))])

    for e in ("time_in", "guidance_in"):
        lin(f"{e}.in_layer", h, 256)
        lin(f"{e}.out_layer", h, h)
    lin("vector_in.in_layer", h, 32)
    lin("vector_in.out_layer", h, h)
    lin("txt_in", h, 32)
    lin("img_in", h, 8)
    for s in ("img", "txt"):
        lin(f"double_blocks.0.{s}_mod.lin", 6 * h, h)
        lin(f"double_blocks.0.{s}_attn.qkv", 3 * h, h)
        lin(f"double_blocks.0.{s}_attn.proj", h, h)
        lin(f"double_blocks.0.{s}_mlp.0", mlp, h)
        lin(f"double_blocks.0.{s}_mlp.2", h, mlp)
    lin("single_blocks.0.modulation.lin", 3 * h, h)
    lin("single_blocks.0.linear1", 3 * h + mlp, h)
    lin("single_blocks.0.linear2", h, h + mlp)
    lin("final_layer.linear", 8, h)
    lin("final_layer.adaLN_modulation.1", 2 * h, h)
    for n in ("double_blocks.0.img_attn.norm", "double_blocks.0.txt_attn.norm", "single_blocks.0.norm"):
        t += [(f"{n}.query_norm.scale", (hd,)), (f"{n}.key_norm.scale", (hd,))]
    path = tmp_path / "flux.gguf"
    _write(path, "flux", t)
    assert _mapped(path) == _params(m)
    kinds = {n: dt for n, dt, _ in offload.gguf_tensors(str(path))}
    assert kinds["transformer_blocks.0.attn.to_q.weight"] == "Q8_0" and kinds["x_embedder.weight"] == "F32"


def test_a_qwen_image_gguf_keeps_diffusers_names(tmp_path):
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                    num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    path = tmp_path / "qwen.gguf"
    # One projection stored re-cut to rows of 256 (32 x 32 -> 4 x 256), read back in its shape.
    recut = {"model.diffusion_model.transformer_blocks.0.attn.to_q.weight"}
    _write(path, "qwen_image", [(f"model.diffusion_model.{n}", tuple(p.shape)) for n, p in m.named_parameters()], recut)
    assert _mapped(path) == _params(m)
    kinds = {n: dt for n, dt, _ in offload.gguf_tensors(str(path))}
    assert kinds["transformer_blocks.0.attn.to_q.weight"] == "Q8_0"


def test_a_wan_gguf_in_wans_own_names_maps_onto_diffusers_wan(tmp_path):
    # Its Conv3d patch embedding five-dimensional, as ComfyUI-GGUF's fix_5d_tensors writes it.
    import test_fixtures

    original = [l.split(" ") for l in (ROOT / "tests/data/wan-original-names.txt").read_text().split("\n")[:-1]]
    path = tmp_path / "wan.gguf"
    tensors = [(n, tuple(int(d) for d in s.split("x"))) for n, s in original]
    _write(path, "wan", tensors)
    assert _mapped(path) == _params(test_fixtures._wan())
    # Each tensor's bytes where diffusers' own converter puts them: tensors of one
    # shape (norm2 and norm3, attn1 and attn2) cannot trade places unseen.
    import torch
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    rd = gguf.GGUFReader(str(path))
    stored = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type))).reshape(s)
              for t, (_, s) in zip(rd.tensors, tensors)}
    want = convert_wan_transformer_to_diffusers(dict(stored))
    for name, dt, shape in offload.gguf_tensors(str(path)):
        raw = np.frombuffer(bytes(offload.gguf_read(str(path), name)), dtype=np.uint8)
        qt = getattr(gguf.GGMLQuantizationType, dt)
        got = torch.from_numpy(np.array(gguf.quants.dequantize(raw.reshape(shape[0], -1) if len(shape) == 2 else raw, qt))).reshape(shape)
        assert torch.equal(got, want[name]), name
    with pytest.raises(OffloadError, match="no tensor"):
        offload.gguf_read(str(path), "blocks.0.self_attn.q.weight")


def test_a_gguf_offload_does_not_map_is_named(tmp_path):
    path = tmp_path / "sd3.gguf"
    _write(path, "sd3", [("joint_blocks.0.x.weight", (4, 32))])
    with pytest.raises(OffloadError, match='architecture "sd3"'):
        offload.gguf_tensors(str(path))
    path = tmp_path / "bad.gguf"
    _write(path, "flux", [("lora_up.weight", (4, 32))])
    with pytest.raises(OffloadError, match="lora_up.weight"):
        offload.gguf_tensors(str(path))
