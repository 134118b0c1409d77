"""Reading a checkpoint's tensors straight into live GPU tensors (:func:`read_to_device`).

The bytes go through two pinned host buffers of at most :data:`BATCH_BYTES` each: the tensors in batches,
each batch read (and CRC-checked, by the core's reader threads) into one buffer while the host-to-device
copies of the batch before it run from the other, on a side stream. Without it a restore read every tensor
into freshly allocated pageable memory (its pages faulted in by the read) and then copied it to the GPU
from there, one synchronous copy per tensor: on the H200 the copies and faults took longer than reading
the memory tier's files (docs/memory-tier.md). A tensor larger than a buffer is read through a pageable
buffer of its own, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

BATCH_BYTES = 256 << 20  # each of the two pinned buffers (a checkpoint chunk is 8 MiB by default)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _batches(items: Sequence[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """``items`` in order, grouped into runs of at most ``limit`` bytes."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = limit + 1
    for key, t in items:
        if size + _nbytes(t) > limit:
            out.append([])
            size = 0
        out[-1].append((key, t))
        size += _nbytes(t)
    return out


def read_to_device(shards: Any, items: Sequence[tuple[str, torch.Tensor]], threads: int,
                   batch_bytes: int = BATCH_BYTES) -> None:
    """Read the tensors ``items`` (key, contiguous live CUDA tensor of the saved dtype and shape) from
    ``shards`` (:class:`alpsck.store.shards.CheckpointShards`) into those tensors. Returns once every copy
    has landed; a CheckpointError from a read leaves the batches before it copied."""
    items = [(k, t) for k, t in items if t.numel()]
    big = [(k, t) for k, t in items if _nbytes(t) > batch_bytes]
    for key, t in big:
        host = torch.empty(_nbytes(t), dtype=torch.uint8)
        shards.read_into([(key, host)], threads)
        t.reshape(-1).view(torch.uint8).copy_(host)
    small = [(k, t) for k, t in items if _nbytes(t) <= batch_bytes]
    for device in dict.fromkeys(t.device for _, t in small):
        _pipeline(shards, [(k, t) for k, t in small if t.device == device], threads, batch_bytes, device)


def _pipeline(shards: Any, items: list[tuple[str, torch.Tensor]], threads: int, batch_bytes: int,
              device: torch.device) -> None:
    batches = _batches(items, batch_bytes)
    size = max(sum(_nbytes(t) for _, t in b) for b in batches)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(min(2, len(batches)))]
    done: list[Any] = [None] * len(buffers)  # the event after the copies out of each buffer
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # work queued on the live tensors comes first
    try:
        for i, batch in enumerate(batches):
            slot = i % len(buffers)
            if done[slot] is not None:
                done[slot].synchronize()  # its copies have left the buffer
            views, off = [], 0
            for key, t in batch:
                views.append((key, buffers[slot][off:off + _nbytes(t)]))
                off += _nbytes(t)
            shards.read_into(views, threads)
            with torch.cuda.stream(stream):
                for (_, t), (_, view) in zip(batch, views, strict=True):
                    t.reshape(-1).view(torch.uint8).copy_(view, non_blocking=True)
                done[slot] = torch.cuda.Event()
                done[slot].record(stream)
    finally:
        stream.synchronize()  # the buffers are freed, and the tensors read, only after every copy landed
