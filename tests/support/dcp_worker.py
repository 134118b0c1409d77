"""One rank of the DCP tests (tests/ranks/test_dcp.py): ``python dcp_worker.py save|load RUN_DIR``.

Started once per rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (gloo on CPU).

* ``save``: world size 2; saves steps 5, 10 and 15 of :func:`reference` (the last with
  keep_last=2) through AlpsckStorageWriter, with DTensors sharded Shard(0) and Shard(1),
  replicated plain tensors, bf16 tensors and non-tensor values.
* ``named``: world size 2; torchtitan's naming: ``dcp.save(..., checkpoint_id=FOLDER/step-N)`` with one
  reused ``AlpsckStorageWriter()``: step-5, step-10, step-10 again holding reference(11) (an
  overwrite), and step-15 through ``dcp.async_save`` on a gloo group.
* ``same``: world size 2; loads the newest checkpoint into the sharding it was saved with (so each rank
  reads its own shard's part of ``w`` and ``wb``), printing every RuntimeWarning as ``WARN ...``.
* ``load``: any world size; loads the newest checkpoint into DTensors sharded differently
  (Shard(1) where the save had Shard(0), and the other way round) and checks every value bit for bit.

Prints ``OK rank R`` on success; exits non-zero with the mismatch otherwise.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch


def reference(step: int) -> dict[str, Any]:
    """The full (unsharded) state of checkpoint ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(10, 6, generator=g),                        # saved Shard(0), uneven over 4
            "wb": torch.randn(7, 9, generator=g).to(torch.bfloat16),     # saved Shard(1)
            "b": torch.randn(6, generator=g),                            # replicated
            "emb": torch.randn(5, 3, generator=g).to(torch.bfloat16),    # replicated bf16
            "count": torch.randint(0, 1 << 40, (3, 2), generator=g),     # int64
        },
        "step_t": torch.tensor(step),
        "extra": {"lr": 0.1 * step, "betas": (0.9, 0.95), "name": f"adamw-{step}", "milestones": [1, 2, step]},
    }


def template() -> dict[str, Any]:
    """A state of the right shapes holding other values (what a fresh job has before loading)."""
    ref = reference(0)
    return {"model": {k: torch.full_like(v, 7) for k, v in ref["model"].items()}, "step_t": torch.tensor(-1),
            "extra": dict.fromkeys(ref["extra"])}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def check(loaded: dict[str, Any], step: int) -> list[str]:
    """Mismatches between a loaded (full, plain-tensor) state and reference(step)."""
    ref = reference(step)
    bad = [f"model.{k}" for k, v in ref["model"].items() if not same_bits(loaded["model"][k], v)]
    if not same_bits(loaded["step_t"], ref["step_t"]):
        bad.append("step_t")
    for k, v in ref["extra"].items():
        if loaded["extra"][k] != v or type(loaded["extra"][k]) is not type(v):
            bad.append(f"extra.{k}: {loaded['extra'][k]!r} != {v!r}")
    return bad


def main() -> int:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter

    torch.set_num_threads(1)
    mode, run_dir = sys.argv[1], sys.argv[2]
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
        for step in (5, 10, 15):
            state = sharded(reference(step), 0, 1, None)
            dcp.save(state, storage_writer=AlpsckStorageWriter(run_dir, step, keep_last=2 if step == 15 else 0))
        dist.barrier()
        dist.destroy_process_group()
        print(f"OK rank {rank}")
        return 0
    if mode == "named":
        writer = AlpsckStorageWriter()
        for name, step in (("step-5", 5), ("step-10", 10), ("step-10", 11)):
            dcp.save(sharded(reference(step), 0, 1, None), checkpoint_id=os.path.join(run_dir, name),
                     storage_writer=writer)
        dcp.async_save(sharded(reference(15), 0, 1, None), checkpoint_id=os.path.join(run_dir, "step-15"),
                       storage_writer=writer, process_group=dist.new_group(backend="gloo")).result()
        dist.barrier()
        dist.destroy_process_group()
        print(f"OK rank {rank}")
        return 0
    if mode == "same":
        import warnings

        state = sharded(template(), 0, 1, None)
        reader = AlpsckStorageReader(run_dir)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RuntimeWarning)
            dcp.load(state, storage_reader=reader)
        for w in seen:
            if issubclass(w.category, RuntimeWarning):
                print(f"WARN {w.message}")
        full = {"model": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state["model"].items()},
                "step_t": state["step_t"], "extra": state["extra"]}
        bad = check(full, reader.step or -1)
        dist.barrier()
        dist.destroy_process_group()
        print(f"OK rank {rank} step {reader.step}" if not bad else f"rank {rank}: step {reader.step}: {bad}")
        return 1 if bad else 0
    state = sharded(template(), 1, 0, 1)  # resharded: other dims, other world size
    reader = AlpsckStorageReader(run_dir)
    dcp.load(state, storage_reader=reader)
    full = {"model": {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state["model"].items()},
            "step_t": state["step_t"], "extra": state["extra"]}
    bad = check(full, reader.step or -1)
    local = state["model"]["w"].to_local()
    if bad or reader.step != 15:
        print(f"rank {rank}: step {reader.step}, mismatches: {bad}")
        return 1
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank} step {reader.step} local w {list(local.shape)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # skip the interpreter's teardown of torch (seconds on a busy 2-core machine)
