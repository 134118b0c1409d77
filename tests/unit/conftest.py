"""The unit tier: in-process tests: no child Python process, no rank, no SLURM; parallel-safe (pytest -n 2).
Every test in this folder is marked `unit` (docs/testing.md)."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called for the items of this folder only (conftest scoping), before ``-m`` selects."""
    item.add_marker(pytest.mark.unit)
