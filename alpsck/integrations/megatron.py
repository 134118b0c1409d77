"""Megatron-LM's distributed checkpoints through alpsck (megatron-core 0.16): a save and a load strategy for
``megatron.core.dist_checkpointing``, backend ``"alpsck"``.

Megatron's ``torch_dist`` format turns its ``ShardedTensor`` s into torch.distributed.checkpoint (DCP) ones and
writes them with its own ``FileSystemWriterAsync``. :class:`AlpsckSaveStrategy` does the same translation and writes
them with alpsck's DCP storage (:class:`alpsck.dcp.AlpsckStorageWriter`, in ``CHECKPOINT/alpsck``): each rank's
shard written at the disk's speed, every chunk with its CRC32C, one atomic commit, no pickle in what it writes.
``metadata.json`` records the backend, so ``dist_checkpointing.load`` picks :class:`AlpsckLoadStrategy` by itself
once :func:`install` registered it; that load checks every chunk's CRC and reshards as DCP does::

    from alpsck.integrations import megatron as alpsck_megatron
    alpsck_megatron.install()      # in the launch script, before training: nothing in Megatron's files changes
    ...
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir, sharded_strategy=alpsck_megatron.save_strategy())
    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)   # AlpsckLoadStrategy, by metadata.json

For Megatron-LM's ``pretrain``, :func:`install` also hands ``save_strategy()`` to the training loop through
``checkpointing_context['save_strategy']`` (the key Megatron's ``save_checkpoint`` reads for ``--ckpt-format
torch_dist``) when ``megatron.training`` is importable (docs/megatron.md).

What stays Megatron's: ``metadata.json``, and ``common.pt`` with the non-sharded state and ``ShardedObject`` s,
which Megatron's common strategy writes with ``torch.save`` and reads with ``torch.load(weights_only=True)``.

Asynchronous saves (``dist_checkpointing.save(..., async_sharded_save=True)``, Megatron-LM's ``--async-save``): the
strategy is an ``AsyncSaveShardedStrategy``. Megatron runs an async save's ``async_fn`` in another process (forked
per save, or its persistent worker) and then, in the trainer, its ``finalize_fns`` (``metadata.json``, then the
tracker file). Here the write stays in the trainer's process, where alpsck's writer runs: ``async_save`` copies
each shard to host memory (the trainer may change the tensors from then on), and ``dcp.async_save`` plans, writes
and commits in a thread of its own, on a gloo group of its own (the training's collectives never meet it). The
``async_fn`` Megatron runs elsewhere only waits until that write is done (a file the write's end creates), so
Megatron's poll sees the save in flight as long as it is; the finalize step then raises, on every rank, any rank's
failure. So ``metadata.json`` and the tracker are written after the checkpoint is committed, and a save that was
never finalized is never resumed from: the tracker still names the one before.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..dcp import AlpsckStorageReader, AlpsckStorageWriter
from ..ranks import Ranks
from ..store.durable import replace_durably
from ..store.picker import pick
from .megatron_local import AlpsckLocalCheckpointManager, done_file, raise_unless_every_rank_saved, wait_for

try:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as _mt
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.base import (
        AsyncSaveShardedStrategy,
        StrategyAction,
        register_default_strategy,
    )
except ImportError as e:
    raise ImportError("alpsck.integrations.megatron needs megatron-core 0.16 (pip install megatron-core)") from e

BACKEND, VERSION = "alpsck", 1
SUBDIR = "alpsck"  # inside Megatron's checkpoint directory, beside its metadata.json and common.pt
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's: the iteration its --load resumes from
_ITERATION = re.compile(r"^iter_(\d{7,})$")


def _where(checkpoint_dir: str | Path) -> Path:
    return Path(checkpoint_dir) / SUBDIR


class _Staged:
    """DCP's ``AsyncStager`` for a state already copied to host memory (:meth:`AlpsckSaveStrategy.async_save`):
    Megatron's ``CheckpointableShardedTensor`` wrappers refuse the copies DCP's stagers would make."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


_GROUP: list[Any] = []  # the async saves' own gloo group, made at the first (every rank makes it there)


def _save_group() -> Any:
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


class AlpsckSaveStrategy(AsyncSaveShardedStrategy):  # type: ignore[misc]
    """Megatron's sharded save through alpsck's DCP writer, synchronous (``save``) or asynchronous (``async_save``;
    module docstring). ``options``: the writer's (``threads``, ``chunk_bytes``, ``direct_io``, ``commit_timeout_s``)."""

    def __init__(self, keep_only_main_replica: bool = True, **options: Any) -> None:
        super().__init__(BACKEND, VERSION)
        self.keep_only_main_replica = keep_only_main_replica
        self.options = options
        self._pending: Future[Any] | None = None  # the async save in flight: one at a time

    def _dcp_state(self, sharded_state_dict: Any, *, copy: bool) -> tuple[dict[str, Any], Any]:
        """Megatron's translation to DCP: the state and its planner; ``copy``: each shard copied to host memory."""
        sd, _flat, _renamed = _mt._replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                             self.keep_only_main_replica)
        if copy:
            for shards in sd.values():
                for sh in shards:
                    if isinstance(sh, ShardedTensor):
                        sh.data = sh.data.detach().to("cpu", copy=True)
        planner = _mt.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                       flatten_state_dict=False)
        return _mt.mcore_to_pyt_state_dict(sd, False), planner

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        self._settle()
        pyt, planner = self._dcp_state(sharded_state_dict, copy=False)
        dcp.save(pyt, storage_writer=AlpsckStorageWriter(_where(checkpoint_dir), **self.options), planner=planner)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        self._settle()  # Megatron only warns when a save starts before the last one was finalized
        pyt, planner = self._dcp_state(sharded_state_dict, copy=True)
        done = done_file()
        fut = dcp.async_save(pyt, storage_writer=AlpsckStorageWriter(_where(checkpoint_dir), **self.options),
                             planner=planner, process_group=_save_group(), async_stager=_Staged())
        assert isinstance(fut, Future)
        self._pending = fut
        fut.add_done_callback(lambda _f: Path(done).touch())

        def finalize() -> None:  # in the trainer, on every rank, before Megatron's metadata.json and tracker
            with contextlib.suppress(OSError):
                os.unlink(done)
            self._settle()

        return AsyncRequest(wait_for, (done, os.getpid()), [finalize])

    def _settle(self) -> None:
        """The async save in flight (if any) done; its failure raised on every rank, whichever rank's it was."""
        fut, self._pending = self._pending, None
        if fut is None:
            return
        ranks = Ranks(dist.get_rank(), dist.get_world_size(), _save_group())
        raise_unless_every_rank_saved(fut.exception(), ranks, "an asynchronous save")

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False  # ShardedObjects go to Megatron's common strategy (common.pt)


@contextlib.contextmanager
def _alpsck_reader() -> Iterator[None]:
    """Megatron's torch_dist loader with alpsck's reader: it takes its reader from one module function."""
    original = _mt._get_filesystem_reader
    _mt._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: AlpsckStorageReader(_where(checkpoint_dir))
    try:
        yield
    finally:
        _mt._get_filesystem_reader = original


class AlpsckLoadStrategy(_mt.TorchDistLoadShardedStrategy):  # type: ignore[misc]
    """Megatron's ``torch_dist`` load (translation, resharding, shape checks) reading through alpsck's DCP reader:
    every chunk CRC-checked; a checkpoint that fails is reported, never loaded as wrong values."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        with _alpsck_reader():
            return super().load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: str | Path, metadata: Any = None) -> Any:
        with _alpsck_reader():
            return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> Any:
        with _alpsck_reader():
            return super().load_sharded_metadata(checkpoint_dir)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False  # they were saved by Megatron's common strategy, which loads them back

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise ValueError(f"AlpsckLoadStrategy reads checkpoints of backend {BACKEND!r}, not {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise ValueError(f"AlpsckLoadStrategy reads version {VERSION} checkpoints, not {loaded_version}")


def checked_latest(load_dir: str | Path) -> int | None:
    """The iteration a resume from ``load_dir`` should load, every byte of its alpsck checkpoint CRC-checked, with
    Megatron-LM's tracker file set to it. The tracker's iteration when it verifies; else, with a warning naming
    what failed, the newest older ``iter_N`` that does, written to the tracker (durably) so that Megatron's own
    ``load_checkpoint`` loads it; None when none does (or there is no tracker: a fresh run). Call it on rank 0
    before Megatron loads (the other ranks wait at a barrier), or from the job script before the launch."""
    root = Path(load_dir)
    try:
        named = int((root / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None  # no tracker, or "release": nothing of alpsck's to check
    found = sorted((int(m[1]) for p in root.iterdir() if (m := _ITERATION.match(p.name)) and int(m[1]) <= named),
                   reverse=True)
    failed: list[str] = []
    for it in found:
        where = _where(root / f"iter_{it:07d}")
        picked = pick(where, verify_data=True)
        if picked.step is not None:
            if it != named:
                warnings.warn(f"{root}: iteration {named} cannot be loaded ({'; '.join(failed)}); resuming from "
                              f"iteration {it}, now in {TRACKER}", RuntimeWarning, stacklevel=2)
                replace_durably(root / TRACKER, f"{it}\n".encode())
            return it
        failed.append(f"{where}: {picked.why_not() or 'no committed checkpoint'}")
    warnings.warn(f"{root}: no iteration up to {named} can be loaded ({'; '.join(failed) or 'none found'})",
                  RuntimeWarning, stacklevel=2)
    return None


def save_strategy(**options: Any) -> AlpsckSaveStrategy:
    """A save strategy for ``dist_checkpointing.save`` (or ``checkpointing_context['save_strategy']``)."""
    return AlpsckSaveStrategy(**options)


def training_save_strategy(args: Any, **options: Any) -> Any:
    """The save strategy Megatron-LM's ``save_checkpoint`` would build for ``--ckpt-format torch_dist``, with
    alpsck's in place of its own: ``save_strategy(**options)``, and with ``args.ckpt_fully_parallel_save``
    (Megatron-LM's default) wrapped in megatron-core's ``FullyParallelSaveStrategyWrapper`` over the data-parallel
    group (with context parallelism), so that the ranks holding a replicated tensor share its writing instead of
    the first of them writing it all. Megatron-LM wraps only a strategy it made itself: one found in
    ``checkpointing_context`` (as :func:`install` puts it there) is taken as already wrapped. ``args``: Megatron-LM's
    (``get_args()``), after ``initialize_megatron``."""
    strategy = save_strategy(**options)
    if not getattr(args, "ckpt_fully_parallel_save", False):
        return strategy
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
                                            bool(getattr(args, "ckpt_assume_constant_structure", False)))


def install(*, local_memory: bool | str | os.PathLike[str] = False, **options: Any) -> None:
    """Register :class:`AlpsckLoadStrategy` for backend ``"alpsck"`` (``dist_checkpointing.load`` then reads such
    checkpoints by itself), and, where Megatron-LM's training loop is importable, give its checkpoint saves
    ``training_save_strategy(get_args(), **options)``: ``setup_model_and_optimizer`` is wrapped to put it in
    ``checkpointing_context``,
    and, where ``pretrain`` made a local checkpoint manager (``--non-persistent-ckpt-type local``), an
    :class:`~alpsck.integrations.megatron_local.AlpsckLocalCheckpointManager` on its directory in its place, with
    ``memory=local_memory`` (its memory tier, with a replica on the next node: ``--non-persistent-local-ckpt-dir``
    must then be a directory every rank sees). Call once, in the launch script, before ``pretrain``."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, AlpsckLoadStrategy())
    try:
        from megatron.training import get_args, training
    except ImportError:
        return
    original = training.setup_model_and_optimizer
    if getattr(original, "_alpsck", False):
        return

    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        context = kwargs.get("checkpointing_context")
        if context is not None:
            if "save_strategy" not in context:
                context["save_strategy"] = training_save_strategy(get_args(), **options)
            local = context.get("local_checkpoint_manager")  # --non-persistent-ckpt-type local: pretrain made one
            if local is not None and not isinstance(local, AlpsckLocalCheckpointManager):
                if getattr(local, "repl_strategy", None) is not None and local_memory is False:
                    warnings.warn("alpsck's local checkpoint manager keeps no replica on another node without its "
                                  "memory tier: Megatron-LM's --replication is not applied; install(local_memory=True) "
                                  "keeps one (docs/megatron.md)", RuntimeWarning, stacklevel=2)
                context["local_checkpoint_manager"] = AlpsckLocalCheckpointManager(local.local_ckpt_dir,
                                                                                   memory=local_memory)
        return original(*args, **kwargs)

    setup_model_and_optimizer._alpsck = True  # type: ignore[attr-defined]
    training.setup_model_and_optimizer = setup_model_and_optimizer
