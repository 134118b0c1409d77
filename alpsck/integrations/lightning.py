"""Lightning's checkpoints through alpsck: :class:`AlpsckCheckpointIO`, a ``CheckpointIO`` plugin (Lightning 2.6,
``lightning`` or ``pytorch_lightning``). The recipe: docs/lightning.md.

    trainer = L.Trainer(plugins=[AlpsckCheckpointIO()], ...)

Each checkpoint path Lightning names (``ckpts/epoch=3-step=400.ckpt``, ``last.ckpt``) is an alpsck run directory
of that name holding that checkpoint (``keep_last=1``: a path saved again, as ``last.ckpt`` is, keeps its newest),
so Lightning's ``ModelCheckpoint`` finds, ranks and removes it as it does a file.

- A save returns once the state is copied to host memory (no clone on the training device, the copy into alpsck's
  staging memory); the writes and the commit go on in the background, one save per path, several paths in flight.
  A save that failed raises at the plugin's next call; ``teardown`` (the end of ``fit``) waits for every save.
- A load reads the newest valid checkpoint of the path, every chunk CRC-checked (one that fails is skipped, with a
  warning, for the one before it in that directory), and returns the dict Lightning saved, its tensors on the CPU
  (``map_location`` a device or a string moves them). Nothing is unpickled: alpsck's tree is tagged JSON.
- Under DDP, Lightning saves on global rank 0 only (the state is the same on every rank) and every rank loads: so
  does this plugin (its checkpoints have one rank).
- :meth:`AlpsckCheckpointIO.route` gives a path a Checkpointer of its own, kept open, with its own settings and
  retention: the run directory of an ``alpsck submit`` job (:mod:`.lightning_job`).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..errors import UsageError
from ..handles import CoreSave
from ..restore.read import read_state

try:
    from lightning.pytorch import Callback  # noqa: F401 - for .lightning_job, which imports Lightning through here
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # the standalone package
    try:
        from pytorch_lightning import Callback  # type: ignore[no-redef,assignment]  # noqa: F401
        from pytorch_lightning.plugins.io import CheckpointIO  # type: ignore[no-redef]
    except ImportError as e:
        raise ImportError("alpsck.integrations.lightning needs Lightning 2.6 (pip install lightning)") from e


class AlpsckCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """Lightning's ``CheckpointIO`` on alpsck (module docstring). ``options``: the Checkpointer's
    (``threads``, ``chunk_bytes``, ...; docs/python-api.md), for every path."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        for fixed in ("rank", "world_size", "keep_last"):
            if fixed in options:
                raise UsageError(f"AlpsckCheckpointIO sets {fixed} itself (one rank saves; each path keeps its newest)")
        self._options = options
        self._open: dict[str, tuple[Checkpointer, CoreSave]] = {}  # path -> its checkpointer and save in flight
        # path -> the checkpointer kept open for it, and what its saves record (route())
        self._routed: dict[str, tuple[Checkpointer, Callable[[], Mapping[str, float]] | None]] = {}

    def route(self, path: str | os.PathLike[str], checkpointer: Checkpointer,
              metrics: Callable[[], Mapping[str, float]] | None = None) -> None:
        """Saves to ``path`` go through ``checkpointer`` (on ``path``, one rank), kept open until :meth:`teardown`:
        its settings and retention, several saves in flight, instead of a new Checkpointer per save keeping one.
        ``metrics``: called at each save, what it returns recorded with the checkpoint (``save(metrics=)``)."""
        key = os.fspath(path)
        if os.path.realpath(checkpointer.run_dir) != os.path.realpath(key):
            raise UsageError(f"route({key!r}): the checkpointer writes {checkpointer.run_dir}")
        if key in self._open:
            self._close(key)
        old = self._routed.pop(key, None)
        if old is not None and old[0] is not checkpointer:
            old[0].close()
        self._routed[key] = (checkpointer, metrics)

    def wait(self, path: str | os.PathLike[str]) -> None:
        """Every save to ``path`` durable (its failure raised)."""
        key = os.fspath(path)
        if key in self._routed:
            self._routed[key][0].wait()
        elif key in self._open:
            self._close(key)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AlpsckCheckpointIO takes no storage_options (alpsck's are the plugin's own arguments)")
        key = os.fspath(path)
        self._reap()
        if key in self._routed:
            ck, metrics = self._routed[key]
            ck.save(int(checkpoint.get("global_step", 0)), checkpoint, metrics=metrics() if metrics is not None else None)
            return
        if key in self._open:  # saved again before its last save was durable (last.ckpt): that one first
            self._close(key)
        ck = Checkpointer(key, rank=0, world_size=1, keep_last=1, **self._options)
        try:
            handle = ck.save(int(checkpoint.get("global_step", 0)), checkpoint)
        except BaseException:
            ck.close()
            raise
        self._open[key] = (ck, handle)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        key = os.fspath(path)
        self.wait(key)
        if not os.path.isdir(key):
            raise FileNotFoundError(f"Checkpoint not found: {key} (AlpsckCheckpointIO's checkpoints are directories)")
        _step, state = read_state(key)
        return _moved(state, map_location)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        key = os.fspath(path)
        if key in self._routed:
            self._routed.pop(key)[0].close()
        if key in self._open:
            self._close(key)
        if os.path.isdir(key) and not os.path.islink(key):
            shutil.rmtree(key)
        elif os.path.lexists(key):
            os.remove(key)

    def teardown(self) -> None:
        """Every save durable (the first failure raised, after every checkpointer is closed), the routes dropped."""
        first: BaseException | None = None
        closers = [self._routed.pop(k)[0].close for k in list(self._routed)]
        closers += [functools.partial(self._close, k) for k in list(self._open)]
        for close in closers:
            try:
                close()
            except BaseException as e:  # noqa: BLE001 - close the others, then raise the first
                first = first or e
        if first is not None:
            raise first

    def _reap(self) -> None:
        for key, (_ck, handle) in list(self._open.items()):
            if handle.done():
                self._close(key)

    def _close(self, key: str) -> None:
        ck, _handle = self._open.pop(key)
        ck.close()  # waits for its save; raises its error


def _moved(value: Any, map_location: Any) -> Any:
    """The loaded state with its tensors moved where ``map_location`` says, when it names a device."""
    if not isinstance(map_location, (str, torch.device)):
        return value  # None, or torch.load's callables and dicts: the tensors stay on the CPU
    device = torch.device(map_location)
    if device.type == "cpu":
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    return value
