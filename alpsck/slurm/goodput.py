"""Where a run's wall time went, from its history alone: the goodput ``alpsck status`` shows.

The run's starts come from its timeline (:meth:`alpsck.slurm.timeline.Timeline.starts`, the one walk
over them that the failure interval of ``checkpoint.every: auto`` and the plot read too).

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
write; a ``restored`` event's ``taken_at`` where the restore used another step, a memory tier's); a start
with a final checkpoint of the step the next resumed from lost nothing.

Each restart has its ``cause`` (``crashed``, ``hang``, ``failed``, or the requeue's reason:
``timeout``, ``preemption`` ...), ``restart_s`` from the end of the start before to the end of the
next start's first step (or to what of it was recorded), and its parts: ``detect_s`` (a hang: the
time without progress before it was called one), ``teardown_s`` (the end → the job step's end),
``start_s`` (→ the next ``started``: srun, the interpreter, imports; in the allocation) or
``queue_s`` (a requeue's wait), ``setup_s``, ``restore_s`` and ``first_step_s``; and ``lost_s``
(with ``lost_steps``, from the step time, where known); ``node``: where the start before failed first, when the
health gate traced it (:mod:`alpsck.slurm.trace`). ``bad_nodes`` sums, per such node, what its failures cost: the
work they lost and their restarts' time to the next first step.
"""

from __future__ import annotations

import statistics
from typing import Any

from .history import Traced
from .timeline import CANCELLED, FINISHED, GAVE_UP, Start, Timeline, _num, _opt, as_timeline

TIER_NAMES = {"memory": "memory", "replica": "a replica", "run_dir": "the run directory"}  # Checkpointer.restored_tier
PARTS = ("training", "lost", "startup", "stall", "final", "unaccounted", "restart_gap", "queue")


def _lost_s(s: Start, nxt: Start, room: float) -> float:
    """Seconds start ``s`` trained that ``nxt`` trains again: after the state ``nxt`` resumed from was taken."""
    if s.outcome in (FINISHED, CANCELLED, GAVE_UP) or room <= 0:
        return 0.0
    step, taken = nxt.resumed  # a restore from memory: its step, newer than the run directory's
    if s.final_step is not None and s.final_step == step:
        return 0.0  # stopped at a step boundary and saved it: nothing to repeat
    if taken is None:
        # Nothing says when: only a start that resumed from where this one did surely repeats all of it.
        return room if step == s.resumed[0] and s.times is not None else 0.0
    useful_until = max(taken, s.first_poll or s.t0)
    return min(room, max(0.0, s.end - useful_until))


def goodput(events: Timeline | list[dict[str, Any]], now: float | None = None) -> dict[str, Any] | None:
    """The goodput of the run (its timeline, or the events read), or None before its first start.
    ``now``: the end of a run still going (default: the time now)."""
    tl = as_timeline(events)
    runs = tl.starts(now)
    if not runs:
        return None
    parts = dict.fromkeys(PARTS, 0.0)
    step_times = [_num(s.times.step_s) / _num(s.times.polls) for s in runs
                  if s.times is not None and _num(s.times.polls) > 1 and _num(s.times.step_s) > 0]
    step_s = statistics.median(step_times) if step_times else None
    restarts: list[dict[str, Any]] = []
    traced = {(e.job_id, e.attempt): e.node for e in tl.of_kind(Traced) if e.node}
    t_first = runs[0].t0
    t_last = tl.end_time(now)
    for k, s in enumerate(runs):
        wall = s.end - s.t0
        training = 0.0
        if s.times is not None:
            split = {"training": _num(s.times.step_s), "startup": _num(s.times.start_s) + _num(s.times.restore_s),
                     "stall": _num(s.times.save_s), "final": _num(s.times.final_s)}
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
        if (s.job_id, s.attempt) in traced:
            restarts[-1]["node"] = traced[(s.job_id, s.attempt)]
    if runs[-1].outcome == "unknown" and t_last > runs[-1].end:  # requeued or resubmitted, not started again yet
        parts["queue"] += t_last - runs[-1].end
    wall = max(0.0, t_last - t_first)
    total = sum(parts.values())
    if total > wall:  # a clock step or events out of order: never report more than the wall time
        parts = {k: v * wall / total for k, v in parts.items()} if total else parts
    return {"wall_s": round(wall, 3), "ettr": round(parts["training"] / wall, 4) if wall > 0 else None,
            **{f"{k}_s": round(v, 3) for k, v in parts.items()}, "restarts": restarts,
            "bad_nodes": _bad_nodes(restarts), "starts": [s.as_dict() for s in runs]}


def _bad_nodes(restarts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per node the restarts were traced to: how many, and what they cost (work lost and time to the next first
    step), the costliest first."""
    cost: dict[str, list[float]] = {}
    for r in restarts:
        if r.get("node"):
            cost.setdefault(r["node"], []).append(r["lost_s"] + r["restart_s"])
    return sorted(({"node": n, "failures": len(c), "cost_s": round(sum(c), 3)} for n, c in cost.items()),
                  key=lambda b: -b["cost_s"])


def _restart(s: Start, nxt: Start, gap: float, in_alloc: bool, lost: float, step_s: float | None) -> dict[str, Any]:
    """One restart: its cause, when, how long until the next start's first step ended, and its parts."""
    r: dict[str, Any] = {"cause": s.cause, "at": round(s.end, 3), "in_allocation": in_alloc,
                         "tier": nxt.restored_tier}
    if s.hang is not None and _opt(s.hang.seconds) is not None:
        r["detect_s"] = round(_num(s.hang.seconds), 3)
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


def restart_causes(g: dict[str, Any], key: str = "cause") -> dict[str, int]:
    """How many restarts each cause (or each value of another ``key``: ``tier``) had, in the order they first
    came; restarts without one are left out."""
    counts: dict[str, int] = {}
    for r in g["restarts"]:
        if r.get(key) is not None:
            counts[str(r[key])] = counts.get(str(r[key]), 0) + 1
    return counts


def line(g: dict[str, Any]) -> str:
    """One line for ``alpsck status``."""
    dur = duration
    ettr = "-" if g["ettr"] is None else f"{100 * g['ettr']:.0f}%"
    restarts = ", ".join(f"{n} {c}" for c, n in restart_causes(g).items()) or "none"
    read = ", ".join(f"{TIER_NAMES.get(t, t)} {n}" for t, n in restart_causes(g, "tier").items())  # restores' source
    slowest = max((r["restart_s"] for r in g["restarts"] if r["in_allocation"]), default=None)  # a requeue's is queue
    return (f"goodput: ETTR {ettr} (training {dur(g['training_s'])} of {dur(g['wall_s'])}; work lost "
            f"{dur(g['lost_s'])}, startup {dur(g['startup_s'])}, stalls {dur(g['stall_s'])}, final checkpoints "
            f"{dur(g['final_s'])}, queue {dur(g['queue_s'])}, restarts in the allocation {dur(g['restart_gap_s'])}, "
            f"unaccounted {dur(g['unaccounted_s'])}); restarts: {restarts}"
            + (f" (the slowest in the allocation: {slowest:.1f} s to its first step)" if slowest is not None else "")
            + (f"; restored from {read}" if read else "")
            + ("; failures by node: " + ", ".join(f"{b['node']} {b['failures']} ({dur(b['cost_s'])})"
                                                for b in g.get("bad_nodes", [])) if g.get("bad_nodes") else ""))
