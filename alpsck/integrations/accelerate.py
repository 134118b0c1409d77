"""Hugging Face ``accelerate``'s training state through alpsck: :class:`AcceleratorCheckpointer` (accelerate 1.15).

``Accelerator.save_state`` writes the optimizers, schedulers, RNG streams and registered objects with
``torch.save`` whatever its hooks do (``register_save_state_pre_hook`` sees only the models), and ``load_state``
unpickles them. This class saves the same things, the ones ``save_state`` walks (the prepared models, optimizers
and schedulers, the grad scaler, the objects given to ``register_for_checkpointing``, and each rank's RNG streams),
as one alpsck checkpoint per step of one run directory, and restores them, with nothing pickled::

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    ckpt = AcceleratorCheckpointer(accelerator, "/capstor/scratch/cscs/me/run")
    step = ckpt.restore() or 0                     # the newest valid checkpoint's step; None: fresh
    for epoch in range(step // len(data), epochs):
        data.set_epoch(epoch)
        for batch in ckpt.batches(data, skip=step - epoch * len(data) if epoch == step // len(data) else 0):
            ...; step += 1
            if step % 500 == 0:
                ckpt.save(step)
    ckpt.close()

- ``save(step)`` returns once the state is copied to host memory; the writes go on while training does.
- ``restore()`` loads the newest checkpoint that reads back whole (every chunk CRC-checked; one that fails is
  skipped, with a warning, for the one before). It restores everything but the RNG streams: those come back in
  :meth:`batches`, after the resumed epoch's first batch is drawn (building a data loader's iterator draws from
  the global RNG; the Trainer restores them at that moment too), or in :meth:`restore_rng` for a loop of one's own.
- The data position is the caller's: ``batches(data, skip=N)`` skips the first N batches of this epoch through
  accelerate's ``skip_first_batches``. A bit-exact resume needs a sampler whose order depends on the epoch only
  (``use_seedable_sampler=True`` and ``set_epoch``): accelerate does not save a plain sampler's generator.
- One process, or DDP: every rank saves and restores (its RNG streams are its own; the rest is written once).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..checkpointer import Checkpointer
from ..errors import UsageError
from ..rng import RNGState

try:
    from accelerate import Accelerator
except ImportError as e:
    raise ImportError("alpsck.integrations.accelerate needs accelerate 1.15 (pip install accelerate)") from e

class _LaterRNG:
    """The RNG streams in the state: saved as :class:`~alpsck.rng.RNGState` saves them, but restored only when
    :meth:`AcceleratorCheckpointer.restore_rng` says (after the resumed epoch's first batch)."""

    def __init__(self) -> None:
        self.pending: Any = None

    def state_dict(self) -> dict[str, Any]:
        return RNGState().state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.pending = state


class AcceleratorCheckpointer:
    """What ``Accelerator.save_state`` saves, saved and restored through alpsck (module docstring). ``options``:
    the Checkpointer's (``keep_last``, ``threads``, ...; docs/python-api.md)."""

    def __init__(self, accelerator: Accelerator, run_dir: str, **options: Any) -> None:
        for fixed in ("rank", "world_size", "replicated"):
            if fixed in options:
                raise UsageError(f"AcceleratorCheckpointer sets {fixed} itself (from the accelerator)")
        self.accelerator = accelerator
        self.run_dir = run_dir
        self._rng = _LaterRNG()
        world = max(1, accelerator.num_processes)
        shared = [k for k in self._state() if k != "rng"]  # identical on every rank under DDP: written once
        self._ck = Checkpointer(run_dir, rank=accelerator.process_index, world_size=world,
                                replicated=shared if world > 1 else (), **options)

    def _state(self) -> dict[str, Any]:
        """The live objects, by key: what ``save_state`` walks (accelerate keeps them as attributes)."""
        acc: Any = self.accelerator
        state: dict[str, Any] = {}
        for kind, objs in (("model", [acc.unwrap_model(m) for m in acc._models]), ("optimizer", acc._optimizers),
                           ("scheduler", acc._schedulers), ("object", acc._custom_objects)):
            state.update({f"{kind}{i}": obj for i, obj in enumerate(objs)})
        if acc.scaler is not None:
            state["scaler"] = acc.scaler
        state["rng"] = self._rng
        return state

    def save(self, step: int) -> None:
        """Checkpoint ``step`` (every rank calls it); returns once the state is copied to host memory."""
        self._ck.save(step, self._state())

    def restore(self, step: int | None = None) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into the accelerator's objects and return its step; None
        when the run directory holds none. The RNG streams wait for :meth:`batches` (or :meth:`restore_rng`). A
        collective under DDP."""
        return self._ck.restore(self._state(), step)

    def restore_rng(self) -> None:
        """Set this rank's RNG streams to the restored checkpoint's (once; no-op without a restore)."""
        rng, self._rng.pending = self._rng.pending, None
        if rng is not None:
            RNGState().load_state_dict(rng)

    def batches(self, dataloader: Any, skip: int = 0) -> Iterator[Any]:
        """The batches of ``dataloader`` after its first ``skip`` (accelerate's ``skip_first_batches``), with the
        restored RNG streams set as the first one is drawn."""
        it: Iterable[Any] = self.accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        for batch in it:
            self.restore_rng()
            yield batch

    def wait(self) -> None:
        """Every save so far durable."""
        self._ck.wait()

    def close(self) -> None:
        self._ck.close()

    def __enter__(self) -> AcceleratorCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
