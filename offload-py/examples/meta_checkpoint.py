"""The guide's example of a model that never sits in host memory: a small Flux
(heads of 128, as Flux-dev's) saved to a safetensors file, built again on the
meta device and run from the file, its output checked bitwise against the
resident model. `python examples/meta_checkpoint.py DIR [cpu|cuda]`."""

import sys
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import save_file

import offload
from quickstart import small_inputs

CONFIG = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=128, num_attention_heads=2,
              joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(16, 56, 56))


def main(directory, device="cuda" if torch.cuda.is_available() else "cpu"):
    torch.manual_seed(0)
    resident = FluxTransformer2DModel(**CONFIG)
    with torch.no_grad():
        for p in resident.parameters():
            p.normal_(0, 0.05)
    resident = resident.to(torch.bfloat16).eval()
    path = str(Path(directory) / "flux.safetensors")
    save_file(resident.state_dict(), path)
    inputs = small_inputs(device)
    with torch.no_grad():
        want = resident.to(device)(**inputs)[0].cpu()

    with torch.device("meta"):
        transformer = FluxTransformer2DModel.from_config(resident.config).to(torch.bfloat16).eval()
    handle = offload.enable(transformer, device=device, checkpoint=path)
    tier = handle.host_tier()  # {"in_place": 4, "copied": 0, "copy_reason": None}: no block copied
    with torch.no_grad():
        out = transformer(**inputs)[0]
    offload.disable(transformer)  # back on the meta device

    assert tier == {"in_place": 4, "copied": 0, "copy_reason": None}, tier
    assert torch.equal(out.cpu(), want), "the output from the checkpoint differs from the resident one"
    print(f"{device}: output from the checkpoint bitwise equal to the resident one")
    return out, tier


if __name__ == "__main__":
    main(*sys.argv[1:])
