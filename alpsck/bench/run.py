"""The benchmark loop: limits, peers and an alpsck sweep on one state, in one run.

Every save-based number is the median of ``repeats`` saves after one warm-up save (the warm-up
pays one-time costs such as allocating staging memory; it is reported separately as
``first_stall``). Ratios are taken against limits measured in the same run.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .limits import RawBandwidth, prefaulted_copy_seconds, raw_bandwidth
from .methods import AlpsckMethod, CoreZeroCopyMethod, Method, peer_methods
from .state import state_bytes, transformer_state


@dataclass
class Measurement:
    method: str
    stall: float
    durable: float
    restore: float
    first_stall: float
    saves: list[tuple[float, float]] = field(default_factory=list)


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


def measure(method: Method, repeats: int, progress: Callable[[str], None]) -> Measurement:
    progress(f"{method.name}: warm-up save")
    first_stall, _ = method.save(1)
    saves = []
    for i in range(repeats):
        progress(f"{method.name}: save {i + 1}/{repeats}")
        saves.append(method.save(2 + i))
    progress(f"{method.name}: restore")
    restore = method.restore()
    return Measurement(method.name, statistics.median(s for s, _ in saves), statistics.median(d for _, d in saves),
                       restore, first_stall, saves)


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


def run(directory: Path, size_bytes: int, *, threads: list[int], chunks_mib: list[int], in_flight: list[int],
        copy_threads: list[int] | None = None, urgent: list[bool] | None = None, peers: bool = True,
        repeats: int = 3, iter_seconds: float = 1.0, slowdown: float = 0.03, mtbf_hours: float = 24.0,
        progress: Callable[[str], None] | None = None) -> BenchResult:
    say = progress or (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    directory = directory / f"alpsck-bench-{os.getpid()}"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        say(f"building a transformer-like state of {size_bytes / 2**30:.2f} GiB")
        state = transformer_state(size_bytes)
        nbytes = state_bytes(state)
        say("raw O_DIRECT write/read bandwidth (start of run)")
        raw_start = raw_bandwidth(directory, nbytes)
        raw = raw_start
        say(f"raw write {raw.write_bps / 1e9:.2f} GB/s, read {raw.read_bps / 1e9:.2f} GB/s ({raw.tool})")
        copy_s = prefaulted_copy_seconds(state)
        say(f"copy into pre-faulted memory: {copy_s:.3f} s")
        results: list[Measurement] = []
        methods: list[Callable[[], Method]] = []
        for t in threads:
            for c in chunks_mib:
                for f in in_flight:
                    for cp in copy_threads or [0]:
                        for u in urgent or [False]:
                            methods.append(lambda t=t, c=c, f=f, cp=cp, u=u: AlpsckMethod(
                                directory / f"alpsck-{t}-{c}-{f}-{cp}-{int(u)}", state, threads=t, chunk_mib=c,
                                max_in_flight=f, copy_threads=cp or None, urgent=u))
        methods.append(lambda: CoreZeroCopyMethod(directory / "core-zerocopy", state, threads=max(threads),
                                                  chunk_mib=chunks_mib[0]))
        if peers:
            methods.extend((lambda m=m: m) for m in peer_methods(directory, state))
        for make in methods:
            m = make()
            try:
                results.append(measure(m, repeats, say))
            finally:
                m.close()
        # Cloud disks drift (burst credits): measure again at the end and take ratios against the
        # mean, reporting both ends so a drift is visible.
        say("raw O_DIRECT write/read bandwidth (end of run)")
        raw_end = raw_bandwidth(directory, nbytes)
        raw = RawBandwidth((raw_start.write_bps + raw_end.write_bps) / 2, (raw_start.read_bps + raw_end.read_bps) / 2,
                           f"{raw_start.tool}; mean of start {raw_start.write_bps / 1e9:.2f}/{raw_start.read_bps / 1e9:.2f}"
                           f" and end {raw_end.write_bps / 1e9:.2f}/{raw_end.read_bps / 1e9:.2f} GB/s (write/read)")
        core = next(r for r in results if r.method.startswith("core zero-copy"))
        ours = [r for r in results if r.method.startswith("alpsck")]
        # Best = lowest stall among default-mode (non-urgent) saves: the training loop's cost.
        best = min([r for r in ours if not r.method.endswith("urgent")] or ours, key=lambda r: (r.stall, r.durable))
        fastest = min(ours, key=lambda r: r.durable)
        ratios: dict[str, float] = {
            "durable_vs_raw_write": best.durable / (nbytes / raw.write_bps),
            "stall_vs_prefaulted_copy": best.stall / copy_s,
            "restore_bw_vs_raw_read": (nbytes / best.restore) / raw.read_bps,
            "fastest durable (any mode) vs raw write": fastest.durable / (nbytes / raw.write_bps),
            "core zero-copy durable vs raw write": core.durable / (nbytes / raw.write_bps),
            "core zero-copy restore bw vs raw read": (nbytes / core.restore) / raw.read_bps,
        }
        for r in results:
            if r.method.startswith(("alpsck", "core")):
                continue
            ratios[f"{r.method}: durable / alpsck"] = r.durable / best.durable
            ratios[f"{r.method}: stall / alpsck"] = r.stall / best.stall
            ratios[f"{r.method}: restore / alpsck"] = r.restore / best.restore
        f_best = int(best.method.split("f=", 1)[1].split()[0])
        return BenchResult(str(directory), nbytes, _machine(), raw.write_bps, raw.read_bps, raw.tool, copy_s, results,
                           best.method, ratios, advise(best, copy_s, iter_seconds, slowdown, mtbf_hours, f_best))
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
