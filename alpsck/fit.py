"""Does a saved state tree fit the live state, and loading it in: :func:`apply`, :func:`fits`,
:func:`skeleton` and :func:`check_fits` (the check a save makes before it commits to a tree).

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
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from alpsck.capture import kind_of
from alpsck.errors import CorruptCheckpointError, StateMismatchError
from alpsck.tree import (
    MAX_DEPTH,
    TENSOR_DTYPE_NAMES,
    Decoder,
    TensorRef,
    TensorSpec,
    as_tensor_ref,
    decode,
    decode_refs,
    dtype_name,
    entries,
)

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is optional
    np = None  # type: ignore[assignment]

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
        return f"{TENSOR_DTYPE_NAMES.get(spec[0], str(spec[0]))} {list(spec[1])}"
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
    kind = kind_of(obj)
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
    dec = Decoder(as_tensor_ref)
    decoded: dict[str, tuple[str, Any, Any]] = {}
    saved = entries(tree)
    for key, (kind, value, _md) in saved.items():
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
        passed.update((key, (kind, value)) for key, (kind, value, _md) in saved.items())


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

    decoded = decode(tree, resolve)
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
            state[key] = _fit_entry(key, kind_of(state[key]), state[key], kind, value, commit=True)
        else:
            state[key] = value


def _views(state: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    return {key: _view(key, obj, refs=False) for key, obj in state.items()}


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


def check_restorable(recorded: Mapping[str, tuple[str, Any]], at: str, tree: Mapping[str, Any],
                     fitted: dict[str, Any], what: str) -> None:
    """A save's check that a resumed run could restore it: :func:`check_fits` of its ``tree`` against the
    skeleton ``recorded`` at ``at`` (``restore()`` or the first ``save()``), worded for the save ``what``
    (StateMismatchError naming the key path, nothing written).

    What fails: a plain value whose type changed (a float that became a dict or a 1-d
    tensor; a float that became a 0-d tensor is fine, restore converts it), a top-level tensor or a
    module tensor whose shape or dtype changed, module keys that appeared or vanished, an optimizer
    whose parameter groups changed. An optimizer's per-parameter state (Adam's ``exp_avg``
    appearing at the first step), schedulers, RNG and loaders are not compared (restore loads those
    into fresh objects), nor are entries added to or left out of the state. The check is local to
    each rank (no collective: a save never waits for the others); ranks running the same code refuse
    the same save."""
    try:
        check_fits(recorded, tree, fitted)
    except StateMismatchError as e:
        raise StateMismatchError(
            f"{what} not saved (nothing was written): a resumed run would fail to restore "
            f"it. Such a run builds the state as it was at {at}, and restoring this save into "
            f"that fails: {e} (the checkpoint: the state now; live: the state at {at}). Keep "
            "each entry's type (a number and a 0-d tensor convert both ways) and each tensor's shape and "
            "dtype") from None


def fits(state: Mapping[str, Any], tree: Mapping[str, Any]) -> bool:
    """True when :func:`apply` of ``tree`` would pass its checks on ``state``, decided from the tree
    alone (tensors as :class:`TensorRef`), before any byte is read into the live tensors."""
    try:
        _check_decoded(_views(state), decode_refs(tree))
    except (StateMismatchError, CorruptCheckpointError):
        return False
    return True
