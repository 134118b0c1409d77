"""Stop requests: time limit, preemption, cancel and maintenance, noticed at a step boundary.

Signal handlers only record that a signal came (they run between bytecodes on the main thread
and must not do I/O). The training loop asks :meth:`StopController.requested` at each step
boundary; on the first positive answer the reason is settled:

- the time-limit signal (USR2 by default, sent by SLURM's ``--signal``, or by submitit's local
  executor before its timeout) means ``timeout``;
- SIGTERM means ``preemption`` if the job is still RUNNING (PreemptMode=REQUEUE with a GraceTime
  signals the steps while the job stays RUNNING), ``cancel`` if it is COMPLETING or CANCELLED
  (what ``scancel`` does); where ``scontrol`` cannot be reached (inside an Alps container), it is
  taken as ``preemption``, the safe side: checkpoint and requeue;
- a MAINT reservation that starts before the job would end, and within ``margin_s``, is
  ``maintenance`` (a watcher thread polls ``scontrol show reservation``).

A later SIGTERM upgrades any reason to ``cancel`` only if scontrol confirms a cancel; the
runner calls :meth:`StopController.settle` before it decides, so a ``scancel`` that comes
during the final checkpoint of a time-limit stop is a cancel, not a requeue.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from .launch import EARLY_SIGNALS

Runner = Callable[[list[str]], str]


def run_cmd(argv: list[str], timeout: float = 20) -> str:
    """stdout of a command; raises OSError/CalledProcessError/TimeoutExpired on failure."""
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=timeout).stdout


def scontrol_available() -> bool:
    return os.environ.get("ALPSCK_NO_SCONTROL") != "1" and shutil.which("scontrol") is not None


def job_field(job_id: str, name: str, run: Runner = run_cmd) -> str | None:
    """One ``Name=value`` field of ``scontrol show job``; None when scontrol is missing or fails."""
    if not scontrol_available():
        return None
    try:
        out = run(["scontrol", "show", "job", "-o", job_id])
    except (OSError, subprocess.SubprocessError):
        return None
    for field in out.split():
        if field.startswith(name + "="):
            return field.split("=", 1)[1]
    return None


def job_state(job_id: str, run: Runner = run_cmd) -> str | None:
    return job_field(job_id, "JobState", run)


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
        out = run(["scontrol", "show", "reservation", "-o"])
    except (OSError, subprocess.SubprocessError):
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
                covers = host in run(["scontrol", "show", "hostnames", nodes]).split()
            except (OSError, subprocess.SubprocessError):
                covers = True  # cannot tell: assume it concerns us
        start = _parse_time(fields.get("StartTime", ""))
        if covers and start is not None and (earliest is None or start < earliest):
            earliest = start
    return earliest


class StopController:
    """Collects stop requests; see the module docstring. One per job process."""

    def __init__(self, job_id: str, *, timeout_signal: str = "USR2", maintenance: bool = False,
                 margin_s: float = 300, poll_s: float = 60, run: Runner = run_cmd) -> None:
        self.job_id = job_id
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
        signal.signal(self.timeout_signal, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        # Signals the job launcher recorded before these handlers existed (alpsck.slurm.launch).
        early = getattr(sys, EARLY_SIGNALS, None)
        if isinstance(early, list):
            self._signals.extend(e for e in early if e[0] in (self.timeout_signal, signal.SIGTERM))
            early.clear()
        if self._maintenance and scontrol_available():
            self._watcher = threading.Thread(target=self._watch, name="alpsck-maintenance", daemon=True)
            self._watcher.start()

    def close(self) -> None:
        self._stop_watch.set()

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
            self._maybe_upgrade_to_cancel()
            return True
        with self._lock:
            maint_at = self._maint_at
        if self._signals:
            signum, at = self._signals[0]
            if signum == self.timeout_signal:
                self._reason = "timeout"
            else:
                self._reason = "cancel" if self._scancelled() else "preemption"
            self.signal_time = at
            self._seen = 1
            return True
        if maint_at is not None:
            self._reason = "maintenance"
            self.signal_time = maint_at
            self._seen = 0
            return True
        return False

    def _maybe_upgrade_to_cancel(self) -> None:
        for signum, _ in self._signals[self._seen:]:
            self._seen += 1
            if signum == signal.SIGTERM and self._reason != "cancel" and self._scancelled():
                self._reason = "cancel"

    def _scancelled(self) -> bool:
        """scontrol says the job is being cancelled (what ``scancel`` does; preemption keeps it RUNNING)."""
        return job_state(self.job_id, self._run) in ("COMPLETING", "CANCELLED")

    def settle(self) -> str | None:
        """The reason, with signals that came after it was settled taken into account (a SIGTERM
        from ``scancel`` during the final checkpoint makes it ``cancel``). Call before acting on it.

        None when the loop never saw a stop: a signal it did not poll for (it came during the
        last step) leaves a finished run, and only the loop knows whether it stopped early."""
        if self._reason is not None:
            self._maybe_upgrade_to_cancel()
        return self._reason

    def cancelled(self) -> bool:
        """Whether the job was cancelled, seen by the loop or not: a job that fails after a
        ``scancel`` (its final save, or a peer rank that went away) must not be requeued."""
        if self.settle() == "cancel":
            return True
        return self._reason is None and any(s == signal.SIGTERM for s, _ in self._signals) and self._scancelled()

    @property
    def reason(self) -> str | None:
        return self._reason

    def request(self, reason: str) -> None:
        """Request a stop programmatically (tests, custom policies)."""
        self._reason = self._reason or reason
        self.signal_time = self.signal_time or time.time()
