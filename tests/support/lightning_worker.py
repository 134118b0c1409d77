"""A Lightning 2.6 training through alpsck's CheckpointIO (tests/ranks/test_lightning.py): a small regression model,
DDP over gloo on the CPU (Lightning starts the other ranks itself, running this script again), a checkpoint at the
end of every epoch (and ``last.ckpt``). Rank 0 appends ``global_step loss.hex()`` to LOSSES after every step.

    python lightning_worker.py RUN LOSSES EPOCHS [--resume] [--stop-at STEP] [--fsdp]

``--resume``: ``fit(ckpt_path="last")``. ``--stop-at STEP``: at that step rank 0 waits until every save is
durable, writes RUN/stopped and sleeps, for the test to SIGKILL the whole process group there. ``--fsdp``: FSDP2
(``fully_shard`` in ``configure_model``) under :class:`alpsck.integrations.lightning_sharded.AlpsckModelParallelStrategy`,
whose sharded checkpoints bypass the CheckpointIO, instead of DDP.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from alpsck.integrations.lightning import AlpsckCheckpointIO
from alpsck.integrations.lightning_sharded import AlpsckModelParallelStrategy

warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging, on every rank


def shard_for_fsdp2(module: L.LightningModule) -> None:
    """``configure_model``'s, under :class:`AlpsckModelParallelStrategy`: FSDP2 over the data-parallel ranks, each
    layer of ``module.net`` that has parameters, then the whole net (also tests/support/lightning_job_worker.py's)."""
    if isinstance(module.trainer.strategy, AlpsckModelParallelStrategy):
        from torch.distributed.fsdp import fully_shard

        mesh = module.device_mesh["data_parallel"]
        for layer in module.net:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(module.net, mesh=mesh)


def dataset() -> torch.utils.data.TensorDataset:
    """96 samples of 8 features and a smooth target, the same in every process (a generator of its own)."""
    x = torch.randn(96, 8, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())


class Regression(L.LightningModule):
    """``dropout``: a dropout layer after the activation (tests/support/lightning_job_worker.py's model)."""

    def __init__(self, dropout: float | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), *([nn.Dropout(dropout)] if dropout else []),
                                 nn.Linear(32, 1))

    def configure_model(self) -> None:
        shard_for_fsdp2(self)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)}


class Record(Callback):
    def __init__(self, losses: Path, io: AlpsckCheckpointIO, run: Path, stop_at: int | None) -> None:
        self.losses, self.io, self.run, self.stop_at = losses, io, run, stop_at

    def on_train_batch_end(self, trainer: L.Trainer, _m: object, outputs: dict[str, torch.Tensor], _b: object,
                           _i: int) -> None:
        if trainer.global_rank != 0:
            return
        with open(self.losses, "a") as f:
            f.write(f"{trainer.global_step} {outputs['loss'].item().hex()}\n")
        if trainer.global_step == self.stop_at:
            self.io.teardown()  # every save so far durable (the sharded strategy's are when save_checkpoint returns)
            (self.run / "stopped").touch()
            time.sleep(600)


def main() -> None:
    run, losses, epochs = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    stop_at = int(sys.argv[sys.argv.index("--stop-at") + 1]) if "--stop-at" in sys.argv else None
    L.seed_everything(0, workers=True, verbose=False)
    data = dataset()
    io = AlpsckCheckpointIO()
    strategy = (AlpsckModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if "--fsdp" in sys.argv
                else "ddp")
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, plugins=[io],
                        callbacks=[ModelCheckpoint(dirpath=run, save_top_k=-1, save_last=True),
                                   Record(losses, io, run, stop_at)],
                        deterministic=True, enable_progress_bar=False, logger=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    trainer.fit(Regression(), loader, ckpt_path="last" if "--resume" in sys.argv else None)


if __name__ == "__main__":
    main()
