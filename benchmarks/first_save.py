"""The first save of a process against the saves after it (issue #25's acceptance).

A training starts: it builds its state, calls ``restore()`` (here: no checkpoint yet), trains for
``--work-s`` seconds (matrix products on the training's threads, not a sleep: staging memory
faulted in the background competes with them, as it would), then saves ``--saves`` times with
``--work-s / 5`` of training between saves. Two ways, alternating, ``--rounds`` times each, in
this one run:

- ``prepared``: ``restore()`` sizes and faults the staging pool in the background
  (``Checkpointer.prepare``, what alpsck does);
- ``unprepared``: the same Checkpointer, no ``restore()``: the first save allocates and faults its
  staging memory while training waits (alpsck before #25).

Prints each round's stalls (the seconds ``save()`` blocks), the first stall / median of the rest,
and the training time the ``--work-s`` took in each way (what the background faulting cost it)::

    python benchmarks/first_save.py --dir /work/bench --gib 1 --rounds 3

``--device cuda`` puts the state and the training's products on the GPU. The saves then take the
pipelined path, and ``prepared`` also registers the pool as pinned memory in the background
(``Stager.pin_ahead``); ``unprepared`` pins it inside the first save (alpsck before stop 38).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import alpsck


def train_for(seconds: float, a: torch.Tensor) -> int:
    """Matrix products for ``seconds``; returns how many ran (the training's throughput)."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)
        if a.is_cuda:
            torch.cuda.synchronize()  # counts products done, not queued
        n += 1
    return n


def one_round(run_dir: Path, gib: float, saves: int, work_s: float, prepared: bool,
              device: str = "cpu") -> dict[str, float | list[float]]:
    n = int(gib * 2**30) // 4 // 8
    state = {f"layer{i}": torch.randn(n, device=device) for i in range(8)}
    a = torch.randn(256, 256, device=device) / 16
    with alpsck.Checkpointer(run_dir, keep_last=2) as ck:
        if prepared:
            ck.restore(state)
        products = train_for(work_s, a)
        stalls = []
        for step in range(1, saves + 1):
            t0 = time.perf_counter()
            h = ck.save(step, state)
            stalls.append(time.perf_counter() - t0)
            train_for(work_s / 5, a)
            h.wait()
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"stalls": stalls, "first_vs_rest": stalls[0] / statistics.median(stalls[1:]), "products": products}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--work-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu", help="where the state lives: cpu (default) or cuda")
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="alpsck-first-save-"))
    results: dict[str, list[dict[str, float | list[float]]]] = {"prepared": [], "unprepared": []}
    for r in range(args.rounds):
        for way in ("unprepared", "prepared") if r % 2 else ("prepared", "unprepared"):
            res = one_round(base / f"{way}-{r}", args.gib, args.saves, args.work_s, way == "prepared", args.device)
            results[way].append(res)
            stalls = " ".join(f"{s:.3f}" for s in res["stalls"])  # type: ignore[union-attr]
            print(f"round {r} {way:>10}: stalls {stalls} s; first/rest {res['first_vs_rest']:.2f}; "
                  f"{res['products']} products in the first {args.work_s:g} s", flush=True)
    for way, rs in results.items():
        ratio = statistics.median(float(x["first_vs_rest"]) for x in rs)  # type: ignore[arg-type]
        prods = statistics.median(float(x["products"]) for x in rs)  # type: ignore[arg-type]
        print(f"{way:>10}: first stall / median of the rest = {ratio:.2f} (median of {len(rs)} rounds); "
              f"training products before the first save: {prods:.0f}")


if __name__ == "__main__":
    main()
