"""The benchmark loop: limits, peers and an alpsck sweep on one state, in one run.

Every save-based number is the median of ``repeats`` saves after the method's warm-up saves
(the first, taken :func:`first_save_after` the method was set up, is reported as ``first_stall``;
alpsck warms up with two, so that its steady state, recycled checkpoint files overwritten in
place, is what is timed), and the restore the median of ``repeats`` restores of the last save.
Right before each timed save, and before and after each restore, the raw disk is sampled
(:class:`.limits.RawProbe`), and each method's ratios are taken against its own samples: on a
disk that drifts within seconds, only neighbouring samples compare. (One restore per method, as
until stop 34, put single samples 1.2-2.0 s apart for the same read on this VM.)

``cpu`` is the CPU time one save costs, from the call to durable: every thread of the process
(the training thread's copy, writers, committer, a peer's helper threads) and its children, user
and system. Where training keeps every core busy (checkpointing every iteration on a small node),
that CPU comes out of the training; unlike wall times on a shared VM it hardly drifts between
runs.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import AlpsckError
from .limits import RawProbe, prefaulted_copy_seconds
from .methods import AlpsckMethod, CoreZeroCopyMethod, Method, peer_methods
from .state import state_bytes, transformer_state


@dataclass
class Measurement:
    method: str
    stall: float
    durable: float
    restore: float  # median of the restores (s)
    first_stall: float
    saves: list[tuple[float, float]] = field(default_factory=list)
    raw_write: float = 0.0  # median raw O_DIRECT write of the state, sampled before each save (s)
    raw_read: float = 0.0   # median raw O_DIRECT read of the state, sampled around the restores (s)
    cpu: float = 0.0        # median CPU seconds of one timed save, call to durable, all threads (module docstring)
    restores: list[float] = field(default_factory=list)  # each restore (s)
    raw_reads: list[float] = field(default_factory=list)  # the raw reads around them: before the first, after each (s)
    restore_vs_raw: float = 0.0  # restore bandwidth / raw read bandwidth, paired (restore_vs_raw_read)


@dataclass
class BenchResult:
    directory: str
    state_bytes: int
    machine: dict[str, Any]
    raw_write_bps: float
    raw_read_bps: float
    raw_tool: str
    copy_seconds: float
    measurements: list[Measurement]
    best: str
    ratios: dict[str, float]
    advice: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _machine() -> dict[str, Any]:
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "arch": os.uname().machine,
        "kernel": os.uname().release,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


# The first save comes this long after the method was set up (for alpsck: a Checkpointer whose
# restore() found no checkpoint), as in a training that restores, then trains a few steps: 5 s for a
# state of 1 GiB or more, less in proportion for a smaller one (whose staging memory is ready sooner),
# at least 0.25 s. A fixed 5 s made a 20 MiB run sleep half its time (7 methods: 35 s of 68).
FIRST_SAVE_AFTER_S = 5.0


def first_save_after(state_bytes: int) -> float:
    return max(0.25, min(FIRST_SAVE_AFTER_S, FIRST_SAVE_AFTER_S * state_bytes / (1 << 30)))


def process_cpu_seconds() -> float:
    """User + system CPU time of this process's threads and its waited-for children so far."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(method: Method, repeats: int, probe: RawProbe, progress: Callable[[str], None]) -> Measurement:
    wait = first_save_after(probe.size)
    progress(f"{method.name}: {wait:.2f} s of 'training', then the first save")
    time.sleep(wait)
    first_stall, _ = method.save(1)
    for w in range(1, method.warmups):
        method.save(1 + w)
    saves, raw_w, cpu = [], [], []
    for i in range(repeats):
        progress(f"{method.name}: save {i + 1}/{repeats}")
        raw_w.append(probe.write_seconds())
        c0 = process_cpu_seconds()
        saves.append(method.save(1 + method.warmups + i))  # returns once durable
        cpu.append(process_cpu_seconds() - c0)
    raw_r, restores = [probe.read_seconds()], []
    for i in range(repeats):
        progress(f"{method.name}: restore {i + 1}/{repeats}")
        restores.append(method.restore())
        raw_r.append(probe.read_seconds())
    return Measurement(method.name, statistics.median(s for s, _ in saves), statistics.median(d for _, d in saves),
                       statistics.median(restores), first_stall, saves, statistics.median(raw_w),
                       statistics.median(raw_r), statistics.median(cpu), restores, raw_r,
                       restore_vs_raw_read(restores, raw_r))


def restore_vs_raw_read(restores: list[float], raw_reads: list[float]) -> float:
    """Restore bandwidth over the raw read's, paired: each restore against the mean of the raw reads
    just before and just after it, then the median of those ratios.

    On a disk whose speed swings within seconds, a restore compares only with its neighbours; a
    median of the restores against a median of all the raw reads mixes samples taken up to a
    minute apart (stop 36 gives both for the same runs in docs/benchmarks.md).
    """
    if len(raw_reads) != len(restores) + 1:
        raise ValueError(f"{len(restores)} restores need {len(restores) + 1} raw reads around them, got {len(raw_reads)}")
    return statistics.median((raw_reads[i] + raw_reads[i + 1]) / 2 / r for i, r in enumerate(restores))


def advise(best: Measurement, copy_s: float, iter_seconds: float, slowdown: float, mtbf_hours: float,
           max_in_flight: int) -> dict[str, Any]:
    """Recommended settings from the measured persist time.

    PCcheck's rule: with N checkpoints in flight, a checkpoint every k iterations keeps the
    slowdown under q when k >= T_w / (N * q * t) (T_w persist time, t iteration time). Young/Daly:
    the interval that minimises lost work plus checkpoint cost is sqrt(2 * C * MTBF), with C the
    stall per checkpoint.
    """
    t_w = best.durable
    k = max(1, math.ceil(t_w / (max_in_flight * slowdown * iter_seconds)))
    stall = max(best.stall, 1e-6)
    daly = math.sqrt(2 * stall * mtbf_hours * 3600)
    return {
        "settings": best.method,
        "persist_seconds": t_w,
        "min_interval_iterations": k,
        "rule": f"k >= T_w/(N*q*t) = {t_w:.2f}/({max_in_flight}*{slowdown}*{iter_seconds}) -> every {k} iterations",
        "young_daly_interval_seconds": daly,
        "young_daly_interval_iterations": max(k, math.ceil(daly / iter_seconds)),
        "inputs": {"iteration_seconds": iter_seconds, "tolerated_slowdown": slowdown, "mtbf_hours": mtbf_hours},
    }


def disk_needed(size_bytes: int, *, repeats: int, in_flight: int, peers: bool) -> int:
    """The most the bench holds in its directory at once: the raw probe's file, plus what the
    greediest method keeps (alpsck: the kept checkpoint, ``in_flight`` saves and an expired one
    kept for reuse; a peer: its warm-up save and every timed one, until it is done)."""
    alpsck = in_flight + 2
    peer = 1 + repeats if peers else 0
    return size_bytes * (1 + max(alpsck, peer))


def run(directory: Path, size_bytes: int, *, threads: list[int], chunks_mib: list[int], in_flight: list[int],
        copy_threads: list[int] | None = None, urgent: list[bool] | None = None, peers: bool = True,
        repeats: int = 3, iter_seconds: float = 1.0, slowdown: float = 0.03, mtbf_hours: float = 24.0,
        progress: Callable[[str], None] | None = None) -> BenchResult:
    say = progress or (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    need = disk_needed(size_bytes, repeats=repeats, in_flight=max(in_flight), peers=peers)
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < need:  # refused before anything is written (a full disk failed mid-run, in a peer)
        raise AlpsckError(f"--dir {directory}: a {size_bytes / 2**30:.2f} GiB bench needs about {need / 2**30:.1f} GiB "
                          f"free there (the raw probe's file and up to {need // size_bytes - 1} copies of the state "
                          f"at once); {free / 2**30:.1f} GiB are")
    directory = directory / f"alpsck-bench-{os.getpid()}"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        say(f"building a transformer-like state of {size_bytes / 2**30:.2f} GiB")
        state = transformer_state(size_bytes)
        nbytes = state_bytes(state)
        say("laying out the raw-disk probe file")
        probe = RawProbe(directory, nbytes)
        copy_s = prefaulted_copy_seconds(state)
        say(f"copy into pre-faulted memory: {copy_s:.3f} s")
        results: list[Measurement] = []
        methods: list[Callable[[], Method]] = []
        for t in threads:
            for c in chunks_mib:
                for f in in_flight:
                    for cp in copy_threads or [0]:
                        for u in urgent or [False]:
                            methods.append(partial(AlpsckMethod, directory / f"alpsck-{t}-{c}-{f}-{cp}-{int(u)}", state,
                                                   threads=t, chunk_mib=c, max_in_flight=f, copy_threads=cp or None,
                                                   urgent=u))
        methods.append(partial(CoreZeroCopyMethod, directory / "core-zerocopy", state, threads=max(threads),
                               chunk_mib=chunks_mib[0]))
        if peers:
            methods.extend(partial(lambda m: m, m) for m in peer_methods(directory, state))  # built already
        try:
            for make in methods:
                m = make()
                try:
                    results.append(measure(m, repeats, probe, say))
                finally:
                    m.close()
        finally:
            probe.close()
        raw_write_s, raw_read_s = statistics.median(probe.writes), statistics.median(probe.reads)
        core = next(r for r in results if r.method.startswith("core zero-copy"))
        ours = [r for r in results if r.method.startswith("alpsck")]
        # Best = lowest stall among default-mode (non-urgent) saves: the training loop's cost.
        best = min([r for r in ours if not r.method.endswith("urgent")] or ours, key=lambda r: (r.stall, r.durable))
        fastest = min(ours, key=lambda r: r.durable)
        # Each method against the raw samples taken next to its own saves and restore.
        ratios: dict[str, float] = {
            "durable_vs_raw_write": best.durable / best.raw_write,
            "stall_vs_prefaulted_copy": best.stall / copy_s,
            "first_stall_vs_steady_stall": best.first_stall / best.stall,
            "restore_bw_vs_raw_read": best.restore_vs_raw,
            "fastest durable (any mode) vs raw write": fastest.durable / fastest.raw_write,
            "core zero-copy durable vs raw write": core.durable / core.raw_write,
            "core zero-copy restore bw vs raw read": core.restore_vs_raw,
        }
        for r in results:
            if r.method.startswith(("alpsck", "core")):
                continue
            ratios[f"{r.method}: durable / alpsck"] = r.durable / best.durable
            ratios[f"{r.method}: stall / alpsck"] = r.stall / best.stall
            ratios[f"{r.method}: restore / alpsck"] = r.restore / best.restore
            ratios[f"{r.method}: CPU per save / alpsck"] = r.cpu / best.cpu if best.cpu > 0 else math.inf
        f_best = int(best.method.split("f=", 1)[1].split()[0])
        tool = (f"{probe.tool}; sampled before each save ({len(probe.writes)} writes, "
                f"{min(probe.writes):.2f}-{max(probe.writes):.2f} s) and around each restore ({len(probe.reads)} reads, "
                f"{min(probe.reads):.2f}-{max(probe.reads):.2f} s); ratios use each method's own samples")
        return BenchResult(str(directory), nbytes, _machine(), nbytes / raw_write_s, nbytes / raw_read_s, tool, copy_s,
                           results, best.method, ratios, advise(best, copy_s, iter_seconds, slowdown, mtbf_hours, f_best))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
