"""Stop requests: time limit, preemption, cancel, requeue and maintenance, noticed at a step boundary.

Signal handlers only record that a signal came (they run between bytecodes on the main thread
and must not do I/O). The training loop asks :meth:`StopController.requested` at each step
boundary; on the first positive answer the reason is settled:

- the time-limit signal (USR2 by default, sent by SLURM's ``--signal``, or by submitit's local
  executor before its timeout) means ``timeout``;
- SIGTERM is read from SLURM's view of the job (:func:`term_verdict`): ``preemption`` while the
  job is still RUNNING (PreemptMode=REQUEUE with a GraceTime signals the steps and keeps the job
  RUNNING; ``scancel --signal=TERM`` too), ``cancel`` when it is COMPLETING or CANCELLED (what
  ``scancel`` does), ``timeout`` when SLURM ends it at its time limit (Reason=TimeLimit), and
  ``requeue`` when its restart count went up (``scontrol requeue`` by hand or by an admin: SLURM
  starts it again by itself). Where ``scontrol`` cannot be reached (inside an Alps container) it
  is ``term``: the job checkpoints and leaves the verdict to the batch script, which runs on the
  host and asks scontrol the same question (:func:`term_verdict_shell`). Under the local executor
  (``slurm=False``) a SIGTERM is ``preemption``;
- a MAINT reservation that starts before the job would end, and within ``margin_s``, is
  ``maintenance`` (a watcher thread polls ``scontrol show reservation``).

A later SIGTERM changes any reason to ``cancel`` (or ``requeue``) only if scontrol says so; the
runner calls :meth:`StopController.settle` before it decides, so a ``scancel`` that comes
during the final checkpoint of a time-limit stop is a cancel, not a requeue.
"""

from __future__ import annotations

import datetime as dt
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from ..errors import SlurmError
from . import commands
from .launch import EARLY_SIGNALS

# scontrol's stdout for its arguments (``["show", "job", ...]``); SlurmError when it fails. Tests pass their own.
Runner = Callable[[list[str]], str]
run_cmd: Runner = commands.scontrol
scontrol_available = commands.scontrol_available
scontrol_requeue = commands.scontrol_requeue


def job_fields(job_id: str, run: Runner = run_cmd) -> dict[str, str] | None:
    """The ``Name=value`` fields of ``scontrol show job`` (the first of each name: free text such
    as a comment comes later); None when scontrol is missing or fails."""
    if not scontrol_available():
        return None
    try:
        out = run(["show", "job", "-o", job_id])
    except SlurmError:
        return None
    fields: dict[str, str] = {}
    for field in out.split():
        name, eq, value = field.partition("=")
        if eq and name not in fields:
            fields[name] = value
    return fields or None


def job_field(job_id: str, name: str, run: Runner = run_cmd) -> str | None:
    """One field of ``scontrol show job``; None when scontrol is missing or fails."""
    fields = job_fields(job_id, run)
    return fields.get(name) if fields else None


# JobStates in which SLURM is ending the job (scontrol prints COMPLETING until its steps are gone).
_ENDING = ("COMPLETING", "CANCELLED", "TIMEOUT", "DEADLINE")


def term_verdict(fields: dict[str, str] | None, slurm_restarts: int) -> str:
    """What a SIGTERM means, from scontrol's fields of the job and the ``SLURM_RESTART_COUNT`` this
    start began with: ``requeue`` (someone requeued the job: its Restarts went up), ``timeout``
    (SLURM is ending it at its time limit), ``cancel`` (scancel), ``preemption`` (the job is still
    RUNNING), or ``term`` when scontrol cannot tell. Measured on Slurm 22.05: scancel gives
    COMPLETING then CANCELLED with Reason=None; ``scontrol requeue`` gives COMPLETING with Restarts
    already one up; the time limit gives COMPLETING with Reason=TimeLimit; preemption in GraceTime
    keeps RUNNING. The batch script's twin is :func:`term_verdict_shell`; the tests drive both
    through one table."""
    if not fields or "JobState" not in fields:
        return "term"
    restarts = fields.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > slurm_restarts:
        return "requeue"
    state = fields["JobState"]
    if state in _ENDING:
        return "timeout" if state in ("TIMEOUT", "DEADLINE") or fields.get("Reason") == "TimeLimit" else "cancel"
    return "preemption"


def term_verdict_shell() -> list[str]:
    """Bash lines defining ``alpsck_term_verdict``: :func:`term_verdict` for the batch script, on
    the host, for this job (``$SLURM_JOB_ID``, ``$SLURM_RESTART_COUNT``). It prints
    ``preemption`` where scontrol gives no answer: the job asked for a requeue, so try it."""
    ending = "|".join(_ENDING)
    return [
        "alpsck_term_verdict() {",
        '  local fields state reason restarts',
        '  fields=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr -s " " "\\n")',
        '  state=$(printf "%s\\n" "$fields" | sed -n "s/^JobState=//p" | head -n 1)',
        '  reason=$(printf "%s\\n" "$fields" | sed -n "s/^Reason=//p" | head -n 1)',
        '  restarts=$(printf "%s\\n" "$fields" | sed -n "s/^Restarts=//p" | head -n 1)',
        '  case "$restarts" in',
        '    ""|*[!0-9]*) ;;',
        '    *) if [ "$restarts" -gt "${SLURM_RESTART_COUNT:-0}" ]; then echo requeue; return; fi ;;',
        "  esac",
        '  case "$state" in',
        f'    {ending})',
        '      case "$state/$reason" in TIMEOUT/*|DEADLINE/*|*/TimeLimit) echo timeout ;; *) echo cancel ;; esac ;;',
        "    *) echo preemption ;;",
        "  esac",
        "}",
    ]


def _parse_time(text: str) -> float | None:
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()  # SLURM prints local time
    except ValueError:
        return None


def job_end_time(job_id: str, run: Runner = run_cmd) -> float | None:
    end = job_field(job_id, "EndTime", run)
    return _parse_time(end) if end else None


def maintenance_start(job_id: str, host: str, run: Runner = run_cmd) -> float | None:
    """Start time of the earliest MAINT reservation covering ``host`` (or all nodes), if any."""
    if not scontrol_available():
        return None
    try:
        out = run(["show", "reservation", "-o"])
    except SlurmError:
        return None
    earliest: float | None = None
    for line in out.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "MAINT" not in fields.get("Flags", "").split(","):
            continue
        nodes = fields.get("Nodes", "")
        covers = nodes in ("", "ALL") or host in nodes.split(",")
        if not covers and nodes:
            try:
                covers = host in run(["show", "hostnames", nodes]).split()
            except SlurmError:
                covers = True  # cannot tell: assume it concerns us
        start = _parse_time(fields.get("StartTime", ""))
        if covers and start is not None and (earliest is None or start < earliest):
            earliest = start
    return earliest


class StopController:
    """Collects stop requests; see the module docstring. One per job process."""

    def __init__(self, job_id: str, *, timeout_signal: str = "USR2", maintenance: bool = False,
                 margin_s: float = 300, poll_s: float = 60, slurm_restarts: int = 0, slurm: bool = True,
                 run: Runner = run_cmd) -> None:
        self.job_id = job_id
        self.slurm = slurm  # False under the local executor: a SIGTERM is then a preemption, never asked of SLURM
        self.slurm_restarts = slurm_restarts  # SLURM_RESTART_COUNT of this start (term_verdict)
        self.timeout_signal = getattr(signal, f"SIG{timeout_signal}")
        self._run = run
        self._signals: list[tuple[int, float]] = []  # appended by handlers (list.append is atomic)
        self._reason: str | None = None
        self.signal_time: float | None = None
        self._maint_at: float | None = None
        self._maintenance = maintenance
        self._margin = margin_s
        self._poll = poll_s
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._seen = 0  # signals already considered by requested()

    # -- installation --------------------------------------------------------------------------

    def install(self) -> None:
        """Install the signal handlers (main thread only) and start the maintenance watcher."""
        self.claim_signals()
        # Signals the job launcher recorded before these handlers existed (alpsck.slurm.launch).
        early = getattr(sys, EARLY_SIGNALS, None)
        if isinstance(early, list):
            self._signals.extend(e for e in early if e[0] in (self.timeout_signal, signal.SIGTERM))
            early.clear()
        if self._maintenance and scontrol_available():
            self._watcher = threading.Thread(target=self._watch, name="alpsck-maintenance", daemon=True)
            self._watcher.start()

    def claim_signals(self) -> None:
        """Install the stop signals' handlers (main thread only), again where a framework put its own over them:
        Lightning's ``fit`` answers a SIGTERM by raising at its next batch, before any final checkpoint
        (:mod:`alpsck.integrations.lightning`). Signals already recorded stay recorded."""
        signal.signal(self.timeout_signal, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def maintenance_off(self) -> str | None:
        """Why the maintenance watcher asked for does not run (after :meth:`install`), or None: it runs,
        or was not asked for. ``alpsck status`` shows it, so that a promise of the config is never
        silently dropped."""
        if not self._maintenance or self._watcher is not None:
            return None
        if commands.scontrol_hidden():
            return f"off: {commands.NO_SCONTROL_ENV}=1 hides scontrol from the job"
        return ("off: scontrol is not on the job's PATH (inside a container: mount SLURM's commands and "
                "configuration into it, docs/alps.md), so the weekly maintenance reservation is not watched")

    def close(self) -> None:
        self._stop_watch.set()

    def ignore_late(self) -> None:
        """Ignore the stop signals from now on (main thread only): the job's outcome is decided.
        Python's own handlers would not do: interpreter shutdown resets them to the default
        action, which for USR1/USR2/TERM ends the process, so a signal during the teardown that
        follows would end a finished task with 128 + the signal."""
        for sig in {self.timeout_signal, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM}:
            signal.signal(sig, signal.SIG_IGN)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append((signum, time.time()))

    def _watch(self) -> None:
        host = socket.gethostname().split(".")[0]
        end = job_end_time(self.job_id, self._run)
        while True:
            start = maintenance_start(self.job_id, host, self._run)
            now = time.time()
            if start is not None and (end is None or start < end) and now >= start - self._margin:
                with self._lock:
                    self._maint_at = now
                return
            if self._stop_watch.wait(self._poll):
                return

    # -- the loop's side -----------------------------------------------------------------------

    def requested(self) -> bool:
        """True once a stop was requested; settles the reason on first call after a signal."""
        if self._reason is not None:
            self._reread_later_terms()
            return True
        with self._lock:
            maint_at = self._maint_at
        if self._signals:
            signum, at = self._signals[0]
            self._reason = "timeout" if signum == self.timeout_signal else self._term_verdict()
            self.signal_time = at
            self._seen = 1
            return True
        if maint_at is not None:
            self._reason = "maintenance"
            self.signal_time = maint_at
            self._seen = 0
            return True
        return False

    def _term_verdict(self) -> str:
        if not self.slurm:  # a job id of the local executor is a pid: SLURM may know another job by it
            return "preemption"
        return term_verdict(job_fields(self.job_id, self._run), self.slurm_restarts)

    def _unpolled_term(self, verdict: str) -> bool:
        """A SIGTERM came that the loop never polled for, and SLURM's view of it is ``verdict``."""
        return (self._reason is None and any(s == signal.SIGTERM for s, _ in self._signals)
                and self._term_verdict() == verdict)

    def _reread_later_terms(self) -> None:
        """A SIGTERM after the reason was settled overrides it when it is a cancel (or SLURM's own
        requeue): the final checkpoint is taken either way, the requeue is not."""
        for signum, _ in self._signals[self._seen:]:
            self._seen += 1
            if signum == signal.SIGTERM and self._reason != "cancel":
                verdict = self._term_verdict()
                if verdict in ("cancel", "requeue"):
                    self._reason = verdict

    def settle(self, peers: bool = False) -> str | None:
        """The reason, with signals that came after it was settled taken into account (a SIGTERM
        from ``scancel`` during the final checkpoint makes it ``cancel``). Call before acting on it.

        None when the loop never saw a stop: a signal it did not poll for (it came during the
        last step) leaves a finished run, and only the loop knows whether it stopped early. With
        ``peers`` (other ranks ran the same loop) a stop signal that came before the entry returned
        counts as seen: the ranks agree on each step's stop, and another rank may have taken the
        same signal first and stopped them all while this one waited in that agreement (it polled
        before the signal came, and was never asked again). Were the run in fact complete, the
        requeue that follows costs one start that finds nothing left to train; a run stopped early
        and called finished would lose the rest of its training."""
        if self._reason is None and peers and self._signals:
            self.requested()
        if self._reason is not None:
            self._reread_later_terms()
        return self._reason

    def cancelled(self) -> bool:
        """Whether the job was cancelled, seen by the loop or not: a job that fails after a
        ``scancel`` (its final save, or a peer rank that went away) must not be requeued."""
        return self.settle() == "cancel" or self._unpolled_term("cancel")

    def requeued_by_slurm(self) -> bool:
        """Whether SLURM requeued the job itself (``scontrol requeue`` by hand), seen by the loop or
        not: a job that then fails must not requeue itself again."""
        return self.settle() == "requeue" or self._unpolled_term("requeue")

    def allocation_ending(self) -> bool:
        """Whether the job's allocation is ending, for a start that failed: the loop saw a stop, the
        time-limit signal came, or a SIGTERM came that SLURM calls a cancel, a requeue or a time
        limit. A SIGTERM of a job that SLURM still runs is the job step's own end (srun cancels the
        step when one of its tasks dies, ``--kill-on-bad-exit``), or a preemption in its grace time:
        SLURM shows both alike (RUNNING), so the step may start again, and the batch script, whose
        shell only a job-level stop reaches (its TERM trap), decides."""
        if self.settle() in ("timeout", "maintenance") or any(s == self.timeout_signal for s, _ in self._signals):
            return True
        # A SIGTERM's verdict is asked afresh: the one the loop settled on ("preemption": the job was still
        # RUNNING) is also what a step's own cancel looks like, and a cancel may have come since.
        return (any(s == signal.SIGTERM for s, _ in self._signals)
                and self._term_verdict() in ("cancel", "requeue", "timeout"))

    def terminated(self) -> bool:
        """Whether a SIGTERM came (polled by the loop or not)."""
        return any(s == signal.SIGTERM for s, _ in self._signals)

    @property
    def reason(self) -> str | None:
        return self._reason

    def request(self, reason: str) -> None:
        """Request a stop programmatically (tests, custom policies)."""
        self._reason = self._reason or reason
        self.signal_time = self.signal_time or time.time()
