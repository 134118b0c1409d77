"""A torch.distributed.checkpoint (DCP) storage backend on the alpsck core, so DCP's planner reshards.

Use it where a checkpoint must load at another world size (or another sharding) than it was saved
with; at the same world size, :class:`alpsck.Checkpointer` restores directly::

    import torch.distributed.checkpoint as dcp
    from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter

    dcp.save(state_dict, storage_writer=AlpsckStorageWriter("runs/exp1", step))   # every rank
    dcp.load(state_dict, storage_reader=AlpsckStorageReader("runs/exp1"))        # any world size

On disk a DCP checkpoint is an ordinary alpsck checkpoint (``docs/format.md``), so
``alpsck inspect-checkpoints``, verification (``_core.scan``) and retention treat it like any
other: each rank writes ``RUN_DIR/step-N.tmp/rank-RRRRR.bin`` through its own core
:class:`alpsck._core.Engine` (one extent per DCP write item, CRC32C on every chunk, O_DIRECT,
``commit="deferred"``), and the coordinator commits the step with the DCP metadata as the extra
file ``dcp-metadata.json``, once every rank's shard is durable. The commit is the core's atomic
rename, so a crash at any point leaves either the whole checkpoint or none of it.

Call order (DCP drives it; see ``torch/distributed/checkpoint/storage.py``).
Save: ``storage_meta()`` and ``set_up_storage_writer()`` (all ranks) -> ``prepare_local_plan()``
(all ranks) -> ``prepare_global_plan()`` (coordinator: stamps every plan with its rank and the
world size, then opens the coordinator's engine, whose start-up removes abandoned ``step-*.tmp``
directories) -> ``write_data()`` (all ranks: the other ranks open their engines only now, after
the coordinator's clean-up; returns once this rank's shard is sealed and durable) -> ``finish()``
(coordinator: :func:`alpsck._core.commit_step`, then retention).
Load: ``read_metadata()`` (all ranks: picks the step, checks ``dcp-metadata.json`` against the
manifest's CRC32C, parses it with explicit validation) -> ``set_up_storage_reader()`` ->
``prepare_local_plan()`` -> ``prepare_global_plan()`` (coordinator: every rank must have picked the
same step) -> ``read_data()`` (each shard opened once; extents read in file order, in batches,
every chunk CRC-checked; straight into the destination when it is a whole, contiguous CPU chunk).

No pickle, ever. DCP's own FileSystemWriter pickles its Metadata and every non-tensor value;
here the Metadata is JSON (schema in ``docs/format.md``), rebuilt on read from a fixed set of
types (tensor dtypes from :data:`alpsck.tree.TENSOR_DTYPES`; unknown types, fields, dtypes or
layouts raise :class:`UnsafeCheckpointError`, inconsistent sizes and offsets
:class:`CorruptCheckpointError`, each naming the field). Non-tensor values (DCP's ``BYTE_IO``
items: ints, floats, strings, tuples, dicts ... that DCP would ``torch.save``) are stored as
alpsck's tagged JSON (:mod:`alpsck.tree`), taken from the planner's ``lookup_object`` (so
DCP's own pickle of them is never written); a value JSON cannot hold (a custom class, a tuple
holding tensors) fails the save with :class:`UsageError`. On load a value is decoded from JSON
and handed to ``planner.load_bytes`` as a ``torch.save`` of the decoded plain value, made here
in memory: what the planner unpickles was never read from disk.

Locking: a writer takes the run directory's per-rank writer lock
(:func:`alpsck.checkpointer.lock_run_dir`) for as long as its engine is open (coordinator: from
``prepare_global_plan`` to the end of ``write_data``; other ranks: during ``write_data``) and the
coordinator again for the commit and retention in ``finish``. So a DCP save and an open
:class:`alpsck.Checkpointer` (or another job) on the same run directory fail with
:class:`RunDirLockedError` instead of removing each other's directories. Readers take no lock.

Threading: a writer or reader serves one save or load at a time, driven by DCP on one thread per
rank (``async_save`` runs the whole save on its background thread). Long core calls release the
GIL. One writer per checkpoint: a step is written once (a committed step raises UsageError).
"""

from __future__ import annotations

import io
import json
import math
import os
import uuid
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
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
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _core, tree
from .checkpointer import lock_run_dir
from .errors import CorruptCheckpointError, NoCheckpointError, UnsafeCheckpointError, UsageError
from .shards import MAX_RANKS, shard_name

__all__ = ["AlpsckStorageReader", "AlpsckStorageWriter", "ExtentRef", "decode_metadata", "encode_metadata"]

METADATA_FILE = "dcp-metadata.json"      # the extra file committed with the shards
METADATA_FORMAT = "alpsck-dcp-metadata/1"
SHARD_FORMAT = "alpsck-dcp/1"            # the meta document in each shard's index
VALUE_FORMAT = "alpsck-dcp-value/1"      # one non-tensor value, tagged JSON
MAX_METADATA_BYTES = 16 << 20            # the core's limit on a committed extra file (kMaxManifestBytes)
MAX_VALUE_BYTES = 64 << 20               # one non-tensor value
MAX_NAME_BYTES = 4096                    # the core's limit on an extent name
MAX_OVERLAP_CHECK = 1024                 # chunks per tensor checked pairwise for overlaps
DEFAULT_READ_BATCH_BYTES = 512 << 20

_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "channels_last": torch.channels_last,
                   "preserve_format": torch.preserve_format}
_DTYPE_NAMES = {d: n for n, d in tree.TENSOR_DTYPES.items()}


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:09d}"  # as the core names it (StepDirName)


@dataclass(frozen=True)
class ExtentRef:
    """Where one DCP item lies: extent ``extent`` (``nbytes`` long) of rank ``rank``'s shard.

    The ``storage_data`` of each WriteResult and the values of ``Metadata.storage_data``.
    ``kind`` is ``"tensor"`` (raw little-endian bytes of one chunk, C order) or ``"json"``
    (one non-tensor value, UTF-8 tagged JSON).
    """

    rank: int
    extent: str
    nbytes: int
    kind: str


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in its plan's ``storage_data``."""

    rank: int
    world_size: int


def extent_name(index: MetadataIndex, kind: str) -> str:
    """The extent of a DCP item: ``fqn@o1,o2,...`` (chunk offsets) for tensors, ``fqn@json`` for values.

    Injective: the part after the last ``@`` is digits and commas, or ``json``. A name too long for
    the core, or holding a NUL byte, becomes ``#<sha256 of the fqn>@...``.
    """
    suffix = "json" if kind == "json" else ",".join(str(int(o)) for o in (index.offset or ()))
    name = f"{index.fqn}@{suffix}"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES or "\0" in name:
        import hashlib

        name = f"#{hashlib.sha256(index.fqn.encode('utf-8', 'surrogatepass')).hexdigest()}@{suffix}"
    return name


# ------------------------------------------------------------------------------ metadata (JSON)


def _dtype_name(dtype: torch.dtype, fqn: str) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise UsageError(f"{fqn}: tensor dtype {dtype} cannot be checkpointed (allowed: {', '.join(tree.TENSOR_DTYPES)})")
    return name


def _check_properties(p: TensorProperties, fqn: str) -> None:
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


def _encode_planner_data(pd: Any) -> dict[str, list[str | int]] | None:
    """DefaultSavePlanner's planner_data (flattened key -> path in the nested state dict), or None."""
    if pd is None:
        return None
    if isinstance(pd, dict) and all(isinstance(k, str) and _plain_path(v) for k, v in pd.items()):
        return {k: list(v) for k, v in pd.items()}
    raise UsageError(
        f"planner_data of type {type(pd).__name__} cannot be stored without pickle: alpsck keeps the default "
        "planner's key mappings (dict of str -> tuple of str/int) only")


def encode_metadata(md: Metadata, *, step: int, world_size: int) -> bytes:
    """``dcp-metadata.json``: DCP's Metadata as JSON (``md.storage_data`` must map MetadataIndex -> ExtentRef).

    Raises UsageError for anything that could not be rebuilt without pickle.
    """
    sdm: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise UsageError(f"state dict key {fqn!r} is not a string")
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            _check_properties(p, fqn)
            sdm[fqn] = {
                "type": "tensor", "dtype": _dtype_name(p.dtype, fqn), "size": [int(s) for s in m.size],
                "chunks": [{"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]} for c in m.chunks],
                "layout": "strided", "memory_format": _memory_format_name(p.memory_format, fqn),
                "requires_grad": bool(p.requires_grad), "pin_memory": bool(p.pin_memory),
            }
        elif isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise UsageError(f"{fqn}: DCP storage metadata of type {type(m).__name__} is not supported")
    storage: list[dict[str, Any]] = []
    for index, ref in (md.storage_data or {}).items():
        if not isinstance(index, MetadataIndex) or not isinstance(ref, ExtentRef):
            raise UsageError("Metadata.storage_data does not come from AlpsckStorageWriter.write_data")
        storage.append({"fqn": index.fqn, "offset": None if index.offset is None else [int(o) for o in index.offset],
                        "rank": ref.rank, "extent": ref.extent, "bytes": ref.nbytes, "kind": ref.kind})
    sm = md.storage_meta
    doc = {
        "format": METADATA_FORMAT, "step": step, "world_size": world_size, "version": md.version,
        "state_dict_metadata": sdm, "storage_data": storage, "planner_data": _encode_planner_data(md.planner_data),
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


def _check_chunks(f: _Fields, field: str, size: list[int], chunks: list[ChunkStorageMetadata]) -> None:
    """The chunks lie inside the tensor and cover it exactly (volumes add up, no two overlap)."""
    total = math.prod(size)
    covered = 0
    for i, c in enumerate(chunks):
        for d, (o, s, n) in enumerate(zip(c.offsets, c.sizes, size, strict=True)):
            if o + s > n:
                raise f.corrupt(f"{field}.chunks[{i}]", f"dimension {d} spans [{o}, {o + s}) outside the size {n}")
        covered += math.prod(c.sizes)
    if covered != total:
        raise f.corrupt(field, f"its chunks hold {covered} elements, the tensor has {total}")
    boxes = [c for c in chunks if math.prod(c.sizes)]
    if 1 < len(boxes) <= MAX_OVERLAP_CHECK:
        lo = torch.tensor([list(c.offsets) for c in boxes], dtype=torch.int64)
        hi = lo + torch.tensor([list(c.sizes) for c in boxes], dtype=torch.int64)
        overlap = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(-1)
        overlap.fill_diagonal_(False)
        if bool(overlap.any()):
            i, j = (int(x) for x in overlap.nonzero()[0])
            raise f.corrupt(field, f"chunks {i} and {j} overlap")


def _decode_tensor_md(f: _Fields, field: str, v: Any) -> TensorStorageMetadata:
    f.obj(v, field, ("type", "dtype", "size", "chunks", "layout", "memory_format", "requires_grad", "pin_memory"))
    dtype = f.choice(v["dtype"], f"{field}.dtype", tree.TENSOR_DTYPES, "tensor dtype")
    layout = f.choice(v["layout"], f"{field}.layout", _LAYOUTS, "tensor layout")
    memory_format = f.choice(v["memory_format"], f"{field}.memory_format", _MEMORY_FORMATS, "memory format")
    size = f.integers(v["size"], f"{field}.size")
    if math.prod(size) > tree.MAX_ELEMENTS:
        raise f.corrupt(f"{field}.size", f"{size} exceeds {tree.MAX_ELEMENTS} elements")
    if not isinstance(v["chunks"], list):
        raise f.corrupt(f"{field}.chunks", "expected a list")
    chunks = []
    for i, c in enumerate(v["chunks"]):
        cf = f"{field}.chunks[{i}]"
        f.obj(c, cf, ("offsets", "sizes"))
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(f.integers(c["offsets"], f"{cf}.offsets", len(size))),
                                           sizes=torch.Size(f.integers(c["sizes"], f"{cf}.sizes", len(size)))))
    _check_chunks(f, field, size, chunks)
    props = TensorProperties(dtype=dtype, layout=layout, requires_grad=f.boolean(v["requires_grad"], f"{field}.requires_grad"),
                             memory_format=memory_format, pin_memory=f.boolean(v["pin_memory"], f"{field}.pin_memory"))
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def decode_metadata(data: bytes, where: str, *, step: int | None = None, world_size: int | None = None) -> Metadata:
    """Rebuild DCP's Metadata from ``dcp-metadata.json``, validating every field.

    ``step``/``world_size``, when given, must match the document (the directory's step and the
    manifest's shard count). ``storage_data`` becomes MetadataIndex -> :class:`ExtentRef`; every
    tensor chunk must have exactly one stored extent, every value one, every extent a valid rank.
    """
    f = _Fields(where)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {e}") from e
    f.obj(doc, "document", ("format", "step", "world_size", "version", "state_dict_metadata", "storage_data",
                            "planner_data", "storage_meta"))
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
    for fqn, v in sdm_doc.items():
        field = f"state_dict_metadata[{fqn!r}]"
        kind = f.obj(v, field, ("type",), ("dtype", "size", "chunks", "layout", "memory_format", "requires_grad",
                                           "pin_memory")).get("type")
        if kind == "tensor":
            sdm[fqn] = _decode_tensor_md(f, field, v)
        elif kind == "bytes":
            f.obj(v, field, ("type",))
            sdm[fqn] = BytesStorageMetadata()
        else:
            raise f.unsafe(f"{field}.type", f"storage type {_short(kind)} is unknown")

    if not isinstance(doc["storage_data"], list):
        raise f.corrupt("storage_data", "expected a list")
    storage: dict[MetadataIndex, ExtentRef] = {}
    chunk_at: dict[str, dict[tuple[int, ...], int]] = {}  # fqn -> chunk offsets -> chunk index
    for i, e in enumerate(doc["storage_data"]):
        field = f"storage_data[{i}]"
        f.obj(e, field, ("fqn", "offset", "rank", "extent", "bytes", "kind"))
        fqn = f.string(e["fqn"], f"{field}.fqn", max_bytes=1 << 20)
        md = sdm.get(fqn)
        if md is None:
            raise f.corrupt(f"{field}.fqn", f"{fqn!r} is not in state_dict_metadata")
        kind = f.choice(e["kind"], f"{field}.kind", {"tensor": "tensor", "json": "json"}, "storage kind")
        rank = f.integer(e["rank"], f"{field}.rank", 0, world - 1)
        extent = f.string(e["extent"], f"{field}.extent", max_bytes=MAX_NAME_BYTES)
        nbytes = f.integer(e["bytes"], f"{field}.bytes")
        if isinstance(md, TensorStorageMetadata):
            if kind != "tensor":
                raise f.corrupt(f"{field}.kind", f"{kind!r} for tensor {fqn!r}")
            offset = f.integers(e["offset"], f"{field}.offset", len(md.size))
            at = chunk_at.get(fqn)
            if at is None:
                at = chunk_at[fqn] = {tuple(c.offsets): k for k, c in enumerate(md.chunks)}
            k = at.get(tuple(offset))
            if k is None:
                raise f.corrupt(f"{field}.offset", f"{offset} is not the offset of a chunk of {fqn!r}")
            want = math.prod(md.chunks[k].sizes) * md.properties.dtype.itemsize
            if nbytes != want:
                raise f.corrupt(f"{field}.bytes", f"{nbytes}, but chunk {offset} of {fqn!r} needs {want}")
            index = MetadataIndex(fqn, offset, k)
        else:
            if kind != "json" or e["offset"] is not None:
                raise f.corrupt(field, f"value {fqn!r} must be stored as json without an offset")
            if nbytes > MAX_VALUE_BYTES:
                raise f.corrupt(f"{field}.bytes", f"{nbytes} exceeds {MAX_VALUE_BYTES}")
            index = MetadataIndex(fqn)
        if index in storage:
            raise f.corrupt(field, f"{fqn!r} at {e['offset']} is stored twice")
        storage[index] = ExtentRef(rank, extent, nbytes, kind)
    for fqn, md in sdm.items():
        wanted = ([MetadataIndex(fqn, c.offsets) for c in md.chunks] if isinstance(md, TensorStorageMetadata)
                  else [MetadataIndex(fqn)])
        for index in wanted:
            if index not in storage:
                raise f.corrupt("storage_data", f"no stored data for {fqn!r}" + (f" at {list(index.offset)}" if index.offset
                                                                                 is not None else ""))

    planner_data = doc["planner_data"]
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise f.corrupt("planner_data", "expected an object or null")
        for k, p in planner_data.items():
            if not (isinstance(p, list) and len(p) <= tree.MAX_DEPTH and _plain_path(p)):
                raise f.corrupt(f"planner_data[{k!r}]", f"expected a list of strings and integers, got {_short(p)}")
        planner_data = {k: tuple(p) for k, p in planner_data.items()}

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


# ------------------------------------------------------------------------------ non-tensor values


def _encode_value(planner: SavePlanner, item: WriteItem) -> bytes:
    """One BYTE_IO item as tagged JSON, from the planner's original object (never DCP's pickle of it)."""
    fqn = item.index.fqn
    lookup = getattr(planner, "lookup_object", None)
    if not callable(lookup):
        raise UsageError(f"{fqn}: non-tensor values need a planner with lookup_object() (DefaultSavePlanner or a "
                         f"subclass); {type(planner).__name__} has none")
    obj = lookup(item.index)
    enc = tree._Encoder()
    try:
        value = enc.value(obj, fqn)
    except (TypeError, ValueError) as e:
        raise UsageError(
            f"{e}. alpsck stores non-tensor values as JSON, never as pickles: keep such state in "
            "alpsck.Checkpointer's state tree, or convert it to plain values (numbers, strings, lists, dicts, tuples, "
            "bytes)") from None
    if enc.tensors:
        raise UsageError(f"{fqn}: a {type(obj).__name__} holding tensors is a single opaque value to DCP (it would be "
                         "pickled); put the tensors in a list or dict so DCP saves them as tensors")
    data = json.dumps({"format": VALUE_FORMAT, "value": value}, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise UsageError(f"{fqn}: the value takes {len(data)} bytes as JSON, more than {MAX_VALUE_BYTES}; store big "
                         "data as tensors")
    return data


def _decode_value(data: bytes, where: str) -> Any:
    """A non-tensor value back from its JSON; only :mod:`alpsck.tree`'s tags are accepted."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(doc, dict) or set(doc) != {"format", "value"} or doc["format"] != VALUE_FORMAT:
        raise UnsafeCheckpointError(f"{where}: not an {VALUE_FORMAT} document; refusing to load it")

    def no_tensor(key: str, spec: tree.TensorSpec, path: str) -> Any:
        raise UnsafeCheckpointError(f"{path}: a tensor reference inside a non-tensor value; refusing to load it")

    return tree._Decoder(no_tensor).value(doc["value"], where)


# ------------------------------------------------------------------------------ writer


class _RunDirLock:
    """This rank's writer lock on the run directory (released by close() or when collected)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.fd: int | None = lock_run_dir(run_dir, rank)
        self._finalizer = weakref.finalize(self, _unlock, self.fd)

    def close(self) -> None:
        self._finalizer()
        self.fd = None


def _unlock(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)  # a clean release leaves no owner behind
    finally:
        os.close(fd)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a CPU, contiguous, resolved copy of ``t`` (no copy when it already is one)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


class AlpsckStorageWriter(StorageWriter):
    """DCP StorageWriter: checkpoint ``step`` of ``run_dir``, one alpsck shard per rank, one atomic commit.

    Args:
        run_dir: the run directory (created if missing). Use one that no :class:`alpsck.Checkpointer`
            has open: both take its writer lock.
        step: the checkpoint's step; it must not be committed yet.
        threads: writer threads of each rank's engine (default 8).
        chunk_bytes: unit of writing and CRC (default 8 MiB).
        keep_last: after the commit, keep the newest ``keep_last`` committed checkpoints of the run
            directory, DCP or not (0 keeps all).
        commit_timeout_s: how long the commit waits for every rank's shard.
        direct_io: O_DIRECT where the file system allows.

    Tensors are written from their own memory (no snapshot copy): DCP keeps them unchanged until
    ``write_data`` returns (``dcp.async_save`` stages a copy first). See the module docstring for
    the call order, locking and the no-pickle policy.
    """

    def __init__(self, run_dir: str | os.PathLike[str], step: int, *, threads: int | None = None,
                 chunk_bytes: int | None = None, keep_last: int = 0, commit_timeout_s: float = 600.0,
                 direct_io: bool = True) -> None:
        super().__init__()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UsageError(f"step must be a non-negative integer, not {step!r}")
        if keep_last < 0:
            raise UsageError(f"keep_last must be 0 (keep all) or more, not {keep_last}")
        self.run_dir = Path(run_dir)
        self.step = step
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.keep_last = keep_last
        self.commit_timeout_s = commit_timeout_s
        self.direct_io = direct_io
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.world_size: int | None = None
        self._engine: _core.Engine | None = None
        self._lock: _RunDirLock | None = None

    # pickled by dcp.async_save's process executor: never the open engine or lock
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_engine"] = state["_lock"] = None
        return state

    @property
    def checkpoint_id(self) -> str:
        return str(_step_dir(self.run_dir, self.step))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen automatically: construct it with a run directory and a step

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Called by DCP when ``dcp.save(checkpoint_id=...)`` is given: it must be this run directory."""
        self.close()
        if checkpoint_id is not None and Path(checkpoint_id) != self.run_dir:
            raise UsageError(f"checkpoint_id {os.fspath(checkpoint_id)!r}: this writer saves step {self.step} of "
                             f"{self.run_dir}; pass checkpoint_id=None or make a writer for the other directory")
        self.save_id = str(uuid.uuid4())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks, first: records this rank; a committed step is refused before anything is written."""
        self.rank = int(kwargs.get("rank") or 0)
        if is_coordinator != (self.rank == 0):
            raise UsageError(f"the coordinator must be rank 0 (this is rank {self.rank})")
        if not kwargs.get("use_collectives", True):
            raise UsageError("AlpsckStorageWriter commits one checkpoint for all ranks: use_collectives=False is not "
                             "supported")
        if (_step_dir(self.run_dir, self.step) / "MANIFEST.json").exists():
            raise UsageError(f"{self.run_dir}: step {self.step} is already committed; a step is written once "
                             "(make a writer for a new step)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """All ranks: refuses tensors alpsck cannot store (dtype, layout) before anything is written."""
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                if item.tensor_data is None:
                    raise UsageError(f"{item.index.fqn}: tensor write item without tensor data")
                _check_properties(item.tensor_data.properties, item.index.fqn)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: tells each rank its rank and the world size, and opens its own engine.

        The engine opens last, after every rank planned successfully: its start-up removes
        abandoned ``step-*.tmp`` directories, which must happen before any rank writes (the other
        ranks open theirs in ``write_data``, after this plan reached them).
        """
        world = len(plans)
        for plan in plans:
            if plan.planner_data is not None:
                _encode_planner_data(plan.planner_data)  # fails now rather than in finish()
        out = [replace(plan, storage_data=_RankPlan(i, world)) for i, plan in enumerate(plans)]
        self.world_size = world
        self._open(0, world)
        return out

    def _open(self, rank: int, world: int) -> _core.Engine:
        if self._engine is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = _RunDirLock(self.run_dir, rank)
            try:
                self._engine = _core.Engine(str(self.run_dir), threads=self.threads or 0,
                                            chunk_bytes=self.chunk_bytes or 0, max_in_flight=1, keep_last=0,
                                            direct_io=self.direct_io, rank=rank, world_size=world,
                                            commit_timeout_s=self.commit_timeout_s)
            except BaseException:
                self.close()
                raise
            if self.direct_io and not self._engine.direct_io:
                warnings.warn(f"{self.run_dir}: the file system refused O_DIRECT; alpsck writes buffered and "
                              "fdatasyncs instead", RuntimeWarning, stacklevel=3)
        return self._engine

    def close(self) -> None:
        """Close this rank's engine and drop its lock (done by write_data/finish; safe to call twice)."""
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                engine.close()
        finally:
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """All ranks: writes this rank's shard and returns once it is sealed and durable (not committed).

        One extent per write item: a tensor chunk's raw bytes (written from the tensor's memory),
        or a non-tensor value as JSON. The shard's DONE record tells the coordinator it is there.
        """
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise UsageError("the plan carries no alpsck rank assignment: was prepare_global_plan of an "
                             "AlpsckStorageWriter run?")
        if info.rank != self.rank:
            raise UsageError(f"the plan is for rank {info.rank}, this is rank {self.rank}")
        self.world_size = info.world_size
        try:
            extents: list[tuple[str, torch.Tensor]] = []
            results: list[WriteResult] = []
            names: set[str] = set()
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    kind = "json"
                    data = torch.frombuffer(bytearray(_encode_value(planner, item)), dtype=torch.uint8)
                else:
                    kind = "tensor"
                    data = self._tensor_bytes(planner, item)
                name = extent_name(item.index, kind)
                if name in names:
                    raise UsageError(f"{item.index.fqn}: written twice by rank {self.rank} (extent {name!r})")
                names.add(name)
                extents.append((name, data))
                results.append(WriteResult(index=item.index, size_in_bytes=data.numel(),
                                           storage_data=ExtentRef(self.rank, name, data.numel(), kind)))
            meta = json.dumps({"format": SHARD_FORMAT, "step": self.step, "rank": self.rank,
                               "world_size": info.world_size})
            engine = self._open(self.rank, info.world_size)
            handle = engine.save(self.step, extents, meta, "zerocopy", extents, "deferred")
            handle.wait()
            if handle.result()["skipped"]:
                raise UsageError(f"{self.run_dir}: step {self.step} is already committed; a step is written once")
        finally:
            self.close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _tensor_bytes(self, planner: SavePlanner, item: WriteItem) -> torch.Tensor:
        td = item.tensor_data
        assert td is not None  # prepare_local_plan checked it
        t = planner.resolve_data(item)
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{item.index.fqn}: the planner resolved a tensor item to a {type(t).__name__}")
        if t.dtype != td.properties.dtype or tuple(t.shape) != tuple(td.chunk.sizes):
            raise UsageError(f"{item.index.fqn}: the planner resolved a {t.dtype} {list(t.shape)} tensor for a "
                             f"{td.properties.dtype} {list(td.chunk.sizes)} chunk")
        return _flat_bytes(t)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, last: commits the step with ``dcp-metadata.json`` (atomic), then applies retention.

        :func:`alpsck._core.commit_step` checks that every rank's shard is durable (its DONE
        record), writes the metadata file and the manifest, renames ``step-N.tmp`` to ``step-N``
        (the commit point) and publishes LATEST.
        """
        storage: dict[MetadataIndex, ExtentRef] = {}
        for rank_results in results:
            for r in rank_results:
                if not isinstance(r.storage_data, ExtentRef):
                    raise UsageError("a write result does not come from AlpsckStorageWriter.write_data")
                storage[r.index] = r.storage_data
        world = self.world_size or len(results)
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        if metadata.version is None:
            from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

            metadata.version = CURRENT_DCP_VERSION
        data = encode_metadata(metadata, step=self.step, world_size=world)
        if len(data) > MAX_METADATA_BYTES:
            raise UsageError(f"the DCP metadata takes {len(data)} bytes as JSON, more than the {MAX_METADATA_BYTES} "
                             "a checkpoint's extra file may hold")
        decode_metadata(data, METADATA_FILE, step=self.step, world_size=world)  # never commit what load would refuse
        lock = _RunDirLock(self.run_dir, 0)
        try:
            _core.commit_step(str(self.run_dir), self.step, world, [(METADATA_FILE, data)], self.commit_timeout_s)
            if self.keep_last:
                warning = _core.retain_newest(str(self.run_dir), self.keep_last)
                if warning:
                    warnings.warn(f"{self.run_dir}: retention: {warning}", RuntimeWarning, stacklevel=2)
        finally:
            lock.close()


# ------------------------------------------------------------------------------ reader


def _read_small(path: Path, limit: int) -> bytes:
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path}: larger than {limit} bytes")
    return data


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


class AlpsckStorageReader(StorageReader):
    """DCP StorageReader for checkpoints written by :class:`AlpsckStorageWriter`, at any world size.

    Args:
        run_dir: the run directory.
        step: the checkpoint to load; None: the newest committed one that has DCP metadata (a newer
            one that fails its checks is skipped with a warning naming what was wrong).
        threads: reader threads per shard (chunks are CRC-checked on them).
        read_batch_bytes: at most this many bytes of extents are read per batch (bounds the
            temporary memory of chunks that cannot be read straight into their destination).
        direct_io: O_DIRECT reads.

    A chunk that fails its CRC raises :class:`CorruptCheckpointError` out of ``dcp.load`` (as
    DCP's CheckpointException); destinations already filled by then keep the new values.
    """

    def __init__(self, run_dir: str | os.PathLike[str], step: int | None = None, *, threads: int = 4,
                 read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES, direct_io: bool = True) -> None:
        super().__init__()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise UsageError(f"step must be None or a non-negative integer, not {step!r}")
        self.run_dir = Path(run_dir)
        self.requested_step = step
        self.threads = threads
        self.read_batch_bytes = read_batch_bytes
        self.direct_io = direct_io
        self.load_id = str(uuid.uuid4())
        self.step: int | None = None          # the step read_metadata picked
        self.path: Path | None = None         # its directory
        self._metadata: Metadata | None = None

    @property
    def checkpoint_id(self) -> str:
        return str(self.path or self.run_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen automatically

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Called by DCP when ``dcp.load(checkpoint_id=...)`` is given: it must be this run directory."""
        if checkpoint_id is not None and Path(checkpoint_id) != self.run_dir:
            raise UsageError(f"checkpoint_id {os.fspath(checkpoint_id)!r}: this reader loads from {self.run_dir}")
        self.load_id = str(uuid.uuid4())
        self.step = self.path = self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """All ranks: picks the checkpoint and returns its validated Metadata (see the class docstring).

        DCP asks again with ``rank=`` after a failure (for its rank-local metadata files); alpsck
        has one global file, so that retry fails at once instead of repeating the search.
        """
        if kwargs.get("rank") is not None:
            raise UsageError(f"alpsck keeps one {METADATA_FILE} per checkpoint, no rank-local metadata")
        if self._metadata is None:
            self._metadata = self._pick()
        md = self._metadata
        md.storage_meta = replace(md.storage_meta or StorageMeta(), load_id=self.load_id)
        return md

    def _pick(self) -> Metadata:
        infos = sorted(_core.scan(str(self.run_dir)), key=lambda i: i["step"], reverse=True)
        if self.requested_step is not None:
            info = next((i for i in infos if i["step"] == self.requested_step), None)
            if info is None:
                raise NoCheckpointError(f"{self.run_dir}: no checkpoint of step {self.requested_step}")
            if info["status"] != "committed":
                raise CorruptCheckpointError(f"{info['path']}: {info['status']}: {info['error']}")
            if METADATA_FILE not in info["extra_files"]:
                raise UsageError(f"{info['path']}: not a DCP checkpoint (no {METADATA_FILE}); one written by "
                                 "alpsck.Checkpointer is restored with Checkpointer.restore at its world size")
            return self._load(info)
        skipped: list[str] = []
        for info in infos:
            if info["status"] == "corrupt":
                skipped.append(f"{info['path']}: {info['error']}")
                continue
            if info["status"] != "committed" or METADATA_FILE not in info["extra_files"]:
                continue
            try:
                md = self._load(info)
            except CorruptCheckpointError as e:  # UnsafeCheckpointError included
                skipped.append(str(e))
                continue
            for why in skipped:
                warnings.warn(f"skipping checkpoint: {why}", RuntimeWarning, stacklevel=4)
            return md
        raise NoCheckpointError(f"{self.run_dir}: no valid DCP checkpoint" +
                                (f" (skipped: {'; '.join(skipped)})" if skipped else ""))

    def _load(self, info: dict[str, Any]) -> Metadata:
        """The Metadata of one committed checkpoint: ``dcp-metadata.json`` checked against the manifest."""
        path = Path(info["path"])
        try:
            manifest = json.loads(_read_small(path / "MANIFEST.json", MAX_METADATA_BYTES))
            entry = next(x for x in manifest["extra"] if x.get("name") == METADATA_FILE)
            want_bytes, want_crc = int(entry["bytes"]), int(entry["crc"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
            raise CorruptCheckpointError(f"{path}/MANIFEST.json: no valid entry for {METADATA_FILE} ({e!r})") from e
        data = _read_small(path / METADATA_FILE, MAX_METADATA_BYTES)
        if len(data) != want_bytes or _core.crc32c(data) != want_crc:
            raise CorruptCheckpointError(f"{path / METADATA_FILE}: size or CRC32C differs from the manifest")
        md = decode_metadata(data, str(path / METADATA_FILE), step=info["step"], world_size=info["ranks"])
        self.step, self.path = int(info["step"]), path
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks: the metadata must be the one this reader's read_metadata returned."""
        if metadata is not self._metadata or self.path is None:
            raise UsageError("AlpsckStorageReader reads only the metadata its own read_metadata() returned")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return replace(plan, storage_data=self.step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank must have picked the same checkpoint (a save may have landed in between)."""
        steps = sorted({p.storage_data for p in plans}, key=str)
        if len(steps) > 1:
            raise UsageError(f"{self.run_dir}: the ranks picked different checkpoints (steps {steps}); pass step= to "
                             "AlpsckStorageReader")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """All ranks: reads what ``plan`` asks for, shard by shard, each shard opened once."""
        md, path = self._metadata, self.path
        if md is None or path is None:
            raise UsageError("read_data before read_metadata")
        storage: dict[MetadataIndex, ExtentRef] = md.storage_data
        by_rank: dict[int, dict[str, list[ReadItem]]] = {}
        refs: dict[str, ExtentRef] = {}
        for req in plan.items:
            ref = storage.get(req.storage_index)
            if ref is None:
                raise CorruptCheckpointError(f"{path}: no stored data for {req.storage_index.fqn!r} at "
                                             f"{req.storage_index.offset}")
            by_rank.setdefault(ref.rank, {}).setdefault(ref.extent, []).append(req)
            refs[f"{ref.rank}/{ref.extent}"] = ref
        for rank in sorted(by_rank):
            shard = path / shard_name(rank)
            reader = _core.ShardReader(str(shard), self.direct_io)
            layout = {name: (offset, size) for name, offset, size in reader.extents}
            wanted = by_rank[rank]
            for name in wanted:
                have = layout.get(name)
                if have is None or have[1] != refs[f"{rank}/{name}"].nbytes:
                    raise CorruptCheckpointError(
                        f"{shard}: extent {name!r} " + ("is missing" if have is None else
                                                        f"has {have[1]} bytes, the metadata says "
                                                        f"{refs[f'{rank}/{name}'].nbytes}"))
            batch: list[tuple[ExtentRef, list[ReadItem]]] = []
            size = 0
            for name in sorted(wanted, key=lambda n: layout[n][0]):
                ref = refs[f"{rank}/{name}"]
                batch.append((ref, wanted[name]))
                size += ref.nbytes
                if size >= self.read_batch_bytes:
                    self._read_batch(reader, shard, batch, planner, md)
                    batch, size = [], 0
            if batch:
                self._read_batch(reader, shard, batch, planner, md)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_batch(self, reader: _core.ShardReader, shard: Path, batch: list[tuple[ExtentRef, list[ReadItem]]],
                    planner: LoadPlanner, md: Metadata) -> None:
        """One read_into call for the batch's extents, then the copies into the destinations and the commits."""
        dsts: list[tuple[str, torch.Tensor]] = []
        direct: list[tuple[ReadItem, torch.Tensor]] = []  # read straight into the destination
        values: list[tuple[ExtentRef, list[ReadItem], torch.Tensor]] = []
        copies: list[tuple[list[ReadItem], torch.Tensor, torch.Tensor | None]] = []  # (reqs, chunk, resolved dest)
        for ref, reqs in batch:
            if ref.kind == "json":
                buf = torch.empty(ref.nbytes, dtype=torch.uint8)
                dsts.append((ref.extent, buf))
                values.append((ref, reqs, buf))
                continue
            tmd = md.state_dict_metadata[reqs[0].storage_index.fqn]
            assert isinstance(tmd, TensorStorageMetadata)  # decode_metadata checked every storage entry
            sizes = tuple(tmd.chunks[self._chunk_index(tmd, reqs[0])].sizes)
            dtype = tmd.properties.dtype
            resolved: torch.Tensor | None = None
            req = reqs[0]
            if len(reqs) == 1 and not any(req.storage_offsets) and tuple(req.lengths) == sizes:
                resolved = planner.resolve_tensor(req).detach()
                if (resolved.device.type == "cpu" and resolved.dtype == dtype and resolved.is_contiguous()
                        and tuple(resolved.shape) == sizes):
                    if ref.nbytes:
                        dsts.append((ref.extent, resolved.reshape(-1).view(torch.uint8)))
                    direct.append((req, resolved))
                    continue
            chunk = torch.empty(sizes, dtype=dtype)
            if ref.nbytes:
                dsts.append((ref.extent, chunk.reshape(-1).view(torch.uint8)))
            copies.append((reqs, chunk, resolved))
        reader.read_into(dsts, self.threads)
        for req, dest in direct:
            planner.commit_tensor(req, dest)
        for reqs, chunk, resolved in copies:
            for req in reqs:
                src = _narrow(chunk, req.storage_offsets, req.lengths)
                dest = resolved if resolved is not None else planner.resolve_tensor(req).detach()
                if dest.shape != src.shape:
                    raise CorruptCheckpointError(f"{shard}: {req.storage_index.fqn!r}: the stored region "
                                                 f"{list(src.shape)} does not fit the destination {list(dest.shape)}")
                dest.copy_(src)
                planner.commit_tensor(req, dest)
        for ref, reqs, buf in values:
            value = _decode_value(buf.numpy().tobytes(), f"{shard}:{ref.extent}")
            pickled = io.BytesIO()
            torch.save(value, pickled)  # made here from plain values decoded from JSON, for planner.load_bytes
            for req in reqs:
                pickled.seek(0)
                planner.load_bytes(req, pickled)

    @staticmethod
    def _chunk_index(tmd: TensorStorageMetadata, req: ReadItem) -> int:
        hint = req.storage_index.index
        if hint is not None and 0 <= hint < len(tmd.chunks) and tmd.chunks[hint].offsets == req.storage_index.offset:
            return hint
        for i, c in enumerate(tmd.chunks):
            if c.offsets == req.storage_index.offset:
                return i
        raise CorruptCheckpointError(f"{req.storage_index.fqn!r}: no chunk at {req.storage_index.offset}")
