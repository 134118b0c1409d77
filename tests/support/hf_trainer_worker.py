"""One run of a tiny ``transformers`` Trainer on CPU for tests/process/test_transformers.py, through
:class:`alpsck.integrations.transformers.AlpsckTrainer` (or the stock Trainer: ``stock``).

``python hf_trainer_worker.py OUT_DIR LOSSES_FILE [--kill-at N] [--resume] [--stock]``: 20 steps of a 2-layer MLP
with dropout (the RNG streams matter) over 24 samples, batch 4 (6 steps an epoch: step 10 is mid-epoch), a
checkpoint every 5 steps. Each step's loss is appended to LOSSES_FILE (``step float.hex``) as it is logged;
``--kill-at N`` SIGKILLs the process at the end of step N, once the checkpoint of the last multiple of 5 before it
is committed (a save is written while training goes on); under ``torchrun`` (DDP over gloo) every rank does so.
``--resume`` trains with
``resume_from_checkpoint=True``. Only rank 0 records losses.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from alpsck.integrations.transformers import AlpsckTrainer
from alpsck.store.picker import pick
from support.tiny_classifier import Net, Samples


class Record(TrainerCallback):  # type: ignore[misc]
    def __init__(self, path: str, kill_at: int | None) -> None:
        self.path, self.kill_at = path, kill_at

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs and state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(f"{state.global_step} {float(logs['loss']).hex()}\n")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.kill_at is not None and state.global_step == self.kill_at:
            saved = self.kill_at - self.kill_at % args.save_steps
            folder = Path(args.output_dir) / f"checkpoint-{saved}"
            deadline = time.monotonic() + 60
            while pick(folder).step != saved and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("losses")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stock", action="store_true")
    a = ap.parse_args()
    args = TrainingArguments(output_dir=a.out, max_steps=20, save_steps=5, per_device_train_batch_size=4,
                             logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                             disable_tqdm=True)
    torch.manual_seed(0)
    cls = Trainer if a.stock else AlpsckTrainer
    trainer = cls(model=Net(), args=args, train_dataset=Samples(), callbacks=[Record(a.losses, a.kill_at)])
    trainer.train(resume_from_checkpoint=True if a.resume else None)


if __name__ == "__main__":
    main()
