"""Where a run's wall time went, from its history alone: the goodput ``alpsck status`` shows.

One walk over the run's starts (:func:`starts`) serves every reader of them: the goodput here, the
failure interval of ``checkpoint.every: auto`` (:func:`alpsck.slurm.interval.observed_mtbf`) and
the timeline plot (:mod:`alpsck.tools.plot`). A start runs from its ``started`` to its end: a crash's
step end (the ``crashed`` the next start records), a hang's detection, or its own last ending event.

The run's wall time, from its first ``started`` to its last event (or now, while it runs), is cut
into parts that add up to it exactly:

- per start, from the ``times`` event its rank 0 logs when the entry returns or raises, or its
  watchdog logs when it finds a hang (the sections, :mod:`alpsck.slurm.watchdog`): ``training``
  (steps that count), ``lost`` (steps trained after the state the next start resumed from was
  taken: trained again; also taken from ``unaccounted`` for a start that logged no split),
  ``startup`` (imports, set-up and restore until the loop's first poll, and restores the loop itself
  made), ``stall`` (the loop blocked in a save), ``final`` (after it saw a stop: the final checkpoint);
- ``unaccounted``: the rest of a start: its teardown after the entry, and the whole of a start
  that logged no ``times`` (SIGKILLed, its node lost), whose split nobody recorded;
- between starts: ``restart_gap`` (the end of a job step that died to the next one's start in
  the same allocation) and ``queue`` (a requeue or a resubmission to the next allocation's start).

``ettr`` (effective training time ratio) is training that counts over wall. Work lost needs the
time the resumed state was taken (``started``'s ``step_taken_at``: its manifest's time less its
write); a start with a final checkpoint of the step the next resumed from lost nothing.

Each restart has its ``cause`` (``crashed``, ``hang``, ``failed``, or the requeue's reason:
``timeout``, ``preemption`` ...), ``restart_s`` from the end of the start before to the end of the
next start's first step (or to what of it was recorded), and its parts: ``detect_s`` (a hang: the
time without progress before it was called one), ``teardown_s`` (the end → the job step's end),
``start_s`` (→ the next ``started``: srun, the interpreter, imports; in the allocation) or
``queue_s`` (a requeue's wait), ``setup_s``, ``restore_s`` and ``first_step_s``; and ``lost_s``
(with ``lost_steps``, from the step time, where known).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# Events that end a start (a crash ends it at its step's end, which the next start records).
ENDS = ("finished", "failed", "requeued", "cancelled", "gave_up", "hang")
# Outcomes of a start that are failures (for the failure interval).
FAILURES = ("crashed", "hang", "failed")
PARTS = ("training", "lost", "startup", "stall", "final", "unaccounted", "restart_gap", "queue")


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
    times: dict[str, Any] | None
    final_step: int | None  # the step of its final checkpoint, after a stop
    events: list[dict[str, Any]] = field(repr=False, default_factory=list)

    @property
    def first_poll(self) -> float | None:
        return None if self.times is None else self.t0 + _num(self.times.get("start_s"))

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "attempt": self.attempt, "t0": round(self.t0, 3), "end": round(self.end, 3),
                "outcome": self.outcome, "resume_step": self.resume_step}


def _outcome(own: list[dict[str, Any]], crashed: dict[str, Any] | None, last: bool, ended: bool) -> tuple[str, str]:
    kinds = {e["event"] for e in own}
    req = next((e for e in reversed(own) if e["event"] == "requeued"), None)
    for name in ("hang", "crashed", "failed", "gave_up", "cancelled"):
        if (crashed is not None) if name == "crashed" else name in kinds:
            return name, name
    if req is not None:
        return "requeued", str(req.get("reason") or "requeued")
    if "finished" in kinds:
        return "finished", "finished"
    return ("running" if last and not ended else "unknown"), "resubmitted"


def run_ended(events: list[dict[str, Any]]) -> bool:
    """Whether the run's last event ends it for good (finished, cancelled, gave up, failed for good)."""
    last = events[-1] if events else None
    return last is not None and (last["event"] in ("finished", "cancelled", "gave_up") or (
        last["event"] == "failed" and not (last.get("will_requeue") or last.get("will_restart"))))


def _run_end(events: list[dict[str, Any]], now: float | None) -> tuple[bool, float]:
    """Whether the run ended for good, and its end: its last event's time, or now while it runs."""
    ended = run_ended(events)
    last = float(events[-1]["time"])
    return ended, last if ended else max(last, time.time() if now is None else now)


def starts(events: list[dict[str, Any]], now: float | None = None) -> list[Start]:
    """The run's starts, oldest first (events normalised, in the history's order). ``now``: the end of
    a start still running (default: the time now)."""
    idx = [i for i, e in enumerate(events) if e["event"] == "started"]
    if not idx:
        return []
    ended, t_last = _run_end(events, now)
    out: list[Start] = []
    for k, i in enumerate(idx):
        st = events[i]
        t0 = float(st["time"])
        nxt = idx[k + 1] if k + 1 < len(idx) else len(events)
        own = events[i + 1:nxt]
        last = nxt == len(events)
        crashed = next((e for e in own if e["event"] == "crashed" and _num(e.get("time_of_end")) >= t0), None)
        ending = [e for e in own if e["event"] in ENDS]
        if crashed is not None:
            end = _num(crashed["time_of_end"])
        elif ending:
            end = float(ending[-1]["time"])
        elif not last:
            end = float(events[nxt - 1]["time"]) if nxt - 1 > i else t0
        else:
            end = t_last
        outcome, cause = _outcome(own, crashed, last, ended)
        final = next((e for e in reversed(own) if e["event"] == "final_checkpoint"), None)
        step = st.get("step")
        fstep = final.get("step") if final is not None else None
        out.append(Start(
            job_id=st.get("job_id"), attempt=int(_num(st.get("attempt"))), t0=t0, end=max(end, t0), outcome=outcome,
            cause=cause, resume_step=step if type(step) is int else None, taken_at=_opt(st.get("step_taken_at")),
            down_s=_opt(st.get("down_s")), times=next((e for e in reversed(own) if e["event"] == "times"), None),
            final_step=fstep if type(fstep) is int else None, events=own))
    return out


def _lost_s(s: Start, nxt: Start, room: float) -> float:
    """Seconds start ``s`` trained that ``nxt`` trains again: after the state ``nxt`` resumed from was taken."""
    if s.outcome in ("finished", "cancelled", "gave_up") or room <= 0:
        return 0.0
    if s.final_step is not None and s.final_step == nxt.resume_step:
        return 0.0  # stopped at a step boundary and saved it: nothing to repeat
    if nxt.taken_at is None:
        # Nothing says when: only a start that resumed from where this one did surely repeats all of it.
        return room if nxt.resume_step == s.resume_step and s.times is not None else 0.0
    useful_until = max(nxt.taken_at, s.first_poll or s.t0)
    return min(room, max(0.0, s.end - useful_until))


def goodput(events: list[dict[str, Any]], now: float | None = None) -> dict[str, Any] | None:
    """The goodput of the run whose (normalised) events these are, or None before its first start.
    ``now``: the end of a run still going (default: the time now)."""
    runs = starts(events, now)
    if not runs:
        return None
    parts = dict.fromkeys(PARTS, 0.0)
    step_times = [_num(s.times.get("step_s")) / _num(s.times.get("polls")) for s in runs
                  if s.times is not None and _num(s.times.get("polls")) > 1 and _num(s.times.get("step_s")) > 0]
    step_s = statistics.median(step_times) if step_times else None
    restarts: list[dict[str, Any]] = []
    t_first = runs[0].t0
    t_last = _run_end(events, now)[1]
    for k, s in enumerate(runs):
        wall = s.end - s.t0
        training = 0.0
        if s.times is not None:
            split = {"training": _num(s.times.get("step_s")), "startup": _num(s.times.get("start_s")) +
                     _num(s.times.get("restore_s")), "stall": _num(s.times.get("save_s")),
                     "final": _num(s.times.get("final_s"))}
            total = sum(split.values())
            scale = min(1.0, wall / total) if total > 0 else 1.0
            for name, v in split.items():
                parts[name] += v * scale
            training = split["training"] * scale
            unaccounted = max(0.0, wall - total * scale)
        else:
            unaccounted = wall
        parts["unaccounted"] += unaccounted
        if k + 1 == len(runs):
            break
        nxt = runs[k + 1]
        lost = _lost_s(s, nxt, training if s.times is not None else unaccounted)
        parts["training" if s.times is not None else "unaccounted"] -= lost
        parts["lost"] += lost
        gap = max(0.0, nxt.t0 - s.end)
        in_alloc = nxt.attempt > 0
        parts["restart_gap" if in_alloc else "queue"] += gap
        restarts.append(_restart(s, nxt, gap, in_alloc, lost, step_s))
    if runs[-1].outcome == "unknown" and t_last > runs[-1].end:  # requeued or resubmitted, not started again yet
        parts["queue"] += t_last - runs[-1].end
    wall = max(0.0, t_last - t_first)
    total = sum(parts.values())
    if total > wall:  # a clock step or events out of order: never report more than the wall time
        parts = {k: v * wall / total for k, v in parts.items()} if total else parts
    return {"wall_s": round(wall, 3), "ettr": round(parts["training"] / wall, 4) if wall > 0 else None,
            **{f"{k}_s": round(v, 3) for k, v in parts.items()}, "restarts": restarts,
            "starts": [s.as_dict() for s in runs]}


def _restart(s: Start, nxt: Start, gap: float, in_alloc: bool, lost: float, step_s: float | None) -> dict[str, Any]:
    """One restart: its cause, when, how long until the next start's first step ended, and its parts."""
    r: dict[str, Any] = {"cause": s.cause, "at": round(s.end, 3), "in_allocation": in_alloc}
    hang = next((e for e in s.events if e["event"] == "hang"), None)
    if hang is not None and _opt(hang.get("seconds")) is not None:
        r["detect_s"] = round(_num(hang["seconds"]), 3)
    if in_alloc and nxt.down_s is not None:  # the step's end, from the batch script's clock
        r["teardown_s"] = round(max(0.0, gap - nxt.down_s), 3)
        r["start_s"] = round(min(gap, nxt.down_s), 3)
    elif in_alloc:
        r["start_s"] = round(gap, 3)
    else:
        r["queue_s"] = round(gap, 3)
    total = gap
    if nxt.times is not None:
        for key, name in (("setup_s", "start_s"), ("restore_s", "restore_s"), ("first_step_s", "first_step_s")):
            v = _opt(nxt.times.get(name))
            if v is not None:
                r[key] = round(v, 3)
                total += v
    r["restart_s"] = round(total, 3)
    r["lost_s"] = round(lost, 3)
    if step_s:
        r["lost_steps"] = int(round(lost / step_s))
    return r


def duration(s: float) -> str:
    """Seconds as ``1h05m``, ``4m23s`` or ``9s``: how goodput is written (status, the plot's title)."""
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def restart_causes(g: dict[str, Any]) -> dict[str, int]:
    """How many restarts each cause had, in the order they first came."""
    causes: dict[str, int] = {}
    for r in g["restarts"]:
        causes[str(r["cause"])] = causes.get(str(r["cause"]), 0) + 1
    return causes


def line(g: dict[str, Any]) -> str:
    """One line for ``alpsck status``."""
    dur = duration
    ettr = "-" if g["ettr"] is None else f"{100 * g['ettr']:.0f}%"
    restarts = ", ".join(f"{n} {c}" for c, n in restart_causes(g).items()) or "none"
    slowest = max((r["restart_s"] for r in g["restarts"] if r["in_allocation"]), default=None)  # a requeue's is queue
    return (f"goodput: ETTR {ettr} (training {dur(g['training_s'])} of {dur(g['wall_s'])}; work lost "
            f"{dur(g['lost_s'])}, startup {dur(g['startup_s'])}, stalls {dur(g['stall_s'])}, final checkpoints "
            f"{dur(g['final_s'])}, queue {dur(g['queue_s'])}, restarts in the allocation {dur(g['restart_gap_s'])}, "
            f"unaccounted {dur(g['unaccounted_s'])}); restarts: {restarts}"
            + (f" (the slowest in the allocation: {slowest:.1f} s to its first step)" if slowest is not None else ""))
