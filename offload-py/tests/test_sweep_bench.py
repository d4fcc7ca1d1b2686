"""The sweep's probe settings (``bench/anchors/sweep.py --depth``,
``--tables-on-device``): the host tensor lists a module keeps are moved as
asked, and ``sweep_merge.py`` refuses to pool a probe's processes with the
defaults'."""

import pathlib
import sys

import pytest
import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench/anchors"))


def test_host_tensor_lists_a_module_keeps_are_moved_and_named():
    import sweep

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self.freqs_cis = [torch.randn(4, 2), torch.randn(3, 2)]  # as Lumina2's rotary tables
            self.mixed = [torch.randn(2), 1]  # not a list of tensors: left alone
            self.weight = nn.Parameter(torch.randn(2))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rope_embedder = Rope()

    m = M()
    before = [t.clone() for t in m.rope_embedder.freqs_cis]
    assert sweep.tables_to(m, "meta") == ["rope_embedder.freqs_cis"]
    assert all(t.device.type == "meta" for t in m.rope_embedder.freqs_cis)
    assert [t.shape for t in m.rope_embedder.freqs_cis] == [t.shape for t in before]
    assert m.rope_embedder.mixed[0].device.type == "cpu" and m.rope_embedder.weight.device.type == "cpu"


def test_a_probes_processes_are_not_pooled_with_the_defaults():
    import sweep_merge

    with pytest.raises(ValueError, match="different probes"):
        sweep_merge.merge([{"models": []}, {"probe": {"depth": 3, "tables_on_device": False}, "models": []}], ["a", "b"])
