"""A Lightning fit as an ``alpsck submit`` job (tests/slurm/test_lightning_job.py; docs/lightning.md's recipe): a
small regression model with dropout, DDP over gloo on the CPU, the train loader an :class:`alpsck.data.ResumableLoader`.
Rank 0 appends ``global_step loss.hex()`` to LOSSES after every step; each step is padded to PACE seconds.

    entry: {function: lightning_job_worker:main, args: [LOSSES, STEPS, PACE, STRATEGY]}   # alpsck submit, 2 tasks
    python lightning_job_worker.py LOSSES STEPS STRATEGY   # the uninterrupted reference: Lightning starts rank 1

STRATEGY: ``ddp`` (checkpoints through :class:`alpsck.integrations.lightning.AlpsckCheckpointIO`), or ``fsdp``: FSDP2
(``fully_shard`` in ``configure_model``) under :class:`alpsck.integrations.lightning_sharded.AlpsckModelParallelStrategy`,
every rank writing its shard.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import lightning_worker  # beside this file (the test copies both)
import torch
from lightning.pytorch.callbacks import Callback

from alpsck.data import ResumableLoader
from alpsck.integrations.lightning import AlpsckCheckpointIO
from alpsck.integrations.lightning_sharded import AlpsckModelParallelStrategy

warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging, on every rank


class Regression(lightning_worker.Regression):
    """The Lightning tests' model, with dropout, and its train loader a resumable one."""

    def __init__(self) -> None:
        super().__init__(dropout=0.2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        loss = super().training_step(batch, i)
        self.log("loss", loss)  # what checkpoint.keep_best ranks by (the bridge records it with each save)
        return loss

    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(lightning_worker.dataset(), batch_size=4, seed=1, num_replicas=self.trainer.world_size,
                               rank=self.trainer.global_rank)


class Record(Callback):
    def __init__(self, losses: Path, pace: float) -> None:
        self.losses, self.pace = losses, pace

    def on_train_batch_end(self, trainer: L.Trainer, _m: object, outputs: dict[str, torch.Tensor], _b: object,
                           _i: int) -> None:
        if trainer.global_rank == 0:
            with open(self.losses, "a") as f:
                f.write(f"{trainer.global_step} {outputs['loss'].item().hex()}\n")
        time.sleep(self.pace)


def fit(losses: Path, steps: int, pace: float, strategy: str, callbacks: list[Any], ckpt_path: str | None) -> None:
    L.seed_everything(0, verbose=False)
    sharded = strategy == "fsdp"
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_steps=steps,
                        strategy=AlpsckModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if sharded
                        else "ddp", plugins=[] if sharded else [AlpsckCheckpointIO()],
                        callbacks=[*callbacks, Record(losses, pace)],
                        deterministic=True, enable_progress_bar=False, logger=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(Regression(), ckpt_path=ckpt_path)


def main(job: Any) -> None:
    """The job's entry: the recipe of docs/lightning.md."""
    from alpsck.integrations.lightning_job import AlpsckJob

    losses, steps, pace, strategy = job.argv
    bridge = AlpsckJob(job)
    fit(Path(losses), int(steps), float(pace), strategy, [bridge], bridge.ckpt_path)


if __name__ == "__main__":
    fit(Path(sys.argv[1]), int(sys.argv[2]), 0.0, sys.argv[3], [], None)
