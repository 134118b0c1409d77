"""What a submitted job is doing now: its history reconciled with whether it still lives, its log,
and the lines ``alpsck submit`` prints while it waits.

The timeline's state (:attr:`alpsck.slurm.timeline.Timeline.state`) is the job's own record. A job
that died without writing its end (it could not start at all, a SIGKILL, a lost node) would stay
``pending`` or ``running`` there forever; :func:`reconcile` asks the backend whether the job still exists (the local executor's
controller process; SLURM's queue) and calls such a job ``failed``, with the end of its log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .. import _core
from ..errors import SlurmError, UsageError
from ..out.textout import local_time, printable
from ..store.durable import read_small_inside
from . import commands, history, timeline
from .history import Event
from .timeline import CANCELLED, FAILED, LIVE_STATES, PENDING, TIMEOUT, Timeline, as_timeline

_FIELDS = ("node", "reason", "step", "from_step", "seconds", "restart", "mechanism", "message", "not_requeued", "malformed")
_LOG_DIR = "submitit"
LATEST = _core.run_dir_names["latest"]  # the run directory's names belong to the core (run_dir.h)


def _log_name(job_id: str) -> str:
    if not history.is_job_id(job_id):  # never a path (../x) or a NUL: history.normalise lets none through
        raise UsageError(f"{printable(job_id, 100)}: not a job id (SLURM's, or the local executor's)")
    return f"{job_id}_0_log.out"


def log_path(run_dir: str | os.PathLike[str], job_id: str) -> Path:
    """The job's log (rank 0; stdout and stderr together), written by submitit."""
    return Path(run_dir) / _LOG_DIR / _log_name(job_id)


def log_tail(run_dir: str | os.PathLike[str], job_id: str, lines: int = 15) -> list[str]:
    """The last ``lines`` lines of the job's log, escaped for the terminal (:func:`printable`); []
    when there is none, or it is not a regular file inside the run directory (a symlink, there or
    at ``submitit/``, is not followed)."""
    try:
        data = read_small_inside(run_dir, (_LOG_DIR, _log_name(job_id)), 64 * 1024, tail=True)
    except OSError:
        return []
    return [printable(line) for line in data.decode(errors="replace").splitlines()[-lines:]]


def describe(e: Event | dict[str, Any]) -> str:
    """One event (its record, or as :func:`history.normalise` leaves it) as a timeline line: time, event,
    its fields, escaped for the terminal."""
    rec = timeline.record_of(e) if isinstance(e, dict) else e
    extra = " ".join(f"{k}={printable(rec.get(k), 500)}" for k in _FIELDS if rec.get(k) is not None)
    return f"{local_time(rec.time or 0.0)}  {printable(rec.kind, 40):<17} {extra}".rstrip()


def last_submission(events: Timeline | list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest event naming a job and its backend (:meth:`Timeline.last_submission`), as read."""
    return as_timeline(events).last_submission()


def local_job_alive(job_id: str, run_dir: str | os.PathLike[str]) -> bool:
    """Whether the local executor's controller of ``job_id`` (its pid) still runs this run dir's job."""
    if not job_id.isdigit():
        return False
    try:
        cmdline = Path(f"/proc/{job_id}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    folder = os.fsencode(str(Path(run_dir) / "submitit"))
    return any(os.path.abspath(arg) == os.path.abspath(folder) for arg in cmdline if arg)


def job_alive(run_dir: str | os.PathLike[str], submission: dict[str, Any]) -> tuple[bool | None, str | None]:
    """Whether the submitted job still exists (None when nobody can tell: SLURM not answering),
    and, for a live SLURM job, its JobState in the queue (PENDING, RUNNING, COMPLETING...)."""
    job_id = str(submission.get("job_id"))
    if submission.get("backend") == "local":
        return local_job_alive(job_id, run_dir), None
    if commands.unavailable() is not None:
        return None, None
    live = live_jobs(os.fspath(run_dir))
    if live is None:
        return None, None
    state = next((st for i, st in live if i == job_id), None)
    return state is not None, state


# squeue states after which a job no longer runs nor comes back by itself.
_ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
          "REVOKED"}


def live_jobs(run_dir: str | Path, *, budget: float | None = 0) -> list[tuple[str, str]] | None:
    """(job id, state) of the jobs in ``run_dir``'s history that SLURM still queues or runs.

    A job the controller no longer knows (finished long ago, or from a cluster since restarted)
    is not live. None when squeue gave no answer within ``budget`` seconds of retries (None: the
    default budget of :mod:`commands`; 0: one try).
    """
    tl = timeline.read(run_dir)
    ids = list(dict.fromkeys(str(e.job_id) for e in (tl.records[i] for i in tl.submissions())
                             if e.get("backend") == "slurm" and str(e.job_id).isdigit()))
    if not ids:
        return []
    try:  # "Invalid job id": no job of the list is known
        r = commands.squeue("-h", "-o", "%i %T", "-j", ",".join(ids), budget=budget,
                            accept=lambda code, _out, err: code == 0 or "Invalid job id" in err)
    except SlurmError:
        return None
    out = []
    for line in r.stdout.splitlines():
        job_id, _, state = line.strip().partition(" ")
        if job_id in ids and state and state not in _ENDED:
            out.append((job_id, state))
    return out


def slurm_record(job_id: str) -> dict[str, str] | None:
    """How SLURM recorded the job's end: ``{"state": JobState, "exit_code": "N:S"}`` from ``sacct``
    (the accounting database; where accounting is off, the job-completion log, ``sacct -c``), or
    None when neither knows the job or cannot be asked."""
    for source in ("-X", "-c"):  # the accounting database, then the job-completion log
        try:  # one try each (a report must not wait)
            r = commands.sacct(source, "-n", "-P", "-j", job_id, "-o", "JobID,State,ExitCode")
        except SlurmError:
            continue
        rows = [line.split("|") for line in r.stdout.splitlines() if line.count("|") == 2]
        rows = [row for row in rows if row[0] == job_id]
        if rows:
            state = rows[-1][1].split()[0]  # "CANCELLED by 0" -> CANCELLED
            return {"state": state, "exit_code": rows[-1][2]}
    return None


# What SLURM's final JobState means for a job whose history records no end.
_SLURM_ENDS = {"CANCELLED": CANCELLED, "TIMEOUT": TIMEOUT, "DEADLINE": TIMEOUT}


def decide(recorded: str, alive: bool | None, slurm: dict[str, Any] | None, job_id: str) -> tuple[str, str | None]:
    """The state machine of ``alpsck status``: the state and a note, from the state the history
    records (:attr:`Timeline.state`), whether the job still exists (None: cannot tell) and
    SLURM's view of the job (read only once the job is gone, as its record of the end; None: not a
    SLURM job, or SLURM does not say).

    An end the history records (finished, failed, cancelled, gave_up) stands. A job the history
    says is still on (pending, running, requeued) stays so while it exists or nobody can tell;
    once it is gone, SLURM's record names the end: CANCELLED is cancelled (a scancel while pending,
    after a requeue), TIMEOUT timeout, anything else, or no record, failed."""
    if recorded not in LIVE_STATES or alive is not False:
        return recorded, None
    state = _SLURM_ENDS.get(slurm["state"], FAILED) if slurm else FAILED
    if state == CANCELLED:
        return state, f"job {job_id} was cancelled ({'before it started' if recorded == PENDING else recorded})"
    how = "could not start (see its log)" if recorded == PENDING else "ended without recording how"
    said = (f"SLURM: {slurm['state']}, exit code {slurm['exit_code']}" if slurm else
            "killed, its node lost, or the cluster restarted")
    return state, f"job {job_id} no longer exists: it {how} ({said}). Submit again to resume from the newest checkpoint"


def reconcile(run_dir: str | os.PathLike[str], events: Timeline | list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The job's state: ``state`` (one of history.STATES, by :func:`decide`), ``note`` (or None),
    ``log`` (path of the newest job's log, or None), ``log_tail`` (its last lines, for a failure),
    ``slurm``: for a SLURM job, SLURM's view, ``{"state", "exit_code"}``: its JobState in the queue
    while it lives (exit code None), SLURM's record of its end once it has ended (None where
    SLURM does not tell)."""
    tl = timeline.read(run_dir) if events is None else as_timeline(events)
    recorded = tl.state
    sub = tl.last_submission()  # its job id is one history.is_job_id accepts (history.normalise)
    log = log_path(run_dir, sub["job_id"]) if sub is not None else None
    out: dict[str, Any] = {"state": recorded, "note": None, "log": str(log) if log else None, "log_tail": [],
                           "slurm": None}
    if sub is None:
        return out
    job_id = sub["job_id"]
    alive, queue_state = job_alive(run_dir, sub)
    if sub.get("backend") == "slurm":
        if alive:
            out["slurm"] = {"state": queue_state, "exit_code": None}
        elif alive is False:
            out["slurm"] = slurm_record(job_id)
    out["state"], out["note"] = decide(recorded, alive, out["slurm"], job_id)
    if out["state"] == FAILED:
        out["log_tail"] = log_tail(run_dir, job_id)
    return out


def error_line(tail: list[str]) -> str | None:
    """The line of a log tail that names the error (a traceback's last line), if any."""
    for line in reversed(tail):
        text = line.strip()
        if text and not text.startswith(("alpsck:", "File ", "^", "~")) and (":" in text or "Error" in text):
            return text
    return None


class Follower:
    """Prints what a job does while ``alpsck submit`` waits: one line per new history event, and
    one per newly committed checkpoint, in the order of their times."""

    def __init__(self, run_dir: str, newest: Callable[[str], int | None], out: IO[str], since: int) -> None:
        """``since``: the log's size (:attr:`history.Log.end`) before the job was submitted."""
        self.run_dir, self.newest, self.out, self.seen = run_dir, newest, out, since
        self.latest = self._latest()
        self.step = newest(run_dir)

    def _latest(self) -> tuple[int, int] | None:
        """LATEST's (mtime, inode): rank 0 rewrites it after every commit, so one ``stat`` per poll
        says whether to ask the picker (which opens every shard) again."""
        try:
            st = os.stat(os.path.join(self.run_dir, LATEST))
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def poll(self) -> None:
        lines: list[tuple[float, str]] = []
        latest = self._latest()  # first: a stop's final checkpoint is durable before its events
        if latest != self.latest:
            self.latest = latest
            step = self.newest(self.run_dir)
            if step is not None and step != self.step:
                when = latest[0] / 1e9 if latest is not None else time.time()  # LATEST's write: the commit
                lines.append((when, f"{local_time(when)}  {'checkpoint':<17} step={step} (durable)"))
                self.step = step
        log = history.read_log(self.run_dir, since=self.seen)
        lines += [(e.time or 0.0, describe(e)) for e in timeline.fold(log.events).records]
        for _, line in sorted(lines, key=lambda x: x[0]):  # stable: events keep their log order
            self.out.write(line + "\n")
        self.seen = log.end or self.seen  # 0: no log (yet), or it could not be read this time
        self.out.flush()

    def wait(self, done: Callable[[], bool], interval: float = 1.0) -> None:
        while not done():
            self.poll()
            time.sleep(interval)
        self.poll()
