"""A Lightning ``fit`` under ``alpsck submit``: :class:`AlpsckJob`, a callback that makes the job's time limit,
preemption or maintenance a final checkpoint, the requeue and an exact resume (recipe: docs/lightning.md).

    def main(job):                                   # the config's entry.function
        bridge = AlpsckJob(job)
        trainer = L.Trainer(plugins=[AlpsckCheckpointIO()], callbacks=[bridge], ...)
        trainer.fit(model, data, ckpt_path=bridge.ckpt_path)

One owner of the signals. Lightning's ``fit`` puts its own handlers over the job's: on SLURM it would requeue the
job itself on SIGUSR1 (``SLURMEnvironment(auto_requeue=True)``, the default), and on every SIGTERM it raises at
the next batch, before any final checkpoint. The callback turns the first off (before ``fit`` installs it) and
puts the job's handlers back once ``fit`` has installed its own (``on_train_start``), so every stop reaches
:meth:`alpsck.slurm.JobContext.stop_requested` and nothing else.

After each optimizer step (not inside a gradient accumulation: gradients are not in a checkpoint) the ranks agree,
in one all-reduce, on whether the job's ``checkpoint`` section wants a checkpoint now
(:meth:`~alpsck.slurm.JobContext.checkpoint_due`) and whether a stop came. Either way ``trainer.save_checkpoint``
writes the whole of Lightning's checkpoint into the job's run directory, through the ``AlpsckCheckpointIO`` plugin
and one Checkpointer kept open with the config's settings and retention (``AlpsckCheckpointIO.route``); at a stop
it waits until that save is durable and sets ``trainer.should_stop``. The runner then records the final checkpoint
and requeues, as for any entry. ``ckpt_path`` is the run directory when the job resumes, and the plugin loads its
newest valid checkpoint (every chunk CRC-checked; a damaged one is skipped, and the runner records the step used).

Exact, bit for bit: Lightning restores the model, the optimizers, the schedulers and its loops, and the train
loader's position when the loader is resumable (``state_dict``/``load_state_dict``: :class:`alpsck.data.ResumableLoader`
is one, and with a length Lightning fetches no batch ahead, so the position saved is the batches trained). Lightning
keeps no random state; this callback keeps every rank's (python, numpy, torch CPU and CUDA: :class:`alpsck.rng.RNGState`)
and puts it back before the first resumed batch, so dropout draws what it would have. Not in the memory tier: a
``checkpoint.memory_every`` is not applied here, with a warning (the plugin writes the run directory). With
``checkpoint.keep_best`` (``val_loss:min:3``) each save records the value Lightning's ``trainer.callback_metrics``
holds for that metric (what the model logged), which the rule ranks by. Strategies whose checkpoints go through the
``CheckpointIO`` plugin (one device, DDP), and :class:`.lightning_sharded.AlpsckModelParallelStrategy` (FSDP2,
tensor parallelism), whose every rank writes its shard as a DCP step of the run directory.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..options import keep_best_text
from ..progress import RESTORED_HOOKS
from ..rng import RNGState
from ..slurm.context import JobContext, current_job
from ..store.picker import taken_at
from ..store.retention import RULES
from .lightning import AlpsckCheckpointIO, Callback
from .lightning_sharded import AlpsckModelParallelStrategy


def _any_rank(trainer: Any, *flags: bool) -> list[bool]:
    """Each flag, true where any rank's is (one all-reduce; the flags as they are with one rank)."""
    if trainer.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=trainer.strategy.root_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _ranked_metric(trainer: Any, keep_best: Any) -> Callable[[], dict[str, float]] | None:
    """What each save records for ``checkpoint.keep_best``: the value its metric has in Lightning's
    ``trainer.callback_metrics`` (what ``self.log`` logged), when it has one; None without ``keep_best``."""
    text = keep_best_text(keep_best)
    if not text:
        return None
    name = str(text).rsplit(":", 2)[0]

    def metrics() -> dict[str, float]:
        value = trainer.callback_metrics.get(name)
        return {name: float(value)} if value is not None and torch.as_tensor(value).numel() == 1 else {}

    return metrics


class AlpsckJob(Callback):  # type: ignore[misc]
    """Lightning's ``fit`` as an ``alpsck submit`` job's training loop (module docstring). ``job``: the entry's
    argument (by default the running job's)."""

    def __init__(self, job: JobContext | None = None) -> None:
        super().__init__()
        job = job if job is not None else current_job()
        if job is None:
            raise UsageError("AlpsckJob: no alpsck submit job runs in this process (start it with alpsck submit, "
                             "or leave the callback out)")
        self.job = job
        self._saved: int | None = None  # the step of this fit's last save into the run directory
        self._rng: dict[str, Any] | None = None  # this rank's random state, put back before the first batch

    @property
    def ckpt_path(self) -> str | None:
        """``fit``'s ``ckpt_path``: the job's run directory when the job resumes from a checkpoint, else None."""
        return self.job.run_dir if self.job.resume_step is not None else None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy, io = trainer.strategy, trainer.strategy.checkpoint_io
        sharded = isinstance(strategy, AlpsckModelParallelStrategy) and strategy._save_distributed_checkpoint
        if not sharded and not isinstance(io, AlpsckCheckpointIO):
            raise UsageError("AlpsckJob saves through alpsck: L.Trainer(plugins=[AlpsckCheckpointIO()], "
                             "callbacks=[AlpsckJob(job)], ...), or with strategy=AlpsckModelParallelStrategy(...)")
        env: Any = getattr(strategy, "cluster_environment", None)
        if getattr(env, "auto_requeue", False):  # SLURMEnvironment's, on by default
            env.auto_requeue = False  # before fit installs its handlers: alpsck requeues
            if trainer.is_global_zero:
                print("alpsck: Lightning's SLURM auto-requeue is off: the job requeues through alpsck",
                      file=sys.stderr, flush=True)
        ck = self.job.config.checkpoint
        metrics = _ranked_metric(trainer, ck.keep_best)
        if sharded:  # every rank writes its shard: the run directory's steps, with the config's threads and retention
            strategy.route(self.job.run_dir, metrics=metrics, threads=ck.threads,
                           **{rule: getattr(ck, rule) for rule in RULES})
        elif trainer.is_global_zero:  # Lightning saves on global rank 0, the whole state: a checkpoint of one rank
            io.route(self.job.run_dir, self.job.checkpointer(rank=0, world_size=1, memory=False), metrics=metrics)
        if ck.memory_every and trainer.is_global_zero:
            warnings.warn(f"{self.job.config.source}: checkpoint.memory_every ({ck.memory_every}) is not applied to a "
                          "Lightning job: its checkpoints all go to the run directory (docs/lightning.md)",
                          RuntimeWarning, stacklevel=2)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.job.stop.claim_signals()  # fit has put its handlers over the job's: the job's go back
        if self._rng is not None:
            RNGState().load_state_dict(self._rng)
            self._rng = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return  # inside a gradient accumulation: the gradients so far are in no checkpoint
        step = trainer.global_step
        due, stop = _any_rank(trainer, self.job.checkpoint_due(step) == "run_dir", self.job.stop_requested())
        if (due or stop) and step != self._saved:
            trainer.save_checkpoint(self.job.run_dir)
            self._saved = step
        if stop:
            io = trainer.strategy.checkpoint_io
            if trainer.is_global_zero and isinstance(io, AlpsckCheckpointIO):  # a sharded save is durable already
                io.wait(self.job.run_dir)  # the final checkpoint durable
            trainer.strategy.barrier("alpsck: the final checkpoint")
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        """Every rank's random state (an all-gather: Lightning takes a checkpoint's state on every rank)."""
        mine = RNGState().state_dict()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)  # between this job's ranks, in memory: never read from storage
        else:
            everyone = [mine]
        return {"rng": everyone}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        everyone = state_dict.get("rng") or []
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if len(everyone) != world:
            warnings.warn(f"AlpsckJob: the checkpoint holds the random state of {len(everyone)} rank(s) and this fit "
                          f"has {world}: the random streams go on from where they are", RuntimeWarning, stacklevel=2)
            return
        self._rng = everyone[dist.get_rank() if world > 1 else 0]

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        step = int(checkpoint.get("global_step", 0))
        for hook in list(RESTORED_HOOKS):  # the runner records the step used (a fall-back past a damaged one)
            hook(Path(self.job.run_dir), step, "run_dir", taken_at(self.job.run_dir, step))
