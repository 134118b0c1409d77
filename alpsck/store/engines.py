"""Opening the engines a Checkpointer writes through: the run directory's (:func:`open_engine`) and the
memory tier's (:func:`open_memory`), on every rank, each with its directory's writer lock held.

The ranks' collectives come in as :class:`Collectives` (``alpsck.ranks.Ranks`` is one), so that this
layer stays below the one that knows torch.distributed.

An open that fails raises with no reference cycle through its frames (an exception held in a local of a
frame its traceback holds): such a cycle would keep the half-made Checkpointer, and with it the process
group its ranks use, alive until the cyclic collector runs, past ``destroy_process_group()``, and a gloo
group still alive as the interpreter exits aborts the process ("terminate called without an active
exception": a rank whose open failed, in CI 42)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    def each_list(self, values: list[int]) -> list[list[int]]: ...
    def from_rank0(self, values: list[int]) -> list[int]: ...
    def agreement_store(self, token: int | None = None) -> tuple[Any, str] | None: ...


@dataclass
class Opened:
    """An engine open on every rank (:func:`open_engine`), and what the ranks said on the way."""

    engine: _core.Engine
    lock: _core.RunDirLock
    rank0_said: list[int]  # what rank 0's ``rank0_says`` returned, on every rank ([] without one)
    said: list[list[int]]  # every rank's ``say``, indexed by rank ([] without one)


def open_engine(directory: Path, opts: dict[str, Any], ranks: Collectives, faults: Sequence[dict[str, Any]] = (),
                before_rank0: Callable[[], None] | None = None, *,
                rank0_says: Callable[[], list[int]] | None = None, say: Sequence[int] = (),
                refused: Exception | None = None) -> Opened:
    """Every rank's engine on ``directory``, with its lock held. Rank 0's engine cleans up abandoned
    directories when it opens, so it opens first (after ``before_rank0``: the Lustre layout) and the others
    only after it succeeded (rank 0's word, with the namespace of the ranks' agreements it drew); then every
    rank must have opened (two collectives). A failed open leaves nothing open or locked, on any rank.

    What the caller's ranks must learn at open rides on those two collectives, rather than costing one more
    each: ``rank0_says`` (run by rank 0 once its engine is open, under its lock; what it raises fails the
    open) goes with rank 0's word, ``say`` (this rank's ints) with every rank's. ``refused``: why this rank may
    not open (its caller's checks): it opens nothing, raises that, and the others learn that it failed."""
    token = secrets.randbits(62)  # the namespace's number; rank 0's goes to the others with its word that it opened
    engine: _core.Engine | None = None
    lock: _core.RunDirLock | None = None
    rank0_said: list[int] = []
    said: list[list[int]] = []
    for first in (True, False):
        error: BaseException | None = None
        if (ranks.rank == 0) == first and refused is not None:
            error = refused
        elif (ranks.rank == 0) == first:
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
                if ranks.rank == 0 and rank0_says is not None:
                    rank0_said = list(rank0_says())
            except Exception as e:
                error = e
                if engine is None:  # no engine to sync them: done here, so a later open finds the names durable
                    fsync_dirs_quietly(unsynced)
        if first:  # only rank 0 did anything: its word, and the token, to every rank
            opened, token, *rank0_said = ranks.from_rank0([int(error is None), token, *rank0_said]
                                                          if ranks.rank == 0 else [])
        elif say:
            words = ranks.each_list([int(error is None), *say])
            opened, said = all(w[0] for w in words), [w[1:] for w in words]
        else:
            opened = ranks.all_true(error is None)
        if not opened:
            if engine is not None:
                engine.close()
            if lock is not None:
                lock.release()
            if error is not None:
                try:
                    raise error
                finally:  # the error's traceback holds this frame: no cycle through its locals (module docstring)
                    error = refused = None
            raise CheckpointError(f"{directory}: another rank could not open its checkpointer (see its log)")
    assert engine is not None and lock is not None
    return Opened(engine, lock, rank0_said, said)


def check_memory(memory: Any) -> None:
    """UsageError unless ``memory`` is a Checkpointer's ``memory`` argument: True, False or a directory."""
    if not isinstance(memory, bool) and not isinstance(memory, (str, os.PathLike)):
        raise UsageError(f"memory: {memory!r}: must be True, False or a directory")


def run_token_for_memory(run_dir: Path) -> int:
    """The run's identity (:func:`alpsck.store.memory_tier.run_token`), for rank 0 to say as its engine on the run
    directory opens (it holds the lock); CheckpointError naming the run directory when it can be neither read nor
    made."""
    try:
        return memory_tier.run_token(run_dir)
    except OSError as e:
        raise CheckpointError(f"{run_dir}: the run's identity could not be read or made for its memory tier: {e}") from e


def open_memory(base: Path, opts: dict[str, Any], node: Collectives, group: str) -> Opened:
    """The engine of this node's ranks (``node``: their collectives, ``group``: their directory's name,
    :func:`alpsck.store.memory_tier.group_dir_name`) in the run's memory directory ``base``, with the memory
    tier's options (a collective of the node's ranks)."""
    return open_engine(base / group, memory_tier.engine_options(opts), node)
