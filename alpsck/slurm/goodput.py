"""Where a run's wall time went, from its history alone: the goodput ``alpsck status`` shows.

The run's wall time, from its first ``started`` to its last event (or now, while it runs), is cut
into parts that add up to it exactly:

- per start, from the ``times`` event its rank 0 logs when the entry returns or raises (the hang
  watchdog's sections, :mod:`alpsck.slurm.watchdog`): ``training`` (steps), ``startup`` (imports,
  set-up and restore until the loop's first poll, and restores the loop itself made), ``stall``
  (the loop blocked in a save), ``final`` (after it saw a stop: the final checkpoint);
- ``unaccounted``: the rest of a start: its teardown after the entry, and the whole of a start
  that logged no ``times`` (SIGKILLed, hung, its node lost), whose split nobody recorded;
- between starts: ``restart_gap`` (the end of a job step that died to the next one's start in
  the same allocation) and ``queue`` (a requeue or a resubmission to the next allocation's start).

``ettr`` (effective training time ratio) is training over wall. A start that logged no ``times``
counts whole as unaccounted, so the ratio is a lower bound there. Each restart has its ``cause``
(``crashed``, ``hang``, ``failed``, or the requeue's reason: ``timeout``, ``preemption`` ...) and
``restart_s``: from the end of the start before (a crashed step's srun end, a hang's detection, a
failure or requeue event) to the next start's first poll when it logged one, else to its start.
Not measured: work lost (the steps a start trained after its newest durable checkpoint and a
resume repeated), for which a killed start records nothing.
"""

from __future__ import annotations

import time
from typing import Any

# What ends a start, and the cause a restart after it is given.
_ENDS = ("finished", "failed", "requeued", "cancelled", "gave_up", "hang")


def _num(v: Any) -> float:
    return float(v) if type(v) in (int, float) else 0.0


def goodput(events: list[dict[str, Any]], now: float | None = None) -> dict[str, Any] | None:
    """The goodput of the run whose (normalised) events these are, or None before its first start.
    ``now``: the end of a run still going (default: the time now)."""
    starts = [i for i, e in enumerate(events) if e["event"] == "started"]
    if not starts:
        return None
    parts = dict.fromkeys(("training", "startup", "stall", "final", "unaccounted", "restart_gap", "queue"), 0.0)
    restarts: list[dict[str, Any]] = []
    t_first = float(events[starts[0]]["time"])
    last = events[-1]
    ended = last["event"] in ("finished", "cancelled", "gave_up") or (
        last["event"] == "failed" and not (last.get("will_requeue") or last.get("will_restart")))
    t_last = float(last["time"]) if ended else max(float(last["time"]), time.time() if now is None else now)
    prev_end: float | None = None
    prev_cause: str | None = None
    for k, i in enumerate(starts):
        start = events[i]
        t0 = float(start["time"])
        nxt = starts[k + 1] if k + 1 < len(starts) else len(events)
        own = events[i + 1:nxt]
        if prev_end is not None:
            gap = max(0.0, t0 - prev_end)
            parts["restart_gap" if _num(start.get("attempt")) > 0 else "queue"] += gap
        times = next((e for e in reversed(own) if e["event"] == "times"), None)
        # The start's end: a crash the next start recorded (its srun's end), else its own last ending event.
        crashed = next((e for e in own if e["event"] == "crashed"), None)
        ending = [e for e in own if e["event"] in _ENDS]
        if crashed is not None and _num(crashed.get("time_of_end")) >= t0:
            end = _num(crashed["time_of_end"])
        elif ending:
            end = float(ending[-1]["time"])
        elif nxt < len(events):
            end = float(events[nxt - 1]["time"]) if nxt - 1 > i else t0
        else:
            end = t_last
        end = max(end, t0)
        wall = end - t0
        if times is not None:
            split = {"training": _num(times.get("step_s")), "startup": _num(times.get("start_s")) +
                     _num(times.get("restore_s")), "stall": _num(times.get("save_s")), "final": _num(times.get("final_s"))}
            scale = min(1.0, wall / sum(split.values())) if sum(split.values()) > 0 else 1.0
            for name, v in split.items():
                parts[name] += v * scale
            parts["unaccounted"] += max(0.0, wall - sum(split.values()) * scale)
        else:
            parts["unaccounted"] += wall
        if prev_cause is not None:
            first_poll = t0 + (_num(times.get("start_s")) if times is not None else 0.0)
            assert prev_end is not None
            restarts.append({"cause": prev_cause, "at": round(prev_end, 3), "restart_s": round(first_poll - prev_end, 3),
                             "in_allocation": _num(start.get("attempt")) > 0})
        prev_end = end
        kinds = {e["event"] for e in own}
        req = next((e for e in reversed(own) if e["event"] == "requeued"), None)
        prev_cause = ("hang" if "hang" in kinds else "crashed" if crashed is not None else "failed" if "failed" in kinds
                      else str(req.get("reason") or "requeued") if req is not None else "resubmitted")
    if prev_end is not None and t_last > prev_end:  # requeued or resubmitted, and not started again yet
        parts["queue"] += t_last - prev_end
    wall = max(0.0, t_last - t_first)
    total = sum(parts.values())
    if total > wall:  # a clock step or events out of order: never report more than the wall time
        parts = {k: v * wall / total for k, v in parts.items()} if total else parts
    return {"wall_s": round(wall, 3), "ettr": round(parts["training"] / wall, 4) if wall > 0 else None,
            **{f"{k}_s": round(v, 3) for k, v in parts.items()}, "restarts": restarts}


def line(g: dict[str, Any]) -> str:
    """One line for ``alpsck status``."""
    def dur(s: float) -> str:
        s = int(round(s))
        return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"

    ettr = "-" if g["ettr"] is None else f"{100 * g['ettr']:.0f}%"
    causes: dict[str, int] = {}
    for r in g["restarts"]:
        causes[r["cause"]] = causes.get(r["cause"], 0) + 1
    restarts = ", ".join(f"{n} {c}" for c, n in causes.items()) or "none"
    return (f"goodput: ETTR {ettr} (training {dur(g['training_s'])} of {dur(g['wall_s'])}; startup "
            f"{dur(g['startup_s'])}, stalls {dur(g['stall_s'])}, final checkpoints {dur(g['final_s'])}, queue "
            f"{dur(g['queue_s'])}, restarts in the allocation {dur(g['restart_gap_s'])}, unaccounted "
            f"{dur(g['unaccounted_s'])}); restarts: {restarts}")
