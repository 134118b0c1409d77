"""One rank of the 2-rank storage-contract cases (tests/unit/test_dcp_contract.py), on one backend.

``python dcp_contract_worker.py fs|alpsck|url DIR``, started once per rank with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (gloo on CPU). After PyTorch's
test_file_system_checkpoint_cpu.py (resharding on load, saving again into the same checkpoint,
switching between sharded and plain tensors) and e2e/test_e2e_save_and_load.py (ranks whose state
dicts list the same keys in another order, with Stateful entries that run collectives). Prints
``OK rank R`` when every case passed; the first failure raises.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # torch 2.13 does not export them
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter

# "url": DCP's own format through its fsspec writer and reader, at alpsck:// (alpsck.integrations.fsspec_fs).
WRITERS = {"fs": FileSystemWriter, "alpsck": AlpsckStorageWriter, "url": FsspecWriter}
READERS = {"fs": FileSystemReader, "alpsck": AlpsckStorageReader, "url": FsspecReader}


def where(backend: str, path: Path) -> Any:
    return f"alpsck://{path}" if backend == "url" else path


def save(backend: str, sd: dict[str, Any], path: Path) -> None:
    dcp.save(sd, checkpoint_id=where(backend, path), storage_writer=WRITERS[backend](where(backend, path)))


def load(backend: str, sd: dict[str, Any], path: Path) -> None:
    dcp.load(sd, checkpoint_id=where(backend, path), storage_reader=READERS[backend](where(backend, path)))


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def reshard_on_load(backend: str, root: Path) -> None:
    """Every (save placement, load placement) pair, each saved into the same checkpoint again."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placements = [Shard(0), Shard(1), Replicate()]
    path = root / "reshard"
    for i, save_p in enumerate(placements):
        for j, load_p in enumerate(placements):
            g = torch.Generator().manual_seed(10 * i + j)
            ref = torch.randn(9, 6, generator=g)  # 9 rows: uneven over 2 ranks
            save(backend, {"t": distribute_tensor(ref, mesh, [save_p]), "step": 10 * i + j}, path)
            into = {"t": distribute_tensor(torch.zeros(9, 6), mesh, [load_p]), "step": -1}
            load(backend, into, path)
            assert torch.equal(full(into["t"]), ref) and into["step"] == 10 * i + j, (save_p, load_p)


def switch_sharded_and_plain(backend: str, root: Path) -> None:
    """A sharded tensor loads into a plain one and back, through one checkpoint saved again."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    path = root / "switch"
    ref = torch.arange(40.0).reshape(8, 5)
    save(backend, {"t": distribute_tensor(ref, mesh, [Shard(0)])}, path)
    plain = {"t": torch.zeros(8, 5)}
    load(backend, plain, path)
    assert torch.equal(plain["t"], ref)
    save(backend, {"t": ref * 2}, path)  # every rank holds the whole tensor: written once
    sharded = {"t": distribute_tensor(torch.zeros(8, 5), mesh, [Shard(1)])}
    load(backend, sharded, path)
    assert torch.equal(full(sharded["t"]), ref * 2)


class Collective(Stateful):
    """A Stateful whose state_dict and load_state_dict run a collective, as FSDP's do."""

    def __init__(self, value: float) -> None:
        self.t = torch.full((3,), value)

    def state_dict(self) -> dict[str, Any]:
        total = self.t.clone()
        dist.all_reduce(total)
        return {"t": self.t, "sum": total}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        dist.barrier()
        self.t = state_dict["t"]


def different_key_order(backend: str, root: Path) -> None:
    rank = dist.get_rank()
    path = root / "ordered"
    keys = ["a", "b"] if rank == 0 else ["b", "a"]
    sd = {k: Collective(float(i + 1)) for i, k in enumerate(["a", "b"])}
    save(backend, {k: sd[k] for k in keys}, path)
    into = {k: Collective(0.0) for k in keys}
    load(backend, into, path)
    assert torch.equal(into["a"].t, torch.full((3,), 1.0)) and torch.equal(into["b"].t, torch.full((3,), 2.0))


def main() -> int:
    backend, root = sys.argv[1], Path(sys.argv[2])
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    dist.init_process_group("gloo")
    for case in (reshard_on_load, switch_sharded_and_plain, different_key_order):
        case(backend, root)
        dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rc = main()
    sys.stdout.flush()
    os._exit(rc)
