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
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


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
