"""Why a step is slower than its bound: each cause, provoked on purpose, is the
one :meth:`Offloaded.diagnose` names. CPU rows on the simulated device (its
link given a rate); CUDA rows print SKIPPED without a GPU and fail with
OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import offload

from helpers import NO_CUDA


class _Work(nn.Module):
    """A block of ``weight`` (``n`` × ``n``) that works ``reps`` matmuls on its
    input's first ``rows`` rows, sleeps ``sleep_s`` on the host, and may
    synchronise the host with the device or move a host table itself."""

    def __init__(self, n: int, reps: int = 1, sleep_s: float = 0.0, sync: bool = False, table=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n, dtype=torch.bfloat16) / n**0.5, requires_grad=False)
        self.reps, self.sleep_s, self.sync, self.table = reps, sleep_s, sync, table

    def forward(self, x):
        n = self.weight.shape[0]
        y = x[..., :n] if x.shape[-1] >= n else nn.functional.pad(x, (0, n - x.shape[-1]))
        for _ in range(self.reps):
            y = y @ self.weight
        if self.table is not None:
            y = y + self.table.to(y.device).sum() * 0  # a pageable copy, as a model's own
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if self.sync:
            y.sum().item()
        out = x.clone()
        out[..., : min(n, x.shape[-1])] += y[..., : min(n, x.shape[-1])] * 1e-3
        return out


class _Model(nn.Module):
    """Blocks run in turn; ``side``: a page-locked host tensor the model sends to
    the device on a stream of its own as the step starts (a user's next batch,
    say), sharing the link with the package's copies."""

    def __init__(self, blocks, between_s: float = 0.0, side=None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.between_s = between_s
        self.side = side

    def forward(self, x):
        if self.side is not None:
            s = torch.cuda.Stream(x.device)
            with torch.cuda.stream(s):
                self.side_on_device = self.side.to(x.device, non_blocking=True)
        for b in self.blocks:
            x = b(x)
            if self.between_s:
                time.sleep(self.between_s)
        return x


def _diagnosed(model: nn.Module, x: torch.Tensor, device: str, depth: int = 1, link_gbps=None) -> dict:
    m = offload.enable(model, device=device, depth=depth)
    try:
        with torch.no_grad():
            model(x)  # learns the order
            m.enable_trace()
            for _ in range(2):
                model(x)
        if device == "cuda":
            torch.cuda.synchronize()
        return m.diagnose(link_gbps=link_gbps)
    finally:
        offload.disable(model)


def test_a_copy_bound_step_is_named_the_link(sim_link):
    torch.manual_seed(0)
    d = _diagnosed(_Model([_Work(2048) for _ in range(6)]), torch.randn(1, 2048, dtype=torch.bfloat16), "cpu")
    assert d["verdict"] == "link", d["summary"]
    assert d["causes"]["link"] > 60e-3 and d["waits"] and "copy-bound" in d["summary"], d["summary"]


def test_a_copy_issued_too_late_behind_a_short_block_is_named_late_and_depth_two_hides_it(sim_link):
    def model():
        torch.manual_seed(0)
        return _Model([_Work(2048, sleep_s=s) for s in (0.1, 0, 0.1, 0, 0.1, 0)])

    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    d = _diagnosed(model(), x, "cpu")
    assert d["verdict"] == "late", d["summary"]
    assert d["causes"]["late"] > 30e-3 and "1 block(s) ahead" in d["summary"], d["summary"]
    deeper = _diagnosed(model(), x, "cpu", depth=2)
    assert deeper["causes"].get("late", 0) < d["causes"]["late"] / 4, deeper["summary"]


def test_the_hosts_time_between_blocks_is_named_the_host(sim_link):
    torch.manual_seed(0)
    model = _Model([_Work(256, sleep_s=0.001) for _ in range(4)], between_s=0.01)
    d = _diagnosed(model, torch.randn(1, 256, dtype=torch.bfloat16), "cpu")
    assert d["verdict"] == "host" and d["between_s"] > 30e-3, d["summary"]


def test_diagnose_before_a_traced_step_and_a_bad_link_rate_are_named_errors():
    torch.manual_seed(0)
    model = _Model([_Work(64) for _ in range(3)])
    m = offload.enable(model, device="cpu")
    with pytest.raises(offload.OffloadError, match="no traced step to diagnose"):
        m.diagnose()
    with pytest.raises(TypeError, match="link_gbps"):
        m.diagnose(link_gbps="50")
    with pytest.raises(ValueError, match="link_gbps"):
        m.diagnose(link_gbps=0)
    offload.disable(model)


# -- CUDA rows: the same causes on a GPU -------------------------------------


def _cuda_link_gbps(model, x) -> float:
    m = offload.enable(model, device="cuda")
    with torch.no_grad():
        model(x)
    gbps = m.probe_bandwidth() / 1e9
    offload.disable(model)
    return gbps


@NO_CUDA
def test_cuda_a_copy_bound_step_is_named_the_link():
    torch.manual_seed(0)
    model = _Model([_Work(4096) for _ in range(8)])  # 32 MiB a block, one row of compute
    d = _diagnosed(model, torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda"), "cuda")
    assert d["verdict"] == "link", d["summary"]
    assert d["wait_s"] > 0.5 * d["step_s"], d["summary"]


@NO_CUDA
def test_cuda_a_copy_issued_too_late_behind_a_short_block_is_named_late_and_depth_two_hides_it():
    def model():
        torch.manual_seed(0)
        # A long block (100 matmuls of 4096 × 2048 by 2048 × 2048, ~6 ms on an H100
        # for ~1 ms of the host's: the device's work, not the host's; 400 matmuls on
        # 1024-wide weights made the host take 0.037 s of a 0.039 s step and the
        # verdict `host`), a short one, a large one (128 MiB): at depth 1 the large
        # one's copy is issued when the short one starts.
        return _Model([_Work(*a) for a in [(2048, 100), (1024, 1), (8192, 1)] * 3])

    x = torch.randn(4096, 8192, dtype=torch.bfloat16, device="cuda")
    d = _diagnosed(model(), x, "cuda")
    # Which of the two names the wait depends on the host: a host behind the
    # device issues the large copy when the short block starts (`late`: the copy
    # stream idle before it); a host ahead issues it earlier, and it waits for the
    # long block to free its slot (`slot`). Either way one more slot hides it.
    shallow = d["causes"].get("late", 0) + d["causes"].get("slot", 0)
    assert d["verdict"] in ("late", "slot") and shallow > 1e-3, d["summary"]
    assert any(w["by_cause"].get("late", 0) + w["by_cause"].get("slot", 0) > 1e-4 for w in d["waits"]), d["waits"]
    deeper = _diagnosed(model(), x, "cuda", depth=2)
    assert deeper["causes"].get("late", 0) + deeper["causes"].get("slot", 0) < shallow / 2, deeper["summary"]


@NO_CUDA
def test_cuda_a_models_own_copies_sharing_the_link_are_named():
    # 64 MiB blocks whose copies their compute about hides, while the model sends
    # 2 GiB of its own to the device on a side stream: the package's copies run
    # slower beside it, or (an H100 runs two streams' host-to-device copies one
    # after the other) queue behind it; either is the shared link.
    torch.manual_seed(0)
    x = torch.randn(2048, 5792, dtype=torch.bfloat16, device="cuda")
    gbps = _cuda_link_gbps(_Model([_Work(5792, reps=6) for _ in range(8)]), x)
    alone = _diagnosed(_Model([_Work(5792, reps=6) for _ in range(8)]), x, "cuda", link_gbps=gbps)
    assert alone["causes"].get("shared_link", 0) == 0, alone["summary"]
    side = torch.empty(1 << 30, dtype=torch.bfloat16).pin_memory()
    d = _diagnosed(_Model([_Work(5792, reps=6) for _ in range(8)], side=side), x, "cuda", link_gbps=gbps)
    assert d["causes"].get("shared_link", 0) > 1e-3, d["summary"]
    assert any(w["by_cause"].get("shared_link", 0) > 0 for w in d["waits"]), (gbps, d["waits"])


@NO_CUDA
def test_cuda_a_host_synchronisation_inside_each_block_is_named_the_host():
    torch.manual_seed(0)
    model = _Model([_Work(1024, reps=50, sync=True) for _ in range(8)])
    d = _diagnosed(model, torch.randn(2048, 1024, dtype=torch.bfloat16, device="cuda"), "cuda")
    assert d["verdict"] == "host", d["summary"]
    assert "synchronisation" in d["summary"] and d["host_s"] >= 0.8 * d["step_s"], d["summary"]


# -- the default depth: chosen from the second step -----------------------------


def _uneven():
    torch.manual_seed(0)
    return _Model([_Work(2048, sleep_s=s) for s in (0.1, 0, 0.1, 0, 0.1, 0)])


def test_with_no_depth_given_the_package_times_its_second_step_and_deepens_a_ring_that_copies_late(sim_link):
    model, x = _uneven(), torch.randn(1, 2048, dtype=torch.bfloat16)
    m = offload.enable(model, device="cpu")
    with torch.no_grad():
        ref = model(x)
        assert m.plan()["chosen_by"] == "auto" and "until the second step" in m.plan()["why"]
        model(x)
        plan = m.plan()
        assert plan["depth"] == 2 and plan["chosen_by"] == "auto", plan
        assert "1: " in plan["why"] and "2: " in plan["why"] and "within 1 %" in plan["why"], plan["why"]
        out = model(x)
        # Untraced again (the package's own trace ends with the choice), and bitwise equal.
        with pytest.raises(offload.OffloadError, match="no traced step"):
            m.diagnose()
        m.enable_trace()
        model(x)
        model(x)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert m.diagnose()["causes"].get("late", 0) < 0.02, m.diagnose()["summary"]
    offload.disable(model)


def test_a_given_depth_or_budget_is_kept_and_says_so(sim_link):
    model, x = _uneven(), torch.randn(1, 2048, dtype=torch.bfloat16)
    m = offload.enable(model, device="cpu", depth=1)
    with torch.no_grad():
        for _ in range(3):
            model(x)
    assert m.plan() == {"depth": 1, "resident_blocks": [], "chosen_by": "given", "why": "as given"}
    offload.disable(model)
    m = offload.enable(model, device="cpu", budget_gib=1)
    assert m.plan()["chosen_by"] == "budget" and "budget" in m.plan()["why"], m.plan()
    offload.disable(model)


def test_a_copy_bound_ring_keeps_depth_one(sim_link):
    model = _Model([_Work(2048) for _ in range(6)])
    m = offload.enable(model, device="cpu")
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(1, 2048, dtype=torch.bfloat16))
    assert m.plan()["depth"] == 1 and m.plan()["chosen_by"] == "auto", m.plan()["why"]
    offload.disable(model)


class _SyncsFirst(nn.Module):
    """A forward that synchronises the host and works on it before its first
    block, as Lumina2's does (``.tolist()``, then its embeddings)."""

    def __init__(self, blocks, host_s: float):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.host_s = host_s

    def forward(self, x):
        x.sum().item()
        time.sleep(self.host_s)
        for b in self.blocks:
            x = b(x)
        return x


@NO_CUDA
def test_cuda_a_forward_that_synchronises_before_its_first_block_gets_a_ring_one_deeper():
    torch.manual_seed(0)
    model = _SyncsFirst([_Work(2048, reps=2) for _ in range(8)], host_s=0.003)
    x = torch.randn(4096, 2048, dtype=torch.bfloat16, device="cuda")
    m = offload.enable(model, device="cuda")
    try:
        with torch.no_grad():
            ref = None
            for _ in range(3):
                out = model(x)
                ref = out if ref is None else ref
        plan = m.plan()
        assert plan["chosen_by"] == "auto" and "one deeper for the step's edge" in plan["why"], plan
        assert plan["depth"] >= 2, plan
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    finally:
        offload.disable(model)


def test_on_the_simulated_device_the_steps_edge_never_deepens_the_ring(sim_link):
    # Its compute is the host's: the host is never ahead, so a late first ask
    # says nothing of a synchronisation (the replay alone chooses).
    model = _SyncsFirst([_Work(2048) for _ in range(6)], host_s=0.01)
    m = offload.enable(model, device="cpu")
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(1, 2048, dtype=torch.bfloat16))
    plan = m.plan()
    assert plan["chosen_by"] == "auto" and "step's edge" not in plan["why"], plan
    offload.disable(model)


# -- the automatic plan keeps a host-bound model's blocks resident ------------


def _host_bound_model():
    # The host's time between blocks: the step is the host's, as a model whose
    # blocks are short against its Python time per block.
    torch.manual_seed(0)
    return _Model([_Work(256, sleep_s=0.001) for _ in range(6)], between_s=0.01)


_BLOCK = 256 * 256 * 2  # one _Work(256) block's bytes


def _steps(model, x, n):
    with torch.no_grad():
        return [model(x) for _ in range(n)][-1]


def test_a_host_bound_step_keeps_as_many_blocks_resident_as_the_allowance_holds(sim_link):
    import copy

    model = _host_bound_model()
    resident = copy.deepcopy(model)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = resident(x)
    params = [b.weight for b in model.blocks]
    m = offload.enable(model, device="cpu", auto_resident_gib=2.5 * _BLOCK / 2**30)
    try:
        assert m.plan()["resident_blocks"] == []
        _steps(model, x, 2)  # the first learns the order, the second is timed and the plan chosen
        plan = m.plan()
        assert len(plan["resident_blocks"]) == 2 and "host-bound" in plan["why"] and "2 of 6 blocks kept" in plan["why"], plan
        kept = [model.blocks[int(n.rsplit(".", 1)[1])] for n in plan["resident_blocks"]]
        assert all(not b._forward_pre_hooks and not b._forward_hooks for b in kept), "a kept block still has the package's hooks"
        out = _steps(model, x, 1)
        met = m.metrics()
        # The first step after the choice: the four streamed blocks, each copied
        # ahead (their copies when kept closed a step of their own, and did not
        # teach the order: no block is fetched on demand).
        assert met["blocks"] == 4 and met["misses"] == 0 and met["prefetch_hits"] == 4, met
        out = _steps(model, x, 1)
        met = m.metrics()
        # From then on, a step copies its four streamed blocks once each, never a kept one.
        assert met["bytes_copied"] == 4 * _BLOCK and met["blocks"] == 4 and met["misses"] == 0, met
        assert torch.equal(out, ref)
        # A kept block's tensors are resident ones: an edit is used, and kept by disable.
        kept[0].weight.data.mul_(2)
        i = list(model.blocks).index(kept[0])
        resident.blocks[i].weight.data.mul_(2)
        with torch.no_grad():
            assert torch.equal(model(x), resident(x))
    finally:
        offload.disable(model)
    assert [b.weight for b in model.blocks] == params and all(type(p) is nn.Parameter for p in params)
    for a, b in zip(model.blocks, resident.blocks):
        assert torch.equal(a.weight, b.weight), "disable lost an edit of a kept block, or a streamed block's bytes"


def test_the_blocks_left_to_stream_are_spread_over_the_run_order(sim_link):
    # Kept as one run, the streamed blocks would come back to back, where a
    # block's copy can outlast its compute (Flux-dev's last 13 of 57 on an
    # H100): spread, each copy overlaps the kept blocks' compute before it.
    import copy

    torch.manual_seed(0)
    model = _Model([_Work(256, sleep_s=0.001) for _ in range(8)], between_s=0.01)
    resident = copy.deepcopy(model)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = resident(x)
    m = offload.enable(model, device="cpu", auto_resident_gib=5.5 * _BLOCK / 2**30)
    try:
        _steps(model, x, 2)
        plan = m.plan()
        kept = sorted(int(n.rsplit(".", 1)[1]) for n in plan["resident_blocks"])
        # Five fit; the three streamed at 8/4, 2·8/4, 3·8/4: never two side by side, the first kept.
        assert kept == [0, 1, 3, 5, 7] and "spread over the run order" in plan["why"], plan
        out = _steps(model, x, 2)
        assert m.metrics()["blocks"] == 3 and m.metrics()["bytes_copied"] == 3 * _BLOCK, m.metrics()
        assert torch.equal(out, ref)
    finally:
        offload.disable(model)


class _Backwards(_Model):
    """Its blocks run last registered first."""

    def forward(self, x):
        for b in reversed(self.blocks):
            x = b(x)
            time.sleep(self.between_s)
        return x


def test_the_spread_follows_the_order_the_blocks_run_in_not_their_registration(sim_link):
    torch.manual_seed(0)
    model = _Backwards([_Work(256, sleep_s=0.001) for _ in range(8)], between_s=0.01)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    m = offload.enable(model, device="cpu", auto_resident_gib=5.5 * _BLOCK / 2**30)
    try:
        _steps(model, x, 2)
        kept = sorted(int(n.rsplit(".", 1)[1]) for n in m.plan()["resident_blocks"])
        # Run positions 0, 1, 3, 5, 7 kept: blocks 7, 6, 4, 2, 0 (the first to run among them).
        assert kept == [0, 2, 4, 6, 7], m.plan()
    finally:
        offload.disable(model)


def test_a_kept_block_holds_its_own_bytes_not_a_slot_of_the_largest_block(sim_link):
    # The ring's slots have its largest block's size: a small block kept in
    # its slot's buffer would hold that size for good (Flux-dev's 44 kept
    # blocks held 11.7 GB more than their own 18.4 GB on an H100).
    import copy

    torch.manual_seed(0)
    model = _Model([_Work(512, sleep_s=0.001)] + [_Work(256, sleep_s=0.001) for _ in range(5)], between_s=0.01)
    resident = copy.deepcopy(model)
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = resident(x)
    m = offload.enable(model, device="cpu", auto_resident_gib=2.5 * _BLOCK / 2**30)
    try:
        _steps(model, x, 2)
        kept = m.plan()["resident_blocks"]
        assert len(kept) == 2 and "blocks.0" not in kept, m.plan()  # two of the small ones
        # Counted from the step whose end kept them.
        assert m.metrics()["kept_bytes"] == 2 * _BLOCK, m.metrics()
        _steps(model, x, 1)
        assert m.metrics()["kept_bytes"] == 2 * _BLOCK, m.metrics()
        assert torch.equal(_steps(model, x, 1), ref)
    finally:
        offload.disable(model)
    for a, b in zip(model.blocks, resident.blocks):
        assert torch.equal(a.weight, b.weight)


def test_blocks_kept_by_a_plan_chosen_in_inference_mode_can_be_edited_after_it(sim_link):
    # The plan is chosen at the end of a step; run under torch.inference_mode(),
    # the slot's buffer is an inference tensor, which torch refuses to write
    # outside inference mode: a kept block takes a plain copy, its views plain.
    import copy

    model = _host_bound_model()
    resident = copy.deepcopy(model)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    m = offload.enable(model, device="cpu", auto_resident_gib=2.5 * _BLOCK / 2**30)
    try:
        with torch.inference_mode():
            for _ in range(3):
                model(x)
        kept = [model.blocks[int(n.rsplit(".", 1)[1])] for n in m.plan()["resident_blocks"]]
        assert len(kept) == 2, m.plan()
        assert not any(b.weight.is_inference() for b in kept)
        with torch.no_grad():
            kept[0].weight.mul_(2)
            resident.blocks[list(model.blocks).index(kept[0])].weight.mul_(2)
            assert torch.equal(model(x), resident(x))
    finally:
        offload.disable(model)
    for a, b in zip(model.blocks, resident.blocks):
        assert torch.equal(a.weight, b.weight), "disable lost the edit of a kept block"


def test_a_spread_of_the_streamed_blocks_fits_the_allowance_or_is_not_made():
    from offload._offloaded import _spread_streamed

    even = [(f"b.{i}", 10) for i in range(8)]
    assert _spread_streamed(even, 3, 50) == ["b.0", "b.1", "b.3", "b.5", "b.7"]
    assert _spread_streamed(even, 0, 80) is None and _spread_streamed(even, 8, 0) is None
    # Larger blocks where the spread keeps them: it fits, or the host-time
    # order's choice stands (a spread keeping fewer blocks is never made).
    sized = [(f"b.{i}", 30 if i in (1, 3) else 10) for i in range(8)]
    assert _spread_streamed(sized, 3, 90) == ["b.0", "b.1", "b.3", "b.5", "b.7"]
    assert _spread_streamed(sized, 3, 80) is None
    assert _spread_streamed([("b.0", 4)] + [(f"b.{i}", 1) for i in range(1, 11)], 5, 6) is None
    # No spread fits (the first block alone is over the allowance).
    assert _spread_streamed([("b.0", 100), ("b.1", 1), ("b.2", 1)], 1, 50) is None


def test_an_allowance_of_zero_keeps_every_block_streamed(sim_link):
    model = _host_bound_model()
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    m = offload.enable(model, device="cpu", auto_resident_gib=0)
    try:
        # The third step is the first at the chosen depth (the ring rebuilt: a
        # loaded machine may copy more there); the fourth is the steady state.
        _steps(model, x, 4)
        assert m.plan()["resident_blocks"] == [] and "0 of 6 blocks kept" in m.plan()["why"]
        assert m.metrics()["bytes_copied"] == 6 * _BLOCK
    finally:
        offload.disable(model)


def test_a_copy_bound_step_keeps_no_block_resident_whatever_the_allowance(sim_link):
    torch.manual_seed(0)
    model = _Model([_Work(2048) for _ in range(4)])
    m = offload.enable(model, device="cpu", auto_resident_gib=1.0)
    try:
        _steps(model, torch.randn(1, 2048, dtype=torch.bfloat16), 3)
        why = m.plan()["why"]
        assert m.plan()["resident_blocks"] == [] and "host-bound" not in why, m.plan()
        # The plan says what it read: the host's share of the traced step and its verdict.
        assert "no block kept: the host took" in why and "verdict" in why, why
    finally:
        offload.disable(model)


def test_auto_resident_gib_is_checked_and_only_for_the_packages_own_plan():
    model = _Model([_Work(64) for _ in range(3)])
    with pytest.raises(ValueError, match="auto_resident_gib .*resident_blocks"):
        offload.enable(model, device="cpu", depth=1, auto_resident_gib=1)
    with pytest.raises(ValueError, match="auto_resident_gib"):
        offload.enable(model, device="cpu", auto_resident_gib=-1)
    with pytest.raises(TypeError, match="auto_resident_gib"):
        offload.enable(model, device="cpu", auto_resident_gib="1")
    assert offload.offloaded(model) is None


@NO_CUDA
def test_cuda_a_host_bound_model_is_kept_resident_within_a_quarter_of_the_free_memory():
    import copy

    model = _host_bound_model()
    resident = copy.deepcopy(model).cuda()
    x = torch.randn(1, 256, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ref = resident(x)
    m = offload.enable(model, device="cuda")
    try:
        _steps(model, x, 2)
        plan = m.plan()
        assert len(plan["resident_blocks"]) == 6 and "a quarter of the device's free memory" in plan["why"], plan
        out = _steps(model, x, 1)
        torch.cuda.synchronize()
        assert m.metrics()["bytes_copied"] == 0 and m.metrics()["blocks"] == 0, m.metrics()
        assert torch.equal(out, ref)
        assert all(b.weight.device.type == "cuda" for b in model.blocks)
        m.enable_trace()
        _steps(model, x, 1)
        with pytest.raises(offload.OffloadError, match="every block is kept resident"):
            m.diagnose()
    finally:
        offload.disable(model)
    assert all(b.weight.device.type == "cpu" for b in model.blocks)


def test_every_block_kept_copies_nothing_and_diagnose_says_why(sim_link):
    model = _host_bound_model()
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    m = offload.enable(model, device="cpu", auto_resident_gib=1.0)
    try:
        _steps(model, x, 4)
        assert len(m.plan()["resident_blocks"]) == 6 and m.metrics()["bytes_copied"] == 0, (m.plan(), m.metrics())
        m.enable_trace()
        _steps(model, x, 1)
        with pytest.raises(offload.OffloadError, match="every block is kept resident"):
            m.diagnose()
    finally:
        offload.disable(model)


def test_blocks_kept_between_a_forward_and_its_backward_give_the_resident_gradients(sim_link):
    # In a training loop the plan is chosen at the end of a forward whose
    # backward is still to come: the weights it saved of a block kept since
    # come from the kept buffer, and the kept block keeps its views.
    import copy

    model = _host_bound_model().requires_grad_(False)
    resident = copy.deepcopy(model)
    h = offload.enable(model, device="cpu", auto_resident_gib=1.0)
    try:
        for i in range(4):
            torch.manual_seed(i)
            x = torch.randn(1, 256, dtype=torch.bfloat16, requires_grad=True)
            y = x.detach().clone().requires_grad_(True)
            model(x).float().square().sum().backward()
            resident(y).float().square().sum().backward()
            assert torch.equal(x.grad, y.grad), f"iteration {i}: the input's gradient differs"
        assert len(h.plan()["resident_blocks"]) == 6, h.plan()
        assert all(type(b.weight) is not type(offload.offloaded(model)._params[f"blocks.{i}.weight"].holder)
                   for i, b in enumerate(model.blocks)), "a kept block holds a placeholder again"
    finally:
        offload.disable(model)
    for a, b in zip(model.blocks, resident.blocks):
        assert torch.equal(a.weight, b.weight)


def test_calibration_names_the_kept_blocks_whose_times_it_lacks(sim_link):
    model = _host_bound_model()
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    m = offload.enable(model, device="cpu", auto_resident_gib=2.5 * _BLOCK / 2**30)
    try:
        _steps(model, x, 2)
        kept = m.plan()["resident_blocks"]
        assert len(kept) == 2
        with pytest.raises(offload.OffloadError, match="kept resident by the automatic plan") as e:
            m.calibration()
        assert all(name in str(e.value) for name in kept), str(e.value)
        # Given every block's time, the cost model holds the kept blocks too.
        times = {f"blocks.{i}": 0.001 for i in range(6)}
        cal = m.calibration(compute_s=times)
        assert sorted(b["id"] for b in cal["blocks"]) == [f"blocks.{i}" for i in range(6)], cal
        # Once a backward ran, its times too: a traced backward lacks the kept
        # blocks, and a cost model without them would plan a forward alone.
        xg = x.clone().requires_grad_()
        model(xg).float().sum().backward()
        assert xg.grad is not None
        with pytest.raises(offload.OffloadError, match="backward_s"):
            m.calibration(compute_s=times)
        cal = m.calibration(compute_s=times, backward_s=times)
        assert all(b["backward_s"] == 0.001 for b in cal["blocks"]), cal
    finally:
        offload.disable(model)


def test_the_host_share_that_keeps_blocks():
    # On CUDA, the host's share of the device's step decides (from 0.6: the
    # sweep's host-bound models took 0.65-1.0, and straddled the diagnosis's
    # 0.8 between processes), unless the step was copy-bound; on the simulated
    # device, the diagnosis's verdict.
    from offload._offloaded import _host_bound

    def d(host_s, verdict=None, lost=0.0):
        return {"step_s": 0.1, "host_s": host_s, "verdict": verdict, "causes": {"host": lost} if lost else {}}

    assert _host_bound(d(0.065), cuda=True)  # 65 %: nothing charged to the host, kept all the same
    assert _host_bound(d(0.09, "host", 0.01), cuda=True)
    assert not _host_bound(d(0.055), cuda=True)
    assert not _host_bound(d(0.09, "link", 0.0), cuda=True)  # copy-bound: the budget's to keep
    assert not _host_bound({"step_s": 0.0, "host_s": 0.0, "verdict": None, "causes": {}}, cuda=True)
    assert not _host_bound(d(0.065), cuda=False)  # the simulated device: the verdict must be the host
    assert _host_bound(d(0.02, "host", 0.005), cuda=False)
    assert not _host_bound(d(0.02, "copy", 0.005), cuda=False)
    assert not _host_bound(d(0.02, "host", 0.0005), cuda=False)
