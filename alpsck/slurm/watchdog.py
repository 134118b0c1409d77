"""The hang watchdog: a supervisor process that sees the training loop's progress through shared
memory (never a file), and ends a task whose loop made none for its section's timeout.

The runner starts one per task (:meth:`Watchdog.start`, a forked child) before the entry runs. The
loop's progress (:mod:`alpsck.progress`: each ``stop_requested()`` poll, and the Checkpointer's
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

Learned timeouts (``requeue.hang_timeout: learned``): a section's timeout becomes
:data:`LEARN_FACTOR` times the longest visit of it seen in the run (never under
``requeue.hang_timeout_min_s``) once the run has seen :data:`LEARN_AFTER` of them; until then the
configured one holds. What a start saw goes into its ``times`` event (``longest``, ``seen``), so the
next start, after a restart or a requeue, begins from the run's numbers (:func:`learned_from`): every
rank reads the same history, so every rank starts from the same timeouts. Within a start each rank
learns from its own loop, which in a data-parallel loop waits on the same collectives as the others'.

The supervisor only reads memory, sleeps, writes its own lines and signals its parent; it exits
when the parent is gone, and the runner stops it when the entry returns. Rank 0's records where the
hung start's time went (a ``times`` event, from the shared memory) before its ``hang``.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import sys
import time
from typing import Any

from . import history
from .history import Hang, Times
from .timeline import Timeline, as_timeline

SECTIONS = ("start", "step", "save", "restore", "final")
SECTION_FACTOR = {"start": 4.0, "step": 1.0, "save": 4.0, "restore": 4.0, "final": 4.0}
LEARN_FACTOR = 5.0  # a learned timeout: this many times the longest visit seen (NVIDIA's resiliency extension's)
LEARN_AFTER = {"start": 1, "step": 20, "save": 2, "restore": 1, "final": 1}  # visits seen before one is learned
# The shared page: the time of the last progress (monotonic), its section's index, that section's timeout
# now; then the seconds spent in each section, the polls and the first step's duration (the hung start's
# ``times``, which the supervisor records).
_HEAD = struct.Struct("<dId")
_TOTALS = struct.Struct(f"<{len(SECTIONS)}dId")
_TOTALS_AT = 64
# The signal the supervisor sends for the stack dump (faulthandler's C handler in the task); a real-time
# signal nothing else in a training job uses.
DUMP_SIGNAL = signal.SIGRTMIN + 7


def learned_from(events: Timeline | list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int]]:
    """The longest visit of each section and how many were seen, over the run's ``times`` events."""
    longest = dict.fromkeys(SECTIONS, 0.0)
    seen = dict.fromkeys(SECTIONS, 0)
    for e in as_timeline(events).of_kind(Times):
        lo, n = e.longest, e.seen
        for k in SECTIONS:
            v = lo.get(k) if isinstance(lo, dict) else None
            c = n.get(k) if isinstance(n, dict) else None
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9:
                longest[k] = max(longest[k], float(v))
            if isinstance(c, int) and not isinstance(c, bool) and c > 0:
                seen[k] += c
    return longest, seen


class Watchdog:
    """One task's watchdog: :meth:`mark` (the :mod:`alpsck.progress` sink) in the task, a supervisor child.

    ``learn``: (min_s, the run's history) to learn the timeouts (:func:`learned_from`), or None for
    fixed ones."""

    def __init__(self, timeout_s: float, *, run_dir: str, job_id: str, rank: int, attempt: int,
                 poll_s: float = 1.0, grace_s: float = 3.0,
                 learn: tuple[float, Timeline | list[dict[str, Any]]] | None = None) -> None:
        self.timeout_s = timeout_s
        self.run_dir, self.job_id, self.rank, self.attempt = run_dir, job_id, rank, attempt
        self.poll_s, self.grace_s = poll_s, grace_s
        self._mem = mmap.mmap(-1, mmap.PAGESIZE)  # anonymous and shared: the forked child sees every write
        self._child: int | None = None
        # Where this start's time went, by section (for the runner's ``times`` event: the goodput's parts).
        self.totals = dict.fromkeys(SECTIONS, 0.0)
        self.polls = 0
        self.first_step_s: float | None = None  # from the first poll to the second
        self._first_poll = 0.0
        self._min_s = learn[0] if learn is not None else None
        self._prior_longest, self._prior_seen = learned_from(learn[1]) if learn is not None else ({}, {})
        self.longest = dict.fromkeys(SECTIONS, 0.0)  # this start's longest visit of each section
        self.seen = dict.fromkeys(SECTIONS, 0)
        self._section, self._since = "start", time.monotonic()
        self.mark("start")

    def limit(self, section: str) -> float:
        """The section's timeout now: learned once enough of its visits were seen, else the configured one."""
        fixed = self.timeout_s * SECTION_FACTOR[section]
        if self._min_s is None:
            return fixed
        seen = self.seen[section] + self._prior_seen.get(section, 0)
        if seen < LEARN_AFTER[section]:
            return fixed
        longest = max(self.longest[section], self._prior_longest.get(section, 0.0))
        return max(self._min_s, LEARN_FACTOR * longest)

    def mark(self, section: str) -> None:
        now = time.monotonic()
        took = now - self._since
        left = self._section
        self.totals[left] += took
        if left != section or section in ("step", "final"):  # a visit ended (each poll ends a step's)
            self.longest[left] = max(self.longest[left], took)
            self.seen[left] += 1
        if section in ("step", "final"):
            self.polls += 1
            if self.polls == 1:
                self._first_poll = now
            elif self.polls == 2:
                self.first_step_s = now - self._first_poll
        self._section, self._since = section, now
        # One copy of the packed bytes: pack_into would zero the header before writing its fields, and the
        # supervisor could read that (section 'start', timeout 0: a hang in no time, seen once in CI).
        self._mem[:_HEAD.size] = _HEAD.pack(now, SECTIONS.index(section), self.limit(section))
        _TOTALS.pack_into(self._mem, _TOTALS_AT, *(self.totals[k] for k in SECTIONS), self.polls,
                          -1.0 if self.first_step_s is None else self.first_step_s)

    def times(self) -> dict[str, Any]:
        """Seconds in each section so far (``start``: imports, set-up and restore until the first poll;
        ``step``: training; ``save``: the loop blocked in a save; ``final``: after it saw a stop), the
        polls, the first step's seconds, and each section's longest visit and visits (for learning)."""
        now = time.monotonic()
        totals = dict(self.totals)
        totals[self._section] += now - self._since
        return _times(totals, self.polls, self.first_step_s) | {
            "longest": {k: round(v, 3) for k, v in self.longest.items() if self.seen[k]},
            "seen": {k: v for k, v in self.seen.items() if v}}

    def read(self) -> tuple[float, str, float]:
        """The last progress (monotonic time), its section, and that section's timeout."""
        at, index, limit = _HEAD.unpack_from(self._mem, 0)
        return at, SECTIONS[index] if index < len(SECTIONS) else "step", limit

    def overdue(self, confirm_after_s: float = 0.05) -> tuple[str, float, float] | None:
        """(section, seconds without progress, its timeout) when the loop is past its section's timeout, else
        None. Read twice, ``confirm_after_s`` apart, and only the same header both times counts: a read while
        the task writes the header can mix two states (an old time with a new, shorter timeout), and a loop
        that made progress in between is no hang."""
        first = self.read()
        if time.monotonic() - first[0] <= first[2]:
            return None
        time.sleep(confirm_after_s)
        if self.read() != first:
            return None
        at, section, limit = first
        return section, time.monotonic() - at, limit

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
            overdue = self.overdue()
            if overdue is None:
                continue
            section, quiet, limit = overdue
            os.write(2, (f"alpsck: rank {self.rank}: no progress in section {section!r} for {quiet:.0f} s (its "
                         f"timeout: {limit:.0f} s): a hang; every thread's stack follows, then the task is ended "
                         "and restarted\n").encode())
            os.kill(parent, DUMP_SIGNAL)
            if self.rank == 0:
                self._record_hang(section, quiet, limit)
            time.sleep(self.grace_s)
            os.kill(parent, signal.SIGKILL)
            return

    def _record_hang(self, section: str, quiet: float, limit: float) -> None:
        """Rank 0's supervisor: where the hung start's time went (the hung section's time included), then ``hang``."""
        *spent, polls, first = _TOTALS.unpack_from(self._mem, _TOTALS_AT)
        totals = dict(zip(SECTIONS, spent, strict=True))
        totals[section] += quiet
        history.append(self.run_dir, Times(job_id=self.job_id, attempt=self.attempt,
                                           **_times(totals, polls, None if first < 0 else first)))
        history.append(self.run_dir, Hang(job_id=self.job_id, section=section, seconds=round(quiet, 1),
                                          timeout_s=round(limit, 1), attempt=self.attempt))


def _times(totals: dict[str, float], polls: int, first_step_s: float | None) -> dict[str, Any]:
    return {f"{k}_s": round(v, 3) for k, v in totals.items()} | {"polls": polls} | (
        {} if first_step_s is None else {"first_step_s": round(first_step_s, 4)})


def _max_fd() -> int:
    try:
        return max(256, int(os.sysconf("SC_OPEN_MAX")))
    except (ValueError, OSError):
        return 65536
