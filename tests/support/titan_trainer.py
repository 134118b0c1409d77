"""A torchtitan-shaped trainer, written here (not torchtitan's code), for tests/ranks/test_dcp_titan.py.

``python titan_trainer.py FOLDER STEPS INTERVAL MODE [KILL_AT]``, started once per rank with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (gloo on CPU). What it shares with torchtitan's
checkpoint manager is what matters to a storage backend:

* an FSDP2 model (``fully_shard`` on a CPU mesh) and AdamW, saved through
  ``torch.distributed.checkpoint.state_dict`` as DTensors, with an LR scheduler, a dataloader
  whose state is per-rank ``bytes`` (a pickle the dataloader itself writes and reads) and a train
  state holding ``io.BytesIO`` buffers;
* checkpoint ids ``FOLDER/step-N`` (unpadded), saved at step 1, every INTERVAL steps and at the
  last step (always synchronous); MODE ``sync`` (``dcp.save``), ``thread`` (``dcp.async_save`` on a
  gloo group) or ``process`` (``dcp.async_save`` with the process executor); one save in flight;
* discovery on start: the newest ``step-N`` in FOLDER that has a ``.metadata`` file, by an
  unanchored regex; none: start from scratch;
* purge: rank 0 keeps the newest 2 by ``shutil.rmtree(ignore_errors=True)``, right after a save
  starts.

Every rank appends ``step loss`` lines to ``FOLDER/../losses-rank-R.txt``; with KILL_AT, each
rank SIGKILLs itself right after starting the save of step KILL_AT (an async save is then in
flight). At the end rank 0 writes the parameters to ``FOLDER/../final.pt`` (plain tensors).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import signal
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter

DIM, VOCAB, SEQ, BATCH = 32, 64, 8, 4


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                    for _ in range(2))
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


class DataLoader(Stateful):
    """Deterministic batches from (seed, rank, position); its state is a pickle, as torchdata's is."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.position = rank, world, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.position + self.rank)
        self.position += 1
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position}), "world_size": self.world}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        assert state_dict["world_size"] == self.world
        self.position = pickle.loads(state_dict[f"dp_rank_{self.rank}"])["position"]


class TrainState(Stateful):
    def __init__(self) -> None:
        self.step = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32), "global_avg_losses": buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        state_dict["global_avg_losses"].seek(0)
        self.losses = torch.load(state_dict["global_avg_losses"], weights_only=False)


class ModelAndOptimizer(Stateful):
    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def latest_step(folder: str) -> int:
    if not os.path.isdir(folder):
        return -1
    steps = [int(m.group(1)) for name in os.listdir(folder)
             if (m := re.search(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))]
    return max(steps, default=-1)


def purge(folder: str, keep: int) -> None:
    if not os.path.isdir(folder):  # the first save is still in flight
        return
    steps = sorted(int(m.group(1)) for name in os.listdir(folder) if (m := re.search(r"step-(\d+)", name)))
    for step in steps[:-keep]:
        shutil.rmtree(os.path.join(folder, f"step-{step}"), ignore_errors=True)


def main() -> int:
    folder, steps, interval, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    kill_at = int(sys.argv[5]) if len(sys.argv) > 5 else -1
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Model()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 5))
    data, train = DataLoader(rank, world), TrainState()
    states: dict[str, Any] = {"model_optim": ModelAndOptimizer(model, optim), "lr_scheduler": sched,
                              "dataloader": data, "train_state": train}
    writer, reader = AlpsckStorageWriter(), AlpsckStorageReader()
    pg = dist.new_group(backend="gloo")
    found = latest_step(folder)
    if found >= 0:
        dcp.load(states, checkpoint_id=os.path.join(folder, f"step-{found}"), storage_reader=reader)
        assert train.step == found, (train.step, found)
    pending: Any = None
    log = open(os.path.join(os.path.dirname(folder), f"losses-rank-{rank}.txt"), "a")  # noqa: SIM115
    while train.step < steps:
        train.step += 1
        inputs, labels = data.next()
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        sched.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the default group: pg is the checkpoints' (async saves use it from their thread)
        train.losses.append(float(total) / world)
        log.write(f"{train.step} {float(total) / world!r}\n")
        log.flush()
        last = train.step == steps
        if train.step == 1 or train.step % interval == 0 or last:
            if pending is not None:
                pending.result()  # one save in flight
                pending = None
            cid = os.path.join(folder, f"step-{train.step}")
            if mode == "sync" or last:
                dcp.save(states, checkpoint_id=cid, storage_writer=writer)
            elif mode == "thread":
                pending = dcp.async_save(states, checkpoint_id=cid, storage_writer=writer, process_group=pg)
            else:
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                pending = dcp.async_save(states, checkpoint_id=cid, storage_writer=writer, process_group=pg,
                                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            if rank == 0:
                purge(folder, keep=2)
            if train.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    if pending is not None:
        pending.result()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, os.path.join(os.path.dirname(folder), "final.pt"))
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the model's outputs are not modified in place
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
