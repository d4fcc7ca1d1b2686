"""Which of SDPA's backends gives a sound backward on this machine: for each
backend, in a process of its own (a kernel that breaks the CUDA context
leaves nothing else runnable in its process), a resident LoRA step of a
small Flux and a bare attention backward at Flux-dev's 1024² shape, each run
twice from the same state: finite, repeatable (bitwise), or the error named.
No part of this project runs in it: it names a library's failure apart from
ours (issue 56 asks for the library's failure to be named where the resident
reference does not run).

    python3 sdpa_probe.py OUT.json                (every backend, one process each)
    python3 sdpa_probe.py OUT.json --backend math (one backend, in this process)
    python3 sdpa_probe.py OUT.json --device cpu   (the script's own check, at small shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BACKENDS = ["default", "cudnn", "flash", "efficient", "math"]


def entry(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:400]}


def twice(fn, dev: str) -> dict:
    """`fn()` twice: each returns the tensors to compare; finite and bitwise equal?"""
    import torch

    try:
        a, b = fn(), fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        return {"finite": all(bool(torch.isfinite(t.float()).all()) for t in a + b),
                "repeatable": all(torch.equal(x, y) for x, y in zip(a, b)),
                "max_abs": max(float(t.float().abs().max()) for t in a)}
    except Exception as e:  # the library's own error, named
        return entry(e)


def probe(backend: str, dev: str) -> dict:
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import train_step

    # The backends by the names train_step.py's --attention takes.
    name = train_step.BACKENDS[backend]
    ctx = (lambda: contextlib.nullcontext()) if name is None else (lambda: sdpa_kernel(getattr(SDPBackend, name)))
    out = {"backend": backend}

    # A bare attention at Flux-dev 1024²: 24 heads of 128, 4096 image + 512 text
    # tokens (on the CPU, the script's own check, 2 heads of 64 tokens).
    shape = (1, 24, 4608, 128) if dev == "cuda" else (1, 2, 64, 16)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(3))

    def bare():
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        with ctx():
            o = F.scaled_dot_product_attention(qq, kk, vv)
        o.float().square().mean().backward()
        return [qq.grad, kk.grad, vv.grad]

    out["flux_dev_attention"] = twice(bare, dev)

    # A small Flux's resident LoRA step (the test's shape: 16 image, 8 text tokens).
    def small():
        import zoo_anchor as za

        torch.manual_seed(0)
        model = za.build(train_step.TINY["reference"], device=dev)
        train_step.add_lora(model)
        x = za.inputs("flux-dev", train_step.TINY["cases"][0], dev)
        key = "hidden_states"
        x[key] = x[key].clone().requires_grad_(True)
        with ctx():
            loss = train_step.first(model(**x)).float().square().mean()
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        return [loss.detach(), x[key].grad] + grads

    if "error" in out["flux_dev_attention"] and ("illegal" in out["flux_dev_attention"]["error"] or "Accelerator" in out["flux_dev_attention"]["error"]):
        # The bare attention broke this process's CUDA context: nothing after it would be its own result.
        out["small_flux_lora"] = {"error": "not run: the bare attention's error broke this process's CUDA context"}
    else:
        out["small_flux_lora"] = twice(small, dev)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--backend", choices=BACKENDS)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args()
    if a.backend:
        import torch

        doc = {"gpu": torch.cuda.get_device_name() if a.device == "cuda" else "none", "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version() if a.device == "cuda" else None, **probe(a.backend, a.device)}
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        return
    rows = []
    for b in BACKENDS:
        part = f"{a.out}.{b}.json"
        if os.path.exists(part):
            os.remove(part)  # a file of an earlier run is not this one's result
        t = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, part, "--backend", b, "--device", a.device], capture_output=True, text=True,
                               timeout=300)
            rc, tail = r.returncode, (r.stderr.strip().splitlines() or ["no output"])[-1][:400]
        except subprocess.TimeoutExpired:
            rc, tail = None, "timed out after 300 s"
        row = json.load(open(part)) if os.path.exists(part) else {"backend": b, "error": tail}
        row["rc"], row["wall_s"] = rc, round(time.perf_counter() - t, 1)
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
    with open(a.out, "w") as fh:
        json.dump({"what": "SDPA's backward per backend (bench/anchors/sdpa_probe.py)",
                   "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
