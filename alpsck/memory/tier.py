"""The memory tier as a Checkpointer holds it (:class:`MemoryTier`): this node's engine in the run's memory
directory, the node's ranks (a save to memory is committed by them alone), and on a node's leader the replica
ring's worker when the job spans several nodes."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch

from ..handles import CoreSave
from ..ranks import Ranks, mine
from ..store import memory_tier
from ..store.engines import Opened, open_memory, run_token_for_memory
from ..store.preflight import preflight_refusal
from .nodes import node_layout
from .replica import Replicator
from .restore import restore_across_tiers


class MemoryTier:
    """One Checkpointer's memory tier (module docstring). ``base``: the run's memory directory (one name on
    every node); ``directory``: this node's ranks' checkpoints in it (``ranks-FIRST-LAST``)."""

    def __init__(self, memory: bool | str | os.PathLike[str], run_dir: Path, engine_opts: dict[str, Any],
                 ranks: Ranks, run_dir_opened: Opened) -> None:
        """``run_dir_opened``: the run directory's engine as :func:`alpsck.store.engines.open_engine` opened it,
        with what :meth:`words_at_open` had the ranks say (every rank's node; with ``memory`` True, the run's
        identity, which rank 0 reads or makes under the run directory's lock)."""
        self.nodes = node_layout(ranks, [w[0] for w in run_dir_opened.said])
        self.local: Ranks = self.nodes.local
        self.base = Path(memory) if not isinstance(memory, bool) else \
            memory_tier.memory_dir_for(run_dir, run_dir_opened.rank0_said[0])
        self.directory = self.base / self.nodes.name(self.nodes.index)
        opened = open_memory(self.base, engine_opts, self.local, self.nodes.name(self.nodes.index))
        self.engine, self.lock = opened.engine, opened.lock
        self.replicator = Replicator(self.nodes, self.base, self.directory) \
            if self.nodes.count > 1 and self.nodes.leader else None
        self._owners: dict[tuple[tuple[str, int], ...], dict[str, int]] = {}
        self._preflight = 0

    @staticmethod
    def words_at_open(memory: bool | str | os.PathLike[str],
                      run_dir: Path) -> tuple[Callable[[], list[int]] | None, list[int]]:
        """What the ranks say as the run directory's engine opens, for a memory tier (``open_engine``'s
        ``rank0_says`` and ``say``): every rank its node, and with ``memory`` True rank 0 the run's identity."""
        return (lambda: [run_token_for_memory(run_dir)]) if memory is True else None, [memory_tier.host_key()]

    def mine(self, tensors: Mapping[str, torch.Tensor], replicated: frozenset[str]) -> list[tuple[str, torch.Tensor]]:
        """The tensors this rank writes to memory: replicated ones are spread over the node's ranks, so that
        each node's checkpoint is whole by itself."""
        return mine(tensors, replicated, self.local, self._owners)

    def refusal(self, size: int) -> str:
        """The node leader's pre-flight (Checkpointer's ``preflight``): one checkpoint kept, one in flight and,
        with several nodes, the previous node's replica fit in the memory directory's free space."""
        if self.local.rank != 0:
            return ""
        copies = 3 if self.nodes.count > 1 else 2
        why, self._preflight = preflight_refusal(self.directory, size, self.local.world_size, copies, self._preflight)
        return why

    def before_save(self) -> None:
        """Wait until the previous memory save's replica is sent (:mod:`alpsck.memory.replica`, back-pressure)."""
        if self.replicator is not None:
            self.replicator.drain()

    def replicate(self, handle: CoreSave) -> None:
        """Send the memory save ``handle`` to the next node once committed (its leader only)."""
        if self.replicator is not None:
            self.replicator.submit(handle)

    def wait(self) -> None:
        self.engine.wait_all()
        if self.replicator is not None:
            self.replicator.drain()

    def close(self) -> None:
        """Stop replicating (after the last replica) and close the engine; the lock is released by release()."""
        try:
            if self.replicator is not None:
                self.replicator.close()
        finally:
            self.engine.close()

    def release(self) -> None:
        self.lock.release()

    def restore(self, run_dir: Path, state: MutableMapping[str, Any], *, step: int | None, ranks: Ranks,
                allow_unhealthy: bool) -> tuple[int | None, str | None]:
        """Restore across the tiers (:func:`alpsck.memory.restore.restore_across_tiers`), after the replicas
        in flight."""
        if self.replicator is not None:
            self.replicator.drain()
        return restore_across_tiers(run_dir, self.base, self.nodes, state, step=step, ranks=ranks,
                                    allow_unhealthy=allow_unhealthy)

