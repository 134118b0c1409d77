"""Turn a training-state mapping into tensors plus a JSON-safe tree, and back.

This is the contract every checkpointer relies on: :func:`capture` splits the state into a flat
``key -> tensor`` dict (the bytes a checkpointer writes) and a JSON tree (everything else, with
tensors replaced by references). :func:`tensor_specs` reads the tensor list back out of a tree,
validated, so a reader knows what to allocate; :func:`apply` loads tree + tensors into the live
objects.

Call order. Save: ``capture(state)`` on the training thread, between optimizer steps (the
returned tensors are the LIVE tensors, so copy them before the next step changes them), then
``json.dumps(captured.tree, allow_nan=False)``. Restore: ``json.loads`` → ``tensor_specs(tree)``
→ read the tensors → ``apply(state, tree, tensors)``. Nothing here keeps global state; the
functions may run on any thread, but never concurrently with the training step that owns
``state``.

State values (top-level entries) and how they are restored:

* ``nn.Module``: its ``state_dict()``; restored with ``load_state_dict(strict=True)`` after every
  tensor was checked against the live one (keys, shapes, dtypes → :class:`StateMismatchError`).
* ``torch.Tensor``: restored in place with ``copy_`` (any device); shape/dtype must match.
* anything with ``state_dict()``/``load_state_dict()`` (optimizer, LR scheduler,
  :class:`alpsck.rng.RNGState`, loaders): restored with ``load_state_dict(decoded)``.
* plain values: restored by replacing the entry, ``state[key] = value``, after checking the saved
  value against the live one (:func:`apply`, "Plain values" below).

Plain values (top-level entries that are neither modules, tensors nor stateful, and everything
nested in them) are checked against the live value at the same path, recursively, then replaced:

* a number (``bool``/``int``/``float``) and a 0-d tensor convert both ways: a saved 0-d tensor
  restored where the live value is a number becomes ``tensor.item()`` (an ``int`` for integer
  dtypes, a ``bool`` for ``torch.bool``); a saved number restored where the live value is a 0-d
  tensor is written into that tensor with ``fill_`` (in place, on its device, in its dtype) and
  the tensor stays. This also holds between a top-level tensor entry and a top-level number.
* ``None`` on either side matches anything (a value not set yet, or no longer set).
* a dict matches a dict (keys both have are checked; the saved keys are what is restored), a
  list or tuple matches a list or tuple (elements both have are checked), a tensor matches a
  tensor of any shape (replaced by the saved one, as before), and a leaf matches a leaf of its
  own kind (number, ``str``, ``bytes``, ``torch.dtype``, ``torch.device``).
* anything else (a dict where the live value is a number, a 1-d tensor where it is a number, a
  number where it is a 1-d tensor, ...) raises :class:`StateMismatchError` naming the path.

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
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from alpsck.errors import (
    CorruptCheckpointError,
    StateMismatchError,
    StateTypeError,
    UnsafeCheckpointError,
    UsageError,
)

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
    "bool": torch.bool,
    "complex64": torch.complex64,
}
_TENSOR_DTYPE_NAMES = {dtype: name for name, dtype in TENSOR_DTYPES.items()}
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
        return f"TensorRef({self.key!r}, {_TENSOR_DTYPE_NAMES.get(self.dtype, str(self.dtype))}, {list(self.shape)})"


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


@dataclass
class Captured:
    """Result of :func:`capture`.

    ``tensors`` maps key -> the live tensor (detached; a contiguous copy only if it was not
    contiguous); ``tree`` is JSON-able with ``json.dumps(tree, allow_nan=False)``.
    """

    tensors: dict[str, torch.Tensor]
    tree: dict[str, Any]


def dtype_name(dtype: torch.dtype) -> str:
    """The tree name of a checkpointable tensor dtype; StateTypeError if it is not allowed."""
    try:
        return _TENSOR_DTYPE_NAMES[dtype]
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


def _kind_of(value: Any) -> str:
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "stateful"
    return "value"


# ----------------------------------------------------------------------------------- encoding


class _Encoder:
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
        name = _TENSOR_DTYPE_NAMES.get(t.dtype)
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


def capture(state: Mapping[str, Any]) -> Captured:
    """Split ``state`` into live tensors and a JSON-safe tree. StateTypeError names an unsupported path.

    Runs ``state_dict()`` of every stateful entry; call it between training steps on the thread
    that owns the state.
    """
    enc = _Encoder()
    entries: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key:
            raise StateTypeError(f"state keys must be non-empty str, got {key!r}")
        kind = _kind_of(obj)
        entry: dict[str, Any] = {"kind": kind}
        if kind == "module":
            sd = obj.state_dict()
            entry["value"] = enc.value(dict(sd), key)
            metadata = getattr(sd, "_metadata", None)
            entry["metadata"] = enc.value(dict(metadata), f"{key}/_metadata") if metadata else None
        elif kind == "tensor":
            entry["value"] = enc.tensor(obj, key)
        elif kind == "stateful":
            entry["value"] = enc.value(obj.state_dict(), key)
        else:
            entry["value"] = enc.value(obj, key)
        entries[key] = entry
    return Captured(enc.tensors, {"format": TREE_FORMAT, "version": TREE_VERSION, "entries": entries})


# ----------------------------------------------------------------------------------- decoding

_Resolve = Callable[[str, TensorSpec, str], Any]


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 80 else r[:77] + "..."


class _Decoder:
    """Decodes tagged JSON; tensor references are handed to ``resolve(key, spec, path)``."""

    def __init__(self, resolve: _Resolve) -> None:
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
        if set(node) != _TAG_FIELDS[tag] | {TAG}:
            raise CorruptCheckpointError(
                f"{path}: tag {tag!r} needs fields {sorted(_TAG_FIELDS[tag])}, got {sorted(map(str, node))}")
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


def _entries(tree: Mapping[str, Any]) -> dict[str, tuple[str, Any, Any]]:
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

    dec = _Decoder(record)
    for key, (_kind, value, metadata) in _entries(tree).items():
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
    return _decode(tree, _ref)


def _ref(key: str, spec: TensorSpec, path: str) -> TensorRef:
    return TensorRef(key, spec.dtype, spec.shape)


def _spec_of(t: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """(dtype, shape) of a tensor or a TensorRef; None for anything else."""
    if isinstance(t, torch.Tensor):
        return t.dtype, tuple(t.shape)
    if isinstance(t, TensorRef):
        return t.dtype, t.shape
    return None


def _describe(t: Any) -> str:
    spec = _spec_of(t)
    if spec is not None:
        return f"{_TENSOR_DTYPE_NAMES.get(spec[0], str(spec[0]))} {list(spec[1])}"
    return "None" if t is None else type(t).__name__


def _check_tensor(name: str, saved: Any, live: Any, what: str) -> None:
    s, v = _spec_of(saved), _spec_of(live)
    if s != v:
        raise StateMismatchError(f"{name}: checkpoint has {_describe(saved)}, {what} has {_describe(live)}")


def _check_module(key: str, live: Mapping[str, Any], saved: Any) -> None:
    """``live``: the live module's state_dict (tensors, or TensorRefs of a :func:`skeleton`)."""
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(f"{key}: module state is not a dict")
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise StateMismatchError(
            f"{key}: module state keys differ; missing from checkpoint: {missing[:10]}, "
            f"not in live module: {unexpected[:10]}")
    for name, value in saved.items():
        _check_tensor(f"{key}/{name}", value, live[name], "live module")


# ----------------------------------------------------------------------------------- plain values


def _value_class(v: Any) -> str:
    """What a plain value is, for the checks of the module docstring's "Plain values"."""
    if np is not None and (isinstance(v, np.generic) or (isinstance(v, np.ndarray) and v.ndim == 0)):
        v = v.item()
    if v is None:
        return "None"
    if isinstance(v, (bool, int, float)):
        return "number"
    if isinstance(v, (torch.Tensor, TensorRef)):
        return "tensor"
    if isinstance(v, str):
        return "str"
    if isinstance(v, (bytes, bytearray, memoryview)):
        return "bytes"
    if isinstance(v, io.BytesIO):
        return "BytesIO"
    if isinstance(v, torch.dtype):
        return "dtype"
    if isinstance(v, torch.device):
        return "device"
    if isinstance(v, Mapping):
        return "dict"
    if isinstance(v, (list, tuple)) or (np is not None and isinstance(v, np.ndarray)):
        return "sequence"
    return type(v).__name__


def _fit(live: Any, saved: Any, path: str, commit: bool, depth: int = 0) -> Any:
    """The value that restoring ``saved`` over ``live`` puts at ``path`` (module docstring, "Plain
    values"); StateMismatchError if it may not. Only with ``commit`` is anything converted or filled:
    without, this is the check, and ``saved`` may hold TensorRefs."""
    if live is None or saved is None or depth > MAX_DEPTH:
        return saved
    lc, sc = _value_class(live), _value_class(saved)
    if lc == sc == "dict":
        return {k: _fit(live[k], x, f"{path}/{k}", commit, depth + 1) if k in live else x for k, x in saved.items()}
    if lc == sc == "sequence":
        items = [_fit(v, x, f"{path}/{i}", commit, depth + 1) for i, (v, x) in enumerate(zip(live, saved, strict=False))]
        items += list(saved[len(items):])
        return tuple(items) if isinstance(saved, tuple) else items
    if lc == "number" and sc == "tensor":
        spec = _spec_of(saved)
        if spec is not None and not spec[1]:
            return saved.item() if commit else saved
    elif lc == "tensor" and sc == "number":
        if not live.shape:
            if not commit:
                return saved
            with torch.no_grad():
                live.fill_(saved)
            return live
    elif lc == sc:
        return saved
    why = "; a number converts only to and from a 0-d tensor" if {lc, sc} == {"number", "tensor"} else ""
    raise StateMismatchError(f"{path}: the checkpoint has {_describe(saved)}, the live state has {_describe(live)}"
                             + why)


def _fit_entry(key: str, live_kind: str, live: Any, kind: str, saved: Any, commit: bool) -> Any:
    """:func:`_fit` of a top-level plain value; also a top-level tensor against a number (the 0-d
    conversion). Anything else between a tensor entry and a value entry is a mismatch, as before."""
    if kind == live_kind or "number" in (_value_class(live), _value_class(saved)):
        return _fit(live, saved, key, commit)
    raise StateMismatchError(f"{key}: the checkpoint holds a {kind} ({_describe(saved)}), the live object is a "
                             f"{live_kind} ({_describe(live)})")


# ----------------------------------------------------------------------------------- checks


def _as_ref(t: Any, path: str) -> Any:
    return TensorRef(path, t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else t


def _shape_only(v: Any, path: str, depth: int = 0) -> Any:
    """A plain value with its tensors as TensorRefs (containers copied; kept for later checks)."""
    if isinstance(v, torch.Tensor):
        return _as_ref(v, path)
    if depth > MAX_DEPTH:
        return None
    if isinstance(v, Mapping):
        return {k: _shape_only(x, f"{path}/{k}", depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        items = [_shape_only(x, f"{path}/{i}", depth + 1) for i, x in enumerate(v)]
        return tuple(items) if isinstance(v, tuple) else items
    if np is not None and isinstance(v, (np.generic, np.ndarray)):
        return v.item() if v.ndim == 0 else []
    return v


def _view(key: str, obj: Any, refs: bool) -> tuple[str, Any]:
    """(kind, what restore checks of ``obj``): a module's state_dict, the tensor, an optimizer's
    parameter count per group (None for other stateful objects, which are not checked), the plain
    value. With ``refs``, tensors are TensorRefs: a record that later changes of ``obj`` leave alone."""
    kind = _kind_of(obj)
    if kind == "module":
        return kind, {n: _as_ref(t, f"{key}/{n}") if refs else t for n, t in obj.state_dict().items()}
    if kind == "tensor":
        return kind, _as_ref(obj, key) if refs else obj
    if kind == "stateful":
        opt = isinstance(obj, torch.optim.Optimizer)
        return kind, [len(g["params"]) for g in obj.param_groups] if opt else None
    return kind, _shape_only(obj, key) if refs else obj


def skeleton(state: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """What :func:`apply` checks of ``state``, without its data, for :func:`check_fits` later.

    Per entry: its kind; a module's state_dict keys with each tensor's dtype and shape; a top-level
    tensor's dtype and shape; an optimizer's parameter count per group; a plain value's structure
    with its tensors as :class:`TensorRef` (a copy: later changes of the state leave it alone).
    Other stateful objects (schedulers, RNG, loaders) only as their kind. Calls ``state_dict()`` of
    every module.
    """
    return {key: _view(key, obj, refs=True) for key, obj in state.items()}


def check_fits(recorded: Mapping[str, tuple[str, Any]], tree: Mapping[str, Any],
               passed: dict[str, Any] | None = None) -> None:
    """StateMismatchError unless :func:`apply` of ``tree`` into a state that :func:`skeleton` recorded
    as ``recorded`` would pass its checks, for the entries both hold (an entry only one of them has
    is not checked). Decided from the tree alone: no tensor byte is read.

    ``passed``, kept by the caller across calls against the same ``recorded``, remembers the
    entries that fitted: an entry equal (``==``) to one that fitted before is not decoded again (a
    training saves the same structure at every step; ``==`` only conflates numbers of different
    Python types, which the checks treat alike). Updated only when the whole tree fits."""
    dec = _Decoder(_ref)
    decoded: dict[str, tuple[str, Any, Any]] = {}
    entries = _entries(tree)
    for key, (kind, value, _md) in entries.items():
        if key not in recorded:
            continue
        if passed is not None and key in passed and passed[key] == (kind, value):
            continue
        if kind == "stateful" and isinstance(value, Mapping) and "state" in value:
            # Of an optimizer only the parameter groups are checked: its per-parameter state (the
            # bulk of the tree) is left undecoded.
            value = {**value, "state": {}}
        decoded[key] = (kind, dec.value(value, key), None)
    _check_decoded(recorded, decoded, common_only=True)
    if passed is not None:
        passed.update((key, (kind, value)) for key, (kind, value, _md) in entries.items())


def apply(state: MutableMapping[str, Any], tree: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Load ``tree`` + ``tensors`` (CPU tensors keyed as in the tree) into the live ``state``.

    Decodes and checks everything first (a mismatch raises :class:`StateMismatchError` naming the
    key before any live object changed), then loads the entries in tree order. Plain values are
    checked and converted as the module docstring's "Plain values" says. Call between training
    steps on the thread that owns the state. Tensors handed in may end up referenced by the
    restored objects (e.g. optimizer state on CPU); do not reuse their memory afterwards.
    """

    def resolve(key: str, spec: TensorSpec, path: str) -> torch.Tensor:
        t = tensors.get(key)
        if not isinstance(t, torch.Tensor):
            raise CorruptCheckpointError(f"{path}: tensor {key!r} is missing from the checkpoint")
        if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            raise CorruptCheckpointError(
                f"{path}: tensor {key!r} is {_describe(t)} but the tree says "
                f"{dtype_name(spec.dtype)} {list(spec.shape)}")
        return t

    decoded = _decode(tree, resolve)
    _check_decoded(_views(state), decoded)
    for key, (kind, value, md) in decoded.items():
        if kind == "module":
            sd: OrderedDict[str, Any] = OrderedDict(value)
            if md is not None:
                sd._metadata = md  # type: ignore[attr-defined]
            state[key].load_state_dict(sd, strict=True)
        elif kind == "tensor" and isinstance(state[key], torch.Tensor):
            with torch.no_grad():
                state[key].copy_(value)
        elif kind == "stateful":
            try:
                state[key].load_state_dict(value)
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
                if isinstance(e, (StateMismatchError, CorruptCheckpointError)):
                    raise
                raise StateMismatchError(
                    f"{key}: {type(state[key]).__name__}.load_state_dict rejected the checkpoint: {e}") from e
        elif key in state:  # a plain value, or a 0-d tensor entry restored into a number
            state[key] = _fit_entry(key, _kind_of(state[key]), state[key], kind, value, commit=True)
        else:
            state[key] = value


def _views(state: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    return {key: _view(key, obj, refs=False) for key, obj in state.items()}


def _decode(tree: Mapping[str, Any], resolve: _Resolve) -> dict[str, tuple[str, Any, Any]]:
    dec = _Decoder(resolve)
    decoded: dict[str, tuple[str, Any, Any]] = {}
    for key, (kind, value, metadata) in _entries(tree).items():
        md = dec.value(metadata, f"{key}/_metadata") if metadata is not None else None
        if md is not None and not isinstance(md, dict):
            raise CorruptCheckpointError(f"{key}/_metadata: not a dict")
        decoded[key] = (kind, dec.value(value, key), md)
    return decoded


def _check_decoded(live: Mapping[str, tuple[str, Any]], decoded: Mapping[str, tuple[str, Any, Any]],
                   common_only: bool = False) -> None:
    """StateMismatchError unless the decoded entries fit the live state, given as :func:`_view` s
    (entries, kinds, module keys, tensor shapes and dtypes, optimizer groups, plain values). With
    ``common_only``, entries only one side holds are not checked."""
    missing = [k for k in live if k not in decoded]
    if missing and not common_only:
        raise StateMismatchError(f"state entries missing from the checkpoint: {missing}")
    for key, (kind, value, _) in decoded.items():
        if key not in live:
            if kind != "value" and not common_only:
                raise StateMismatchError(f"{key}: the checkpoint holds a {kind} the live state lacks")
            continue
        live_kind, view = live[key]
        if kind == live_kind == "value" or {kind, live_kind} == {"tensor", "value"}:
            _fit_entry(key, live_kind, view, kind, value, commit=False)
        elif live_kind != kind:
            raise StateMismatchError(f"{key}: the checkpoint holds a {kind}, the live object is a {live_kind}")
        elif kind == "module":
            _check_module(key, view, value)
        elif kind == "tensor":
            _check_tensor(key, value, view, "live tensor")
        elif kind == "stateful" and view is not None:
            _check_optimizer(key, view, value)


def _check_optimizer(key: str, live_groups: list[int], saved: Any) -> None:
    """What ``Optimizer.load_state_dict`` would refuse, found before anything is loaded (else the
    modules before it in the tree were already restored when it raised). ``live_groups``: the live
    optimizer's parameter count per group. Its per-parameter state is not checked: a fresh
    optimizer (no state yet) takes a checkpoint's."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise StateMismatchError(f"{key}: the checkpoint's optimizer state has no param_groups/state")
    if len(groups) != len(live_groups):
        raise StateMismatchError(f"{key}: the checkpoint has {len(groups)} parameter group(s), the live optimizer "
                                 f"{len(live_groups)}")
    for i, (g, n_live) in enumerate(zip(groups, live_groups, strict=True)):
        params = g.get("params") if isinstance(g, dict) else None
        if not isinstance(params, list) or len(params) != n_live:
            n = len(params) if isinstance(params, list) else "no"
            raise StateMismatchError(f"{key}: parameter group {i} has {n} parameter(s) in the checkpoint, "
                                     f"{n_live} in the live optimizer")


def fits(state: Mapping[str, Any], tree: Mapping[str, Any]) -> bool:
    """True when :func:`apply` of ``tree`` would pass its checks on ``state``, decided from the tree
    alone (tensors as :class:`TensorRef`), before any byte is read into the live tensors."""
    try:
        _check_decoded(_views(state), decode_refs(tree))
    except (StateMismatchError, CorruptCheckpointError):
        return False
    return True
