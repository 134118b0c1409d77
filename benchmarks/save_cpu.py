"""Where the CPU of one save goes, on the reference training's state (issue #25).

Builds the overhead bench's reference model (a 14 M-parameter Llama, 167 MB of fp32 weights and
AdamW moments), trains 3 steps so the optimizer has its state, then takes ``--saves`` checkpoints
with the training idle, each waited to durable before the next. Per save it reports the median of:

- ``stall``: seconds inside ``save()``;
- ``caller CPU``: CPU seconds of the calling thread inside ``save()`` (Python's walk of the state,
  its share of the snapshot copy);
- ``other CPU``: CPU seconds of every other thread of the process from the call to durable (the
  second copy thread, the writers, the committer);
- ``durable``: seconds from the call to the fsync'ed commit.

On a node whose cores all train (checkpointing every iteration on a small machine), the CPU a save
takes comes out of the training; unlike wall times on a shared VM it hardly drifts between runs, so
two builds compare in back-to-back runs (``PYTHONPATH=<other build>`` for the second)::

    python benchmarks/save_cpu.py --dir /work/bench --saves 20
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the run directory goes (removed afterwards)")
    ap.add_argument("--saves", type=int, default=20, help="timed saves (after one untimed)")
    args = ap.parse_args()
    if args.saves < 1:
        ap.error("--saves must be at least 1")

    from alpsck import Checkpointer
    from alpsck.bench.overhead import OverheadConfig, _Training
    from alpsck.bench.run import process_cpu_seconds

    training = _Training(OverheadConfig(), 1000)
    for _ in range(3):
        training.step()
    run_dir = args.dir / "save-cpu"
    shutil.rmtree(run_dir, ignore_errors=True)
    stall, caller, other, durable = [], [], [], []
    try:
        with Checkpointer(run_dir, max_in_flight=2, keep_last=3) as ck:
            ck.save(1, training.state).wait()
            for step in range(2, 2 + args.saves):
                p0, t0, w0 = process_cpu_seconds(), time.thread_time(), time.perf_counter()
                h = ck.save(step, training.state)
                w1, t1 = time.perf_counter(), time.thread_time()
                h.wait()
                p1 = process_cpu_seconds()
                stall.append(w1 - w0)
                caller.append(t1 - t0)
                other.append((p1 - p0) - (t1 - t0))  # the caller only blocks in wait(): its CPU there is ~0
                durable.append(float(h.result()["durable_seconds"]))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    def ms(xs: list[float]) -> str:
        return f"{statistics.median(xs) * 1e3:.1f} ms"

    nbytes = training.state_bytes()
    print(f"reference state {nbytes / 1e6:.0f} MB, {args.saves} saves (medians): stall {ms(stall)}, "
          f"caller CPU {ms(caller)}, other CPU {ms(other)}, total CPU "
          f"{statistics.median(c + o for c, o in zip(caller, other, strict=True)) * 1e3:.1f} ms, durable {ms(durable)}")


if __name__ == "__main__":
    main()
