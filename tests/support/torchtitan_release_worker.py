"""One rank of tests/ranks/test_torchtitan_release.py: torchtitan's own CheckpointManager (the released package).

``python torchtitan_release_worker.py STORAGE FOLDER STEPS ASYNC_MODE OUT [STOP]``, started once per rank with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (gloo on CPU). Trains a small FSDP2 model the way
torchtitan's Trainer drives its checkpointer (``load()`` at start, ``save(step, last_step=...)`` after
every step, ``close()`` at the end), with torchtitan's OptimizersContainer (AdamW) and
LRSchedulersContainer, a dataloader whose state is per-rank pickled bytes (as torchtitan's
ParallelAwareDataloader) and a train state of ``step`` and ``ntokens_seen`` (as its Trainer).

STORAGE ``filesystem``: torchtitan's CheckpointManager as released (DCP's FileSystemWriter).
STORAGE ``alpsck``: the same module's source with docs/dcp.md's recipe applied (the ``diff`` block
of "The change in your trainer"), loaded as ``torchtitan.components.checkpointer.dcp_alpsck``; each
hunk must match torchtitan's code exactly once, so the recipe cannot drift from the release.

STEPS is the training's length (its LR schedule, its last step); the job stops after step STOP (a
job's time limit; default STEPS). Writes OUT/rank-R.pt (plain tensors and numbers, for
``torch.load(weights_only=True)``): the loss of every step trained, the step the manager resumed
from, and the full final state (model, optimizer, LR schedulers, dataloader position, train state).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import re
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DOCS = Path(__file__).resolve().parents[2] / "docs" / "dcp.md"
MODULE = "torchtitan.components.checkpointer.dcp"


def recipe_hunks(doc: str) -> list[tuple[str, str]]:
    """The (old, new) text of each hunk of the first ``diff`` block in docs/dcp.md."""
    m = re.search(r"```diff\n(.*?)```", doc, re.S)
    assert m, "docs/dcp.md has no ```diff block (the torchtitan recipe)"
    hunks: list[tuple[list[str], list[str]]] = []
    for line in m.group(1).splitlines():
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            hunks.append(([], []))
        elif line.startswith(" "):
            hunks[-1][0].append(line[1:])
            hunks[-1][1].append(line[1:])
        elif line.startswith("-"):
            hunks[-1][0].append(line[1:])
        elif line.startswith("+"):
            hunks[-1][1].append(line[1:])
    return [("\n".join(old), "\n".join(new)) for old, new in hunks]


def patched_manager_module() -> ModuleType:
    spec = importlib.util.find_spec(MODULE)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    for old, new in recipe_hunks(DOCS.read_text()):
        n = source.count(f"\n{old}\n")
        assert n == 1, f"docs/dcp.md's recipe: {old!r} is in {spec.origin} {n} times, not once"
        source = source.replace(f"\n{old}\n", f"\n{new}\n")
    name = MODULE + "_alpsck"
    mod_spec = importlib.util.spec_from_loader(name, loader=None, origin=spec.origin)
    assert mod_spec is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod.__package__ = MODULE.rpartition(".")[0]
    sys.modules[name] = mod
    exec(compile(source, spec.origin + " (docs/dcp.md's recipe applied)", "exec"), mod.__dict__)  # noqa: S102
    return mod


class Data:
    """torchtitan's ParallelAwareDataloader's checkpoint shape: ``{dp_rank_R: pickle bytes, world_size}``."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.pos = rank, world, 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.pos + self.rank)
        self.pos += 1
        return torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"pos": self.pos}), "world_size": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert state["world_size"] == self.world
        self.pos = pickle.loads(state[f"dp_rank_{self.rank}"])["pos"]  # noqa: S301 (the dataloader's own bytes)


class TrainState:
    """torchtitan's Trainer as its checkpoint's ``train_state``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def plain(v: Any) -> Any:
    if hasattr(v, "full_tensor"):
        v = v.full_tensor()
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def main() -> int:
    storage, folder, steps, async_mode, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    stop = int(sys.argv[6]) if len(sys.argv) > 6 else steps
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    if storage == "alpsck":
        manager_cls = patched_manager_module().CheckpointManager
    else:
        from torchtitan.components.checkpoint import CheckpointManager as manager_cls

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})]).build(
        model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=steps)
    data, train = Data(rank, world), TrainState()
    config = manager_cls.Config(enable=True, folder="checkpoint", interval=2, keep_latest_k=2,
                                last_save_model_only=False, async_mode=async_mode)
    checkpointer = config.build(dataloader=data, model_parts=[model], optimizers=optimizers,
                                lr_schedulers=lr_schedulers, states={"train_state": train}, sd_adapter=None,
                                base_folder=folder)
    checkpointer.load(step=-1)
    resumed = train.step
    losses = []
    while train.step < stop:
        train.step += 1
        inputs, labels = data.next()
        loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        lr_schedulers.step()
        train.ntokens_seen += inputs.numel()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
        checkpointer.save(train.step, last_step=train.step == steps)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    state = {
        "resumed": resumed, "losses": losses, "train": train.state_dict(), "data_pos": data.pos,
        "model": {k: plain(v) for k, v in model.state_dict().items()},
        "optimizer": {k: plain(v) for k, v in optimizers.state_dict().items()},
        "lr_schedulers": lr_schedulers.state_dict(),
    }
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, f"rank-{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank} resumed {resumed}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
