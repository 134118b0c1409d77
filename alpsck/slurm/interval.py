"""``checkpoint.every: auto``: the checkpoint interval from the numbers, by Young and Daly.

With C the cost of one checkpoint to training and M the mean time between failures, the interval
that minimises the expected time lost (to checkpoints and to the work a failure throws away) is
Young's ``sqrt(2 C M)``; Daly's higher-order form, used here, corrects it where C is not small
next to M: ``sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for C < 2 M, else M.

C is measured in the job (:class:`AutoInterval`): what a step that saved took beyond the typical
step, that is the loop's stall in the save (an asynchronous save costs the training only its
snapshot), the median of the last saves. M is ``checkpoint.mtbf_s`` when configured, else observed
in the run's history (its time running over its failures: crashes, hangs, failed starts), else a
day. The interval is evaluated again after every save, and rank 0 records it (an ``interval``
event, when it changed by more than a fifth) with the numbers it came from, which ``status`` shows.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .timeline import Timeline, as_timeline

DEFAULT_MTBF_S = 86_400.0
MIN_INTERVAL_S = 1.0


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimum checkpoint interval (seconds of work between checkpoints) for cost C and MTBF M."""
    c, m = max(cost_s, 0.0), max(mtbf_s, 1e-9)
    if c >= 2 * m:
        return m
    r = c / (2 * m)
    return max(MIN_INTERVAL_S, math.sqrt(2 * c * m) * (1 + math.sqrt(r) / 3 + r / 9) - c)


def observed_mtbf(events: Timeline | list[dict[str, Any]]) -> float | None:
    """The run's time running over its failures (starts that crashed, hung or failed), from its timeline
    (:meth:`alpsck.slurm.timeline.Timeline.observed_mtbf`); None before its first failure."""
    return as_timeline(events).observed_mtbf()


class AutoInterval:
    """Decides, step by step, whether a checkpoint is due under ``checkpoint.every: auto``."""

    def __init__(self, mtbf_s: float | None, events: Timeline | list[dict[str, Any]], record: Callable[..., Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        observed = observed_mtbf(events) if mtbf_s is None else None
        self.mtbf_s = mtbf_s if mtbf_s is not None else observed if observed is not None else DEFAULT_MTBF_S
        self.mtbf_from = "configured" if mtbf_s is not None else "observed" if observed is not None else "default"
        self._record, self._clock = record, clock
        self._steps: deque[float] = deque(maxlen=64)   # durations of steps that did not save
        self._costs: deque[float] = deque(maxlen=8)    # what the last saves cost beyond a step
        self._last_call: float | None = None
        self._saved_last = False
        self._last_save = clock()
        self.interval_s: float | None = None            # None until a save was measured: save at the first step
        self._recorded: float | None = None

    def due(self) -> bool:
        now = self._clock()
        if self._last_call is not None:
            took = now - self._last_call
            if self._saved_last:
                if self._steps:
                    self._costs.append(max(0.0, took - statistics.median(self._steps)))
                    self._evaluate()
            else:
                self._steps.append(took)
        self._last_call = now
        due = self.interval_s is None and len(self._steps) >= 3 or (
            self.interval_s is not None and now - self._last_save >= self.interval_s)
        self._saved_last = due
        if due:
            self._last_save = now
        return due

    def _evaluate(self) -> None:
        cost = statistics.median(self._costs)
        self.interval_s = daly_interval(cost, self.mtbf_s)
        if self._recorded is None or abs(self.interval_s - self._recorded) > 0.2 * self._recorded:
            self._recorded = self.interval_s
            self._record(seconds=round(self.interval_s, 3), save_cost_s=round(cost, 4), mtbf_s=round(self.mtbf_s, 1),
                         mtbf_from=self.mtbf_from, rule="daly")
