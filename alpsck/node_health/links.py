"""The links between the nodes, timed (``health.min_link_gbps``): one task per node in one job step joins a gloo
group, and the tasks pass a buffer of ``mib`` MiB round a ring (task ``r`` sends to ``r+1`` and receives from
``r-1``, all at once), three times after a barrier each; each task reports the rate of its incoming link, from the
median round (:func:`main`, one JSON line). A slow node slows both of its links in the ring: the one into it and
the one out of it (:func:`slow_nodes`, in the health gate). Host memory over TCP, as the memory tier's replica
travels; NCCL's links between GPUs are not probed here yet.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

from ..job_env import JobEnv, rendezvous_port
from .checks import node_name

CODE = "import sys; del sys.path[0]; from alpsck.node_health.links import main; sys.exit(main(sys.argv[1:]))"
ROUNDS = 3


def main(argv: list[str]) -> int:
    """``MASTER MIB TIMEOUT_S``: this task's incoming link, as ``{"node", "rank", "gbps", "seconds"}``."""
    if len(argv) != 3:
        print("usage: links MASTER MIB TIMEOUT_S", file=sys.stderr)
        return 2
    master, mib, timeout_s = argv[0], int(argv[1]), float(argv[2])
    job = JobEnv.detect()  # one task per node of the probe's step; each gate (each attempt) meets on a new port
    rank, world = job.rank, job.world_size
    import torch
    import torch.distributed as dist

    at = rendezvous_port("alpsck-links", job.slurm_job_id, job.attempt)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{at}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        out = torch.zeros(mib << 20, dtype=torch.uint8)
        got = torch.empty_like(out)
        took = []
        for _ in range(ROUNDS):
            dist.barrier()
            t0 = time.monotonic()
            sent, received = dist.isend(out, (rank + 1) % world), dist.irecv(got, (rank - 1) % world)
            assert sent is not None and received is not None  # None only for a rank outside the group
            received.wait()
            took.append(time.monotonic() - t0)
            sent.wait()
        seconds = statistics.median(took)
        print(json.dumps({"node": node_name(), "rank": rank, "gbps": round(out.numel() * 8 / seconds / 1e9, 3),
                          "seconds": round(seconds, 4)}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def slow_nodes(rates: list[tuple[str, float]], min_gbps: float) -> dict[str, str]:
    """The nodes to blame, from each task's incoming rate in ring order (``rates[i]``: node ``i`` and the rate of
    the link from node ``i-1``): a node both of whose links (in from ``i-1``, out to ``i+1``) run below
    ``min_gbps``, with why. Two nodes share both links, so neither is blamed there (nor one link's slowness alone)."""
    k = len(rates)
    if k < 3:
        return {}
    out = {}
    for i, (node, into) in enumerate(rates):
        prev_node = rates[i - 1][0]
        nxt_node, out_rate = rates[(i + 1) % k]
        if into < min_gbps and out_rate < min_gbps:
            out[node] = (f"its links run below min_link_gbps {min_gbps:g}: {into:.3g} Gbit/s in from {prev_node}, "
                         f"{out_rate:.3g} Gbit/s out to {nxt_node}")
    return out
