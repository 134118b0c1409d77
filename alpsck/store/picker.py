"""Which checkpoint a restore uses, and why not the newer ones: the one picker (:func:`pick`; every reader
asks it), which checkpoint a step or "the newest" names (:func:`pick_checkpoint`), and the data-CRC check of
a whole checkpoint (:func:`data_error`)."""

from __future__ import annotations

import dataclasses
import errno
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import CheckpointError, CheckpointIOError, NoCheckpointError, UsageError
from ..options import DEFAULTS
from .scan import ACCESS_ERRNOS, open_shard


def taken_at_of(info: Mapping[str, Any] | None) -> float | None:
    """When a checkpoint's state was taken (unix seconds): its manifest's time less its write's duration."""
    created, took = (info or {}).get("created"), (info or {}).get("write_seconds")
    if not isinstance(created, (int, float)) or not created > 0:
        return None
    return float(created) - (float(took) if isinstance(took, (int, float)) and 0 <= took < created else 0.0)


def taken_at(directory: str | os.PathLike[str], step: int) -> float | None:
    """:func:`taken_at_of` the checkpoint of ``step`` in ``directory`` (None where it cannot be read: gone)."""
    try:
        return taken_at_of(pick(directory, step=step, allow_unhealthy=True).info)
    except (CheckpointError, OSError):
        return None


def pick_checkpoint(run_dir: str | os.PathLike[str], step: int | None, *, kind: str = "any") -> tuple[dict[str, Any], Pick]:
    """The checkpoint of ``step`` (any status, to report it), or the one :func:`pick` picks when step is None;
    with the pick itself (its candidates and what it skipped).

    A missing step raises NoCheckpointError naming it and listing the steps that exist; no usable
    checkpoint at all, NoCheckpointError saying why the newer ones were skipped.
    """
    p = pick(run_dir, kind=kind, step=step, allow_unhealthy=step is not None)  # a named step, whatever its health
    if p.info is not None:
        return p.info, p
    if step is None:
        why = p.why_not()
        raise NoCheckpointError(f"{run_dir}: no valid checkpoint" + (f" ({why})" if why else ""))
    found = [i for i in p.scanned if i["step"] == step]
    if not found:
        avail = ", ".join(f"{i['step']} ({i['status']})" for i in p.scanned) or "none"
        raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}; available: {avail}")
    # Only step-N directories are checkpoints: the step-N one (its status says why it is not used), else an attempt.
    found.sort(key=lambda i: i["status"] == "incomplete")
    return found[0], p


REASONS = ("damaged", "corrupt", "unreadable", "incomplete", "aborted", "other_kind", "other_world", "unhealthy",
           "data_crc")
KINDS = ("any", "alpsck", "dcp")
# An attempt (a save in flight, or one a crash or an abort left): expected, so the readers skip it without
# a warning (inspect-checkpoints --json lists it in ``skipped`` all the same).
QUIET_REASONS = ("incomplete", "aborted")


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A step newer than the pick, and why it was not picked (``reason`` one of :data:`REASONS`)."""

    step: int
    path: str
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}: {self.message}"

    @property
    def quiet(self) -> bool:
        """An attempt (in flight, abandoned or aborted): expected, so readers skip it without a warning."""
        return self.reason in QUIET_REASONS

    def warning(self) -> str:
        """What every reader says when it skips this step (restore, peek, the DCP reader, export): one wording."""
        what = "corrupt" if self.reason == "data_crc" else self.reason.replace("_", "-")
        return f"skipping {what} checkpoint {self.path} (step {self.step}: {self.reason}): {self.message}"


def metrics_text(metrics: Mapping[str, float]) -> str:
    """A checkpoint's metrics in one line, ``loss=2.31 val_loss=nan``: four significant digits."""
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def read_failure(info: Mapping[str, Any], error: BaseException | str, corrupt: str = "data_crc") -> Skipped:
    """A candidate the picker passed whose reading failed, as a skipped step: ``unreadable`` for an
    access error (an OSError such as CheckpointIOError: permission denied, EIO, ESTALE; nothing is
    known about the bytes, so it is never treated as corrupt), else ``corrupt`` (``data_crc`` by
    default: its data failed a CRC; ``corrupt`` for its metadata). A str is another rank's report:
    unreadable."""
    reason = "unreadable" if isinstance(error, (OSError, str)) else corrupt
    return Skipped(int(info["step"]), str(info["path"]), reason, str(error))


@dataclasses.dataclass(frozen=True)
class Pick:
    """Which checkpoint of a run directory a restore uses (:func:`pick`).

    ``step``/``path``/``info``: the pick (None: nothing passes: a fresh start, or no such ``step``);
    ``candidates``: the pick first, then every older one passing the quick rule, newest first (what a
    reader tries next when reading the pick's data fails); ``skipped``: every step newer than the pick,
    newest first, with its reason; ``scanned``: every entry of the run directory (``_core.scan``'s
    dicts, ascending; with ``verify_all`` every committed one verified).
    """

    step: int | None
    path: str | None
    info: dict[str, Any] | None
    candidates: tuple[dict[str, Any], ...]
    skipped: tuple[Skipped, ...]
    scanned: tuple[dict[str, Any], ...]

    @property
    def steps(self) -> list[int]:
        """The candidates' steps, newest first."""
        return [int(c["step"]) for c in self.candidates]

    def why_not(self, limit: int = 3) -> str:
        """The skipped steps in one line (for an error message), or ''."""
        if not self.skipped:
            return ""
        more = len(self.skipped) - limit
        return "; ".join(f"step {k.step}: {k.reason}: {k.message}" for k in self.skipped[:limit]) + (
            f"; and {more} more" if more > 0 else "")


def pick(
    run_dir: str | os.PathLike[str],
    *,
    verify_data: bool = False,
    verify_all: bool = False,
    kind: str = "any",
    step: int | None = None,
    max_step: int | None = None,
    world_size: int | None = None,
    threads: int = DEFAULTS["read_threads"],
    progress: Callable[[int], None] | None = None,
    allow_unhealthy: bool = False,
) -> Pick:
    """Which checkpoint of ``run_dir`` a restore uses, and why not the newer ones: the one picker.

    The rule (docs/guarantees.md, "Which checkpoint a restore uses"): only ``step-N`` directories count
    (an attempt beside a committed step of the same number is irrelevant); newest first, within
    ``step`` (exactly) or ``max_step`` (at most); each must pass the quick check (manifest, shard
    footers and indexes, extra files), be of ``kind`` ("alpsck": Checkpointer's, "dcp": one that
    committed ``dcp-metadata.json``, "any"), have ``world_size`` ranks (None: any), unless
    ``allow_unhealthy`` have only finite metrics (what ``save(..., metrics=)`` recorded: a NaN or
    infinite loss is a diverged run's checkpoint, skipped as ``unhealthy``) and, with
    ``verify_data``, every chunk CRC (checked lazily, newest first, up to the first that passes).
    ``verify_all`` verifies every committed checkpoint (for a listing of them all).

    A missing ``run_dir`` raises NoCheckpointError; one this user may not list, CheckpointIOError saying so.
    """
    if kind not in KINDS:
        raise UsageError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    try:
        d = _core.pick(str(run_dir), verify_data=verify_data, verify_all=verify_all, kind=kind, step=step,
                       max_step=max_step, world_size=world_size or 0, threads=threads, progress=progress,
                       allow_unhealthy=allow_unhealthy)
    except CheckpointIOError as e:
        if e.errno == errno.ENOENT:
            raise NoCheckpointError(f"{run_dir}: no such directory, so no checkpoint") from None
        if e.errno in ACCESS_ERRNOS:  # still a CheckpointIOError: restore_into's ranks report it as such
            raise CheckpointIOError(e.errno, f"{run_dir}: permission denied ({e.strerror or e}); run as the user "
                                    "who owns the run or fix its permissions") from None
        raise
    return Pick(step=d["step"], path=d["path"], info=d["info"], candidates=tuple(d["candidates"]),
                skipped=tuple(Skipped(**k) for k in d["skipped"]), scanned=tuple(d["scanned"]))


def data_error(info: dict[str, Any]) -> Skipped | None:
    """None if every chunk of every shard of a committed checkpoint matches its CRC, else why it is
    skipped (:func:`read_failure`: ``data_crc``, or ``unreadable`` when reading failed for a
    reason other than its bytes)."""
    try:
        for name in info["shards"]:
            open_shard(Path(info["path"]) / name).verify(DEFAULTS["read_threads"])
    except CheckpointError as e:
        return read_failure(info, e)
    return None
