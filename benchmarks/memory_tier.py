"""The memory tier against its peers in the same run (issue #54's targets, on the CPU).

One state of ``--size-gib`` (fp32 tensors of 64 MiB), then, each the median of ``--repeats``:

- ``copy``: a plain copy of the state into preallocated memory (torch's ``copy_``): the floor of any stall;
- ``stall memory`` / ``stall run_dir``: seconds inside ``save(..., tier=...)`` (staging prepared ahead, as
  ``restore()`` or ``prepare()`` does), and ``durable``: until the save's commit;
- ``restore memory`` / ``restore run_dir``: a fresh Checkpointer's ``restore()`` of the same step from each
  tier into the live tensors; the run directory's cold: its files' pages are dropped from the page cache
  first (``posix_fadvise(DONTNEED)``), as on a node that did not write them.

It prints the ratios (stall memory / copy: target at most 1.1; restore run_dir / memory: target at least
10 at 1 GiB) and, with ``--json``, everything as one JSON document::

    python benchmarks/memory_tier.py --dir /work/bench --size-gib 1 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the run directory goes (removed afterwards)")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.repeats < 1 or not 0 < args.size_gib <= 64:
        ap.error("--repeats must be at least 1 and --size-gib in (0, 64]")

    import torch

    from alpsck import Checkpointer
    from alpsck.bench.methods import drop_page_cache
    from alpsck.store import memory_tier

    shm = Path(tempfile.mkdtemp(prefix="alpsck-bench-", dir=os.environ.get(memory_tier.ROOT_ENV) or "/dev/shm"))
    os.environ[memory_tier.ROOT_ENV] = str(shm)  # the bench's own memory root, removed at the end
    run = args.dir / f"memory-tier-bench-{os.getpid()}"
    chunk = 16 << 20  # fp32 elements: 64 MiB tensors
    n = max(1, round(args.size_gib * (1 << 30) / (4 * chunk)))
    state: dict[str, Any] = {f"t{i}": torch.randn(chunk) for i in range(n)}
    size = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"state_bytes": size, "repeats": args.repeats, "cpus": os.cpu_count()}
    try:
        dst = {k: torch.empty_like(t) for k, t in state.items()}
        copies = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for k, t in state.items():
                dst[k].copy_(t)
            copies.append(time.perf_counter() - t0)
        del dst
        out["copy_s"] = statistics.median(copies)
        step = 0
        with Checkpointer(run, memory=True, keep_last=1) as ck:
            ck.prepare(state)
            ck.save(step, state).wait()  # faults in both engines' staging before the timed saves
            ck.save(step + 1, state, tier="memory").wait()
            step = 1
            for tier in ("memory", "run_dir"):
                stalls, durables = [], []
                for _ in range(args.repeats):
                    step += 1
                    t0 = time.perf_counter()
                    handle = ck.save(step, state, tier=tier)
                    stalls.append(time.perf_counter() - t0)
                    handle.wait()
                    durables.append(time.perf_counter() - t0)
                out[f"stall_{tier}_s"] = statistics.median(stalls)
                out[f"durable_{tier}_s"] = statistics.median(durables)
            ck.save(step + 1, state).wait()  # the same step in both tiers: the restores read the same bytes
            ck.save(step + 1, state, tier="memory").wait()
        for tier in ("memory", "run_dir"):
            times = []
            for _ in range(args.repeats):
                if tier == "run_dir":
                    drop_page_cache(run, write_back=True)
                with Checkpointer(run, memory=tier == "memory") as ck:
                    t0 = time.perf_counter()
                    got = ck.restore(state)
                    times.append(time.perf_counter() - t0)
                    assert got == step + 1 and ck.restored_tier == tier, (got, ck.restored_tier)
            out[f"restore_{tier}_s"] = statistics.median(times)
    finally:
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    out["stall_memory_vs_copy"] = out["stall_memory_s"] / out["copy_s"]
    out["restore_run_dir_vs_memory"] = out["restore_run_dir_s"] / out["restore_memory_s"]
    if args.json:
        print(json.dumps(out, indent=2))
        return
    gib = size / (1 << 30)
    print(f"state {gib:.2f} GiB, median of {args.repeats}, {os.cpu_count()} CPUs")
    print(f"  plain copy        {out['copy_s']:.3f} s")
    for tier in ("memory", "run_dir"):
        print(f"  save {tier:8s}     stall {out[f'stall_{tier}_s']:.3f} s, durable {out[f'durable_{tier}_s']:.3f} s")
    for tier in ("memory", "run_dir"):
        print(f"  restore {tier:8s}  {out[f'restore_{tier}_s']:.3f} s ({gib / out[f'restore_{tier}_s']:.2f} GiB/s)")
    print(f"  stall memory / copy {out['stall_memory_vs_copy']:.2f}; restore run_dir / memory "
          f"{out['restore_run_dir_vs_memory']:.1f}x")


if __name__ == "__main__":
    main()
