"""The hang watchdog: a supervisor process that sees the training loop's progress through shared
memory (never a file), and ends a task whose loop made none for its section's timeout.

The runner starts one per task (:meth:`Watchdog.start`, a forked child) before the entry runs. The
loop's progress (:mod:`alpsck.handles`: each ``stop_requested()`` poll, and the Checkpointer's
blocking calls in sections of their own) is a time and a section written into an anonymous shared
mapping; the supervisor reads it every ``poll_s``. Sections and their timeouts
(``requeue.hang_timeout_s`` = T): ``step`` T; ``start`` (imports, restore, until the first poll),
``save``, ``restore`` and ``final`` (after the loop saw a stop) 4 T each, so a slow save is never
called a hang. On a timeout the supervisor prints a line to the task's log, has faulthandler dump
every thread's Python stack there (a signal it registered in the task: it works while the main
thread is blocked in C), rank 0's records a ``hang`` event (section, seconds without progress,
attempt), and after ``grace_s`` (for the other ranks' dumps: their loops stopped too, waiting in a
collective for this one) it SIGKILLs the task. srun ends the step, and the batch script's restart
loop starts it again in the allocation (:mod:`alpsck.slurm.submit`), where the runner resumes from
the newest checkpoint.

The supervisor only reads memory, sleeps, writes its own lines and signals its parent; it exits
when the parent is gone, and the runner stops it when the entry returns.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import sys
import time

from . import history

SECTIONS = ("start", "step", "save", "restore", "final")
SECTION_FACTOR = {"start": 4.0, "step": 1.0, "save": 4.0, "restore": 4.0, "final": 4.0}
_LAYOUT = struct.Struct("<dI")  # monotonic time of the last progress, section index
# The signal the supervisor sends for the stack dump (faulthandler's C handler in the task); a real-time
# signal nothing else in a training job uses.
DUMP_SIGNAL = signal.SIGRTMIN + 7


class Watchdog:
    """One task's watchdog: :meth:`mark` (the :mod:`alpsck.handles` sink) in the task, a supervisor child."""

    def __init__(self, timeout_s: float, *, run_dir: str, job_id: str, rank: int, attempt: int,
                 poll_s: float = 1.0, grace_s: float = 3.0) -> None:
        self.timeout_s = timeout_s
        self.run_dir, self.job_id, self.rank, self.attempt = run_dir, job_id, rank, attempt
        self.poll_s, self.grace_s = poll_s, grace_s
        self._mem = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous and shared: the forked child sees every write
        self._child: int | None = None
        # Where this start's time went, by section (for the runner's ``times`` event: the goodput's parts).
        self.totals = dict.fromkeys(SECTIONS, 0.0)
        self.polls = 0
        self._section, self._since = "start", time.monotonic()
        self.mark("start")

    def mark(self, section: str) -> None:
        now = time.monotonic()
        self.totals[self._section] += now - self._since
        self._section, self._since = section, now
        if section in ("step", "final"):
            self.polls += 1
        _LAYOUT.pack_into(self._mem, 0, now, SECTIONS.index(section))

    def times(self) -> dict[str, float | int]:
        """Seconds in each section so far (``start``: imports, set-up and restore until the first poll;
        ``step``: training; ``save``: the loop blocked in a save; ``final``: after it saw a stop), and polls."""
        self.mark(self._section)
        return {f"{k}_s": round(v, 3) for k, v in self.totals.items()} | {"polls": self.polls}

    def read(self) -> tuple[float, str]:
        at, index = _LAYOUT.unpack_from(self._mem, 0)
        return at, SECTIONS[index] if index < len(SECTIONS) else "step"

    def start(self) -> None:
        """Register the stack dump and fork the supervisor."""
        faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the supervisor: nothing but memory reads, sleeps, its own writes and signals
            # Close every descriptor but stdin/out/err first: a fork keeps them all (close-on-exec needs an
            # exec), and a pipe end kept here (the stdout of an scontrol another thread of the task was
            # running) would keep that thread's read waiting for an EOF that never comes.
            os.closerange(3, _max_fd())
            code = 0
            try:
                self._supervise(parent)
            except BaseException:  # noqa: BLE001 - a supervisor never raises into a forked copy of the job
                code = 1
            os._exit(code)
        self._child = pid

    def stop(self) -> None:
        """The entry returned: stop the supervisor (no dump, no kill)."""
        child, self._child = self._child, None
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        faulthandler.unregister(DUMP_SIGNAL)

    def _supervise(self, parent: int) -> None:
        for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):  # the task's business, not ours
            signal.signal(s, signal.SIG_IGN)
        while os.getppid() == parent:
            time.sleep(self.poll_s)
            at, section = self.read()
            quiet = time.monotonic() - at
            limit = self.timeout_s * SECTION_FACTOR[section]
            if quiet <= limit:
                continue
            os.write(2, (f"alpsck: rank {self.rank}: no progress in section {section!r} for {quiet:.0f} s (its "
                         f"timeout: {limit:.0f} s): a hang; every thread's stack follows, then the task is ended "
                         "and restarted\n").encode())
            os.kill(parent, DUMP_SIGNAL)
            if self.rank == 0:
                _append_hang(self.run_dir, self.job_id, section, quiet, limit, self.attempt)
            time.sleep(self.grace_s)
            os.kill(parent, signal.SIGKILL)
            return


def _max_fd() -> int:
    try:
        return max(256, int(os.sysconf("SC_OPEN_MAX")))
    except (ValueError, OSError):
        return 65536


def _append_hang(run_dir: str, job_id: str, section: str, quiet: float, limit: float, attempt: int) -> None:
    history.append(run_dir, "hang", job_id=job_id, section=section, seconds=round(quiet, 1), timeout_s=round(limit, 1),
                   attempt=attempt)
