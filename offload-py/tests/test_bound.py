"""At the bound on models outside the registry: what a block does beside its
kernels must not serialise it with the prefetch. CUDA rows: they
print SKIPPED without a GPU and fail with OFFLOAD_REQUIRE_DEVICE=1."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload

from helpers import NO_CUDA, _bits


class _TableBlock(nn.Module):
    """CogView4's pattern: the model makes a table on the host and every block
    moves a view of it to the device itself (``cos[None].to(x.device)``, a
    pageable copy and a stream synchronisation each time)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x, tables):
        cos, sin = tables
        return self.lin(x) * cos[None].to(x.device) + sin[None].to(x.device)


class _TableModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_TableBlock() for _ in range(4))

    def forward(self, x):
        t = torch.arange(64, dtype=torch.float32) / 64  # on the host, as CogView4's rope
        tables = (t.cos().expand(8, 64).contiguous(), t.sin().expand(8, 64).contiguous())
        for b in self.blocks:
            x = b(x, tables)
        return x


def _pageable_copies_and_syncs(fn) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return sum("Pageable -> Device" in n for n in names), names.count("cudaStreamSynchronize")


@NO_CUDA
def test_cuda_host_tables_a_block_moves_itself_are_moved_once_a_step_without_a_sync():
    m, x = _TableModel().cuda(), torch.randn(2, 8, 64, device="cuda")
    with torch.no_grad():
        ref = m(x).clone()
        copies, syncs = _pageable_copies_and_syncs(lambda: m(x))
    assert copies == 8 and syncs >= 8, (copies, syncs)  # resident: two a block
    m.cpu()
    h = offload.enable(m, device="cuda", auto_resident_gib=0)
    with torch.no_grad():
        outs = [m(x).clone() for _ in range(3)]  # the first learns which tables the blocks move
        copies, syncs = _pageable_copies_and_syncs(lambda: m(x))
    for o in outs:
        assert torch.equal(_bits(o), _bits(ref))
    # Learned: each table crosses once a step, page-locked, with no host sync.
    assert copies == 0 and syncs == 0, (copies, syncs)
    assert h.violations() == []
    offload.disable(m)
