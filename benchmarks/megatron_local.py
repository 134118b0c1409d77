"""Megatron-LM's local checkpoints (``--non-persistent-ckpt-type local``): alpsck's ``AlpsckLocalCheckpointManager``
against nvidia-resiliency-ext's ``LocalCheckpointManager`` (what Megatron-LM's ``pretrain`` makes), in the same run.

Each rank holds its part of a state of float32 CPU tensors (16 of equal size in all, random values, as
``ShardedTensor`` s of a global tensor each), made into a ``MCoreTensorAwareStateDict`` (algorithm ``atomic``) as
Megatron-LM's ``save_checkpoint`` makes it. Two places, each with its own pair:

- ``disk``: nvidia's manager (``torch.save`` of each rank's part into ``DIR``, renamed into place, never fsync'ed)
  against alpsck's directory per rank in ``DIR`` (O_DIRECT, fsync'ed, committed);
- ``memory``: nvidia's manager in ``SHM`` (a tmpfs, ``/dev/shm`` by default) against alpsck's memory tier
  (``memory=True``, its root ``SHM``: node shared memory, committed by the node's ranks; with one node no replica).

``save``: seconds in ``manager.save(state, iteration)``, synchronous (both return once the checkpoint is complete
and every rank agreed), one manager per method and place kept open as a training keeps it, the methods taking
turns, an untimed ``os.sync()`` before each. ``load``: then, as a restart does, a new manager's ``find_latest()``
and ``load()`` of the last iteration saved; on ``disk`` nvidia's files are first dropped from the page cache
(fsync'ed, then ``posix_fadvise(DONTNEED)``): alpsck's are never in it (O_DIRECT). One untimed warm-up repetition
of each (its loads checked to give back the values saved, through ``MCoreTensorAwareStateDict.to_state_dict``, as
Megatron-LM loads them), then 21 timed ones up to 16 MiB, 5 up to 512 MiB, 3 above (``--reps``). Seconds on
rank 0 after a barrier; the table gives the medians and alpsck/nvidia (below 1.0: alpsck faster)::

    PYTHONPATH=. python benchmarks/megatron_local.py --dir /tmp/mlbench [--shm /dev/shm] [--sizes 2MiB,300MiB] [--ranks 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench_common import alpsck_version, default_reps, fmt, load_average, parse_size, run_workers, size_name

from alpsck.job_env import free_port

TENSORS = 16
METHODS = ("nvidia", "alpsck")
PLACES = ("disk", "memory")
MEASURES = ("save", "load")


def _state(rank: int, world: int, nbytes: int, fill: bool) -> tuple[dict[str, Any], list[Any]]:
    """This rank's sharded state (the tensors random with ``fill``, else zeros: a template to load into) and
    its tensors."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    n = nbytes // TENSORS // 4 // world
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.rand(n, generator=g) if fill else torch.zeros(n) for _ in range(TENSORS)]
    model = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", t, (0, rank, world)) for i, t in enumerate(tensors)}
    return {"model": model, "iteration": 0}, tensors


def _manager(method: str, place: str, root: Path, shm: Path) -> Any:
    if method == "nvidia":
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

        return LocalCheckpointManager(str((root if place == "disk" else shm) / "nvidia"))
    from alpsck.integrations.megatron_local import AlpsckLocalCheckpointManager

    return AlpsckLocalCheckpointManager(root / f"alpsck-{place}", memory=place == "memory")


def _close(manager: Any) -> None:
    close = getattr(manager, "close", None)
    if close is not None:
        close()


def run_rank(rank: int, world: int, port: int, nbytes: int, reps: int, root: Path, shm: Path, out: Path) -> None:
    """Saves first, each method and place with one manager kept open (as a training keeps it), the methods taking
    turns; then loads, each by a new manager (as a restart makes it), the last iteration saved."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), ALPSCK_MEMORY_ROOT=str(shm))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from alpsck.bench.methods import drop_page_cache

    state, saved = _state(rank, world, nbytes, fill=True)
    times: dict[str, dict[str, dict[str, list[float]]]] = {
        p: {m: {x: [] for x in MEASURES} for m in METHODS} for p in PLACES}
    savers = {(m, p): _manager(m, p, root, shm) for m in METHODS for p in PLACES}
    for rep in range(reps + 1):  # rep 0: the warm-up
        for place in PLACES:
            for method in (METHODS if rep % 2 == 0 else METHODS[::-1]):
                tasd, _ = MCoreTensorAwareStateDict.from_state_dict({**state, "iteration": rep + 1}, algo="atomic")
                if rank == 0:
                    os.sync()
                dist.barrier()
                t0 = time.perf_counter()
                savers[method, place].save(tasd, rep + 1)
                dist.barrier()
                if rep:
                    times[place][method]["save"].append(time.perf_counter() - t0)
    for manager in savers.values():
        _close(manager)
    for rep in range(reps + 1):
        for place in PLACES:
            for method in (METHODS if rep % 2 == 0 else METHODS[::-1]):
                if method == "nvidia" and place == "disk":  # its files as a restart on another node finds them
                    for f in (root / "nvidia").rglob("*.pt"):
                        fd = os.open(f, os.O_RDONLY)
                        os.fsync(fd)
                        os.close(fd)
                        drop_page_cache(f)
                dist.barrier()
                t0 = time.perf_counter()
                manager = _manager(method, place, root, shm)
                found = manager.find_latest()
                loaded, _name = manager.load()
                dist.barrier()
                if rep:
                    times[place][method]["load"].append(time.perf_counter() - t0)
                if found != reps + 1:
                    raise SystemExit(f"{method} {place}: find_latest() is {found}, not {reps + 1}")
                if rep == 0:  # what comes back is what was saved, as Megatron-LM loads it
                    template, _ = _state(rank, world, nbytes, fill=False)
                    got = loaded.to_state_dict(template, algo="atomic")
                    for i, t in enumerate(saved):
                        if not torch.equal(got["model"][f"w{i}"], t):
                            raise SystemExit(f"{method} {place}: tensor w{i} came back with other values")
                _close(manager)
                del loaded
    if rank == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def run_cell(nbytes: int, world: int, reps: int, root: Path, shm: Path, timeout_s: float) -> dict[str, Any]:
    cell, cell_shm = root / f"{size_name(nbytes)}-r{world}", shm / f"alpsck-megatron-local-bench-{os.getpid()}"
    for d in (cell, cell_shm):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    out = root / f"{size_name(nbytes)}-r{world}.json"
    port = free_port()
    result = run_workers([[sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(r), "--world",
                           str(world), "--port", str(port), "--bytes", str(nbytes), "--reps", str(reps), "--dir",
                           str(cell), "--shm", str(cell_shm), "--out", str(out)] for r in range(world)], out, timeout_s)
    for d in (cell, cell_shm):
        shutil.rmtree(d, ignore_errors=True)
    return result


def table(results: list[tuple[int, int, int, dict[str, Any]]]) -> list[str]:
    head = (f"{'size':>7} {'ranks':>5} {'place':<6} {'measure':<7} {'reps':>4}  {'nvidia median':>13}  "
            f"{'alpsck median':>13}  {'alpsck/nvidia':>13}")
    lines = [head, "-" * len(head)]
    for nbytes, world, reps, res in results:
        if "failed" in res:
            lines.append(f"{size_name(nbytes):>7} {world:>5} all    {'':<7} {reps:>4}  FAILED: {res['failed']}")
            continue
        for place in PLACES:
            for measure in MEASURES:
                nv, al = (statistics.median(res[place][m][measure]) for m in METHODS)
                lines.append(f"{size_name(nbytes):>7} {world:>5} {place:<6} {measure:<7} {reps:>4}  {fmt(nv):>13}  "
                             f"{fmt(al):>13}  {al / nv:>13.2f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the disk checkpoints go (removed as it goes)")
    ap.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="the memory place: a tmpfs")
    ap.add_argument("--sizes", default="2MiB,300MiB", help="total state sizes, across the ranks")
    ap.add_argument("--ranks", default="1,2", help="rank counts (a gloo group on 127.0.0.1)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per cell (default 21/5/3 by size)")
    ap.add_argument("--cell-timeout", type=float, default=900.0, help="seconds one cell may take")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_rank(args.rank, args.world, args.port, args.bytes, args.reps, args.dir, args.shm, args.out)
        return
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    if not sizes or not ranks or any(r < 1 for r in ranks) or any(s % (TENSORS * 4 * max(ranks)) for s in sizes):
        ap.error(f"--sizes and --ranks need a value each; a size must split into {TENSORS} float32 tensors per rank")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")
    import torch

    header = [f"# torch {torch.__version__}, {os.cpu_count()} CPUs, alpsck {alpsck_version()}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {load_average()}",
              f"# command: {shlex.join(['python', *sys.argv])}",
              "# seconds on rank 0 after a barrier, medians of the timed reps (after one warm-up whose loads are"
              " checked); alpsck/nvidia (< 1: alpsck faster)",
              "# save: manager.save(state, iteration), synchronous; load: a new manager's find_latest() and load()"
              " (disk: nvidia's files dropped from the page cache first; alpsck reads O_DIRECT)"]
    print("\n".join(header), flush=True)
    results: list[tuple[int, int, int, dict[str, Any]]] = []
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for world in ranks:
        for nbytes in sizes:
            reps = args.reps or default_reps(nbytes)
            print(f"cell {size_name(nbytes)} x {world} rank(s), {reps} reps ...", file=sys.stderr, flush=True)
            results.append((nbytes, world, reps, run_cell(nbytes, world, reps, args.dir, args.shm, args.cell_timeout)))
    lines = [*header, *table(results), f"# wall time {time.monotonic() - t0:.0f} s, load average {load_average()} at the end"]
    print("\n".join(lines[len(header):]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
