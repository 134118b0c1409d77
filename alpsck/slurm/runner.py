"""JobRunner: the callable submitit runs inside the job, on every start and restart.

On each start (rank 0 writes history; every rank runs the entry):

1. install stop handlers (replacing submitit's, which would checkpoint inside the signal
   handler) and the maintenance watcher;
2. record ``started`` with the restart count and the step it resumes from; end with
   ``gave_up`` (exit :data:`GIVE_UP_EXIT`, 93: do not requeue) if the restart budget is spent
   (:meth:`alpsck.slurm.timeline.Timeline.charged_starts`: a requeue after which the newest checkpoint had advanced costs
   nothing; a crash or a stop without progress costs one), or if the last
   ``give_up_after_no_progress`` starts all resumed from the same step (a job that crashes at
   every start). With several tasks, rank 0 decides and writes its decision to ``RUN_DIR/.start-decision``; the other
   ranks wait for it, so that all of them run (from the same step) or none;
3. export the torch.distributed environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``) for a multi-task job, so the entry can call
   ``init_process_group()``; then run the entry (``module:function`` with a JobContext, or a
   script via runpy). The entry must agree across ranks on when to stop (the reference training
   all-reduces the stop flag each step), so every rank takes the same final checkpoint;
4. then, by outcome (signals that came after the loop saw its stop are taken in first):
   - the loop saw a stop (timeout / preemption / maintenance): ``final_checkpoint`` (newest
     durable step, seconds since the signal), then requeue;
   - the loop saw a stop and ``scancel`` came, before or during the final checkpoint:
     ``final_checkpoint``, ``cancelled``, no requeue;
   - returned normally without seeing a stop (one that came during the last step included):
     ``finished``;
   - raised: ``failed``, then requeue if ``requeue.on_failure``, the job was not cancelled, the
     restart budget (the same one as a stop's) remains, and the error can change on a retry:
     an ImportError, SyntaxError or config error, or the same error as the previous start with
     no checkpoint in between, ends the run ``failed`` at once; else exit 1;
   - raised RollbackLimitError (the loss went bad again after ``max_rollbacks`` in-process rollbacks):
     ``gave_up`` with its message, exit 93 (a requeue would diverge again).

Restart in the allocation first (under SLURM, ``requeue.in_job_restarts`` times per allocation): a
failure the rules above would requeue exits with :data:`RESTART_EXIT` instead, unless the allocation
is ending (:meth:`StopController.allocation_ending`), and the batch script's restart loop
(:func:`alpsck.slurm.submit.restart_loop_lines`) starts the job step again; so it does for a step
whose task died without a word (a signal, a hard exit). The next start records ``crashed`` for such
a step (its exit code, from ``JobEnv.previous_exit``), logs ``started`` with its ``attempt``, and
resumes from the newest checkpoint, under the same give-up rules.

Requeue: under submitit's local executor, exit with its requeue code (144), which restarts the
task. Under SLURM, ``scontrol requeue $SLURM_JOB_ID`` from rank 0, unless SLURM requeued the job
already (reason ``requeue``: it starts again by itself). Where scontrol fails (Slurm commands
are not available inside an Alps container), rank 0 writes ``RUN_DIR/.requeue-request``
(:func:`alpsck.slurm.handoff.request_text`) and exits with code 3: the batch script's EXIT trap, which runs on the
host, asks scontrol what the job's end is (:func:`alpsck.slurm.stop.term_verdict_shell`),
requeues it or not, appends the matching event that the request carries to the history, and
removes the request (:func:`alpsck.slurm.submit.requeue_trap_lines`). A request left by a batch
shell that was killed is removed at the next start.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ConfigError, RollbackLimitError, SlurmError, UsageError, torch_required
from ..job_env import JobEnv, rendezvous_port
from ..progress import RESTORED_HOOKS, SAVED_HOOKS, install_progress
from ..store.picker import pick, taken_at_of
from . import history, timeline, trace
from .config import JobConfig
from .context import JobContext, _set_current
from .exits import GIVE_UP_EXIT, LOCAL_REQUEUE_EXIT, REQUEUE_EXIT, RESTART_EXIT
from .handoff import DECISION_TIMEOUT_S, REQUEST_FILE, remove_request, request_text, wait_decision, write_decision, write_request  # noqa: F401
from .history import (
    Cancelled,
    Crashed,
    Event,
    Failed,
    FinalCheckpoint,
    Finished,
    GaveUp,
    Requeued,
    Restored,
    Signal,
    Started,
    Times,
)
from .launch import user_paths
from .stop import StopController, job_end_time, job_fields, scontrol_available, scontrol_requeue, term_verdict
from .stragglers import PaceWatch
from .timeline import Timeline
from .watchdog import Watchdog


def newest_step(run_dir: str) -> int | None:
    """The step a restore tries first (the picker's quick choice, :func:`alpsck.store.picker.pick`, of any
    kind: the entry may save with Checkpointer or DCP), or None: no run directory, none usable, or not
    readable. Data CRCs are not read: a restore that meets a mismatch falls back to an older step, which
    ``JobContext.restored_step`` then records."""
    return resume_point(run_dir)[0]


def resume_point(run_dir: str) -> tuple[int | None, float | None]:
    """:func:`newest_step`, and when its state was taken (unix seconds: the manifest's time less its write's
    duration), for the goodput's work lost: what the start before trained after it is trained again."""
    try:
        p = pick(run_dir)
    except (CheckpointError, OSError):
        return None, None
    return p.step, taken_at_of(p.info)


# Errors that a new start meets again: a requeue would only spend another allocation on them.
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (ImportError, SyntaxError, ConfigError, UsageError)


def _signal_name(exit_code: int | None) -> str | None:
    """The signal a job step's exit code says ended it (srun reports 128 + N), or None."""
    import signal

    if exit_code is None or not 128 < exit_code < 128 + 65:
        return None
    try:
        return signal.Signals(exit_code - 128).name
    except ValueError:
        return None


def _error_text(err: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(err), err)).strip()[-2000:]


def attempt_port(job_id: str, attempt: int) -> int:
    """The rendezvous port of a start of the job step: a new one for each attempt, so the new ranks never meet
    the store of the step that died (a socket still closing), and never in the ephemeral range
    (:func:`alpsck.job_env.rendezvous_port`; submitit's own draw, which it replaces, may be)."""
    return rendezvous_port(job_id, attempt)


def export_torch_distributed_env(job_id: str = "", attempt: int = 0, step_nodes: Sequence[str] = ()) -> None:
    """MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK from the SLURM job, unless already set. ``step_nodes``: the
    job step's nodes (:attr:`alpsck.job_env.JobEnv.step_nodes`)."""
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return
    import submitit

    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(attempt_port(job_id, attempt))

    # CUDA_VISIBLE_DEVICES stays as SLURM set it (on Alps one GPU per task with --gpus-per-task).
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    # submitit takes the rendezvous host and the tasks per node from the job's nodes; a step on some of them
    # (slurm.spare_nodes: a spare, a lost node) has its own: the first of the step's nodes hosts the store.
    if step_nodes:
        os.environ["MASTER_ADDR"] = step_nodes[0]
        os.environ["LOCAL_WORLD_SIZE"] = str(max(1, int(os.environ["WORLD_SIZE"]) // len(step_nodes)))


class JobRunner:
    """Picklable entry of a submitted job (see the module docstring)."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self._stop: StopController | None = None
        self._job = JobEnv()  # this start's, from __call__ on (JobEnv.detect)
        self._job_id = "local"
        self._rank = 0
        self._pace: PaceWatch | None = None  # rank 0's, this start's (_pace_watch)

    # -- environment ----------------------------------------------------------------------------

    def _requeued_by_slurm(self) -> bool:
        return self._stop is not None and self._stop.requeued_by_slurm()

    def _restart_count(self, job_id: str, tl: Timeline) -> int:
        if self._job.slurm_restarts is not None:
            return self._job.slurm_restarts
        return len(tl.starts_of(job_id))

    def _log(self, event: Event) -> None:
        """Record ``event`` of this job in the run's history (rank 0 writes; the other ranks do nothing)."""
        if self._rank == 0:
            history.append(self.config.run_dir, event, job_id=self._job_id)

    # -- the job --------------------------------------------------------------------------------

    def __call__(self) -> Any:
        try:
            return self._run()
        finally:
            # The outcome is decided and recorded: a stop signal from now on (the time limit's,
            # arriving while Python and torch tear down) has nothing left to stop, and must not
            # kill the task and turn a finished run into a FAILED job.
            if self._stop is not None:
                self._stop.ignore_late()

    def _run(self) -> Any:
        cfg = self.config
        job = self._job = JobEnv.detect()
        job_id, rank, world = job.job_id or "local", job.rank, job.world_size
        self._job_id, self._rank = job_id, rank
        rq = cfg.requeue
        # A local job has no SLURM reservation to watch (a cluster on the same machine is not its own).
        stop = StopController(job_id, timeout_signal=rq.signal,
                              maintenance=rq.on_maintenance and rank == 0 and not job.local,
                              margin_s=rq.maintenance_margin_s, poll_s=rq.maintenance_poll_s,
                              slurm_restarts=job.slurm_restarts or 0, slurm=not job.local)
        stop.install()
        self._stop = stop
        tl = self._timeline = timeline.read(cfg.run_dir)
        restart = self._restart_count(job_id, tl)
        self._charged = tl.charged_starts(job_id)  # earlier starts only
        if rank == 0:
            resume, verdict = self._decide_start(stop, restart)
            if world > 1:
                write_decision(cfg.run_dir, job_id, restart, resume, verdict, job.attempt)
            if verdict is not None:
                return self._give_up(verdict)
        else:
            decision = wait_decision(cfg.run_dir, job_id, restart, DECISION_TIMEOUT_S, job.attempt)
            if decision["give_up"] is not None:
                print(f"alpsck: rank {rank}: rank 0 gave up: {decision['give_up']}", file=sys.stderr, flush=True)
                raise SystemExit(GIVE_UP_EXIT)
            resume = decision["resume"]
        if world > 1:
            export_torch_distributed_env(job_id, job.attempt, job.step_nodes)
        ctx = JobContext(cfg, job_id, restart, rank, world, stop, resume_step=resume)

        def restored(run_dir: Path, step: int | None, tier: str | None, taken: float | None) -> None:
            if os.path.realpath(run_dir) != os.path.realpath(cfg.run_dir):
                return
            ctx.restored_step = step
            if step != resume or tier in ("memory", "replica"):  # it fell back (a CRC failed), or came from memory
                self._log(Restored(step=step, resume_step=resume, tier=tier,  # resume: the run directory's pick
                                   taken_at=None if taken is None else round(taken, 3)))

        RESTORED_HOOKS.append(restored)
        saved = self._pace_watch(job)
        if saved is not None:
            SAVED_HOOKS.append(saved)
        _set_current(ctx)
        dog = self._watchdog(tl)
        try:
            with torch_required(f"the job's entry {self.config.entry.function or self.config.entry.script}"):
                result = self._run_entry(ctx)
        except BaseException as e:  # noqa: BLE001 - SystemExit from a script counts as a failure too
            self._end_watch(dog)
            dog = None
            if isinstance(e, SystemExit) and e.code in (0, None):
                result = None
            else:
                stop.close()
                return self._failed(ctx, e)
        finally:
            self._end_watch(dog)
            _set_current(None)
            RESTORED_HOOKS.remove(restored)
            if saved is not None:
                SAVED_HOOKS.remove(saved)
        stop.close()
        return self._returned(ctx, result)

    def _decide_start(self, stop: StopController, restart: int) -> tuple[int | None, str | None]:
        """Rank 0's start: record it (and a crash of the step before), and decide whether to run: the step
        it resumes from, and why it gives up instead (or None)."""
        cfg, job, job_id, rq, tl = self.config, self._job, self._job_id, self.config.requeue, self._timeline
        attempt = job.attempt
        remove_request(cfg.run_dir)
        resume, taken_at = resume_point(cfg.run_dir)
        if attempt and not job.local and rq.signal_delay_s is not None:
            # The time-limit signal comes once, to the job step then running: one that came between two
            # attempts reached none. Past that point of the allocation, the restarted step stops at once
            # (a final checkpoint and the requeue, as after the signal); the loop agrees on it across ranks.
            end = job_end_time(job_id)
            if end is not None and end - time.time() <= rq.signal_delay_s:
                stop.request("timeout")
        # The step before died without asking for the restart (RESTART_EXIT): a task killed or exiting hard.
        # A rank that failed because of it (a peer gone) may have recorded that failure first; the crash is
        # still the cause. The watchdog's own kill is recorded as the hang it was.
        if attempt and job.previous_exit != RESTART_EXIT and not tl.hung(job_id):
            self._log(Crashed(attempt=attempt - 1, exit_code=job.previous_exit, time_of_end=job.previous_end,
                              signal=_signal_name(job.previous_exit)))
        self._log(Started(
            restart=restart, step=resume, rank=job.rank, world_size=job.world_size,
            backend="local" if job.local else "slurm", step_taken_at=round(taken_at, 3) if taken_at else None,
            maintenance_watch=stop.maintenance_off(), attempt=attempt or None,
            down_s=round(time.time() - job.previous_end, 3) if attempt and job.previous_end else None))
        starts = tl.starts_of(job_id)
        same = [e for e in starts[-rq.give_up_after_no_progress:] if e.step == resume]
        if self._charged > rq.max_restarts:  # requeued by someone else (e.g. preemption) past the budget
            return resume, (f"{self._charged} earlier starts crashed or made no progress: more than "
                            f"requeue.max_restarts ({rq.max_restarts})")
        if len(starts) >= rq.give_up_after_no_progress and len(same) == rq.give_up_after_no_progress:
            return resume, f"no progress: the last {len(same)} starts all resumed from step {resume}"
        return resume, None

    def _pace_watch(self, job: JobEnv) -> Callable[[Path, dict[str, Any]], None] | None:
        """Rank 0's watch over the ranks' pace at the run directory's saves (:mod:`.stragglers`; its nodes name the
        ranks a failed commit missed: :meth:`_failed`), or None."""
        h, cfg = self.config.health, self.config
        if job.rank != 0 or job.world_size < 2:
            return None
        watch = self._pace = PaceWatch(cfg.run_dir, self._job_id, job.attempt, factor=h.straggler_factor,
                                       saves=h.straggler_saves)

        def saved(run_dir: Path, result: dict[str, Any]) -> None:
            if os.path.realpath(run_dir) == os.path.realpath(cfg.run_dir):
                watch.saw(result)
        return saved

    def _watchdog(self, tl: Timeline) -> Watchdog | None:
        rq, job = self.config.requeue, self._job
        if rq.hang_timeout_s <= 0:
            return None
        dog = Watchdog(rq.hang_timeout_s, run_dir=self.config.run_dir, job_id=self._job_id, rank=job.rank,
                       attempt=job.attempt, learn=(rq.hang_timeout_min_s, tl) if rq.hang_timeout == "learned" else None)
        install_progress(dog)
        dog.start()
        return dog

    def _end_watch(self, dog: Watchdog | None) -> None:
        """Once the entry returned or raised, before any outcome (some end the process): stop the watchdog
        and record where this start's time went (goodput's parts)."""
        if dog is not None:
            dog.stop()
            install_progress(None)
            self._log(Times(attempt=self._job.attempt, **dog.times()))

    def _returned(self, ctx: JobContext, result: Any) -> Any:
        """The entry returned: finished, or stopped (final checkpoint, then cancelled or requeued)."""
        stop, rq, resume = ctx.stop, self.config.requeue, ctx.resume_step
        # Settle signals that came after the loop saw its stop (a scancel during the final
        # checkpoint): the decision below must see them.
        reason = stop.settle(peers=ctx.world_size > 1)
        if reason is None:  # no stop, or one the entry never saw (it finished first): the run is complete
            self._log(Finished(step=newest_step(self.config.run_dir)))
            return result
        step = newest_step(self.config.run_dir)
        seconds = round(time.time() - stop.signal_time, 3) if stop.signal_time else None
        self._log(Signal(reason=reason, time_of_signal=stop.signal_time, step=step))
        self._log(FinalCheckpoint(reason=reason, step=step, seconds=seconds))
        if reason == "cancel":
            self._log(Cancelled(step=step))
            return result
        if ctx.rank != 0:
            return result
        progress = step is not None and (resume is None or step > resume)
        if not progress and self._charged + 1 > rq.max_restarts:
            return self._give_up(f"stopped ({reason}) with no checkpoint newer than step {resume}; "
                                 f"{self._charged + 1} starts crashed or made no progress, and requeue.max_restarts "
                                 f"is {rq.max_restarts}")
        return self._requeue(reason, step, progress=progress)

    def _run_entry(self, ctx: JobContext) -> Any:
        entry = self.config.entry
        # The user's modules: where `alpsck submit` ran and beside the config (alpsck itself is
        # imported by now, from the installed package: see launch.job_python).
        for d in reversed(user_paths(self.config.config_dir, self.config.workdir or os.getcwd())):
            if d not in sys.path:
                sys.path.insert(0, d)
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

    def _give_up(self, message: str) -> None:
        self._log(GaveUp(message=message, step=newest_step(self.config.run_dir), exit_code=GIVE_UP_EXIT))
        print(f"alpsck: giving up (exit {GIVE_UP_EXIT}: do not requeue): {message}", file=sys.stderr, flush=True)
        raise SystemExit(GIVE_UP_EXIT)

    def _retry_verdict(self, ctx: JobContext, err: BaseException, message: str, step: int | None) -> str | None:
        """Why a failed start is not worth another allocation, or None when a retry may succeed."""
        rq = self.config.requeue
        if ctx.stop.cancelled():  # never requeue what the user cancelled, even if it then failed
            return "the job was cancelled"
        if isinstance(err, KeyboardInterrupt):  # scancel --signal=INT: the user interrupted the job
            return "interrupted (SIGINT)"
        if not rq.on_failure:
            return "requeue.on_failure is false"
        if isinstance(err, DETERMINISTIC_ERRORS):
            return f"{type(err).__name__} fails the same way at every start"
        if self._charged + 1 > rq.max_restarts:
            return f"{self._charged + 1} starts crashed or made no progress, and requeue.max_restarts is {rq.max_restarts}"
        # Earlier starts of this job that failed with this error, newest first, with no checkpoint
        # since (each recorded this same newest step): a retry would meet it again.
        if step == ctx.resume_step:
            streak = self._timeline.same_failures(ctx.job_id, message, step)
            if streak >= rq.same_error_retries:
                if streak == 0:
                    return "it failed before writing a checkpoint, and requeue.same_error_retries is 0"
                return (f"the {streak} start(s) before failed with the same error, and no checkpoint was written in "
                        f"between (requeue.same_error_retries is {rq.same_error_retries})")
        return None

    def _failed(self, ctx: JobContext, err: BaseException) -> Any:
        message = _error_text(err)
        if self._pace is not None:  # the commit agreement missed some ranks: their nodes, before the next gate reads
            trace.trace_missing(self.config.run_dir, self._job_id, self._job.attempt, message, self._pace.nodes)
        if isinstance(err, RollbackLimitError):  # the loss kept going bad: another start would diverge again
            traceback.print_exception(type(err), err, err.__traceback__)
            return self._give_up(message)
        step = newest_step(self.config.run_dir)
        why_not = self._retry_verdict(ctx, err, message, step)
        # Inside the allocation first (the batch script's restart loop), while its budget lasts and no stop
        # came (a time limit, a preemption, a requeue by hand: the allocation is ending): every rank decides
        # alike (the same history, the same attempt) and exits for it.
        here = (why_not is None and not self._job.local and self._job.attempt < self.config.requeue.in_job_restarts
                and not ctx.stop.allocation_ending())
        will = why_not is None and ctx.rank == 0 and not here
        # The event keeps the error, also for a cancelled job (its final checkpoint may be missing).
        self._log(Failed(message=message, step=step, will_requeue=will, will_restart=True if here else None,
                         cancelled=True if ctx.stop.cancelled() else None, not_requeued=why_not or None))
        traceback.print_exception(type(err), err, err.__traceback__)
        if here:
            return self._restart_here(ctx, step)
        if will:
            return self._requeue("failure", step, progress=False)
        if why_not:
            print(f"alpsck: not requeued: {why_not}", file=sys.stderr, flush=True)
        raise SystemExit(1)

    def _restart_here(self, ctx: JobContext, step: int | None) -> None:
        """Ask the batch script's restart loop to start the job step again in this allocation (exit 75)."""
        if ctx.rank == 0 and ctx.stop.terminated():
            # A SIGTERM came: the step's own end, or a preemption in its grace time (SLURM shows both as
            # RUNNING). The batch script starts the step again in the first case; in the second its shell
            # was told to stop too, and its EXIT trap requeues the job from this request.
            self._write_request("failure", step, progress=False)
        print(f"alpsck: restarting the job step in this allocation (in-job restart {self._job.attempt + 1} of "
              f"{self.config.requeue.in_job_restarts})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(RESTART_EXIT)

    def _write_request(self, reason: str, step: int | None, progress: bool) -> None:
        """The requeue request for the batch script's EXIT trap (:func:`alpsck.slurm.handoff.request_text`)."""
        write_request(self.config.run_dir, request_text(self._job.slurm_job_id or "", (self._job.slurm_restarts or 0),
                                                        reason, step, progress))

    def _requeue(self, reason: str, step: int | None, *, progress: bool) -> None:
        """Requeue this job; ``progress``: the newest checkpoint advanced during this start, so
        the requeue does not count against ``requeue.max_restarts``."""
        sys.stdout.flush()
        sys.stderr.flush()

        def log(mechanism: str, why: str = reason) -> None:
            self._log(Requeued(reason=why, step=step, mechanism=mechanism, progress=progress))

        if self._job.local:
            log("local")
            os._exit(LOCAL_REQUEUE_EXIT)  # submitit's local controller restarts the task
        job_id = self._job.slurm_job_id or ""
        if self._requeued_by_slurm():  # a "requeue" stop, or a crash after an unpolled requeue
            # scontrol requeue by hand (or an admin): SLURM starts the job again by itself.
            log("slurm", "requeue")
            os._exit(0)
        # "term": scontrol did not answer when the SIGTERM came; the batch script asks it again,
        # rather than a requeue here overriding what may be a scancel.
        if scontrol_available() and reason != "term":
            try:
                scontrol_requeue(job_id)
                log("scontrol")
                os._exit(0)
            except SlurmError as e:
                if term_verdict(job_fields(job_id), (self._job.slurm_restarts or 0)) == "requeue":
                    # It failed after it took effect (the job's restart count is up): our requeue.
                    log("scontrol")
                    os._exit(0)
                print(f"alpsck: scontrol requeue failed ({e}); asking the batch script", file=sys.stderr)
        self._write_request(reason, step, progress)
        # The batch script records the outcome (requeued, or cancelled) from the request.
        print(f"alpsck: asked the batch script to requeue job {job_id} ({reason})", file=sys.stderr, flush=True)
        os._exit(REQUEUE_EXIT)
