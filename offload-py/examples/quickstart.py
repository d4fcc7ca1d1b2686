"""The README's Python example: a diffusers transformer (a small Flux, random
weights) streamed block by block through offload, its output checked bitwise
against the resident run. `python examples/quickstart.py [cpu|cuda]`."""

import sys

import torch
from diffusers import FluxTransformer2DModel

import offload


def small_flux():
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=2, num_single_layers=3, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.to(torch.bfloat16).eval()


def small_inputs(device):
    """Seeded inputs of one forward of `small_flux` (16 image and 7 text tokens)."""
    torch.manual_seed(1)
    return dict(hidden_states=torch.randn(1, 16, 8, dtype=torch.bfloat16, device=device),
                encoder_hidden_states=torch.randn(1, 7, 32, dtype=torch.bfloat16, device=device),
                pooled_projections=torch.randn(1, 32, dtype=torch.bfloat16, device=device),
                timestep=torch.tensor([0.5], dtype=torch.bfloat16, device=device),
                img_ids=torch.zeros(16, 3, device=device), txt_ids=torch.zeros(7, 3, device=device), return_dict=False)


def main(device="cuda" if torch.cuda.is_available() else "cpu"):
    model = small_flux()
    inputs = small_inputs(device)
    with torch.no_grad():
        resident = model.to(device)(**inputs)[0].cpu()
    model.to("cpu")

    handle = offload.enable(model, device=device)  # blocks found in the module tree
    with torch.no_grad():
        out = model(**inputs)[0]  # each block's weights reach the device just before it runs
    print(handle.metrics())  # bytes streamed, prefetch hits, misses, host waits, device bytes
    offload.disable(model)  # the module as it was: same parameters, same bytes

    assert torch.equal(out.cpu(), resident), "the streamed output differs from the resident one"
    print(f"{device}: streamed output bitwise equal to the resident one")
    return out


if __name__ == "__main__":
    main(*sys.argv[1:])
