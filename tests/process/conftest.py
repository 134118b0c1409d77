"""The process tier: one process tree: the test starts child processes (the CLI, kills, workers, the wheel
install). Every test in this folder is marked `process` (docs/testing.md)."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called for the items of this folder only (conftest scoping), before ``-m`` selects."""
    item.add_marker(pytest.mark.process)
