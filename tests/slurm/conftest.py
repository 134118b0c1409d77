"""The slurm tier: jobs: the local SLURM cluster (the cluster fixture) or submitit's local executor. Every test
in this folder is marked `slurm` (docs/testing.md)."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called for the items of this folder only (conftest scoping), before ``-m`` selects."""
    item.add_marker(pytest.mark.slurm)
