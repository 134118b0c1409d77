"""The watchdog's progress channel: where the training loop is, for a watchdog outside it.

One process-wide sink, none by default. The job runner installs a sink
(:class:`alpsck.slurm.watchdog.Watchdog`: shared memory read by a supervisor process) and the loop's
own calls feed it: :meth:`alpsck.slurm.JobContext.stop_requested` marks a step's progress, and the
Checkpointer's blocking calls run in a section of their own (``save``, ``restore``, through
:func:`blocking`), so that a slow save or restore is timed as one and never called a hung step.
Without a sink (a Checkpointer outside a job) every call here is a no-op costing one attribute read.

Also the other channels from a checkpointer to the job layer: :data:`RESTORED_HOOKS` and
:data:`SAVED_HOOKS`. Importable without torch (the runner imports it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar


class Sink(Protocol):
    def mark(self, section: str) -> None: ...


_SINK: Sink | None = None
_F = TypeVar("_F", bound=Callable[..., Any])

# Who wants to know which step a restore used (the SLURM runner: JobContext.restored_step): each is
# called with (run_dir, the step restored or None, its tier: "memory", "replica", "run_dir" or None, when
# that state was taken: unix seconds or None) after every Checkpointer.restore of this process.
# Here, not in alpsck.restore (which imports torch), so that the runner imports without torch.
RESTORED_HOOKS: list[Callable[[Path, int | None, str | None, float | None], None]] = []
# Who wants each committed save of the run directory (the SLURM runner's straggler watch, rank 0): each is called
# with (run_dir, the save's result: the handle's ``result()``, whose ``ranks`` the committing rank fills) once the
# Checkpointer sees the save durable (at the next save(), wait() or close()). A hook must not raise.
SAVED_HOOKS: list[Callable[[Path, dict[str, Any]], None]] = []


def install_progress(sink: Sink | None) -> None:
    """Set (or with None, remove) the process's sink; the loop is in its ``start`` section until it polls."""
    global _SINK
    _SINK = sink
    _LOOP[0] = "start"
    _OPEN.clear()


def mark_progress(section: str) -> None:
    """Progress, now, in ``section`` (``start``, ``step``, ``save``, ``restore``, ``final``)."""
    if _SINK is not None:
        _SINK.mark(section)


_LOOP = ["start"]  # the loop's own section (set by mark_loop), where a blocking call returns to
_OPEN: list[str] = []  # the blocking calls under way, outermost first (a wait inside a close)


def mark_loop(section: str) -> None:
    """The loop's own section from now on (``step``, or ``final`` once it saw a stop): progress in it."""
    _LOOP[0] = section
    mark_progress(section)


@contextmanager
def progress_section(name: str) -> Iterator[None]:
    """A blocking call in a section of its own; when it returns, progress in the section it was called from."""
    if _SINK is None:
        yield
        return
    _OPEN.append(name)
    _SINK.mark(name)
    try:
        yield
    finally:
        _OPEN.pop()
        if _SINK is not None:
            _SINK.mark(_OPEN[-1] if _OPEN else _LOOP[0])


def blocking(name: str) -> Callable[[_F], _F]:
    """Decorator: the method runs in section ``name`` (:func:`progress_section`)."""
    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if _SINK is None:
                return fn(*args, **kwargs)
            with progress_section(name):
                return fn(*args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap
