"""The reference training loop: a Llama-style model whose resumed runs reproduce losses bit for bit.

``train(cfg)`` runs steps ``restored + 1 .. cfg.training_steps`` on the calling thread. Per step:
poll ``stop_requested`` → (``fail_at_step``: ``os._exit(17)``, a simulated crash) → forward /
backward / clip / ``optimizer.step`` / ``scheduler.step`` → append the loss → every
``checkpoint_freq`` steps ``ckpt.save(step, state)`` with ``state = {"model", "optim", "sched",
"rng", "data", "step"}``. At the end (or on a stop request) it saves the last step if not saved
yet and waits until that checkpoint is durable.

Distributed: under ``torchrun`` or ``srun`` (``WORLD_SIZE > 1``) it joins the process group (gloo
on CPU, NCCL on CUDA), wraps the model in DDP and draws each rank's batch from ``(seed, step,
rank)``. With ``--checkpointer alpsck`` every rank saves its shard of each checkpoint: its own
RNG streams and data position, and its share of the model and optimizer tensors, which DDP keeps
identical on every rank and which are therefore written once (``replicated``). Whether to stop
or to checkpoint after a step is agreed by all ranks (one small all-reduce per step), so they
all save the same steps. The ``torch`` baseline saves on rank 0 only. Rank 0 writes the loss
file (its local loss).

Determinism: seeds python/numpy/torch, enables ``torch.use_deterministic_algorithms`` (warn-only
on CUDA) and sets ``CUBLAS_WORKSPACE_CONFIG``; these are process-wide settings and stay set.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import (
    CosineAnnealingLR,
    LinearLR,
    LRScheduler,
    SequentialLR,
)

from alpsck.errors import ConfigError
from alpsck.examples.llama.data import (
    TEXT_VOCAB,
    SyntheticBatches,
    TextBatches,
    read_corpus,
)
from alpsck.examples.llama.model import ModelArgs, Transformer
from alpsck.handles import CheckpointerLike
from alpsck.options import DEFAULTS
from alpsck.options import problem as option_problem
from alpsck.rng import RNGState
from alpsck.store.durable import replace_durably
from alpsck.store.retention import RULES

if TYPE_CHECKING:  # imported when used: the alpsck checkpointer (compiled core) is optional here
    from alpsck.restore import Rollback, RollbackRecord

log = logging.getLogger("alpsck.examples.llama")

FAIL_EXIT_CODE = 17
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CHECKPOINTERS = ("torch", "alpsck")
LOSS_HEADER = "step,loss\n"
REPLICATED = ("model", "optim")  # identical on every DDP rank: written once per checkpoint


RETENTION = RULES[1:]  # TrainConfig's retention keys beside keep_last (the alpsck checkpointer's)


@dataclass
class TrainConfig:
    """Every knob of the reference training; field names match the CLI flags (``_`` ↔ ``-``)."""

    seed: int = 0
    training_steps: int = 100
    checkpoint_freq: int = 50  # 0: no periodic checkpoints (the last step is still saved)
    memory_every: int = 0  # alpsck: also a checkpoint to the memory tier every N steps (0: none)
    model_dtype: str = "fp32"
    sequence_length: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_theta: float = 500000.0
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: str = "cosine"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_dir: str = "checkpoints"
    checkpointer: str = "alpsck"
    load_checkpoint: bool = False
    load_checkpoint_dir: str | None = None  # None: the newest valid checkpoint in checkpoint_dir
    fail_at_step: int | None = None
    loss_file: str | None = None
    max_in_flight: int = DEFAULTS["max_in_flight"]  # the Checkpointer's defaults (alpsck.options)
    threads: int = DEFAULTS["threads"]
    keep_last: int = DEFAULTS["keep_last"]
    # Retention beside keep_last (alpsck checkpointer only; docs/retention.md): the engine's options.
    keep_every_steps: int = DEFAULTS["keep_every_steps"]
    keep_every_seconds: float = DEFAULTS["keep_every_seconds"]
    keep_best: str = DEFAULTS["keep_best"]
    overlap_copy: bool = False  # alpsck: pipelined snapshots for CPU states too (always on for GPU ones)
    data_file: str | None = None
    data_column: str = "text"
    device: str | None = None  # None: cuda if available, else cpu
    torch_threads: int | None = None
    log_every: int = 10
    min_step_seconds: float = 0.0  # pad each step to this wall time (stands in for a bigger model)
    # In-process rollback on a bad loss (alpsck checkpointer only; alpsck.restore.Rollback): a run whose
    # losses stay finite (and under the spike bound) is bit-exact with rollback off.
    rollback: bool = True
    max_rollbacks: int = 3  # the next bad loss after these many rollbacks of the run ends it: do not requeue
    rollback_skip_batches: int | None = None  # batches skipped after the step restored (None: the steps rolled back)
    spike_factor: float | None = None  # a loss above this x the median of the last 8 is bad too (None: off)
    nan_at_step: int | None = None  # a test's fault: the loss of step N becomes NaN (once: not after a rollback from N)

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad field."""
        positive = ("training_steps", "sequence_length", "dim", "n_layers", "n_heads", "vocab_size",
                    "multiple_of", "batch_size", "max_in_flight", "threads", "keep_last")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in RETENTION:
            why = option_problem(name, getattr(self, name))
            if why is not None:
                raise ConfigError(f"{name}: {why}")
            if self.checkpointer != "alpsck" and getattr(self, name) != DEFAULTS[name]:
                raise ConfigError(f"{name}: the alpsck checkpointer's retention rule (checkpointer is "
                                  f"{self.checkpointer!r})")
        if self.memory_every and self.checkpointer != "alpsck":
            raise ConfigError(f"memory_every: the alpsck checkpointer's memory tier (checkpointer is {self.checkpointer!r})")
        for name in ("checkpoint_freq", "memory_every", "warmup_steps", "log_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_rollbacks", "rollback_skip_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.nan_at_step is not None and self.nan_at_step < 1:
            raise ConfigError(f"nan_at_step must be >= 1 (a step of the run), got {self.nan_at_step}")
        why = None if self.spike_factor is None else option_problem("spike_factor", self.spike_factor)
        if why is not None:  # the options table's limits (alpsck.options; NaN refused too)
            raise ConfigError(f"spike_factor: {why}")
        if not 0 <= self.min_step_seconds < float("inf"):  # also refuses NaN
            raise ConfigError(f"min_step_seconds must be finite and >= 0, got {self.min_step_seconds}")
        if self.model_dtype not in DTYPES:
            raise ConfigError(f"model_dtype must be one of {sorted(DTYPES)}, got {self.model_dtype!r}")
        if self.checkpointer not in CHECKPOINTERS:
            raise ConfigError(f"checkpointer must be one of {CHECKPOINTERS}, got {self.checkpointer!r}")
        if self.schedule not in ("cosine", "linear"):
            raise ConfigError(f"schedule must be 'cosine' or 'linear', got {self.schedule!r}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"lr must be > 0 and min_lr_ratio in [0, 1], got {self.lr}, {self.min_lr_ratio}")
        if self.warmup_steps >= self.training_steps:
            raise ConfigError(f"warmup_steps ({self.warmup_steps}) must be < training_steps ({self.training_steps})")
        if self.data_file is not None and self.vocab_size < TEXT_VOCAB:
            raise ConfigError(f"vocab_size must be >= {TEXT_VOCAB} with data_file, got {self.vocab_size}")
        try:
            self.model_args().validate()
        except ValueError as e:
            raise ConfigError(f"n_heads/n_kv_heads/dim: {e}") from None

    def model_args(self) -> ModelArgs:
        return ModelArgs(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                         n_kv_heads=self.n_kv_heads, vocab_size=self.vocab_size,
                         multiple_of=self.multiple_of, ffn_dim_multiplier=self.ffn_dim_multiplier,
                         rope_theta=self.rope_theta)


@dataclass
class TrainResult:
    final_step: int  # the last completed step
    stopped: bool  # True when stop_requested ended the run early
    restored_step: int | None  # the step resumed from, None for a fresh start
    last_loss: float | None
    saved_steps: list[int] = field(default_factory=list)  # steps this process saved
    rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (from step, to step) of this process's rollbacks


def make_checkpointer(kind: str, run_dir: str | Path, *, max_in_flight: int, threads: int,
                      keep_last: int, overlap_copy: bool = False, numa_node: int = -1, memory: bool = False,
                      **retention: Any) -> CheckpointerLike:
    """``"torch"``: :class:`alpsck.torch_save.TorchSaveCheckpointer`; ``"alpsck"``: the concurrent one,
    a shard per rank when torch.distributed is initialised (model and optimizer written once), its
    staging memory on NUMA node ``numa_node`` (-1: first touch)."""
    if kind == "torch":
        from alpsck.torch_save import TorchSaveCheckpointer

        return TorchSaveCheckpointer(run_dir, keep_last=keep_last)
    if kind == "alpsck":
        # Imported lazily: the concurrent checkpointer is optional (and may not exist yet).
        try:
            from alpsck.checkpointer import Checkpointer
        except ImportError as e:
            raise ConfigError(f"checkpointer 'alpsck' is not available here ({e}); use 'torch'") from e

        return Checkpointer(run_dir, max_in_flight=max_in_flight, threads=threads, keep_last=keep_last,
                            replicated=REPLICATED, overlap_copy=overlap_copy or None, numa_node=numa_node,
                            memory=memory, **retention)
    raise ConfigError(f"checkpointer must be one of {CHECKPOINTERS}, got {kind!r}")


def make_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig) -> LRScheduler:
    """Linear warmup, then cosine or linear decay to ``lr * min_lr_ratio``; no lambdas, so it checkpoints."""
    decay_steps = max(1, cfg.training_steps - cfg.warmup_steps)
    main: LRScheduler
    if cfg.schedule == "cosine":
        main = CosineAnnealingLR(opt, T_max=decay_steps, eta_min=cfg.lr * cfg.min_lr_ratio)
    else:
        main = LinearLR(opt, start_factor=1.0, end_factor=max(cfg.min_lr_ratio, 1e-8), total_iters=decay_steps)
    if cfg.warmup_steps == 0:
        return main
    warmup = LinearLR(opt, start_factor=1.0 / cfg.warmup_steps, end_factor=1.0, total_iters=cfg.warmup_steps)
    return SequentialLR(opt, [warmup, main], milestones=[cfg.warmup_steps])


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norm weights)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _open_loss_file(path: str, restored_step: int | None) -> IO[str]:
    """Keep the lines of steps <= restored_step (none on a fresh start), then open for appending."""
    p = Path(path)
    kept: list[str] = []
    if restored_step is not None and p.exists():
        for line in p.read_text().splitlines(keepends=True)[1:]:
            head = line.split(",", 1)[0]
            if head.isdigit() and int(head) <= restored_step and line.endswith("\n"):
                kept.append(line)
    p.parent.mkdir(parents=True, exist_ok=True)
    replace_durably(p, (LOSS_HEADER + "".join(kept)).encode())  # p.tmp, fsync, rename: the one durable write
    return open(p, "a", encoding="utf-8", newline="\n")  # closed by _train()


def _setup_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device, bool]:
    """Returns (rank, world_size, device, whether this call initialised the process group)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        # Several visible GPUs: one per local rank. One (SLURM's --gpus-per-task=1): that one.
        visible = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % visible if world > 1 and visible > 1 else torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world <= 1:
        return 0, 1, device, False
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device, created


def _seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")


def train(cfg: TrainConfig, *, stop_requested: Callable[[], bool] | None = None,
          checkpoint_due: Callable[[int], str | bool] | None = None,
          on_rollback: Callable[[RollbackRecord], None] | None = None) -> TrainResult:
    """Train per ``cfg``; see the module docstring for the step order.

    ``stop_requested`` is polled on the training thread at every step boundary (make it cheap,
    e.g. read a flag a signal handler sets). When it returns True (on any rank), the current step
    is saved if it was not yet, the save is waited for, and the result has ``stopped=True``.
    ``on_rollback`` is called (on every rank) with the record of each in-process rollback.
    """
    cfg.validate()
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    rank, world, device, created_group = _setup_distributed(cfg)
    try:
        return _train(cfg, rank, world, device, stop_requested, checkpoint_due, on_rollback)
    finally:
        if created_group and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, rank: int, world: int, device: torch.device,
           stop_requested: Callable[[], bool] | None, checkpoint_due: Callable[[int], str | bool] | None,
           on_rollback: Callable[[RollbackRecord], None] | None = None) -> TrainResult:
    _seed_everything(cfg.seed, device)
    with torch.device(device):
        model = Transformer(cfg.model_args())
    model.to(dtype=DTYPES[cfg.model_dtype])
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg)
    data: SyntheticBatches | TextBatches
    if cfg.data_file:
        data = TextBatches(read_corpus(cfg.data_file, cfg.data_column), cfg.batch_size, cfg.sequence_length,
                           cfg.seed, rank)
    else:
        data = SyntheticBatches(cfg.vocab_size, cfg.batch_size, cfg.sequence_length, cfg.seed, rank)
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "data": data,
                             "step": 0}

    ckpt_kwargs: dict[str, Any] = {"max_in_flight": cfg.max_in_flight, "threads": cfg.threads,
                                   "keep_last": cfg.keep_last}
    sharded = cfg.checkpointer == "alpsck"  # every rank saves its shard (else rank 0 alone)
    if sharded:
        ckpt_kwargs["overlap_copy"] = cfg.overlap_copy
        ckpt_kwargs["memory"] = bool(cfg.memory_every)
        ckpt_kwargs.update({name: getattr(cfg, name) for name in RETENTION})
        if device.type == "cuda":  # staging on the Grace of this rank's GPU (alpsck.staging)
            from alpsck.staging import gpu_numa_node

            ckpt_kwargs["numa_node"] = gpu_numa_node(device)
    ckpt = make_checkpointer(cfg.checkpointer, cfg.checkpoint_dir, **ckpt_kwargs) if rank == 0 or sharded else None
    restored: int | None = None
    tier: str | None = None
    if cfg.load_checkpoint:
        src = Path(cfg.load_checkpoint_dir or cfg.checkpoint_dir)
        if ckpt is not None and src.resolve() == Path(cfg.checkpoint_dir).resolve():
            restored = ckpt.restore(state)
            tier = getattr(ckpt, "restored_tier", None)  # alpsck's: memory, replica or run_dir
        elif sharded:
            from alpsck.checkpointer import Checkpointer, restore_into  # restore_into is read-only: no run-dir lock

            assert isinstance(ckpt, Checkpointer)  # sharded: the alpsck checkpointer, on every rank
            restored = restore_into(src, state, ranks=ckpt.ranks)
        else:
            reader = make_checkpointer(cfg.checkpointer, src, **ckpt_kwargs)
            try:
                restored = reader.restore(state)
            finally:
                reader.close()
        if rank == 0 and restored is None:
            log.info("no valid checkpoint in %s; starting fresh", src)
        elif rank == 0:
            log.info("resumed from step %d of %s%s", restored, src, f" (from {tier})" if tier else "")
    if world > 1:
        dist.barrier()
    step = restored if restored is not None else 0
    state["step"] = step

    net: nn.Module = model
    if world > 1:
        net = _ddp(model, device)

    loss_file = _open_loss_file(cfg.loss_file, restored) if cfg.loss_file and rank == 0 else None
    rb: Rollback | None = None  # alpsck checkpointer only: the torch baseline has no restore on every rank
    if sharded and cfg.rollback and ckpt is not None:
        from alpsck.checkpointer import Checkpointer
        from alpsck.restore import Rollback

        assert isinstance(ckpt, Checkpointer)  # sharded: the alpsck checkpointer, on every rank
        rb = Rollback(ckpt, state, max_rollbacks=cfg.max_rollbacks, skip_batches=cfg.rollback_skip_batches,
                      spike_factor=cfg.spike_factor, on_rollback=on_rollback,
                      forget=not cfg.load_checkpoint)  # a fresh start: earlier rollbacks are another history's
    result = TrainResult(final_step=step, stopped=False, restored_step=restored, last_loss=None)
    last_saved = restored

    def save(s: int, urgent: bool = False, tier: str = "run_dir") -> None:
        nonlocal last_saved
        state["step"] = s
        if ckpt is not None:
            # The step's loss goes into the checkpoint's manifest (alpsck's Checkpointer): a NaN one is
            # then unhealthy, and no restore resumes from it (rank 0's loss is what is recorded).
            kw: dict[str, Any] = {"metrics": {"loss": result.last_loss}} if sharded and result.last_loss is not None else {}
            if tier != "run_dir":
                kw["tier"] = tier
            ckpt.save(s, state, urgent=urgent, **kw)
            result.saved_steps.append(s)
        last_saved = s

    try:
        t0 = time.perf_counter()
        _, stop, _ = _agree(world, device, False, bool(stop_requested and stop_requested()), False)
        s = step
        while s < cfg.training_steps:
            s += 1
            if stop:
                result.stopped = True
                break
            if cfg.fail_at_step is not None and s == cfg.fail_at_step:
                if loss_file is not None:
                    loss_file.flush()
                os._exit(FAIL_EXIT_CODE)  # a simulated crash: in-flight checkpoints may be lost
            if rb is not None:  # the windows that led to earlier rollbacks (none: nothing changes)
                data.position += rb.skip_before(s)
            t_step = time.perf_counter()
            inputs, targets = (t.to(device, non_blocking=True) for t in data.next())
            logits = net(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            if s == cfg.nan_at_step and not (rb is not None and rb.rolled_back_from(s)):
                loss = loss * float("nan")  # the injected fault: NaN gradients, then NaN parameters
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            value = float(loss.item())
            result.final_step, result.last_loss = s, value
            if loss_file is not None:
                loss_file.write(f"{s},{value!r}\n")
                loss_file.flush()
            if rank == 0 and cfg.log_every and s % cfg.log_every == 0:
                log.info("step %d loss %.4f lr %.3g (%.1f steps/s)", s, value, sched.get_last_lr()[0],
                         (s - step) / max(time.perf_counter() - t0, 1e-9))
            if cfg.min_step_seconds:  # padding changes only the pace, never the losses
                time.sleep(max(0.0, t_step + cfg.min_step_seconds - time.perf_counter()))
            due = _tier_due(checkpoint_due(s) if checkpoint_due is not None else
                            "run_dir" if cfg.checkpoint_freq and s % cfg.checkpoint_freq == 0 else
                            "memory" if cfg.memory_every and s % cfg.memory_every == 0 else "")
            # Not polled after the last step: the run is complete, and a stop it answered True to
            # would make the SLURM runner requeue (or give up on) a finished run.
            asked = bool(stop_requested and s < cfg.training_steps and stop_requested())
            why = rb.problem(s, value) if rb is not None else None
            due, stop, bad = _agree(world, device, due, asked, why is not None)
            if bad and rb is not None:  # every rank rolls back together (the restore is a collective)
                r = rb.roll_back(s, why or "the loss of another rank went bad")
                log.warning("step %d: %s: rolled back to step %d, skipping %d batch(es)", s,
                            why or "another rank's loss", r, rb.records[-1].skip)
                if loss_file is not None:  # the trace continues from the step restored, as on a resume
                    loss_file.close()
                    loss_file = _open_loss_file(cfg.loss_file or "", r)
                result.rollbacks.append((s, r))
                result.final_step, result.last_loss, last_saved, state["step"] = r, None, r, r
                s = r
                continue
            if due:
                save(s, tier=TIERS_DUE[due])
        if last_saved != result.final_step:
            save(result.final_step, urgent=result.stopped)  # a final checkpoint races a deadline
        if ckpt is not None:
            ckpt.wait()
        if world > 1:
            dist.barrier()
    finally:
        if loss_file is not None:
            loss_file.close()
        if ckpt is not None:
            ckpt.close()
    return result


# A checkpoint due, as a number the ranks agree on by their maximum: none, the memory tier, the run directory
# (where any rank says the run directory, every rank saves there).
TIERS_DUE = ("", "memory", "run_dir")


def _tier_due(due: str | bool) -> int:
    """``job.checkpoint_due``'s answer (a tier, "" for none; True: the run directory) as TIERS_DUE's index."""
    return TIERS_DUE.index("run_dir" if due is True else due or "")


def _ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP with one gradient bucket layout for the whole run, so that a resumed run sums every gradient in the
    order the uninterrupted run did. DDP's default rebuilds its buckets after the first iteration, in the order
    the gradients became ready (here not the parameters' reverse order, the first iteration's), and a ring
    all-reduce over 3 or more ranks adds each element in an order set by its place in the bucket: the first step
    after every resume then differed in the last bits (measured at 4 ranks under SLURM: every tensor at step 40,
    losses at steps 39 and 44; 2 ranks cannot show it, a + b == b + a). DDP never rebuilds when it looks for
    unused parameters; the price is a walk of the autograd graph per step, a small all-reduce of a used-map, and
    torch's one warning per rank that it found no unused parameter."""
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                               find_unused_parameters=True)


def _agree(world: int, device: torch.device, due: int, stop: bool, bad: bool) -> tuple[int, bool, bool]:
    """(checkpoint now: TIERS_DUE's index, stop now, roll back now), each the most any rank says: all ranks
    save the same steps to the same tier, and roll back together."""
    if world > 1:
        t = torch.tensor([due, int(stop), int(bad)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        due, stop, bad = int(t[0].item()), bool(t[1].item()), bool(t[2].item())
    return due, stop, bad


def build_parser() -> argparse.ArgumentParser:
    """The CLI of ``python -m alpsck.examples.llama``; one flag per :class:`TrainConfig` field."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m alpsck.examples.llama",
                                description="Llama-style reference training with crash-consistent checkpoints.")
    add = p.add_argument
    add("--seed", type=int, default=d.seed)
    add("--training-steps", type=int, default=d.training_steps)
    add("--checkpoint-freq", type=int, default=d.checkpoint_freq, help="save every N steps (0: only the last)")
    add("--memory-every", type=int, default=d.memory_every, metavar="N",
        help="alpsck: also save to the memory tier (node shared memory) every N steps (0: never)")
    add("--model-dtype", choices=sorted(DTYPES), default=d.model_dtype)
    add("--sequence-length", type=int, default=d.sequence_length)
    add("--dim", type=int, default=d.dim)
    add("--n-layers", type=int, default=d.n_layers)
    add("--n-heads", type=int, default=d.n_heads)
    add("--n-kv-heads", type=int, default=d.n_kv_heads)
    add("--vocab-size", type=int, default=d.vocab_size)
    add("--multiple-of", type=int, default=d.multiple_of)
    add("--ffn-dim-multiplier", type=float, default=d.ffn_dim_multiplier)
    add("--rope-theta", type=float, default=d.rope_theta)
    add("--batch-size", type=int, default=d.batch_size)
    add("--lr", type=float, default=d.lr)
    add("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    add("--warmup-steps", type=int, default=d.warmup_steps)
    add("--schedule", choices=("cosine", "linear"), default=d.schedule)
    add("--weight-decay", type=float, default=d.weight_decay)
    add("--grad-clip", type=float, default=d.grad_clip)
    add("--checkpoint-dir", default=d.checkpoint_dir)
    add("--checkpointer", choices=CHECKPOINTERS, default=d.checkpointer)
    add("--load-checkpoint", nargs="?", const="", default=None, metavar="RUN_DIR",
        help="resume from the newest valid checkpoint in RUN_DIR (default: --checkpoint-dir)")
    add("--fail-at-step", type=int, default=None, help=f"simulate a crash: exit {FAIL_EXIT_CODE} on reaching step N")
    add("--loss-file", default=None, help="CSV step,loss (rank 0)")
    add("--max-in-flight", type=int, default=d.max_in_flight)
    add("--threads", type=int, default=d.threads, help="checkpoint writer threads")
    add("--keep-last", type=int, default=d.keep_last)
    add("--keep-every-steps", type=int, default=d.keep_every_steps, metavar="N", help="also keep every step N*k")
    add("--keep-every-seconds", type=float, default=d.keep_every_seconds, metavar="S",
        help="also keep one checkpoint per S seconds")
    add("--keep-best", default=d.keep_best, metavar="METRIC:MODE:K", help="also keep the K best by a metric (loss:min:2)")
    add("--overlap-copy", action="store_true",
        help="alpsck: copy the model and optimizer out while the next step runs (GPU states always do)")
    add("--data-file", default=None, help="local .txt or .parquet (byte-level tokens); default: synthetic")
    add("--data-column", default=d.data_column)
    add("--device", default=None)
    add("--torch-threads", type=int, default=None, help="torch.set_num_threads")
    add("--log-every", type=int, default=d.log_every)
    add("--rollback", action=argparse.BooleanOptionalAction, default=d.rollback,
        help="alpsck: on a NaN/inf (or spiking) loss, restore the newest healthy checkpoint in-process and go on")
    add("--max-rollbacks", type=int, default=d.max_rollbacks,
        help="the next bad loss after N rollbacks ends the run (under SLURM: gave_up, do not requeue)")
    add("--rollback-skip-batches", type=int, default=None, metavar="N",
        help="batches skipped after the step restored (default: as many as the steps rolled back)")
    add("--spike-factor", type=float, default=None, metavar="F",
        help="a loss above F x the median of the last 8 counts as bad too (default: off)")
    add("--nan-at-step", type=int, default=None, metavar="N", help="test fault: the loss of step N becomes NaN (once)")
    add("--min-step-seconds", type=float, default=d.min_step_seconds, metavar="S",
        help="pad every step to at least S seconds of wall time: a bigger model's pace without its compute "
             "(requeue demos, tests whose jobs must run a known time whatever the load)")
    return p


def config_from_args(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    load = args.pop("load_checkpoint")
    return TrainConfig(**args, load_checkpoint=load is not None, load_checkpoint_dir=load or None)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train; returns the process exit code (2 for a configuration error)."""
    cfg = config_from_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        train(cfg)
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    return 0


def slurm_entry(job: Any) -> TrainResult:
    """Entry point for ``alpsck submit`` (``entry.function: alpsck.examples.llama.train:slurm_entry``).

    ``entry.args`` are this module's CLI flags. The run dir, checkpoint settings and resume come
    from the job config: checkpoints go to ``run_dir`` through the alpsck checkpointer, every
    start resumes from the newest valid one, the loss trace goes to ``run_dir/loss.csv`` unless
    ``--loss-file`` says otherwise, and a stop request (time limit, preemption, maintenance,
    scancel) ends the loop at a step boundary with a final durable checkpoint. Each in-process
    rollback (a NaN loss, say) is a ``rollback`` event in the run's history; after ``--max-rollbacks``
    the job gives up (exit 93, do not requeue).
    """
    cfg = config_from_args(job.argv)
    ck = job.config.checkpoint
    cfg = replace(cfg, checkpoint_dir=job.run_dir, checkpointer="alpsck", load_checkpoint=True, load_checkpoint_dir=None,
                  max_in_flight=ck.max_in_flight, threads=ck.threads, keep_last=ck.keep_last, memory_every=ck.memory_every,
                  **{name: getattr(ck, name) for name in RETENTION},
                  spike_factor=cfg.spike_factor if cfg.spike_factor is not None else ck.spike_factor or None,
                  loss_file=cfg.loss_file or os.path.join(job.run_dir, "loss.csv"))
    return train(cfg, stop_requested=job.stop_requested, checkpoint_due=job.checkpoint_due,
                 on_rollback=_history_of_rollbacks(job))


def _history_of_rollbacks(job: Any) -> Callable[[RollbackRecord], None]:
    """A ``rollback`` event in the run's history per rollback (rank 0 writes it; the others do nothing)."""
    from alpsck.slurm import history  # the apps layer: the checkpointer's layer never imports slurm

    def record(rec: RollbackRecord) -> None:
        if job.rank == 0:
            history.append(job.run_dir, history.Rollback(job_id=job.job_id, step=rec.to_step, from_step=rec.from_step,
                                                         reason=rec.reason, skip=rec.skip,
                                                         seconds=round(rec.wait_s + rec.restore_s, 3)))
    return record
