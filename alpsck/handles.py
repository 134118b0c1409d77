"""The small interface every alpsck checkpointer shares.

:class:`SaveHandle` is what ``save()`` returns; :class:`CheckpointerLike` is the interface of
:class:`alpsck.torch_save.TorchSaveCheckpointer` and of the real (concurrent) checkpointer, so the
training loop can take either. :class:`CompletedSave` is the handle of a save that was already
durable when ``save()`` returned.

Call order of a checkpointer: ``restore()`` (optional, before training), ``save()`` any number of
times, ``wait()``, ``close()``. A checkpointer is also a context manager whose exit calls
``close()``. Those calls that block the loop run in progress sections of their own
(:mod:`alpsck.progress`), so that a hang watchdog times a slow save as a save, never as a hung step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .progress import blocking

if TYPE_CHECKING:  # the handle's type only: handles imports neither torch nor the core
    from . import _core


@runtime_checkable
class SaveHandle(Protocol):
    """The result of ``save()``: a future of that checkpoint being durable.

    It behaves like a :class:`concurrent.futures.Future`: ``done()``, ``result(timeout)`` (waits,
    raises the save's error, a :class:`alpsck.errors.CheckpointError`, returns the save's sizes and
    timings), ``exception(timeout)``, ``add_done_callback(fn)``; ``wait(timeout)`` is ``result``
    without the value. A save cannot be cancelled. Handles may be used from any thread.
    """

    @property
    def step(self) -> int: ...

    def wait(self, timeout: float | None = None) -> None: ...

    def done(self) -> bool: ...

    def result(self, timeout: float | None = None) -> dict[str, Any]: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def add_done_callback(self, fn: Callable[[Any], object]) -> None: ...


class FutureMixin:
    """The :class:`concurrent.futures.Future` surface of a handle, on top of its ``wait()``,
    ``done()`` and ``_value()`` (the finished save's sizes and timings)."""

    step: int

    def wait(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def done(self) -> bool:
        raise NotImplementedError

    def _value(self) -> dict[str, Any]:
        raise NotImplementedError

    def _settle(self) -> None:
        """Wait until done without counting as the caller having seen the error (for callbacks)."""
        self.wait()

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until durable (TimeoutError after ``timeout`` s); raise the save's error, or return
        its sizes and timings (``snapshot_seconds``, ``durable_seconds``, ``bytes``, ``path``, ...)."""
        self.wait(timeout)
        return self._value()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait until done (TimeoutError after ``timeout`` s); the save's error, or None."""
        try:
            self.wait(timeout)
        except TimeoutError:
            raise
        except Exception as e:
            return e
        return None

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Call ``fn(handle)`` once the save is done (at once if it is): from a helper thread, as a
        Future calls it from the thread that completes it. An exception in ``fn`` is logged."""

        def call() -> None:
            try:
                fn(self)
            except Exception:
                logging.getLogger("alpsck").exception("a save handle's done callback raised")

        if self.done():
            call()
            return

        def watch() -> None:
            with contextlib.suppress(Exception):  # its error is for result()/exception() to report
                self._settle()
            call()

        threading.Thread(target=watch, name=f"alpsck-save-{self.step}-callback", daemon=True).start()

    def cancel(self) -> bool:
        """A save cannot be cancelled: always False."""
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return not self.done()


@dataclass(frozen=True)
class CompletedSave(FutureMixin):
    """Handle of a save that was complete (durable) when it was returned; waiting is a no-op."""

    step: int
    path: str = ""

    def wait(self, timeout: float | None = None) -> None:
        """Return at once: the checkpoint is already durable."""

    def done(self) -> bool:
        """Always True."""
        return True

    def _value(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "skipped": False}


class CheckpointerLike(Protocol):
    """What the training loop needs from a checkpointer (sync baseline or concurrent core)."""

    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False) -> SaveHandle: ...

    def restore(self, state: MutableMapping[str, Any]) -> int | None: ...

    def latest_step(self) -> int | None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


class CoreSave(FutureMixin):
    """Handle of one checkpoint persisting in the background: a future (:class:`alpsck.handles.SaveHandle`)."""

    def __init__(self, handle: _core.SaveHandle, tier: str = "run_dir") -> None:
        self._h = handle
        self.tier = tier  # where it goes: "run_dir", or "memory" (the memory tier's node-local commit)
        self.reported = False  # its error already reached the caller (through wait())

    @property
    def step(self) -> int:  # type: ignore[override]
        return int(self._h.step)

    def done(self) -> bool:
        """True once the checkpoint is durable (or its save failed)."""
        return bool(self._h.done())

    @blocking("save")
    def wait(self, timeout: float | None = None) -> None:
        """Block until durable; raise the save's error; TimeoutError if ``timeout`` passes first."""
        try:
            finished = self._h.wait(timeout)
        except Exception:
            self.reported = True
            raise
        if not finished:
            raise TimeoutError(f"checkpoint of step {self.step} not durable after {timeout} s")

    def _value(self) -> dict[str, Any]:
        return dict(self._h.result())

    def _settle(self) -> None:
        # A callback's waiting is not the caller's: the error still reaches the next save()/wait().
        self._h.wait(None)


def reap(pending: list[CoreSave], *, finished: bool = False) -> tuple[list[CoreSave], CoreSave | None]:
    """The saves still to watch, and the first whose error the caller has not seen (its ``wait()`` raises it):
    the finished ones are dropped, and later failures stay, for the next ``save()`` or ``wait()`` (every
    failure reaches the caller, one per call). ``finished``: every save is known to be done."""
    still = [] if finished else [h for h in pending if not h.done()]
    failed = [h for h in pending if (finished or h.done()) and not h.reported and h._h.error_message() is not None]
    return still + failed[1:], failed[0] if failed else None


def warn_unreported(pending: list[CoreSave], run_dir: object, stacklevel: int = 2) -> None:
    """A warning for each failed save whose error no caller has seen (on close: never dropped silently)."""
    for h in pending:
        why = h._h.error_message()
        if not h.reported and why is not None:
            h.reported = True
            warnings.warn(f"{run_dir}: the checkpoint of step {h.step} failed too: {why}", RuntimeWarning,
                          stacklevel=stacklevel + 1)
