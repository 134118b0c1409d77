"""The ranks tier: several ranks: multi-process distributed runs (gloo on CPU). Every test in this folder is
marked `ranks` (docs/testing.md)."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called for the items of this folder only (conftest scoping), before ``-m`` selects."""
    item.add_marker(pytest.mark.ranks)
