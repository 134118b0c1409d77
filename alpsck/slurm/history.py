"""RUN_DIR/history.jsonl, the job layer's events as a vocabulary: one record class per kind of event
(:class:`Started`, :class:`Requeued`, ... : its fields and their types), the one writer (:func:`append`)
and the one reader (:func:`read_log`). The kinds are spelled here only; every other module names them by
their record class, and reads the history only through its fold, :mod:`alpsck.slurm.timeline`.

Each event is one JSON line: ``time`` (unix seconds), ``event`` (its kind), ``job_id``, ``host`` and its
kind's fields (a stop's ``reason``: timeout, preemption, maintenance, cancel, requeue, term, failure:
see :mod:`alpsck.slurm.stop`). Appends are single ``write`` calls of one line with O_APPEND, so
concurrent writers (several ranks, the batch script's EXIT trap) never interleave within a line.

Whoever can write the run directory can write anything into the log. :func:`read_log`, the one
reader, takes the log from its end (the newest events decide the state; at most ``MAX_BYTES`` of
it, so memory and time stay bounded however long it grows), and :func:`normalise`, the one check
(each field against its declared type), turns each line into an event whose fields every caller may
use as they are, or skips it; :func:`typed` makes it its record.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from .. import _core
from ..store.durable import append_durably, make_dirs_durably, open_regular, read_at

HISTORY = _core.run_dir_names["history"]  # the run directory's names belong to the core (run_dir.h)
STATES = ("pending", "running", "requeued", "finished", "failed", "cancelled", "gave_up", "timeout")
# (timeout: SLURM ended the job at its time limit with no requeue recorded; see alpsck.slurm.watch.reconcile)
MAX_BYTES = 8 << 20  # what read_log() takes of the log, from its end: ~50,000 events
MAX_TIME = 1e11  # an event's time is unix seconds in [0, MAX_TIME): every calendar function takes it
# A job id that may name a file (its log, RUN_DIR/submitit/<id>_0_log.out) or be asked of SLURM:
# a SLURM job id (an array task's ARRAYID_TASK) or the local executor's controller pid.
JOB_ID = re.compile(r"[0-9]{1,20}(?:_[0-9]{1,20})?")
MAX_DEPTH = 16  # arrays and objects in a field's value: a deeper one would exhaust the recursion of what prints it


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


# -- the vocabulary ---------------------------------------------------------------------------------
# Every kind of event, one record class each: its fields and their types. A field's type is also the
# check :func:`normalise` makes of it when it is read back (``int``: a count >= 0; ``float``: a finite
# number; ``str``; ``bool``; anything else is kept as it is). A field the class does not name is kept in
# ``more`` (written as it is; read back as it was). These classes are the only place the kinds are spelled.


@dataclass(frozen=True, kw_only=True)
class Event:
    """What every event carries: ``time`` (unix seconds; the writer sets it), ``job_id``, ``host`` (the
    writer's, by default), and ``more``: fields its kind does not name."""

    KIND: ClassVar[str] = ""
    time: float | None = None
    job_id: str | None = None
    host: str | None = None
    more: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def kind(self) -> str:
        return self.KIND

    def get(self, name: str) -> Any:
        """A field by name, named or in ``more`` (None when absent)."""
        if name in _FIELDS_OF.get(type(self), ()):
            return getattr(self, name)
        return self.more.get(name)

    def stored(self) -> dict[str, Any]:
        """The event as it is stored: ``time``, ``event``, its fields that are not None, ``more``."""
        rec: dict[str, Any] = {"time": self.time, "event": self.kind}
        for name in _FIELDS_OF[type(self)]:
            if name not in ("time", "more", "other_kind") and getattr(self, name) is not None:
                rec[name] = getattr(self, name)
        rec.update({k: v for k, v in self.more.items() if v is not None and k not in rec})
        return rec


@dataclass(frozen=True, kw_only=True)
class Submitted(Event):
    """``alpsck submit`` handed the job to its backend."""

    KIND: ClassVar[str] = "submitted"
    backend: str | None = None
    config: str | None = None
    name: str | None = None


@dataclass(frozen=True, kw_only=True)
class Started(Event):
    """A start of the job (rank 0): the restart count, the step it resumes from and when that state was taken."""

    KIND: ClassVar[str] = "started"
    restart: int | None = None
    step: int | None = None
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None
    step_taken_at: float | None = None
    maintenance_watch: str | None = None
    attempt: int | None = None
    down_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class Crashed(Event):
    """The job step before this start died without a word (recorded by the next start)."""

    KIND: ClassVar[str] = "crashed"
    attempt: int | None = None
    exit_code: int | None = None
    time_of_end: float | None = None
    signal: str | None = None


@dataclass(frozen=True, kw_only=True)
class Signal(Event):
    """The loop saw a stop: its reason (:mod:`alpsck.slurm.stop`) and when the signal came."""

    KIND: ClassVar[str] = "signal"
    reason: str | None = None
    time_of_signal: float | None = None
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class FinalCheckpoint(Event):
    """The final checkpoint after a stop: its step and seconds since the signal."""

    KIND: ClassVar[str] = "final_checkpoint"
    reason: str | None = None
    step: int | None = None
    seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class Requeued(Event):
    """The job was requeued (``progress``: the newest checkpoint advanced in the start it ends)."""

    KIND: ClassVar[str] = "requeued"
    reason: str | None = None
    step: int | None = None
    mechanism: str | None = None
    progress: bool | None = None
    recorded_by: str | None = None


@dataclass(frozen=True, kw_only=True)
class Finished(Event):
    """The entry returned without a stop: the run is complete."""

    KIND: ClassVar[str] = "finished"
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Failed(Event):
    """The entry raised (or the job ended without recording how): whether it is retried, and why not."""

    KIND: ClassVar[str] = "failed"
    message: str | None = None
    step: int | None = None
    will_requeue: bool | None = None
    will_restart: bool | None = None
    cancelled: bool | None = None
    not_requeued: str | None = None
    recorded_by: str | None = None

    @property
    def final(self) -> bool:
        """Whether this failure ends the run (it is neither requeued nor restarted)."""
        return not (self.will_requeue or self.will_restart)


@dataclass(frozen=True, kw_only=True)
class Cancelled(Event):
    """The job was cancelled for good."""

    KIND: ClassVar[str] = "cancelled"
    step: int | None = None
    recorded_by: str | None = None


@dataclass(frozen=True, kw_only=True)
class GaveUp(Event):
    """The run gave up (exit 93: do not requeue)."""

    KIND: ClassVar[str] = "gave_up"
    message: str | None = None
    step: int | None = None
    exit_code: int | None = None


@dataclass(frozen=True, kw_only=True)
class Restored(Event):
    """A restore used another ``step`` than ``resume_step`` (the run directory's pick at the start): it fell back
    (the newer one failed its check), or it came from the memory tier (as new or newer); ``tier``: where it came from
    (``memory``, ``replica`` or ``run_dir``; absent in runs before the memory tier: the run directory)."""

    KIND: ClassVar[str] = "restored"
    step: int | None = None
    resume_step: int | None = None
    tier: str | None = None
    taken_at: float | None = None  # when the restored state was taken (goodput's work lost), as Started's step_taken_at


@dataclass(frozen=True, kw_only=True)
class Times(Event):
    """Where a start's time went, by section (:mod:`alpsck.slurm.watchdog`): goodput's parts."""

    KIND: ClassVar[str] = "times"
    attempt: int | None = None
    start_s: float | None = None
    step_s: float | None = None
    save_s: float | None = None
    restore_s: float | None = None
    final_s: float | None = None
    polls: int | None = None
    first_step_s: float | None = None
    longest: dict[str, Any] | None = None
    seen: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Hang(Event):
    """The hang watchdog ended a start: the section and the seconds without progress."""

    KIND: ClassVar[str] = "hang"
    section: str | None = None
    seconds: float | None = None
    timeout_s: float | None = None
    attempt: int | None = None


@dataclass(frozen=True, kw_only=True)
class Interval(Event):
    """``checkpoint.every: auto`` chose an interval, and the numbers it came from."""

    KIND: ClassVar[str] = "interval"
    seconds: float | None = None
    save_cost_s: float | None = None
    mtbf_s: float | None = None
    mtbf_from: str | None = None
    rule: str | None = None


@dataclass(frozen=True, kw_only=True)
class Rollback(Event):
    """The training restored an earlier checkpoint in-process after a bad loss."""

    KIND: ClassVar[str] = "rollback"
    step: int | None = None
    from_step: int | None = None
    reason: str | None = None
    skip: int | None = None
    seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class Cordoned(Event):
    """A node is kept out of the run from now on (:mod:`alpsck.slurm.health_gate`): which, why (``reason``: the
    failed checks' findings; ``checks``: their names) and at which attempt of which job it was found."""

    KIND: ClassVar[str] = "cordoned"
    node: str | None = None
    reason: str | None = None
    checks: str | None = None
    attempt: int | None = None


@dataclass(frozen=True, kw_only=True)
class Traced(Event):
    """A failed job step traced to the node it failed on first (:mod:`alpsck.slurm.trace`): the ``attempt`` whose
    step it was, the ``node``, the ``task`` (rank) and srun's word for it (``message``)."""

    KIND: ClassVar[str] = "traced"
    attempt: int | None = None
    node: str | None = None
    task: int | None = None
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """A rank persistently slower than its peers at the saves of one start (:mod:`alpsck.slurm.stragglers`): its
    ``node`` and ``rank``, ``factor`` (the median over ``saves`` saves of its own work over its peers' median),
    ``work_s`` and ``peers_s`` (those medians), ``late_s`` (the median of how much later than its peers' median it
    arrived at the agreement), at which ``attempt``."""

    KIND: ClassVar[str] = "straggler"
    node: str | None = None
    rank: int | None = None
    factor: float | None = None
    work_s: float | None = None
    peers_s: float | None = None
    late_s: float | None = None
    saves: int | None = None
    attempt: int | None = None


@dataclass(frozen=True, kw_only=True)
class Other(Event):
    """An event of a kind this version does not know (a newer writer's, or written by hand): kept."""

    other_kind: str = ""

    @property
    def kind(self) -> str:
        return self.other_kind


KINDS: dict[str, type[Event]] = {c.KIND: c for c in (
    Submitted, Started, Crashed, Signal, FinalCheckpoint, Requeued, Finished, Failed, Cancelled, GaveUp, Restored,
    Times, Hang, Interval, Rollback, Cordoned, Traced, Straggler)}
_FIELDS_OF: dict[type[Event], tuple[str, ...]] = {c: tuple(f.name for f in fields(c)) for c in (*KINDS.values(), Other)}
# The check of each type a field may be declared with (``X | None``; null counts as absent).
_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "int | None": lambda v: type(v) is int and v >= 0,
    "float | None": lambda v: type(v) in (int, float) and math.isfinite(v),
    "str | None": lambda v: isinstance(v, str),
    "bool | None": lambda v: isinstance(v, bool)}


def _checks() -> dict[str, Callable[[Any], bool]]:
    """The fields alpsck's code reads and the check of each, from the record classes' annotations (a
    name has one type in every kind that has it)."""
    out: dict[str, tuple[str, Callable[[Any], bool]]] = {}
    for cls in KINDS.values():
        for f in fields(cls):
            check = _TYPE_CHECKS.get(str(f.type))
            if check is None or f.name in ("time", "more"):
                continue
            if f.name in out and out[f.name][0] != str(f.type):
                raise TypeError(f"history field {f.name!r} is declared {out[f.name][0]} and {f.type}")
            out[f.name] = (str(f.type), check)
    return {k: c for k, (_, c) in out.items()}


_CHECKS = _checks()


def typed(rec: dict[str, Any]) -> Event:
    """A normalised event (:func:`normalise`) as its record: the fields its kind names, the rest in ``more``."""
    cls = KINDS.get(rec["event"], Other)
    names = _FIELDS_OF[cls]
    kw = {k: v for k, v in rec.items() if k in names and k not in ("more", "other_kind")}
    more = {k: v for k, v in rec.items() if k != "event" and k not in kw}
    if cls is Other:
        return Other(other_kind=rec["event"], more=more, **kw)
    return cls(more=more, **kw)


def record(event: Event | str, **fields: Any) -> dict[str, Any]:
    """One event as it is stored: ``time`` (now, unless the record has one), ``event``, the fields that are
    not None, ``host``. ``event``: a record, or a kind's name with its fields (the record of that kind)."""
    if isinstance(event, str):
        event = typed({"event": event, **fields})
    elif fields:  # fields set on a record (a caller's job_id): the declared ones replace, the rest join ``more``
        named = _FIELDS_OF[type(event)]
        event = replace(event, **{k: v for k, v in fields.items() if k in named and k != "more"},
                        more={**event.more, **{k: v for k, v in fields.items() if k not in named}})
    rec = event.stored()
    if rec["time"] is None:
        rec["time"] = round(time.time(), 3)
    rec.setdefault("host", socket.gethostname())
    return rec


def line(rec: dict[str, Any]) -> str:
    """The stored form of an event: one line of JSON (no newline inside it)."""
    return json.dumps(rec, sort_keys=False)


def append(run_dir: str | os.PathLike[str], event: Event | str, **fields: Any) -> dict[str, Any]:
    """The one writer: append one event (:func:`record`) durably and return it. A log that cannot be
    written (a symlink or a FIFO in its place, a full disk) is a warning on stderr, not the end of the
    job it records."""
    rec = record(event, **fields)
    data = (line(rec) + "\n").encode()
    path = Path(run_dir) / HISTORY
    try:
        make_dirs_durably(Path(run_dir))  # a new run directory's name durable too, as the lines in it are
        append_durably(path, data)
    except OSError as e:
        print(f"alpsck: warning: cannot record {rec['event']!r} in {path}: {e.strerror or e}", file=sys.stderr,
              flush=True)
    return rec


# The batch script's writer (bash, on the batch host, where the job's Python may not run: a container's or a uenv's).
SHELL_APPEND = "alpsck_history_append"  # LINE: one stored event, appended as it is
SHELL_EVENT = "alpsck_history_event"    # FIELDS: an event's fields as JSON members, stamped and appended


def shell_append_lines(run_dir: str | os.PathLike[str]) -> list[str]:
    """The bash function :data:`SHELL_APPEND` (``LINE``): appends one stored event to RUN_DIR's history from a batch
    script, only into a regular file or none: never through a symlink, never into a FIFO (a hang). Not fsync'ed:
    the batch shell has no fsync, and a lost line is a history that misses one event, never a lost checkpoint."""
    hist = shlex.quote(str(Path(run_dir) / HISTORY))
    return [
        f"{SHELL_APPEND}() {{",
        f'  if [ ! -L {hist} ] && {{ [ ! -e {hist} ] || [ -f {hist} ]; }}; then printf "%s\\n" "$1" >> {hist}; fi',
        "}",
    ]


def shell_event_lines() -> list[str]:
    """The bash function :data:`SHELL_EVENT` (``FIELDS``, from :func:`shell_event`): the event stamped with
    ``time`` (``date``), ``job_id`` ($SLURM_JOB_ID, where it is one: :data:`JOB_ID`) and ``host`` (where
    ``hostname`` gives a host name), appended by :data:`SHELL_APPEND` (:func:`shell_append_lines`, defined before)."""
    return [
        f"{SHELL_EVENT}() {{",
        "  local stamp host",
        "  stamp='\"time\":'$(date +%s)",
        "  [[ \"${SLURM_JOB_ID:-}\" =~ ^[0-9]{1,20}(_[0-9]{1,20})?$ ]] && stamp+=',\"job_id\":\"'\"$SLURM_JOB_ID\"'\"'",
        "  host=$(hostname 2>/dev/null)",
        "  [[ \"$host\" =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$ ]] && stamp+=',\"host\":\"'\"$host\"'\"'",
        f'  {SHELL_APPEND} "{{$stamp,$1}}"',
        "}",
    ]


def shell_event(event: Event) -> str:
    """The bash command (:func:`shell_event_lines`) that appends ``event`` when it runs, stamped there. Its fields are
    JSON made here, quoted: nothing of the config's reaches the shell."""
    fields = {k: v for k, v in event.stored().items() if k not in ("time", "job_id", "host")}
    return f"{SHELL_EVENT} {shlex.quote(json.dumps(fields, separators=(',', ':'))[1:-1])}"


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
    if ev == Submitted.KIND and not is_job_id(rec.get("job_id")):
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
