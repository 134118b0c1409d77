"""Non-tensor values as tagged JSON, beyond :mod:`alpsck.tree`'s: one value as an ``alpsck-dcp-value/1``
document (:func:`encode_value` / :func:`decode_value`). The value encoder adds to the tree's tags NumPy
arrays and scalars (their dtype and bytes), sets and frozensets, named tuples, ``torch.Size``, complex
numbers and tensors inside a value (inline): what DCP's FileSystemWriter would pickle of such values.
Decoding knows only these tags and the tree's, and never instantiates a class named by data.

Below the checkpointer and the DCP backend (the store layer), beside :mod:`alpsck.tree`: the DCP
backend stores each of its non-tensor values through it. Pure functions, no I/O, safe on any thread.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import json
import keyword
import math
from collections.abc import Mapping
from typing import Any

import torch

from .. import tree
from ..errors import CorruptCheckpointError, StateTypeError, UnsafeCheckpointError, UsageError
from ..tree import np

__all__ = ["MAX_VALUE_BYTES", "NUMPY_DTYPES", "VALUE_FORMAT", "ValueDecoder", "ValueEncoder", "decode_value", "encode_value",
           "namedtuple_class", "no_tensor"]

VALUE_FORMAT = "alpsck-dcp-value/1"      # one non-tensor value, tagged JSON
MAX_VALUE_BYTES = 64 << 20               # one non-tensor value


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


def encode_value(obj: Any, fqn: str) -> bytes:
    """One non-tensor value (a DCP BYTE_IO item) as an alpsck-dcp-value/1 document of tagged JSON.

    UsageError when JSON cannot hold it (a custom class, a set) or when it holds tensors.
    """
    enc = ValueEncoder()
    try:
        value = enc.value(obj, fqn)
    except (TypeError, ValueError) as e:
        raise UsageError(
            f"{e}. alpsck stores non-tensor values as JSON, never as pickles: keep such state in "
            "alpsck.Checkpointer's state tree, or convert it to plain values (numbers, strings, lists, dicts, tuples, "
            "bytes)") from None
    data = json.dumps({"format": VALUE_FORMAT, "value": value}, allow_nan=False, separators=(",", ":")).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise UsageError(f"{fqn}: the value takes {len(data)} bytes as JSON, more than {MAX_VALUE_BYTES}; store big "
                         "data as tensors")
    return data


def decode_value(data: bytes, where: str) -> Any:
    """A non-tensor value back from its JSON; only :mod:`alpsck.tree`'s tags are accepted."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(doc, dict) or set(doc) != {"format", "value"} or doc["format"] != VALUE_FORMAT:
        raise UnsafeCheckpointError(f"{where}: not an {VALUE_FORMAT} document; refusing to load it")

    return ValueDecoder(no_tensor).value(doc["value"], where)


def no_tensor(key: str, spec: tree.TensorSpec, path: str) -> Any:
    raise UnsafeCheckpointError(f"{path}: a tensor reference inside a non-tensor value; refusing to load it")


# NumPy dtypes a value may hold (stored little-endian); object, string and structured arrays are refused.
NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64", "complex64", "complex128")
_VALUE_TAGS: dict[str, frozenset[str]] = {  # the tags of non-tensor values beyond alpsck.tree's
    "ndarray": frozenset({"dtype", "shape", "b64"}),  # a NumPy array: its dtype, shape and C-order bytes
    "npscalar": frozenset({"dtype", "b64"}),          # a NumPy scalar (np.float64(2.5)): its dtype and bytes
    "set": frozenset({"items"}),
    "frozenset": frozenset({"items"}),
    "namedtuple": frozenset({"name", "fields", "items"}),  # a named tuple: its class's name, its fields, its items
    "vtensor": frozenset({"dtype", "shape", "b64"}),  # a tensor inside a non-tensor value: its dtype, shape, bytes
    "size": frozenset({"items"}),  # a torch.Size: its ints
    "complex": frozenset({"re", "im"}),  # a Python complex number: its parts, as floats are encoded
}
MAX_FIELDS = 1024


@functools.lru_cache(maxsize=256)
def namedtuple_class(name: str, fields: tuple[str, ...]) -> type:
    """A named-tuple class of that name and those fields, made here (never imported: a checkpoint names no
    code to run). DCP's load planner turns the live named tuples into plain tuples before the storage
    reads (``_init_state_dict``), so the live class is not there to restore into; this one has the same
    name, fields and equality."""
    return collections.namedtuple(name, fields, module=__name__)  # type: ignore[misc]


class ValueEncoder(tree.Encoder):
    """alpsck.tree's encoder, plus NumPy arrays and scalars (kept as their dtype and bytes, so they come
    back as what they were), sets and frozensets, named tuples, and tensors inside a value (a tuple
    holding a tensor: one opaque value to DCP), inline: what FileSystemWriter's pickle keeps of such values."""

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        name = tree.TENSOR_DTYPE_NAMES.get(t.dtype)
        if (name is None or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided
                or t.is_nested or t.is_quantized or t.device.type == "meta"):
            raise StateTypeError(f"{path}: a {type(t).__name__} ({t.dtype}, {t.layout}, {t.device.type}) inside a "
                                 "non-tensor value cannot be stored: plain strided tensors of the checkpoint dtypes only")
        raw = tree.flat_bytes(t.detach().cpu()).numpy().tobytes()
        return {tree.TAG: "vtensor", "dtype": name, "shape": list(t.shape), "b64": base64.b64encode(raw).decode("ascii")}

    def value(self, v: Any, path: str, depth: int = 0) -> Any:
        if np is not None and isinstance(v, (np.ndarray, np.generic)):
            name = v.dtype.name
            if name not in NUMPY_DTYPES or v.dtype.byteorder not in "=<|":
                raise StateTypeError(f"{path}: cannot checkpoint a NumPy value of dtype {v.dtype} "
                                          f"(allowed: {', '.join(NUMPY_DTYPES)})")
            arr = np.ascontiguousarray(v)
            raw = base64.b64encode(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()).decode("ascii")
            if isinstance(v, np.generic):
                return {tree.TAG: "npscalar", "dtype": name, "b64": raw}
            return {tree.TAG: "ndarray", "dtype": name, "shape": list(arr.shape), "b64": raw}
        if isinstance(v, torch.Size):
            return {tree.TAG: "size", "items": [int(d) for d in v]}
        if isinstance(v, complex):
            return {tree.TAG: "complex", "re": self.value(v.real, path, depth + 1), "im": self.value(v.imag, path, depth + 1)}
        fields = getattr(type(v), "_fields", None) if isinstance(v, tuple) and type(v) is not tuple else None
        if isinstance(fields, tuple):
            return {tree.TAG: "namedtuple", "name": type(v).__name__, "fields": list(fields),
                    "items": [self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, (set, frozenset)):
            items = [self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]
            items.sort(key=lambda x: json.dumps(x, sort_keys=True))  # the same set, the same document
            return {tree.TAG: "frozenset" if isinstance(v, frozenset) else "set", "items": items}
        return super().value(v, path, depth)


def _vtensor(node: Mapping[str, Any], path: str) -> torch.Tensor:
    """A tensor stored inside a non-tensor value, as a new CPU tensor (checked: dtype, shape, byte count)."""
    dtype, shape, raw = node["dtype"], node["shape"], node["b64"]
    if not isinstance(dtype, str) or dtype not in tree.TENSOR_DTYPES:
        raise UnsafeCheckpointError(f"{path}: tensor dtype {_short(dtype)} is not allowed; refusing to load it")
    if (not isinstance(shape, list) or len(shape) > tree.MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise CorruptCheckpointError(f"{path}: invalid tensor shape {_short(shape)}")
    t = torch.empty(shape, dtype=tree.TENSOR_DTYPES[dtype])
    try:
        data = base64.b64decode(raw, validate=True) if isinstance(raw, str) else None
    except (binascii.Error, ValueError):
        data = None
    if data is None or len(data) != t.numel() * t.element_size():
        raise CorruptCheckpointError(f"{path}: the tensor's bytes do not match its dtype and shape")
    if data:
        t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return t


def _identifier(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 200 and v.isidentifier() and not keyword.iskeyword(v)


class ValueDecoder(tree.Decoder):
    """alpsck.tree's decoder, plus :class:`ValueEncoder`'s tags; never instantiates a class named by data."""

    def tagged(self, node: Mapping[str, Any], path: str, depth: int) -> Any:
        tag = node[tree.TAG]
        if not isinstance(tag, str) or tag not in _VALUE_TAGS:
            return super().tagged(node, path, depth)
        tree.check_tag_fields(node, tag, _VALUE_TAGS[tag], path)
        if tag in ("set", "frozenset"):
            items = node["items"]
            if not isinstance(items, list):
                raise CorruptCheckpointError(f"{path}: {tag} items must be a list")
            out = [self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(items)]
            try:
                return set(out) if tag == "set" else frozenset(out)
            except TypeError:
                raise CorruptCheckpointError(f"{path}: a {tag} item is not hashable") from None
        if tag == "namedtuple":
            name, fields, items = node["name"], node["fields"], node["items"]
            if (not _identifier(name) or not isinstance(fields, list) or not isinstance(items, list)
                    or len(fields) != len(items) or len(fields) > MAX_FIELDS or not all(map(_identifier, fields))
                    or len(set(fields)) != len(fields) or any(f.startswith("_") for f in fields)):
                raise CorruptCheckpointError(f"{path}: invalid named tuple {_short(name)} {_short(fields)}")
            cls = namedtuple_class(name, tuple(fields))
            return cls(*(self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(items)))
        if tag == "vtensor":
            return _vtensor(node, path)
        if tag == "size":
            dims = node["items"]
            if (not isinstance(dims, list) or len(dims) > tree.MAX_DIMS
                    or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= tree.MAX_ELEMENTS for d in dims)):
                raise CorruptCheckpointError(f"{path}: invalid torch.Size {_short(dims)}")
            return torch.Size(dims)
        if tag == "complex":
            re_, im = (self.value(node[k], f"{path}/{k}", depth + 1) for k in ("re", "im"))
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (re_, im)):
                raise CorruptCheckpointError(f"{path}: invalid complex parts {_short(re_)}, {_short(im)}")
            return complex(re_, im)
        if np is None:
            raise CorruptCheckpointError(f"{path}: a NumPy value, and NumPy is not installed")
        dtype, raw = node["dtype"], node["b64"]
        if not isinstance(dtype, str) or dtype not in NUMPY_DTYPES:
            raise UnsafeCheckpointError(f"{path}: NumPy dtype {_short(dtype)} is not allowed; refusing to load it")
        shape = [] if tag == "npscalar" else node["shape"]
        if (not isinstance(shape, list) or len(shape) > tree.MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise CorruptCheckpointError(f"{path}: invalid NumPy shape {_short(shape)}")
        try:
            data = base64.b64decode(raw, validate=True) if isinstance(raw, str) else None
        except (binascii.Error, ValueError):
            data = None
        want = np.dtype(dtype).newbyteorder("<")
        if data is None or len(data) != math.prod(shape) * want.itemsize:
            raise CorruptCheckpointError(f"{path}: the {tag}'s bytes do not match its dtype and shape")
        arr = np.frombuffer(data, dtype=want).astype(np.dtype(dtype)).reshape(shape)  # a writable copy, native order
        return arr[()] if tag == "npscalar" else arr

