"""How a restore into GPU tensors batches them (alpsck.restore.device); the reads and copies themselves run
only on a GPU (tests/gpu/test_gpu.py)."""

from __future__ import annotations

import torch

from alpsck.restore.device import _batches


def test_batches_keep_the_order_and_stay_within_the_limit() -> None:
    sizes = [10, 30, 60, 1, 100, 40, 40, 25]  # bytes (uint8 tensors)
    items = [(f"k{i}", torch.empty(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    batches = _batches(items, 100)
    assert [k for b in batches for k, _ in b] == [k for k, _ in items]  # every tensor once, in order
    assert [[t.numel() for _, t in b] for b in batches] == [[10, 30, 60], [1], [100], [40, 40], [25]]
    assert _batches([], 100) == []


def test_a_tensor_as_large_as_the_limit_is_a_batch_of_its_own() -> None:
    items = [("a", torch.empty(25, dtype=torch.float32)), ("b", torch.empty(1, dtype=torch.float32))]  # 100 + 4 bytes
    assert [[k for k, _ in b] for b in _batches(items, 100)] == [["a"], ["b"]]
