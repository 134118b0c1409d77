"""``alpsck bench --ranks 1,2,4``: aggregate DCP save/load throughput of several ranks on one node.

The same total state (a transformer-like state, :mod:`.state`) is split over W ranks as DTensors
sharded on dim 0 (each rank builds its own shards with ``DTensor.from_local``: no communication),
and saved and loaded through ``torch.distributed.checkpoint`` with alpsck's backend
(:mod:`alpsck.dcp`, each checkpoint named by ``checkpoint_id`` as torchtitan names them) and with
DCP's FileSystemWriter/Reader (``sync_files=True``: every file
fsync'ed; the checkpoint directory and its parent are fsync'ed after the save too, inside the
timing, so both are durable when the clock stops). Every configuration runs in one process group
of W processes (gloo; CPU tensors), started by this module as ``python -m alpsck.bench.ranks``.

Timing, on rank 0, between two barriers: a save is ``dcp.save`` until it returned on every rank
(committed and durable); a load is ``dcp.load`` into zeroed tensors with the checkpoint's pages
dropped from the page cache first, so both backends read from the device. Old checkpoints are
removed outside the timing. The first save and load of each configuration are a warm-up; the
median of ``repeats`` follows. After each load every tensor's checksum is compared with the saved
one, so a wrong load fails the benchmark instead of looking fast.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import AlpsckError
from ..store.durable import fsync_path
from .methods import drop_page_cache
from .run import _machine
from .state import state_bytes, transformer_state


@dataclass
class RanksMeasurement:
    ranks: int
    method: str
    save_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    state_bytes: int = 0

    @property
    def save_gbps(self) -> float:
        return self.state_bytes / statistics.median(self.save_seconds) / 1e9

    @property
    def load_gbps(self) -> float:
        return self.state_bytes / statistics.median(self.load_seconds) / 1e9


@dataclass
class RanksResult:
    directory: str
    state_bytes: int
    machine: dict[str, Any]
    repeats: int
    measurements: list[RanksMeasurement]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for m, out in zip(self.measurements, d["measurements"], strict=True):
            out["save_gbps"], out["load_gbps"] = m.save_gbps, m.load_gbps
        return d


def methods_for(alpsck_threads: int | None, dcp_threads: list[int]) -> list[str]:
    return [f"alpsck t={alpsck_threads or 8}"] + [f"dcp-fs t={t}" for t in dcp_threads]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(directory: Path, size_bytes: int, ranks: list[int], *, repeats: int = 3, alpsck_threads: int | None = None,
              dcp_threads: list[int] | None = None, progress: Any = None) -> RanksResult:
    """Measure every world size in ``ranks``; each runs every method on the same total state."""
    say = progress or (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    work = directory / f"alpsck-bench-ranks-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    methods = methods_for(alpsck_threads, dcp_threads or [1, 4])
    out: list[RanksMeasurement] = []
    total = 0
    try:
        for world in ranks:
            say(f"{world} rank(s): {', '.join(methods)}")
            cfg = {"dir": str(work / f"w{world}"), "bytes": size_bytes // world, "repeats": repeats,
                   "methods": methods, "alpsck_threads": alpsck_threads}
            port = _free_port()
            procs = []
            for r in range(world):
                env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)}
                procs.append(subprocess.Popen([sys.executable, "-m", "alpsck.bench.ranks", json.dumps(cfg)], env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            outputs = [p.communicate() for p in procs]
            failed = [(r, e) for r, (p, (_, e)) in enumerate(zip(procs, outputs, strict=True)) if p.returncode]
            if failed:
                raise AlpsckError(f"bench --ranks {world}: rank {failed[0][0]} failed:\n{failed[0][1][-3000:]}")
            doc = json.loads(outputs[0][0].strip().splitlines()[-1])
            total = doc["state_bytes"]
            for m in doc["measurements"]:
                out.append(RanksMeasurement(world, m["method"], m["save_seconds"], m["load_seconds"], total))
            shutil.rmtree(work / f"w{world}", ignore_errors=True)
        return RanksResult(str(work), total, _machine(), repeats, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(r: RanksResult) -> str:
    lines = [f"DCP on one node: {r.state_bytes / 2**30:.2f} GiB in total, split over the ranks; "
             f"median of {r.repeats} after a warm-up ({r.machine['cpus']} CPUs, torch {r.machine['torch']})",
             "",
             f"{'ranks':>5}  {'method':<14} {'save s':>8} {'save GB/s':>10} {'load s':>8} {'load GB/s':>10}"]
    for m in r.measurements:
        lines.append(f"{m.ranks:>5}  {m.method:<14} {statistics.median(m.save_seconds):8.3f} {m.save_gbps:10.2f} "
                     f"{statistics.median(m.load_seconds):8.3f} {m.load_gbps:10.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ one rank


def _ckpt(d: Path, step: int) -> Path:
    """Each checkpoint in a directory of its own, named by DCP's checkpoint_id, for both backends
    (alpsck's checkpoint-directory mode: as torchtitan names them)."""
    return d / f"ckpt-{step}"


def _save(method: str, state: dict[str, Any], d: Path, step: int, rank: int, cfg: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    from ..dcp import AlpsckStorageWriter

    ckpt = _ckpt(d, step)
    if method.startswith("alpsck"):
        dcp.save(state, checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter(threads=cfg["alpsck_threads"]))
        return
    dcp.save(state, checkpoint_id=ckpt,
             storage_writer=dcp.FileSystemWriter(ckpt, sync_files=True, thread_count=int(method.split("t=")[1])))
    if rank == 0:  # the rename of .metadata and the new directory, durable too
        fsync_path(ckpt)
        fsync_path(ckpt.parent)


def _load(method: str, state: dict[str, Any], d: Path, step: int) -> None:
    import torch.distributed.checkpoint as dcp

    from ..dcp import AlpsckStorageReader

    ckpt = _ckpt(d, step)
    reader = AlpsckStorageReader() if method.startswith("alpsck") else dcp.FileSystemReader(ckpt)
    dcp.load(state, checkpoint_id=ckpt, storage_reader=reader)


def _worker(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    mesh = init_device_mesh("cpu", (world,))
    local = transformer_state(cfg["bytes"], seed=rank)  # same shapes on every rank: the Shard(0) pieces
    sums = {k: float(v.double().sum()) for k, v in local.items()}
    state = {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()}
    total = torch.tensor([state_bytes(local)], dtype=torch.int64)
    dist.all_reduce(total)
    base = Path(cfg["dir"])

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    results = []
    for method in cfg["methods"]:
        d = base / method.replace(" ", "-").replace("=", "")
        saves, loads = [], []
        for step in range(1, cfg["repeats"] + 2):
            saves.append(timed(lambda step=step, d=d, method=method: _save(method, state, d, step, rank, cfg)))
            for t in local.values():
                t.zero_()
            if rank == 0:
                drop_page_cache(d)
            loads.append(timed(lambda step=step, d=d, method=method: _load(method, state, d, step)))
            bad = [k for k, v in local.items() if float(v.double().sum()) != sums[k]]
            if bad:
                raise AlpsckError(f"rank {rank}: {method} loaded wrong values into {bad[:3]}")
            dist.barrier()
            if rank == 0:  # keep one checkpoint (outside the timing)
                for old in d.iterdir():
                    if old.is_dir() and old.name.startswith("ckpt-") and old != _ckpt(d, step):
                        shutil.rmtree(old)
        results.append({"method": method, "save_seconds": saves[1:], "load_seconds": loads[1:]})
        dist.barrier()
    dist.destroy_process_group()
    return {"state_bytes": int(total.item()), "measurements": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of `alpsck bench --ranks` (started by it)")
    p.add_argument("config", help="JSON configuration")
    cfg = json.loads(p.parse_args(argv).config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        doc = _worker(cfg)
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
