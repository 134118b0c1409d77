"""One rank of tests/ranks/test_dcp_import.py: ``python dcp_import_worker.py save|load FOLDER``.

Started once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (gloo on CPU).

* ``save``: DCP's own FileSystemWriter (no storage_writer) writes ``FOLDER/step-5`` and
  ``FOLDER/step-10`` of :func:`dcp_worker.reference`, with DTensors sharded Shard(0) and Shard(1), so
  each rank writes its own ``__R_0.distcp``: the checkpoints a torchtitan run left before alpsck.
* ``load``: any world size; loads ``FOLDER/step-10`` through AlpsckStorageReader into DTensors sharded
  differently (after ``alpsck import-dcp``) and checks every value bit for bit.

Prints ``OK rank R`` on success; exits non-zero with the mismatch otherwise.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from dcp_worker import check, reference, template  # noqa: E402


def main() -> int:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from alpsck.dcp import AlpsckStorageReader

    torch.set_num_threads(1)
    mode, folder = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def sharded(state: dict[str, Any], w_dim: int, wb_dim: int, emb_dim: int | None) -> dict[str, Any]:
        m = state["model"]
        m["w"] = distribute_tensor(m["w"], mesh, [Shard(w_dim)])
        m["wb"] = distribute_tensor(m["wb"], mesh, [Shard(wb_dim)])
        if emb_dim is not None:
            m["emb"] = distribute_tensor(m["emb"], mesh, [Shard(emb_dim)])
        return state

    if mode == "save":
        for step in (5, 10):
            dcp.save(sharded(reference(step), 0, 1, None), checkpoint_id=os.path.join(folder, f"step-{step}"))
    else:
        state = sharded(template(), 1, 0, 1)
        dcp.load(state, checkpoint_id=os.path.join(folder, "step-10"), storage_reader=AlpsckStorageReader())
        full = {"model": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state["model"].items()},
                "step_t": state["step_t"], "extra": state["extra"]}
        bad = check(full, 10)
        if bad:
            print(f"rank {rank}: mismatches: {bad}")
            return 1
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
