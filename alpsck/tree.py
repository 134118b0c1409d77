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
* plain values: restored by replacing the entry, ``state[key] = value``.

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
    UnsafeCheckpointError,
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
    "float": frozenset({"v"}),
    "bigint": frozenset({"v"}),
    "dtype": frozenset({"v"}),
    "device": frozenset({"v"}),
    "tensor": frozenset({"key", "dtype", "shape"}),
}
_KINDS = ("module", "tensor", "stateful", "value")


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
    """The tree name of a checkpointable tensor dtype; TypeError if it is not allowed."""
    try:
        return _TENSOR_DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"tensor dtype {dtype} cannot be checkpointed") from None


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support has no DTensor
        return False
    return isinstance(t, DTensor)


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
            raise TypeError(f"{path}: a DTensor (FSDP2 / tensor-parallel sharded state): save it per shard with "
                            "torch.distributed.checkpoint through alpsck.dcp.AlpsckStorageWriter, which also reshards "
                            "on load; the Checkpointer's tree holds plain (replicated or per-rank) tensors")
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise TypeError(f"{path}: cannot checkpoint a {t.layout} / {t.device.type} tensor")
        name = _TENSOR_DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"{path}: tensor dtype {t.dtype} cannot be checkpointed")
        t = plain(t)
        key, n = path, 1
        while key in self.tensors:
            n += 1
            key = f"{path}~{n}"
        self.tensors[key] = t
        return {TAG: "tensor", "key": key, "dtype": name, "shape": list(t.shape)}

    def value(self, v: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"{path}: nested more than {MAX_DEPTH} levels (a cycle?)")
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
        if isinstance(v, torch.dtype):
            return {TAG: "dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {TAG: "device", "v": str(v)}
        if isinstance(v, Mapping):
            if all(isinstance(k, str) for k in v) and TAG not in v:
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
        raise TypeError(f"{path}: cannot checkpoint a value of type {type(v).__module__}.{type(v).__qualname__}")


def capture(state: Mapping[str, Any]) -> Captured:
    """Split ``state`` into live tensors and a JSON-safe tree. TypeError names an unsupported path.

    Runs ``state_dict()`` of every stateful entry; call it between training steps on the thread
    that owns the state.
    """
    enc = _Encoder()
    entries: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"state keys must be non-empty str, got {key!r}")
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
        v = node["v"] if tag != "bytes" else node["b64"]
        if not isinstance(v, str):
            raise CorruptCheckpointError(f"{path}: {tag} value must be a string, got {_short(v)}")
        if tag == "bytes":
            try:
                return base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise CorruptCheckpointError(f"{path}: invalid base64") from None
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


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{dtype_name(t.dtype) if t.dtype in _TENSOR_DTYPE_NAMES else t.dtype} {list(t.shape)}"
    return type(t).__name__


def _check_tensor(name: str, saved: Any, live: Any, what: str) -> None:
    if not (isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor)):
        if isinstance(saved, torch.Tensor) or isinstance(live, torch.Tensor):
            raise StateMismatchError(f"{name}: checkpoint has {_describe(saved)}, {what} has {_describe(live)}")
        return
    if saved.dtype != live.dtype or saved.shape != live.shape:
        raise StateMismatchError(f"{name}: checkpoint has {_describe(saved)}, {what} has {_describe(live)}")


def _check_module(key: str, module: nn.Module, saved: Any) -> None:
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(f"{key}: module state is not a dict")
    live = module.state_dict()
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise StateMismatchError(
            f"{key}: module state keys differ; missing from checkpoint: {missing[:10]}, "
            f"not in live module: {unexpected[:10]}")
    for name, value in saved.items():
        _check_tensor(f"{key}/{name}", value, live[name], "live module")


def apply(state: MutableMapping[str, Any], tree: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Load ``tree`` + ``tensors`` (CPU tensors keyed as in the tree) into the live ``state``.

    Decodes and checks everything first (a mismatch raises :class:`StateMismatchError` naming the
    key before any live object changed), then loads the entries in tree order. Call between
    training steps on the thread that owns the state. Tensors handed in may end up referenced by
    the restored objects (e.g. optimizer state on CPU); do not reuse their memory afterwards.
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
    _check_decoded(state, decoded)
    for key, (kind, value, md) in decoded.items():
        if kind == "module":
            sd: OrderedDict[str, Any] = OrderedDict(value)
            if md is not None:
                sd._metadata = md  # type: ignore[attr-defined]
            state[key].load_state_dict(sd, strict=True)
        elif kind == "tensor":
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
        else:
            state[key] = value


def _decode(tree: Mapping[str, Any], resolve: Callable[[str, TensorSpec, str], torch.Tensor]
            ) -> dict[str, tuple[str, Any, Any]]:
    dec = _Decoder(resolve)
    decoded: dict[str, tuple[str, Any, Any]] = {}
    for key, (kind, value, metadata) in _entries(tree).items():
        md = dec.value(metadata, f"{key}/_metadata") if metadata is not None else None
        if md is not None and not isinstance(md, dict):
            raise CorruptCheckpointError(f"{key}/_metadata: not a dict")
        decoded[key] = (kind, dec.value(value, key), md)
    return decoded


def _check_decoded(state: Mapping[str, Any], decoded: Mapping[str, tuple[str, Any, Any]]) -> None:
    """StateMismatchError unless the decoded entries fit the live state (entries, kinds, module
    keys, tensor shapes and dtypes)."""
    missing = [k for k in state if k not in decoded]
    if missing:
        raise StateMismatchError(f"state entries missing from the checkpoint: {missing}")
    for key, (kind, value, _) in decoded.items():
        if key not in state:
            if kind != "value":
                raise StateMismatchError(f"{key}: the checkpoint holds a {kind} the live state lacks")
            continue
        live_kind = _kind_of(state[key])
        if live_kind != kind:
            raise StateMismatchError(f"{key}: the checkpoint holds a {kind}, the live object is a {live_kind}")
        if kind == "module":
            _check_module(key, state[key], value)
        elif kind == "tensor":
            _check_tensor(key, value, state[key], "live tensor")
        elif kind == "stateful" and isinstance(state[key], torch.optim.Optimizer):
            _check_optimizer(key, state[key], value)


def _check_optimizer(key: str, live: torch.optim.Optimizer, saved: Any) -> None:
    """What ``Optimizer.load_state_dict`` would refuse, found before anything is loaded (else the
    modules before it in the tree were already restored when it raised)."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(saved.get("state"), dict):
        raise StateMismatchError(f"{key}: the checkpoint's optimizer state has no param_groups/state")
    if len(groups) != len(live.param_groups):
        raise StateMismatchError(f"{key}: the checkpoint has {len(groups)} parameter group(s), the live optimizer "
                                 f"{len(live.param_groups)}")
    for i, (g, lg) in enumerate(zip(groups, live.param_groups, strict=True)):
        params = g.get("params") if isinstance(g, dict) else None
        if not isinstance(params, list) or len(params) != len(lg["params"]):
            n = len(params) if isinstance(params, list) else "no"
            raise StateMismatchError(f"{key}: parameter group {i} has {n} parameter(s) in the checkpoint, "
                                     f"{len(lg['params'])} in the live optimizer")


def fits(state: Mapping[str, Any], tree: Mapping[str, Any]) -> bool:
    """True when :func:`apply` of ``tree`` would pass its checks on ``state``, decided from the tree
    alone (tensors as shapes), before any byte is read into the live tensors."""

    def shaped(key: str, spec: TensorSpec, path: str) -> torch.Tensor:
        return torch.empty(spec.shape, dtype=spec.dtype, device="meta")

    try:
        _check_decoded(state, _decode(tree, shaped))
    except (StateMismatchError, CorruptCheckpointError):
        return False
    return True
