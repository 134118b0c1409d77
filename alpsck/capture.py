"""Turn a training-state mapping into tensors plus a JSON-safe tree (:mod:`alpsck.tree`).

Turn a training-state mapping into tensors plus a JSON-safe tree, and back.

This is the contract every checkpointer relies on: :func:`capture` splits the state into a flat
``key -> tensor`` dict (the bytes a checkpointer writes) and a JSON tree (everything else, with
tensors replaced by references). :func:`alpsck.tree.tensor_specs` reads the tensor list back out of a tree,
validated, so a reader knows what to allocate; :func:`alpsck.fit.apply` loads tree + tensors into the live
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
  value against the live one (:func:`alpsck.fit.apply`, whose module says how plain values fit).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from alpsck.errors import StateTypeError
from alpsck.tree import TREE_FORMAT, TREE_VERSION, Encoder


@dataclass
class Captured:
    """Result of :func:`capture`.

    ``tensors`` maps key -> the live tensor (detached; a contiguous copy only if it was not
    contiguous); ``tree`` is JSON-able with ``json.dumps(tree, allow_nan=False)``.
    """

    tensors: dict[str, torch.Tensor]
    tree: dict[str, Any]


def kind_of(value: Any) -> str:
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
        return "stateful"
    return "value"


def capture(state: Mapping[str, Any]) -> Captured:
    """Split ``state`` into live tensors and a JSON-safe tree. StateTypeError names an unsupported path.

    Runs ``state_dict()`` of every stateful entry; call it between training steps on the thread
    that owns the state.
    """
    enc = Encoder()
    entries: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key:
            raise StateTypeError(f"state keys must be non-empty str, got {key!r}")
        kind = kind_of(obj)
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
