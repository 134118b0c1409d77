"""The Hugging Face ``transformers`` Trainer's checkpoints through alpsck: :class:`AlpsckTrainer` (transformers 5.x).

    trainer = AlpsckTrainer(model=model, args=TrainingArguments(output_dir="out", save_steps=500, ...), ...)
    trainer.train(resume_from_checkpoint=True)   # resumes from the newest valid checkpoint, when there is one

The Trainer has no storage hook: its checkpoint is the files its ``_save_checkpoint`` writes (``model.safetensors``,
``optimizer.pt``, ``scheduler.pt`` and ``rng_state.pth`` through ``torch.save``, ``trainer_state.json``) and reads
back. This subclass overrides those methods and nothing else, so the training loop, the data skipping on resume and
the moment the RNG is restored (after the resumed epoch's first batch) stay the Trainer's own:

- Each ``output_dir/checkpoint-N`` is an alpsck run directory holding one checkpoint: the model's weights, the
  optimizer's and the scheduler's state, the trainer state (its JSON) and each rank's RNG streams. The Trainer's
  ``save_total_limit`` rotation removes them as it removes its own directories.
- A save returns once the state is copied to host memory; the writes and the commit go on while training does.
  The next save, and the end of ``train``, wait for it (and raise its error).
- ``resume_from_checkpoint=True`` takes the newest checkpoint that reads back whole, every chunk CRC-checked: one
  that fails is skipped, with a warning, for the one before it. A checkpoint named explicitly that fails raises.
  Nothing is unpickled.
- One process, or DDP with every rank saving (each rank's RNG streams are its own; the rest is written once). Not
  FSDP: accelerate saves it past these methods (through DCP's FileSystemWriter).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

from ..checkpointer import Checkpointer
from ..errors import CheckpointError, NoCheckpointError, UsageError
from ..handles import CoreSave
from ..restore.read import read_state
from ..rng import RNGState

try:
    from transformers import Trainer
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:
    raise ImportError("alpsck.integrations.transformers needs transformers 5 (pip install transformers)") from e

_STATE_JSON = "trainer_state.json"  # the one file the Trainer's train() opens itself
_NUMBERED = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_REPLICATED = ("model", "optimizer", "scheduler", "scaler", "trainer_state")


class AlpsckTrainer(Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` whose checkpoints are alpsck's (module docstring). ``alpsck_options``: the
    Checkpointer's options (``threads``, ``chunk_bytes``, ...; docs/python-api.md)."""

    def __init__(self, *args: Any, alpsck_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = dict(alpsck_options or {})
        for fixed in ("rank", "world_size", "keep_last"):
            if fixed in options:
                raise UsageError(f"AlpsckTrainer sets {fixed} itself (the Trainer's ranks; each directory holds one)")
        self._alpsck_options = options
        self._alpsck_pending: tuple[Checkpointer, CoreSave] | None = None
        self._alpsck_loaded: dict[str, Any] | None = None

    # -- saving

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._alpsck_wait()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        callbacks: Any = self.state.stateful_callbacks  # transformers types these Optional: set by now
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            callbacks[cb.__class__.__name__] = cb.state()
        optimizer: Any = self.optimizer
        scheduler: Any = self.lr_scheduler
        state: dict[str, Any] = {
            "model": self.accelerator.get_state_dict(self.model, unwrap=True),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "trainer_state": json.dumps(dataclasses.asdict(self.state), sort_keys=True),
            "rng": RNGState(),
        }
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        world = max(1, self.args.world_size)
        ck = Checkpointer(folder, rank=self.args.process_index, world_size=world, keep_last=1,
                          replicated=_REPLICATED if world > 1 else (), **self._alpsck_options)
        try:
            handle = ck.save(self.state.global_step, state)
        except BaseException:
            ck.close()
            raise
        self._alpsck_pending = (ck, handle)
        if self.args.should_save:
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _alpsck_wait(self) -> None:
        """The save in flight durable (its error raised)."""
        pending, self._alpsck_pending = self._alpsck_pending, None
        if pending is not None:
            pending[0].close()

    # -- resuming

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        try:
            if not resume_from_checkpoint:
                return super().train(None, *args, **kwargs)
            folder, self._alpsck_loaded = self._alpsck_read(resume_from_checkpoint)
            # The Trainer opens <checkpoint>/trainer_state.json itself: that one small JSON file, in a directory
            # of its own; everything else comes from the alpsck checkpoint through the methods below.
            with tempfile.TemporaryDirectory(prefix="alpsck-resume-") as stage:
                Path(stage, _STATE_JSON).write_text(self._alpsck_loaded["trainer_state"])
                return super().train(stage, *args, **kwargs)
        finally:
            self._alpsck_loaded = None
            self._alpsck_wait()

    def _alpsck_read(self, which: str | bool) -> tuple[str, dict[str, Any]]:
        """(checkpoint folder, its state as saved) for ``resume_from_checkpoint``: True, the newest that reads back
        (older ones after a failure, with a warning); a path, that one (raises when it fails)."""
        rank = self.args.process_index
        if not isinstance(which, bool):
            return which, read_state(which, rank=rank)[1]
        out = str(self.args.output_dir)
        found = sorted(((int(m[1]), os.path.join(out, n)) for n in (os.listdir(out) if os.path.isdir(out) else [])
                        if (m := _NUMBERED.match(n)) and os.path.isdir(os.path.join(out, n))), reverse=True)
        failed = []
        for _, folder in found:
            try:
                state = read_state(folder, rank=rank)[1]
            except CheckpointError as e:
                failed.append(f"{folder}: {e}")
                continue
            if failed:
                warnings.warn(f"resuming from {folder}; newer checkpoints failed: {'; '.join(failed)}",
                              RuntimeWarning, stacklevel=3)
            return folder, state
        raise NoCheckpointError(f"{out}: no checkpoint to resume from" + (f" ({'; '.join(failed)})" if failed else ""))

    def _loaded(self, key: str) -> Any:
        if self._alpsck_loaded is None:
            raise UsageError("AlpsckTrainer: resume through train(resume_from_checkpoint=...)")
        return self._alpsck_loaded[key]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        target: Any = model if model is not None else self.model
        target.load_state_dict(self._loaded("model"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        optimizer: Any = self.optimizer
        scheduler: Any = self.lr_scheduler
        optimizer.load_state_dict(self._loaded("optimizer"))
        scheduler.load_state_dict(self._loaded("scheduler"))

    def _load_scaler(self, checkpoint: str | None) -> None:
        scaler = getattr(self.accelerator, "scaler", None)
        if checkpoint is not None and scaler is not None and self._alpsck_loaded and "scaler" in self._alpsck_loaded:
            scaler.load_state_dict(self._loaded("scaler"))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            RNGState().load_state_dict(self._loaded("rng"))
