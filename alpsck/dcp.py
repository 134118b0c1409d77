"""A torch.distributed.checkpoint (DCP) storage backend on the alpsck core, so DCP's planner reshards.

Use it where a checkpoint must load at another world size (or another sharding) than it was saved
with; at the same world size, :class:`alpsck.Checkpointer` restores directly::

    import torch.distributed.checkpoint as dcp
    from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter

    dcp.save(state_dict, storage_writer=AlpsckStorageWriter("runs/exp1", step))   # every rank
    dcp.load(state_dict, storage_reader=AlpsckStorageReader("runs/exp1"))        # any world size

On disk a DCP checkpoint is an ordinary alpsck checkpoint (``docs/format.md``), so
``alpsck inspect-checkpoints``, verification (``_core.scan``) and retention treat it like any
other: each rank writes ``RUN_DIR/step-N.tmp/rank-RRRRR.bin`` through its own core
:class:`alpsck._core.Engine` (one extent per DCP write item, CRC32C on every chunk, O_DIRECT,
``commit="deferred"``), and the coordinator commits the step with the DCP metadata as the extra
file ``dcp-metadata.json``, once every rank's shard is durable. The commit is the core's atomic
rename, so a crash at any point leaves either the whole checkpoint or none of it.

Call order (DCP drives it; see ``torch/distributed/checkpoint/storage.py``).
Save: ``storage_meta()`` and ``set_up_storage_writer()`` (all ranks) -> ``prepare_local_plan()``
(all ranks) -> ``prepare_global_plan()`` (coordinator: stamps every plan with its rank and the
world size, then opens the coordinator's engine, whose start-up removes abandoned ``step-*.tmp``
directories) -> ``write_data()`` (all ranks: the other ranks open their engines only now, after
the coordinator's clean-up; returns once this rank's shard is sealed and durable) -> ``finish()``
(coordinator: :func:`alpsck._core.commit_step`, then retention).
Load: ``read_metadata()`` (all ranks: picks the step, checks ``dcp-metadata.json`` against the
manifest's CRC32C, parses it with explicit validation) -> ``set_up_storage_reader()`` ->
``prepare_local_plan()`` -> ``prepare_global_plan()`` (coordinator: every rank must have picked the
same step) -> ``read_data()`` (each shard opened once; extents read in file order, in batches,
every chunk CRC-checked; straight into the destination when it is a whole, contiguous CPU chunk).

No pickle, ever. DCP's own FileSystemWriter pickles its Metadata and every non-tensor value;
here the Metadata is JSON (schema in ``docs/format.md``), rebuilt on read from a fixed set of
types (tensor dtypes from :data:`alpsck.tree.TENSOR_DTYPES`; unknown types, fields, dtypes or
layouts raise :class:`UnsafeCheckpointError`, inconsistent sizes and offsets
:class:`CorruptCheckpointError`, each naming the field). Non-tensor values (DCP's ``BYTE_IO``
items: ints, floats, strings, tuples, dicts ... that DCP would ``torch.save``) are stored as
alpsck's tagged JSON (:mod:`alpsck.tree`), taken from the planner's ``lookup_object`` (so
DCP's own pickle of them is never written); a value JSON cannot hold (a custom class, a tuple
holding tensors) fails the save with :class:`UsageError`; ``bytes`` and ``io.BytesIO`` values
(torchtitan's dataloader and train state) are stored as their bytes. On load a value is decoded
from JSON and set where DefaultLoadPlanner would set it, with no pickle at all; a planner with
its own ``load_bytes`` gets a ``torch.save`` of the decoded plain value, made here in memory:
what it unpickles was never read from disk.

Locking: a writer takes the run directory's per-rank writer lock
(:func:`alpsck.checkpointer.lock_run_dir`) while it writes: the coordinator in
``prepare_global_plan`` (its engine's start-up tidies the directory; the generation is chosen),
every rank during ``write_data``, and the coordinator again for the commit and retention in
``finish``. No lock is held between those calls, so a save that DCP abandons in between leaves
none. A DCP save and an open :class:`alpsck.Checkpointer` (or another job) on the same run
directory fail with :class:`RunDirLockedError` instead of removing each other's directories.
Readers take no lock.

Threading: a writer or reader serves one save or load at a time, driven by DCP on one thread per
rank (``async_save`` runs the whole save on its background thread). Long core calls release the
GIL. In a run directory a step is written once (a committed step raises UsageError).

Checkpoint-directory mode (``dcp.save(..., checkpoint_id="folder/step-10")``, as torchtitan names
its checkpoints): the named directory is a run directory of its own, each save the next generation
of it; ``finish`` commits the generation, then writes the ``.metadata`` marker DCP trainers look
for (JSON, ``alpsck.dcp_json.MARKER_BYTES``), then removes the older generations, so an overwrite
leaves the old checkpoint loadable until the new one is committed. The coordinator picks the
generation under the lock in ``prepare_global_plan`` and sends it to every rank in its plan.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import re
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _core, tree
from .checkpointer import lock_run_dir
from .dcp_json import (
    MARKER_NAMES,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    SHARD_FORMAT,
    ExtentRef,
    check_properties,
    decode_metadata,
    decode_value,
    encode_metadata,
    encode_planner_data,
    encode_value,
    extent_name,
    marker_problem,
    write_marker,
)
from .durable import fsync_path, read_small
from .errors import CorruptCheckpointError, NoCheckpointError, UsageError
from .inspect import entry_kind
from .options import DEFAULTS, check_step
from .options import check as check_option
from .shards import UNUSABLE, shard_name

__all__ = ["METADATA_FILE", "AlpsckStorageReader", "AlpsckStorageWriter"]

DEFAULT_READ_BATCH_BYTES = 512 << 20
_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")  # folder/step-20 -> ("step-", "20", ""): its siblings' pattern


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / _core.step_dir_name(step)


def _is_committed_step_dir(path: Path) -> bool:
    """``run/step-N`` with its manifest: one committed checkpoint of a run directory."""
    return _core.parse_run_dir_name(path.name)[0] == "step" and (path / _core.run_dir_names["manifest"]).is_file()


def _holds_alpsck_state(path: Path) -> bool:
    """Whether directory ``path`` is alpsck's: a LATEST, a history, an attempt ... or a step-N that holds a
    manifest. A bare ``step-10`` (a FileSystemWriter checkpoint, or a folder of named checkpoints) is not."""
    for name in os.listdir(path):
        kind = entry_kind(name)
        if kind == "step":
            if (path / name / _core.run_dir_names["manifest"]).is_file():
                return True
        elif kind not in ("other", "lock"):
            return True
    return False


def _is_marked(path: Path) -> bool:
    """A checkpoint directory AlpsckStorageWriter wrote (checkpoint-directory mode): it has alpsck's marker."""
    return (path / MARKER_NAMES[0]).is_file() and marker_problem(path) is None


def _is_alpsck_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether checkpoint_id names an alpsck run directory, a checkpoint directory written by
    AlpsckStorageWriter, or a committed step-N inside one; never raises."""
    try:
        path = Path(checkpoint_id)
        return path.is_dir() and (_is_committed_step_dir(path) or _holds_alpsck_state(path))
    except (OSError, TypeError, ValueError):
        return False


def _may_become_checkpoint(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether a writer can write a checkpoint at checkpoint_id: alpsck's already, an empty directory,
    or a path not there yet whose nearest existing parent is a writable directory (DCP's rule)."""
    try:
        if "://" in os.fspath(checkpoint_id):
            return False
        path = Path(checkpoint_id).absolute()
        if path.exists():
            return _is_alpsck_checkpoint_id(path) or (path.is_dir() and not os.listdir(path))
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
    except (OSError, TypeError, ValueError):
        return False


def _same_dir(a: str | os.PathLike[str], b: Path) -> bool:
    return Path(a).resolve() == b.resolve()


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in its plan's ``storage_data``."""

    rank: int
    world_size: int
    step: int  # the step (run-directory mode) or generation (checkpoint-directory mode) the save writes


def _encode_value(planner: SavePlanner, item: WriteItem) -> bytes:
    """One BYTE_IO item as JSON, from the planner's original object (never DCP's pickle of it)."""
    lookup = getattr(planner, "lookup_object", None)
    if not callable(lookup):
        raise UsageError(f"{item.index.fqn}: non-tensor values need a planner with lookup_object() (DefaultSavePlanner "
                         f"or a subclass); {type(planner).__name__} has none")
    return encode_value(lookup(item.index), item.index.fqn)


@dataclass(frozen=True)
class _Extent:
    """One write item of this rank's shard: its extent name, its size, and how to get its bytes (a flat
    uint8 CPU tensor; for a tensor item, the planner's resolve_data, called only then)."""

    name: str
    nbytes: int
    resolve: Callable[[], torch.Tensor]
    tensor: Callable[[], torch.Tensor] | None = None  # a tensor item: the planner's tensor, before flattening


def _make_dirs_durably(path: Path) -> None:
    """``mkdir -p path``, each directory it creates made durable in its parent (a checkpoint directory
    is new at every save in checkpoint-directory mode: its commit must not vanish with its name)."""
    missing: list[Path] = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for d in reversed(missing):
        fsync_path(d.parent)


def _chunk_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None  # prepare_local_plan checked it
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def _in_place(planner: SavePlanner, extents: list[_Extent]) -> list[tuple[str, torch.Tensor]] | None:
    """The extents as views of the tensors' own memory, when that costs no copy: DCP's default
    resolve_data (a lookup, allocating nothing) giving CPU tensors whose bytes are contiguous. None
    otherwise (device tensors, views, a planner whose resolve_data may allocate): they are resolved
    one at a time while the shard is written (:func:`_save_resolving_lazily`), as DCP's contract asks."""
    if type(planner).resolve_data is not DefaultSavePlanner.resolve_data:
        return None
    out: list[tuple[str, torch.Tensor]] = []
    for e in extents:
        if e.tensor is None:
            out.append((e.name, e.resolve()))
            continue
        t = e.tensor().detach()
        if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None
        out.append((e.name, t.reshape(-1).view(torch.uint8)))
    return out


def _save_resolving_lazily(engine: _core.Engine, step: int, extents: list[_Extent], meta: str) -> Any:
    """Write the shard through the engine's staging slots, chunk by chunk: each extent is resolved when
    its first byte is needed and dropped after its last one is copied, so resolving (a device-to-host
    copy, a planner's allocation) overlaps the writes and at most the extents spanning one chunk are
    held at once. Returns the save's handle."""
    handle, fill = engine.save_external(step, [(e.name, e.nbytes) for e in extents], meta, "deferred")
    if not fill.needed:
        return handle
    by_name = {e.name: e for e in extents}
    cb = int(fill.chunk_bytes)
    pieces: list[list[tuple[str, int, int, int]]] = [[] for _ in range(int(fill.num_chunks))]  # name, src, dst, n
    last: dict[str, int] = {}
    for name, offset, size in fill.extents:
        pos, end = int(offset), int(offset) + int(size)
        while pos < end:
            i = pos // cb
            n = min(end, (i + 1) * cb) - pos
            pieces[i].append((name, pos - int(offset), pos - i * cb, n))
            last[name] = i
            pos += n
    pool = engine.staging_tensor()
    live: dict[str, torch.Tensor] = {}
    try:
        for i, chunk in enumerate(pieces):
            slot = fill.acquire(i, block=True)
            if slot is None:
                break  # the save failed (a write error): its handle says why
            for name, src, dst, n in chunk:
                data = live.get(name)
                if data is None:
                    data = live[name] = by_name[name].resolve()
                    if data.numel() != by_name[name].nbytes:
                        raise UsageError(f"extent {name!r}: {data.numel()} bytes resolved for "
                                         f"{by_name[name].nbytes} planned")
                pool[int(slot) + dst: int(slot) + dst + n].copy_(data[src: src + n])
                if last[name] == i:
                    del live[name]
            fill.submit(i, slot)
    except BaseException as e:
        fill.fail(f"resolving the DCP write items of step {step} failed: {type(e).__name__}: {e}")
        raise
    finally:
        fill.finish()
    return handle


# ------------------------------------------------------------------------------ writer


class AlpsckStorageWriter(StorageWriter):
    """DCP StorageWriter: one alpsck shard per rank, one atomic commit.

    Two ways to name the checkpoint (docs/python-api.md, "Resharding"; docs/dcp.md):

    - **run-directory mode**, ``AlpsckStorageWriter(run_dir, step)``: checkpoint ``step`` of the
      alpsck run directory ``run_dir``, beside the Checkpointer's (``run_dir/step-00000000N``). A
      step is written once.
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
        step: the checkpoint's step in run-directory mode; it must not be committed yet.
        threads, chunk_bytes, commit_timeout_s: the engine's options (None: the defaults in
            alpsck.options, as for the Checkpointer).
        keep_last: run-directory mode: after the commit, keep the newest ``keep_last`` committed
            checkpoints of the run directory, DCP or not (0 keeps all).
        direct_io: O_DIRECT where the file system allows.
        overwrite: checkpoint-directory mode: whether a save may replace a committed checkpoint
            (DCP's default, True).

    CPU tensors that DCP's default planner hands over contiguous are written from their own memory
    (no snapshot copy): DCP keeps them unchanged until ``write_data`` returns (``dcp.async_save``
    stages a copy first). Anything else (device tensors, views, a planner whose ``resolve_data``
    allocates) is resolved one item at a time while the shard is written, through a few staging
    slots, so resolving overlaps writing and never holds the whole state at once. See the module
    docstring for the call order, locking and the no-pickle policy.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 threads: int | None = None, chunk_bytes: int | None = None, keep_last: int = 0,
                 commit_timeout_s: float | None = None, direct_io: bool = True, overwrite: bool = True) -> None:
        super().__init__()
        check_step(step, allow_none=True)
        if step is not None and run_dir is None:
            raise UsageError("AlpsckStorageWriter: step= needs the run directory it belongs to")
        self.run_dir: Path | None = None if run_dir is None else Path(run_dir)
        self.step = step  # None: checkpoint-directory mode
        self.threads = DEFAULTS["threads"] if threads is None else threads
        self.chunk_bytes = DEFAULTS["chunk_bytes"] if chunk_bytes is None else chunk_bytes
        self.keep_last = keep_last
        self.commit_timeout_s = DEFAULTS["commit_timeout_s"] if commit_timeout_s is None else commit_timeout_s
        for name in ("threads", "chunk_bytes", "keep_last", "commit_timeout_s"):
            check_option(name, getattr(self, name))
        self.direct_io = direct_io
        self.overwrite = overwrite
        self.save_id = str(uuid.uuid4())
        self.rank = 0
        self.world_size: int | None = None
        self._writing: int | None = None  # the step this save writes: self.step, or the coordinator's generation
        self._started = time.monotonic()
        self._engine: _core.Engine | None = None
        self._lock: _core.RunDirLock | None = None

    def __del__(self) -> None:  # a writer dropped after a failed save holds no lock
        with contextlib.suppress(Exception):
            self.close()

    # pickled by dcp.async_save's process executor: never the open engine or lock
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_engine"] = state["_lock"] = None
        return state

    @property
    def named(self) -> bool:
        """Checkpoint-directory mode: the checkpoint is the directory DCP's checkpoint_id names."""
        return self.step is None

    @property
    def checkpoint_id(self) -> str:
        if self.run_dir is None:
            return ""
        return str(self.run_dir if self.step is None else _step_dir(self.run_dir, self.step))

    def _dir(self) -> Path:
        if self.run_dir is None:
            raise UsageError("AlpsckStorageWriter() was given no checkpoint directory: pass checkpoint_id= to "
                             "dcp.save (or a path to AlpsckStorageWriter)")
        return self.run_dir

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True where this writer can save: an alpsck run or checkpoint directory, an empty directory, or a
        path not there yet under a writable directory; False for URLs and for other directories that
        hold files (a FileSystemWriter checkpoint, say)."""
        return _may_become_checkpoint(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (DCP calls this with ``dcp.save(checkpoint_id=...)``): the run directory or
        this writer's step keep run-directory mode; any other path is the checkpoint directory to write."""
        self.close()
        if checkpoint_id is not None:
            if "://" in os.fspath(checkpoint_id):
                raise UsageError(f"checkpoint_id {os.fspath(checkpoint_id)!r}: alpsck writes to a file system path")
            keep = self.run_dir is not None and self.step is not None and (
                _same_dir(checkpoint_id, self.run_dir) or _same_dir(checkpoint_id, _step_dir(self.run_dir, self.step)))
            if not keep:
                self.run_dir, self.step = Path(checkpoint_id), None
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
        self.rank = int(kwargs.get("rank") or 0)
        self._writing = self.step
        self._started = time.monotonic()  # the manifest's write_seconds counts from here
        if is_coordinator != (self.rank == 0):
            who = (f"rank {self.rank} was made the coordinator" if is_coordinator else
                   "rank 0 was not made the coordinator")
            raise UsageError(f"AlpsckStorageWriter needs rank 0 as the coordinator, and {who}: the deprecated "
                             "save_state_dict(coordinator_rank=...) is not supported; use dcp.save, whose coordinator "
                             "is rank 0")
        if not kwargs.get("use_collectives", True):
            raise UsageError("AlpsckStorageWriter commits one checkpoint for all ranks: use_collectives=False is not "
                             "supported")
        run_dir = self._dir()
        if self.step is not None:
            if (_step_dir(run_dir, self.step) / _core.run_dir_names["manifest"]).exists():
                raise UsageError(f"{run_dir}: step {self.step} is already committed; a step is written once "
                                 "(make a writer for a new step)")
        else:
            self._check_overwrite(run_dir)

    def _check_overwrite(self, path: Path) -> None:
        """Checkpoint-directory mode: refuse a directory holding someone else's files, or (overwrite=False)
        a committed checkpoint; DCP's wording, so its callers' checks match."""
        if not path.exists():
            return
        if not path.is_dir():
            raise UsageError(f"checkpoint_id {str(path)!r} is not a directory")
        why = marker_problem(path)
        foreign = sorted(n for n in os.listdir(path) if entry_kind(n) == "other" and n not in MARKER_NAMES)
        if why is None and foreign:
            why = f"{path} holds files alpsck did not write ({', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''})"
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
        for plan in plans:
            if plan.planner_data is not None:
                encode_planner_data(plan.planner_data)  # fails now rather than in finish()
        self.world_size = world
        self._open(0, world)
        try:
            if self.step is None:  # the next generation, chosen under the lock after the engine tidied the directory
                self._check_overwrite(self._dir())
                taken = [i["step"] for i in _core.scan(str(self._dir()))]
                self._writing = max(taken, default=0) + 1
        finally:
            # The engine stays open (its start-up tidied the directory, which must not happen again while
            # the other ranks write); the lock is taken again in write_data, so a save that fails in between
            # (DCP's finish_plan, or a subclass's write_data) leaves no lock behind.
            self._unlock()
        assert self._writing is not None
        return [replace(plan, storage_data=_RankPlan(i, world, self._writing)) for i, plan in enumerate(plans)]

    def _open(self, rank: int, world: int) -> _core.Engine:
        """This rank's engine, with the run directory's lock held (taken again if it was let go)."""
        run_dir = self._dir()
        if self._lock is None:
            _make_dirs_durably(run_dir)
            self._lock = lock_run_dir(run_dir, rank)
        if self._engine is None:
            try:
                # staging_bytes: slots for the items resolved while writing (mapped now, touched only then)
                self._engine = _core.Engine(str(run_dir), threads=self.threads, chunk_bytes=self.chunk_bytes,
                                            staging_bytes=(self.threads + 2) * self.chunk_bytes,
                                            max_in_flight=1, keep_last=0,
                                            direct_io=self.direct_io, rank=rank, world_size=world,
                                            commit_timeout_s=self.commit_timeout_s)
            except BaseException:
                self.close()
                raise
            if self.direct_io and not self._engine.direct_io:
                warnings.warn(f"{run_dir}: the file system refused O_DIRECT; alpsck writes buffered and "
                              "fdatasyncs instead", RuntimeWarning, stacklevel=3)
        return self._engine

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
        while writing: the class docstring), or a non-tensor value as JSON. The shard's DONE record
        tells the coordinator it is there.
        """
        try:  # every way out releases the engine and the lock (the coordinator's engine was opened by the plan)
            info = plan.storage_data
            if not isinstance(info, _RankPlan):
                raise UsageError("the plan carries no alpsck rank assignment: was prepare_global_plan of an "
                                 "AlpsckStorageWriter run?")
            if info.rank != self.rank:
                raise UsageError(f"the plan is for rank {info.rank}, this is rank {self.rank}")
            self.world_size, step = info.world_size, info.step
            extents: list[_Extent] = []
            results: list[WriteResult] = []
            names: set[str] = set()
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    kind = "json"
                    data = torch.frombuffer(bytearray(_encode_value(planner, item)), dtype=torch.uint8)
                    extent = _Extent(extent_name(item.index, kind), data.numel(), lambda data=data: data)
                else:
                    kind = "tensor"
                    tensor = functools.partial(self._resolved, planner, item)
                    extent = _Extent(extent_name(item.index, kind), _chunk_nbytes(item),
                                     lambda tensor=tensor: tree.flat_bytes(tensor()), tensor)
                if extent.name in names:
                    raise UsageError(f"{item.index.fqn}: written twice by rank {self.rank} (extent {extent.name!r})")
                names.add(extent.name)
                extents.append(extent)
                results.append(WriteResult(index=item.index, size_in_bytes=extent.nbytes,
                                           storage_data=ExtentRef(self.rank, extent.name, extent.nbytes, kind)))
            meta = json.dumps({"format": SHARD_FORMAT, "step": step, "rank": self.rank,
                               "world_size": info.world_size})
            engine = self._open(self.rank, info.world_size)
            direct = _in_place(planner, extents)
            if direct is not None:  # written from the tensors' own memory
                handle = engine.save(step, direct, meta, "zerocopy", direct, "deferred")
            else:
                handle = _save_resolving_lazily(engine, step, extents, meta)
            handle.wait()
            if handle.result()["skipped"]:
                raise UsageError(f"{self.run_dir}: step {step} is already committed; a step is written once")
        finally:
            self.close()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

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

        :func:`alpsck._core.commit_step` checks that every rank's shard is durable (its DONE
        record), writes the metadata file and the manifest, renames ``step-N.tmp`` to ``step-N``
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
            _core.commit_step(str(run_dir), step, world, [(METADATA_FILE, data)], self.commit_timeout_s,
                              time.monotonic() - self._started)
            keep = 1 if self.named else self.keep_last
            if self.named:
                write_marker(run_dir)
            if keep:
                warning = _core.retain_newest(str(run_dir), keep)
                if warning:
                    warnings.warn(f"{run_dir}: retention: {warning}", RuntimeWarning, stacklevel=2)
        finally:
            lock.release()


# ------------------------------------------------------------------------------ reader


def _read_small(path: Path, limit: int) -> bytes:
    data = read_small(path, limit)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path}: larger than {limit} bytes")
    return data


def _set_value(planner: LoadPlanner, req: ReadItem, value: Any) -> None:
    """DefaultLoadPlanner.load_bytes's assignment, given the value itself rather than a pickle of it."""
    assert isinstance(planner, DefaultLoadPlanner)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[req.dest_index.fqn], value)
    else:
        planner.state_dict[req.dest_index.fqn] = value


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


class AlpsckStorageReader(StorageReader):
    """DCP StorageReader for checkpoints written by :class:`AlpsckStorageWriter`, at any world size.

    Args:
        run_dir: a run directory, a checkpoint directory (checkpoint-directory mode), or one
            committed ``run/step-00000000N``; None: the ``checkpoint_id`` given to ``dcp.load``.
        step: the checkpoint to load from a run directory; None: the newest committed one that has
            DCP metadata (a newer one that fails its checks is skipped with a warning naming what
            was wrong).
        threads: reader threads per shard (chunks are CRC-checked on them).
        read_batch_bytes: at most this many bytes of extents are read per batch (bounds the
            temporary memory of chunks that cannot be read straight into their destination).
        direct_io: O_DIRECT reads.
        fallback: a checkpoint directory none of whose generations is valid (``folder/step-20``) is
            skipped with a warning for the newest valid sibling of a lower number (``folder/step-10``),
            checkpoint directories both; False raises instead. A run directory never falls back to
            another run directory.

    Each load picks its checkpoint afresh (a reused reader sees saves committed since). A chunk that
    fails its CRC raises :class:`CorruptCheckpointError` out of ``dcp.load`` (as DCP's
    CheckpointException); destinations already filled by then keep the new values.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 threads: int = DEFAULTS["read_threads"], read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
                 direct_io: bool = True, fallback: bool = True) -> None:
        super().__init__()
        check_step(step, allow_none=True)
        self.run_dir: Path | None = None if run_dir is None else Path(run_dir)
        self.requested_step = step
        self.threads = threads
        self.read_batch_bytes = read_batch_bytes
        self.direct_io = direct_io
        self.fallback = fallback
        self.load_id = str(uuid.uuid4())
        self.step: int | None = None          # the step read_metadata picked
        self.path: Path | None = None         # its directory
        self._metadata: Metadata | None = None

    @property
    def checkpoint_id(self) -> str:
        return str(self.path or self.run_dir or "")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for an alpsck run directory, checkpoint directory, or committed step-N inside one."""
        return _is_alpsck_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins (DCP calls this with ``dcp.load(checkpoint_id=...)``): the run directory keeps
        ``step``; any other path is read instead (a checkpoint directory, or a run directory's newest)."""
        if checkpoint_id is not None and (self.run_dir is None or not _same_dir(checkpoint_id, self.run_dir)):
            self.run_dir, self.requested_step = Path(checkpoint_id), None
        self.load_id = str(uuid.uuid4())
        self.step = self.path = self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """All ranks: picks the checkpoint (afresh on every call) and returns its validated Metadata.

        DCP asks again with ``rank=`` after a failure (for its rank-local metadata files); alpsck
        has one global file, so that retry fails at once instead of repeating the search.
        """
        if kwargs.get("rank") is not None:
            raise UsageError(f"alpsck keeps one {METADATA_FILE} per checkpoint, no rank-local metadata")
        md = self._metadata = self._pick()
        md.storage_meta = replace(md.storage_meta or StorageMeta(), load_id=self.load_id)
        return md

    def _pick(self) -> Metadata:
        if self.run_dir is None:
            raise UsageError("AlpsckStorageReader() was given no checkpoint: pass checkpoint_id= to dcp.load (or a "
                             "path to AlpsckStorageReader)")
        where, step = self.run_dir, self.requested_step
        if step is None and _is_committed_step_dir(where):  # run/step-00000000N: that step of its run directory
            where, step = where.parent, _core.parse_run_dir_name(where.name)[1]
        if step is not None:
            return self._pick_step(where, step)
        skipped: list[str] = []
        try:
            md = self._pick_newest(where, skipped)
        except NoCheckpointError:
            if not (self.fallback and skipped and _is_marked(where)):  # never from one run directory to another
                raise
            md = self._pick_sibling(where, skipped)
        for why in skipped:
            warnings.warn(f"skipping checkpoint: {why}", RuntimeWarning, stacklevel=4)
        return md

    def _pick_step(self, run_dir: Path, step: int) -> Metadata:
        info = next((i for i in _core.scan(str(run_dir)) if i["step"] == step), None)
        if info is None:
            raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}")
        if info["status"] != "committed":
            raise CorruptCheckpointError(f"{info['path']}: {info['status']}: {info['error']}")
        if METADATA_FILE not in info["extra_files"]:
            raise UsageError(f"{info['path']}: not a DCP checkpoint (no {METADATA_FILE}); one written by "
                             "alpsck.Checkpointer is restored with Checkpointer.restore at its world size")
        return self._load(info)

    def _pick_newest(self, run_dir: Path, skipped: list[str]) -> Metadata:
        """The newest valid DCP checkpoint of ``run_dir`` (a generation, in a checkpoint directory);
        what was skipped on the way is appended to ``skipped``."""
        if not run_dir.exists():
            raise NoCheckpointError(f"{run_dir}: no valid DCP checkpoint (no such directory)")
        why = marker_problem(run_dir)
        if why is not None:
            raise UsageError(f"{why}, not a checkpoint alpsck wrote: load it with DCP's FileSystemReader")
        infos = sorted(_core.scan(str(run_dir)), key=lambda i: i["step"], reverse=True)
        for info in infos:
            if info["status"] in UNUSABLE:
                skipped.append(f"{info['path']}: {info['status']}: {info['error']}")
                continue
            if info["status"] != "committed" or METADATA_FILE not in info["extra_files"]:
                continue
            try:
                return self._load(info)
            except CorruptCheckpointError as e:  # UnsafeCheckpointError included
                skipped.append(str(e))
        raise NoCheckpointError(f"{run_dir}: no valid DCP checkpoint" +
                                (f" (skipped: {'; '.join(skipped)})" if skipped else ""))

    def _pick_sibling(self, named: Path, skipped: list[str]) -> Metadata:
        """``folder/step-20`` held no valid checkpoint: the newest valid ``folder/step-M``, M < 20 (the
        same name with a lower number), as a run directory falls back to its last good step."""
        m = _NUMBERED.match(named.name)
        siblings: list[tuple[int, Path]] = []
        if m is not None:
            with contextlib.suppress(OSError):
                for entry in os.scandir(named.parent):
                    s = _NUMBERED.match(entry.name)
                    if (s is not None and (s[1], s[3]) == (m[1], m[3]) and int(s[2]) < int(m[2])
                            and entry.is_dir(follow_symlinks=False)):
                        siblings.append((int(s[2]), Path(entry.path)))
        for _, path in sorted(siblings, reverse=True):
            if not _is_marked(path):
                continue
            before = len(skipped)
            try:
                md = self._pick_newest(path, skipped)
            except (NoCheckpointError, UsageError):
                continue
            skipped[:] = [f"{named} held no valid checkpoint ({'; '.join(skipped[:before])}); loading {path} instead"]
            return md
        raise NoCheckpointError(f"{named}: no valid DCP checkpoint (skipped: {'; '.join(skipped)}), and no "
                                "valid one of a lower number beside it")

    def _load(self, info: dict[str, Any]) -> Metadata:
        """The Metadata of one committed checkpoint: ``dcp-metadata.json`` checked against the manifest."""
        path = Path(info["path"])
        try:
            manifest = json.loads(_read_small(path / _core.run_dir_names["manifest"], MAX_METADATA_BYTES))
            entry = next(x for x in manifest["extra"] if x.get("name") == METADATA_FILE)
            want_bytes, want_crc = int(entry["bytes"]), int(entry["crc"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
            raise CorruptCheckpointError(f"{path}/MANIFEST.json: no valid entry for {METADATA_FILE} ({e!r})") from e
        data = _read_small(path / METADATA_FILE, MAX_METADATA_BYTES)
        if len(data) != want_bytes or _core.crc32c(data) != want_crc:
            raise CorruptCheckpointError(f"{path / METADATA_FILE}: size or CRC32C differs from the manifest")
        md = decode_metadata(data, str(path / METADATA_FILE), step=info["step"], world_size=info["ranks"])
        self.step, self.path = int(info["step"]), path
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks: the metadata must be the one this reader's read_metadata returned."""
        if metadata is not self._metadata or self.path is None:
            raise UsageError("AlpsckStorageReader reads only the metadata its own read_metadata() returned")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return replace(plan, storage_data=self.step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank must have picked the same checkpoint (a save may have landed in between)."""
        steps = sorted({p.storage_data for p in plans}, key=str)
        if len(steps) > 1:
            raise UsageError(f"{self.run_dir}: the ranks picked different checkpoints (steps {steps}); pass step= to "
                             "AlpsckStorageReader")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """All ranks: reads what ``plan`` asks for, shard by shard, each shard opened once."""
        md, path = self._metadata, self.path
        if md is None or path is None:
            raise UsageError("read_data before read_metadata")
        storage: dict[MetadataIndex, ExtentRef] = md.storage_data
        by_rank: dict[int, dict[str, list[ReadItem]]] = {}
        refs: dict[str, ExtentRef] = {}
        for req in plan.items:
            ref = storage.get(req.storage_index)
            if ref is None:
                raise CorruptCheckpointError(f"{path}: no stored data for {req.storage_index.fqn!r} at "
                                             f"{req.storage_index.offset}")
            by_rank.setdefault(ref.rank, {}).setdefault(ref.extent, []).append(req)
            refs[f"{ref.rank}/{ref.extent}"] = ref
        for rank in sorted(by_rank):
            shard = path / shard_name(rank)
            reader = _core.ShardReader(str(shard), self.direct_io)
            layout = {name: (offset, size) for name, offset, size in reader.extents}
            wanted = by_rank[rank]
            for name in wanted:
                have = layout.get(name)
                if have is None or have[1] != refs[f"{rank}/{name}"].nbytes:
                    raise CorruptCheckpointError(
                        f"{shard}: extent {name!r} " + ("is missing" if have is None else
                                                        f"has {have[1]} bytes, the metadata says "
                                                        f"{refs[f'{rank}/{name}'].nbytes}"))
            batch: list[tuple[ExtentRef, list[ReadItem]]] = []
            size = 0
            for name in sorted(wanted, key=lambda n: layout[n][0]):
                ref = refs[f"{rank}/{name}"]
                batch.append((ref, wanted[name]))
                size += ref.nbytes
                if size >= self.read_batch_bytes:
                    self._read_batch(reader, shard, batch, planner, md)
                    batch, size = [], 0
            if batch:
                self._read_batch(reader, shard, batch, planner, md)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_batch(self, reader: _core.ShardReader, shard: Path, batch: list[tuple[ExtentRef, list[ReadItem]]],
                    planner: LoadPlanner, md: Metadata) -> None:
        """One read_into call for the batch's extents, then the copies into the destinations and the commits."""
        dsts: list[tuple[str, torch.Tensor]] = []
        direct: list[tuple[ReadItem, torch.Tensor]] = []  # read straight into the destination
        values: list[tuple[ExtentRef, list[ReadItem], torch.Tensor]] = []
        copies: list[tuple[list[ReadItem], torch.Tensor, torch.Tensor | None]] = []  # (reqs, chunk, resolved dest)
        for ref, reqs in batch:
            if ref.kind == "json":
                buf = torch.empty(ref.nbytes, dtype=torch.uint8)
                if ref.nbytes:
                    dsts.append((ref.extent, buf))
                values.append((ref, reqs, buf))
                continue
            tmd = md.state_dict_metadata[reqs[0].storage_index.fqn]
            assert isinstance(tmd, TensorStorageMetadata)  # decode_metadata checked every storage entry
            sizes = tuple(tmd.chunks[self._chunk_index(tmd, reqs[0])].sizes)
            dtype = tmd.properties.dtype
            resolved: torch.Tensor | None = None
            req = reqs[0]
            if len(reqs) == 1 and not any(req.storage_offsets) and tuple(req.lengths) == sizes:
                resolved = planner.resolve_tensor(req).detach()
                if (resolved.device.type == "cpu" and resolved.dtype == dtype and resolved.is_contiguous()
                        and tuple(resolved.shape) == sizes):
                    if ref.nbytes:
                        dsts.append((ref.extent, resolved.reshape(-1).view(torch.uint8)))
                    direct.append((req, resolved))
                    continue
            chunk = torch.empty(sizes, dtype=dtype)
            if ref.nbytes:
                dsts.append((ref.extent, chunk.reshape(-1).view(torch.uint8)))
            copies.append((reqs, chunk, resolved))
        reader.read_into(dsts, self.threads)
        for req, dest in direct:
            planner.commit_tensor(req, dest)
        for reqs, chunk, resolved in copies:
            for req in reqs:
                src = _narrow(chunk, req.storage_offsets, req.lengths)
                dest = resolved if resolved is not None else planner.resolve_tensor(req).detach()
                if dest.shape != src.shape:
                    raise CorruptCheckpointError(f"{shard}: {req.storage_index.fqn!r}: the stored region "
                                                 f"{list(src.shape)} does not fit the destination {list(dest.shape)}")
                dest.copy_(src)
                planner.commit_tensor(req, dest)
        for ref, reqs, buf in values:
            raw = buf.numpy().tobytes()
            for req in reqs:
                value = decode_value(raw, f"{shard}:{ref.extent}")  # a fresh object for each destination
                if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
                    _set_value(planner, req, value)  # what DefaultLoadPlanner does, without its pickle round trip
                    continue
                pickled = io.BytesIO()
                torch.save(value, pickled)  # made here from plain values decoded from JSON, for a custom load_bytes
                pickled.seek(0)
                planner.load_bytes(req, pickled)

    @staticmethod
    def _chunk_index(tmd: TensorStorageMetadata, req: ReadItem) -> int:
        hint = req.storage_index.index
        if hint is not None and 0 <= hint < len(tmd.chunks) and tmd.chunks[hint].offsets == req.storage_index.offset:
            return hint
        for i, c in enumerate(tmd.chunks):
            if c.offsets == req.storage_index.offset:
                return i
        raise CorruptCheckpointError(f"{req.storage_index.fqn!r}: no chunk at {req.storage_index.offset}")
