"""The training guide's example (docs/training.md): a LoRA on a diffusers
transformer (a small Flux, random weights) trained with AdamW while its frozen
base streams block by block, forward and again in reverse for the backward;
the losses and adapters checked bitwise against the resident run.
`python examples/train_lora.py [cpu|cuda]`."""

import sys

import torch
from peft import LoraConfig

import offload
from quickstart import small_flux, small_inputs


def with_lora():
    model = small_flux().requires_grad_(False)  # the base stays frozen
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    torch.manual_seed(2)
    with torch.no_grad():  # peft starts B at zero: random adapters, so every step moves
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    return model


def train(model, device, steps=5):
    """`steps` AdamW steps on the adapters (the only parameters needing grad)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    inputs = small_inputs(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**inputs)[0].float().square().mean()
        loss.backward()  # each block comes back to the device, in reverse
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def main(device="cuda" if torch.cuda.is_available() else "cpu"):
    # A bitwise comparison needs a backward that sums in a fixed order: on CUDA,
    # attention's math backend (torch's fused attention backwards accumulate in
    # any order, so two resident runs may differ). Training itself needs no such
    # setting.
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            return run(device)
    return run(device)


def run(device):
    resident, resident_adapters = train(with_lora().to(device), device)

    model = with_lora()
    handle = offload.enable(model, device=device, depth=1)  # the adapters stay resident, the base streams
    losses, adapters = train(model, device)
    fwd, bwd = handle.metrics("forward"), handle.metrics("backward")
    print(f"forward: {fwd['blocks']} blocks, {fwd['bytes_copied']} bytes; backward: {bwd['blocks']} blocks, "
          f"{bwd['bytes_copied']} bytes")
    offload.disable(model)  # the module back, with its trained adapters

    assert losses == resident, f"the losses differ: {losses} vs {resident}"
    assert all(torch.equal(adapters[n], resident_adapters[n]) for n in adapters), "the trained adapters differ"
    assert all(torch.equal(p.detach().cpu(), adapters[n]) for n, p in model.named_parameters() if p.requires_grad)
    print(f"{device}: {len(losses)} steps, losses {losses[0]:.5f} → {losses[-1]:.5f}, bitwise equal to the resident run")
    return losses, bwd


if __name__ == "__main__":
    main(*sys.argv[1:])
