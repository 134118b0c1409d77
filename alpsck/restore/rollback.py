"""Rolling back in the training loop (:class:`Rollback`) when its loss goes bad, and the record of the
rollbacks in the run directory (:data:`ROLLBACKS_FILE`, :func:`read_rollbacks`), so a requeued run skips alike."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import _core
from ..errors import CheckpointError, NoCheckpointError, RollbackLimitError, UsageError
from ..options import check as check_option
from ..store.durable import read_small, replace_durably
from ..store.names import temp_name
from .health import SPIKE_WINDOW, loss_problem

# In the run directory (its name is the core's: cpp/core/run_dir.h): the rollbacks so far, so a requeued run skips alike.
ROLLBACKS_FILE = _core.run_dir_names["rollbacks"]
_ROLLBACKS_FORMAT = 1
_ROLLBACKS_MAX_BYTES = 1 << 20


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
