"""Fixtures the Rust tests read, checked against the classes they stand for."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_flux_names_fixture_is_diffusers_own():
    # tests/data/flux-diffusers-names.txt: the parameter names and shapes of a
    # one-double, one-single block FluxTransformer2DModel, which offload-candle's
    # GGUF test maps a BFL-named file onto.
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=32,
                               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                               guidance_embeds=True, axes_dims_rope=(8, 8, 16))
    want = [f"{n} {'x'.join(map(str, p.shape))}" for n, p in m.named_parameters()]
    assert (ROOT / "tests/data/flux-diffusers-names.txt").read_text().split("\n")[:-1] == want


def _wan():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                                 text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def test_the_wan_names_fixtures_are_diffusers_own():
    # tests/data/wan-diffusers-names.txt: a one-block WanTransformer3DModel's
    # parameters; tests/data/wan-original-names.txt: the same weights as Wan's own
    # checkpoints (and the Wan GGUF releases) name them, which diffusers' own
    # converter turns into the first. offload_core::rename's Wan map is tested
    # against both.
    import torch
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    want = [f"{n} {'x'.join(map(str, p.shape))}" for n, p in _wan().named_parameters()]
    assert (ROOT / "tests/data/wan-diffusers-names.txt").read_text().split("\n")[:-1] == want
    original = [l.split(" ") for l in (ROOT / "tests/data/wan-original-names.txt").read_text().split("\n")[:-1]]
    ck = {n: torch.zeros([int(d) for d in s.split("x")]) for n, s in original}
    got = convert_wan_transformer_to_diffusers(ck)
    assert sorted(f"{n} {'x'.join(map(str, t.shape))}" for n, t in got.items()) == sorted(want)


def test_the_qwen_image_names_fixture_is_diffusers_own():
    # tests/data/qwen-image-diffusers-names.txt: a one-block
    # QwenImageTransformer2DModel's parameters, the names Qwen-Image's GGUF
    # releases keep; offload_core::rename's Qwen-Image map admits exactly its
    # top-level modules.
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                                    num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    want = [f"{n} {'x'.join(map(str, p.shape))}" for n, p in m.named_parameters()]
    assert (ROOT / "tests/data/qwen-image-diffusers-names.txt").read_text().split("\n")[:-1] == want
