"""The gpu tier: needs a CUDA device (deselected by default: -m gpu). Every test in this folder is marked `gpu`
(docs/testing.md)."""

from __future__ import annotations

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called for the items of this folder only (conftest scoping), before ``-m`` selects."""
    item.add_marker(pytest.mark.gpu)
