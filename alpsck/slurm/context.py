"""JobContext: what a training entry point gets from the SLURM layer.

An entry ``module:function`` is called as ``function(job)`` with a :class:`JobContext`. It
trains, polls ``job.stop_requested()`` at every step boundary (or iterates ``job.steps(...)``),
and when a stop is requested saves a final checkpoint, waits until it is durable, and returns.
The runner does the rest (history, requeue). A script entry (``entry.script``) runs in the same
process with ``sys.argv`` set; it reaches the same object through :func:`current_job`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..progress import mark_loop
from .config import JobConfig
from .stop import StopController

_CURRENT: JobContext | None = None


def current_job() -> JobContext | None:
    """The JobContext of the running job, or None outside ``alpsck submit``."""
    return _CURRENT


def _set_current(ctx: JobContext | None) -> None:
    global _CURRENT
    _CURRENT = ctx


@dataclass
class JobContext:
    config: JobConfig
    job_id: str
    restart: int           # 0 on the first start, then 1, 2, ... per requeue
    rank: int
    world_size: int
    stop: StopController
    resume_step: int | None = None   # the step a restore tries first, at start (data CRCs not read)
    restored_step: int | None = None  # the step a Checkpointer.restore of this job used (None: none yet, or fresh)
    _last_save: float = field(default_factory=time.monotonic)
    _auto: Any = None  # checkpoint.every: auto (alpsck.slurm.interval.AutoInterval), made at the first step

    @property
    def run_dir(self) -> str:
        return self.config.run_dir

    @property
    def argv(self) -> list[str]:
        return list(self.config.entry.args)

    def stop_requested(self) -> bool:
        """Poll at step boundaries: True once a time-limit, preemption, cancel or maintenance
        stop was requested. Then save a final checkpoint, wait for it, and return. Each poll is
        the loop's progress for the hang watchdog (:mod:`alpsck.progress`): a step's, or once a
        stop was seen the final checkpoint's, which has a timeout of its own."""
        stopping = self.stop.requested()
        mark_loop("final" if stopping else "step")
        return stopping

    @property
    def stop_reason(self) -> str | None:
        return self.stop.reason

    def checkpoint_due(self, step: int) -> str:
        """Where a checkpoint of ``step`` is due, or "" (false) for none: ``"run_dir"`` when
        ``checkpoint.every_steps`` or ``checkpoint.every_seconds`` says to save now (with ``checkpoint.every:
        auto``, when Young/Daly's interval from the measured save cost has passed); else ``"memory"`` when
        ``step`` is a multiple of ``checkpoint.memory_every``. Pass it on: ``ckpt.save(step, state, tier=due)``."""
        persistent = self._persistent_due(step)
        every = self.config.checkpoint.memory_every
        return "run_dir" if persistent else "memory" if every and step % every == 0 else ""

    def _persistent_due(self, step: int) -> bool:
        ck = self.config.checkpoint
        if ck.every == "auto":
            if self._auto is None:
                from . import history, timeline
                from .interval import AutoInterval

                def record(**kw: Any) -> None:
                    if self.rank == 0:
                        history.append(self.run_dir, history.Interval(job_id=self.job_id, **kw))

                self._auto = AutoInterval(ck.mtbf_s, timeline.read(self.run_dir), record)
            return bool(self._auto.due())
        due = bool(ck.every_steps and step % ck.every_steps == 0)
        if ck.every_seconds and time.monotonic() - self._last_save >= ck.every_seconds:
            due = True
        if due:
            self._last_save = time.monotonic()
        return due

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """Steps start..stop-1, ending early (before yielding) once a stop is requested."""
        for s in range(start, stop):
            if self.stop_requested():
                return
            yield s

    def checkpointer(self, **overrides: Any) -> Any:
        """An :class:`alpsck.Checkpointer` on the run dir with the config's settings."""
        from ..checkpointer import Checkpointer

        ck = self.config.checkpoint
        kw: dict[str, Any] = {**ck.engine_options(), "lustre_layout": ck.lustre_layout, "preflight": ck.preflight,
                              "rank": self.rank, "memory": bool(ck.memory_every)}
        kw.update(overrides)
        return Checkpointer(self.run_dir, **kw)
