"""Training over streamed weights: in grad mode a block's weights are let go
after its forward and the backward brings each block back, in reverse. CPU rows
on the simulated device; CUDA rows print SKIPPED without a GPU and fail with
OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import offload
from offload._module import Offloaded

from helpers import NO_CUDA

DEVICES = ["cpu", pytest.param("cuda", marks=NO_CUDA)]


class _Block(nn.Module):
    """A frozen base (two Linears and a norm) with a trainable low-rank adapter."""

    def __init__(self, n: int = 64, rank: int = 4):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(n, 2 * n), nn.Linear(2 * n, n), nn.LayerNorm(n)
        self.lora_a = nn.Parameter(torch.randn(rank, n) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(n, rank) * 0.1)

    def forward(self, x):
        h = self.down(nn.functional.gelu(self.up(self.norm(x))))
        return x + h + (x @ self.lora_a.t()) @ self.lora_b.t()


class _Model(nn.Module):
    def __init__(self, blocks: int = 6, ckpt: str = ""):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(blocks))
        for name, p in self.named_parameters():
            p.requires_grad_("lora" in name)
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            if self.ckpt:
                x = checkpoint(b, x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = b(x)
        return x


def _train(model: nn.Module, device: str, steps: int = 3, handle=None, outside=contextlib.nullcontext):
    """``steps`` of SGD on the adapters: each step's loss, input gradient and
    adapters, and each backward's metrics where streamed (the model called
    inside ``outside()``)."""
    torch.manual_seed(1)
    xs = [torch.randn(8, 64, device=device) for _ in range(steps)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    out = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        opt.zero_grad()
        with outside():
            y = model(x)
        loss = y.square().mean()
        loss.backward()
        opt.step()
        adapters = [p.detach().clone() for p in model.parameters() if p.requires_grad]
        out.append((loss.detach().clone(), x.grad.clone(), adapters,
                    None if handle is None else (handle.metrics("forward"), handle.metrics("backward"))))
    return out


def _same(a, b):
    for (la, ga, wa, _), (lb, gb, wb, _) in zip(a, b):
        assert torch.equal(la, lb) and torch.equal(ga, gb)
        assert all(torch.equal(p, q) for p, q in zip(wa, wb))


@pytest.mark.parametrize("dev", DEVICES)
def test_training_over_streamed_weights_gives_the_resident_steps_and_streams_the_backward_in_reverse(dev):
    resident = _train(_Model().to(dev), dev)
    model = _Model()
    h = offload.enable(model, device=dev, depth=1)
    streamed = _train(model, dev, handle=h)
    _same(streamed, resident)
    for i, (*_, (fwd, bwd)) in enumerate(streamed):
        assert not fwd["backward"] and bwd["backward"], (fwd, bwd)
        assert bwd["blocks"] == 6, bwd  # each block brought back once
        if i > 0:
            assert (fwd["retraces"], bwd["retraces"], fwd["misses"], bwd["misses"]) == (0, 0, 0, 0), (fwd, bwd)
    assert h.violations() == []
    offload.disable(model)


def _kept_buffers(model, dev, pack=None, outside=contextlib.nullcontext):
    """How many blocks' buffers are still alive after a forward in grad mode
    (the model called inside ``outside()``)."""
    kept, lend = [], Offloaded._lend

    def spy(self, block):
        lend(self, block)
        kept.append(StorageWeakRef(self._buffer.untyped_storage()))

    h = offload.enable(model, device=dev, depth=1)
    old = Offloaded._pack
    try:
        Offloaded._lend = spy
        if pack is not None:
            Offloaded._pack = pack
        x = torch.randn(8, 64, device=dev, requires_grad=True)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            with outside():
                out = model(x)
        alive = sum(not r.expired() for r in kept)
        # The package's own count agrees: what is alive beyond the buffers the
        # ring's slots hold (on CUDA its two slots' last copies; none on the
        # simulated device) is retained (warned of from the second such step).
        ring = {StorageWeakRef(b.untyped_storage()).cdata for b in h._engine().held_buffers()}
        assert len(ring) <= (2 if dev == "cuda" else 0), ring
        retained = h.metrics("forward")["retained_blocks"]
        assert retained == sum(not r.expired() and r.cdata not in ring for r in kept), (retained, alive, len(ring))
        assert not any("lent weights" in str(w.message) for w in warned), [str(w.message) for w in warned]
        out.square().mean().backward()
    finally:
        Offloaded._lend, Offloaded._pack = lend, old
        offload.disable(model)
    return alive


@pytest.mark.parametrize("dev", DEVICES)
def test_a_forward_in_grad_mode_keeps_no_blocks_weights_for_the_backward(dev):
    # On CUDA a lent buffer is the slot's own (the ring keeps its depth + 1 = 2
    # slots' last copies until the next copies replace them); on the simulated
    # device each lend is a copy of the slot.
    assert _kept_buffers(_Model(), dev) <= (2 if dev == "cuda" else 0)
    # The check can fail: with the weights saved as themselves (autograd's own
    # saving, before this package's hooks), every block's buffer stays alive.
    assert _kept_buffers(_Model(), dev, pack=lambda self, t: t) == 6


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
def test_gradient_checkpointing_over_streamed_weights_gives_the_resident_steps(dev, ckpt):
    resident = _train(_Model(ckpt=ckpt).to(dev), dev)
    model = _Model(ckpt=ckpt)
    h = offload.enable(model, device=dev, depth=1)
    streamed = _train(model, dev, handle=h)
    _same(streamed, resident)
    # Each block recomputed and brought back for its backward together: no more
    # copies in the backward than its blocks.
    for *_, (fwd, bwd) in streamed[1:]:
        assert bwd["copies"] <= 6 + 1, bwd
    # The recompute that opens the backward (the last block's, before any of its
    # weights is unpacked) is the backward's: the forward's step is the whole
    # forward (it was that block alone, its copies left out of the step's
    # bytes), the backward's every block twice (recompute, then backward).
    for *_, (fwd, bwd) in streamed:
        assert (fwd["backward"], fwd["blocks"], bwd["backward"], bwd["blocks"]) == (False, 6, True, 12), (fwd, bwd)
    # From the third step the ring turns at each pass's end with its two slots
    # kept: 6 - 2 copies a pass, none wasted.
    fwd, bwd = streamed[2][3]
    assert (fwd["copies"], bwd["copies"], fwd["wasted_prefetches"] + bwd["wasted_prefetches"]) == (4, 4, 0), (fwd, bwd)
    offload.disable(model)


@pytest.mark.parametrize("dev", DEVICES)
def test_gradients_accumulated_over_forwards_and_under_autocast_are_the_resident_ones(dev):
    def run(model):
        torch.manual_seed(2)
        xs = [torch.randn(8, 64, device=dev, requires_grad=True) for _ in range(3)]
        loss = sum(model(x).square().mean() for x in xs[:2])  # two forwards, one backward
        loss.backward()
        with torch.autocast(dev, dtype=torch.bfloat16):
            model(xs[2]).float().square().mean().backward()
        return [x.grad for x in xs] + [p.grad for p in model.parameters() if p.requires_grad]

    want = run(_Model().to(dev))
    model = _Model()
    h = offload.enable(model, device=dev, depth=1)
    got = run(model)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert h.metrics("backward")["backward"] and h.violations() == []
    offload.disable(model)


def _one_pass_over_two_forwards(make, dev, forward):
    """Three iterations of ``(l1 + l2).backward()`` over two forwards
    (``forward(model, x)``), resident and streamed: the streamed gradients must
    be the resident ones, and each iteration three steps (two forwards, one
    backward of 24 block runs: each block recomputed twice and run backward
    twice)."""

    def run(model, handle=None):
        torch.manual_seed(3)
        xs = [torch.randn(8, 64, device=dev, requires_grad=True) for _ in range(2)]
        seen = []
        for _ in range(3):
            for x in xs:
                x.grad = None
            model.zero_grad()
            (forward(model, xs[0]).square().mean() + forward(model, xs[1]).square().mean()).backward()
            if handle is not None:
                seen.append((handle.steps, handle.metrics("backward")))
        return [x.grad for x in xs] + [p.grad for p in model.parameters() if p.requires_grad], seen

    want, _ = run(make().to(dev))
    model = make()
    h = offload.enable(model, device=dev, depth=1)
    got, seen = run(model, h)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [n for n, _ in seen] == [3, 6, 9], seen
    assert all(b["backward"] and b["blocks"] == 24 for _, b in seen), seen
    assert h.violations() == []
    offload.disable(model)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("ckpt", ["reentrant", "non-reentrant"])
def test_a_checkpointed_backward_over_two_forwards_is_one_backward_step(dev, ckpt):
    # (l1 + l2).backward() over two checkpointed forwards: one autograd pass
    # that recomputes every block twice. It is one backward step, not split
    # where a block comes round again (it was two of 12 blocks).
    _one_pass_over_two_forwards(lambda: _Model(ckpt=ckpt), dev, lambda m, x: m(x))


@pytest.mark.parametrize("dev", DEVICES)
def test_a_whole_module_checkpointed_twice_recomputes_inside_one_backward_step(dev):
    # checkpoint(model, x) twice, then (l1 + l2).backward(): the pass recomputes
    # the second forward, runs its blocks' backwards, then recomputes the first
    # forward while its backward is live. Those forwards are the backward's
    # step (the second ended the backward as an abandoned one: 7 steps an iteration).
    _one_pass_over_two_forwards(_Model, dev, lambda m, x: checkpoint(m, x, use_reentrant=False))


class _LinearWeights(torch.overrides.TorchFunctionMode):
    """The storages of the weights each `linear` computes with, weakly."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.refs.append(StorageWeakRef(args[1].untyped_storage()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dev", DEVICES)
def test_a_base_stored_in_fp8_trains_as_resident_and_its_compute_casts_are_not_kept(dev):
    from diffusers.hooks import apply_layerwise_casting

    # float32 compute on both devices: the unconverted norms hand the Linears float32.
    compute = torch.float32

    def build():
        m = _Model()
        for b in m.blocks:
            apply_layerwise_casting(b, storage_dtype=torch.float8_e4m3fn, compute_dtype=compute, skip_modules_pattern=("norm", "lora"))
        return m

    want = _train(build().to(dev), dev)
    model = build()
    h = offload.enable(model, device=dev, depth=1)
    _same(_train(model, dev, handle=h), want)

    def kept(pack=None):
        old = Offloaded._pack
        if pack is not None:
            Offloaded._pack = pack
        try:
            x = torch.randn(8, 64, device=dev, requires_grad=True)
            with _LinearWeights() as seen:
                out = model(x)
            alive = sum(not r.expired() for r in seen.refs)
            out.square().mean().backward()
        finally:
            Offloaded._pack = old
        return alive, len(seen.refs)

    # The casts layerwise casting makes for each Linear's compute: none alive after
    # the forward (each made again from its block in the backward); all of them
    # with the weights saved as themselves.
    assert kept() == (0, 12) and h.metrics("forward")["retained_blocks"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sabotage keeps blocks' bytes too: warned of
        assert kept(pack=lambda self, t: t) == (12, 12)
    offload.disable(model)


@pytest.mark.parametrize("dev", DEVICES)
def test_a_backward_that_raises_leaves_the_module_usable(dev):
    want = _train(_Model().to(dev), dev)
    model = _Model()
    h = offload.enable(model, device=dev, depth=1)

    def boom(grad):
        raise RuntimeError("a hook that fails mid-backward")

    hook = model.blocks[3].lora_a.register_hook(boom)
    with pytest.raises(RuntimeError, match="fails mid-backward"):
        model(torch.randn(8, 64, device=dev, requires_grad=True)).square().mean().backward()
    hook.remove()
    # The next forward ends the backward that never reached its end: training then
    # gives the resident steps, each pass counted as the pass it is.
    steps = h.steps
    got = _train(model, dev, handle=h)
    _same(got, want)
    assert h.steps == steps + 1 + 2 * 3, (steps, h.steps)  # the unfinished backward, then each pass of 3 steps
    for *_, (fwd, bwd) in got:
        assert not fwd["backward"] and bwd["backward"] and bwd["blocks"] == 6, (fwd, bwd)
    offload.disable(model)


def test_a_calibration_of_traced_training_steps_has_each_blocks_backward_time_and_plans_with_it():
    # The simulated device traces its steps as CUDA does: the forward's and the
    # backward's compute spans apart, so the cost model holds both passes.
    model = _Model()
    h = offload.enable(model, device="cpu", depth=1)
    h.enable_trace()
    _train(model, "cpu", steps=2)
    cal = h.calibration()
    h.disable_trace()
    offload.disable(model)
    assert len(cal["blocks"]) == 6
    assert all(b["compute_s"] > 0 and b.get("backward_s", 0) > 0 for b in cal["blocks"]), cal["blocks"]
    # Given, they replace the traced ones; one block missing is named.
    given = {b["id"]: 2 * b["compute_s"] for b in cal["blocks"]}
    fwd_s = {b["id"]: b["compute_s"] for b in cal["blocks"]}
    again = offload.enable(_Model(), device="cpu", depth=1)
    assert [b["backward_s"] for b in again.calibration(fwd_s, backward_s=given)["blocks"]] == list(given.values())
    with pytest.raises(offload.OffloadError, match="no time in backward_s"):
        again.calibration(fwd_s, backward_s={k: v for k, v in list(given.items())[1:]})
    again.disable()
    # The planner takes a training step's model: the plan trains as resident.
    planned = _Model()
    block = cal["blocks"][0]["bytes"]
    p = offload.enable(planned, device="cpu", budget_gib=5 * block / 2**30, calibration=cal)
    _same(_train(planned, "cpu"), _train(_Model(), "cpu"))
    plan = p.plan()
    assert plan["chosen_by"] == "budget" and "over a training step" in plan["why"], plan
    offload.disable(planned)
    # A forward's steps alone: no backward times.
    fwd = _Model()
    f = offload.enable(fwd, device="cpu", depth=1)
    f.enable_trace()
    with torch.no_grad():
        fwd(torch.randn(8, 64))
        fwd(torch.randn(8, 64))
    assert all("backward_s" not in b for b in f.calibration()["blocks"])
    offload.disable(fwd)


def test_the_automatic_depth_of_a_training_loop_is_chosen_from_its_forward_and_backward():
    # The second step of a training loop is its first backward: the depth is
    # chosen at the end of the next forward, from that forward's blocks' compute
    # and the traced backward's, the replay running both passes (the turns'
    # blocks kept in their slots, as the ring does).
    model = _Model()
    h = offload.enable(model, device="cpu")
    _train(model, "cpu", steps=1)
    assert h.plan()["chosen_by"] == "auto" and "until the second step ends" in h.plan()["why"], h.plan()
    _train(model, "cpu", steps=2)
    why = h.plan()["why"]
    assert "chosen from a traced training step (a forward, then its backward in reverse)" in why, why
    compute = float(why.split("compute (")[1].split(" s)")[0])
    assert compute > 0, why  # a forward's blocks computed in the traced step
    offload.disable(model)


@pytest.mark.parametrize("how", ["blocks", "whole"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_training_compiled_blocks_or_a_compiled_module_streams_the_backward_as_eager(backend, how):
    # Trainers mostly keep streamed blocks out of torch.compile. Compiled (each
    # block, or the whole module with fullgraph=False), AOT autograd's saved
    # weights go through the package's saved-tensor hooks as eager autograd's
    # do: the resident compiled run's losses, gradients and adapters, the
    # backward streamed in reverse, and no block's buffer kept past its forward.
    def build():
        m = _Model()
        if how == "blocks":
            for b in m.blocks:
                b.compile(backend=backend)
        else:
            m.compile(backend=backend)
        return m

    torch._dynamo.reset()
    try:
        ref = _train(build(), "cpu")
        m = build()
        h = offload.enable(m, device="cpu", depth=1)
        try:
            got = _train(m, "cpu", handle=h)
        finally:
            offload.disable(m)
        _same(ref, got)
        back = got[-1][3][1]
        assert back["blocks"] == 6 and back["misses"] == 0, back
        assert _kept_buffers(build(), "cpu") == 0
        # The check can fail under compile too: weights saved as themselves.
        assert _kept_buffers(build(), "cpu", pack=lambda self, t: t) == 6
    finally:
        torch._dynamo.reset()


class _Matmul(torch.autograd.Function):
    """A hand-written autograd function over a block's weight (as fused kernels
    and quantized layers write them): it saves the weight it was given, which a
    block's weight is while its block binds at first use, a placeholder."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g @ w, None


class _FunctionBlock(_Block):
    def forward(self, x):
        # The block's first use of a weight is inside the function.
        h = self.down(nn.functional.gelu(_Matmul.apply(x, self.up.weight)))
        return self.norm(x + h) + (x @ self.lora_a.t()) @ self.lora_b.t()


class _NoGradFirstBlock(_Block):
    def forward(self, x):
        # The block's first use of a weight is under no_grad (a statistic of
        # it), so a block binding at first use binds with grad off.
        with torch.no_grad():
            scale = self.up.weight.abs().amax().clamp(min=1.0)
        return super().forward(x) / scale


class _GradInsideBlock(_Block):
    def forward(self, x):
        # Run under no_grad, the block uses a weight (binding with grad off),
        # then turns grad on inside itself: its later uses build a graph that
        # saves its weights.
        scale = self.up.weight.abs().amax().clamp(min=1.0)
        with torch.enable_grad():
            return super().forward(x) / scale


class _AdapterGraphInsideBlock(_Block):
    inside = False  # set on one block

    def forward(self, x):
        # Grad turned on inside a block run under no_grad, over an input that
        # does not require grad: only the adapters' term builds a graph, and
        # it saves none of the block's weights.
        scale = self.up.weight.abs().amax().clamp(min=1.0)
        with torch.enable_grad() if self.inside else contextlib.nullcontext():
            return super().forward(x) / scale


class _PassThroughBlock(_Block):
    def forward(self, x):
        assert float(self.up.weight.abs().sum()) > 0  # its weights used: bound
        return x


class _FuncGradBlock(_Block):
    def forward(self, x):
        # A gradient taken inside the block by torch.func (a guidance term),
        # which refuses any saved-tensor hooks on the stack.
        g = torch.func.grad(lambda v: self.up(self.norm(v)).square().sum())(x)
        return super().forward(x) - 1e-3 * g


class _InterruptedOnceBlock(_Block):
    """Interrupted (Ctrl-C) mid-forward where armed, after a weight's use."""

    armed = False

    def forward(self, x):
        h = self.up(self.norm(x))
        if _InterruptedOnceBlock.armed:
            _InterruptedOnceBlock.armed = False
            raise KeyboardInterrupt
        return x + self.down(nn.functional.gelu(h)) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _with_blocks(cls):
    m = _Model()
    torch.manual_seed(2)
    m.blocks = nn.ModuleList(cls() for _ in range(6))
    for name, p in m.named_parameters():
        p.requires_grad_("lora" in name)
    return m


@pytest.mark.parametrize("dev", DEVICES)
def test_a_block_whose_first_weight_use_is_under_no_grad_still_keeps_no_weights_for_the_backward(dev):
    # Bound with grad off, its later grad-mode uses must still save weights as
    # their places: saved as views of the lent buffer they would keep every
    # block alive (and on CUDA read a slot the ring has since refilled).
    resident = _train(_with_blocks(_NoGradFirstBlock).to(dev), dev)
    m = _with_blocks(_NoGradFirstBlock)
    h = offload.enable(m, device=dev, depth=1)
    _same(_train(m, dev, handle=h), resident)
    offload.disable(m)
    assert _kept_buffers(_with_blocks(_NoGradFirstBlock), dev) <= (2 if dev == "cuda" else 0)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("lazy", [True, False])
def test_a_block_run_under_no_grad_that_builds_a_graph_inside_itself_over_its_weights_is_refused_by_name(dev, lazy):
    # Bound with grad off, then grad turned on inside it: autograd saved views
    # of the lent buffer, which the ring refills before the backward. Refused
    # at the block's end, naming it; the module is usable after (nothing kept
    # bound), and the same model with grad on outside trains bitwise. (Pushing
    # the saving hooks at every block's start would fix it instead, but breaks
    # torch.func's transforms inside a block run under no_grad, which refuse
    # any saved-tensor hooks.)
    m = _with_blocks(_GradInsideBlock)
    h = offload.enable(m, device=dev, depth=1, lazy=lazy)
    x = torch.randn(8, 64, device=dev, requires_grad=True)
    with pytest.raises(offload.OffloadError, match=r"block blocks\.0 ran with grad off but returned a tensor with a graph"):
        with torch.no_grad():
            m(x)
    assert h.violations() == []
    streamed = _train(m, dev, handle=h)
    offload.disable(m)
    _same(streamed, _train(_with_blocks(_GradInsideBlock).to(dev), dev))
    # A graph built inside over the adapters alone (the last block, its input
    # requiring no grad) saved none of the block's bytes: not refused, and
    # its backward gives the resident adapters' gradients. (A block after it
    # would take an input that requires grad and save its weights: refused.)
    def adapters_only(model):
        x = torch.randn(8, 64, device=dev, generator=torch.Generator(dev).manual_seed(3))
        with torch.no_grad():
            y = model(x)
        assert y.grad_fn is not None
        y.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert len(grads) == 2, len(grads)  # the last block's adapters
        return y.detach(), grads

    def last_builds_over_adapters():
        m = _with_blocks(_AdapterGraphInsideBlock)
        m.blocks[-1].inside = True
        return m

    want = adapters_only(last_builds_over_adapters().to(dev))
    m = last_builds_over_adapters()
    offload.enable(m, device=dev, depth=1, lazy=lazy)
    try:
        got = adapters_only(m)
    finally:
        offload.disable(m)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    # A block that hands back its input, which carries a graph from before
    # (not built inside it), is not refused.
    m = _with_blocks(_PassThroughBlock)
    offload.enable(m, device=dev, depth=1, lazy=lazy)
    y = x * 2
    assert y.grad_fn is not None
    try:
        with torch.no_grad():
            assert m(y) is y
    finally:
        offload.disable(m)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("lazy", [True, False])
def test_torch_func_inside_a_block_run_under_no_grad_gives_the_resident_output(dev, lazy):
    # No saved-tensor hooks of the package are on the stack in a block run
    # with grad off: torch.func's transforms, which refuse them, run there.
    x = torch.randn(8, 64, device=dev)
    with torch.no_grad():
        want = _with_blocks(_FuncGradBlock).to(dev)(x)
    m = _with_blocks(_FuncGradBlock)
    offload.enable(m, device=dev, depth=1, lazy=lazy)
    try:
        with torch.no_grad():
            got = m(x)
    finally:
        offload.disable(m)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("lazy", [True, False])
def test_a_weight_a_custom_autograd_function_saves_comes_back_for_the_backward(dev, lazy):
    # The function's forward runs with grad off and reads the weight there: a
    # block binding at first use binds inside it. What it saved is brought back
    # in the backward like any saved weight, bitwise the resident steps.
    resident = _train(_with_blocks(_FunctionBlock).to(dev), dev)
    m = _with_blocks(_FunctionBlock)
    h = offload.enable(m, device=dev, depth=1, lazy=lazy)
    streamed = _train(m, dev, handle=h)
    _same(streamed, resident)
    assert all(bwd["blocks"] == 6 for *_, (_, bwd) in streamed), [s[-1] for s in streamed]
    offload.disable(m)


@pytest.mark.parametrize("dev", DEVICES)
def test_a_users_saved_tensor_hooks_entered_after_an_interrupt_mid_block_keep_working(dev):
    # An interrupt skips torch's always_call hooks: the block's saved-tensor
    # hooks stay pushed. A context of the user's entered next sits on them; ours
    # must not pop theirs (they then chained to themselves: RecursionError) and
    # go once they are back on top.
    resident = _train(_with_blocks(_InterruptedOnceBlock).to(dev), dev)
    m = _with_blocks(_InterruptedOnceBlock)
    h = offload.enable(m, device=dev, depth=1)
    _InterruptedOnceBlock.armed = True
    with pytest.raises(KeyboardInterrupt):
        m(torch.randn(8, 64, device=dev, requires_grad=True))
    packed = []

    def users():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: (packed.append(1), t)[1], lambda t: t)

    streamed = _train(m, dev, handle=h, outside=users)
    _same(streamed, resident)
    assert packed, "the user's hooks saw nothing"
    offload.disable(m)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "hooks left on the stack"
    # Interrupted inside the user's context: its exit pops ours in place of its
    # own, which are left on top. The package's next step pops them (else
    # every later save goes through them, and torch.func refuses to run).
    m = _with_blocks(_InterruptedOnceBlock)
    h = offload.enable(m, device=dev, depth=1)
    _InterruptedOnceBlock.armed = True
    with pytest.raises(KeyboardInterrupt):
        with users():
            m(torch.randn(8, 64, device=dev, requires_grad=True))
    streamed = _train(m, dev, handle=h, steps=1)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None, "the user's hooks left on the stack"
    offload.disable(m)
    _same(streamed, resident[:1])


class _CtxMatmul(torch.autograd.Function):
    """A weight kept on the ctx itself, not through save_for_backward (as
    bitsandbytes' 4-bit matmul keeps it)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.tensors = (x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        _, w = ctx.tensors
        return g @ w, None


class _CtxFunctionBlock(_Block):
    def forward(self, x):
        with torch.enable_grad():
            return _CtxMatmul.apply(x @ self.lora_a.t() @ self.lora_b.t(), self.up.weight[:, : x.shape[-1]])[..., :64]


@pytest.mark.parametrize("dev", DEVICES)
def test_a_graph_built_under_no_grad_or_torch_func_that_keeps_a_weight_is_refused_however_it_keeps_it(dev):
    # The grad-off graph check finds a weight a Function keeps on its ctx, and
    # one saved through torch.func's wrappers (the whole model under
    # torch.func.grad, where no saved-tensor hooks can be pushed).
    # (Bound at its start, with grad off: bound at the weight's first use,
    # inside `enable_grad`, the saved-tensor hooks would be pushed, which a
    # ctx attribute escapes; not seen, noted in bench/NOTES.md.)
    m = _with_blocks(_CtxFunctionBlock)
    offload.enable(m, device=dev, depth=1, lazy=False)
    try:
        with pytest.raises(offload.OffloadError, match=r"block blocks\.0 ran with grad off but returned a tensor with a graph"):
            with torch.no_grad():
                m(torch.randn(8, 64, device=dev))
    finally:
        offload.disable(m)
    m = _with_blocks(_Block)
    offload.enable(m, device=dev, depth=1)
    try:
        with pytest.raises(offload.OffloadError, match=r"block blocks\.0 ran with grad off but returned a tensor with a graph"):
            torch.func.grad(lambda v: m(v).square().mean())(torch.randn(8, 64, device=dev))
    finally:
        offload.disable(m)


def test_a_blocks_keyword_inputs_are_not_held_past_it():
    # The pre-hook keeps a block's keywords for the grad-off graph check at its
    # end; they are let go there, not held until the next forward.
    import weakref

    class _ByKeyword(_Model):
        def forward(self, x):
            for b in self.blocks:
                x = b(x=x)
                seen.append(weakref.ref(x))
            return x

    seen = []
    m = _ByKeyword()
    offload.enable(m, device="cpu", depth=1)
    try:
        with torch.no_grad():
            y = m(torch.randn(8, 64)).sum()
        assert float(y) == float(y)
        # The last block's input is the block before's output, held by nothing now.
        assert seen[-2]() is None, "the last block's keyword input is still held"
    finally:
        offload.disable(m)


@pytest.mark.parametrize("dev", DEVICES)
def test_blocks_whose_bytes_something_keeps_are_counted_and_warned_of_by_name(dev):
    # A forward in grad mode keeps no block's bytes: none retained at any
    # step's end. A weight kept on a custom Function's ctx (escaping the
    # saved-tensor hooks) keeps its block's bytes until the backward: counted
    # per step and warned of once (from the second such step), naming them.
    m = _Model()
    h = offload.enable(m, device=dev, depth=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for *_, (fwd, bwd) in _train(m, dev, handle=h):
            assert fwd["retained_blocks"] == 0 and bwd["retained_blocks"] == 0, (fwd, bwd)
    offload.disable(m)
    # The same with autograd saving the weights itself (the package's hooks
    # sabotaged): every block but the ring's two slots' is retained.
    old = Offloaded._pack
    Offloaded._pack = lambda self, t: t
    try:
        m = _Model()
        h = offload.enable(m, device=dev, depth=1)
        # Every block's bytes but those still in the ring's slots (on CUDA the
        # last two blocks'; the simulated device's ring holds no lent buffer).
        n = 4 if dev == "cuda" else 6
        names = ", ".join(f"blocks\\.{i}" for i in range(n))
        with pytest.warns(UserWarning, match=rf"lent weights of {n} block\(s\) \({names}\)"):
            _train(m, dev, steps=2)
        assert h.metrics("forward")["retained_blocks"] == n
        # Warned of once the step's bookkeeping is done: turned into an error,
        # the warning leaves the step ended all the same.
        m2 = _Model()
        h2 = offload.enable(m2, device=dev, depth=1)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                x = torch.randn(8, 64, device=dev, requires_grad=True)
                m2(x)
                with pytest.raises(UserWarning, match="lent weights"):
                    m2(x)
            assert h2.metrics()["retained_blocks"] == n and "kept_bytes" in h2.metrics(), h2.metrics()
        finally:
            offload.disable(m2)
    finally:
        Offloaded._pack = old
        offload.disable(m)
    # A weight a Function keeps on its ctx, the block bound inside enable_grad.
    m = _with_blocks(_CtxFunctionBlock)
    h = offload.enable(m, device=dev, depth=1)
    try:
        with pytest.warns(UserWarning, match=r"custom autograd Function"):
            with torch.no_grad():
                ys = [m(torch.randn(8, 64, device=dev)) for _ in range(2)]
        assert h.metrics()["retained_blocks"] == n and ys[-1].grad_fn is not None
        del ys
    finally:
        offload.disable(m)


class _KeepsEveryOtherStep(_Block):
    """A block whose forward keeps its weight in a list on every other call
    (one of two passes under guidance, say), the list emptied on the others."""

    kept: list = []
    calls = 0

    def forward(self, x):
        step = type(self).calls // 6  # six blocks a step
        type(self).calls += 1
        if step % 2 == 0:
            type(self).kept.append(self.up.weight[:])  # a view of the lent bytes
        else:
            type(self).kept.clear()
        return super().forward(x)


def test_a_hold_every_other_step_is_warned_of():
    # Held at the end of steps 1 and 3 and let go in 2: the hold is not in two
    # steps in a row, and is warned of all the same, at the third step (every
    # block: the simulated device's ring holds none of the lent copies).
    m = _with_blocks(_KeepsEveryOtherStep)
    _KeepsEveryOtherStep.kept.clear()
    _KeepsEveryOtherStep.calls = 0
    h = offload.enable(m, device="cpu", depth=1)
    try:
        counts = []
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.no_grad():
                for _ in range(3):
                    m(torch.randn(8, 64))
                    counts.append(h.metrics()["retained_blocks"])
        said = [str(w.message) for w in seen if "lent weights" in str(w.message)]
        assert counts == [6, 0, 6], counts
        assert len(said) == 1 and "(blocks.0, blocks.1, blocks.2, blocks.3, blocks.4, blocks.5)" in said[0], said
    finally:
        _KeepsEveryOtherStep.kept.clear()
        offload.disable(m)


def test_a_block_lent_twice_from_one_slot_is_the_rings_own_not_retained(monkeypatch):
    # On CUDA a checkpointed backward lends each block twice (its recompute,
    # then its backward), the second from the slot the first filled: one
    # buffer, which the ring still holds at the pass's end. Emulated here (the
    # simulated device lends a fresh copy each time, and its ring holds none):
    # the buffers the slots hold (`held_buffers`) are the ring's own, however
    # many times each was lent.
    import collections

    from offload._enable import offloaded

    frombuffer = torch.frombuffer

    class _Slots:
        """Two slots, each holding its buffer and the one tensor over it; a
        block still in one is lent from it again (a prefetch hit)."""

        def __init__(self, real):
            self.real, self.slots = real, collections.OrderedDict()

        def __getattr__(self, k):
            return getattr(self.real, k)

        def lend(self, stack, index, *a):
            raw = self.real.lend(stack, index, *a)
            if (stack, index) in self.slots:
                self.slots.move_to_end((stack, index))
                return self.slots[(stack, index)][0]
            if len(self.slots) >= 2:
                self.slots.popitem(last=False)
            self.slots[(stack, index)] = (raw, frombuffer(raw, dtype=torch.uint8))
            return raw

        def held_buffers(self):
            return [t for _, t in self.slots.values()]

    def one_tensor_per_buffer(buf, dtype):
        for raw, t in getattr(st._streamer, "slots", {}).values():
            if raw is buf:
                return t
        return frombuffer(buf, dtype=dtype)

    monkeypatch.setattr(torch, "frombuffer", one_tensor_per_buffer)
    m = _Model(ckpt="non-reentrant")
    h = offload.enable(m, device="cpu", depth=1)
    st = offloaded(m)
    st._streamer = _Slots(st._streamer)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            steps = _train(m, "cpu", handle=h)
    finally:
        st._streamer = st._streamer.real
        offload.disable(m)
    assert all(b["blocks"] == 12 for *_, (_, b) in steps), [b for *_, (_, b) in steps]
    assert [(f["retained_blocks"], b["retained_blocks"]) for *_, (f, b) in steps] == [(0, 0)] * 3
