"""RUN_DIR/history.jsonl: one JSON event per line, appended and fsync'ed; and the timeline view.

Events (``event`` field): submitted, started, signal, final_checkpoint, requeued, finished,
failed, cancelled, gave_up (a start that resumes says so in ``started``'s ``step``). Each carries
``time`` (unix seconds), ``job_id`` and, where it applies, ``reason`` (timeout, preemption,
maintenance, cancel, requeue, term, failure: see :mod:`alpsck.slurm.stop`), ``step``,
``seconds``, ``restart``, ``host``, ``message``. Appends are single ``write`` calls of one line
with O_APPEND, so concurrent writers (several ranks, the batch script's EXIT trap) never
interleave within a line.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .. import _core
from ..store.durable import open_own, read_small

HISTORY = _core.run_dir_names["history"]  # the run directory's names belong to the core (run_dir.h)
STATES = ("pending", "running", "requeued", "finished", "failed", "cancelled", "gave_up", "timeout")
# (timeout: SLURM ended the job at its time limit with no requeue recorded; see alpsck.slurm.watch.reconcile)
MAX_BYTES = 1 << 28  # what read() takes of the log: ~1 million events


def record(event: str, **fields: Any) -> dict[str, Any]:
    """One event as it is stored: ``time``, ``event``, the fields that are not None, ``host``."""
    rec: dict[str, Any] = {"time": round(time.time(), 3), "event": event}
    rec.update({k: v for k, v in fields.items() if v is not None})
    rec.setdefault("host", socket.gethostname())
    return rec


def line(rec: dict[str, Any]) -> str:
    """The stored form of an event: one line of JSON (no newline inside it)."""
    return json.dumps(rec, sort_keys=False)


def append(run_dir: str | os.PathLike[str], event: str, **fields: Any) -> dict[str, Any]:
    """Append one event (durably) and return it. A log that cannot be written (a symlink or a
    FIFO in its place, a full disk) is a warning on stderr, not the end of the job it records."""
    rec = record(event, **fields)
    data = (line(rec) + "\n").encode()
    path = Path(run_dir) / HISTORY
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        fd = open_own(path, append=True)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        print(f"alpsck: warning: cannot record {event!r} in {path}: {e.strerror or e}", file=sys.stderr, flush=True)
    return rec


def read(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events; a torn line (a crash mid-append) or a foreign one is skipped: an event is an
    object with a string ``event`` and a finite number ``time`` (status formats both)."""
    path = Path(run_dir) / HISTORY
    try:  # none, or not a regular file (a FIFO, a directory): no events
        text = read_small(path, MAX_BYTES).decode(errors="replace")
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if (isinstance(rec, dict) and isinstance(rec.get("event"), str) and isinstance(rec.get("time"), (int, float))
                and not isinstance(rec["time"], bool) and math.isfinite(rec["time"]) and abs(rec["time"]) < 1e11):
            events.append(rec)
    return events


def state_of(events: list[dict[str, Any]]) -> str:
    """The job's state from its newest decisive event."""
    for e in reversed(events):
        ev = e["event"]
        if ev == "finished":
            return "finished"
        if ev == "gave_up":
            return "gave_up"
        if ev == "cancelled":
            return "cancelled"
        if ev == "failed" and not e.get("will_requeue"):
            return "failed"
        if ev == "requeued":
            return "requeued"
        if ev in ("started", "signal", "final_checkpoint"):
            return "running"
        if ev == "submitted":
            return "pending"
    return "pending"


def summary(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    events = read(run_dir)
    starts = [e for e in events if e["event"] == "started"]
    steps = [e["step"] for e in events if isinstance(e.get("step"), int)]
    job_ids = []
    for e in events:
        if e.get("job_id") and e["job_id"] not in job_ids:
            job_ids.append(e["job_id"])
    return {
        "run_dir": str(run_dir),
        "state": state_of(events),
        "job_ids": job_ids,
        "starts": len(starts),
        "requeues": sum(1 for e in events if e["event"] == "requeued"),
        "last_step": max(steps) if steps else None,
        "events": events,
    }
