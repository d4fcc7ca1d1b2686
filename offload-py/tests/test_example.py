"""The README's and the guide's Python example runs, and checks its own output."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import meta_checkpoint  # noqa: E402
import quickstart  # noqa: E402

from helpers import DEVICES  # noqa: E402


@pytest.mark.parametrize("dev", DEVICES)
def test_the_quickstart_runs_and_is_bitwise_equal(dev):
    out = quickstart.main(dev)
    assert torch.isfinite(out.float()).all() and out.float().std() > 0


@pytest.mark.parametrize("dev", DEVICES)
def test_the_meta_device_example_runs_from_its_checkpoint(dev, tmp_path):
    out, tier = meta_checkpoint.main(str(tmp_path), dev)
    assert torch.isfinite(out.float()).all() and out.float().std() > 0 and tier["copied"] == 0


@pytest.mark.parametrize("dev", DEVICES)
def test_the_training_example_trains_bitwise_and_streams_the_backward(dev):
    pytest.importorskip("peft", reason="peft is installed by scripts/python-env.sh")
    import train_lora

    losses, backward = train_lora.main(dev)
    assert len(set(losses)) == len(losses) and all(l == l for l in losses), losses  # finite, moving
    assert backward["backward"] and backward["bytes_copied"] > 0, backward
