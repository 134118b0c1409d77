"""``alpsck status``'s report: built here from the run's timeline, SLURM's view of its job, the checkpoint a
resume uses and the scratch's purge window; :mod:`alpsck.slurm.cli` only prints it (text, or its JSON form).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import AlpsckError, CheckpointError
from . import goodput, history, stragglers, timeline, watch
from .history import Interval, Started, Straggler
from .timeline import Timeline


@dataclass(frozen=True)
class StatusReport:
    """What ``alpsck status`` says of a run; :meth:`as_json` is its ``--json`` document (keys documented in
    docs/slurm.md). ``log_end``: the history's size when read, where ``--follow`` goes on from."""

    run_dir: str
    state: str
    job_ids: list[str]
    starts: int
    requeues: int
    last_step: int | None
    events: list[dict[str, Any]]  # the newest ``shown``, as read
    earlier_events: int           # read but not shown
    malformed_lines: int
    unread_bytes: int             # older log not read at all
    note: str | None
    log: str | None
    log_tail: list[str]
    slurm: dict[str, Any] | None
    metrics: dict[str, Any]
    unhealthy: list[dict[str, Any]]
    purge: dict[str, Any]
    backend: str | None
    host: str | None
    watchers_off: dict[str, str]
    goodput: dict[str, Any] | None
    interval: dict[str, Any] | None
    cordoned: list[dict[str, Any]]  # the nodes kept out of the run: node, reason, checks, since, job_id
    stragglers: list[dict[str, Any]]  # the nodes named as stragglers (stragglers.named)
    log_end: int = 0

    def as_json(self) -> dict[str, Any]:
        """The ``--json`` document: every field but ``log_end``, in the order declared."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "log_end"}


def history_path(run_dir: Path) -> Path:
    """RUN_DIR's job history, or AlpsckError saying why it has none to read."""
    if not run_dir.is_dir():
        raise AlpsckError(f"{run_dir}: {'not a directory' if run_dir.exists() else 'no such directory'}")
    path = run_dir / history.HISTORY
    if not path.exists():
        raise AlpsckError(f"{run_dir}: no {history.HISTORY} (not a run directory of a submitted job)")
    if path.is_symlink() or not path.is_file():
        raise AlpsckError(f"{path}: not a regular file, so it holds no job history")
    return path


def purge(run_dir: Path, days: int | None) -> dict[str, Any]:
    """The purge window (``--purge-days``, else the scratch's: storage.purge_days) and a warning
    when the newest checkpoint nears it."""
    from ..store.storage import newest_committed, purge_days, purge_warning

    days = purge_days(run_dir) if days is None else days or None
    out: dict[str, Any] = {"days": days, "warning": None}
    if days is None:
        return out
    newest = newest_committed(run_dir)  # before anything reads a checkpoint (a read resets the clock)
    if newest is not None:
        out["warning"] = purge_warning(newest, days, time.time())
    return out


def where(tl: Timeline) -> dict[str, Any]:
    """Where the newest job ran (``backend``: slurm or local; ``host``: the submitting host for a local
    one, which on a cluster is a login node) and the watchers its newest start could not run."""
    sub = tl.last_submission()
    start = tl.newest(Started)
    off = start.maintenance_watch if start is not None else None
    return {"backend": sub.get("backend") if sub else None,
            "host": sub.get("host") if sub and sub.get("backend") == "local" else None,
            "watchers_off": {"maintenance": off} if isinstance(off, str) else {}}


def _checkpoint(run_dir: Path) -> tuple[int | None, dict[str, Any], list[dict[str, Any]]]:
    """The checkpoint a resume uses (the picker's): its step, its save's metrics, and the newer ones
    skipped as unhealthy."""
    from ..store.picker import pick

    try:
        picked = pick(str(run_dir))  # the one a resume uses, and why not the newer ones
    except (CheckpointError, OSError):
        return None, {}, []
    unhealthy = [{"step": k.step, "message": k.message} for k in picked.skipped if k.reason == "unhealthy"]
    return picked.step, (picked.info or {}).get("metrics") or {}, unhealthy


def report(run_dir: Path, *, shown: int, purge_days: int | None) -> StatusReport:
    """The status of the run in ``run_dir`` with its newest ``shown`` events; AlpsckError when it has no
    history to read."""
    path = history_path(run_dir)
    window = purge(run_dir, purge_days)  # first: what follows reads the checkpoints
    log = history.read_log(run_dir)
    if not log.events:  # "pending" would claim a job that nothing here records
        raise AlpsckError(f"{path}: no readable event in {'its newest' if log.start else 'its'} {log.lines} line(s): "
                          "not a job history, or damaged")
    tl = timeline.fold(log.events)
    rec = watch.reconcile(run_dir, tl)
    last_step = tl.last_step
    # During a start, the newest committed checkpoint says more than the events (written at a start's ends).
    on_disk, metrics, unhealthy = _checkpoint(run_dir)
    if on_disk is not None and (last_step is None or on_disk > last_step):
        last_step = on_disk
    shown_events = log.events[-shown:] if shown > 0 else []
    chosen = tl.newest(Interval)  # checkpoint.every: auto
    return StatusReport(
        run_dir=str(run_dir), state=rec["state"], job_ids=tl.job_ids, starts=len(tl.starts_of()),
        requeues=tl.requeues(), last_step=last_step, events=shown_events,
        earlier_events=len(log.events) - len(shown_events), malformed_lines=log.malformed, unread_bytes=log.start,
        note=rec["note"], log=rec["log"], log_tail=rec["log_tail"], slurm=rec["slurm"], metrics=metrics,
        unhealthy=unhealthy, purge=window, **where(tl),
        goodput=goodput.goodput(tl),  # of the events read (the newest 8 MiB of the history)
        interval=({k: chosen.get(k) for k in ("seconds", "save_cost_s", "mtbf_s", "mtbf_from", "time")}
                  if chosen else None),
        cordoned=[{"node": node, "reason": e.reason, "checks": e.checks, "since": e.time, "job_id": e.job_id}
                  for node, e in tl.cordoned().items()],
        stragglers=stragglers.named(tl.of_kind(Straggler)),
        log_end=log.end)
