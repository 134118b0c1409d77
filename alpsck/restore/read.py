"""Reading one checkpoint directory back (:func:`read_checkpoint`), and a run's newest valid checkpoint's
non-tensor state without a model (:func:`peek`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import tree
from ..errors import CheckpointError, NoCheckpointError, UsageError
from ..options import DEFAULTS
from ..store.picker import Pick, data_error, pick, read_failure
from ..store.shards import CheckpointShards
from .device import read_to_device
from .health import all_unhealthy


def read_checkpoint(
    path: str | os.PathLike[str],
    rank: int = 0,
    threads: int = DEFAULTS["read_threads"],
    into: Mapping[str, torch.Tensor] | None = None,
    fits: Callable[[dict[str, Any]], bool] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read one checkpoint directory as ``rank``: (meta document, tensors by key), every chunk CRC-checked.

    The tree is rank ``rank``'s; tensors come from whichever shard holds them (:mod:`alpsck.store.shards`).
    With ``into`` (key -> live tensor, as :func:`alpsck.capture.capture` gives), tensors are read
    straight into the live CPU tensors — no allocation, no extra copy — and into live GPU tensors
    through pinned buffers (:func:`alpsck.restore.device.read_to_device`), but only when every
    saved tensor that has a live counterpart matches it in shape and dtype, and ``fits`` (if
    given) accepts the meta document; otherwise nothing live is touched and fresh tensors are
    returned (the caller's mismatch check then fails cleanly). A CheckpointError raised part-way
    through the reads carries ``live_touched``: whether live tensors may hold some of its bytes.
    """
    shards = CheckpointShards(path, rank)
    specs = shards.specs
    live = dict(into or {})
    if any(k in live and (live[k].dtype != s.dtype or tuple(live[k].shape) != s.shape) for k, s in specs.items()):
        live = {}
    if live and fits is not None and not fits(shards.meta):
        live = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, spec in specs.items():
        t = live.get(key)
        usable = t is not None and t.device.type in ("cpu", "cuda") and t.is_contiguous() and not t.requires_grad
        tensors[key] = t if usable and t is not None else torch.empty(spec.shape, dtype=spec.dtype)
    try:
        shards.read_into([(k, t.reshape(-1).view(torch.uint8)) for k, t in tensors.items()
                          if t.numel() and t.device.type == "cpu"], threads)
        gpu = [(k, t) for k, t in tensors.items() if t.device.type == "cuda"]
        if gpu:
            read_to_device(shards, gpu, threads)  # through pinned buffers, overlapped with the reads
    except CheckpointError as e:  # corrupt chunk or I/O error part-way: earlier tensors may have landed
        e.live_touched = any(tensors[k] is live.get(k) for k in tensors)  # type: ignore[attr-defined]
        raise
    return shards.meta, tensors


def peek(run_dir: str | os.PathLike[str], step: int | None = None, rank: int = 0, *,
         verify: bool = False, allow_unhealthy: bool = False) -> dict[str, Any]:
    """The non-tensor state of a run's newest valid checkpoint (or of ``step``), before any model exists.

    Returns ``{state key: value}`` as ``restore()`` would decode it (tuples, bytes, dtypes, ...;
    a module's entry is its state_dict, a stateful object's its state_dict), with every tensor,
    0-d ones included, replaced by a :class:`alpsck.tree.TensorRef` (``key``, ``dtype``, ``shape``):
    no tensor byte is read. ``rank`` picks whose tree (RNG streams and data positions differ per
    rank). Typical use: ``args = alpsck.peek("runs/x")["model_args"]`` to build the model a
    checkpoint needs.

    It picks the checkpoint as ``restore()`` does (:func:`alpsck.store.picker.pick`, kind "alpsck";
    the rule: docs/guarantees.md), then checks its state tree; every step skipped gets a
    RuntimeWarning naming why (its reason code), as in ``restore()``. Corruption inside tensor data
    is found only with ``verify=True``, which reads and CRC-checks every shard of the candidate (all
    of its bytes: slow for a big checkpoint), as a restore does; without it a checkpoint whose
    tensor bytes are damaged can be the one peeked, and a restore then falls back to the one before
    it. With ``step``, only that checkpoint is considered. Raises NoCheckpointError when none is
    valid (also when ``run_dir`` does not exist), UsageError when ``rank`` is not one of the
    checkpoint's ranks.

    A reader: it takes no lock and changes nothing, so it may run while a job writes the run
    directory. Nothing is unpickled: the tree is tagged JSON decoded by :mod:`alpsck.tree`.
    """

    entries = _first_readable(run_dir, step, rank, verify, allow_unhealthy,
                              lambda path: tree.decode_refs(CheckpointShards(path, rank).meta["tree"]))[1]
    return {key: value for key, (_kind, value, _md) in entries.items()}


def read_state(run_dir: str | os.PathLike[str], step: int | None = None, rank: int = 0, *,
               threads: int = DEFAULTS["read_threads"]) -> tuple[int, dict[str, Any]]:
    """The whole state of a run's newest valid checkpoint (or of ``step``), with no live state to restore into:
    (its step, ``{state key: value}``) as :func:`peek` decodes it, every tensor read (each chunk CRC-checked) into
    a new CPU tensor. For a framework that expects its loader to return the checkpoint it saved (Lightning's
    ``CheckpointIO.load_checkpoint``, :mod:`alpsck.integrations.lightning`). Picks as ``restore()`` does; one whose
    data fails its CRC is skipped, with a warning, for the one before (not with ``step``: it raises)."""
    def read(path: str) -> dict[str, tuple[str, Any, Any]]:
        meta, tensors = read_checkpoint(path, rank, threads)
        return tree.decode(meta["tree"], lambda key, _spec, _path: tensors[key])

    s, entries = _first_readable(run_dir, step, rank, True, False, read, whole=True)
    return s, {key: value for key, (_kind, value, _md) in entries.items()}


def _first_readable(run_dir: str | os.PathLike[str], step: int | None, rank: int, verify: bool, allow_unhealthy: bool,
                    read: Callable[[str], dict[str, tuple[str, Any, Any]]], *,
                    whole: bool = False) -> tuple[int, dict[str, tuple[str, Any, Any]]]:
    """The first checkpoint the picker offers (:func:`alpsck.store.picker.pick`, kind "alpsck") that ``read``
    reads: its step and entries. ``whole``: ``read`` reads every byte (so no separate CRC pass is made)."""
    if rank < 0:
        raise UsageError(f"rank must be 0 or more, not {rank}")
    picked = pick(run_dir, kind="alpsck", step=step, verify_data=verify and not whole, allow_unhealthy=allow_unhealthy)
    if step is not None and not any(i["step"] == step for i in picked.scanned):
        raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}")
    warn_skipped(picked, stacklevel=4)
    for info in picked.candidates:
        s = int(info["step"])
        if info.get("ranks") and rank >= info["ranks"]:
            raise UsageError(f"{run_dir}: the checkpoint of step {s} has {info['ranks']} rank(s); there is no rank {rank}")
        try:
            entries = read(info["path"])
            bad = data_error(info) if verify and not whole and not info["verified"] else None
        except CheckpointError as e:
            if step is not None and whole:
                raise
            bad = read_failure(info, e, "corrupt")
        if bad is not None:
            warnings.warn(bad.warning(), RuntimeWarning, stacklevel=3)
            continue
        return s, entries
    if step is None and all_unhealthy(picked):
        raise NoCheckpointError(f"{run_dir}: {all_unhealthy(picked)}")
    why = f" ({picked.why_not()})" if picked.skipped else ""
    raise NoCheckpointError(f"{run_dir}: checkpoint of step {step} is not valid{why}" if step is not None
                            else f"{run_dir}: no valid checkpoint{why}")


def warn_skipped(picked: Pick, stacklevel: int) -> None:
    """One RuntimeWarning per step the picker skipped, naming why (its reason code and message); an attempt
    (in flight or abandoned) is skipped quietly, and another world size is refused by restore_into instead."""
    for k in picked.skipped:
        if not k.quiet and k.reason != "other_world":
            warnings.warn(k.warning(), RuntimeWarning, stacklevel=stacklevel + 1)
