"""Tiny instances of the real classes (diffusers' and transformers' own code),
built from configs with random weights, and inputs for one forward each."""

from __future__ import annotations

import torch


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fresh random weights (never zeros: diffusers zero-initialises some
    projections), bf16, on the CPU, in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.05)
    return model.to(torch.bfloat16).eval()


def _rand(*shape, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def flux(head_dim: int = 16):
    """A tiny Flux transformer; ``head_dim=64`` gives blocks of a few MiB, where
    coding pays (it does not on a few KiB: each coded string carries its table)."""
    from diffusers import FluxTransformer2DModel

    m = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=head_dim,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2),
    )
    seq, txt = 16, 7
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1).reshape(seq, 3)
    inputs = dict(
        hidden_states=_rand(2, seq, 8, seed=1),
        encoder_hidden_states=_rand(2, txt, 32, seed=2),
        pooled_projections=_rand(2, 32, seed=3),
        timestep=torch.tensor([0.5, 0.25], dtype=torch.bfloat16),
        guidance=torch.tensor([3.5, 3.5], dtype=torch.bfloat16),
        img_ids=img_ids,
        txt_ids=torch.zeros(txt, 3),
        return_dict=False,
    )
    return _randomize(m, 10), inputs, 5


def sd3():
    from diffusers import SD3Transformer2DModel

    m = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
    )
    inputs = dict(
        hidden_states=_rand(2, 4, 8, 8, seed=1),
        encoder_hidden_states=_rand(2, 6, 32, seed=2),
        pooled_projections=_rand(2, 16, seed=3),
        timestep=torch.tensor([500, 250]),
        return_dict=False,
    )
    return _randomize(m, 11), inputs, 3


def qwen_image():
    from diffusers import QwenImageTransformer2DModel

    m = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )
    txt = 5
    inputs = dict(
        hidden_states=_rand(1, 16, 16, seed=1),
        encoder_hidden_states=_rand(1, txt, 16, seed=2),
        encoder_hidden_states_mask=torch.ones(1, txt, dtype=torch.long),
        timestep=torch.tensor([0.5], dtype=torch.bfloat16),
        img_shapes=[(1, 4, 4)],
        return_dict=False,
    )
    return _randomize(m, 12), inputs, 3


def wan():
    from diffusers import WanTransformer3DModel

    m = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=32,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    inputs = dict(
        hidden_states=_rand(1, 4, 2, 8, 8, seed=1),
        encoder_hidden_states=_rand(1, 6, 16, seed=2),
        timestep=torch.tensor([500]),
        return_dict=False,
    )
    return _randomize(m, 13), inputs, 3


def t5(layers=3):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4, relative_attention_num_buckets=8)
    m = T5EncoderModel(cfg)
    g = torch.Generator().manual_seed(4)
    inputs = dict(input_ids=torch.randint(0, 64, (2, 9), generator=g), return_dict=False)
    return _randomize(m, 14), inputs, layers


def qwen25_vl_text():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    cfg = Qwen2_5_VLTextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
    )
    m = Qwen2_5_VLTextModel(cfg)
    g = torch.Generator().manual_seed(5)
    inputs = dict(input_ids=torch.randint(0, 64, (1, 9), generator=g), use_cache=False, return_dict=False)
    return _randomize(m, 15), inputs, 3


MODELS = {"flux": flux, "sd3": sd3, "qwen-image": qwen_image, "wan": wan, "t5": t5, "qwen2.5-vl-text": qwen25_vl_text}


def gguf_quantize(model: torch.nn.Module, quant: str = "Q8_0") -> torch.nn.Module:
    """``model`` with every ``nn.Linear`` whose fan-in is whole GGUF blocks
    swapped for diffusers' ``GGUFLinear`` holding a ``GGUFParameter`` quantized by
    the ``gguf`` package: what ``from_single_file(..., GGUFQuantizationConfig)``
    builds from a GGUF release, without a file."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, _replace_with_gguf_linear

    import numpy as np

    qt = getattr(gguf.GGMLQuantizationType, quant)
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(7)
    state = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m.in_features % block == 0:
            if quant == "Q8_0":
                q = gguf.quants.quantize(m.weight.detach().float().numpy(), qt)
            else:
                # The gguf package quantizes Q8_0 only: K-quant blocks of random
                # bytes with small finite super-scales (d, dmin: the first two f16s).
                q = rng.integers(0, 256, (m.out_features, m.in_features // block, size), dtype=np.uint8)
                q[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
                q[..., 2:4] = np.frombuffer(np.float16(0.001).tobytes(), np.uint8)
                q = q.reshape(m.out_features, -1)
            state[f"{name}.weight"] = GGUFParameter(torch.from_numpy(q), quant_type=qt)
    _replace_with_gguf_linear(model, torch.bfloat16, state)
    for name, m in model.named_modules():
        if f"{name}.weight" in state:
            m.weight = state[f"{name}.weight"]
            if m.bias is not None:
                m.bias = torch.nn.Parameter(torch.randn(m.bias.shape).to(torch.bfloat16) * 0.05, requires_grad=False)
    return model


class Chain(torch.nn.Module):
    """``n`` blocks made by ``make`` (seeded: the same weights every time) in a
    ``ModuleList`` called ``blocks``, called in order: the smallest model the
    package streams, around whatever block a test needs."""

    def __init__(self, make, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(make() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
