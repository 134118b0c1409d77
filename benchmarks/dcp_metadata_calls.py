"""File-system metadata calls per DCP save into a new checkpoint directory (``dcp.save(checkpoint_id=DIR/step-N)``,
torchtitan's way), per rank: ``AlpsckStorageWriter`` against ``FileSystemWriter``, in the same run.

W gloo processes, each under ``strace -f`` (:func:`metadata_budget.run_traced`: the same calls counted, the same
markers). Each rank saves a state of 8 float32 tensors of 256 KiB of its own (a 2 MiB shard per rank) with each
writer into a new directory per save: ``--warmup`` saves each (untimed), then ``--saves`` measured ones of the first
writer between two markers, and of the second between two more. On Lustre each of these calls is a round trip to a
metadata server, the thing a shared file system runs short of::

    python benchmarks/dcp_metadata_calls.py --ranks 2,4 --saves 3
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from metadata_budget import SYNC, _top, parse_trace, run_traced, strace_problem

WRITERS = ("fs", "alpsck")
WORKER = r"""
import datetime, os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from alpsck.dcp import AlpsckStorageWriter
torch.set_num_threads(1)
root, warmup, saves = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank = dist.get_rank()
state = {f"rank{rank}": {f"t{i}": torch.full((65536,), float(rank + i)) for i in range(8)}}

def mark(name):
    try:
        os.stat(name)
    except FileNotFoundError:
        pass

for writer in ("fs", "alpsck"):
    def save(step):
        path = os.path.join(root, writer, f"step-{step}")
        dcp.save(state, storage_writer=AlpsckStorageWriter(path) if writer == "alpsck" else dcp.FileSystemWriter(path))
    for step in range(1, warmup + 1):
        save(step)
    dist.barrier()
    mark(f"/alpsck-marker-{writer}-begin")
    for step in range(warmup + 1, warmup + saves + 1):
        save(step)
    mark(f"/alpsck-marker-{writer}-end")
    dist.barrier()
dist.destroy_process_group()
"""


def one_world(base: Path, world: int, warmup: int, saves: int, timeout: float) -> dict[str, list[dict]]:
    """Each writer's counts per rank, at ``world`` ranks."""
    work = Path(tempfile.mkdtemp(prefix=f"dcp-calls-{world}r-", dir=base))
    (work / "worker.py").write_text(WORKER)
    run_traced(work, world, [str(work / "worker.py"), str(work / "ck"), str(warmup), str(saves)], timeout,
               f"{world} ranks")
    out: dict[str, list[dict]] = {}
    for writer in WRITERS:
        out[writer] = [parse_trace((work / f"trace.{r}").read_text(errors="replace"), str(work / "ck"),
                                   f"/alpsck-marker-{writer}-begin", f"/alpsck-marker-{writer}-end")
                       for r in range(world)]
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2", help="world sizes, comma-separated (gloo on 127.0.0.1)")
    ap.add_argument("--saves", type=int, default=3, help="measured saves of each writer")
    ap.add_argument("--warmup", type=int, default=2, help="saves of each writer before its measured ones")
    ap.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--top", type=int, default=0, help="also list each rank's N most frequent calls and paths")
    a = ap.parse_args()
    worlds = [int(w) for w in a.ranks.split(",") if w]
    if not worlds or min(worlds) < 1 or a.saves < 1 or a.warmup < 0:
        ap.error("need --ranks >= 1, --saves >= 1, --warmup >= 0")
    why = strace_problem()
    if why is not None:
        print(f"dcp_metadata_calls: {why}", file=sys.stderr)
        return 2
    base = a.dir or Path(tempfile.mkdtemp(prefix="alpsck-dcp-calls-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"metadata calls per save (sync calls, not counted: {', '.join(SYNC)})")
    print(f"{'ranks':>5} {'rank':>4} {'FileSystemWriter':>16} {'alpsck':>8} {'alpsck/fs':>9}")
    for world in worlds:
        got = one_world(base, world, a.warmup, a.saves, 120 + 30 * world)
        for r in range(world):
            fs, al = (got[w][r]["total"] / a.saves for w in WRITERS)
            print(f"{world:>5} {r:>4} {fs:>16.1f} {al:>8.1f} {al / fs:>9.1f}")
            for w in WRITERS if a.top else ():
                print(f"  {w}:", *_top(got[w][r], a.saves, a.top), sep="\n")
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
