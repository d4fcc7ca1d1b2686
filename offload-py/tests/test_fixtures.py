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
