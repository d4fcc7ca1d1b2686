"""Steps, streams and the host: what a step is, no host sync in a steady step, a
user's stream, graph capture refused, interrupted forwards, users' hooks, two GPUs. CPU rows run on the simulated device; CUDA rows print SKIPPED
without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload import OffloadError
from models import MODELS
from helpers import HAS_CUDA, NO_CUDA, _bits, _out, _to, _snapshot, _same_snapshot, _zoo_anchor, _CAPTURE, _Lin, _Running


def _capture_outcome(sabotage: bool) -> str:
    import subprocess

    script = _CAPTURE.format(tests=str(Path(__file__).parent), sabotage=sabotage)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    lines = [l for l in r.stdout.splitlines() if l.startswith("OUTCOME")]
    assert lines, f"the capture script printed no outcome (rc {r.returncode}): {r.stderr[-2000:]}"
    return lines[-1]



TWO_GPUS = HAS_CUDA and torch.cuda.device_count() >= 2



REQUIRE_TWO = os.environ.get("OFFLOAD_REQUIRE_TWO_GPUS") == "1"



def test_a_long_host_wait_lets_other_python_threads_run():
    # The engine's host-side waits (here the bandwidth probe's copies and
    # synchronisations) run with the GIL released: another thread keeps running
    # through the call. Held, no line of the other thread runs between the call's
    # first and last 50 ms.
    import threading
    import time

    model, _, _ = MODELS["flux"]()
    h = offload.enable(model, device="cpu")
    stamps, stop = [], threading.Event()

    def other():
        while not stop.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=other)
    th.start()
    try:
        time.sleep(0.02)
        # A call long enough to tell, however fast or busy this machine: the
        # passes doubled until one call takes at least 0.3 s.
        passes = 100
        for _ in range(16):
            t0 = time.perf_counter()
            h.probe_bandwidth(passes)
            t1 = time.perf_counter()
            if t1 - t0 >= 0.3:
                break
            passes *= 2
    finally:
        stop.set()
        th.join()
        offload.disable(model)
    assert t1 - t0 >= 0.3, f"the probe took {t1 - t0:.3f} s at {passes} passes: too short to tell"
    inside = [s for s in stamps if t0 + 0.05 < s < t1 - 0.05]
    # Held, none; released, the other thread wakes about once a millisecond: ask
    # for a tenth of that (a busy machine wakes it less often).
    want = max(10, int((t1 - t0 - 0.1) * 100))
    assert len(inside) >= want, f"the other thread ran {len(inside)} times in the {t1 - t0:.2f} s call (want {want})"



def test_metrics_before_any_step_is_a_named_error():
    model, _, _ = MODELS["t5"]()
    h = offload.enable(model, device="cpu")
    with pytest.raises(OffloadError, match="no step has ended"):
        h.metrics()
    offload.disable(model)



def test_no_host_sync_in_steady_state_on_the_simulated_device():
    # The CUDA row's check, on the CPU: after the first step (which learns the
    # order), a step synchronises the host nowhere, and computes as resident.
    model, inputs, _ = MODELS["flux"]()
    with torch.no_grad():
        ref = _out(model(**inputs)).clone()
    h = offload.enable(model, device="cpu", depth=1)
    with torch.no_grad():
        _out(model(**inputs))
        syncs = h.counters()["syncs"]
        out = _out(model(**inputs)).clone()
        out2 = _out(model(**inputs)).clone()
    assert h.counters()["syncs"] == syncs, "a steady-state step synchronised the host"
    assert torch.equal(_bits(out), _bits(ref)) and torch.equal(_bits(out2), _bits(ref))
    offload.disable(model)



@NO_CUDA
def test_cuda_user_stream_and_no_host_sync_in_steady_state():
    model, inputs, _ = MODELS["flux"]()
    model.to("cuda")
    with torch.no_grad():
        ref = _out(model(**_to(inputs, "cuda"))).clone()
    model.to("cpu")
    h = offload.enable(model, device="cuda", depth=1)
    with torch.no_grad():
        _out(model(**_to(inputs, "cuda")))
        syncs = h.counters()["syncs"]
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            out = _out(model(**_to(inputs, "cuda"))).clone()
        torch.cuda.current_stream().wait_stream(s)
        out2 = _out(model(**_to(inputs, "cuda"))).clone()
    assert h.counters()["syncs"] == syncs, "a steady-state step synchronised the host"
    assert torch.equal(_bits(out), _bits(ref)) and torch.equal(_bits(out2), _bits(ref))
    assert h.violations() == []
    offload.disable(model)



@NO_CUDA
def test_cuda_a_forward_probe_or_calibration_under_graph_capture_is_refused_and_the_module_runs_on():
    """torch.cuda.graph captures on a side stream of its own: a forward, a probe
    or a calibration under it is a named error before the engine issues
    anything, and the same module runs bitwise equal outside capture after."""
    model, inputs, _ = MODELS["flux"]()
    x = _to(inputs, "cuda")
    model.to("cuda")
    with torch.no_grad():
        ref = _out(model(**x)).clone()
    model.to("cpu")
    h = offload.enable(model, device="cuda", depth=1)
    with torch.no_grad():
        _out(model(**x))
    calls = {
        "forward": lambda: model(**x),
        "probe_bandwidth": lambda: h.probe_bandwidth(1),
        "calibration": lambda: h.calibration(),
    }
    for name, call in calls.items():
        with pytest.raises(OffloadError, match="captured into a CUDA graph") as e, torch.no_grad():
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                call()
        said = str(e.value)
        assert said.startswith(f"component {h.component!r}: "), said
        assert (said.split(": ")[1].startswith("block ") if name == "forward" else name in said), said
    with torch.no_grad():
        out = _out(model(**x)).clone()
    assert torch.equal(_bits(out), _bits(ref))
    assert h.violations() == []
    assert h.metrics()["forgotten_guards"] == 0
    offload.disable(model)



@NO_CUDA
def test_cuda_the_capture_test_fails_without_the_check_on_torchs_stream():
    """Sabotage of the test above, each in its own process (a capture gone wrong
    may leave the device unusable to the rest): with the check on torch's
    current stream, the capture is refused by name; without it, it is not (the
    engine's own check looks at its compute stream, which torch.cuda.graph does
    not capture)."""
    assert "captured into a CUDA graph" in _capture_outcome(sabotage=False)
    broken = _capture_outcome(sabotage=True)
    assert "captured into a CUDA graph" not in broken, broken
    print("without the check:", broken)



def test_a_component_called_through_another_method_than_forward_ends_its_steps():
    # A pipeline calls its VAE through decode(), which no forward hook sees: a
    # block asked for again begins the next step, so its steps end and have
    # metrics (before, none ever did), the output bitwise the resident one.
    from diffusers import AutoencoderKL

    from models import _randomize

    vae = _randomize(AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32, 32], layers_per_block=1,
                                   norm_num_groups=32, down_block_types=["DownEncoderBlock2D"] * 2,
                                   up_block_types=["UpDecoderBlock2D"] * 2), 3)
    z = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        ref = vae.decode(z).sample.clone()
    before = _snapshot(vae)
    h = offload.enable(vae, device="cpu")
    with torch.no_grad():
        outs = [vae.decode(z).sample.clone() for _ in range(3)]
    m = h.metrics()
    offload.disable(vae)
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))
    # The decoder's blocks (its up blocks and its mid block's resnets), once each a step, all prefetched.
    assert m["blocks"] == 4 and m["misses"] == 0 and h.steps == 2, (m, h.steps)
    _same_snapshot(before, _snapshot(vae))



def test_a_block_run_twice_inside_one_forward_is_one_step():
    # Inside the module's forward a block asked for again is the model's own
    # doing: one step a forward, whatever it repeats.
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for b in list(self.blocks) + [self.blocks[0]]:
                x = b(x)
            return x

    torch.manual_seed(0)
    m = Twice().to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m(x).clone()
    h = offload.enable(m, device="cpu")
    with torch.no_grad():
        outs = [m(x).clone() for _ in range(2)]
    assert h.steps == 2 and h.metrics()["blocks"] == 4, (h.steps, h.metrics())
    offload.disable(m)
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))



def test_stream_summary_tells_the_hosts_gaps_from_the_devices():
    # `zoo_anchor.py --kernels` reads a profiled step: a gap of 5 µs or more before
    # a kernel launched after the stream ran dry is the host's; one before a kernel
    # queued long before is the device's (a wait, the front end).
    za = _zoo_anchor()

    def kernel(ts, dur, corr, stream=7, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": f"k{corr}", "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": corr}}

    def launch(ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    trace = {"traceEvents": [
        launch(0, 2, 1), launch(3, 2, 2), launch(120, 2, 3), launch(130, 1, 4),
        kernel(10, 50, 1),
        kernel(70, 40, 2),  # 10 µs after k1 ended at 60, launched at 5: the device's
        kernel(125, 10, 3),  # 15 µs after k2 ended at 110, its launch returned at 122: the host's
        kernel(137, 3, 4),  # 2 µs: not a long gap
        kernel(0, 500, 9, stream=29, cat="gpu_memcpy"),
        # Stream 8: a short kernel inside a long one (launched early) leaves no gap
        # after it; the next starts 6 µs after the long one ends.
        kernel(0, 100, 11, stream=8), kernel(10, 5, 12, stream=8), kernel(106, 4, 13, stream=8),
    ]}
    s = za.stream_summary(trace)
    k = s["7"]
    assert (k["kernels"], k["long_gaps"], k["long_gaps_with_launch"], k["long_gaps_host_late"]) == (4, 2, 2, 1)
    assert k["long_gaps_s"] == pytest.approx(25e-6) and k["long_gaps_host_late_s"] == pytest.approx(15e-6)
    assert k["gaps_s"] == pytest.approx(27e-6) and k["busy_s"] == pytest.approx(103e-6)
    assert (s["29"]["memcpys"], s["29"]["kernels"]) == (1, 0)
    assert (s["8"]["long_gaps"], s["8"]["gaps_s"]) == (1, pytest.approx(6e-6))
    # Two devices' streams of one number are two streams.
    two = za.stream_summary({"traceEvents": [dict(kernel(0, 5, 1), args={"stream": 7, "device": d}) for d in (0, 1)]})
    assert sorted(two) == ["0:7", "1:7"]



# A row of its own, as the relay's: bench/py-run.sh deselects it on one GPU and
# runs it with PY_TWO_GPUS=1 (OFFLOAD_REQUIRE_TWO_GPUS=1) on two.
@pytest.mark.skipif(not TWO_GPUS and not REQUIRE_TWO, reason="SKIPPED: needs two CUDA devices")
def test_a_module_on_the_second_gpu_leaves_torchs_current_device_alone():
    # The engine binds its device's context to the calling thread; every call
    # puts the caller's back, so torch's current device stays what it was.
    assert TWO_GPUS, "OFFLOAD_REQUIRE_TWO_GPUS=1 but torch sees fewer than two CUDA devices"
    model, inputs, _ = MODELS["t5"]()
    with torch.cuda.device(0):
        h = offload.enable(model, device="cuda:1")
        assert torch.cuda.current_device() == 0
        with torch.no_grad():
            model(**_to(inputs, "cuda:1"))
        h.metrics()
        assert torch.cuda.current_device() == 0, "a step left device 1 current"
        offload.disable(model)
        assert torch.cuda.current_device() == 0



def test_an_interrupted_forward_ends_its_step_when_the_next_begins():
    # KeyboardInterrupt skips torch's always_call hooks: the next forward still
    # starts a step of its own, computing as resident.
    m, x = _Lin(), torch.randn(2, 8)
    with torch.no_grad():
        ref = m(x).clone()
    h = offload.enable(m, device="cpu")

    def interrupt(mod, args):
        raise KeyboardInterrupt

    hook = m.blocks[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        m(x)
    hook.remove()
    with torch.no_grad():
        out = m(x)
    assert torch.equal(out, ref)
    assert h.metrics()["blocks"] == 3, h.metrics()
    offload.disable(m)



def test_an_interrupted_block_that_wrote_its_weights_is_named_and_closes_only_its_step():
    # Ctrl-C inside a block that had written its streamed weights in place: the
    # next forward names the write, and its failed start closes no second,
    # empty step (the last step's metrics stay the interrupted one's).
    class Interrupted(_Running):
        stop = False

        def forward(self, x):
            out = super().forward(x)
            if self.stop:
                raise KeyboardInterrupt
            return out

    m = torch.nn.Module()
    torch.manual_seed(0)
    m.blocks = torch.nn.ModuleList([Interrupted(), Interrupted()])
    m.blocks[0].stop = True
    m.forward = lambda x: m.blocks[1](m.blocks[0](x))
    h = offload.enable(m, device="cpu")
    x = torch.randn(3, 4)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        m(x)
    with pytest.raises(OffloadError, match=r"block blocks\.0 wrote its streamed weights in place"), torch.no_grad():
        m(x)
    assert (h.steps, h.metrics()["blocks"]) == (1, 1), (h.steps, h.metrics())
    offload.disable(m)



def test_a_users_pre_hook_that_raises_closes_no_empty_step():
    # A pre-hook registered before enable runs before ours; when it raises, the
    # forward never began a step, and torch's always_call step hook ends none.
    m, x = _Lin(), torch.randn(2, 8)
    fail = [False]

    def guard(mod, args):
        if fail[0]:
            raise ValueError("refused by the user's hook")

    m.register_forward_pre_hook(guard)
    h = offload.enable(m, device="cpu")
    with torch.no_grad():
        m(x)
    before = (h.steps, h.metrics())
    fail[0] = True
    with pytest.raises(ValueError, match="refused"), torch.no_grad():
        m(x)
    assert (h.steps, h.metrics()) == before, "a forward that never began closed a step"
    fail[0] = False
    with torch.no_grad():
        m(x)
    assert h.steps == before[0] + 1
    offload.disable(m)



def test_a_users_pre_hook_registered_before_enable_sees_the_weights():
    m, x = _Lin(), torch.randn(2, 8)
    seen = []
    m.blocks[1].register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.sum().item()))
    with torch.no_grad():
        m(x)
    offload.enable(m, device="cpu")
    with torch.no_grad():
        m(x)
    offload.disable(m)
    assert seen[0] == seen[1], seen



def test_a_users_forward_hook_registered_after_enable_sees_the_weights():
    # The package's post-hook gives the block back: it runs last, after a hook
    # the user adds while the module is offloaded.
    m, x = _Lin(), torch.randn(2, 8)
    seen = []

    def look(mod, args, out):
        seen.append(mod.weight.sum().item())

    with torch.no_grad():
        m(x)
    resident = m.blocks[1].weight.sum().item()
    offload.enable(m, device="cpu")
    hook = m.blocks[1].register_forward_hook(look)
    with torch.no_grad():
        m(x)
    hook.remove()
    offload.disable(m)
    assert seen == [resident], (seen, resident)

