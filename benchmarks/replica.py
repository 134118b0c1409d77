"""The replica ring's copy rate against the raw rate of the same link, in the same run (issue #54's target).

Two processes stand for two nodes of one rank each (gloo over TCP; on one machine: loopback, each process its
own memory root, as tests/ranks/test_memory_tier_ranks.py does). Each holds ``--size-gib`` of fp32 tensors and,
each the median of ``--repeats``:

- ``raw``: one ``dist.send``/``dist.recv`` of a buffer of the state's size each way at once (isend + recv),
  between the same two processes, over another gloo group: the link's rate as gloo gives it;
- ``raw fresh``: the same into a receive buffer allocated for it (its pages faulted in as the bytes arrive, as
  a replica's new pages in a tmpfs are);
- ``replica``: ``save(step, state, tier="memory")`` then ``wait()``, which returns once the node's checkpoint
  is committed and the replica ring has sent it to the other node and received the other's
  (``Replicator.copies``: the exchange's own seconds);
- ``stall``: seconds inside that ``save()`` (the replica is off the training's path).

    python benchmarks/replica.py --dir /work/bench --size-gib 0.5 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def rank_main(rank: int, port: int, run: Path, size: int, repeats: int, out: Path) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
                       "ALPSCK_MEMORY_ROOT": str(run.parent / f"node-{rank}"), "ALPSCK_NODE": f"node-{rank}"})
    import torch
    import torch.distributed as dist

    from alpsck import Checkpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    other = 1 - rank
    state = {"w": [torch.randn(16 << 20) for _ in range(max(1, size // (64 << 20)))]}
    nbytes = sum(t.numel() * 4 for t in state["w"])
    raw_group = dist.new_group(backend="gloo")
    buf_out, buf_in = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    raw, fresh, replica, stall = [], [], [], []
    with Checkpointer(run, memory=True) as ck:
        ck.save(0, state, tier="memory")
        ck.wait()  # staging faulted in, the ring's first exchange done
        for i in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            work = dist.isend(buf_out, other, group=raw_group)
            dist.recv(buf_in, other, group=raw_group)
            work.wait()
            raw.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            work = dist.isend(buf_out, other, group=raw_group)
            dist.recv(torch.empty(nbytes, dtype=torch.uint8), other, group=raw_group)
            work.wait()
            fresh.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(i + 1, state, tier="memory")
            stall.append(time.perf_counter() - t0)
            ck.wait()
            rep = ck._memory.replicator if ck._memory is not None else None  # noqa: SLF001 - its record
            replica.append(rep.copies[-1]["seconds"] if rep is not None else float("nan"))
    if rank == 0:
        gib = nbytes / (1 << 30)
        doc = {"gib": gib, "raw_s": statistics.median(raw), "raw_fresh_s": statistics.median(fresh),
               "replica_s": statistics.median(replica),
               "stall_s": statistics.median(stall)}
        doc["raw_gib_s"] = gib / doc["raw_s"]
        doc["replica_gib_s"] = gib / doc["replica_s"]
        doc["replica_over_raw"] = doc["replica_s"] / doc["raw_s"]
        doc["replica_over_raw_fresh"] = doc["replica_s"] / doc["raw_fresh_s"]
        out.write_text(json.dumps(doc))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the run and node memory go (removed afterwards)")
    ap.add_argument("--size-gib", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        return
    import shutil
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="replica-bench-"))
    out = work / "result.json"
    size = int(args.size_gib * (1 << 30))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import replica as r; from pathlib import Path; "
            "r.rank_main(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), "
            "Path(sys.argv[7]))")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent), str(r), str(port),
                                   str(work / "run"), str(size), str(args.repeats), str(out)]) for r in (0, 1)]
        if any(p.wait() != 0 for p in procs):
            sys.exit("a rank failed")
        doc = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{doc['gib']:.2f} GiB per node, medians of {args.repeats}:")
    print(f"  raw gloo exchange   {doc['raw_s']:.3f} s  ({doc['raw_gib_s']:.2f} GiB/s each way)")
    print(f"  raw, fresh memory   {doc['raw_fresh_s']:.3f} s")
    print(f"  replica exchange    {doc['replica_s']:.3f} s  ({doc['replica_gib_s']:.2f} GiB/s each way)")
    print(f"  replica / raw       {doc['replica_over_raw']:.2f}x  (/ raw into fresh memory: "
          f"{doc['replica_over_raw_fresh']:.2f}x)")
    print(f"  save() stall        {doc['stall_s']:.3f} s")
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
