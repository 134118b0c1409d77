"""Opening the engines a Checkpointer writes through: the run directory's (:func:`open_engine`) and the
memory tier's (:func:`open_memory`), on every rank, each with its directory's writer lock held.

The ranks' collectives come in as :class:`Collectives` (``alpsck.ranks.Ranks`` is one), so that this
layer stays below the one that knows torch.distributed."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from .. import _core
from ..errors import CheckpointError, UsageError
from . import memory_tier
from .durable import fsync_dirs_quietly, make_dirs
from .lock import lock_run_dir


class Collectives(Protocol):
    """What opening an engine needs of the ranks (``alpsck.ranks.Ranks``)."""

    rank: int
    world_size: int

    def all_true(self, ok: bool) -> bool: ...
    def each(self, value: int) -> list[int]: ...
    def from_rank0(self, values: list[int]) -> list[int]: ...
    def agreement_store(self, token: int | None = None) -> tuple[Any, str] | None: ...


def open_engine(directory: Path, opts: dict[str, Any], ranks: Collectives, faults: Sequence[dict[str, Any]] = (),
                before_rank0: Callable[[], None] | None = None) -> tuple[_core.Engine, _core.RunDirLock]:
    """Every rank's engine on ``directory``, with its lock held. Rank 0's engine cleans up abandoned
    directories when it opens, so it opens first (after ``before_rank0``: the Lustre layout) and the others
    only after it succeeded (rank 0's word, with the namespace of the ranks' agreements it drew); then every
    rank must have opened (two collectives). A failed open leaves nothing open or locked, on any rank."""
    token = secrets.randbits(62)  # the namespace's number; rank 0's goes to the others with its word that it opened
    engine: _core.Engine | None = None
    lock: _core.RunDirLock | None = None
    for first in (True, False):
        error: BaseException | None = None
        if (ranks.rank == 0) == first:
            unsynced: list[Path] = []
            try:
                agreement = ranks.agreement_store(token)
                store, store_ns = agreement if agreement is not None else (None, "")
                # A power loss must not take a new run dir's name: the engine fsyncs the directories that hold
                # the new names while its first save is written, before that save counts as durable.
                unsynced = make_dirs(directory)
                if ranks.rank == 0 and before_rank0 is not None:
                    before_rank0()
                lock = lock_run_dir(directory, ranks.rank)
                engine = _core.Engine(
                    str(directory), opts, rank=ranks.rank, world_size=ranks.world_size,
                    one_history=True,  # each save retires the abandoned history first (Checkpointer's docstring)
                    store=store, store_ns=store_ns,  # several ranks agree on each commit through it
                    faults=[dict(f) for f in faults],  # test hook: inject I/O errors (cpp/core/env.h)
                    unsynced_dirs=[str(d) for d in unsynced])
            except Exception as e:
                error = e
                if engine is None:  # no engine to sync them: done here, so a later open finds the names durable
                    fsync_dirs_quietly(unsynced)
        if first:  # only rank 0 did anything: its word, and the token, to every rank
            opened, token = ranks.from_rank0([int(error is None), token] if ranks.rank == 0 else [])
        else:
            opened = ranks.all_true(error is None)
        if not opened:
            if engine is not None:
                engine.close()
            if lock is not None:
                lock.release()
            if error is not None:
                raise error
            raise CheckpointError(f"{directory}: another rank could not open its checkpointer (see its log)")
    assert engine is not None and lock is not None
    return engine, lock


def open_memory(memory: bool | str | os.PathLike[str], run_dir: Path, opts: dict[str, Any], ranks: Collectives,
                node: Collectives, group: str) -> tuple[Path, Path, _core.Engine, _core.RunDirLock]:
    """The memory tier's directory (``memory``: the Checkpointer's argument, True or a directory;
    :mod:`alpsck.store.memory_tier`), and the engine of this node's ranks (``node``: their collectives,
    ``group``: their directory's name in it, :func:`alpsck.store.memory_tier.group_dir_name`) there: (the
    run's memory directory, this node's, its engine, its lock). A collective of every rank."""
    if memory is not True and (isinstance(memory, bool) or not isinstance(memory, (str, os.PathLike))):
        raise UsageError(f"memory: {memory!r}: must be True, False or a directory")
    if memory is True:  # rank 0 holds the run directory's lock: it reads or makes the identity, the others take it
        token, error = -1, None
        if ranks.rank == 0:
            try:
                token = memory_tier.run_token(run_dir)
            except OSError as e:
                error = e
        [token] = ranks.from_rank0([token] if ranks.rank == 0 else [])
        if token < 0:
            raise CheckpointError(f"{run_dir}: the run's identity could not be read or made for its memory tier"
                                  + (f": {error}" if error is not None else " (rank 0's error says why)"))
        memory = memory_tier.memory_dir_for(run_dir, token)
    base = Path(memory)
    engine, lock = open_engine(base / group, memory_tier.engine_options(opts), node)
    return base, base / group, engine, lock
