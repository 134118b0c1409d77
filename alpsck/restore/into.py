"""The multi-rank restore protocol (:func:`restore_into`), which :meth:`alpsck.Checkpointer.restore` runs.

Rank 0 alone lists the run directory and picks (the one picker); the others read the steps it
names at their fixed names, so a restart of N ranks costs the file system one listing, not N.
Every rank reaches each collective, whatever rank 0's file system showed it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import fit
from ..capture import capture
from ..errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, StateMismatchError, UsageError
from ..options import DEFAULTS, check_run_dir_arg, check_state, check_step
from ..ranks import Ranks
from ..store.names import step_dir
from ..store.picker import Pick, pick, read_failure
from .health import all_unhealthy
from .read import read_checkpoint, warn_skipped

# How a rank's read of one checkpoint went, as restore_into's ranks tell each other.
_READ, _UNREAD, _FAILED = 0, 1, 2
# What rank 0 decided from its listing of the run directory, as it tells the other ranks.
_TRY, _NO_STEP, _OTHER_WORLD, _UNLISTED, _ALL_UNHEALTHY = 0, 1, 2, 3, 4


def _ranks_named(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def restore_into(
    run_dir: str | os.PathLike[str],
    state: MutableMapping[str, Any],
    *,
    step: int | None = None,
    threads: int = DEFAULTS["read_threads"],
    rank: int = 0,
    ranks: Ranks | None = None,
    allow_unhealthy: bool = False,
    agreed: bool = False,
) -> int | None:
    """Restore the newest valid checkpoint of ``run_dir`` into ``state`` (see Checkpointer.restore). By
    default a checkpoint whose recorded metrics are not finite is skipped as ``unhealthy``
    (``allow_unhealthy=True``: restored like any other).

    The checkpoints tried are the picker's candidates (:func:`alpsck.store.picker.pick`, kind "alpsck",
    this world size; the rule: docs/guarantees.md), each step skipped on the way warned about with its
    reason code. Tensor bytes are read directly into the live CPU tensors where shapes and dtypes match. If a
    chunk then fails its CRC, or a read fails with an I/O error, the previous checkpoint is tried
    (it overwrites the same tensors); if none is left, CorruptCheckpointError says the live state is
    no longer pristine. With several ``ranks`` this is a collective: rank 0 alone lists the run
    directory and picks the candidates, which it broadcasts (the others read them at their names,
    so N ranks cost the file system one listing), and a checkpoint is loaded only once every rank
    has read its part of it without error. Every rank reports how its read went before any acts
    on it: a checkpoint one rank cannot read is skipped by all; any other failure on one rank (a
    state that does not fit, a bug) is raised there, and the other ranks raise a CheckpointError
    naming it instead of waiting for it. Rank 0's listing alone decides whether ``step`` exists and
    whether the world size fits; when rank 0 cannot list ``run_dir`` it raises its error, and the
    others a CheckpointError naming rank 0.
    When none is left and one rank's live tensors were already overwritten, every rank raises
    CorruptCheckpointError.

    ``agreed``: ``step`` is one the ranks already agreed to read, from a listing of their own (the memory
    tier's restore, :mod:`alpsck.memory.restore`): rank 0 neither lists nor picks, and every rank reads it at
    its name (one collective fewer).
    """
    check_run_dir_arg(run_dir)
    check_step(step, allow_none=True)
    check_state(state, mutable=True)
    if ranks is None and rank != 0:  # once the only way to pick a rank; alone, a process is rank 0 of 1
        raise UsageError(f"restore_into(rank={rank}) without ranks=: a process restoring alone is rank 0 of a "
                         "world of 1; pass ranks= in a multi-rank job, or read rank N's part of one checkpoint "
                         "with alpsck.checkpointer.read_checkpoint(step_dir, rank=N)")
    ranks = ranks or Ranks(rank, 1, None)
    picked: Pick | None
    if agreed:
        if step is None:
            raise UsageError("restore_into(agreed=True) needs the step the ranks agreed on")
        picked, order = None, [step]
    else:
        picked, order = _agreed_order(run_dir, step, ranks, allow_unhealthy)
    # Rank 0's view of each step; another rank reads it at its name (a step it cannot see fails its read).
    # (Only step-N directories are checkpoints: an attempt beside one is not.)
    infos = {int(i["step"]): i for i in picked.scanned if i["status"] != "incomplete"} if picked is not None else {}
    unusable: Exception | None = None  # the live state cannot be captured on this rank: raised once all know
    try:
        live = capture(state).tensors
    except Exception as e:
        live, unusable = {}, e
    touched: str | None = None
    unread_why: str | None = None  # why the last step tried could not be read (a named step's error says it)
    for s in order:
        info = infos.get(s)
        meta, tensors, error, failure, fitted = _read_step(run_dir, s, info, state, live, unusable, ranks, threads)
        mine = _FAILED if failure is not None or fitted is False else _UNREAD if error is not None else _READ
        verdicts = ranks.each(mine)
        into_live = any(t is live.get(k) for k, t in tensors.items())
        failed = [r for r, v in enumerate(verdicts) if v == _FAILED]
        if failed:
            if failure is not None:
                raise failure
            if mine == _FAILED:
                fit.apply(state, meta["tree"], tensors)  # raises the mismatch fits() found, before any change
            raise CheckpointError(
                f"{run_dir}: restoring step {s} failed on {_ranks_named(failed)} (its own error says why), so no rank "
                "loaded it" + ("; live tensors of this rank may already hold some of its bytes" if into_live else ""))
        unread = [r for r, v in enumerate(verdicts) if v == _UNREAD]
        if unread:
            why = _skip_unread(run_dir, s, info, error, unread, into_live)  # warns, whatever was touched before
            touched = touched or why
            unread_why = str(error) if error is not None else f"{_ranks_named(unread)} could not read it"
            continue
        fit.apply(state, meta["tree"], tensors)
        return int(meta.get("step", s))
    _none_restored(run_dir, step, picked, ranks, unusable, touched, unread_why)
    return None


def _skip_unread(run_dir: str | os.PathLike[str], s: int, info: dict[str, Any] | None, error: CheckpointError | None,
                 unread: list[int], into_live: bool) -> str | None:
    """Step ``s`` is skipped: some rank could not read it (``error``: this rank's reason, or another rank's);
    warned about. What it left in this rank's live tensors (a message), or None when it touched none."""
    where = info or {"step": s, "path": str(step_dir(Path(run_dir), s))}
    if error is not None:
        warnings.warn(read_failure(where, error, "corrupt").warning(), RuntimeWarning, stacklevel=4)
        return str(error) if getattr(error, "live_touched", False) else None
    warnings.warn(read_failure(where, f"{_ranks_named(unread)} could not read it").warning(), RuntimeWarning,
                  stacklevel=4)
    return f"{_ranks_named(unread)} could not read step {s}" if into_live else None


def _agreed_order(run_dir: str | os.PathLike[str], step: int | None, ranks: Ranks,
                  allow_unhealthy: bool) -> tuple[Pick | None, list[int]]:
    """Rank 0's pick (None on the other ranks) and the steps every rank tries, in order, as rank 0
    broadcast them; raises on every rank what rank 0's listing refuses (no such step, another world
    size, every checkpoint unhealthy, a run directory rank 0 cannot list)."""
    picked: Pick | None = None
    refusal, written_by, order = _TRY, 0, []
    unlisted: Exception | None = None
    if ranks.rank == 0:
        try:
            picked = pick(run_dir, kind="alpsck", world_size=ranks.world_size, step=step,
                          allow_unhealthy=allow_unhealthy)
        except Exception as e:  # NoCheckpointError for a missing run directory, as peek and pick say it
            unlisted, refusal = e, _UNLISTED
    if picked is not None:
        other_world = [k for k in picked.skipped if k.reason == "other_world"]
        if step is not None and not any(i["step"] == step for i in picked.scanned):
            refusal = _NO_STEP
        elif other_world:  # the newest usable one was written at another world size: never silently an older one
            refusal, order = _OTHER_WORLD, [other_world[0].step]
            written_by = next(int(i["ranks"]) for i in picked.scanned if i["step"] == other_world[0].step)
        elif step is None and all_unhealthy(picked):  # a named step says why it is not valid below
            refusal = _ALL_UNHEALTHY
        else:
            warn_skipped(picked, stacklevel=4)
            order = picked.steps
    refusal, written_by, *order = ranks.from_rank0([refusal, written_by, *order])
    if refusal == _UNLISTED:
        if unlisted is not None:
            raise unlisted
        raise CheckpointError(f"{run_dir}: rank 0 could not list the run directory (its own error says why), so no "
                              "rank restored")
    if refusal == _NO_STEP:
        raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}"
                                + ("" if ranks.rank == 0 else " (rank 0 lists none, and rank 0 decides)"))
    if refusal == _ALL_UNHEALTHY:
        why = all_unhealthy(picked) if picked is not None else "rank 0 finds every checkpoint unhealthy"
        raise NoCheckpointError(f"{run_dir}: {why}")
    if refusal == _OTHER_WORLD:
        raise UsageError(
            f"{run_dir}: the checkpoint of step {order[0]} was written by {written_by} rank(s), this job "
            f"has {ranks.world_size}; restore it at its world size, or reshard it with torch.distributed.checkpoint "
            "through alpsck.dcp")
    return picked, order


def _read_step(run_dir: str | os.PathLike[str], s: int, info: dict[str, Any] | None, state: MutableMapping[str, Any],
               live: dict[str, torch.Tensor], unusable: Exception | None, ranks: Ranks, threads: int,
               ) -> tuple[dict[str, Any], dict[str, torch.Tensor], CheckpointError | None, Exception | None, bool | None]:
    """This rank's read of step ``s``: (meta, tensors, error, failure, fitted). ``error``: this rank cannot
    read it (every rank skips it); ``failure``: anything else (raised here once every rank knows);
    ``fitted``: whether the tree fits the live state (apply() would pass its checks)."""
    meta: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    error: CheckpointError | None = None
    failure: Exception | None = None
    fitted: bool | None = None

    def fits(m: dict[str, Any]) -> bool:
        nonlocal fitted
        fitted = isinstance(m.get("tree"), dict) and fit.fits(state, m["tree"])
        return fitted

    if unusable is not None:
        return meta, tensors, error, unusable, fitted
    path = info["path"] if info is not None else str(step_dir(Path(run_dir), s))
    try:
        # Into the live tensors only if the tree fits the live state: a mismatch found by
        # apply() afterwards must leave the live objects as they were.
        meta, tensors = read_checkpoint(path, rank=ranks.rank, threads=threads, into=live, fits=fits)
        if fitted is None:  # nothing was to be read into live tensors, so read_checkpoint did not ask
            fits(meta)
    except StateMismatchError as e:
        failure = e
    except CheckpointError as e:
        error = e
        if info is None and not os.path.isdir(path):  # rank 0 lists it, this rank does not see it
            error = CorruptCheckpointError(f"{run_dir}: step {s} is not visible from rank {ranks.rank} ({e})")
    except Exception as e:  # a bug, say: the other ranks must not wait for this rank
        failure = e
    return meta, tensors, error, failure, fitted


def _none_restored(run_dir: str | os.PathLike[str], step: int | None, picked: Pick | None, ranks: Ranks,
                   unusable: Exception | None, touched: str | None, unread_why: str | None) -> None:
    """No rank restored: they end the same way, whatever happened to their own state (returns: start afresh)."""
    ends = ranks.each(_FAILED if unusable is not None else _UNREAD if touched is not None else _READ)
    if unusable is not None:
        raise unusable
    if _FAILED in ends:
        raise CheckpointError(f"{run_dir}: {_ranks_named([r for r, v in enumerate(ends) if v == _FAILED])} cannot "
                              "restore into its state (its own error says why), so no rank restored")
    if touched is not None:
        raise CorruptCheckpointError(
            f"{run_dir}: no valid checkpoint left, and reading one that then failed already overwrote live tensors "
            f"({touched}); rebuild the state before training")
    if _UNREAD in ends:
        raise CorruptCheckpointError(
            f"{run_dir}: no valid checkpoint left, and reading one that then failed already overwrote live tensors "
            f"on {_ranks_named([r for r, v in enumerate(ends) if v == _UNREAD])}; rebuild the state on every rank "
            "before training")
    if step is not None:
        why = picked.why_not() if picked is not None and picked.skipped else unread_why
        raise NoCheckpointError(f"{run_dir}: checkpoint of step {step} is not valid" + (f" ({why})" if why else ""))
