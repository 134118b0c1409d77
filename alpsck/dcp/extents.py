"""A rank's DCP write items as the extents of its shard: a non-tensor value encoded (JSON through
:mod:`alpsck.store.values`, never DCP's pickle; a custom planner's own bytes kept raw), tensors as views of
their own memory when that costs no copy (:func:`in_place`), else resolved one at a time while the shard is
written through the engine's staging slots (:func:`save_resolving_lazily`)."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from .. import _core, tree
from ..errors import UsageError
from ..store.values import encode_value


def default_bytes(planner: SavePlanner) -> bool:
    """Whether the planner's bytes for a non-tensor value would be DefaultSavePlanner's torch.save of the object."""
    if not isinstance(planner, DefaultSavePlanner):
        return False
    cls = type(planner)
    return cls.resolve_data is DefaultSavePlanner.resolve_data and cls.transform_object is DefaultSavePlanner.transform_object


def encode_item(planner: SavePlanner, item: WriteItem) -> tuple[str, bytes]:
    """One BYTE_IO item: ``("json", ...)``, the planner's original object as JSON (never DCP's default pickle
    of it); or, from a planner with its own resolve_data or transform_object, ``("raw", ...)``: the bytes it
    gave, as DCP keeps them (for that planner's own load_bytes to read)."""
    if default_bytes(planner):
        assert isinstance(planner, DefaultSavePlanner)
        return "json", encode_value(planner.lookup_object(item.index), item.index.fqn)
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):
        return "raw", data.getvalue()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return "raw", bytes(data)
    raise UsageError(f"{item.index.fqn}: {type(planner).__name__}.resolve_data gave a {type(data).__name__} for a "
                     "non-tensor value (bytes or io.BytesIO expected)")


@dataclass(frozen=True)
class Extent:
    """One write item of this rank's shard: its extent name, its size, and how to get its bytes (a flat
    uint8 CPU tensor; for a tensor item, the planner's resolve_data, called only then)."""

    name: str
    nbytes: int
    resolve: Callable[[], torch.Tensor]
    tensor: Callable[[], torch.Tensor] | None = None  # a tensor item: the planner's tensor, before flattening


def given(data: torch.Tensor) -> torch.Tensor:
    return data


def flat_bytes_of(tensor: Callable[[], torch.Tensor]) -> torch.Tensor:
    return tree.flat_bytes(tensor())


def chunk_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None  # prepare_local_plan checked it
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def in_place(planner: SavePlanner, extents: list[Extent]) -> list[tuple[str, torch.Tensor]] | None:
    """The extents as views of the tensors' own memory, when that costs no copy: DCP's default
    resolve_data (a lookup, allocating nothing) giving CPU tensors whose bytes are contiguous. None
    otherwise (device tensors, views, a planner whose resolve_data may allocate): they are resolved
    one at a time while the shard is written (:func:`save_resolving_lazily`), as DCP's contract asks."""
    if type(planner).resolve_data is not DefaultSavePlanner.resolve_data:
        return None
    out: list[tuple[str, torch.Tensor]] = []
    for e in extents:
        if e.tensor is None:
            out.append((e.name, e.resolve()))
            continue
        t = e.tensor().detach()
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        out.append((e.name, t.reshape(-1).view(torch.uint8)))
    return out


def save_resolving_lazily(engine: _core.Engine, step: int, extents: list[Extent], meta: str) -> Any:
    """Write the shard through the engine's staging slots, chunk by chunk: each extent is resolved when
    its first byte is needed and dropped after its last one is copied, so resolving (a device-to-host
    copy, a planner's allocation) overlaps the writes and at most the extents spanning one chunk are
    held at once. Returns the save's handle."""
    handle, fill = engine.save_external(step, [(e.name, e.nbytes) for e in extents], meta, "deferred")
    if not fill.needed:
        return handle
    by_name = {e.name: e for e in extents}
    cb = int(fill.chunk_bytes)
    pieces: list[list[tuple[str, int, int, int]]] = [[] for _ in range(int(fill.num_chunks))]  # name, src, dst, n
    last: dict[str, int] = {}
    for name, offset, size in fill.extents:
        pos, end = int(offset), int(offset) + int(size)
        while pos < end:
            i = pos // cb
            n = min(end, (i + 1) * cb) - pos
            pieces[i].append((name, pos - int(offset), pos - i * cb, n))
            last[name] = i
            pos += n
    pool = engine.staging_tensor()
    live: dict[str, torch.Tensor] = {}
    try:
        for i, chunk in enumerate(pieces):
            got = fill.acquire(i, block=True)
            if got is None:
                break  # the save failed (a write error): its handle says why
            assert isinstance(got, int)
            slot = got
            for name, src, dst, n in chunk:
                data = live.get(name)
                if data is None:
                    data = live[name] = by_name[name].resolve()
                    if data.numel() != by_name[name].nbytes:
                        raise UsageError(f"extent {name!r}: {data.numel()} bytes resolved for "
                                         f"{by_name[name].nbytes} planned")
                pool[slot + dst: slot + dst + n].copy_(data[src: src + n])
                if last[name] == i:
                    del live[name]
            fill.submit(i, slot)
    except BaseException as e:
        fill.fail(f"resolving the DCP write items of step {step} failed: {type(e).__name__}: {e}")
        raise
    finally:
        fill.finish()
    return handle
