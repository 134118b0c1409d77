"""Every-iteration checkpointing without a snapshot copy: measured against the default, and worse here (issue #25).

The idea: a save needs no copy if the training cannot change the bytes while they are written.
Weights and AdamW moments change only inside ``optimizer.step()``, so a save taken after a step
can be written straight from the live tensors while the next forward and backward run, if a step
pre-hook waits for the writes before the optimizer touches them. O_DIRECT needs 512-byte aligned
memory, and torch's CPU tensors sit at 64 bytes past a page boundary, so this experiment first
moves every parameter and optimizer moment into one page-aligned arena (``p.data`` and the
optimizer's state point into it) and saves the arena as one extent in the core's zero-copy mode.
The copy leaves the critical path; the CRC32C of the state moves to the writers, which read it
cold from memory while training runs beside them.

``default`` is :class:`alpsck.Checkpointer` as shipped (the snapshot copy with the CRC inside it).
Each variant runs in its own process, alternately, with the same reference training as
``alpsck bench --overhead``: a checkpoint after every iteration in blocks of ``--block``
iterations, paired with blocks without, so the machine's drift cancels. Per run it prints the
median overhead over the pairs, their spread and the median stall inside ``save()``::

    python benchmarks/zero_copy_arena.py --dir /work/bench --runs 2 --pairs 6

Only the arena's tensors are saved in the ``arena`` variant (not the scheduler, RNG or data
position): it is an upper bound on what the approach could gain, not a checkpointer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VARIANTS = ("arena", "default")


def rehome(model: Any, opt: Any, align: int = 4096) -> Any:
    """Moves parameters and tensor optimizer state into one page-aligned uint8 arena; returns it."""
    import torch

    owners: list[tuple[Any, str | None]] = []  # (parameter, None) or (parameter, state key)
    for p in model.parameters():
        owners.append((p, None))
        owners += [(p, k) for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.dim() > 0]

    def get(p: Any, k: str | None) -> Any:
        return p.data if k is None else opt.state[p][k]

    offsets, end = [], 0
    for p, k in owners:
        offsets.append(end)
        end += -(-get(p, k).nbytes // align) * align
    raw = torch.zeros(end + align, dtype=torch.uint8)
    start = -raw.data_ptr() % align
    arena = raw[start:start + end]
    for (p, k), off in zip(owners, offsets, strict=True):
        t = get(p, k)
        view = arena[off:off + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        if k is None:
            p.data = view
        else:
            opt.state[p][k] = view
    return arena


def run_variant(variant: str, root: Path, pairs: int, block: int, dim: int = 512, layers: int = 4) -> str:
    import torch

    from alpsck import Checkpointer, _core
    from alpsck.bench.overhead import OverheadConfig, _Training

    torch.set_num_threads(os.cpu_count() or 1)
    tr = _Training(OverheadConfig(dim=dim, n_layers=layers), 1_000_000)
    for _ in range(3):
        tr.step()
    run_dir = root / f"arena-{variant}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    save: Callable[[int], None]
    drain: Callable[[], None]
    if variant == "arena":
        arena = rehome(tr.model, tr.opt)
        lock = _core.RunDirLock(str(run_dir), 0, "{}")
        engine = _core.Engine(str(run_dir), {"keep_last": 3}, one_history=True)
        pending: list[Any] = []

        def before_step(*_: Any) -> None:  # the optimizer may change the arena once it is written
            while pending:
                pending.pop().wait()

        tr.opt.register_step_pre_hook(before_step)

        def save(step: int) -> None:
            pending.append(engine.save(step, [("arena", arena)], "{}", "zerocopy", arena))

        def drain() -> None:
            before_step()
            engine.wait_all()
    else:
        ck = Checkpointer(run_dir, max_in_flight=2, keep_last=3)

        def save(step: int) -> None:
            ck.save(step, tr.state)

        def drain() -> None:
            ck.wait()

    step = 1
    save(step)  # the one-time costs (staging, files) before the timed blocks
    drain()

    def timed_block(checkpoint: bool) -> tuple[float, float]:
        nonlocal step
        stall = 0.0
        t0 = time.perf_counter()
        for _ in range(block):
            tr.step()
            step += 1
            if checkpoint:
                s0 = time.perf_counter()
                save(step)
                stall += time.perf_counter() - s0
        drain()
        return time.perf_counter() - t0, stall / block

    overheads, stalls, its = [], [], []
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        r = {on: timed_block(on) for on in order}
        overheads.append(100 * (1 - r[False][0] / r[True][0]))
        stalls.append(r[True][1])
        its.append(r[False][0] / block)
    if variant == "arena":
        engine.close()
        lock.release()
    else:
        ck.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    return (f"{variant:8} overhead {statistics.median(overheads):5.1f} % (pairs {min(overheads):.1f}..{max(overheads):.1f})"
            f"  stall {1e3 * statistics.median(stalls):6.2f} ms  iteration {statistics.median(its):.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the run directories go (removed afterwards)")
    ap.add_argument("--runs", type=int, default=2, help="runs of each variant, alternating")
    ap.add_argument("--pairs", type=int, default=6, help="pairs of blocks (with, without checkpoints) per run")
    ap.add_argument("--block", type=int, default=20, help="iterations per block")
    ap.add_argument("--dim", type=int, default=512, help="model width (the overhead benchmark's default: ~170 MB of state)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in this process
    args = ap.parse_args()
    if min(args.runs, args.pairs, args.block, args.dim, args.layers) < 1:
        ap.error("--runs, --pairs, --block, --dim and --layers must be at least 1")
    if args.variant:
        print(run_variant(args.variant, args.dir, args.pairs, args.block, args.dim, args.layers), flush=True)
        return
    for r in range(args.runs):
        for v in VARIANTS:
            cmd = [sys.executable, __file__, "--dir", str(args.dir), "--pairs", str(args.pairs),
                   "--block", str(args.block), "--dim", str(args.dim), "--layers", str(args.layers), "--variant", v]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            print(f"run {r + 1}: {out.strip()}", flush=True)


if __name__ == "__main__":
    main()
