"""Several ranks on one node: time to durable with expired checkpoints recycled, against fresh files.

Each of W processes runs its own ``alpsck._core.Engine`` (rank r of W) on one shared run directory
and saves ``--mib`` MiB of random fp32 per rank, one checkpoint at a time (``max_in_flight=1``).
Two configurations alternate, ``--rounds`` times each, in this one run:

- ``recycled``: ``keep_last=1``. Rank 0's retention turns the expired step into a ``free-K``
  directory once its expiry is durable, and the next save renames it to its ``step-N.tmp``: every
  rank overwrites its old shard in place (no block allocation);
- ``fresh``: ``keep_last=0`` (keep everything): every save writes new files.

A save's time is ``save()`` until its handle completed on every rank (the whole checkpoint
committed and durable); the first ``--warmup`` saves of a round are left out (the first saves
have nothing to recycle). Prints each round and the medians::

    python benchmarks/multirank_recycling.py --dir /work/bench --ranks 2 --mib 512 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _rank(rank: int, world: int, run: str, keep_last: int, saves: int, mib: int, queue: Any, opened: Any) -> None:
    import torch

    from alpsck import _core

    gen = torch.Generator().manual_seed(rank)
    data = torch.randn(mib * (1 << 20) // 4, generator=gen).view(torch.uint8)
    if rank:
        opened.wait()  # rank 0 opens first: its housekeeping removes other ranks' unfinished files
    eng = _core.Engine(run, {"keep_last": keep_last, "max_in_flight": 1}, rank=rank, world_size=world)
    if not rank:
        opened.set()
    times = []
    for step in range(saves):
        t0 = time.perf_counter()
        eng.save(step, [("w", data)], "{}", "snapshot").wait()
        times.append(time.perf_counter() - t0)
        time.sleep(0.2)  # let the other ranks' handles complete too, and the disk settle
    eng.close()
    queue.put((rank, times))


def one_round(base: Path, world: int, keep_last: int, saves: int, mib: int) -> list[float]:
    """Each save's time until it was durable on every rank."""
    run = Path(tempfile.mkdtemp(dir=base)) / "run"
    ctx = mp.get_context("spawn")
    queue, opened = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank, args=(r, world, str(run), keep_last, saves, mib, queue, opened))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        per_rank = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
            if p.exitcode:
                raise RuntimeError(f"a rank exited with {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(run.parent, ignore_errors=True)
    return [max(per_rank[r][i] for r in per_rank) for i in range(saves)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the run directories go (the disk to measure)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=int, default=512, help="state per rank, MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--saves", type=int, default=7, help="saves per round")
    ap.add_argument("--warmup", type=int, default=3, help="saves left out at the start of each round")
    a = ap.parse_args(argv)
    if a.ranks < 1 or a.mib < 1 or a.rounds < 1 or not 0 <= a.warmup < a.saves:
        ap.error("need --ranks, --mib, --rounds >= 1 and 0 <= --warmup < --saves")
    a.dir.mkdir(parents=True, exist_ok=True)
    steady: dict[str, list[float]] = {"recycled": [], "fresh": []}
    for i in range(a.rounds):
        order = ("recycled", "fresh") if i % 2 == 0 else ("fresh", "recycled")
        for name in order:
            times = one_round(a.dir, a.ranks, 1 if name == "recycled" else 0, a.saves, a.mib)
            steady[name] += times[a.warmup:]
            print(f"round {i + 1} {name:8s} " + " ".join(f"{t:.3f}" for t in times), flush=True)
    rec, fresh = statistics.median(steady["recycled"]), statistics.median(steady["fresh"])
    total = a.ranks * a.mib * (1 << 20) / 1e9
    print(f"{a.ranks} ranks x {a.mib} MiB; median time to durable over {len(steady['fresh'])} saves each (after "
          f"{a.warmup} warm-up saves per round): recycled {rec:.3f} s ({total / rec:.2f} GB/s), fresh {fresh:.3f} s "
          f"({total / fresh:.2f} GB/s); fresh / recycled = {fresh / rec:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
