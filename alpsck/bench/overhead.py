"""``alpsck bench --overhead``: what checkpointing every k iterations costs a real training loop.

In the spirit of PCcheck's evaluation: the reference Llama model (:mod:`alpsck.examples.llama`)
trains from the same seed on the same synthetic data once per (method, k). Each run builds a
fresh model, optimizer and data stream, runs ``warmup`` untimed iterations and one untimed
checkpoint waited to durability (one-time costs such as allocating staging memory), then trains
in blocks of at least ``block`` iterations (a whole number of intervals), alternating a block
that checkpoints every k iterations (after its iterations 1, 1+k, ...) with one that does not,
in the order on-off, off-on, on-off, ... until about ``iters`` iterations of each kind ran.

Why pairs of blocks: on a VM the speed of the same training drifts by 10-20 % between runs a
minute apart, more than the overheads to measure. Blocks a few seconds long, taken in
alternating order, see the same drift, so ``1 - it/s(on) / it/s(off)`` within one run measures
the checkpointing and not the machine; the spread over the pairs says how sure that number is.
A block with checkpoints ends by waiting until they are durable, and that wait counts in its
time: no background work spills into the next block (it overstates the cost a little, as if
training had stood still for the wait). With ``rounds`` > 1 the sweep repeats and every
configuration reports its median round. The CPU other processes used during each run is
recorded, so a busy machine shows.

Per (method, k): iterations/s with and without checkpoints, the throughput cost, the mean and
worst stall inside ``save()``, and ``T_w``, the time from ``save()`` to durable of checkpoints
that did not wait for a free in-flight slot (their persist time, with training running beside
them). Methods: ``alpsck`` (:class:`Checkpointer`
with default settings and the given ``max_in_flight``), ``torch`` (the synchronous
:class:`TorchSaveCheckpointer` baseline) and, on request, ``dcp-async``
(``torch.distributed.checkpoint.async_save`` of the flattened tensors, one in flight) and
``alpsck-overlap`` (``overlap_copy=True``: the pipelined snapshot on a CPU state; on a GPU,
``alpsck`` takes that path by itself) and ``alpsck-crc-writers`` (``crc_in_copy=False``: the
writers CRC each chunk after the copy instead of the copy doing it while the bytes are in cache).

``--device cuda`` trains on the GPU (issue 9). The run then also measures the copy limit, a
plain copy of the whole state into pinned host memory (on CPU: into pre-faulted memory), and for
each checkpointing run how much of one copy the training loop still felt: the stall plus the
extra time of the iteration that follows a save (whose optimizer step waits for the copy),
against that limit; the rest overlapped the next forward and backward. ``rss growth`` is the
process's resident memory after the timed run (and its drain) minus before it: flat across
many saves, or something leaks.

The targets, checked per alpsck configuration: a checkpoint every 10 iterations costs at most
3 % of throughput (issue 9); a checkpoint every iteration costs at most 5 % (issue 25) when an
iteration takes longer than ``T_w / max_in_flight`` (the condition is reported with the numbers
it rests on).
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .overhead_config import METHODS as METHODS  # re-exported: the benchmark's names, as before
from .overhead_config import OverheadConfig

_ALPSCK_TAILS = {"alpsck": "", "alpsck-overlap": " overlap", "alpsck-crc-writers": " crc-writers"}
TARGET_K10_PCT = 3.0
TARGET_K1_PCT = 5.0
BUSY_CORES = 0.2  # other processes using more CPU than this during a timed run make it unreliable


def _busy(r: RunStats) -> bool:
    return (r.other_cpu_cores or 0.0) > BUSY_CORES


@dataclass
class RunStats:
    """One configuration: a checkpointing method, every ``k`` iterations, in alternating blocks."""

    method: str
    k: int
    iterations: int  # in the blocks with checkpoints; as many again without
    seconds: float  # the blocks with checkpoints, their waits for durability included
    its: float  # iterations / seconds
    iter_seconds_median: float  # an iteration of the blocks without checkpoints
    block: int = 0
    its_off: float = 0.0  # it/s of the blocks without checkpoints
    overhead_pct: float | None = None  # 1 - its / its_off, in %
    pair_overheads_pct: list[float] = field(default_factory=list)  # the same, per pair of blocks
    checkpoints: int = 0
    stall_mean: float = 0.0
    stall_max: float = 0.0
    persist_seconds: float | None = None  # median T_w of the saves that did not wait for a slot
    persist_samples: int = 0
    throttled_saves: int = 0  # saves that found max_in_flight checkpoints in flight
    drain_seconds: float = 0.0
    committed_before_drain: list[int] = field(default_factory=list)  # committed steps when the loop ended
    committed_after_drain: list[int] = field(default_factory=list)
    saved_steps: list[int] = field(default_factory=list)
    other_cpu_cores: float | None = None  # CPU the rest of the machine used meanwhile (cores; None: unknown)
    overhead_rounds: list[float] = field(default_factory=list)  # overhead % of every round (this is the median)
    after_save_iter_median: float | None = None  # iterations right after a save (their step waits for its copy)
    exposed_copy_seconds: float | None = None  # stall + extra time of the next iteration, per save
    rss_growth_bytes: int | None = None


@dataclass
class OverheadResult:
    directory: str
    machine: dict[str, Any]
    model: dict[str, Any]
    iters: int
    warmup: int
    ks: list[int]
    baseline_its: float  # median it/s of the configurations' blocks without checkpoints
    drift_pct: float  # their spread across the sweep, % of the median: what the pairing cancels
    runs: list[RunStats]
    targets: list[dict[str, Any]]
    rounds: int = 1
    device: str = "cpu"
    copy_limit_seconds: float | None = None  # the whole state into pinned (GPU) / pre-faulted (CPU) memory
    block: int = 20

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- the training step ---------------------------------------------------------------------------


class _Training:
    """The reference model, optimizer, scheduler and data, built fresh from the seed."""

    def __init__(self, cfg: OverheadConfig, total_steps: int) -> None:
        from ..examples.llama.data import SyntheticBatches
        from ..examples.llama.model import Transformer
        from ..examples.llama.train import TrainConfig, make_optimizer, make_scheduler
        from ..rng import RNGState

        self.tc = TrainConfig(seed=cfg.seed, training_steps=total_steps, warmup_steps=min(10, total_steps - 1),
                              sequence_length=cfg.sequence_length, dim=cfg.dim, n_layers=cfg.n_layers,
                              n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size,
                              batch_size=cfg.batch_size)
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device)
        self.model = Transformer(self.tc.model_args()).to(self.device)
        self.opt = make_optimizer(self.model, self.tc)
        self.sched = make_scheduler(self.opt, self.tc)
        self.data = SyntheticBatches(cfg.vocab_size, cfg.batch_size, cfg.sequence_length, cfg.seed)
        self.state: dict[str, Any] = {"model": self.model, "optim": self.opt, "sched": self.sched, "rng": RNGState(),
                                      "data": self.data, "step": 0}

    def step(self) -> float:
        """One iteration exactly as the reference training does it; returns the loss."""
        inputs, targets = self.data.next()
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.state["step"] += 1
        return float(loss.item())

    def flat_tensors(self) -> dict[str, torch.Tensor]:
        """Weights and AdamW state as one flat dict of tensors (what DCP gets)."""
        out = {f"model/{k}": v for k, v in self.model.state_dict().items()}
        for i, p in enumerate(self.model.parameters()):
            for k, v in self.opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/{i}/{k}"] = v
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat_tensors().values())

    def copy_limit_seconds(self, repeats: int = 3) -> float:
        """Best time of one plain copy of the state: into pinned host memory (GPU), pre-faulted memory (CPU)."""
        tensors = list(self.flat_tensors().values())
        if self.device.type != "cuda":
            from .limits import prefaulted_copy_seconds

            return prefaulted_copy_seconds(dict(enumerate(tensors)), repeats)  # type: ignore[arg-type]
        dst = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True) for t in tensors]
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for d, t in zip(dst, tensors, strict=True):
                d.copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best


# -- checkpointing methods, one protocol -----------------------------------------------------------


class _Saver:
    name = "?"

    def __init__(self, run_dir: Path, training: _Training) -> None:
        self.dir, self.tr = run_dir, training
        self.stalls: list[float] = []
        self.persist: list[float] = []
        self.throttled = 0
        self.steps: list[int] = []

    def save(self, step: int) -> float:
        """Checkpoint the live state as ``step``; returns the stall (seconds inside the call)."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait until every checkpoint so far is durable and collect their persist times."""

    def committed(self) -> list[int]:
        raise NotImplementedError

    def reset_stats(self) -> None:
        self.stalls, self.persist, self.throttled, self.steps = [], [], 0, []

    def close(self) -> None:
        pass


class _AlpsckSaver(_Saver):
    def __init__(self, run_dir: Path, training: _Training, max_in_flight: int, threads: int | None,
                 overlap: bool = False, crc_in_copy: bool = True) -> None:
        from ..checkpointer import Checkpointer

        super().__init__(run_dir, training)
        self.f = max_in_flight
        self.name = (f"alpsck f={max_in_flight}" + (f" t={threads}" if threads else "") + (" overlap" if overlap else "")
                     + ("" if crc_in_copy else " crc-writers"))
        self.ck = Checkpointer(run_dir, max_in_flight=max_in_flight, threads=threads, overlap_copy=overlap or None,
                               crc_in_copy=crc_in_copy)
        self.handles: list[tuple[Any, bool]] = []

    def save(self, step: int) -> float:
        busy = sum(1 for h, _ in self.handles if not h.done())
        t0 = time.perf_counter()
        h = self.ck.save(step, self.tr.state)
        stall = time.perf_counter() - t0
        self.handles.append((h, busy >= self.f))
        self.throttled += busy >= self.f
        self.stalls.append(stall)
        self.steps.append(step)
        return stall

    def drain(self) -> None:
        self.ck.wait()
        for h, throttled in self.handles:
            if not throttled:  # its durable_seconds includes no wait for a free slot: the persist time
                self.persist.append(float(h.result()["durable_seconds"]))
        self.handles = []

    def committed(self) -> list[int]:
        return [int(c["step"]) for c in self.ck.checkpoints() if c["status"] == "committed"]

    def close(self) -> None:
        self.ck.close()


class _TorchSaver(_Saver):
    name = "torch.save"

    def __init__(self, run_dir: Path, training: _Training) -> None:
        from ..torch_save import TorchSaveCheckpointer

        super().__init__(run_dir, training)
        self.ck = TorchSaveCheckpointer(run_dir)

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.ck.save(step, self.tr.state)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.persist.append(stall)
        self.steps.append(step)
        return stall

    def committed(self) -> list[int]:
        return self.ck.steps()

    def close(self) -> None:
        self.ck.close()


class _DcpAsyncSaver(_Saver):
    """``dcp.async_save`` (FileSystemWriter, fsync on), at most one in flight, keep the last 3."""

    name = "DCP async_save"

    def __init__(self, run_dir: Path, training: _Training) -> None:
        super().__init__(run_dir, training)
        run_dir.mkdir(parents=True, exist_ok=True)
        # Single-process DCP warns on every save, partly from its background thread.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self.fut: Any = None
        self.t0 = 0.0
        self.t_done: list[float] = []

    def _finish(self) -> None:
        if self.fut is not None:
            self.fut.result()
            # The done-callback may run just after result() returns: then "now" is the time.
            t = self.t_done[0] if self.t_done else time.perf_counter()
            self.persist.append(t - self.t0)
            self.fut = None

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        if self.fut is not None and not self.fut.done():
            self.throttled += 1
        self._finish()
        self.t0, self.t_done = t0, []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.fut = dcp.async_save(self.tr.flat_tensors(), checkpoint_id=str(self.dir / f"dcp-{step:09d}"))
        self.fut.add_done_callback(lambda _f, box=self.t_done: box.append(time.perf_counter()))
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.steps.append(step)
        for s in self.committed()[:-3]:
            shutil.rmtree(self.dir / f"dcp-{s:09d}", ignore_errors=True)
        return stall

    def drain(self) -> None:
        self._finish()

    def committed(self) -> list[int]:
        return sorted(int(p.name[4:]) for p in self.dir.glob("dcp-*") if (p / ".metadata").exists())

    def close(self) -> None:
        self._finish()


# -- the measurement -------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    return {"cpus": len(os.sched_getaffinity(0)), "arch": os.uname().machine, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine incl. steal, CPU seconds of this process); None off Linux."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    t = os.times()
    return busy, t.user + t.system


def _new_saver(cfg: OverheadConfig, run_dir: Path, tr: _Training, method: str, in_flight: int) -> _Saver:
    if method.startswith("alpsck"):
        return _AlpsckSaver(run_dir, tr, in_flight, cfg.threads, overlap=method.endswith("overlap"),
                            crc_in_copy=not method.endswith("crc-writers"))
    if method == "torch.save":
        return _TorchSaver(run_dir, tr)
    return _DcpAsyncSaver(run_dir, tr)


def _block_length(cfg: OverheadConfig, k: int) -> int:
    """Iterations per block: at least ``cfg.block``, and a whole number of intervals."""
    return k * max(1, math.ceil(cfg.block / k))


def _paired_run(cfg: OverheadConfig, base: Path, method: str, k: int, in_flight: int,
                say: Callable[[str], None]) -> RunStats:
    """One training run in alternating blocks, checkpointing every ``k`` iterations (on) and not (off).

    Pairs go on-off, off-on, on-off, ... so that a machine drifting over the run weighs on both
    alike. An on block ends with a wait until its checkpoints are durable, counted in its time:
    none spills into the next block, at the cost of counting that wait as if training stood still.
    """
    label = f"{method} every {k}"
    b = _block_length(cfg, k)
    pairs = max(1, round(cfg.iters / b))
    tr = _Training(cfg, cfg.warmup + 2 * pairs * b + 1)
    run_dir = base / f"{method.replace(' ', '_').replace('=', '')}-k{k}"
    saver: _Saver | None = None
    try:
        saver = _new_saver(cfg, run_dir, tr, method, in_flight)
        say(f"{label}: {cfg.warmup} warm-up iterations and one warm-up checkpoint")
        for _ in range(cfg.warmup):
            tr.step()
        saver.save(tr.state["step"])
        saver.drain()
        saver.reset_stats()
        say(f"{label}: {pairs} pairs of {b}-iteration blocks, with and without checkpoints")
        on_s: list[float] = []
        off_s: list[float] = []
        off_iters: list[float] = []
        after_save: list[float] = []
        drains: list[float] = []
        committed_before: list[int] = []
        rss0 = _rss_bytes()
        cpu0 = _cpu_seconds()
        start = time.perf_counter()
        for j in range(pairs):
            for on in ((True, False) if j % 2 == 0 else (False, True)):
                t_block = time.perf_counter()
                saved_last = False
                for i in range(b):
                    t0 = time.perf_counter()
                    tr.step()
                    if saved_last:
                        after_save.append(time.perf_counter() - t0)
                    saved_last = on and i % k == 0
                    if saved_last:
                        saver.save(tr.state["step"])
                    elif not on:
                        off_iters.append(time.perf_counter() - t0)
                if on:
                    committed_before = saver.committed()
                    t0 = time.perf_counter()
                    saver.drain()
                    drains.append(time.perf_counter() - t0)
                (on_s if on else off_s).append(time.perf_counter() - t_block)
        seconds = time.perf_counter() - start
        cpu1 = _cpu_seconds()
        iters = pairs * b
        stats = RunStats(method=saver.name, k=k, iterations=iters, seconds=sum(on_s), its=iters / sum(on_s),
                         iter_seconds_median=statistics.median(off_iters), block=b, its_off=iters / sum(off_s))
        stats.overhead_pct = (1 - sum(off_s) / sum(on_s)) * 100
        stats.pair_overheads_pct = [(1 - off / on) * 100 for on, off in zip(on_s, off_s, strict=True)]
        if cpu0 is not None and cpu1 is not None:
            stats.other_cpu_cores = max(0.0, (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / seconds
        stats.committed_before_drain = committed_before
        stats.drain_seconds = statistics.fmean(drains)
        stats.committed_after_drain = saver.committed()
        stats.checkpoints = len(saver.stalls)
        stats.saved_steps = list(saver.steps)
        stats.stall_mean = statistics.fmean(saver.stalls) if saver.stalls else 0.0
        stats.stall_max = max(saver.stalls, default=0.0)
        stats.persist_samples = len(saver.persist)
        stats.persist_seconds = statistics.median(saver.persist) if saver.persist else None
        stats.throttled_saves = saver.throttled
        if after_save:
            stats.after_save_iter_median = statistics.median(after_save)
            stats.exposed_copy_seconds = stats.stall_mean + max(0.0, stats.after_save_iter_median
                                                                - stats.iter_seconds_median)
        rss1 = _rss_bytes()
        stats.rss_growth_bytes = None if rss0 is None or rss1 is None else rss1 - rss0
        other = "" if stats.other_cpu_cores is None else f"; other processes used {stats.other_cpu_cores:.2f} cores"
        say(f"{label}: {stats.its:.3f} it/s against {stats.its_off:.3f} without: {stats.overhead_pct:.1f} %, stall "
            f"{stats.stall_mean:.3f} s/checkpoint" + other)
        return stats
    finally:
        if saver is not None:
            saver.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        del tr
        gc.collect()


def _targets(runs: list[RunStats]) -> list[dict[str, Any]]:
    out = []
    for name in dict.fromkeys(r.method for r in runs if r.method.startswith("alpsck")):
        mine = {r.k: r for r in runs if r.method == name}
        f = int(name.split("f=", 1)[1].split()[0])
        samples = [r.persist_seconds for r in mine.values() if r.persist_seconds is not None]
        t_w = statistics.median(samples) if samples else None
        base_iter_s = statistics.median(r.iter_seconds_median for r in mine.values())
        entry: dict[str, Any] = {"method": name, "max_in_flight": f, "persist_seconds": t_w}
        r10 = mine.get(10)
        entry["every_10"] = None if r10 is None else {
            "overhead_pct": r10.overhead_pct, "pairs_pct": r10.pair_overheads_pct, "target_pct": TARGET_K10_PCT,
            "met": r10.overhead_pct is not None and r10.overhead_pct <= TARGET_K10_PCT, "reliable": not _busy(r10),
            "other_cpu_cores": r10.other_cpu_cores}
        r1 = mine.get(1)
        if r1 is None or t_w is None:
            entry["every_1"] = None
        else:
            held = r1.iter_seconds_median > t_w / f
            entry["every_1"] = {
                "overhead_pct": r1.overhead_pct, "pairs_pct": r1.pair_overheads_pct, "target_pct": TARGET_K1_PCT,
                "iteration_seconds": r1.iter_seconds_median,
                "threshold_seconds": t_w / f, "condition_held": held,
                "met": r1.overhead_pct is not None and r1.overhead_pct <= TARGET_K1_PCT, "reliable": not _busy(r1),
                "other_cpu_cores": r1.other_cpu_cores}
        within = [k for k, r in sorted(mine.items()) if r.overhead_pct is not None and r.overhead_pct <= TARGET_K10_PCT]
        entry["smallest_k_within_3pct"] = within[0] if within else None
        # PCcheck's rule for the interval that keeps the cost under q: k >= T_w / (N * q * t).
        entry["pccheck_min_k_3pct"] = None if t_w is None else max(1, math.ceil(t_w / (f * 0.03 * base_iter_s)))
        out.append(entry)
    return out


def run_overhead(directory: Path, cfg: OverheadConfig, progress: Callable[[str], None] | None = None) -> OverheadResult:
    """Measure every configuration of ``cfg`` below ``directory`` (a scratch folder, removed after)."""
    cfg.validate()
    say = progress or (lambda msg: print(f"[overhead] {msg}", file=sys.stderr, flush=True))
    threads_before = torch.get_num_threads()
    if cfg.torch_threads is not None:  # fewer than the cores: the rest are free for alpsck's background
        torch.set_num_threads(cfg.torch_threads)
    base = directory / f"alpsck-overhead-{os.getpid()}"
    base.mkdir(parents=True, exist_ok=True)
    try:
        probe = _Training(cfg, 2)
        probe.step()  # creates the AdamW moments, so the size below is the checkpointed size
        nparams = sum(p.numel() for p in probe.model.parameters())
        model: dict[str, Any] = {
            "dim": cfg.dim, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
            "vocab_size": cfg.vocab_size, "sequence_length": cfg.sequence_length, "batch_size": cfg.batch_size,
            "params": nparams, "state_bytes": probe.state_bytes()}
        copy_limit = probe.copy_limit_seconds()
        del probe
        say(f"model: {nparams / 1e6:.1f} M parameters, checkpointed state {model['state_bytes'] / 1e6:.0f} MB on "
            f"{cfg.device}; one plain copy of it: {copy_limit:.3f} s")
        methods: list[tuple[str, int]] = []
        for m in cfg.methods:
            if m in _ALPSCK_TAILS:
                methods += [(f"alpsck f={f}{_ALPSCK_TAILS[m]}", f) for f in cfg.in_flight]
            else:
                methods.append(({"torch": "torch.save", "dcp-async": "DCP async_save"}[m], 1))
        rounds: dict[tuple[str, int], list[RunStats]] = {}
        for rnd in range(cfg.rounds):
            tag = f"round {rnd + 1}/{cfg.rounds}: " if cfg.rounds > 1 else ""

            def tell(msg: str, tag: str = tag) -> None:
                say(tag + msg)

            for k in cfg.ks:  # k outermost: drift of the machine spreads over every method alike
                for name, f in methods:
                    rounds.setdefault((name, k), []).append(_paired_run(cfg, base, name, k, f, tell))
        runs: list[RunStats] = []
        for all_rounds in rounds.values():  # the round with the median overhead stands for the configuration
            chosen = sorted(all_rounds, key=lambda r: r.overhead_pct or 0.0)[(len(all_rounds) - 1) // 2]
            chosen.overhead_rounds = [r.overhead_pct or 0.0 for r in all_rounds]
            runs.append(chosen)
        off = [r.its_off for rs in rounds.values() for r in rs]
        base_its = statistics.median(off)
        drift = (max(off) - min(off)) / base_its * 100
        return OverheadResult(str(directory), _machine(), model, cfg.iters, cfg.warmup, list(cfg.ks), base_its, drift,
                              runs, _targets(runs), cfg.rounds, cfg.device, copy_limit, cfg.block)
    finally:
        torch.set_num_threads(threads_before)
        shutil.rmtree(base, ignore_errors=True)


# -- reporting ---------------------------------------------------------------------------------------


def table(r: OverheadResult) -> str:
    m = r.model
    lines = [
        f"Llama dim {m['dim']} x {m['n_layers']} layers ({m['n_heads']} heads), batch {m['batch_size']} x "
        f"{m['sequence_length']} tokens: {m['params'] / 1e6:.1f} M parameters, checkpointed state "
        f"{m['state_bytes'] / 1e6:.0f} MB (fp32 weights + AdamW moments)",
        f"each configuration: one training run, {r.warmup} warm-up iterations and one warm-up checkpoint, then "
        f"{r.iters} iterations with checkpoints (rounded to whole blocks) and as many without, in alternating blocks of "
        f"at least {r.block}; run "
        f"dirs on {r.directory}  ({r.machine['cpus']} CPUs, torch {r.machine['torch']}, "
        f"{r.machine['torch_threads']} torch threads)",
        f"without checkpoints: {r.baseline_its:.3f} it/s ({1 / r.baseline_its:.3f} s/iteration, median of the runs), "
        f"drifting by {r.drift_pct:.1f} % across the sweep (the pairing of blocks cancels it)"
        + (f"; {r.rounds} rounds, each configuration shows its median round" if r.rounds > 1 else ""),
        f"device {r.device}; one plain copy of the state into {'pinned' if r.device.startswith('cuda') else 'pre-faulted'}"
        " memory: " + (f"{r.copy_limit_seconds:.4f} s" if r.copy_limit_seconds is not None else "not measured"),
        "",
        f"{'method':<22} {'k':>4} {'it/s':>7} {'without':>7} {'overhead %':>10} {'pairs %':>13} {'ckpts':>5} "
        f"{'stall/ckpt s':>12} {'max stall s':>11} {'T_w s':>7} {'throttled':>9} {'drain s':>7} {'other CPU':>9} "
        f"{'felt copy':>9} {'rss growth MB':>13}",
    ]
    for s in r.runs:
        pairs = (f"{min(s.pair_overheads_pct):.1f}..{max(s.pair_overheads_pct):.1f}" if s.pair_overheads_pct
                 else "-")
        t_w = f"{s.persist_seconds:7.3f}" if s.persist_seconds is not None else "      -"
        other = f"{s.other_cpu_cores:8.2f}" + ("!" if _busy(s) else " ") if s.other_cpu_cores is not None else "        -"
        felt = (f"{s.exposed_copy_seconds / r.copy_limit_seconds:8.2f}x" if s.exposed_copy_seconds is not None
                and r.copy_limit_seconds else "        -")
        rss = f"{s.rss_growth_bytes / 1e6:13.1f}" if s.rss_growth_bytes is not None else "            -"
        lines.append(f"{s.method:<22} {s.k:>4} {s.its:7.3f} {s.its_off:7.3f} {s.overhead_pct or 0.0:10.1f} "
                     f"{pairs:>13} {s.checkpoints:>5} {s.stall_mean:12.3f} {s.stall_max:11.3f} {t_w} "
                     f"{s.throttled_saves:>9} {s.drain_seconds:7.2f} {other} {felt} {rss}")
    lines += ["", "it/s = iterations per second of the blocks with checkpoints (their waits for durability included), "
              "without = of the blocks without; overhead = 1 - it/s / without; pairs = the same per pair of blocks "
              "(lowest..highest); T_w = save() to durable (median, saves that found a free slot); drain = the wait "
              "at the end of a block with checkpoints; throttled = saves that waited for one of max_in_flight slots; "
              f"other CPU = cores used by other processes during the run (! = over {BUSY_CORES}: that row is "
              "unreliable); felt copy = (stall + extra time of the iteration after a save over one without) / one "
              "plain copy: below 1, the rest of the copy overlapped training; rss growth = resident memory after "
              "the run and its drain minus before", "", "targets:"]
    for t in r.targets:
        t_w = t["persist_seconds"]
        lines.append(f"  {t['method']}: T_w {t_w:.3f} s" if t_w is not None else f"  {t['method']}: T_w not measured")
        e10 = t["every_10"]
        if e10 is None:
            lines.append("    every 10 iterations: not measured (10 not in --ks)")
        else:
            lines.append(f"    every 10 iterations: {e10['overhead_pct']:.1f} % (target <= {e10['target_pct']:.0f} %): "
                         + ("MET" if e10["met"] else "NOT MET") + _caveat(e10))
        e1 = t["every_1"]
        if e1 is None:
            lines.append("    every iteration: not measured (1 not in --ks)")
        else:
            cond = (f"iteration {e1['iteration_seconds']:.3f} s {'>' if e1['condition_held'] else '<='} "
                    f"T_w/max_in_flight {e1['threshold_seconds']:.3f} s")
            verdict = ("MET" if e1["met"] else "NOT MET") if e1["condition_held"] else (
                f"target does not apply ({'met' if e1['met'] else 'not met'} anyway)")
            lines.append(f"    every iteration: {e1['overhead_pct']:.1f} % (target <= {e1['target_pct']:.0f} % when "
                         f"iteration > T_w/max_in_flight; {cond}): {verdict}" + _caveat(e1))
        if t["smallest_k_within_3pct"] is not None or t["pccheck_min_k_3pct"] is not None:
            lines.append(f"    smallest measured k within 3 %: {t['smallest_k_within_3pct']}; PCcheck's rule "
                         f"k >= T_w/(N*0.03*t): {t['pccheck_min_k_3pct']}")
    busy = max((s.other_cpu_cores or 0.0) for s in r.runs)
    if busy > BUSY_CORES:
        lines.append(f"note: other processes used up to {busy:.2f} cores during the timed runs: the machine was not "
                     "quiet, so the overheads above mix in their load")
    wide = [s for s in r.runs if s.pair_overheads_pct and max(s.pair_overheads_pct) - min(s.pair_overheads_pct)
            > TARGET_K10_PCT]
    if wide:
        lines.append(f"note: the pairs of {len(wide)} configuration(s) disagree by more than {TARGET_K10_PCT:.0f} points: "
                     "their overheads are uncertain by about that much; use more --iters or --rounds")
    return "\n".join(lines)


def _caveat(e: dict[str, Any]) -> str:
    return "" if e["reliable"] else f" (unreliable: other processes used {e['other_cpu_cores']:.2f} cores meanwhile)"


def plot(r: OverheadResult, path: Path) -> bool:
    """Overhead % against k (log x), one line per method. False when matplotlib is missing."""
    from ..out.figures import pyplot

    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(s.method for s in r.runs):
        mine = sorted((s for s in r.runs if s.method == name and s.overhead_pct is not None), key=lambda s: s.k)
        y = [s.overhead_pct or 0.0 for s in mine]
        lo = [v - min(s.pair_overheads_pct or [v]) for v, s in zip(y, mine, strict=True)]
        hi = [max(s.pair_overheads_pct or [v]) - v for v, s in zip(y, mine, strict=True)]
        ax.errorbar([s.k for s in mine], y, yerr=[lo, hi], marker="o", capsize=3, label=name)
    ax.axhline(TARGET_K10_PCT, color="g", ls="--", lw=1, label=f"{TARGET_K10_PCT:.0f} % (target at k=10)")
    ax.axhline(TARGET_K1_PCT, color="r", ls=":", lw=1, label=f"{TARGET_K1_PCT:.0f} % (target at k=1)")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xscale("log")
    ax.set_xticks(r.ks, [str(k) for k in r.ks])
    ax.set_xlabel("checkpoint every k iterations")
    ax.set_ylabel("throughput cost (%); bars: pairs of blocks")
    ax.set_title(f"{r.model['params'] / 1e6:.0f} M-parameter Llama, {r.model['state_bytes'] / 1e6:.0f} MB state, "
                 f"{1 / r.baseline_its:.2f} s/iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
