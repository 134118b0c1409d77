"""Each framework's own checkpoint writer against alpsck's integration for it, in the same run, one process.

For a training state of float32 CPU tensors (random values) of 2 MiB, 300 MiB and 2 GiB in all (the size is
the checkpoint's tensors: parameters plus Adam's two moments, a third each), per framework:

- ``lightning``: Lightning's default ``CheckpointIO``, ``lightning.pytorch.plugins.io.TorchCheckpointIO``, against
  ``alpsck.integrations.lightning.AlpsckCheckpointIO``, called as Lightning's trainer calls them:
  ``io.save_checkpoint(checkpoint, path)`` with a dict shaped as Lightning's (``state_dict``, ``optimizer_states``
  with Adam's ``exp_avg``/``exp_avg_sq``/``step``, ``global_step``, ``epoch``, ...; 8 parameters), each save to
  a new path ``DIR/lightning/<method>/epoch=<i>.ckpt``, then ``io.teardown()`` for alpsck (waits for its saves),
  and ``io.load_checkpoint(path)``; old ones go through ``io.remove_checkpoint``, untimed.
- ``trainer``: ``transformers.Trainer`` against ``alpsck.integrations.transformers.AlpsckTrainer``, around one
  plain ``torch.nn.Module`` (4 ``nn.Linear(d, d)``, forward returns ``{"loss": ...}``) with
  ``TrainingArguments(use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)``; the stock trainer's
  ``create_optimizer_and_scheduler(num_training_steps=10)`` and one AdamW step on fake gradients, its optimizer
  and scheduler then shared by the AlpsckTrainer (both checkpoint the same objects). The save is
  ``trainer._save_checkpoint(trainer.model, None)`` (what the Trainer writes at ``save_steps``:
  ``output_dir/checkpoint-<global_step>``; ``state.global_step`` bumped each save); the load is
  ``_load_from_checkpoint(path)`` + ``_load_optimizer_and_scheduler(path)`` + ``_load_rng_state(path)``, for
  AlpsckTrainer after ``_alpsck_read(path)`` (reads the whole checkpoint, every chunk CRC-checked) with
  ``_alpsck_loaded`` set to what it read, as its ``train(resume_from_checkpoint=...)`` does.
- ``accelerate``: ``Accelerator(cpu=True)`` with a prepared model (as above) and ``torch.optim.AdamW`` (one step
  on fake gradients): ``accelerator.save_state(dir)`` (each to a new dir) / ``accelerator.load_state(dir)``
  against ``alpsck.integrations.accelerate.AcceleratorCheckpointer(accelerator, run_dir)``: ``save(step)``,
  ``wait()``, ``restore()`` (its default retention, keep_last, removes its older checkpoints as it goes).

Megatron is not here: its own ``torch_dist`` writer (the default to compare against) needs CUDA and does not
run on a CPU.

Measures, seconds per call, the caller's view:

- ``stall``: until the save call returns. alpsck returns once the state is copied to host memory (its writes
  and fsyncs go on in the background); the defaults return when their files are written.
- ``durable``: until the checkpoint is on the device: alpsck's save plus its wait (``teardown()``,
  ``_alpsck_wait()``, ``wait()``; every file fsync'ed, then the commit). The defaults never fsync
  (``torch.save``, safetensors' ``save_file``): their ``durable`` is their ``stall``, the files then sit in
  the page cache, dirty, and a crash of the node in the next seconds loses them.
- ``synced``: for the defaults, their save plus an fsync of every file and directory it wrote (what making
  it as durable as alpsck's costs); for alpsck, its ``durable`` again. (Lightning's default writes through
  fsspec's transaction, a ``mkstemp`` file reopened with O_TRUNC then renamed: ext4's auto_da_alloc starts
  its writeback at close, inside the save, so the fsync after it finds little left.)
- ``cold``: the framework's load of the checkpoint just saved, its files first dropped from the page cache
  (fsync'ed, then ``posix_fadvise(DONTNEED)``): what a restart on another node reads.
- ``load``: the same load again at once. The defaults' files are then in the page cache; alpsck reads with
  O_DIRECT (its default), from the device, every chunk CRC-checked, either way.

Each (framework, size) cell runs in a fresh process of this script: one untimed warm-up repetition, in which
every load is checked to give back tensors equal to what was saved (else it fails, loudly), then 21 timed
repetitions at 2 MiB, 5 at 300 MiB, 3 at 2 GiB (``--reps`` for all). Within a repetition the two methods
alternate: both save, then both load, the first one taking turns; ``os.sync()`` (untimed) before each save,
so neither pays for the other's writeback. The table gives, per (framework, size, measure), both medians and
alpsck/default of the medians (below 1.0: alpsck faster); the header and the last line give the load
average, as other processes' load shows in every time. On a VM whose host backs guest memory lazily (this
project's), touching memory not touched lately costs several times more (2 GiB: 0.9 s, then 5.3 s once 6 GiB
are held), so whatever allocates much (alpsck's staging pool, Lightning's in-memory copy, the page cache of
written files) varies from rep to rep; the warm-up's copy of the state, for its checks, is dropped after it.
benchmarks/results/framework_io.txt is, from the repository root::

    PYTHONPATH=/work/main python3 benchmarks/framework_io.py --dir /tmp/fwbench

(options: ``--sizes 2MiB,300MiB,2GiB --frameworks lightning,trainer,accelerate --reps N --out FILE``, and
``--profile DIR``: cProfile of alpsck's timed saves and loads, one file per cell).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import shlex
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench_common import alpsck_version, default_reps, fmt, load_average, parse_size, run_workers, size_name

FRAMEWORKS = ("lightning", "trainer", "accelerate")
METHODS = ("default", "alpsck")
MEASURES = ("stall", "durable", "synced", "cold", "load")
LINEAR_LAYERS = 4  # the trainer's and accelerate's model
LIGHTNING_PARAMS = 8  # the Lightning checkpoint's parameters (each with two Adam moments)


# ------------------------------------------------------------------------------ helpers of a worker


class Mismatch(Exception):
    """A load gave back other values than were saved."""


def same(want: Any, got: Any, where: str) -> None:
    """Raise Mismatch unless ``got`` equals ``want`` (tensors: dtype, shape and every value)."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            raise Mismatch(f"{where}: {type(got).__name__} {getattr(got, 'dtype', '')} {getattr(got, 'shape', '')}, "
                           f"saved {want.dtype} {tuple(want.shape)}")
        if not torch.equal(got.cpu(), want):
            raise Mismatch(f"{where}: other values than saved")
    elif isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            raise Mismatch(f"{where}: keys {sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__}, "
                           f"saved {sorted(map(str, want))}")
        for k in want:
            same(want[k], got[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            raise Mismatch(f"{where}: {got!r:.80}, saved {want!r:.80}")
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            same(w, g, f"{where}[{i}]")
    elif want != got and not (isinstance(want, float) and math.isnan(want) and isinstance(got, float) and math.isnan(got)):
        raise Mismatch(f"{where}: {got!r:.80}, saved {want!r:.80}")


def fsync_tree(path: Path) -> None:
    """fsync every file and directory at or under ``path``, and its parent directory."""
    from alpsck.store.durable import fsync_path

    for p in [path, *(sorted(path.rglob("*")) if path.is_dir() else []), path.parent]:
        fsync_path(p)


def evict_tree(path: Path) -> None:
    """Drop every file at or under ``path`` from the page cache (fsync'ed first, so its pages are clean)."""
    from alpsck.bench.methods import drop_page_cache

    fsync_tree(path)
    drop_page_cache(path)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def adam_state_dict(optimizer: Any) -> dict[str, Any]:
    """A detached deep copy of ``optimizer.state_dict()`` (tensors cloned)."""
    import torch

    def copy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        if isinstance(v, list):
            return [copy(x) for x in v]
        return v

    return copy(optimizer.state_dict())


def scramble(model: Any, optimizer: Any) -> None:
    """Overwrite the live parameters and Adam moments (so a load that does nothing cannot pass the check)."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(-1.0)


def linear_width(nbytes: int) -> int:
    """d for LINEAR_LAYERS nn.Linear(d, d) whose parameters and two Adam moments hold about ``nbytes`` of float32."""
    per_layer = nbytes / (3 * 4 * LINEAR_LAYERS)  # d * d + d float32 values per layer
    return max(1, int((-1 + math.sqrt(1 + 4 * per_layer)) / 2))


def linear_model(nbytes: int) -> Any:
    import torch
    from torch import nn

    class Net(nn.Module):
        """A plain module whose forward returns ``{"loss": ...}``, as the Trainer takes it."""

        def __init__(self, d: int) -> None:
            super().__init__()
            self.width = d
            self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(LINEAR_LAYERS))

        def forward(self, x: torch.Tensor | None = None, **_: Any) -> dict[str, torch.Tensor]:
            h = x if x is not None else torch.ones(1, self.width)
            for layer in self.layers:
                h = layer(h)
            return {"loss": h.pow(2).mean()}

    torch.manual_seed(0)
    return Net(linear_width(nbytes))


def adam_step(model: Any, optimizer: Any) -> None:
    """One optimizer step on fake gradients, so Adam has its moments; the gradients then dropped."""
    import torch

    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------ the three benches


class Bench:
    """One framework's two methods on one state: ``save`` (stall, durable seconds; where it went), ``load``."""

    nbytes = 0

    def __init__(self, nbytes: int, root: Path) -> None:
        self.root = root

    def save(self, method: str, i: int) -> tuple[float, float, Path]:
        raise NotImplementedError

    def load(self, method: str, path: Path, check: bool) -> float:
        raise NotImplementedError

    def remove(self, method: str, path: Path) -> None:
        remove(path)

    def end_warmup(self) -> None:
        """Drop what the warm-up's checks held (a copy of the state): held, it made every later fresh staging pool
        of alpsck's slower to fault in (2.1 s -> 5.4 s for the trainer's 2 GiB on this VM)."""

    def close(self) -> None:
        pass


def import_lightning_io() -> tuple[Any, Any]:
    """(TorchCheckpointIO, AlpsckCheckpointIO). Importing Lightning imports torchmetrics, which imports
    ``transformers.AutoTokenizer`` when transformers >= 4.4 is installed, and transformers 5.24 without ``tokenizers``
    fails to define it (TypeError): so torchmetrics is told transformers is absent while Lightning imports (no
    effect on what is measured; none at all where ``tokenizers`` is installed)."""
    import importlib.metadata

    import lightning_utilities.core.imports as lu_imports

    version = lu_imports._version

    def hide_transformers(distribution_name: str) -> str:
        if distribution_name == "transformers":
            raise importlib.metadata.PackageNotFoundError(distribution_name)
        return version(distribution_name)

    lu_imports._version = hide_transformers
    try:
        from lightning.pytorch.plugins.io import TorchCheckpointIO
    finally:
        lu_imports._version = version
    from alpsck.integrations.lightning import AlpsckCheckpointIO

    return TorchCheckpointIO, AlpsckCheckpointIO


class LightningBench(Bench):
    def __init__(self, nbytes: int, root: Path) -> None:
        import torch

        torch_io, alpsck_io = import_lightning_io()
        self.io = {"default": torch_io(), "alpsck": alpsck_io()}
        self.root = root
        numel = max(1, nbytes // (3 * 4 * LIGHTNING_PARAMS))
        torch.manual_seed(0)
        params = {f"model.layers.{i // 2}.{'weight' if i % 2 == 0 else 'bias'}": torch.randn(numel)
                  for i in range(LIGHTNING_PARAMS)}
        state = {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(numel), "exp_avg_sq": torch.rand(numel)}
                 for i in range(LIGHTNING_PARAMS)}
        group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
                 "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "params": list(range(LIGHTNING_PARAMS))}
        self.checkpoint: dict[str, Any] = {
            "epoch": 1, "global_step": 7, "pytorch-lightning_version": "2.6.0", "state_dict": params,
            "optimizer_states": [{"state": state, "param_groups": [group]}], "lr_schedulers": [],
            "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 2, "completed": 1}}}},
            "callbacks": {}, "hparams_name": "kwargs", "hyper_parameters": {"lr": 1e-3},
        }
        self.nbytes = 3 * LIGHTNING_PARAMS * numel * 4

    def save(self, method: str, i: int) -> tuple[float, float, Path]:
        io = self.io[method]
        path = self.root / method / f"epoch={i}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        io.save_checkpoint(self.checkpoint, path)
        t1 = time.perf_counter()
        if method == "alpsck":
            io.teardown()
        return t1 - t0, time.perf_counter() - t0, path

    def load(self, method: str, path: Path, check: bool) -> float:
        t0 = time.perf_counter()
        loaded = self.io[method].load_checkpoint(path)
        seconds = time.perf_counter() - t0
        if check:
            same(self.checkpoint, loaded, f"lightning {method} checkpoint")
        return seconds

    def remove(self, method: str, path: Path) -> None:
        self.io[method].remove_checkpoint(path)

    def close(self) -> None:
        self.io["alpsck"].teardown()


class TrainerBench(Bench):
    def __init__(self, nbytes: int, root: Path) -> None:
        from transformers import Trainer, TrainingArguments
        from transformers.utils import logging as hf_logging

        from alpsck.integrations.transformers import AlpsckTrainer

        hf_logging.set_verbosity_error()
        self.model = linear_model(nbytes)

        def args(method: str) -> Any:
            return TrainingArguments(output_dir=str(root / method), use_cpu=True, report_to=[], save_strategy="no",
                                     disable_tqdm=True)

        with quiet():
            self.trainers: dict[str, Any] = {"default": Trainer(model=self.model, args=args("default")),
                                             "alpsck": AlpsckTrainer(model=self.model, args=args("alpsck"))}
        first = self.trainers["default"]
        first.create_optimizer_and_scheduler(num_training_steps=10)
        adam_step(self.model, first.optimizer)
        first.lr_scheduler.step()
        self.trainers["alpsck"].optimizer = first.optimizer
        self.trainers["alpsck"].lr_scheduler = first.lr_scheduler
        self.nbytes = 3 * sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.reference: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None

    def save(self, method: str, i: int) -> tuple[float, float, Path]:
        tr = self.trainers[method]
        tr.state.global_step = i
        path = Path(tr.args.output_dir) / f"checkpoint-{i}"
        t0 = time.perf_counter()
        tr._save_checkpoint(tr.model, None)
        t1 = time.perf_counter()
        if method == "alpsck":
            tr._alpsck_wait()
        return t1 - t0, time.perf_counter() - t0, path

    def load(self, method: str, path: Path, check: bool) -> float:
        tr = self.trainers[method]
        if check:
            if self.reference is None:
                self.reference = ({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                                  adam_state_dict(tr.optimizer), tr.lr_scheduler.state_dict())
            scramble(self.model, tr.optimizer)
        t0 = time.perf_counter()
        folder = str(path)
        if method == "alpsck":
            folder, tr._alpsck_loaded = tr._alpsck_read(folder)
        try:
            tr._load_from_checkpoint(folder)
            tr._load_optimizer_and_scheduler(folder)
            tr._load_rng_state(folder)
        finally:
            if method == "alpsck":
                tr._alpsck_loaded = None
        seconds = time.perf_counter() - t0
        if check:
            assert self.reference is not None
            model, optimizer, scheduler = self.reference
            same(model, self.model.state_dict(), f"trainer {method} model")
            same(optimizer, tr.optimizer.state_dict(), f"trainer {method} optimizer")
            same(scheduler, tr.lr_scheduler.state_dict(), f"trainer {method} scheduler")
        return seconds

    def end_warmup(self) -> None:
        self.reference = None

    def close(self) -> None:
        self.trainers["alpsck"]._alpsck_wait()


class AccelerateBench(Bench):
    def __init__(self, nbytes: int, root: Path) -> None:
        import torch
        from accelerate import Accelerator
        from accelerate.logging import get_logger

        from alpsck.integrations.accelerate import AcceleratorCheckpointer

        get_logger("accelerate").setLevel(logging.ERROR)
        logging.getLogger("accelerate").setLevel(logging.ERROR)
        self.accelerator = Accelerator(cpu=True)
        model = linear_model(nbytes)
        self.model, self.optimizer = self.accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        adam_step(self.model, self.optimizer)
        self.root = root
        self.checkpointer = AcceleratorCheckpointer(self.accelerator, str(root / "alpsck"))
        self.nbytes = 3 * sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.reference: tuple[dict[str, Any], dict[str, Any]] | None = None

    def save(self, method: str, i: int) -> tuple[float, float, Path]:
        if method == "default":
            path = self.root / "default" / f"step-{i}"
            t0 = time.perf_counter()
            self.accelerator.save_state(str(path))
            seconds = time.perf_counter() - t0
            return seconds, seconds, path
        t0 = time.perf_counter()
        self.checkpointer.save(i)
        t1 = time.perf_counter()
        self.checkpointer.wait()
        return t1 - t0, time.perf_counter() - t0, self.root / "alpsck"

    def load(self, method: str, path: Path, check: bool) -> float:
        if check:
            if self.reference is None:
                self.reference = ({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                                  adam_state_dict(self.optimizer))
            scramble(self.model, self.optimizer)
        t0 = time.perf_counter()
        if method == "default":
            with quiet():
                self.accelerator.load_state(str(path))
        elif self.checkpointer.restore() is None:
            raise Mismatch(f"accelerate alpsck: no checkpoint restored from {path}")
        seconds = time.perf_counter() - t0
        self.checkpointer.restore_rng()
        if check:
            assert self.reference is not None
            same(self.reference[0], self.model.state_dict(), f"accelerate {method} model")
            same(self.reference[1], self.optimizer.state_dict(), f"accelerate {method} optimizer")
        return seconds

    def remove(self, method: str, path: Path) -> None:
        if method == "default":
            remove(path)  # alpsck's run directory keeps its newest (its retention removes the older ones)

    def end_warmup(self) -> None:
        self.reference = None

    def close(self) -> None:
        self.checkpointer.close()


BENCHES: dict[str, type[Bench]] = {"lightning": LightningBench, "trainer": TrainerBench, "accelerate": AccelerateBench}


# ------------------------------------------------------------------------------ one cell (a worker process)


def run_cell_here(framework: str, nbytes: int, reps: int, root: Path, out: Path | None, profile: Path | None) -> None:
    """The warm-up repetition and ``reps`` timed ones of one (framework, size); writes ``out`` (JSON)."""
    t_setup = time.perf_counter()
    bench = BENCHES[framework](nbytes, root)
    setup_s = time.perf_counter() - t_setup
    times: dict[str, dict[str, list[float]]] = {m: {x: [] for x in MEASURES} for m in METHODS}
    profiler: Any = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
    step = 0
    try:
        for rep in range(reps + 1):
            record = rep > 0
            order = METHODS if rep % 2 == 0 else METHODS[::-1]
            saved: dict[str, Path] = {}
            for method in order:
                step += 1
                os.sync()
                if profiler is not None and record and method == "alpsck":
                    profiler.enable()
                stall, durable, path = bench.save(method, step)
                if profiler is not None:
                    profiler.disable()
                synced = durable
                if method == "default":
                    t0 = time.perf_counter()
                    fsync_tree(path)
                    synced += time.perf_counter() - t0
                saved[method] = path
                if record:
                    for measure, seconds in (("stall", stall), ("durable", durable), ("synced", synced)):
                        times[method][measure].append(seconds)
            for method in order:  # from the device, then again at once (the defaults' files then in the page cache)
                for measure in ("cold", "load"):
                    if measure == "cold":
                        evict_tree(saved[method])
                    if profiler is not None and record and method == "alpsck":
                        profiler.enable()
                    seconds = bench.load(method, saved[method], check=not record)
                    if profiler is not None:
                        profiler.disable()
                    if record:
                        times[method][measure].append(seconds)
            for method in order:
                bench.remove(method, saved[method])
            if not record:
                bench.end_warmup()
                gc.collect()
            print(f"  {framework} {size_name(nbytes)}: rep {rep}{'' if record else ' (warm-up, loads checked)'} done",
                  file=sys.stderr, flush=True)
    except Mismatch as e:
        raise SystemExit(f"{framework} {size_name(nbytes)}: a load gave back other values than were saved: {e}") from e
    finally:
        bench.close()
    if profiler is not None and profile is not None:
        profiler.dump_stats(str(profile))
    if out is not None:
        out.write_text(json.dumps({"times": times, "nbytes": bench.nbytes, "setup_s": setup_s}))


# ------------------------------------------------------------------------------ the driver


def run_cell(framework: str, nbytes: int, reps: int, root: Path, timeout_s: float, profile: Path | None) -> dict[str, Any]:
    """One cell in a fresh process of this script; its JSON, or ``{"failed": why}``."""
    cell = root / f"{framework}-{size_name(nbytes)}"
    shutil.rmtree(cell, ignore_errors=True)
    cell.mkdir(parents=True)
    out = root / f"{framework}-{size_name(nbytes)}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--framework", framework, "--bytes", str(nbytes),
            "--reps", str(reps), "--dir", str(cell), "--out", str(out)]
    if profile is not None:
        argv += ["--profile", str(profile)]
    result = run_workers([argv], out, timeout_s)
    shutil.rmtree(cell, ignore_errors=True)
    return result


def table(results: list[tuple[str, int, int, dict[str, Any]]]) -> list[str]:
    head = (f"{'framework':<10} {'size':>7} {'state':>10} {'measure':<8} {'reps':>4}  {'default median':>14} "
            f"{'alpsck median':>13}  {'alpsck/default':>14}")
    lines = [head, "-" * len(head)]
    for framework, nbytes, reps, res in results:
        if "failed" in res:
            lines.append(f"{framework:<10} {size_name(nbytes):>7} {'':>10} {'all':<8} {reps:>4}  FAILED: {res['failed']}")
            continue
        state = f"{res['nbytes'] / (1 << 20):.1f} MiB"
        for measure in MEASURES:
            meds = {m: statistics.median(res["times"][m][measure]) if res["times"][m][measure] else None for m in METHODS}
            d, a = meds["default"], meds["alpsck"]
            ratio = f"{a / d:.2f}" if d and a is not None else "-"
            lines.append(f"{framework:<10} {size_name(nbytes):>7} {state:>10} {measure:<8} {reps:>4}  {fmt(d):>14} "
                         f"{fmt(a):>13}  {ratio:>14}")
    return lines


def versions() -> str:
    import importlib.metadata

    found = []
    for name in ("lightning", "transformers", "accelerate"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    return ", ".join(found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the checkpoints go (removed as it goes)")
    ap.add_argument("--sizes", default="2MiB,300MiB,2GiB", help="checkpoint sizes (float32 parameters + Adam moments)")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"some of {','.join(FRAMEWORKS)}")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per cell (default 7/5/3 by size)")
    ap.add_argument("--cell-timeout", type=float, default=600.0, help="seconds one cell may take")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--profile", type=Path, default=None,
                    help="cProfile alpsck's timed saves and loads into DIR/<framework>-<size>.prof (one cell per file)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--framework", default="", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_cell_here(args.framework, args.bytes, args.reps, args.dir, args.out, args.profile)
        return
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    if not sizes or not frameworks or any(f not in FRAMEWORKS for f in frameworks):
        ap.error(f"--sizes needs a size; --frameworks, some of {','.join(FRAMEWORKS)}")
    if args.reps is not None and args.reps < 1:
        ap.error("--reps must be at least 1")

    import torch

    header = [f"# torch {torch.__version__}, {versions()}, {os.cpu_count()} CPUs, alpsck {alpsck_version()}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load average {load_average()}",
              f"# command: {shlex.join(['python3', *sys.argv])}",
              "# one process; seconds; median of the timed reps (after one warm-up whose loads are checked equal);"
              " alpsck/default of the medians (< 1: alpsck faster)",
              "# stall: until save returns; durable: until on the device (alpsck: + its wait; the defaults never fsync, so"
              " theirs is their stall); synced: the defaults + an fsync of their files (alpsck: durable); cold: load with"
              " the files dropped from the page cache; load: again at once (the defaults' files cached, alpsck O_DIRECT)"]
    print("\n".join(header), flush=True)
    results: list[tuple[str, int, int, dict[str, Any]]] = []
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for framework in frameworks:
        for nbytes in sizes:
            reps = args.reps or default_reps(nbytes)
            print(f"cell {framework} {size_name(nbytes)}, {reps} reps ...", file=sys.stderr, flush=True)
            prof = args.profile / f"{framework}-{size_name(nbytes)}.prof" if args.profile is not None else None
            results.append((framework, nbytes, reps, run_cell(framework, nbytes, reps, args.dir, args.cell_timeout, prof)))
    lines = [*header, *table(results), f"# wall time {time.monotonic() - t0:.0f} s, load average {load_average()} at the end"]
    print("\n".join(lines[len(header):]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
