"""The small interface every alpsck checkpointer shares.

:class:`SaveHandle` is what ``save()`` returns; :class:`CheckpointerLike` is the interface of
:class:`alpsck.baseline.TorchSaveCheckpointer` and of the real (concurrent) checkpointer, so the
training loop can take either. :class:`CompletedSave` is the handle of a save that was already
durable when ``save()`` returned.

Call order of a checkpointer: ``restore()`` (optional, before training), ``save()`` any number of
times, ``wait()``, ``close()``. A checkpointer is also a context manager whose exit calls
``close()``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class SaveHandle(Protocol):
    """The result of ``save()``: lets the caller wait until that checkpoint is durable.

    ``wait()`` raises the save's error (a :class:`alpsck.errors.CheckpointError`) if it failed.
    Handles may be waited on from any thread.
    """

    @property
    def step(self) -> int: ...

    def wait(self, timeout: float | None = None) -> None: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class CompletedSave:
    """Handle of a save that was complete (durable) when it was returned; waiting is a no-op."""

    step: int

    def wait(self, timeout: float | None = None) -> None:
        """Return at once: the checkpoint is already durable."""

    def done(self) -> bool:
        """Always True."""
        return True


class CheckpointerLike(Protocol):
    """What the training loop needs from a checkpointer (sync baseline or concurrent core)."""

    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False) -> SaveHandle: ...

    def restore(self, state: MutableMapping[str, Any]) -> int | None: ...

    def latest_step(self) -> int | None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...
