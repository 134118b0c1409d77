"""The DCP storage writer (:class:`AlpsckStorageWriter`); the package's docstring says how a save runs."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .. import _core
from ..errors import RunDirLockedError, UsageError
from ..options import DEFAULTS, check_metrics, check_step
from ..options import check as check_option
from ..ranks import store_clients
from ..store.durable import fsync_dirs_quietly, fsync_path, make_dirs
from ..store.lock import lock_holder, lock_run_dir
from ..store.marker import marker_problem, publish_marker, stage_marker, write_marker
from ..store.names import MARKER_NAMES, entry_kind, step_dir
from ..store.picker import pick
from ..store.retention import Policy
from .extents import Extent, chunk_nbytes, encode_item, flat_bytes_of, given, in_place, save_resolving_lazily
from .formats import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    SHARD_FORMAT,
    ExtentRef,
    check_properties,
    decode_metadata,
    encode_metadata,
    extent_name,
)
from .paths import (
    checkpoint_path,
    damaged_marker,
    is_rank_local_checkpoint,
    may_become_checkpoint,
    rank_local_dir,
    refuse_folder_of_checkpoints,
    same_dir,
)

__all__ = ["AlpsckStorageWriter"]



@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in its plan's ``storage_data``."""

    rank: int  # the rank's shard (the coordinator's is 0: its engine tidies the directory and commits)
    world_size: int
    step: int  # the step (run-directory mode) or generation (checkpoint-directory mode) the save writes
    # Where the ranks' engines agree (torch.distributed's store, under this key namespace, drawn by
    # the coordinator for this save): "" for none (one rank, or no process group): DONE records.
    store_ns: str = ""
    process_rank: int = 0  # the process-group rank the plan is for (DCP's coordinator may be another than 0)
    supersede: bool = False  # run-directory mode: the save retires the committed step and newer ones first


def _refuse_another_writer(path: Path) -> None:
    """Where a writer is made for a directory, or pointed at one by ``dcp.save(checkpoint_id=...)``: refuse one
    another live process is writing (a Checkpointer, another job), in one line, before DCP starts a save (whose
    failure it would print as a traceback of every rank's). The lock itself is still taken for every save; an
    async save of this process's own in flight is no reason to refuse. One probe of the lock file, none
    where the directory does not exist yet (a new checkpoint) beyond the failed open."""
    why = lock_holder(path, others_only=True)
    if why is not None:
        raise RunDirLockedError(f"{why}; two writers in one directory would corrupt each other's checkpoints: "
                                "stop the other writer, or save somewhere else")


def _plan_bytes(plan: SavePlan) -> int:
    """The tensor bytes of one rank's plan (its non-tensor values are small JSON)."""
    return sum(chunk_nbytes(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)


# ------------------------------------------------------------------------------ writer


class AlpsckStorageWriter(StorageWriter, BlockingAsyncStager):
    """DCP StorageWriter: one alpsck shard per rank, one atomic commit.

    Two ways to name the checkpoint (docs/python-api.md, "Resharding"; docs/dcp.md):

    - **run-directory mode**, ``AlpsckStorageWriter(run_dir, step)``: checkpoint ``step`` of the
      alpsck run directory ``run_dir``, beside the Checkpointer's (``run_dir/step-00000000N``). A
      step is written once, unless ``overwrite=True`` or its checkpoint is unusable (a reader fell
      back past it): then the save retires it, and every newer step, to ``superseded-step-N-*``
      (as a Checkpointer's save after a fall-back does; removed by ``alpsck prune``) and writes it anew.
    - **checkpoint-directory mode**, ``AlpsckStorageWriter()`` with ``dcp.save(...,
      checkpoint_id="folder/step-10")`` (or ``AlpsckStorageWriter("folder/step-10")``): the
      checkpoint is that directory, as with DCP's FileSystemWriter and torchtitan. alpsck keeps a
      small run directory there (each save a new generation, committed atomically, then the older
      generations removed) and a ``.metadata`` marker (JSON) where DCP trainers look for one. Saving
      again to the same id overwrites it (``overwrite=False``: refused), and the old checkpoint stays
      loadable until the new one commits. A ``checkpoint_id`` other than the writer's run directory
      switches a writer to this mode.

    Args:
        run_dir: the run directory (run-directory mode), or the checkpoint directory (with no step).
            Use one that no :class:`alpsck.Checkpointer` has open: both take its writer lock.
        step: the checkpoint's step in run-directory mode.
        threads, chunk_bytes, commit_timeout_s: the engine's options (None: the defaults in
            alpsck.options, as for the Checkpointer).
        keep_last, keep_every_steps, keep_every_seconds, keep_best: run-directory mode: after the commit,
            the run directory's committed checkpoints, DCP or not, that no rule keeps are removed: the
            engine's retention rules and defaults (docs/retention.md), but ``keep_last`` 0 (keep all)
            by default here.
        metrics: numbers recorded in the checkpoint's manifest (``{"val_loss": ...}``), for ``keep_best``,
            the health rule and ``inspect-checkpoints``, as ``Checkpointer.save(metrics=)``'s.
        direct_io: O_DIRECT where the file system allows.
        overwrite: whether a save may replace a committed checkpoint. None (the default): yes in
            checkpoint-directory mode (DCP's default), and in run-directory mode only an unusable one.

    CPU tensors that DCP's default planner hands over contiguous are written from their own memory
    (no snapshot copy): DCP keeps them unchanged until ``write_data`` returns (``dcp.async_save``
    stages a copy first: with no ``async_stager`` given, the writer's own ``stage``, a blocking copy to CPU
    memory, as FileSystemWriter stages: the same stall by construction; ``async_stager=`` picks another).
    Anything else (device tensors, views, a planner whose ``resolve_data``
    allocates) is resolved one item at a time while the shard is written, through a few staging
    slots, so resolving overlaps writing and never holds the whole state at once. See the module
    docstring for the call order, locking and the no-pickle policy.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 threads: int | None = None, chunk_bytes: int | None = None, keep_last: int = 0,
                 keep_every_steps: int = 0, keep_every_seconds: float = 0.0, keep_best: Any = "",
                 metrics: Mapping[str, Any] | None = None, commit_timeout_s: float | None = None,
                 direct_io: bool = True, overwrite: bool | None = None) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self)  # stage(): a copy of the state on the CPU, as FileSystemWriter's
        check_step(step, allow_none=True)
        if step is not None and run_dir is None:
            raise UsageError("AlpsckStorageWriter: step= needs the run directory it belongs to")
        self.run_dir: Path | None = None if run_dir is None else checkpoint_path(run_dir, "AlpsckStorageWriter")
        self.step = step  # None: checkpoint-directory mode
        self.threads = DEFAULTS["threads"] if threads is None else threads
        self.chunk_bytes = DEFAULTS["chunk_bytes"] if chunk_bytes is None else chunk_bytes
        self.commit_timeout_s = DEFAULTS["commit_timeout_s"] if commit_timeout_s is None else commit_timeout_s
        for name in ("threads", "chunk_bytes", "commit_timeout_s"):
            check_option(name, getattr(self, name))
        # The engine's retention rules, checked together (keep_last 0 with another rule is refused by name).
        self.retention = Policy(keep_last, keep_every_steps, keep_every_seconds, keep_best)
        self.metrics = check_metrics(metrics)
        self.direct_io = direct_io
        self.overwrite = overwrite is not False
        self._overwrite_given = overwrite
        if self.run_dir is not None:  # refused here, in one line, rather than inside DCP's save
            self._check_target()
        self._supersede = False  # run-directory mode: this save retires the committed step (and newer ones) first
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.world_size: int | None = None
        self._writing: int | None = None  # the step this save writes: self.step, or the coordinator's generation
        self._started = time.monotonic()
        self._engine: _core.Engine | None = None
        self._shard_bytes = 0  # this rank's share of the save being written (sizes its engine: _sized)
        self._lock: _core.RunDirLock | None = None
        self._store_ns = ""  # this save's (_RankPlan.store_ns)
        self._solo_store: Any = None  # one rank's agreement with itself (_store), made for each save
        self._process_rank = 0  # this rank in the process group (set_up_storage_writer)
        self._subdir: str | None = None  # use_collectives=False with several ranks: this rank's rank_local_dir
        # Durability work done while this rank's shard is written, off the save's critical path: the directories
        # holding the names _open created, which its engine syncs (dir_sync.h) and a sealed shard confirms (finish
        # syncs what no shard confirmed), and the marker's temp file (_while_writing)
        self._unsynced: list[Path] = []
        self._marker_staged = False  # checkpoint-directory mode, coordinator: .metadata.tmp written, to put in place
        self._made = False  # this save made its directory (_open): nothing in it to check, list or retire

    def __del__(self) -> None:  # a writer dropped after a failed save holds no lock
        with contextlib.suppress(Exception):
            self.close()

    # pickled by dcp.async_save's process executor: never the open engine or lock
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_engine"] = state["_lock"] = state["_solo_store"] = None
        return state

    @property
    def named(self) -> bool:
        """Checkpoint-directory mode: the checkpoint is the directory DCP's checkpoint_id names."""
        return self.step is None

    @property
    def checkpoint_id(self) -> str:
        if self.run_dir is None:
            return ""
        return str(self.run_dir if self.step is None else step_dir(self.run_dir, self.step))

    def _dir(self) -> Path:
        if self.run_dir is None:
            raise UsageError("AlpsckStorageWriter() was given no checkpoint directory: pass checkpoint_id= to "
                             "dcp.save (or a path to AlpsckStorageWriter)")
        return self.run_dir if self._subdir is None else self.run_dir / self._subdir

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True where this writer can save: an alpsck run or checkpoint directory, an empty directory, or a
        path not there yet under a writable directory; False for URLs and for other directories that
        hold files (a FileSystemWriter checkpoint, say)."""
        return may_become_checkpoint(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (DCP calls this with ``dcp.save(checkpoint_id=...)``): the run directory or
        this writer's step keep run-directory mode; any other path is the checkpoint directory to write."""
        self.close()
        if checkpoint_id is not None:
            if "://" in os.fspath(checkpoint_id):
                raise UsageError(f"checkpoint_id {os.fspath(checkpoint_id)!r}: alpsck writes to a file system path")
            keep = self.run_dir is not None and self.step is not None and (
                same_dir(checkpoint_id, self.run_dir) or same_dir(checkpoint_id, step_dir(self.run_dir, self.step)))
            if not keep:
                self.run_dir, self.step = checkpoint_path(checkpoint_id, "dcp.save's checkpoint_id"), None
                self._check_target()  # before DCP's save starts: its failures print every rank's traceback
        self.save_id = str(uuid.uuid4())

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks, first: records this rank; refuses, before anything is written, a committed step
        (run-directory mode), or an existing checkpoint with ``overwrite=False`` or one that is not
        alpsck's (checkpoint-directory mode).

        A save that failed between the global plan and ``write_data`` (a planner's ``finish_plan``
        raising, say) left the coordinator's engine open (not its lock): it is closed here, so a
        reused writer, or one in dcp.async_save's long-lived process, starts clean.
        """
        self.close()
        self._unsynced, self._marker_staged, self._made, self._solo_store = [], False, False, None
        self._process_rank = int(kwargs.get("rank") or 0)
        # The shard this rank writes: the coordinator's is 0 (whichever process rank DCP made the coordinator,
        # as the deprecated save_state_dict(coordinator_rank=...) does); the others' come with the plan.
        self.rank = 0 if is_coordinator else -1
        self._writing = self.step
        self._started = time.monotonic()  # the manifest's write_seconds counts from here
        self._subdir = None
        if not kwargs.get("use_collectives", True):
            # Every rank saves on its own, as its own coordinator, at world size 1. With several ranks each
            # writes a checkpoint of its own in RANK_LOCAL/<rank>, which the reader finds when DCP asks for the
            # rank-local metadata (read_metadata(rank=...)).
            import torch.distributed as dist

            self.rank = 0
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self._subdir = rank_local_dir(self._process_rank)
        run_dir = self._dir()
        self._supersede = False
        if self.step is not None:
            if (step_dir(run_dir, self.step) / _core.run_dir_names["manifest"]).exists():
                if self._overwrite_given is not True and not self._unusable(run_dir, self.step):
                    raise UsageError(f"{run_dir}: step {self.step} is already committed; a step is written once "
                                     "(make a writer for a new step, or pass overwrite=True to replace it)")
                self._supersede = True
        else:
            self._check_overwrite(run_dir)

    @staticmethod
    def _unusable(run_dir: Path, step: int) -> bool:
        """Whether committed ``step`` is a DCP checkpoint no reader would load (corrupt, damaged): a save after
        the fall-back past it writes it anew. A Checkpointer's checkpoint is never unusable here."""
        p = pick(run_dir, kind="dcp", step=step)
        return p.info is None and bool(p.skipped) and p.skipped[0].reason != "other_kind"

    def _check_target(self) -> None:
        """Where a writer is made for a directory, or pointed at one by ``dcp.save(checkpoint_id=...)``: refuse,
        in one line, one that another live process is writing, and (checkpoint-directory mode) a trainer's
        folder of checkpoints. A new checkpoint costs one probe of a missing file. What FileSystemWriter
        refuses inside DCP's save (``overwrite=False``, a directory of other files) is refused there too,
        as DCP's CheckpointException (:meth:`_check_overwrite`), so its callers' handling matches."""
        assert self.run_dir is not None
        _refuse_another_writer(self.run_dir)
        if self.step is None:
            refuse_folder_of_checkpoints(self.run_dir)

    def _check_overwrite(self, path: Path) -> None:
        """Checkpoint-directory mode: refuse a directory holding someone else's files, or (overwrite=False)
        a committed checkpoint; DCP's wording, so its callers' checks match."""
        if not path.exists():
            return
        if not path.is_dir():
            raise UsageError(f"checkpoint_id {str(path)!r} is not a directory")
        why = None if damaged_marker(path) else marker_problem(path)  # a damaged marker of ours: written anew
        names = os.listdir(path)
        foreign = sorted(n for n in names if entry_kind(n) == "other" and n not in MARKER_NAMES
                         and not is_rank_local_checkpoint(path, n))  # a use_collectives=False save's: ours
        if why is None and foreign:
            why = f"{path} holds files alpsck did not write ({', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''})"
        if why is None:
            refuse_folder_of_checkpoints(path, names)
        if why is not None:
            raise UsageError(f"{why}; alpsck does not write over it: remove it or choose another checkpoint_id")
        if not self.overwrite and any(i["status"] == "committed" for i in _core.scan(str(path))):
            raise UsageError(f"Checkpoint already exists and self.overwrite=False: {path}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """All ranks: refuses tensors alpsck cannot store (dtype, layout) before anything is written."""
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                if item.tensor_data is None:
                    raise UsageError(f"{item.index.fqn}: tensor write item without tensor data")
                check_properties(item.tensor_data.properties, item.index.fqn)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: tells each rank its rank and the world size, and opens its own engine.

        The engine opens last, after every rank planned successfully: its start-up removes
        abandoned ``step-*.tmp`` directories, which must happen before any rank writes (the other
        ranks open theirs in ``write_data``, after this plan reached them).
        """
        world = len(plans)
        self.world_size = world
        me = self._process_rank if world == 1 else None  # one plan (one rank, or use_collectives=False): this one
        # Each rank's shard: the coordinator's (this rank's) is 0, the others follow in process-rank order.
        coordinator = self._process_rank if world > 1 else 0
        import torch.distributed as dist

        # The ranks agree through a store (no DONE record per rank for rank 0 to read), under keys of this save
        # alone: several, the process group's; one, a store in its own memory (_store).
        self._store_ns = f"alpsck-dcp/{uuid.uuid4().hex}/" if world == 1 or dist.is_initialized() else ""
        self._shard_bytes = _plan_bytes(plans[coordinator])
        self._open(0, world)
        try:
            if self.step is None and self._made:  # a directory this save made holds nothing: the first generation
                self._writing = 1
            elif self.step is None:  # the next generation, chosen under the lock after the engine tidied the directory
                self._check_overwrite(self._dir())
                taken = [i["step"] for i in _core.scan(str(self._dir()))]
                self._writing = max(taken, default=0) + 1
        finally:
            # The engine stays open (its start-up tidied the directory, which must not happen again while
            # the other ranks write); the lock is taken again in write_data, so a save that fails in between
            # (DCP's finish_plan, or a subclass's write_data) leaves no lock behind.
            self._unlock()
        assert self._writing is not None
        return [replace(plan, storage_data=_RankPlan((i - coordinator) % world, world, self._writing, self._store_ns,
                                                     i if me is None else me, self._supersede))
                for i, plan in enumerate(plans)]

    def _open(self, rank: int, world: int) -> _core.Engine:
        """This rank's engine, with the run directory's lock held (taken again if it was let go)."""
        run_dir = self._dir()
        created: list[Path] = []  # directories whose fsync makes the new names durable: the engine's to sync
        try:
            if self._lock is None:
                created = make_dirs(run_dir)
                self._made = self._made or run_dir.parent in created  # (make_dirs gives the parents of what it made)
                self._lock = lock_run_dir(run_dir, rank)
        except BaseException:
            fsync_dirs_quietly(created)
            raise
        if self._engine is not None:  # made again under the open engine (removed meanwhile): synced now
            for d in created:
                fsync_path(d)
        else:
            threads, chunk, staging = self._sized()
            try:
                self._engine = _core.Engine(str(run_dir), {"threads": threads, "chunk_bytes": chunk,
                                                           "staging_bytes": staging, "prefault_staging": False,
                                                           "max_in_flight": 1, "keep_last": 0, "direct_io": self.direct_io,
                                                           "commit_timeout_s": self.commit_timeout_s},
                                            one_history=self._supersede, rank=rank, world_size=world,
                                            store=self._store(), store_ns=self._store_ns,
                                            unsynced_dirs=[str(d) for d in created])
                self._unsynced += created
            except BaseException:
                fsync_dirs_quietly(created)
                self.close()
                raise
            if self.direct_io and not self._engine.direct_io:
                warnings.warn(f"{run_dir}: the file system refused O_DIRECT; alpsck writes buffered and "
                              "fdatasyncs instead", RuntimeWarning, stacklevel=3)
        return self._engine

    def _store(self) -> Any:
        """Where this save's ranks agree on its commit, under the keys' namespace its plan names (None where no
        plan named one: DONE records in the attempt's directory): several ranks, the process group's store (this
        process's shared clients of it); one, a store in this process's memory, which its engine and its commit
        share (dcp.async_save's process runs the whole save: plan, write and commit)."""
        if not self._store_ns:
            return None
        if (self.world_size or 1) > 1:
            return store_clients()
        if self._solo_store is None:
            self._solo_store = _core.StoreClients.in_memory()
        return self._solo_store

    def _sized(self) -> tuple[int, int, int]:
        """(writer threads, chunk bytes, staging bytes) for this rank's shard: the options, but never more than
        the shard needs. Staging holds the items resolved while writing (a GPU tensor's copy); a full pipeline
        needs a slot per writer thread and two more. It is not faulted in when the engine opens
        (``prefault_staging``): CPU tensors are written in place and never touch it. Faulted at every open, the
        default 10 slots of 8 MiB cost 40-50 ms per save: a 2 MiB state saved in 54 ms against FileSystemWriter's
        6-9, and at 2 ranks a 300 MiB one 1.47x its time (benchmarks/dcp_fixed_cost.py)."""
        mib = 1 << 20
        chunk = min(self.chunk_bytes, max(mib, -(-self._shard_bytes // mib) * mib))
        chunks = max(1, -(-self._shard_bytes // chunk))
        threads = min(self.threads, chunks)
        return threads, chunk, min(threads + 2, chunks) * chunk

    def _unlock(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def close(self) -> None:
        """Close this rank's engine and drop its lock (done by write_data/finish; safe to call twice)."""
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                engine.close()
        finally:
            self._unlock()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """All ranks: writes this rank's shard and returns once it is sealed and durable (not committed).

        One extent per write item: a tensor chunk's raw bytes (from the tensor's memory, or resolved
        while writing: the class docstring), or a non-tensor value as JSON. The shard's record tells
        the coordinator it is there: in torch.distributed's store with several ranks, else a DONE record.
        """
        try:  # every way out releases the engine and the lock (the coordinator's engine was opened by the plan)
            info = plan.storage_data
            if not isinstance(info, _RankPlan):
                raise UsageError("the plan carries no alpsck rank assignment: was prepare_global_plan of an "
                                 "AlpsckStorageWriter run?")
            if info.process_rank != self._process_rank:
                raise UsageError(f"the plan is for rank {info.process_rank}, this is rank {self._process_rank}")
            self.rank, self.world_size, step = info.rank, info.world_size, info.step
            self._supersede = info.supersede
            self._store_ns = info.store_ns
            extents: list[Extent] = []
            results: list[WriteResult] = []
            names: set[str] = set()
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    kind, raw = encode_item(planner, item)
                    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                    extent = Extent(extent_name(item.index, kind), data.numel(), functools.partial(given, data))
                else:
                    kind = "tensor"
                    tensor = functools.partial(self._resolved, planner, item)
                    extent = Extent(extent_name(item.index, kind), chunk_nbytes(item),
                                     functools.partial(flat_bytes_of, tensor), tensor)
                if extent.name in names:
                    raise UsageError(f"{item.index.fqn}: written twice by rank {self.rank} (extent {extent.name!r})")
                names.add(extent.name)
                extents.append(extent)
                results.append(WriteResult(index=item.index, size_in_bytes=extent.nbytes,
                                           storage_data=ExtentRef(self.rank, extent.name, extent.nbytes, kind)))
            meta = json.dumps({"format": SHARD_FORMAT, "step": step, "rank": self.rank,
                               "world_size": info.world_size})
            self._shard_bytes = sum(e.nbytes for e in extents)
            engine = self._open(self.rank, info.world_size)
            direct = in_place(planner, extents)
            if direct is not None:  # written from the tensors' own memory, by the engine's threads
                handle = engine.save(step, direct, meta, "zerocopy", direct, "deferred")
            else:
                handle = save_resolving_lazily(engine, step, extents, meta)
            try:
                self._while_writing()
            finally:
                handle.wait()
            self._unsynced = []  # a sealed shard: its engine synced them (dir_sync.h)
            if handle.result()["skipped"]:
                raise UsageError(f"{self.run_dir}: step {step} is already committed; a step is written once")
            retired = sorted(s for s, _ in engine.take_retired())
            if retired and self.rank == 0:
                warnings.warn(f"{self._dir()}: step(s) {', '.join(map(str, retired))} retired to superseded-step-* "
                              f"before step {step} was written again (removed by alpsck prune)", RuntimeWarning,
                              stacklevel=2)
        finally:
            self.close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _while_writing(self) -> None:
        """The save's small durable step that need not wait for the shard, done while the engine's threads
        write it: on the coordinator in checkpoint-directory mode, the marker's temp file (put in place by
        :meth:`finish`, after the commit). (The fsync of the directories holding the names :meth:`_open`
        created is the engine's, from its open on: cpp/core/dir_sync.h.)"""
        if self.rank == 0 and self.named and not self._marker_staged:
            self._marker_staged = stage_marker(self._dir())

    @staticmethod
    def _resolved(planner: SavePlanner, item: WriteItem) -> torch.Tensor:
        """The planner's tensor for a tensor item, checked against the plan."""
        td = item.tensor_data
        assert td is not None  # prepare_local_plan checked it
        t = planner.resolve_data(item)
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{item.index.fqn}: the planner resolved a tensor item to a {type(t).__name__}")
        if t.dtype != td.properties.dtype or tuple(t.shape) != tuple(td.chunk.sizes):
            raise UsageError(f"{item.index.fqn}: the planner resolved a {t.dtype} {list(t.shape)} tensor for a "
                             f"{td.properties.dtype} {list(td.chunk.sizes)} chunk")
        return t

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, last: commits the step with ``dcp-metadata.json`` (atomic), then applies retention.

        :func:`alpsck._core.commit_step` checks that every rank's shard is durable (its record in
        the store, or its DONE record), writes the metadata file and the manifest, renames ``step-N.tmp`` to ``step-N``
        (the commit point) and publishes LATEST. In checkpoint-directory mode the ``.metadata``
        marker follows, and only then are the older generations (the overwritten checkpoint) removed.
        """
        step, run_dir = self._writing, self._dir()
        if step is None:
            raise UsageError("finish() before prepare_global_plan()")
        storage: dict[MetadataIndex, ExtentRef] = {}
        for rank_results in results:
            for r in rank_results:
                if not isinstance(r.storage_data, ExtentRef):
                    raise UsageError("a write result does not come from AlpsckStorageWriter.write_data")
                storage[r.index] = r.storage_data
        world = self.world_size or len(results)
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        if metadata.version is None:
            from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

            metadata.version = CURRENT_DCP_VERSION
        data = encode_metadata(metadata, step=step, world_size=world)
        if len(data) > MAX_METADATA_BYTES:
            raise UsageError(f"the DCP metadata takes {len(data)} bytes as JSON, more than the {MAX_METADATA_BYTES} "
                             "a checkpoint's extra file may hold")
        decode_metadata(data, METADATA_FILE, step=step, world_size=world)  # never commit what load would refuse
        lock = lock_run_dir(run_dir, 0)
        try:
            # Done already, unless this rank's write_data did not run (a subclass's):
            unsynced, self._unsynced = self._unsynced, []
            for d in unsynced:
                fsync_path(d)
            self._while_writing()
            _core.commit_step(str(run_dir), step, world, [(METADATA_FILE, data)], self.commit_timeout_s,
                              time.monotonic() - self._started, store=self._store(),
                              store_ns=self._store_ns, metrics=self.metrics)
            rules = Policy(keep_last=1) if self.named else self.retention  # a checkpoint directory: its newest generation
            if self._marker_staged:
                self._marker_staged = False
                publish_marker(run_dir)
            elif self.named:
                write_marker(run_dir)
            if rules.keep_last and not (self.named and step == 1):  # a first generation has none older to retire
                warning = _core.retain_newest(str(run_dir), rules.keep_last, rules.keep_every_steps,
                                              float(rules.keep_every_seconds), rules.keep_best)
                if warning:
                    warnings.warn(f"{run_dir}: retention: {warning}", RuntimeWarning, stacklevel=2)
        finally:
            lock.release()
