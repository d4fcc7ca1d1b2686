"""Anchor: diffusers' group offloading on a Flux-dev-shaped FluxTransformer2DModel
with random bf16 weights, timed with CUDA events in the same run as offload's
benchmark. Modes: resident, block_stream (block level, use_stream, record_stream),
leaf_stream (leaf level, use_stream, record_stream).

python3 diffusers_group_offload.py --modes resident,block_stream --resolutions 1024,2048 --steps 3 --out anchors.json
"""
import argparse
import json
import sys
import time

import torch


def make_model(layers, single_layers):
    from diffusers import FluxTransformer2DModel

    cfg = dict(
        patch_size=1, in_channels=64, num_layers=layers, num_single_layers=single_layers,
        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
    )
    # Built on the meta device in bf16, then materialised once on the GPU (no
    # float32 copy of 12 B parameters) and filled with uniform random values there:
    # filling 12 B parameters on the runner's CPU took 75-105 s, on the GPU < 1 s.
    # Offloaded modes move the model to the CPU afterwards.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        m = FluxTransformer2DModel(**cfg)
    torch.set_default_dtype(torch.float32)
    m = m.to_empty(device="cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-0.03, 0.03)
    return m.eval()


def inputs(res, dev):
    g = torch.Generator().manual_seed(1)
    n = (res // 16) ** 2
    r = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)
    ids = torch.zeros(n, 3)
    ids[:, 1] = torch.arange(n) // (res // 16)
    ids[:, 2] = torch.arange(n) % (res // 16)
    return dict(
        hidden_states=r(1, n, 64), encoder_hidden_states=r(1, 512, 4096), pooled_projections=r(1, 768),
        timestep=torch.tensor([0.5], device=dev, dtype=torch.bfloat16), img_ids=ids.to(dev), txt_ids=torch.zeros(512, 3, device=dev),
        guidance=torch.tensor([3.5], device=dev, dtype=torch.bfloat16), return_dict=False,
    )


def time_steps(model, res, steps):
    x = inputs(res, "cuda")
    with torch.no_grad():
        model(**x)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        evs[0].record()
        for i in range(steps):
            model(**x)
            evs[i + 1].record()
        torch.cuda.synchronize()
    times = [evs[i].elapsed_time(evs[i + 1]) / 1e3 for i in range(steps)]
    return sorted(times)[len(times) // 2], times, torch.cuda.max_memory_allocated()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="resident,block_stream")
    ap.add_argument("--resolutions", default="1024,2048")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--single-layers", type=int, default=38)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import diffusers

    t0 = time.time()
    model = make_model(a.layers, a.single_layers)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}: model {nbytes / 2**30:.2f} GiB built in {time.time() - t0:.1f} s", flush=True)
    results = []
    for mode in a.modes.split(","):
        if mode == "resident":
            model.to("cuda")
        elif mode in ("block_stream", "leaf_stream"):
            model.to("cpu")
            torch.cuda.empty_cache()
            kind = "block_level" if mode == "block_stream" else "leaf_level"
            kw = dict(num_blocks_per_group=1) if kind == "block_level" else {}
            model.enable_group_offload(torch.device("cuda"), torch.device("cpu"), offload_type=kind, use_stream=True, record_stream=True, **kw)
        else:
            sys.exit(f"unknown mode {mode}")
        for res in map(int, a.resolutions.split(",")):
            step, times, peak = time_steps(model, res, a.steps)
            print(f"diffusers {mode} {res}x{res}: step {step:.4f} s, peak {peak / 2**30:.2f} GiB", flush=True)
            results.append(dict(name=f"diffusers_{mode}", mode=mode, resolution=res, batch=1, step_s=step, steps_s=times, peak_device_bytes=peak,
                                model_bytes=nbytes, diffusers=diffusers.__version__, torch=torch.__version__))
        if mode != "resident":
            break  # hooks stay on the model: one offload mode per process
    json.dump(results, open(a.out, "w"), indent=2)


if __name__ == "__main__":
    main()
