"""One rank of the memory tier's multi-rank test (tests/ranks/test_memory_tier_ranks.py):
``python memory_worker.py save|restore RUN_DIR`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set
(gloo on CPU) and ALPSCK_MEMORY_ROOT naming the node memory's stand-in.

* ``save``: step 0 to the run directory, step 5 to the memory tier (each rank its own values, a shared
  model written once), both waited for; ``save STEP:TIER,...`` saves those instead.
* ``restore``: a fresh state, ``restore()``; prints ``RESTORED <step> <tier> <ok>``, ok when every
  value is the one saved at that step on this rank, and ``COLLECTIVES <n>``: the torch.distributed collectives
  the Checkpointer's opening and its restore made.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.distributed as dist

from alpsck import Checkpointer


def values(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(step)
    return {"own": torch.randn(50_000, generator=g), "model": torch.randn(70_000, generator=shared)}


def count_collectives() -> list[str]:
    """From now on, each torch.distributed collective called is listed by name."""
    made: list[str] = []

    def counted(name: str, f: Any) -> Any:
        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            made.append(name)
            return f(*args, **kwargs)
        return call

    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier",
                 "gather", "scatter", "reduce", "all_to_all"):
        setattr(dist, name, counted(name, getattr(dist, name)))
    return made


def main() -> None:
    mode, run_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    made = count_collectives()
    rank = dist.get_rank()
    state: dict[str, object] = {"own": torch.zeros(50_000), "model": {"w": torch.zeros(70_000)}, "step": -1}
    with Checkpointer(run_dir, memory=True, replicated=("model",)) as ck:
        if mode == "save":
            plan = sys.argv[3] if len(sys.argv) > 3 else "0:run_dir,5:memory"
            for step, tier in ((int(a), b) for a, b in (x.split(":") for x in plan.split(","))):
                v = values(step, rank)
                state = {"own": v["own"], "model": {"w": v["model"]}, "step": step}
                ck.save(step, state, tier=tier).wait()
        else:
            got = ck.restore(state)
            v = values(got if got is not None else -1, rank)
            ok = (torch.equal(state["own"], v["own"]) and torch.equal(state["model"]["w"], v["model"])  # type: ignore[index]
                  and state["step"] == got)
            print(f"RESTORED {got} {ck.restored_tier} {ok}", flush=True)
            print(f"COLLECTIVES {len(made)} {' '.join(made)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
