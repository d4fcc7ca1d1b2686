"""pytest's configuration of the package's tests: the device check at collection
(``helpers``: OFFLOAD_REQUIRE_DEVICE=1 without a GPU is an error, not a skip),
and the fixtures the topic files share."""

from __future__ import annotations

import pytest

import helpers  # noqa: F401  (the device check runs as the tests are collected)


@pytest.fixture
def sim_link(monkeypatch):
    """The simulated device's link at 0.2 GB/s: an 8 MiB block (2048 × 2048
    bf16) takes about 42 ms to copy, well above the package's host time for it
    (a few ms, more on a loaded machine: the simulated device's compute is the
    host's)."""
    monkeypatch.setenv("OFFLOAD_SIM_LINK_BYTES_PER_S", "2e8")
