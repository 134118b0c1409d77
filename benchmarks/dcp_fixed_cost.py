"""The fixed cost of a DCP save and load: alpsck's storage backend against DCP's FileSystemWriter/Reader.

Saves and loads a state of float32 CPU tensors (16 of equal size in all, random values; with several
ranks each rank holds its own share, keys prefixed by its rank) through ``torch.distributed.checkpoint``
with ``AlpsckStorageWriter``/``AlpsckStorageReader`` and with DCP's ``FileSystemWriter``/``FileSystemReader``,
a fresh writer or reader per call, every save to a new directory (``DIR/<cell>/<method>/step-<i>``, as
torchtitan names its checkpoints; the older ones are removed as it goes). Per state size, rank count and
backend it reports, on rank 0, after a barrier:

- ``save``: seconds in ``dcp.save`` (both backends return once the data is fsync'ed);
- ``synced``: for FileSystemWriter, its save plus, on rank 0, an fsync of the new checkpoint directory and of
  its parent: FileSystemWriter fsyncs its files but not the names of the files, of ``.metadata`` (renamed into
  place) and of the directory, which a power loss can then take; what making its checkpoint as durable as
  alpsck's costs (framework_io.py's ``synced``, for DCP). For alpsck, its ``save`` again;
- ``stall``: seconds ``dcp.async_save`` blocks its caller before returning the future (the future is then
  waited on, untimed); a backend whose async save fails gets the error's text instead;
- ``cold``: seconds in ``dcp.load`` into preallocated tensors of the right shapes, each checkpoint's files
  first dropped from the page cache (``posix_fadvise(DONTNEED)`` on every file: fsync'ed, so clean): what a
  restart on another node, or after the cache moved on, reads;
- ``load``: the same load again at once: FileSystemWriter's files are then in the page cache (written
  buffered, and just read), while alpsck reads with O_DIRECT (its default) from the device every time.

The backends alternate within each repetition (both save, both async-save, both load; the first one taking
turns from repetition to repetition), so drift hits both, and an untimed ``os.sync()`` before each save
means neither pays for the other's writeback (FileSystemWriter fsyncs its files but not its directories:
without it, the next fsync of a directory, alpsck's, committed them);
each cell (size x ranks) has one untimed warm-up repetition, then 21 timed ones at 2 MiB, 5 at 300 MiB
and 3 at 2 GiB (``--reps`` for all). One rank saves with ``no_dist=True`` (no process group); two ranks
are two processes of this script in a gloo group on 127.0.0.1, one process group per cell; each rank uses
CPUs/ranks torch threads (torchrun's OMP_NUM_THREADS=1 on a 2-CPU machine). The table gives the median and
the minimum of each, and alpsck/fs of the medians (below 1.0: alpsck faster); the header and the last line
give the machine's load average, as other processes' load shows in every time::

    PYTHONPATH=. python benchmarks/dcp_fixed_cost.py --dir /tmp/dcpbench [--sizes 2MiB,300MiB,2GiB] [--ranks 1,2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench_common import alpsck_version, default_reps, fmt, load_average, parse_size, run_workers, size_name

from alpsck.job_env import free_port

METHODS = ("fs", "alpsck")
MEASURES = ("save", "synced", "stall", "load", "cold")
TENSORS = 16  # in all, across the ranks


# ------------------------------------------------------------------------------ one rank of one cell


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:200] if text else type(e).__name__


def run_rank(rank: int, world: int, port: int, nbytes: int, reps: int, root: Path, out: Path | None) -> None:
    """One rank of one cell: the warm-up repetition, then ``reps`` timed ones; rank 0 writes ``out`` (JSON)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

    from alpsck.bench.methods import drop_page_cache
    from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter
    from alpsck.store.durable import fsync_path

    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    no_dist = world == 1
    if not no_dist:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))

    def barrier() -> None:
        if not no_dist:
            dist.barrier()

    def writer(method: str, path: Path) -> StorageWriter:
        return AlpsckStorageWriter(path) if method == "alpsck" else FileSystemWriter(path)

    def reader(method: str, path: Path) -> StorageReader:
        return AlpsckStorageReader(path) if method == "alpsck" else FileSystemReader(path)

    def save(method: str, path: Path) -> None:
        dcp.save(state, checkpoint_id=path, storage_writer=writer(method, path), no_dist=no_dist)

    def async_save(method: str, path: Path) -> Any:
        return dcp.async_save(state, checkpoint_id=path, storage_writer=writer(method, path), no_dist=no_dist)

    def load(method: str, path: Path) -> None:
        dcp.load(into, checkpoint_id=path, storage_reader=reader(method, path), no_dist=no_dist)

    per_rank = TENSORS // world
    numel = nbytes // TENSORS // 4
    torch.manual_seed(rank)
    state = {f"rank{rank}.t{i:02d}": torch.randn(numel) for i in range(per_rank)}
    into = {k: torch.zeros(numel) for k in state}  # faulted in now, not in the first load
    counter = {m: 0 for m in METHODS}
    times: dict[str, dict[str, list[float]]] = {m: {x: [] for x in MEASURES} for m in METHODS}
    errors: dict[str, dict[str, str]] = {m: {} for m in METHODS}

    def new_dir(method: str) -> Path:
        counter[method] += 1
        return root / method / f"step-{counter[method]}"

    def remove(path: Path) -> None:
        barrier()  # every rank is done with it
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def evict(path: Path) -> None:
        """Drop every file of a checkpoint from the page cache (their pages are clean: both backends fsync)."""
        drop_page_cache(path)
        barrier()

    def timed(fn: Callable[[], Any], *, sync: bool = False) -> tuple[float, Any]:
        if sync:  # neither backend pays for what the other left to write back (FileSystemWriter's directories)
            os.sync()
        barrier()
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result

    for rep in range(reps + 1):
        record = rep > 0  # rep 0: the warm-up
        saved: dict[str, Path] = {}
        order = METHODS if rep % 2 else METHODS[::-1]  # the first one takes turns
        for method in order:  # save
            path = new_dir(method)
            seconds, _ = timed(functools.partial(save, method, path), sync=True)
            synced = seconds
            if method == "fs" and rank == 0:  # its directory entries, which it leaves unsynced
                t0 = time.perf_counter()
                for d in (path, path.parent):
                    fsync_path(d)
                synced += time.perf_counter() - t0
            saved[method] = path
            if record:
                times[method]["save"].append(seconds)
                times[method]["synced"].append(synced)
        for method in order:  # stall of async_save
            path = new_dir(method)
            try:
                seconds, fut = timed(functools.partial(async_save, method, path), sync=True)
                fut.result()
                if record:
                    times[method]["stall"].append(seconds)
            except Exception as e:  # recorded in the table; the other measures go on
                errors[method].setdefault("stall", _error_text(e))
            remove(path)
        for method in order:  # loads of the synchronous save: from the device, then again at once
            for measure in ("cold", "load"):
                if measure == "cold":
                    evict(saved[method])
                for t in into.values():
                    t.zero_()
                seconds, _ = timed(functools.partial(load, method, saved[method]))
                if record:
                    times[method][measure].append(seconds)
                elif any(not torch.equal(into[k], state[k]) for k in state):
                    raise SystemExit(f"rank {rank}: {method} loaded other values than it saved")
            remove(saved[method])
        if rank == 0:
            print(f"  {size_name(nbytes)} x {world} rank(s): rep {rep}{'' if record else ' (warm-up)'} done",
                  file=sys.stderr, flush=True)

    barrier()
    if rank == 0 and out is not None:
        out.write_text(json.dumps({"times": times, "errors": errors}))
    if not no_dist:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ the driver


def run_cell(nbytes: int, world: int, reps: int, root: Path, timeout_s: float) -> dict[str, Any]:
    """One cell in ``world`` fresh processes of this script (their own process group); rank 0's JSON."""
    cell = root / f"{size_name(nbytes)}-r{world}"
    shutil.rmtree(cell, ignore_errors=True)
    cell.mkdir(parents=True)
    out = root / f"{size_name(nbytes)}-r{world}.json"
    port = free_port()
    result = run_workers([[sys.executable, str(Path(__file__).resolve()), "--worker", "--rank", str(r), "--world",
                           str(world), "--port", str(port), "--bytes", str(nbytes), "--reps", str(reps), "--dir", str(cell),
                           "--out", str(out)] for r in range(world)], out, timeout_s)
    shutil.rmtree(cell, ignore_errors=True)
    return result


def table(results: list[tuple[int, int, int, dict[str, Any]]]) -> list[str]:
    head = (f"{'size':>7} {'ranks':>5} {'measure':<7} {'reps':>4}  {'fs median':>11} {'fs min':>11}  "
            f"{'alpsck median':>13} {'alpsck min':>11}  {'alpsck/fs':>9}")
    lines = [head, "-" * len(head)]
    for nbytes, world, reps, res in results:
        if "failed" in res:
            lines.append(f"{size_name(nbytes):>7} {world:>5} {'all':<7} {reps:>4}  FAILED: {res['failed']}")
            continue
        for measure in MEASURES:
            cols: dict[str, tuple[str, str, float | None]] = {}
            for method in METHODS:
                xs: list[float] = res["times"][method][measure]
                err = res["errors"][method].get(measure)
                if err is not None:
                    cols[method] = ("error", "", None)
                elif xs:
                    med = statistics.median(xs)
                    cols[method] = (fmt(med), fmt(min(xs)), med)
                else:
                    cols[method] = ("-", "-", None)
            fs_med, al_med = cols["fs"][2], cols["alpsck"][2]
            ratio = f"{al_med / fs_med:.2f}" if fs_med and al_med is not None else "-"
            lines.append(f"{size_name(nbytes):>7} {world:>5} {measure:<7} {reps:>4}  {cols['fs'][0]:>11} {cols['fs'][1]:>11}  "
                         f"{cols['alpsck'][0]:>13} {cols['alpsck'][1]:>11}  {ratio:>9}")
            for method in METHODS:
                err = res["errors"][method].get(measure)
                if err is not None:
                    lines.append(f"{'':>14}{method} {measure} failed: {err}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoints go (removed as it goes)")
    ap.add_argument("--sizes", default="2MiB,300MiB,2GiB", help="total state sizes, across the ranks")
    ap.add_argument("--ranks", default="1,2", help="rank counts (1: no_dist=True; more: a gloo group)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per cell (default 7/5/3 by size)")
    ap.add_argument("--cell-timeout", type=float, default=600.0, help="seconds one cell may take")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_rank(args.rank, args.world, args.port, args.bytes, args.reps, args.dir, args.out)
        return
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except (argparse.ArgumentTypeError, ValueError) as e:
        ap.error(str(e))
    if not sizes or not ranks or any(r < 1 or TENSORS % r for r in ranks):
        ap.error(f"--sizes and --ranks need at least one value each; a rank count must divide {TENSORS}")
    if any(s % (TENSORS * 4 * 1024) for s in sizes):
        ap.error(f"a size must be a multiple of {TENSORS * 4} KiB (16 float32 tensors of whole KiB)")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")

    import torch

    header = [f"# torch {torch.__version__}, {os.cpu_count()} CPUs, alpsck {alpsck_version()}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average {load_average()}",
              f"# command: {shlex.join(['python', *sys.argv])}",
              "# seconds on rank 0 after a barrier; median and min of the timed reps (after one warm-up);"
              " alpsck/fs of the medians (< 1: alpsck faster)",
              "# synced: fs's save + an fsync of its new directory and of the parent (alpsck: its save);"
              " cold: each checkpoint's files dropped from the page cache first; load: the same load again at once (fs's files"
              " then in the page cache; alpsck reads O_DIRECT, its default, from the device)"]
    print("\n".join(header), flush=True)
    results: list[tuple[int, int, int, dict[str, Any]]] = []
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for world in ranks:
        for nbytes in sizes:
            reps = args.reps or default_reps(nbytes)
            print(f"cell {size_name(nbytes)} x {world} rank(s), {reps} reps ...", file=sys.stderr, flush=True)
            results.append((nbytes, world, reps, run_cell(nbytes, world, reps, args.dir, args.cell_timeout)))
    lines = [*header, *table(results), f"# wall time {time.monotonic() - t0:.0f} s, load average {load_average()} at the end"]
    print("\n".join(lines[len(header):]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
