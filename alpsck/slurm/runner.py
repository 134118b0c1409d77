"""JobRunner: the callable submitit runs inside the job, on every start and restart.

On each start (rank 0 writes history; every rank runs the entry):

1. install stop handlers (replacing submitit's, which would checkpoint inside the signal
   handler) and the maintenance watcher;
2. record ``started`` with the restart count and the step it resumes from; end with
   ``gave_up`` if the restart budget is spent, or if the last ``give_up_after_no_progress``
   starts all resumed from the same step (a job that crashes at every start);
3. run the entry (``module:function`` with a JobContext, or a script via runpy);
4. then, by outcome:
   - stop requested (timeout / preemption / maintenance): ``final_checkpoint`` (newest durable
     step, seconds since the signal), then requeue;
   - stop requested by ``scancel``: ``final_checkpoint``, ``cancelled``, no requeue;
   - returned normally: ``finished``;
   - raised: ``failed``, then requeue if ``requeue.on_failure`` and budget remain, else re-raise.

Requeue: under submitit's local executor, exit with its requeue code (144), which restarts the
task. Under SLURM, ``scontrol requeue $SLURM_JOB_ID`` from rank 0; where that fails (Slurm
commands are not available inside an Alps container), write ``RUN_DIR/.requeue-request`` and
exit with code 3: the batch script's EXIT trap, which runs on the host, requeues the job (see
:func:`alpsck.slurm.submit.requeue_trap_lines`).
"""

from __future__ import annotations

import importlib
import os
import runpy
import subprocess
import sys
import time
import traceback
from typing import Any

from .. import _core
from . import history
from .config import JobConfig
from .context import JobContext, _set_current
from .stop import StopController, scontrol_available

LOCAL_REQUEUE_EXIT = 144  # submitit.local.local.LOCAL_REQUEUE_RETURN_CODE
LOCAL_MAX_RESTARTS = 5    # submitit's local controller starts a task at most 6 times (run(max_retry=6))
REQUEUE_EXIT = 3          # asks the batch script's EXIT trap to requeue
REQUEST_FILE = ".requeue-request"


def newest_step(run_dir: str) -> int | None:
    try:
        good = [c["step"] for c in _core.scan(run_dir) if c["status"] == "committed"]
    except OSError:
        return None
    return max(good) if good else None


def _env_int(*names: str, default: int = 0) -> int:
    for n in names:
        v = os.environ.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return default


class JobRunner:
    """Picklable entry of a submitted job (see the module docstring)."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config

    # -- environment ----------------------------------------------------------------------------

    @staticmethod
    def _local() -> bool:
        return "SUBMITIT_LOCAL_JOB_ID" in os.environ

    def _ids(self) -> tuple[str, int, int]:
        job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or "local"
        rank = _env_int("SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID", "RANK")
        world = _env_int("SLURM_NTASKS", "SUBMITIT_LOCAL_NTASKS", "WORLD_SIZE", default=1)
        return job_id, rank, world

    def _restart_count(self, job_id: str, events: list[dict[str, Any]]) -> int:
        if "SLURM_RESTART_COUNT" in os.environ:
            return _env_int("SLURM_RESTART_COUNT")
        return sum(1 for e in events if e["event"] == "started" and e.get("job_id") == job_id)

    # -- the job --------------------------------------------------------------------------------

    def __call__(self) -> Any:
        cfg = self.config
        job_id, rank, world = self._ids()
        rq = cfg.requeue
        stop = StopController(job_id, timeout_signal=rq.signal, maintenance=rq.on_maintenance and rank == 0,
                              margin_s=rq.maintenance_margin_s, poll_s=rq.maintenance_poll_s)
        stop.install()
        log = (lambda event, **kw: history.append(cfg.run_dir, event, job_id=job_id, **kw)) if rank == 0 else (
            lambda event, **kw: None)
        events = history.read(cfg.run_dir)
        restart = self._restart_count(job_id, events)
        resume = newest_step(cfg.run_dir)
        log("started", restart=restart, step=resume, rank=rank, world_size=world)

        if rank == 0:
            starts = [e for e in events if e["event"] == "started" and e.get("job_id") == job_id]
            same = [e for e in starts[-rq.give_up_after_no_progress:] if e.get("step") == resume]
            if restart > rq.max_restarts:  # requeued by someone else (e.g. preemption) past the budget
                return self._give_up(log, f"restart {restart} is past requeue.max_restarts ({rq.max_restarts})")
            if len(starts) >= rq.give_up_after_no_progress and len(same) == rq.give_up_after_no_progress:
                return self._give_up(log, f"no progress: the last {len(same)} starts all resumed from step {resume}")

        ctx = JobContext(cfg, job_id, restart, rank, world, stop, resume_step=resume)
        _set_current(ctx)
        try:
            result = self._run_entry(ctx)
        except BaseException as e:  # noqa: BLE001 - SystemExit from a script counts as a failure too
            if isinstance(e, SystemExit) and e.code in (0, None):
                result = None
            else:
                stop.close()
                return self._failed(log, ctx, e)
        finally:
            _set_current(None)
        stop.close()
        if stop.reason is None:
            log("finished", step=newest_step(cfg.run_dir))
            return result
        step = newest_step(cfg.run_dir)
        seconds = round(time.time() - stop.signal_time, 3) if stop.signal_time else None
        log("signal", reason=stop.reason, time_of_signal=stop.signal_time)
        log("final_checkpoint", reason=stop.reason, step=step, seconds=seconds)
        if stop.reason == "cancel":
            log("cancelled", step=step)
            return result
        if rank != 0:
            return result
        budget = min(rq.max_restarts, LOCAL_MAX_RESTARTS) if self._local() else rq.max_restarts
        if restart >= budget:
            why = "submitit's local executor restarts a task at most 5 times" if budget < rq.max_restarts else (
                f"requeue.max_restarts is {rq.max_restarts}")
            return self._give_up(log, f"stopped ({stop.reason}) after {restart} restarts; {why}")
        return self._requeue(log, stop.reason, step)

    def _run_entry(self, ctx: JobContext) -> Any:
        entry = self.config.entry
        if entry.function:
            mod, fn = entry.function.split(":")
            return getattr(importlib.import_module(mod), fn)(ctx)
        assert entry.script is not None
        old_argv = sys.argv
        sys.argv = [entry.script, *entry.args]
        try:
            runpy.run_path(entry.script, run_name="__main__")
        finally:
            sys.argv = old_argv
        return None

    def _give_up(self, log: Any, message: str) -> None:
        log("gave_up", message=message, step=newest_step(self.config.run_dir))
        print(f"alpsck: giving up: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1)

    def _failed(self, log: Any, ctx: JobContext, err: BaseException) -> Any:
        rq = self.config.requeue
        will = rq.on_failure and ctx.restart < rq.max_restarts and ctx.rank == 0
        log("failed", message="".join(traceback.format_exception_only(type(err), err)).strip()[-2000:],
            step=newest_step(self.config.run_dir), will_requeue=will)
        traceback.print_exception(type(err), err, err.__traceback__)
        if will:
            return self._requeue(log, "failure", newest_step(self.config.run_dir))
        raise SystemExit(1)

    def _requeue(self, log: Any, reason: str, step: int | None) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self._local():
            log("requeued", reason=reason, step=step, mechanism="local")
            os._exit(LOCAL_REQUEUE_EXIT)  # submitit's local controller restarts the task
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if scontrol_available():
            try:
                subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60, capture_output=True)
                log("requeued", reason=reason, step=step, mechanism="scontrol")
                os._exit(0)
            except (OSError, subprocess.SubprocessError) as e:
                print(f"alpsck: scontrol requeue failed ({e}); asking the batch script", file=sys.stderr)
        with open(os.path.join(self.config.run_dir, REQUEST_FILE), "w") as f:
            f.write(job_id + "\n")
            f.flush()
            os.fsync(f.fileno())
        log("requeued", reason=reason, step=step, mechanism="batch-script")
        os._exit(REQUEUE_EXIT)
