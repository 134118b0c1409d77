"""DCP's checkpoint Metadata and non-tensor values as JSON, rebuilt with explicit validation: no pickle.

DCP's FileSystemWriter pickles its :class:`~torch.distributed.checkpoint.metadata.Metadata` and
every non-tensor value; alpsck's DCP backend (:mod:`alpsck.dcp`) stores both as JSON instead
(schema in ``docs/format.md``):

* :func:`encode_metadata` / :func:`decode_metadata`: ``dcp-metadata.json``. Decoding accepts a
  fixed set of fields and types: tensor dtypes from :data:`alpsck.tree.TENSOR_DTYPES`, strided
  layout, three memory formats. Unknown fields, types, dtypes or layouts raise
  :class:`UnsafeCheckpointError`; malformed or inconsistent values (sizes beyond
  :data:`alpsck.tree.MAX_ELEMENTS`, chunks outside their tensor, overlapping or not covering it,
  on a rank outside the world) raise :class:`CorruptCheckpointError`. Every error names the file
  and the field.
* non-tensor values: :func:`alpsck.store.values.encode_value` / ``decode_value`` (below the backend,
  beside :mod:`alpsck.tree`).

Pure functions, no I/O, safe on any thread.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .. import _core, tree
from ..errors import CorruptCheckpointError, UnsafeCheckpointError, UsageError
from ..store.shards import DCP_META_FORMAT, MAX_RANKS
from ..store.values import MAX_VALUE_BYTES, ValueDecoder, ValueEncoder, no_tensor

__all__ = ["ExtentRef", "decode_metadata", "encode_metadata", "extent_name"]

METADATA_FILE = _core.run_dir_names["dcp_metadata"]  # the extra file committed with the shards
METADATA_FORMAT = "alpsck-dcp-metadata/1"
SHARD_FORMAT = DCP_META_FORMAT  # the meta document in each shard's index
# A checkpoint directory named by DCP's checkpoint_id (``folder/step-N``) also holds ``.metadata``, where
# DCP trainers look for a checkpoint: alpsck's marker, JSON (never the pickle FileSystemWriter writes there).
MAX_METADATA_BYTES = 16 << 20            # the core's limit on a committed extra file (kMaxManifestBytes)
MAX_NAME_BYTES = 4096                    # the core's limit on an extent name
MAX_OVERLAP_CHECK = 1024                 # chunks per tensor checked pairwise for overlaps

_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}
_DTYPE_NAMES = {d: n for n, d in tree.TENSOR_DTYPES.items()}


@dataclass(frozen=True)
class ExtentRef:
    """Where one DCP item lies: extent ``extent`` (``nbytes`` long) of rank ``rank``'s shard.

    The ``storage_data`` of each WriteResult and the values of ``Metadata.storage_data``.
    ``kind`` is ``"tensor"`` (raw little-endian bytes of one chunk, C order), ``"json"``
    (one non-tensor value, UTF-8 tagged JSON) or ``"raw"`` (the bytes a save planner's own
    ``resolve_data``/``transform_object`` gave for a non-tensor value, as they were).
    """

    rank: int
    extent: str
    nbytes: int
    kind: str


def extent_name(index: MetadataIndex, kind: str) -> str:
    """The extent of a DCP item: ``fqn@o1,o2,...`` (chunk offsets) for tensors, ``fqn@json`` for values.

    Injective: the part after the last ``@`` is digits and commas, or ``json``. A name too long for
    the core, or holding a NUL byte, becomes ``#<sha256 of the fqn>@...``.
    """
    suffix = kind if kind in ("json", "raw") else ",".join(str(int(o)) for o in (index.offset or ()))
    return _ExtentNames(index.fqn).name(suffix)


class _ExtentNames:
    """:func:`extent_name`'s rule for the many chunks of one tensor, with what depends on the fqn alone worked
    out once (a checkpoint of 300 tensors of 64 chunks each names 19,200 extents at every save and load)."""

    def __init__(self, fqn: str) -> None:
        self.head = f"{fqn}@"
        self.head_bytes = len(self.head.encode("utf-8", "surrogatepass"))
        self.hashed = "\0" in fqn  # every name of this fqn is hashed; else only one too long
        self.fqn = fqn

    def name(self, suffix: str) -> str:
        if self.hashed or self.head_bytes + len(suffix) > MAX_NAME_BYTES:  # the suffix is ASCII
            return f"#{hashlib.sha256(self.fqn.encode('utf-8', 'surrogatepass')).hexdigest()}@{suffix}"
        return self.head + suffix

    def of_offsets(self, offsets: Iterable[int]) -> str:
        return self.name(",".join(map(str, offsets)))


def _dtype_name(dtype: torch.dtype, fqn: str) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise UsageError(f"{fqn}: tensor dtype {dtype} cannot be checkpointed (allowed: {', '.join(tree.TENSOR_DTYPES)})")
    return name


def check_properties(p: TensorProperties, fqn: str) -> None:
    _dtype_name(p.dtype, fqn)
    if p.layout != torch.strided:
        raise UsageError(f"{fqn}: a {p.layout} tensor cannot be checkpointed (strided tensors only)")


def _memory_format_name(mf: torch.memory_format, fqn: str) -> str:
    for name, value in _MEMORY_FORMATS.items():
        if mf == value:
            return name
    raise UsageError(f"{fqn}: memory format {mf} is not supported")


def _plain_path(path: Any) -> bool:
    return isinstance(path, (tuple, list)) and all(
        isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path)


def _default_planner_data(pd: Any) -> bool:
    return isinstance(pd, dict) and all(isinstance(k, str) and _plain_path(v) for k, v in pd.items())


def encode_planner_data(pd: Any) -> dict[str, list[str | int]] | None:
    """DefaultSavePlanner's planner_data (flattened key -> path in the nested state dict), or None for
    anything else (:func:`encode_planner_value` keeps that)."""
    if _default_planner_data(pd):
        return {k: list(v) for k, v in pd.items()}
    return None


def encode_planner_value(pd: Any) -> Any:
    """A planner's own planner_data (not the default planner's key mappings) as tagged JSON (the values
    :func:`encode_value` takes), or None; UsageError naming what JSON cannot hold."""
    if pd is None or _default_planner_data(pd):
        return None
    enc = ValueEncoder()
    try:
        value = enc.value(pd, "planner_data")
    except (TypeError, ValueError) as e:
        raise UsageError(f"{e}: a planner's planner_data is stored as JSON, never as a pickle") from None
    if enc.tensors:
        raise UsageError("planner_data holds tensors: a planner's planner_data is stored as JSON, never as a pickle")
    return value


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a document's many small objects are built (a
    ChunkStorageMetadata, MetadataIndex and ExtentRef per chunk, none in a cycle): its passes, started
    every few hundred allocations, cost more than the work. 300 tensors of 64 chunks: decode 280-460 ms
    with it, 112-115 ms without; encode 74-220 ms, 66-69 ms (this project's VM)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def encode_metadata(md: Metadata, *, step: int, world_size: int) -> bytes:
    """``dcp-metadata.json``: DCP's Metadata as JSON (``md.storage_data`` must map MetadataIndex -> ExtentRef).

    Compact: each tensor chunk is ``[offsets, sizes, rank]`` and each value names its rank and
    length; extent names follow :func:`extent_name` and tensor byte counts follow from the chunk
    sizes, so they are not stored. Raises UsageError for anything that could not be rebuilt
    without pickle, or whose extent is not where the naming rule puts it.
    """
    with _gc_paused():
        return _encode_metadata(md, step, world_size)


def _encode_metadata(md: Metadata, step: int, world_size: int) -> bytes:
    storage: dict[MetadataIndex, ExtentRef] = md.storage_data or {}
    if not all(isinstance(i, MetadataIndex) and isinstance(r, ExtentRef) for i, r in storage.items()):
        raise UsageError("Metadata.storage_data does not come from AlpsckStorageWriter.write_data")

    def where(index: MetadataIndex, kind: str, name: str | None = None) -> ExtentRef:
        ref = storage.get(index)
        if ref is None or ref.kind != kind or ref.extent != (extent_name(index, kind) if name is None else name):
            raise UsageError(f"{index.fqn}: no {kind} extent written for offset {index.offset}")
        return ref

    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise UsageError(f"state dict key {fqn!r} is not a string")
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            check_properties(p, fqn)
            chunks, names = [], _ExtentNames(fqn)
            for c in m.chunks:
                offsets = [int(o) for o in c.offsets]
                ref = where(MetadataIndex(fqn, offsets), "tensor", names.of_offsets(offsets))
                chunks.append([offsets, [int(s) for s in c.sizes], ref.rank])
            sdm[fqn] = {
                "type": "tensor", "dtype": _dtype_name(p.dtype, fqn), "size": [int(s) for s in m.size],
                "layout": "strided", "memory_format": _memory_format_name(p.memory_format, fqn),
                "requires_grad": bool(p.requires_grad), "pin_memory": bool(p.pin_memory), "chunks": chunks,
            }
        elif isinstance(m, BytesStorageMetadata):
            stored = storage.get(MetadataIndex(fqn))
            ref = where(MetadataIndex(fqn), "raw" if stored is not None and stored.kind == "raw" else "json")
            sdm[fqn] = {"type": "bytes", "rank": ref.rank, "bytes": ref.nbytes}
            if ref.kind == "raw":
                sdm[fqn]["raw"] = True
        else:
            raise UsageError(f"{fqn}: DCP storage metadata of type {type(m).__name__} is not supported")
    sm = md.storage_meta
    doc = {
        "format": METADATA_FORMAT, "step": step, "world_size": world_size, "version": md.version,
        "state_dict_metadata": sdm, "planner_data": encode_planner_data(md.planner_data),
        **({} if (pv := encode_planner_value(md.planner_data)) is None else {"planner_value": pv}),
        "storage_meta": None if sm is None else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id, "load_id": sm.load_id, "modules": [str(m) for m in sm.modules]},
    }
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


class _Fields:
    """Typed access to a decoded JSON document; every error names the file and the field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def corrupt(self, field: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {field}: {what}")

    def unsafe(self, field: str, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(f"{self.where}: {field}: {what}; refusing to load it")

    def obj(self, v: Any, field: str, required: Iterable[str], optional: Iterable[str] = ()) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.corrupt(field, f"expected an object, got {type(v).__name__}")
        req = set(required)
        unknown = sorted(set(v) - req - set(optional))
        if unknown:
            raise self.unsafe(field, f"unknown field {unknown[0]!r}")
        missing = sorted(req - set(v))
        if missing:
            raise self.corrupt(field, f"missing field {missing[0]!r}")
        return v

    def integer(self, v: Any, field: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.corrupt(field, f"expected an integer, got {_short(v)}")
        if not lo <= v <= hi:
            raise self.corrupt(field, f"{v} is outside [{lo}, {hi}]")
        return v

    def integers(self, v: Any, field: str, n: int | None = None) -> list[int]:
        if not isinstance(v, list) or len(v) > tree.MAX_DIMS:
            raise self.corrupt(field, f"expected a list of at most {tree.MAX_DIMS} integers, got {_short(v)}")
        if n is not None and len(v) != n:
            raise self.corrupt(field, f"expected {n} integers, got {len(v)}")
        return [self.integer(x, f"{field}[{i}]", 0, tree.MAX_ELEMENTS) for i, x in enumerate(v)]

    def string(self, v: Any, field: str, optional: bool = False, max_bytes: int = 4096) -> Any:
        if v is None and optional:
            return None
        if not isinstance(v, str) or len(v) > max_bytes:
            raise self.corrupt(field, f"expected a string, got {_short(v)}")
        return v

    def boolean(self, v: Any, field: str) -> bool:
        if not isinstance(v, bool):
            raise self.corrupt(field, f"expected true or false, got {_short(v)}")
        return v

    def choice(self, v: Any, field: str, table: dict[str, Any], what: str) -> Any:
        if not isinstance(v, str) or v not in table:
            raise self.unsafe(field, f"{what} {_short(v)} is not allowed (allowed: {', '.join(table)})")
        return table[v]


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def _check_chunks(f: _Fields, field: str, size: list[int], chunks: list[tuple[list[int], list[int]]]) -> None:
    """The chunks (offsets, sizes) lie inside the tensor and cover it exactly (volumes add up, no two overlap)."""
    total = math.prod(size)
    covered = 0
    for i, (offsets, sizes) in enumerate(chunks):
        for d, (o, s, n) in enumerate(zip(offsets, sizes, size, strict=True)):
            if o + s > n:
                raise f.corrupt(f"{field}.chunks[{i}]", f"dimension {d} spans [{o}, {o + s}) outside the size {n}")
        covered += math.prod(sizes)
    if covered != total:
        raise f.corrupt(field, f"its chunks hold {covered} elements, the tensor has {total}")
    boxes = [(i, c) for i, c in enumerate(chunks) if math.prod(c[1])]
    if len(boxes) < 2:
        return
    pair = _overlap_along_one_dim(boxes)
    if pair is None and len(boxes) <= MAX_OVERLAP_CHECK:  # boxes that differ in more than one dimension
        lo = torch.tensor([c[0] for _, c in boxes], dtype=torch.int64)
        hi = lo + torch.tensor([c[1] for _, c in boxes], dtype=torch.int64)
        overlap = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(-1)
        overlap.fill_diagonal_(False)
        if bool(overlap.any()):
            a, b = (int(x) for x in overlap.nonzero()[0])
            pair = (boxes[a][0], boxes[b][0])
    if pair:
        raise f.corrupt(field, f"chunks {min(pair)} and {max(pair)} overlap")


def _overlap_along_one_dim(boxes: list[tuple[int, tuple[list[int], list[int]]]]) -> tuple[int, ...] | None:
    """For chunks that differ in one dimension at most (a row- or column-wise sharding: FSDP's, most tensor
    parallel ones), two that overlap, or () for none, in O(k log k); None for chunks that differ in more."""
    first_off, first_size = boxes[0][1]
    varying = [d for d in range(len(first_off))
               if any(c[0][d] != first_off[d] or c[1][d] != first_size[d] for _, c in boxes)]
    if len(varying) > 1:
        return None
    if not varying:  # the same box twice
        return (boxes[0][0], boxes[1][0])
    d = varying[0]
    ordered = sorted(boxes, key=lambda b: b[1][0][d])
    for (i, (oi, si)), (j, (oj, _)) in zip(ordered, ordered[1:], strict=False):
        if oj[d] < oi[d] + si[d]:
            return (i, j)
    return ()


def _plain_integers(v: Any, n: int, _max: int = tree.MAX_ELEMENTS) -> bool:
    """``v`` is a list of ``n`` integers (not booleans) in [0, MAX_ELEMENTS]: what :meth:`_Fields.integers`
    accepts, checked without building a field name per element."""
    if type(v) is not list or len(v) != n:
        return False
    for x in v:
        if type(x) is not int or not 0 <= x <= _max:
            return False
    return True


def _decode_tensor_md(f: _Fields, field: str, v: Any, fqn: str, world: int,
                      storage: dict[MetadataIndex, ExtentRef]) -> TensorStorageMetadata:
    f.obj(v, field, ("type", "dtype", "size", "chunks", "layout", "memory_format", "requires_grad", "pin_memory"))
    dtype = f.choice(v["dtype"], f"{field}.dtype", tree.TENSOR_DTYPES, "tensor dtype")
    layout = f.choice(v["layout"], f"{field}.layout", _LAYOUTS, "tensor layout")
    memory_format = f.choice(v["memory_format"], f"{field}.memory_format", _MEMORY_FORMATS, "memory format")
    size = f.integers(v["size"], f"{field}.size")
    if math.prod(size) > tree.MAX_ELEMENTS:
        raise f.corrupt(f"{field}.size", f"{size} exceeds {tree.MAX_ELEMENTS} elements")
    if not isinstance(v["chunks"], list):
        raise f.corrupt(f"{field}.chunks", "expected a list")
    ndim, names, seen = len(size), _ExtentNames(fqn), set()
    raw: list[tuple[list[int], list[int]]] = []
    chunks = []
    for i, c in enumerate(v["chunks"]):
        if not (type(c) is list and len(c) == 3 and _plain_integers(c[0], ndim) and _plain_integers(c[1], ndim)
                and type(c[2]) is int and 0 <= c[2] < world):
            # The slow path, only to name what is wrong (a valid chunk never comes here).
            cf = f"{field}.chunks[{i}]"
            if not isinstance(c, list) or len(c) != 3:
                raise f.corrupt(cf, f"expected [offsets, sizes, rank], got {_short(c)}")
            f.integers(c[0], f"{cf}.offsets", ndim)
            f.integers(c[1], f"{cf}.sizes", ndim)
            f.integer(c[2], f"{cf}.rank", 0, world - 1)
        offsets, sizes, rank = c
        key = tuple(offsets)
        if key in seen:
            raise f.corrupt(f"{field}.chunks[{i}].offsets", f"{offsets} appears twice")
        seen.add(key)
        at = torch.Size(offsets)
        raw.append((offsets, sizes))
        chunks.append(ChunkStorageMetadata(offsets=at, sizes=torch.Size(sizes)))
        storage[MetadataIndex(fqn, at, i)] = ExtentRef(rank, names.of_offsets(offsets),
                                                       math.prod(sizes) * dtype.itemsize, "tensor")
    _check_chunks(f, field, size, raw)
    props = TensorProperties(dtype=dtype, layout=layout, requires_grad=f.boolean(v["requires_grad"], f"{field}.requires_grad"),
                             memory_format=memory_format, pin_memory=f.boolean(v["pin_memory"], f"{field}.pin_memory"))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def decode_metadata(data: bytes, where: str, *, step: int | None = None, world_size: int | None = None) -> Metadata:
    """Rebuild DCP's Metadata from ``dcp-metadata.json``, validating every field.

    ``step``/``world_size``, when given, must match the document (the directory's step and the
    manifest's shard count). ``storage_data`` becomes MetadataIndex -> :class:`ExtentRef`, one per
    tensor chunk and per value, each on a rank below ``world_size``, named by :func:`extent_name`.
    """
    with _gc_paused():
        return _decode_metadata(data, where, step, world_size)


def _decode_metadata(data: bytes, where: str, step: int | None, world_size: int | None) -> Metadata:
    f = _Fields(where)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {e}") from e
    f.obj(doc, "document", ("format", "step", "world_size", "version", "state_dict_metadata", "planner_data",
                            "storage_meta"), ("planner_value",))
    if doc["format"] != METADATA_FORMAT:
        raise f.unsafe("format", f"{_short(doc['format'])} is not {METADATA_FORMAT!r}")
    doc_step = f.integer(doc["step"], "step")
    world = f.integer(doc["world_size"], "world_size", 1, MAX_RANKS)
    if step is not None and doc_step != step:
        raise f.corrupt("step", f"{doc_step}, but the directory holds step {step}")
    if world_size is not None and world != world_size:
        raise f.corrupt("world_size", f"{world}, but the manifest lists {world_size} shard(s)")
    version = f.string(doc["version"], "version", optional=True, max_bytes=64)

    sdm_doc = doc["state_dict_metadata"]
    if not isinstance(sdm_doc, dict):
        raise f.corrupt("state_dict_metadata", "expected an object")
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, ExtentRef] = {}
    for fqn, v in sdm_doc.items():
        field = f"state_dict_metadata[{fqn!r}]"
        kind = f.obj(v, field, ("type",), ("dtype", "size", "chunks", "layout", "memory_format", "requires_grad",
                                           "pin_memory", "rank", "bytes", "raw")).get("type")
        if kind == "tensor":
            sdm[fqn] = _decode_tensor_md(f, field, v, fqn, world, storage)
        elif kind == "bytes":
            f.obj(v, field, ("type", "rank", "bytes"), ("raw",))
            if "raw" in v and v["raw"] is not True:
                raise f.corrupt(f"{field}.raw", f"expected true, got {_short(v['raw'])}")
            kind = "raw" if "raw" in v else "json"
            index = MetadataIndex(fqn)
            storage[index] = ExtentRef(f.integer(v["rank"], f"{field}.rank", 0, world - 1), extent_name(index, kind),
                                       f.integer(v["bytes"], f"{field}.bytes", int(kind == "json"), MAX_VALUE_BYTES),
                                       kind)
            sdm[fqn] = BytesStorageMetadata()
        else:
            raise f.unsafe(f"{field}.type", f"storage type {_short(kind)} is unknown")

    planner_data = doc["planner_data"]
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise f.corrupt("planner_data", "expected an object or null")
        for k, p in planner_data.items():
            if not (isinstance(p, list) and len(p) <= tree.MAX_DEPTH and _plain_path(p)):
                raise f.corrupt(f"planner_data[{k!r}]", f"expected a list of strings and integers, got {_short(p)}")
        planner_data = {k: tuple(p) for k, p in planner_data.items()}
    if "planner_value" in doc:
        if planner_data is not None:
            raise f.corrupt("planner_value", "beside the default planner's planner_data")
        planner_data = ValueDecoder(no_tensor).value(doc["planner_value"], f"{where}: planner_value")

    sm = doc["storage_meta"]
    storage_meta = None
    if sm is not None:
        f.obj(sm, "storage_meta", ("checkpoint_id", "save_id", "load_id", "modules"))
        modules = sm["modules"]
        if not isinstance(modules, list):
            raise f.corrupt("storage_meta.modules", "expected a list")
        storage_meta = StorageMeta(
            checkpoint_id=f.string(sm["checkpoint_id"], "storage_meta.checkpoint_id", optional=True),
            save_id=f.string(sm["save_id"], "storage_meta.save_id", optional=True),
            load_id=f.string(sm["load_id"], "storage_meta.load_id", optional=True),
            modules=[f.string(m, f"storage_meta.modules[{i}]") for i, m in enumerate(modules)])
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage,
                    storage_meta=storage_meta, version=version)
