"""The fold of a run's events into its timeline: the one reader of the history's events.

:func:`fold` turns the events :func:`alpsck.slurm.history.read_log` read (oldest first) into a
:class:`Timeline`: their records (:func:`alpsck.slurm.history.typed`), the run's state, its jobs,
starts, requeues, failures, checkpoints and intervals, and its starts as spans (:class:`Start`, the
one walk over them that goodput, the failure interval of ``checkpoint.every: auto`` and the plot
read). The runner's rules (restart budget, no progress, the same error again), ``alpsck status``,
the follower and the hang watchdog's learned timeouts all ask the timeline, never the raw events.

A start runs from its ``started`` to its end: a crash's step end (the ``crashed`` the next start
records), a hang's detection, or its own last ending event.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import history
from .history import (
    Cancelled,
    Cordoned,
    Crashed,
    Event,
    Failed,
    FinalCheckpoint,
    Finished,
    GaveUp,
    Hang,
    Requeued,
    Restored,
    Signal,
    Started,
    Submitted,
    Times,
)

# The states of a run (history.STATES): most are named after the event that decides them.
PENDING, RUNNING, TIMEOUT = "pending", "running", "timeout"
REQUEUED, FINISHED, FAILED, CANCELLED, GAVE_UP = (Requeued.KIND, Finished.KIND, Failed.KIND, Cancelled.KIND,
                                                  GaveUp.KIND)
LIVE_STATES = (PENDING, RUNNING, REQUEUED)  # states in which the job is still supposed to exist
# Events that end a start (a crash ends it at its step's end, which the next start records).
ENDS = (Finished, Failed, Requeued, Cancelled, GaveUp, Hang)
# Outcomes of a start (the kind of the event that ended it, or RUNNING / UNKNOWN) that are failures.
UNKNOWN = "unknown"
CRASHED, HANG = Crashed.KIND, Hang.KIND
FAILURES = (CRASHED, HANG, FAILED)
E = TypeVar("E", bound=Event)


def _num(v: Any) -> float:
    return float(v) if type(v) in (int, float) else 0.0


def _opt(v: Any) -> float | None:
    return float(v) if type(v) in (int, float) else None


@dataclass
class Start:
    """One start of the run: when, how it ended, what it resumed from, and its recorded split."""

    job_id: str | None
    attempt: int
    t0: float
    end: float
    outcome: str          # finished, crashed, hang, failed, requeued, cancelled, gave_up, running, unknown
    cause: str            # what a restart after it is put down to (a requeue's reason for ``requeued``)
    resume_step: int | None
    taken_at: float | None  # when the state it resumed from was taken
    down_s: float | None    # from the job step before's end to this ``started`` (in the allocation)
    times: Times | None
    final_step: int | None  # the step of its final checkpoint, after a stop
    hang: Hang | None = None
    events: list[Event] = field(repr=False, default_factory=list)

    @property
    def restored_tier(self) -> str | None:
        """Where this start's restore came from: ``memory`` or ``run_dir`` (None: a fresh start)."""
        restored = _newest(self.events, Restored)
        if restored is not None:
            return restored.tier or ("run_dir" if restored.step is not None else None)
        return "run_dir" if self.resume_step is not None else None

    @property
    def resumed(self) -> tuple[int | None, float | None]:
        """The step this start's state came from and when that state was taken: its restore's (the memory tier's,
        a fall back), where it recorded one, else the run directory's pick at the start (whose time, where the
        restore's is unknown, bounds the work lost from above)."""
        restored = _newest(self.events, Restored)
        if restored is not None and restored.step is not None:
            taken = _opt(restored.taken_at)
            return restored.step, self.taken_at if taken is None else taken
        return self.resume_step, self.taken_at

    @property
    def first_poll(self) -> float | None:
        return None if self.times is None else self.t0 + _num(self.times.start_s)

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "attempt": self.attempt, "t0": round(self.t0, 3), "end": round(self.end, 3),
                "outcome": self.outcome, "resume_step": self.resume_step, "resumed_step": self.resumed[0],
                "tier": self.restored_tier}


def _newest(records: Iterable[Event], cls: type[E]) -> E | None:
    return next((e for e in reversed(list(records)) if isinstance(e, cls)), None)


def _outcome(own: list[Event], crashed: Crashed | None, last: bool, ended: bool) -> tuple[str, str]:
    for cls in (Hang, Crashed, Failed, GaveUp, Cancelled):
        if (crashed is not None) if cls is Crashed else any(isinstance(e, cls) for e in own):
            return cls.KIND, cls.KIND
    req = _newest(own, Requeued)
    if req is not None:
        return REQUEUED, str(req.reason or REQUEUED)
    if any(isinstance(e, Finished) for e in own):
        return FINISHED, FINISHED
    return (RUNNING if last and not ended else UNKNOWN), "resubmitted"


def ends_run(e: Event | None) -> bool:
    """Whether ``e`` ends the run for good (finished, cancelled, gave up, failed for good)."""
    return isinstance(e, (Finished, Cancelled, GaveUp)) or (isinstance(e, Failed) and e.final)


@dataclass(frozen=True)
class Timeline:
    """A run's events folded (see the module docstring). ``events``: as read (normalised, oldest first:
    what ``status`` shows and prints as JSON); ``records``: the same as records, index for index."""

    events: list[dict[str, Any]]
    records: list[Event]

    # -- the run ---------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """The run's state from its newest decisive event (one of history.STATES but ``timeout``)."""
        for e in reversed(self.records):
            if isinstance(e, (Finished, GaveUp, Cancelled)) or (isinstance(e, Failed) and e.final):
                return e.kind
            if isinstance(e, Requeued):
                return REQUEUED
            if isinstance(e, (Started, Signal, FinalCheckpoint)):
                return RUNNING
            if isinstance(e, Submitted):
                return PENDING
        return PENDING

    @property
    def ended(self) -> bool:
        """Whether the run's last event ends it for good."""
        return ends_run(self.records[-1] if self.records else None)

    def end_time(self, now: float | None = None) -> float:
        """The run's end: its last event's time once it ended for good, else now (or its last event's, if later)."""
        last = float(self.events[-1]["time"]) if self.events else 0.0
        return last if self.ended else max(last, time.time() if now is None else now)

    @property
    def job_ids(self) -> list[str]:
        return list(dict.fromkeys(e.job_id for e in self.records if e.job_id))

    def of_kind(self, cls: type[E], job_id: str | None = None) -> list[E]:
        """The events of one kind (of one job, when ``job_id`` is given), oldest first."""
        return [e for e in self.records if isinstance(e, cls) and (job_id is None or e.job_id == job_id)]

    def starts_of(self, job_id: str | None = None) -> list[Started]:
        """The ``started`` events (of one job, when ``job_id`` is given), oldest first: the one count of starts."""
        return self.of_kind(Started, job_id)

    def requeues(self) -> int:
        return len(self.of_kind(Requeued))

    def newest(self, cls: type[E] | tuple[type[E], ...]) -> E | None:
        return next((e for e in reversed(self.records) if isinstance(e, cls)), None)  # type: ignore[misc]

    @property
    def last_step(self) -> int | None:
        steps = [s for s in (e.get("step") for e in self.records) if type(s) is int]
        return max(steps) if steps else None

    def submissions(self) -> list[int]:
        """The indexes of the events that name a job and its backend, oldest first: ``submitted``, and
        ``started``, which carries the backend too, so that a job whose ``submitted`` lies before the part
        of the history read (read_log's window) is still known, and asked whether it lives."""
        return [i for i, e in enumerate(self.records) if isinstance(e, (Submitted, Started))
                and e.backend in ("slurm", "local") and e.job_id]

    def last_submission(self) -> dict[str, Any] | None:
        """The newest event naming a job and its backend (:meth:`submissions`), as read."""
        found = self.submissions()
        return self.events[found[-1]] if found else None

    # -- the runner's rules ----------------------------------------------------------------------

    def charged_starts(self, job_id: str) -> int:
        """How many of this job's recorded starts count against ``requeue.max_restarts``: all of them
        but those that ended in a requeue after the newest checkpoint advanced (``requeued`` with
        ``progress: true``). A start that left no ending (killed, its node lost) counts."""
        starts = len(self.starts_of(job_id))
        free = sum(1 for e in self.of_kind(Requeued, job_id) if e.progress is True)
        return max(0, starts - free)

    def cordoned(self) -> dict[str, Cordoned]:
        """The nodes kept out of the run, each with the event that first cordoned it (for good: a cordon is
        never lifted by a later event; a node is let back in by a new run directory)."""
        out: dict[str, Cordoned] = {}
        for e in self.of_kind(Cordoned):
            if e.node and e.node not in out:
                out[e.node] = e
        return out

    def hung(self, job_id: str) -> bool:
        """Whether this job's last start was ended by the hang watchdog (a ``hang`` after its ``started``)."""
        for e in reversed(self.records):
            if e.job_id == job_id and isinstance(e, (Started, Hang)):
                return isinstance(e, Hang)
        return False

    def same_failures(self, job_id: str, message: str, step: int | None) -> int:
        """How many of this job's newest failures in a row failed with ``message`` at ``step``."""
        streak = 0
        for e in reversed(self.of_kind(Failed, job_id)):
            if e.message != message or e.step != step:
                break
            streak += 1
        return streak

    # -- the starts ------------------------------------------------------------------------------

    def starts(self, now: float | None = None) -> list[Start]:
        """The run's starts, oldest first. ``now``: the end of a start still running (default: the time now)."""
        recs = self.records
        idx = [i for i, e in enumerate(recs) if isinstance(e, Started)]
        if not idx:
            return []
        ended, t_last = self.ended, self.end_time(now)
        out: list[Start] = []
        for k, i in enumerate(idx):
            st = recs[i]
            assert isinstance(st, Started)
            t0 = float(self.events[i]["time"])
            nxt = idx[k + 1] if k + 1 < len(idx) else len(recs)
            own = recs[i + 1:nxt]
            last = nxt == len(recs)
            crashed = next((e for e in own if isinstance(e, Crashed) and _num(e.time_of_end) >= t0), None)
            ending = [e for e in own if isinstance(e, ENDS)]
            if crashed is not None:
                end = _num(crashed.time_of_end)
            elif ending:
                end = float(ending[-1].time or 0.0)
            elif not last:
                end = float(self.events[nxt - 1]["time"]) if nxt - 1 > i else t0
            else:
                end = t_last
            outcome, cause = _outcome(own, crashed, last, ended)
            final = _newest(own, FinalCheckpoint)
            out.append(Start(
                job_id=st.job_id, attempt=int(_num(st.attempt)), t0=t0, end=max(end, t0), outcome=outcome,
                cause=cause, resume_step=st.step, taken_at=st.step_taken_at, down_s=_opt(st.down_s),
                times=_newest(own, Times), final_step=final.step if final is not None else None,
                hang=next((e for e in own if isinstance(e, Hang)), None), events=own))
        return out

    def observed_mtbf(self) -> float | None:
        """The run's time running over its failures (starts that crashed, hung or failed); None before its
        first failure. The start still running is left out."""
        ended = [s for s in self.starts() if s.outcome != RUNNING]
        failures = sum(1 for s in ended if s.outcome in FAILURES)
        running = sum(s.end - s.t0 for s in ended)
        return running / failures if failures and running > 0 else None

    def markers(self, kinds: Iterable[str]) -> list[tuple[str, float]]:
        """``(kind, time)`` of the events of the kinds named (a crash at its step's end), oldest first."""
        wanted = set(kinds)
        return [(e.kind, float(e.time_of_end or e.time or 0.0) if isinstance(e, Crashed) else float(e.time or 0.0))
                for e in self.records if e.kind in wanted]


def record_of(event: dict[str, Any]) -> Event:
    """One event as read (normalised), as its record: for a reader of a single line (the follower's)."""
    return history.typed(event)


def fold(events: list[dict[str, Any]]) -> Timeline:
    """The timeline of the (normalised, oldest first) events :func:`alpsck.slurm.history.read_log` read."""
    return Timeline(events, [history.typed(e) for e in events])


def read(run_dir: Any) -> Timeline:
    """The timeline of the run directory's history (its newest events: :func:`alpsck.slurm.history.read`)."""
    return fold(history.read(run_dir))


def as_timeline(events: Timeline | list[dict[str, Any]]) -> Timeline:
    """A timeline as it is, or the fold of a list of events (as read)."""
    return events if isinstance(events, Timeline) else fold(events)


def state_of(events: list[dict[str, Any]]) -> str:
    """The job's state from its newest decisive event (:attr:`Timeline.state`)."""
    return fold(events).state
