"""RUN_DIR/history.jsonl: one JSON event per line, appended and fsync'ed; and the timeline view.

Events (``event`` field): submitted, started, signal, final_checkpoint, requeued, finished,
failed, cancelled, gave_up (a start that resumes says so in ``started``'s ``step``), and rollback
(the training restored an earlier checkpoint in-process after a bad loss: ``step`` restored,
``from_step`` whose loss was bad, ``reason``, ``skip`` batches skipped, ``seconds`` it took). Each carries
``time`` (unix seconds), ``job_id`` and, where it applies, ``reason`` (timeout, preemption,
maintenance, cancel, requeue, term, failure: see :mod:`alpsck.slurm.stop`), ``step``,
``seconds``, ``restart``, ``host``, ``message``. Appends are single ``write`` calls of one line
with O_APPEND, so concurrent writers (several ranks, the batch script's EXIT trap) never
interleave within a line.

Whoever can write the run directory can write anything into the log. :func:`read_log`, the one
reader, takes the log from its end (the newest events decide the state; at most ``MAX_BYTES`` of
it, so memory and time stay bounded however long it grows), and :func:`normalise`, the one check,
turns each line into an event whose fields every caller may use as they are, or skips it.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import _core
from ..store.durable import append_durably, open_regular, read_at

HISTORY = _core.run_dir_names["history"]  # the run directory's names belong to the core (run_dir.h)
STATES = ("pending", "running", "requeued", "finished", "failed", "cancelled", "gave_up", "timeout")
# (timeout: SLURM ended the job at its time limit with no requeue recorded; see alpsck.slurm.watch.reconcile)
MAX_BYTES = 8 << 20  # what read_log() takes of the log, from its end: ~50,000 events
MAX_TIME = 1e11  # an event's time is unix seconds in [0, MAX_TIME): every calendar function takes it
# A job id that may name a file (its log, RUN_DIR/submitit/<id>_0_log.out) or be asked of SLURM:
# a SLURM job id (an array task's ARRAYID_TASK) or the local executor's controller pid.
JOB_ID = re.compile(r"[0-9]{1,20}(?:_[0-9]{1,20})?")
MAX_DEPTH = 16  # arrays and objects in a field's value: a deeper one would exhaust the recursion of what prints it


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _real(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


def _shallow(v: Any) -> bool:
    """Whether ``v`` nests at most MAX_DEPTH arrays and objects deep (found without recursion)."""
    stack = [(v, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list)):
            if depth >= MAX_DEPTH:
                return False
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


# The fields alpsck's code reads, and the type each must have (null counts as absent).
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "job_id": _text, "backend": _text, "reason": _text, "message": _text, "mechanism": _text, "host": _text,
    "step": _count, "restart": _count, "resume_step": _count, "seconds": _real,
    "progress": _flag, "will_requeue": _flag, "will_restart": _flag, "attempt": _count, "exit_code": _count,
    "down_s": _real, "time_of_end": _real, "section": _text, "timeout_s": _real, "polls": _count,
    "start_s": _real, "step_s": _real, "save_s": _real, "restore_s": _real, "final_s": _real,
    "save_cost_s": _real, "mtbf_s": _real, "mtbf_from": _text, "from_step": _count, "skip": _count}


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
        append_durably(path, data)
    except OSError as e:
        print(f"alpsck: warning: cannot record {event!r} in {path}: {e.strerror or e}", file=sys.stderr, flush=True)
    return rec


def is_job_id(value: Any) -> bool:
    """Whether ``value`` is a job id that may be used in a path or asked of SLURM (:data:`JOB_ID`)."""
    return isinstance(value, str) and JOB_ID.fullmatch(value) is not None


def normalise(rec: Any) -> dict[str, Any] | None:
    """The one check of an event read from a log: None (not an event) unless ``rec`` is an object
    with a non-empty string ``event`` and a number ``time`` in [0, MAX_TIME); a ``submitted``
    event must also name its job by an id :func:`is_job_id` accepts (it names the job's log file,
    and status asks SLURM about it). A field alpsck reads (:data:`_CHECKS`) whose value has the
    wrong type (a string ``step``, a number ``job_id``) is dropped and named in the event's
    ``malformed`` list, as is any field nested deeper than MAX_DEPTH; any other field is kept as
    it is, whatever JSON value it holds."""
    if not isinstance(rec, dict):
        return None
    ev, t = rec.get("event"), rec.get("time")
    if not isinstance(ev, str) or not ev or not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    if not 0 <= t < MAX_TIME:  # also NaN
        return None
    if ev == "submitted" and not is_job_id(rec.get("job_id")):
        return None
    bad = [k for k, ok in _CHECKS.items() if rec.get(k) is not None and not ok(rec[k])]
    bad += [k for k, v in rec.items() if isinstance(v, (dict, list)) and k not in bad and not _shallow(v)]
    if bad or "malformed" in rec:
        rec = {k: v for k, v in rec.items() if k not in bad and k != "malformed"}
        if bad:
            rec["malformed"] = bad
    return rec


def _event(raw: bytes) -> dict[str, Any] | None:
    try:
        return normalise(json.loads(raw.decode(errors="replace")))
    except (ValueError, RecursionError):  # not JSON (a torn line), an integer of over 4300 digits, too deep
        return None


@dataclass(frozen=True)
class Log:
    """What :func:`read_log` read: the events (oldest first) of the lines from byte ``start`` to
    ``end``; ``malformed`` of those ``lines`` were no event. ``start`` > 0: the older part of the
    log was not read."""

    events: list[dict[str, Any]]
    lines: int = 0
    malformed: int = 0
    start: int = 0
    end: int = 0


def read_log(run_dir: str | os.PathLike[str], *, since: int = 0, max_bytes: int | None = None) -> Log:
    """The events of the log's lines from byte ``since`` (a former read's ``end``) on, but at most
    its last ``max_bytes`` (default :data:`MAX_BYTES`; whole lines only: a line cut there is left
    out). No log, a symlink (alpsck never appends through one), a FIFO or a directory in its
    place: no events. A ``since`` past the end (the log was replaced) reads from the start."""
    try:
        fd = open_regular(Path(run_dir) / HISTORY, follow=False)
    except OSError:
        return Log([])
    try:
        size = os.fstat(fd).st_size
        since = since if 0 <= since <= size else 0
        start = max(since, size - (MAX_BYTES if max_bytes is None else max_bytes))
        if start > since:  # cut: from the byte before, to see whether the cut falls at a line's start
            data = read_at(fd, start - 1, size - start + 1)
            nl = data.find(b"\n")
            start, data = (size, b"") if nl < 0 else (start + nl, data[nl + 1:])
        else:
            data = read_at(fd, start, size - start)
    except OSError:
        return Log([])
    finally:
        os.close(fd)
    raw = data.split(b"\n")
    if raw[-1] == b"":
        raw.pop()
    events = [e for e in map(_event, raw) if e is not None]
    return Log(events, len(raw), len(raw) - len(events), start, start + len(data))


def read(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The newest events (:func:`read_log`), oldest first."""
    return read_log(run_dir).events


def submissions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events that name a job and its backend, oldest first: ``submitted``, and ``started``, which
    carries the backend too, so that a job whose ``submitted`` lies before the part of the history
    read (:func:`read_log`'s window) is still known, and asked whether it lives."""
    return [e for e in events if e["event"] in ("submitted", "started") and e.get("backend") in ("slurm", "local")
            and e.get("job_id")]


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
        if ev == "failed" and not (e.get("will_requeue") or e.get("will_restart")):
            return "failed"
        if ev == "requeued":
            return "requeued"
        if ev in ("started", "signal", "final_checkpoint"):
            return "running"
        if ev == "submitted":
            return "pending"
    return "pending"


def summary(run_dir: str | os.PathLike[str], log: Log, shown: int) -> dict[str, Any]:
    """What ``alpsck status`` says of the events read: counts over all of them, the newest
    ``shown`` as the timeline (``events``), and how much it leaves out: ``earlier_events`` read
    but not shown, ``malformed_lines``, ``unread_bytes`` of older log not read at all."""
    events = log.events
    steps = [e["step"] for e in events if e.get("step") is not None]
    job_ids = list(dict.fromkeys(e["job_id"] for e in events if e.get("job_id")))
    timeline = events[-shown:] if shown > 0 else []
    return {
        "run_dir": str(run_dir),
        "state": state_of(events),
        "job_ids": job_ids,
        "starts": sum(1 for e in events if e["event"] == "started"),
        "requeues": sum(1 for e in events if e["event"] == "requeued"),
        "last_step": max(steps) if steps else None,
        "events": timeline,
        "earlier_events": len(events) - len(timeline),
        "malformed_lines": log.malformed,
        "unread_bytes": log.start,
    }
