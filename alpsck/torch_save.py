"""The naive baseline: one synchronous ``torch.save`` file per checkpoint.

:class:`TorchSaveCheckpointer` has the interface of the real checkpointer
(:class:`alpsck.handles.CheckpointerLike`) so benchmarks and the reference training can swap
them. Layout: ``RUN_DIR/torch-step-{step:09d}.pt`` holding
``{"format", "step", "tensors": {key: CPU tensor}, "tree": <JSON string>}`` (see
:mod:`alpsck.tree`). It is written to ``*.pt.tmp``, flushed, fsynced, renamed into place and the
directory fsynced, so a crash leaves either the old set of checkpoints or the new one. Files are
read with ``torch.load(weights_only=True)``: loading never runs code.

Call order: ``restore()`` (optional) → ``save()``* → ``wait()`` → ``close()``. ``save`` blocks
until the checkpoint is durable. The first save takes the run directory's writer lock (the one
every alpsck writer takes: RunDirLockedError naming the holder if another has it); ``close()``
releases it. Not thread-safe: use one instance from one thread.
"""

from __future__ import annotations

import errno
import json
import os
import re
import warnings
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from alpsck import fit, tree
from alpsck.capture import capture
from alpsck.errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    DiskFullError,
)
from alpsck.handles import CompletedSave
from alpsck.options import check_step
from alpsck.store.durable import fsync_path, open_own
from alpsck.store.lock import lock_run_dir
from alpsck.store.names import temp_name

if TYPE_CHECKING:  # typing.Self is 3.11+ (torch depends on typing_extensions); annotations are not evaluated
    from typing_extensions import Self

FORMAT = "alpsck.torch-baseline/1"
_NAME_RE = re.compile(r"torch-step-([0-9]{9,})\.pt")


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint of ``step`` lives."""
    return Path(run_dir) / f"torch-step-{step:09d}.pt"


class TorchSaveCheckpointer:
    """Synchronous torch.save checkpointer; see the module docstring. Extra kwargs are ignored."""

    def __init__(self, run_dir: str | os.PathLike[str], *, keep_last: int = 3, **ignored_kwargs: Any) -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last must be >= 1, got {keep_last}")
        self.run_dir = Path(run_dir)
        self.keep_last = keep_last
        self._closed = False
        self._lock: Any = None  # the run directory's writer lock (alpsck._core.RunDirLock), from the first save

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def steps(self) -> list[int]:
        """Steps of the checkpoint files on disk, ascending (not verified)."""
        if not self.run_dir.is_dir():
            return []
        found = (_NAME_RE.fullmatch(p.name) for p in self.run_dir.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest_step(self) -> int | None:
        """The newest checkpoint's step by file name (not verified), or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False) -> CompletedSave:
        """Write the checkpoint of ``step`` and return once it is durable (``urgent`` changes nothing:
        this baseline is always synchronous)."""
        if self._closed:
            raise CheckpointError("save() on a closed checkpointer")
        check_step(step)
        captured = capture(state)
        payload = {
            "format": FORMAT,
            "step": step,
            "tensors": {k: t.detach().to("cpu", copy=True) for k, t in captured.tensors.items()},
            "tree": json.dumps(captured.tree, allow_nan=False),
        }
        final = checkpoint_path(self.run_dir, step)
        tmp = Path(temp_name(str(final)))
        if self._lock is None:  # one writer per run directory, this baseline included
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._lock = lock_run_dir(self.run_dir, 0)
        try:
            with os.fdopen(open_own(tmp), "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            fsync_path(self.run_dir)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            cls = DiskFullError if e.errno in (errno.ENOSPC, errno.EDQUOT) else CheckpointWriteError
            raise cls(e.errno, f"saving step {step} to {final}: {e.strerror or e}") from e
        self._retire(keep=step)
        return CompletedSave(step, str(final))

    def _retire(self, keep: int) -> None:
        steps = self.steps()
        old = [s for s in steps if s != keep][: max(0, len(steps) - self.keep_last)]
        for s in old:
            checkpoint_path(self.run_dir, s).unlink(missing_ok=True)

    def load(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Read and verify one checkpoint file: returns ``(tree, tensors)``; CorruptCheckpointError if bad."""
        path = checkpoint_path(self.run_dir, step)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # any failure to unpickle means a bad file
            raise CorruptCheckpointError(f"{path}: cannot be loaded: {e}") from e
        if (not isinstance(payload, dict) or payload.get("format") != FORMAT
                or payload.get("step") != step or not isinstance(payload.get("tree"), str)
                or not isinstance(payload.get("tensors"), dict)):
            raise CorruptCheckpointError(f"{path}: not an alpsck torch-baseline checkpoint of step {step}")
        try:
            tree_ = json.loads(payload["tree"])
        except ValueError as e:
            raise CorruptCheckpointError(f"{path}: tree is not valid JSON: {e}") from e
        tensors = payload["tensors"]
        specs = tree.tensor_specs(tree_)
        for key, spec in specs.items():
            t = tensors.get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise CorruptCheckpointError(f"{path}: tensor {key!r} is missing or does not match the tree")
        return tree_, tensors

    def restore(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest valid checkpoint into ``state``; returns its step, or None if none.

        Files that fail to load or verify are skipped with a warning naming them. A checkpoint
        that does not fit the live objects raises :class:`alpsck.errors.StateMismatchError`.
        """
        for step in reversed(self.steps()):
            try:
                tree_, tensors = self.load(step)
            except CorruptCheckpointError as e:
                warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
                continue
            fit.apply(state, tree_, tensors)
            return step
        return None

    def wait(self) -> None:
        """Return at once: every save is durable when ``save`` returns."""

    def close(self) -> None:
        """Mark closed and release the run directory's writer lock; later saves raise."""
        self._closed = True
        if self._lock is not None:
            self._lock.release()
            self._lock = None
