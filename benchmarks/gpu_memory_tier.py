"""The memory tier on a real GPU, against its peers in the same run: what a save to node memory costs the
training, and how fast a restart reads its state back into the GPU from memory and from the run directory.

The training of ``gpu_staging.py`` (``--layers`` Linear(``--width``) in fp32 + AdamW on the GPU). Each way
of saving has a Checkpointer of its own (``memory=True``), ``--repeats`` saves, medians:

- ``run_dir``: ``save(step, state)``, the pipelined path to the run directory;
- ``memory``: ``save(step, state, tier="memory")``, the same path into the memory tier's engine;
- ``memory blocking``: the same with ``overlap_copy=False``: every tensor copied to pageable host memory
  inside ``save()`` (how the memory tier saved GPU states before it had a stager of its own);

each with ``stall`` (seconds inside ``save()``), ``felt`` (stall + the next iteration's extra time: its
optimizer step waits for the copy of the weights and moments) and ``durable`` (until the commit), against
the floor: a copy of every tensor into one pinned buffer (``pinned D2H``).

Restores into the live CUDA model and optimizer of the same step held in both tiers: from memory (the
memory tier's files in ``/dev/shm``), from the run directory with its pages dropped from the page cache
first (root: ``drop_caches``; said in the output when it could not), against a pinned host-to-device copy.

    python benchmarks/gpu_memory_tier.py --dir /tmp/bench --layers 24 --width 4096 --repeats 3 --json out.json

The memory root is ``ALPSCK_MEMORY_ROOT`` or ``/dev/shm`` (a bench directory of its own inside it, removed
at the end); it must hold three copies of the state (one kept, one in flight, and the restore's).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpu_staging import drop_caches, parse_args, pinned_copier, sync_time, synchronize, training

WAYS = {"run_dir": ({}, "run_dir"), "memory": ({}, "memory"), "memory blocking": ({"overlap_copy": False}, "memory")}


def main() -> None:
    args = parse_args(__doc__)

    import alpsck
    from alpsck.store import memory_tier

    dev = torch.device(args.device)
    model, opt, iteration, tensors = training(args.layers, args.width, args.tokens, dev)
    state = {"model": model, "optim": opt}
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    root = Path(os.environ.get(memory_tier.ROOT_ENV) or "/dev/shm")
    free = shutil.disk_usage(root).free
    print(f"memory root {root}: {free / 2**30:.1f} GiB free", flush=True)
    if free < 3.2 * nbytes:
        raise SystemExit(f"{root} has {free / 2**30:.1f} GiB free, the bench needs {3.2 * nbytes / 2**30:.1f} GiB "
                         f"(set {memory_tier.ROOT_ENV} to a larger tmpfs)")
    shm = Path(tempfile.mkdtemp(prefix="alpsck-gpu-bench-", dir=root))
    os.environ[memory_tier.ROOT_ENV] = str(shm)
    pinned_d2h, pinned_h2d = pinned_copier(tensors, dev)
    res: dict[str, list[float]] = {"iter": [], "pinned_d2h": [], "pinned_h2d": [], "restore_memory": [],
                                   "restore_run_dir": []}
    for way, (kwargs, tier) in WAYS.items():
        run = args.dir / f"gpu-memory-tier-{way.replace(' ', '-')}"
        shutil.rmtree(run, ignore_errors=True)
        for key in ("stall", "felt", "durable"):
            res[f"{way} {key}"] = []
        with alpsck.Checkpointer(run, memory=True, keep_last=1, **kwargs) as ck:
            ck.restore(state)  # nothing to restore: prepares (sizes, faults and pins the staging pools)
            ck.save(0, state, tier=tier).wait()  # the first save: the pools may still be faulting or pinning
            for r in range(1, args.repeats + 1):
                res["iter"].append(sync_time(iteration))
                res["pinned_d2h"].append(sync_time(pinned_d2h))
                synchronize()
                t0 = time.perf_counter()
                h = ck.save(r, state, tier=tier)
                stall = time.perf_counter() - t0
                nxt = sync_time(iteration)
                h.wait()
                res[f"{way} stall"].append(stall)
                res[f"{way} felt"].append(stall + nxt - res["iter"][-1])
                res[f"{way} durable"].append(time.perf_counter() - t0)
                print(f"{way}: stall {stall:.3f} s, next iter {nxt:.3f} s (alone {res['iter'][-1]:.3f} s), "
                      f"durable {res[f'{way} durable'][-1]:.2f} s; pinned D2H {res['pinned_d2h'][-1]:.3f} s", flush=True)
            if way == "run_dir":  # the same step in both tiers: the restores read the same bytes
                last = args.repeats + 1
                ck.save(last, state).wait()
                ck.save(last, state, tier="memory").wait()
        if way != "run_dir":
            shutil.rmtree(run, ignore_errors=True)
    run = args.dir / "gpu-memory-tier-run_dir"
    dropped = True
    for _ in range(args.repeats):
        res["pinned_h2d"].append(sync_time(pinned_h2d))
        for tier in ("memory", "run_dir"):
            if tier == "run_dir":
                dropped &= drop_caches()
            with alpsck.Checkpointer(run, memory=tier == "memory") as ck:
                res[f"restore_{tier}"].append(sync_time(lambda ck=ck: ck.restore(state)))
                assert ck.restored_tier == tier, (tier, ck.restored_tier)
        print(f"restore to the GPU: from memory {res['restore_memory'][-1]:.2f} s, from the run directory "
              f"{res['restore_run_dir'][-1]:.2f} s; pinned H2D {res['pinned_h2d'][-1]:.3f} s", flush=True)
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in res.items() if v}
    gib = nbytes / 2**30
    print(f"\nmedians of {args.repeats}, state {gib:.2f} GiB; iteration {med['iter']:.3f} s; pinned D2H "
          f"{med['pinned_d2h']:.3f} s, H2D {med['pinned_h2d']:.3f} s")
    for way in WAYS:
        print(f"  {way:16s} stall {med[f'{way} stall']:.4f} s, felt {med[f'{way} felt']:.3f} s "
              f"({med[f'{way} felt'] / med['pinned_d2h']:.2f}x the pinned copy), durable {med[f'{way} durable']:.2f} s")
    page = "its pages dropped" if dropped else "page cache NOT dropped"
    print(f"  restore: from memory {med['restore_memory']:.2f} s ({gib / med['restore_memory']:.2f} GiB/s), from the "
          f"run directory ({page}) {med['restore_run_dir']:.2f} s ({gib / med['restore_run_dir']:.2f} GiB/s): "
          f"{med['restore_run_dir'] / med['restore_memory']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps({"bytes": nbytes, "device": str(dev), "dropped": dropped, "medians": med,
                                         "all": res}, indent=1))


if __name__ == "__main__":
    main()
