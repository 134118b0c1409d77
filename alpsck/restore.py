"""Reading a checkpoint back: one directory (:func:`read_checkpoint`), its non-tensor state without a
model (:func:`peek`), and the multi-rank restore protocol (:func:`restore_into`), which
:meth:`alpsck.Checkpointer.restore` runs.

Which checkpoint is read is the picker's answer (:func:`alpsck.store.run_dir.pick`; the rule:
docs/guarantees.md, "Which checkpoint a restore uses"). With several ranks, rank 0's candidates are
tried in order, and a checkpoint any rank cannot read is skipped by all (:class:`alpsck.ranks.Ranks`
carries the votes). Nothing read back is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from . import _core, fit, tree
from .capture import capture
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    RollbackLimitError,
    StateMismatchError,
    UsageError,
)
from .handles import RESTORED_HOOKS  # re-exported (the list lives there, importable without torch)
from .options import DEFAULTS, check_run_dir_arg, check_state, check_step
from .options import check as check_option
from .ranks import Ranks
from .store.durable import read_small, replace_durably
from .store.run_dir import Pick, data_error, pick, read_failure, step_dir, temp_name
from .store.shards import CheckpointShards

__all__ = ["RESTORED_HOOKS", "ROLLBACKS_FILE", "Rollback", "RollbackRecord", "loss_problem", "peek",
           "read_checkpoint", "read_rollbacks", "restore_into"]


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
    straight into the live CPU tensors — no allocation, no extra copy — but only when every
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
        usable = t is not None and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
        tensors[key] = t if usable and t is not None else torch.empty(spec.shape, dtype=spec.dtype)
    try:
        shards.read_into([(k, t.reshape(-1).view(torch.uint8)) for k, t in tensors.items() if t.numel()], threads)
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

    It picks the checkpoint as ``restore()`` does (:func:`alpsck.store.run_dir.pick`, kind "alpsck";
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

    if rank < 0:
        raise UsageError(f"rank must be 0 or more, not {rank}")
    picked = pick(run_dir, kind="alpsck", step=step, verify_data=verify, allow_unhealthy=allow_unhealthy)
    if step is not None and not any(i["step"] == step for i in picked.scanned):
        raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}")
    _warn_skipped(picked, stacklevel=3)
    for info in picked.candidates:
        s = int(info["step"])
        if info.get("ranks") and rank >= info["ranks"]:
            raise UsageError(f"{run_dir}: the checkpoint of step {s} has {info['ranks']} rank(s); there is no rank {rank}")
        try:
            entries = tree.decode_refs(CheckpointShards(info["path"], rank).meta["tree"])
            bad = data_error(info) if verify and not info["verified"] else None
        except CheckpointError as e:
            bad = read_failure(info, e, "corrupt")
        if bad is not None:
            warnings.warn(bad.warning(), RuntimeWarning, stacklevel=2)
            continue
        return {key: value for key, (_kind, value, _md) in entries.items()}
    if step is None and all_unhealthy(picked):
        raise NoCheckpointError(f"{run_dir}: {all_unhealthy(picked)}")
    why = f" ({picked.why_not()})" if picked.skipped else ""
    raise NoCheckpointError(f"{run_dir}: checkpoint of step {step} is not valid{why}" if step is not None
                            else f"{run_dir}: no valid checkpoint{why}")


def _warn_skipped(picked: Pick, stacklevel: int) -> None:
    """One RuntimeWarning per step the picker skipped, naming why (its reason code and message); an attempt
    (in flight or abandoned) is skipped quietly, and another world size is refused by restore_into instead."""
    for k in picked.skipped:
        if not k.quiet and k.reason != "other_world":
            warnings.warn(k.warning(), RuntimeWarning, stacklevel=stacklevel + 1)


# How a rank's read of one checkpoint went, as restore_into's ranks tell each other.
_READ, _UNREAD, _FAILED = 0, 1, 2
# What rank 0 decided from its listing of the run directory, as it tells the other ranks.
_TRY, _NO_STEP, _OTHER_WORLD, _UNLISTED, _ALL_UNHEALTHY = 0, 1, 2, 3, 4


def all_unhealthy(picked: Pick) -> str | None:
    """Why a restore must not start afresh: no checkpoint passes, yet some were skipped only as unhealthy (a
    run whose every checkpoint diverged; starting from nothing would throw the run away). None otherwise."""
    sick = [k for k in picked.skipped if k.reason == "unhealthy"]
    if picked.step is not None or not sick:
        return None
    return (f"every checkpoint a restore could use is unhealthy (step {sick[0].step}: {sick[0].message}): pass "
            "allow_unhealthy=True to restore one, or remove them to start afresh")


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
) -> int | None:
    """Restore the newest valid checkpoint of ``run_dir`` into ``state`` (see Checkpointer.restore). By
    default a checkpoint whose recorded metrics are not finite is skipped as ``unhealthy``
    (``allow_unhealthy=True``: restored like any other).

    The checkpoints tried are the picker's candidates (:func:`alpsck.store.run_dir.pick`, kind "alpsck",
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
    """
    check_run_dir_arg(run_dir)
    check_step(step, allow_none=True)
    check_state(state, mutable=True)
    if ranks is None and rank != 0:  # once the only way to pick a rank; alone, a process is rank 0 of 1
        raise UsageError(f"restore_into(rank={rank}) without ranks=: a process restoring alone is rank 0 of a "
                         "world of 1; pass ranks= in a multi-rank job, or read rank N's part of one checkpoint "
                         "with alpsck.checkpointer.read_checkpoint(step_dir, rank=N)")
    ranks = ranks or Ranks(rank, 1, None)
    # Rank 0 alone lists the run directory and picks (the one picker); the others read the steps it
    # names at their fixed names, so a restart of N ranks costs the file system one listing, not N.
    # Every rank reaches each collective below, whatever rank 0's file system showed it.
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
            _warn_skipped(picked, stacklevel=3)
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
    # Rank 0's view of each step; another rank reads it at its name (a step it cannot see fails its read).
    # (Only step-N directories are checkpoints: an attempt beside one is not.)
    infos = {int(i["step"]): i for i in picked.scanned if i["status"] != "incomplete"} if picked is not None else {}
    unusable: Exception | None = None  # the live state cannot be captured on this rank: raised once all know
    try:
        live = capture(state).tensors
    except Exception as e:
        live, unusable = {}, e
    touched: str | None = None
    for s in order:
        info = infos.get(s)
        meta: dict[str, Any] = {}
        tensors: dict[str, torch.Tensor] = {}
        error: CheckpointError | None = None  # this rank cannot read step s: every rank skips it
        failure: Exception | None = None  # anything else: raised here once every rank knows
        fitted: bool | None = None  # whether the tree fits the live state (apply() would pass its checks)

        def fits(m: dict[str, Any]) -> bool:
            nonlocal fitted
            fitted = isinstance(m.get("tree"), dict) and fit.fits(state, m["tree"])
            return fitted

        if unusable is not None:
            failure = unusable
        else:
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
            where = info or {"step": s, "path": str(step_dir(Path(run_dir), s))}
            if error is not None:
                warnings.warn(read_failure(where, error, "corrupt").warning(), RuntimeWarning, stacklevel=3)
                if getattr(error, "live_touched", False):
                    touched = touched or str(error)
            else:
                warnings.warn(read_failure(where, f"{_ranks_named(unread)} could not read it").warning(),
                              RuntimeWarning, stacklevel=3)
                if into_live:
                    touched = touched or f"{_ranks_named(unread)} could not read step {s}"
            continue
        fit.apply(state, meta["tree"], tensors)
        return int(meta.get("step", s))
    # No rank restored: they end the same way, whatever happened to their own state.
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
        why = f" ({picked.why_not()})" if picked is not None and picked.skipped else ""
        raise NoCheckpointError(f"{run_dir}: checkpoint of step {step} is not valid{why}")
    return None


# -- rolling back in the training loop ------------------------------------------------------------

# In the run directory (its name is the core's: cpp/core/run_dir.h): the rollbacks so far, so a requeued run skips alike.
ROLLBACKS_FILE = _core.run_dir_names["rollbacks"]
_ROLLBACKS_FORMAT = 1
SPIKE_WINDOW = 8  # the finite losses the spike rule takes the median of (Rollback's default window, the save's)
_ROLLBACKS_MAX_BYTES = 1 << 20


def loss_problem(value: float, recent: Sequence[float], spike_factor: float | None) -> str | None:
    """What is wrong with one loss value, or None when it is fine: the one health rule of a loss.

    Not finite (NaN, +inf, -inf) is always bad. With ``spike_factor``, a loss above ``spike_factor``
    times the median of ``recent`` (the finite losses just before it) is a spike; fewer than two
    recent values, or a median <= 0, decide nothing. Free of state, so a save path can ask it too.
    """
    if math.isnan(value):
        return "loss is nan"
    if math.isinf(value):
        return f"loss is {'+inf' if value > 0 else '-inf'}"
    if spike_factor is None or len(recent) < 2:
        return None
    median = statistics.median(recent)
    if median > 0 and value > spike_factor * median:
        return (f"loss {value:.6g} is above {spike_factor:g} x the median {median:.6g} of the last "
                f"{len(recent)}")
    return None


@dataclass(frozen=True)
class RollbackRecord:
    """One rollback: the loss of ``from_step`` was bad (``reason``), the state went back to ``to_step``,
    and the ``skip`` batches after ``to_step`` are skipped on the way forward again. ``wait_s``: waiting
    for saves in flight; ``restore_s``: the restore itself (the rollback's whole in-process cost)."""

    from_step: int
    to_step: int
    reason: str
    skip: int
    wait_s: float = 0.0
    restore_s: float = 0.0


def _record_from(obj: Any, where: str) -> RollbackRecord:
    """A record read back from the file, its types checked (a hand-edited file says what is wrong)."""
    ints = ("from_step", "to_step", "skip")
    if (not isinstance(obj, dict) or any(type(obj.get(k)) is not int or obj[k] < 0 for k in ints)
            or not isinstance(obj.get("reason"), str)):
        raise CheckpointError(f"{where}: a rollback record needs from_step, to_step and skip (integers >= 0) and "
                              f"a reason (text); found {obj!r:.200}")
    times = {k: float(obj[k]) for k in ("wait_s", "restore_s") if type(obj.get(k)) in (int, float)}
    return RollbackRecord(obj["from_step"], obj["to_step"], obj["reason"], obj["skip"], **times)


def read_rollbacks(run_dir: str | os.PathLike[str]) -> list[RollbackRecord]:
    """The rollbacks recorded in ``run_dir`` (:data:`ROLLBACKS_FILE`), oldest first; none without the file.
    Plain JSON, never a pickle; a file that is not what :class:`Rollback` writes is a CheckpointError."""
    path = Path(run_dir) / ROLLBACKS_FILE
    try:
        raw = read_small(path, _ROLLBACKS_MAX_BYTES, follow=False)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the rollback records: {e.strerror or e}") from e
    if len(raw) > _ROLLBACKS_MAX_BYTES:
        raise CheckpointError(f"{path}: over {_ROLLBACKS_MAX_BYTES} bytes: not a file of alpsck's")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e}); remove it to forget the rollbacks") from None
    if not isinstance(doc, dict) or doc.get("format") != _ROLLBACKS_FORMAT or not isinstance(doc.get("rollbacks"), list):
        raise CheckpointError(f"{path}: expected {{'format': {_ROLLBACKS_FORMAT}, 'rollbacks': [...]}}")
    return [_record_from(r, str(path)) for r in doc["rollbacks"]]


def _write_rollbacks(run_dir: Path, records: Sequence[RollbackRecord]) -> None:
    """Replace the records durably: a temp file, fsync, rename, fsync of the directory (a power
    loss leaves the old list or the new one, never a torn one)."""
    path = run_dir / ROLLBACKS_FILE
    data = json.dumps({"format": _ROLLBACKS_FORMAT, "rollbacks": [asdict(r) for r in records]}, indent=1).encode()
    replace_durably(path, data, temp_name(str(path)))


class _Restorer(Protocol):
    """What :class:`Rollback` needs of a checkpointer (:class:`alpsck.Checkpointer` is one)."""

    run_dir: Path
    rank: int

    def wait(self) -> None: ...

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                allow_unhealthy: bool = False) -> int | None: ...


class Rollback:
    """Roll a training back in-process when its loss goes bad, instead of training on from garbage.

    ``check(step, loss)`` after each step: a fine loss returns None; a bad one (:func:`loss_problem`:
    not finite, or with ``spike_factor`` a spike over the median of the last ``window`` finite losses)
    waits for the saves in flight, restores the newest healthy checkpoint into ``state`` (the picker
    skips the unhealthy ones) and returns its step: the caller continues its loop from there. Each
    rollback is recorded durably in the run directory (:data:`ROLLBACKS_FILE`, rank 0 writes it), so a
    requeued run constructing a Rollback on the same directory knows them: :meth:`skip_before` tells
    the data loader how many batches to skip (``skip_batches``; None: as many as the steps rolled
    back, the window that led to the bad loss), the same after a requeue as in-process. After
    ``max_rollbacks`` rollbacks of the run, the next bad loss raises :class:`RollbackLimitError`.
    ``on_rollback`` (e.g. a history event) is called with each new record. ``forget=True``: a run that
    starts afresh on a used run directory (it restores nothing on purpose, so the checkpoints there are
    an abandoned history) drops the records of that history. A run whose losses stay fine is
    untouched: nothing is read back, nothing is skipped. The spike window starts empty at each start.

    With several ranks, every rank must call :meth:`roll_back` together (the restore is a collective):
    agree on :meth:`problem` first (an all-reduce), as the reference training does.
    """

    def __init__(self, checkpointer: _Restorer, state: MutableMapping[str, Any], *, max_rollbacks: int = 3,
                 skip_batches: int | None = None, spike_factor: float | None = None, window: int = SPIKE_WINDOW,
                 on_rollback: Callable[[RollbackRecord], None] | None = None, forget: bool = False) -> None:
        if type(max_rollbacks) is not int or max_rollbacks < 0:
            raise UsageError(f"max_rollbacks must be an integer >= 0, not {max_rollbacks!r}")
        if skip_batches is not None and (type(skip_batches) is not int or skip_batches < 0):
            raise UsageError(f"skip_batches must be None or an integer >= 0, not {skip_batches!r}")
        if spike_factor is not None:  # the options table's limits (0: off, as None)
            check_option("spike_factor", spike_factor)
            spike_factor = spike_factor or None
        if type(window) is not int or window < 2:
            raise UsageError(f"window must be an integer >= 2, not {window!r}")
        self.checkpointer, self.state = checkpointer, state
        self.max_rollbacks, self.skip_batches, self.spike_factor = max_rollbacks, skip_batches, spike_factor
        self.window, self.on_rollback = window, on_rollback
        self.records: list[RollbackRecord] = [] if forget else read_rollbacks(checkpointer.run_dir)
        path = Path(checkpointer.run_dir) / ROLLBACKS_FILE
        if forget and checkpointer.rank == 0 and path.exists():  # the old records would skip data in a new history
            _write_rollbacks(Path(checkpointer.run_dir), [])
        self._recent: list[tuple[int, float]] = []  # (step, loss) of the last `window` fine losses

    def problem(self, step: int, loss: float) -> str | None:
        """What is wrong with the loss of ``step`` (None: fine, and it joins the spike window)."""
        why = loss_problem(loss, [v for _, v in self._recent], self.spike_factor)
        if why is None:
            self._recent = [*self._recent, (step, loss)][-self.window:]
        return why

    def check(self, step: int, loss: float) -> int | None:
        """None when the loss of ``step`` is fine, else :meth:`roll_back` and the step restored (one rank)."""
        why = self.problem(step, loss)
        return None if why is None else self.roll_back(step, why)

    def roll_back(self, step: int, reason: str) -> int:
        """Restore the newest healthy checkpoint because the loss of ``step`` was bad; its step.

        Raises RollbackLimitError after ``max_rollbacks`` rollbacks, and NoCheckpointError when no
        checkpoint older than ``step`` is left to go back to."""
        run_dir = self.checkpointer.run_dir
        if len(self.records) >= self.max_rollbacks:
            raise RollbackLimitError(
                f"{run_dir}: step {step}: {reason}, after {len(self.records)} rollback(s) already: max_rollbacks "
                f"({self.max_rollbacks}) reached; giving up (do not requeue: it would diverge again). The rollbacks: "
                + "; ".join(f"{r.from_step} -> {r.to_step} ({r.reason})" for r in self.records))
        t0 = time.perf_counter()
        self.checkpointer.wait()  # a save in flight may be the newest healthy checkpoint
        t1 = time.perf_counter()
        restored = self.checkpointer.restore(self.state)
        t2 = time.perf_counter()
        if restored is None or restored >= step:
            raise NoCheckpointError(f"{run_dir}: step {step}: {reason}, and no healthy checkpoint before step {step} "
                                    "to roll back to")
        skip = step - restored if self.skip_batches is None else self.skip_batches
        rec = RollbackRecord(step, restored, reason, skip, round(t1 - t0, 6), round(t2 - t1, 6))
        self.records.append(rec)
        if self.checkpointer.rank == 0:
            _write_rollbacks(Path(run_dir), self.records)
        self._recent = [(s, v) for s, v in self._recent if s <= restored]
        if self.on_rollback is not None:
            self.on_rollback(rec)
        return restored

    def skip_before(self, step: int) -> int:
        """How many batches to skip before drawing the batch of ``step``: those of every rollback to
        ``step - 1`` (0 without rollbacks). A pure function of the records, so a requeued run that
        restores a step before a rolled-back window skips it again, and one restoring after it not twice."""
        return sum(r.skip for r in self.records if r.to_step == step - 1)

    def rolled_back_from(self, step: int) -> bool:
        """Whether a rollback from ``step`` is recorded (a test's injected fault fires once only)."""
        return any(r.from_step == step for r in self.records)
