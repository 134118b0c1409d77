"""The two file formats ``alpsck export`` writes, streamed (the command: :mod:`alpsck.tools.export`): which
tensors of a checkpoint an export holds (:func:`plan`), read in batches into one reusable buffer
(:func:`stream`), and written as safetensors (:func:`write_safetensors`, the header by hand) or as the zip
archive ``torch.save`` writes (:func:`write_torch`, ``data.pkl`` pickled from stand-ins that reduce exactly
like tensors). torch only inside the functions: the CLI imports the command on login nodes without it."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import pickle
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import UsageError
from ..store.shards import CheckpointShards

if TYPE_CHECKING:
    import torch

    from .. import tree

#: Bytes read per batch (several small tensors share one read_into call, so each chunk is read once).
BATCH_BYTES = 64 << 20

SAFETENSORS_DTYPES: dict[str, str] = {  # tree dtype name (alpsck.tree.dtype_name) -> safetensors code
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "complex64": "C64",
}


class Item:
    """One tensor to export: tree key, spec, byte size (checked against the shard's extent) and its
    name in the file (the tree key, or its path below ``--subtree``)."""

    def __init__(self, key: str, spec: tree.TensorSpec, name: str | None = None) -> None:
        self.key, self.spec, self.nbytes = key, spec, spec.nbytes
        self.name = key if name is None else name


def refs_below(value: Any, path: str = "") -> Iterator[tuple[str, tree.TensorRef]]:
    """(path below the entry, reference) of every tensor in a decoded entry, nested keys joined with ``/``."""
    from .. import tree

    if isinstance(value, tree.TensorRef):
        yield path, value
    elif isinstance(value, dict):
        for k, x in value.items():
            yield from refs_below(x, f"{path}/{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, x in enumerate(value):
            yield from refs_below(x, f"{path}/{i}" if path else str(i))


def plan(shards: CheckpointShards, subtree: str | None = None) -> list[Item]:
    """The checkpoint's tensors (only those under ``subtree``, named below it) in on-disk order
    (sizes were validated by CheckpointShards)."""
    from .. import tree

    order = shards.keys_in_file_order()
    if subtree is None:
        return [Item(key, shards.specs[key]) for key in order]
    entries = tree.decode_refs(shards.meta["tree"])
    if subtree not in entries:
        raise UsageError(f"--subtree {subtree!r}: the checkpoint has no such top-level key; it has "
                         f"{', '.join(map(repr, entries)) or 'none'}")
    names: dict[str, str] = {}  # tree key -> name in the file
    taken: set[str] = set()
    for path, ref in refs_below(entries[subtree][1]):
        name = path or subtree
        if name in taken:  # {"b/c": t1, "b": {"c": t2}}: the tree key's ~N suffix tells them apart
            name = ref.key.removeprefix(f"{subtree}/")
        if ref.key not in names:
            names[ref.key] = name
            taken.add(name)
    if not names:
        with_tensors = [k for k, (_kind, v, _md) in entries.items() if any(True for _ in refs_below(v))]
        raise UsageError(f"--subtree {subtree!r} holds no tensor; keys with tensors: "
                         f"{', '.join(map(repr, with_tensors)) or 'none'}")
    return [Item(key, shards.specs[key], names[key]) for key in order if key in names]


def stream(shards: CheckpointShards, items: list[Item], threads: int,
            batch_bytes: int) -> Iterator[tuple[Item, torch.Tensor]]:
    """Yield (item, uint8 view of its bytes) in order; each view is valid until the next one is asked for.

    Tensors are read in batches of up to ``max(largest, batch_bytes)`` bytes into one buffer.
    """
    import torch

    if not items:
        return
    largest = max(it.nbytes for it in items)
    cap = max(largest, min(batch_bytes, sum(it.nbytes for it in items)), 1)
    buf = torch.empty(cap, dtype=torch.uint8)
    batch: list[tuple[Item, int]] = []
    used = 0

    def flush() -> Iterator[tuple[Item, torch.Tensor]]:
        dsts = [(it.key, buf[off:off + it.nbytes]) for it, off in batch if it.nbytes]
        if dsts:
            shards.read_into(dsts, threads)
        for it, off in batch:
            yield it, buf[off:off + it.nbytes]

    for it in items:
        if batch and used + it.nbytes > cap:
            yield from flush()
            batch, used = [], 0
        batch.append((it, used))
        used += it.nbytes
    yield from flush()


def _write_all(fh: BinaryIO, view: torch.Tensor) -> None:
    if view.numel():
        fh.write(view.numpy().data)


# ----------------------------------------------------------------------------- safetensors


def safetensors_header(items: list[Item], metadata: dict[str, str]) -> bytes:
    from .. import tree

    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for it in items:
        code = SAFETENSORS_DTYPES.get(tree.dtype_name(it.spec.dtype))
        if code is None:
            raise UsageError(f"tensor {it.name!r}: dtype {tree.dtype_name(it.spec.dtype)} has no safetensors code; "
                             "use --format torch")
        if it.name == "__metadata__":
            raise UsageError("a tensor is named '__metadata__', which safetensors reserves; use --format torch")
        header[it.name] = {"dtype": code, "shape": list(it.spec.shape), "data_offsets": [offset, offset + it.nbytes]}
        offset += it.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(fh: BinaryIO, shards: CheckpointShards, items: list[Item], metadata: dict[str, str],
                       threads: int, batch_bytes: int) -> None:
    fh.write(safetensors_header(items, metadata))
    for _it, view in stream(shards, items, threads, batch_bytes):
        _write_all(fh, view)


def write_tensors_safetensors(fh: BinaryIO, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    """Named contiguous CPU tensors already in memory, as one safetensors file (the header as above)."""
    import torch

    from .. import tree

    fh.write(safetensors_header([Item(n, tree.TensorSpec(t.dtype, tuple(t.shape)), n) for n, t in tensors], metadata))
    for _n, t in tensors:
        _write_all(fh, t.reshape(-1).view(torch.uint8))


# ----------------------------------------------------------------------------- torch.save format


class _StorageStub:
    """Stands for a tensor's storage in data.pkl (persistent id; its bytes are written separately)."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly like a contiguous CPU tensor (``Tensor._reduce_ex_internal``) without holding data."""

    def __init__(self, storage: _StorageStub, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        import torch

        stride: list[int] = []
        acc = 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= max(d, 1)
        args: tuple[Any, ...] = (self.storage, 0, tuple(list(self.shape)), tuple(reversed(stride)), False,
                                 collections.OrderedDict())
        if self.storage.dtype in torch.storage._new_dtypes():
            return (torch._utils._rebuild_tensor_v3, (*args, self.storage.dtype))
        return (torch._utils._rebuild_tensor_v2, args)


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:  # same tuples as torch.serialization._save
        if not isinstance(obj, _StorageStub):
            return None
        import torch

        if obj.dtype in torch.storage._new_dtypes():
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.numel * obj.dtype.itemsize)
        name = torch.empty(0, dtype=obj.dtype)._typed_storage()._pickle_storage_type()
        return ("storage", getattr(torch, name), obj.key, "cpu", obj.numel)


def torch_pickle(items: list[Item]) -> bytes:
    stubs = {it.name: _TensorStub(_StorageStub(str(k), it.spec.dtype, it.spec.numel), it.spec.shape)
             for k, it in enumerate(items)}
    out = io.BytesIO()
    _StubPickler(out, protocol=2).dump(stubs)
    return out.getvalue()


def write_torch(fh: BinaryIO, shards: CheckpointShards, items: list[Item], threads: int, batch_bytes: int) -> None:
    import torch
    from torch import serialization

    get_crc = getattr(serialization, "get_crc32_options", lambda: True)
    get_align = getattr(serialization, "_get_storage_alignment", lambda: 64)
    writer = torch._C.PyTorchFileWriter(fh, get_crc(), get_align())
    finished = False
    try:
        data = torch_pickle(items)
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", b"1", 1)
        alignment = str(get_align()).encode()
        writer.write_record(".storage_alignment", alignment, len(alignment))
        byteorder = sys.byteorder.encode()
        writer.write_record("byteorder", byteorder, len(byteorder))
        for k, (_it, view) in enumerate(stream(shards, items, threads, batch_bytes)):
            n = view.numel()
            if n:  # a storage aliasing exactly these bytes of the buffer (no copy)
                storage = torch.frombuffer(view.numpy().data, dtype=torch.uint8).untyped_storage()
                writer.write_record(f"data/{k}", storage, n)  # type: ignore[arg-type]  # torch's stub omits UntypedStorage
                del storage
            else:
                writer.write_record(f"data/{k}", b"", 0)
        writer.write_end_of_file()
        finished = True
    finally:
        if not finished:  # finalize while fh is open (the writer would otherwise do it in its destructor)
            with contextlib.suppress(Exception):
                writer.write_end_of_file()
        del writer
