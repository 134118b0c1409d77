"""One rank of the 2-rank cases of tests/unit/test_dcp_torch_suite.py, on one backend.

``python dcp_torch_suite_worker.py fs|alpsck:CASE DIR``, started once per rank with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (gloo on CPU). Cases: ``coordinator`` (the deprecated
``save_state_dict(..., coordinator_rank=1)`` / ``load_state_dict(..., coordinator_rank=1)`` of
PyTorch's test_checkpoint.py, on real storage), ``nocoll`` (``dcp.save(..., use_collectives=False)``:
each rank saves and loads without rank coordination). Prints ``OK rank R`` when it passed.
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
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, load_state_dict, save_state_dict

from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter


def writer(backend: str, path: Path) -> Any:
    return FileSystemWriter(path) if backend == "fs" else AlpsckStorageWriter(path)


def reader(backend: str, path: Path) -> Any:
    return FileSystemReader(path) if backend == "fs" else AlpsckStorageReader(path)


def coordinator(backend: str, root: Path) -> None:
    """test_checkpoint.py::TestDistributedFailure::_test_save / _test_load with coordinator=1."""
    rank = dist.get_rank()
    path = root / "coord"
    sd = {"replicated": torch.arange(100.0).reshape(10, 10), f"own{rank}": torch.full((4,), float(rank)),
          "bytes": [1, 2, 3, 4]}
    save_state_dict(sd, storage_writer=writer(backend, path), coordinator_rank=1)
    dist.barrier()
    into = {"replicated": torch.zeros(10, 10), f"own{rank}": torch.zeros(4), "bytes": [0]}
    load_state_dict(into, storage_reader=reader(backend, path), coordinator_rank=1)
    assert torch.equal(into["replicated"], sd["replicated"]) and torch.equal(into[f"own{rank}"], sd[f"own{rank}"])
    assert into["bytes"] == [1, 2, 3, 4]
    dist.barrier()
    save_state_dict({"replicated": sd["replicated"] + 1, "bytes": [5]}, storage_writer=writer(backend, path),
                    coordinator_rank=1)  # and over it again
    dist.barrier()
    into = {"replicated": torch.zeros(10, 10), "bytes": [0]}
    load_state_dict(into, storage_reader=reader(backend, path), coordinator_rank=0)
    assert torch.equal(into["replicated"], sd["replicated"] + 1) and into["bytes"] == [5]


def nocoll(backend: str, root: Path) -> None:
    """dcp.save(..., use_collectives=False): every rank on its own (its own keys); dcp.load finds each rank's part;
    a collective save to the same id afterwards is loaded by every rank."""
    rank = dist.get_rank()
    path = root / "nocoll"
    sd = {"w": torch.full((3,), float(rank + 1)), "step": 10 + rank}
    dcp.save(sd, checkpoint_id=path, storage_writer=writer(backend, path), use_collectives=False)
    dist.barrier()
    into = {"w": torch.zeros(3), "step": 0}
    dcp.load(into, checkpoint_id=path, storage_reader=reader(backend, path))
    assert torch.equal(into["w"], sd["w"]) and into["step"] == 10 + rank, (rank, into)
    dist.barrier()
    # Then a collective save to the same id writes over the ranks' own checkpoints, as FileSystemWriter does.
    common = {"w": torch.full((3,), 9.0), "step": 99}
    dcp.save(common, checkpoint_id=path, storage_writer=writer(backend, path))
    into = {"w": torch.zeros(3), "step": 0}
    dcp.load(into, checkpoint_id=path, storage_reader=reader(backend, path))
    assert torch.equal(into["w"], common["w"]) and into["step"] == 99, (rank, into)


def main() -> int:
    backend, case = sys.argv[1].split(":")
    root = Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    {"coordinator": coordinator, "nocoll": nocoll}[case](backend, root)
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
