"""The tagged-JSON codec of a checkpoint's non-tensor state, and the tensor references in it.

A checkpoint's state tree is JSON: every value that is not a tensor, encoded here, with tensors
replaced by references (:class:`TensorRef`, :class:`TensorSpec`). :mod:`alpsck.capture` builds a
tree from a live state; :func:`tensor_specs` reads the tensor list back out of one, validated, so
a reader knows what to allocate; :mod:`alpsck.fit` checks a tree against a live state and loads it.

Encoding of non-tensor values (tagged JSON; ``"__t"`` is the reserved tag key):

* ``None``, ``bool``, ``str``, ints within int64 and finite floats: as themselves; lists as lists.
* dicts whose keys are all ``str`` and which hold no ``"__t"`` key: JSON objects. Any other dict
  (int keys as in optimizer state, or a ``"__t"`` key): ``{"__t": "dict", "items": [[k, v], ...]}``.
* ``tuple`` (also ``torch.Size`` and named tuples, which come back as plain tuples):
  ``{"__t": "tuple", "items": [...]}``; ``bytes``: ``{"__t": "bytes", "b64": ...}``;
  NaN/±inf: ``{"__t": "float", "v": "nan" | "inf" | "-inf"}``; ints outside int64:
  ``{"__t": "bigint", "v": "<decimal>"}``; ``torch.dtype``: ``{"__t": "dtype", "v": "bfloat16"}``;
  ``torch.device``: ``{"__t": "device", "v": "cuda:0"}``.
* numpy scalars become the Python scalar; numpy arrays become (nested) lists and come back as
  lists (keep big arrays as tensors instead).
* tensors: ``{"__t": "tensor", "key": "<path>", "dtype": "bfloat16", "shape": [...]}``; the path
  is the state key and the nested keys joined with ``/`` (``"model/layers.0.attention.wq.weight"``,
  ``"optim/state/0/exp_avg"``), made unique with a ``~N`` suffix if two paths collide. A tensor
  reachable twice is stored twice.

Decoding accepts only these tags. It never imports or instantiates anything named by the data:
an unknown tag raises :class:`UnsafeCheckpointError`, a malformed entry
:class:`CorruptCheckpointError`, both naming the path.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from alpsck.errors import CorruptCheckpointError, StateTypeError, UnsafeCheckpointError, UsageError

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is optional
    np = None  # type: ignore[assignment]

TREE_FORMAT = "alpsck.tree"
TREE_VERSION = 1
TAG = "__t"
MAX_ELEMENTS = 2**48
MAX_DIMS = 64
MAX_DEPTH = 200
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

#: Tensor dtypes a checkpoint may hold (the names are those used in the tree).
TENSOR_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
TENSOR_DTYPE_NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}
# torch.dtype *values* (not tensors): a fixed table built once from torch's own namespace.
_VALUE_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_FLOAT_SPECIALS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_BIGINT_RE = re.compile(r"-?[0-9]{1,4000}")
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,5})?")
_TAG_FIELDS: dict[str, frozenset[str]] = {
    "dict": frozenset({"items"}),
    "tuple": frozenset({"items"}),
    "bytes": frozenset({"b64"}),
    "bytesio": frozenset({"b64"}),  # an io.BytesIO (DCP trainers keep train state in them): its bytes
    "float": frozenset({"v"}),
    "bigint": frozenset({"v"}),
    "dtype": frozenset({"v"}),
    "device": frozenset({"v"}),
    "tensor": frozenset({"key", "dtype", "shape"}),
}
_KINDS = ("module", "tensor", "stateful", "value")


def check_tag_fields(node: Mapping[str, Any], tag: str, fields: frozenset[str], path: str) -> None:
    """CorruptCheckpointError unless the tagged node holds exactly ``fields`` besides its tag (for
    this module's tags and those a subclass of :class:`Decoder` adds)."""
    if set(node) != fields | {TAG}:
        raise CorruptCheckpointError(f"{path}: tag {tag!r} needs fields {sorted(fields)}, got {sorted(map(str, node))}")


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a checkpoint's tree, described without reading its bytes.

    What :func:`alpsck.peek` returns in place of each tensor. ``key`` is its name in the checkpoint
    (the state key and nested keys joined with ``/``, as ``alpsck export`` names it), ``dtype`` a
    ``torch.dtype``, ``shape`` a tuple of ints.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.dtype, self.shape)

    @property
    def numel(self) -> int:
        return self.spec.numel

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def __repr__(self) -> str:
        return f"TensorRef({self.key!r}, {TENSOR_DTYPE_NAMES.get(self.dtype, str(self.dtype))}, {list(self.shape)})"


class TensorSpec(NamedTuple):
    """What a tree says about one tensor: enough to allocate it before reading its bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """The tree name of a checkpointable tensor dtype; StateTypeError if it is not allowed."""
    try:
        return TENSOR_DTYPE_NAMES[dtype]
    except KeyError:
        raise StateTypeError(f"tensor dtype {dtype} cannot be checkpointed") from None


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no DTensor
        return None
    return DTensor


_PLAIN_TENSOR_TYPES = (torch.Tensor, nn.Parameter)  # exact types that cannot be a DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    if type(t) in _PLAIN_TENSOR_TYPES:  # the common case, without the import machinery per tensor
        return False
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with conjugate/negative views resolved and contiguous (no copy if it already is)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of the bytes of :func:`plain` ``(t)`` on the CPU (a copy only for other devices or views)."""
    return plain(t.cpu() if t.device.type != "cpu" else t).reshape(-1).view(torch.uint8)


# ----------------------------------------------------------------------------------- encoding


class Encoder:
    """Encodes values into tagged JSON, collecting tensors into ``self.tensors``."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        if _is_dtensor(t):
            raise StateTypeError(f"{path}: a DTensor (FSDP2 / tensor-parallel sharded state): save it per shard with "
                            "torch.distributed.checkpoint through alpsck.dcp.AlpsckStorageWriter, which also reshards "
                            "on load; the Checkpointer's tree holds plain (replicated or per-rank) tensors")
        if t.is_nested:
            raise StateTypeError(f"{path}: cannot checkpoint a nested tensor: save its components "
                                 "(t.unbind()) or its values and offsets")
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise StateTypeError(f"{path}: cannot checkpoint a {t.layout} / {t.device.type} tensor")
        name = TENSOR_DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise StateTypeError(f"{path}: tensor dtype {t.dtype} cannot be checkpointed")
        t = plain(t)
        key, n = path, 1
        while key in self.tensors:
            n += 1
            key = f"{path}~{n}"
        self.tensors[key] = t
        return {TAG: "tensor", "key": key, "dtype": name, "shape": list(t.shape)}

    def value(self, v: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise UsageError(f"{path}: nested more than {MAX_DEPTH} levels (a cycle?)")
        # Fast paths for the exact types a training state is made of (a save walks ~1000 nodes on
        # the critical path); subclasses and everything else take the general chain below, which
        # gives the same result for these types.
        tv = type(v)
        if tv is str:
            return v
        if tv is dict:
            if TAG not in v and _all_str(v):
                return {k: self.value(x, f"{path}/{k}", depth + 1) for k, x in v.items()}
        elif tv in _PLAIN_TENSOR_TYPES:
            return self.tensor(v, path)
        elif tv is float and math.isfinite(v):
            return v
        elif tv is int and _INT64_MIN <= v <= _INT64_MAX:
            return v
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):
            v = int(v)
            return v if _INT64_MIN <= v <= _INT64_MAX else {TAG: "bigint", "v": str(v)}
        if isinstance(v, float):
            v = float(v)
            if math.isfinite(v):
                return v
            return {TAG: "float", "v": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, str):
            return str(v)
        if isinstance(v, torch.Tensor):
            return self.tensor(v, path)
        if isinstance(v, (bytes, bytearray, memoryview)):
            return {TAG: "bytes", "b64": base64.b64encode(bytes(v)).decode("ascii")}
        if isinstance(v, io.BytesIO):  # its whole buffer; it comes back as a new BytesIO at position 0
            return {TAG: "bytesio", "b64": base64.b64encode(v.getbuffer()).decode("ascii")}
        if isinstance(v, torch.dtype):
            return {TAG: "dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {TAG: "device", "v": str(v)}
        if isinstance(v, Mapping):
            if TAG not in v and _all_str(v):
                return {str(k): self.value(x, f"{path}/{k}", depth + 1) for k, x in v.items()}
            items = [[self.value(k, f"{path}/{k}", depth + 1), self.value(x, f"{path}/{k}", depth + 1)]
                     for k, x in v.items()]
            return {TAG: "dict", "items": items}
        if isinstance(v, tuple):
            return {TAG: "tuple", "items": [self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]
        if np is not None and isinstance(v, np.generic):
            return self.value(v.item(), path, depth + 1)
        if np is not None and isinstance(v, np.ndarray):
            return self.value(v.tolist(), path, depth + 1)
        raise StateTypeError(f"{path}: cannot checkpoint a value of type {type(v).__module__}.{type(v).__qualname__}")


def _all_str(keys: Any) -> bool:
    for k in keys:
        if not isinstance(k, str):
            return False
    return True


# ----------------------------------------------------------------------------------- decoding

Resolve = Callable[[str, TensorSpec, str], Any]


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


class Decoder:
    """Decodes tagged JSON; tensor references are handed to ``resolve(key, spec, path)``."""

    def __init__(self, resolve: Resolve) -> None:
        self.resolve = resolve

    def value(self, node: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise CorruptCheckpointError(f"{path}: tree nested more than {MAX_DEPTH} levels")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(node)]
        if isinstance(node, Mapping):
            if TAG in node:
                return self.tagged(node, path, depth)
            out: dict[str, Any] = {}
            for k, x in node.items():
                if not isinstance(k, str):
                    raise CorruptCheckpointError(f"{path}: object key {_short(k)} is not a string")
                out[k] = self.value(x, f"{path}/{k}", depth + 1)
            return out
        raise CorruptCheckpointError(f"{path}: {type(node).__name__} is not a JSON value")

    def tagged(self, node: Mapping[str, Any], path: str, depth: int) -> Any:
        tag = node[TAG]
        if not isinstance(tag, str) or tag not in _TAG_FIELDS:
            raise UnsafeCheckpointError(f"{path}: unknown tag {_short(tag)}; refusing to decode it")
        check_tag_fields(node, tag, _TAG_FIELDS[tag], path)
        if tag in ("tuple", "dict"):
            items = node["items"]
            if not isinstance(items, list):
                raise CorruptCheckpointError(f"{path}: {tag} items must be a list")
            if tag == "tuple":
                return tuple(self.value(x, f"{path}/{i}", depth + 1) for i, x in enumerate(items))
            out: dict[Any, Any] = {}
            for item in items:
                if not isinstance(item, list) or len(item) != 2:
                    raise CorruptCheckpointError(f"{path}: dict item {_short(item)} is not a [key, value] pair")
                k = self.value(item[0], f"{path}/<key>", depth + 1)
                try:
                    hash(k)
                except TypeError:
                    raise CorruptCheckpointError(f"{path}: dict key {_short(k)} is not hashable") from None
                out[k] = self.value(item[1], f"{path}/{k}", depth + 1)
            return out
        if tag == "tensor":
            return self.tensor(node, path)
        v = node["b64"] if tag in ("bytes", "bytesio") else node["v"]
        if not isinstance(v, str):
            raise CorruptCheckpointError(f"{path}: {tag} value must be a string, got {_short(v)}")
        if tag in ("bytes", "bytesio"):
            try:
                raw = base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise CorruptCheckpointError(f"{path}: invalid base64") from None
            return raw if tag == "bytes" else io.BytesIO(raw)
        if tag == "float" and v in _FLOAT_SPECIALS:
            return _FLOAT_SPECIALS[v]
        if tag == "bigint" and _BIGINT_RE.fullmatch(v):
            return int(v)
        if tag == "dtype" and v in _VALUE_DTYPES:
            return _VALUE_DTYPES[v]
        if tag == "device" and _DEVICE_RE.fullmatch(v):
            try:
                return torch.device(v)
            except RuntimeError:
                pass
        raise CorruptCheckpointError(f"{path}: invalid {tag} value {_short(v)}")

    def tensor(self, node: Mapping[str, Any], path: str) -> Any:
        key, dtype, shape = node["key"], node["dtype"], node["shape"]
        if not isinstance(key, str) or not key:
            raise CorruptCheckpointError(f"{path}: tensor key must be a non-empty string")
        if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
            raise UnsafeCheckpointError(f"{path}: tensor dtype {_short(dtype)} is not allowed")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise CorruptCheckpointError(f"{path}: invalid tensor shape {_short(shape)}")
        if math.prod(shape) > MAX_ELEMENTS:
            raise CorruptCheckpointError(f"{path}: tensor shape {shape} exceeds {MAX_ELEMENTS} elements")
        return self.resolve(key, TensorSpec(TENSOR_DTYPES[dtype], tuple(shape)), path)


def entries(tree: Mapping[str, Any]) -> dict[str, tuple[str, Any, Any]]:
    """Validate the tree's envelope; returns key -> (kind, encoded value, encoded metadata)."""
    if not isinstance(tree, Mapping):
        raise CorruptCheckpointError("tree: not a JSON object")
    if tree.get("format") != TREE_FORMAT or tree.get("version") != TREE_VERSION:
        raise CorruptCheckpointError(
            f"tree: format {_short(tree.get('format'))} version {_short(tree.get('version'))} is not "
            f"{TREE_FORMAT!r} version {TREE_VERSION}")
    entries = tree.get("entries")
    if not isinstance(entries, Mapping):
        raise CorruptCheckpointError("tree: 'entries' is not an object")
    out: dict[str, tuple[str, Any, Any]] = {}
    for key, entry in entries.items():
        if not isinstance(entry, Mapping) or entry.get("kind") not in _KINDS or "value" not in entry:
            raise CorruptCheckpointError(f"{key}: malformed tree entry")
        metadata = entry.get("metadata")
        if metadata is not None and entry["kind"] != "module":
            raise CorruptCheckpointError(f"{key}: metadata on a non-module entry")
        out[str(key)] = (entry["kind"], entry["value"], metadata)
    return out


def tensor_specs(tree: Mapping[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor the tree references, key -> :class:`TensorSpec`, after validating the whole tree.

    Raises :class:`UnsafeCheckpointError` / :class:`CorruptCheckpointError` naming the path.
    """
    specs: dict[str, TensorSpec] = {}

    def record(key: str, spec: TensorSpec, path: str) -> None:
        if specs.setdefault(key, spec) != spec:
            raise CorruptCheckpointError(f"{path}: tensor key {key!r} appears twice with different specs")

    dec = Decoder(record)
    for key, (_kind, value, metadata) in entries(tree).items():
        dec.value(value, key)
        if metadata is not None:
            dec.value(metadata, f"{key}/_metadata")
    return specs


def decode_refs(tree: Mapping[str, Any]) -> dict[str, tuple[str, Any, Any]]:
    """The tree's entries decoded with every tensor as a :class:`TensorRef` (no tensor byte is needed).

    Returns key -> (kind, value, module ``_metadata`` or None), kind one of ``"module"`` (value: the
    state_dict as a dict), ``"tensor"``, ``"stateful"`` (value: its state_dict) or ``"value"``.
    Validates as :func:`tensor_specs` does (:class:`UnsafeCheckpointError` /
    :class:`CorruptCheckpointError` naming the path) and never imports or unpickles anything.
    """
    return decode(tree, as_tensor_ref)


def as_tensor_ref(key: str, spec: TensorSpec, path: str) -> TensorRef:
    return TensorRef(key, spec.dtype, spec.shape)


def decode(tree: Mapping[str, Any], resolve: Resolve) -> dict[str, tuple[str, Any, Any]]:
    """The tree's entries decoded, each tensor reference handed to ``resolve(key, spec, path)``."""
    dec = Decoder(resolve)
    decoded: dict[str, tuple[str, Any, Any]] = {}
    for key, (kind, value, metadata) in entries(tree).items():
        md = dec.value(metadata, f"{key}/_metadata") if metadata is not None else None
        if md is not None and not isinstance(md, dict):
            raise CorruptCheckpointError(f"{key}/_metadata: not a dict")
        decoded[key] = (kind, dec.value(value, key), md)
    return decoded
