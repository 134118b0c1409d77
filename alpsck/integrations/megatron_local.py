"""Megatron-LM's local checkpoints (``--non-persistent-ckpt-type local``) through alpsck:
:class:`AlpsckLocalCheckpointManager`, in ``checkpointing_context['local_checkpoint_manager']`` (recipe:
docs/megatron.md; :func:`alpsck.integrations.megatron.install` puts it there).

Megatron-LM's ``save_checkpoint`` hands a local checkpoint manager a ``MCoreTensorAwareStateDict`` (megatron-core's;
it needs nvidia-resiliency-ext): the rank's ``ShardedTensor``s and ``ShardedObject``s, and a common state. The manager
of nvidia-resiliency-ext writes it per rank with ``torch.save`` and reads it back with a pickle load. This one writes it
as an alpsck checkpoint of the rank's own run directory, ``LOCAL_DIR/rank-RRRRR`` (node-local storage, as nvidia's
manager writes, or any file system): the tensors at the disk's speed with a CRC32C for every chunk, and everything
else as alpsck's tagged JSON, never a pickle. The layout of each ``ShardedTensor`` (key, dtype, shapes, offsets,
replica id, flattened range) and each ``ShardedObject`` (its value) is kept field by field, and rebuilt from them
at load. An ``argparse.Namespace`` in the common state (Megatron-LM's ``args``) comes back as one; an ``Enum`` in
it comes back as its name (the enum's class is never imported from what a checkpoint says). A value of another
type fails the save, naming where it is.

- ``save(state, iteration, is_async)``: returns once the tensors are copied to host memory; the writes and the
  commit go on in the background. Synchronous: waits for them, then every rank learns whether every rank's save
  committed (an all-reduce) and raises if one did not. Asynchronous: a Megatron ``AsyncRequest`` whose function,
  run in Megatron's other process, waits for this process's write, and whose finalize step (in the trainer, every
  rank) raises any rank's failure, a save that failed before it started (a value alpsck cannot hold, a full disk)
  included: every rank raises there together. ``keep_last`` (2 by default) checkpoints stay in each rank's directory.
- ``find_latest()``: the newest iteration committed on every rank (each rank's list, exchanged as ints), -1 if none.
- ``load()``: every rank reads that iteration, every chunk CRC-checked. When one rank's read fails (a damaged or
  missing checkpoint), every rank warns and goes on to the next newest iteration they all have, so a damaged
  newest checkpoint costs one interval, never a wrong value or a crash. Megatron-LM then takes the iteration from
  the state loaded.

With ``memory=True`` (or a directory) the checkpoints go to alpsck's memory tier instead (docs/memory-tier.md):
one Checkpointer of every rank on ``local_ckpt_dir``, which must then be one directory every rank sees (it holds
the run's identity only); each save is a checkpoint in node shared memory, committed by the node's ranks, and with
several nodes a replica of it on the next node. ``find_latest()`` then restores: the newest iteration held in memory
for every node's ranks, each node's from its own memory or, for a node that was lost (its ranks now on a spare),
from the replica another node holds, every chunk CRC-checked; a copy that cannot be read is tried once, the
replica after it, and with no usable copy left ``find_latest()`` is -1, with a warning, so that Megatron-LM loads
its persistent checkpoint instead. ``load()`` returns what it read.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import tempfile
import time
import uuid
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from .. import _core
from ..checkpointer import Checkpointer
from ..errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, UsageError
from ..handles import CoreSave
from ..options import check_step
from ..ranks import Ranks
from ..restore.read import read_state

try:
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
except ImportError as e:
    raise ImportError("alpsck.integrations.megatron_local needs megatron-core 0.16 (pip install megatron-core)") from e

__all__ = ["AlpsckLocalCheckpointManager", "done_file", "raise_unless_every_rank_saved", "wait_for"]

KIND = "mcore"  # the key of a layout entry that stands for a megatron-core object (its value says which)
_TENSOR_FIELDS = ("key", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations",
                  "replica_id", "prepend_axis_num", "allow_shape_mismatch")


def wait_for(done_file: str, trainer_pid: int) -> None:
    """An async save's ``async_fn`` (this module's and :mod:`.megatron`'s), in Megatron's async process (forked or
    spawned: a module function of plain arguments): back when the trainer's write created ``done_file``, or when the
    trainer is gone. It removes the file it saw (the trainer's finalize does too), so a trainer killed before its
    finalize leaves none behind."""
    while not os.path.exists(done_file) and os.getppid() == trainer_pid:
        time.sleep(0.02)
    with contextlib.suppress(OSError):
        os.unlink(done_file)


def done_file() -> str:
    """A new path for :func:`wait_for` to wait on, named for this process."""
    return os.path.join(tempfile.gettempdir(), f".alpsck-megatron-{os.getpid()}-{uuid.uuid4().hex}")


def raise_unless_every_rank_saved(error: BaseException | None, ranks: Ranks, what: str) -> None:
    """Every rank learns whether every rank's save succeeded (one agreement of ``ranks``), and raises if one did not:
    its own error where it has one, else that another rank failed. ``what``: the save, in the message."""
    if ranks.all_true(error is None):
        return
    if error is not None:
        raise CheckpointError(f"{what} through alpsck failed: {error}") from error
    raise CheckpointError(f"{what} through alpsck failed on another rank (its log names it)")


def _ints(value: Any) -> Any:
    return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else int(value)


def _encode(node: Any, where: str) -> Any:
    """The state as alpsck's tree takes it: each ShardedTensor and ShardedObject as a dict of its fields (its tensor
    or its value among them), a Namespace as a dict of its attributes, an Enum as its name."""
    if isinstance(node, ShardedTensor):
        desc: dict[str, Any] = {KIND: "tensor", **{f: getattr(node, f) for f in _TENSOR_FIELDS}}
        rng = node.flattened_range
        desc["flattened_range"] = None if rng is None else (int(rng.start), int(rng.stop))
        desc["data"] = None if node.data is None else node.data.detach()
        return desc
    if isinstance(node, ShardedObject):
        return {KIND: "object", "key": node.key, "data": _encode(node.data, f"{where}/{node.key}"),
                "global_shape": _ints(node.global_shape), "global_offset": _ints(node.global_offset),
                "replica_id": node.replica_id}
    if isinstance(node, ShardedBase):
        raise UsageError(f"{where}: a {type(node).__name__} (alpsck's local checkpoints hold ShardedTensors and "
                         "ShardedObjects, as megatron-core's save_preprocess leaves them)")
    if isinstance(node, argparse.Namespace):
        return {KIND: "namespace", "vars": _encode(vars(node), where)}
    if isinstance(node, enum.Enum):
        return node.name
    if isinstance(node, dict):
        if KIND in node:
            raise UsageError(f"{where}: a dict with a key {KIND!r}, which alpsck's local checkpoints reserve")
        return {k: _encode(v, f"{where}/{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_encode(v, f"{where}/{i}") for i, v in enumerate(node)]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return tuple(_encode(v, f"{where}/{i}") for i, v in enumerate(node))
    return node  # alpsck's tree encodes it, or names its type and where it is


def _decode(node: Any) -> Any:
    """:func:`_encode`'s inverse (megatron-core checks each ShardedTensor's tensor against its shape and dtype)."""
    if isinstance(node, dict) and KIND in node:
        kind = node[KIND]
        if kind == "tensor":
            rng = node["flattened_range"]
            return ShardedTensor(data=node["data"], flattened_range=None if rng is None else slice(*rng),
                                 **{f: node[f] for f in _TENSOR_FIELDS})
        if kind == "object":
            return ShardedObject(node["key"], _decode(node["data"]), tuple(node["global_shape"]),
                                 tuple(node["global_offset"]), node["replica_id"])
        if kind == "namespace":
            return argparse.Namespace(**_decode(node["vars"]))
        raise CheckpointError(f"a layout entry of unknown kind {kind!r}")
    if isinstance(node, dict):
        return {k: _decode(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_decode(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_decode(v) for v in node)
    return node


class AlpsckLocalCheckpointManager:
    """Megatron-LM's local checkpoint manager on alpsck (module docstring): ``local_ckpt_dir`` holds a run directory
    per rank, or with ``memory`` is the run directory of the memory tier's checkpoints (one directory every rank
    sees). ``options``: the Checkpointer's (``keep_last``, 2 by default here; ``threads``, ...)."""

    def __init__(self, local_ckpt_dir: str | os.PathLike[str], *, memory: bool | str | os.PathLike[str] = False,
                 **options: Any) -> None:
        for fixed in ("rank", "world_size"):
            if fixed in options:
                raise UsageError(f"AlpsckLocalCheckpointManager sets {fixed} itself (torch.distributed's)")
        self.local_ckpt_dir = str(local_ckpt_dir)
        self.memory = memory
        self._ranks = Ranks.detect(None, None)  # torch.distributed's, agreeing through a gloo group
        self.rank = self._ranks.rank
        self.run_dir = Path(local_ckpt_dir) if memory is not False else Path(local_ckpt_dir) / f"rank-{self.rank:05d}"
        self._options = {"keep_last": 2, **options}
        self._ck: Checkpointer | None = None
        self._candidates: list[int] = []  # find_latest's: the iterations every rank has, newest first
        self._restored: tuple[int, dict[str, Any]] | None = None  # find_latest's, with memory: what it read
        self._pending: tuple[CoreSave | Future[None], str] | None = None  # the save in flight; the file its end creates

    def _checkpointer(self) -> Checkpointer:
        if self._ck is None:
            if self.memory is not False:  # every rank's, its memory tier per node
                self._ck = Checkpointer(self.run_dir, memory=self.memory, **self._options)
            else:
                self._ck = Checkpointer(self.run_dir, rank=0, world_size=1, **self._options)
        return self._ck

    def save(self, state_dict: Any, iteration: int, is_async: bool = False) -> Any:
        """Megatron-LM's call (module docstring): None, or with ``is_async`` an ``AsyncRequest``."""
        check_step(iteration, "iteration")
        if not isinstance(state_dict, MCoreTensorAwareStateDict) or state_dict.is_hollow:
            raise UsageError(f"AlpsckLocalCheckpointManager.save takes a MCoreTensorAwareStateDict with its tensors, "
                             f"not {type(state_dict).__name__}")
        self._settle()
        done = done_file()
        handle: CoreSave | Future[None]
        try:
            state = {"layout": _encode(state_dict.sharded_state_dict, "layout"),
                     "common": _encode(state_dict.common_state_dict, "common")}
            handle = self._checkpointer().save(iteration, state, tier="run_dir" if self.memory is False else "memory")
        except Exception as e:
            if not is_async:  # the other ranks wait for this rank's word in _settle: it is "failed"
                self._ranks.all_true(False)
                raise
            # The other ranks learn of it in their finalize (_settle): this rank raises it there, with them, rather
            # than now, when they would go on to wait for its word in a finalize it never reaches.
            handle = Future()
            handle.set_exception(e)
        self._candidates, self._restored = [], None
        handle.add_done_callback(lambda _h: Path(done).touch())
        self._pending = (handle, done)
        if not is_async:
            self._settle()
            return None
        return AsyncRequest(wait_for, (done, os.getpid()), [self._settle])

    def _settle(self) -> None:
        """The save in flight (if any) durable on every rank, or every rank raises."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        handle, done = pending
        error = handle.exception()  # waits for it
        with contextlib.suppress(OSError):
            os.unlink(done)
        raise_unless_every_rank_saved(error, self._ranks, "a local checkpoint")

    def find_latest(self) -> int:
        """The newest iteration committed on every rank, -1 if none (every rank calls it at once). With ``memory``:
        the iteration restored from the memory tier (module docstring), -1 if none."""
        self._settle()
        if self.memory is not False:
            return self._restore_from_memory()
        mine = sorted(i["step"] for i in _core.scan(str(self.run_dir)) if i["status"] == "committed") \
            if self.run_dir.is_dir() else []
        common = set.intersection(*(set(steps) for steps in self._ranks.each_list(mine)))
        self._candidates = sorted(common, reverse=True)
        return self._candidates[0] if self._candidates else -1

    def _restore_from_memory(self) -> int:
        """find_latest() with ``memory``: the whole state read by the Checkpointer's restore (into a state with no
        live entries, so every entry comes back as it was saved), kept for load()."""
        state: dict[str, Any] = {}
        try:
            step = self._checkpointer().restore(state, prepare="memory")  # its only tier: no run-dir staging
        except CorruptCheckpointError as e:  # a memory copy failed after all: nothing live holds its bytes here
            warnings.warn(f"{self.local_ckpt_dir}: no local checkpoint in memory can be loaded ({e}); Megatron-LM "
                          "loads its persistent checkpoint", RuntimeWarning, stacklevel=3)
            step = None
        self._restored = None if step is None else (step, state)
        return -1 if step is None else step

    def load(self) -> tuple[Any, str]:
        """The newest iteration every rank reads whole (module docstring): (its MCoreTensorAwareStateDict, a name).
        ``find_latest()`` first, as Megatron-LM calls them."""
        if self.memory is not False:
            if self._restored is None:
                raise NoCheckpointError(f"{self.local_ckpt_dir}: no local checkpoint in memory to load "
                                        "(find_latest() first, and an iteration every node's ranks have)")
            (iteration, state), self._restored = self._restored, None
            tier = self._checkpointer().restored_tier
            return (MCoreTensorAwareStateDict(common=_decode(state["common"]), sharded_state_dict=_decode(state["layout"])),
                    f"{self.local_ckpt_dir} iteration {iteration} ({tier})")
        if not self._candidates:
            raise NoCheckpointError(f"{self.local_ckpt_dir}: no local checkpoint to load (find_latest() first, and "
                                    "an iteration every rank has)")
        for n, iteration in enumerate(self._candidates):
            error: BaseException | None = None
            try:
                _step, state = read_state(self.run_dir, step=iteration)
            except (CheckpointError, OSError) as e:
                error = e
            if self._ranks.all_true(error is None):
                if n:
                    warnings.warn(f"{self.local_ckpt_dir}: resuming from iteration {iteration}, the newest that every "
                                  "rank loaded whole", RuntimeWarning, stacklevel=2)
                tasd = MCoreTensorAwareStateDict(common=_decode(state["common"]),
                                                 sharded_state_dict=_decode(state["layout"]))
                self._candidates = self._candidates[n:]
                return tasd, f"{self.run_dir}/{_core.step_dir_name(iteration)}"
            why = f"this rank's read failed: {error}" if error is not None else "another rank's read failed (its log says why)"
            warnings.warn(f"{self.local_ckpt_dir}: local checkpoint iteration {iteration} cannot be loaded: {why}",
                          RuntimeWarning, stacklevel=2)
        raise NoCheckpointError(f"{self.local_ckpt_dir}: no iteration every rank has loads on every rank "
                                f"(tried {', '.join(map(str, self._candidates))})")

    def wait(self) -> None:
        """Every save so far durable (with ``memory``: committed in node memory and its replica on the next node sent),
        each rank raising if any rank's save failed (every rank calls it)."""
        self._settle()
        if self._ck is not None:
            self._ck.wait()

    def close(self) -> None:
        """The save in flight durable, the checkpointer closed."""
        try:
            self._settle()
        finally:
            if self._ck is not None:
                self._ck.close()
                self._ck = None
