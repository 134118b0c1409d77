"""The ranks of a multi-rank checkpointer: who writes what, and the few points where they agree.

Saving needs no collective: every rank writes its own shard and the C++ core commits through the
file system (see ``cpp/core/coordinate.h``), so a save never blocks training on the other ranks.
Collectives happen only outside the training loop, on a dedicated gloo group (so an NCCL default
group is never used from the checkpointer, and CPU tensors suffice):

* at start-up, rank 0 opens its engine (which cleans up abandoned directories) before the others;
* on restore, rank 0 alone lists the run directory and picks the candidate checkpoints, which it
  broadcasts (its listing alone decides whether a step asked for exists and whether the world
  size fits; the others read the steps at their names), and every rank must read its part of one
  successfully before any of them
  loads it into the live state; each rank reports how its read went, so that all skip the same
  checkpoint or all stop, never one rank alone.

Replicated tensors (identical on every rank: a DDP model, its optimizer state) are written once.
:func:`assign_owners` spreads them over the ranks by size, deterministically, so every rank
computes the same assignment on its own.
"""

from __future__ import annotations

import heapq
import os
import secrets
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _core
from .errors import UsageError


def assign_owners(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Owner rank of each replicated tensor: largest first, each to the least-loaded rank.

    Deterministic for the same keys and sizes (ties go to the lower key, then the lower rank), so
    ranks agree without talking. The heaviest rank carries at most the average load plus the
    largest tensor.
    """
    loads = [(0, r) for r in range(world_size)]
    heapq.heapify(loads)
    owners: dict[str, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, r = heapq.heappop(loads)
        owners[key] = r
        heapq.heappush(loads, (load + sizes[key], r))
    return owners


def mine(tensors: Mapping[str, torch.Tensor], replicated: frozenset[str], ranks: Ranks,
         cache: dict[tuple[tuple[str, int], ...], dict[str, int]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors rank ``ranks.rank`` writes: its own, and the replicated ones (under the top-level keys
    ``replicated``) :func:`assign_owners` gives it. ``cache`` keeps the last assignment (by keys and sizes)."""
    owners: dict[str, int] = {}
    if ranks.world_size > 1 and replicated:
        sizes = tuple((k, t.numel() * t.element_size()) for k, t in tensors.items() if k.split("/", 1)[0] in replicated)
        if sizes not in cache:
            cache.clear()
            cache[sizes] = assign_owners(dict(sizes), ranks.world_size)
        owners = cache[sizes]
    return [(key, t) for key, t in tensors.items() if owners.get(key, ranks.rank) == ranks.rank]


@dataclass
class Ranks:
    """This process's place among the ranks writing one run directory."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # a gloo torch.distributed ProcessGroup when world_size > 1
    root: int = 0  # rank 0's rank in the default group (a node's ranks: alpsck.memory.nodes)

    @classmethod
    def detect(cls, rank: int | None, world_size: int | None) -> Ranks:
        """From the arguments, else from an initialised torch.distributed; world size 1 otherwise."""
        import torch.distributed as dist

        live = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if live else 1
        if rank is None:
            rank = dist.get_rank() if live else 0
        if world_size < 1 or not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is not in a world of {world_size}")
        if world_size == 1:
            return cls(rank, 1, None)
        if not live or dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise UsageError(
                f"a checkpointer for {world_size} ranks needs torch.distributed initialised with that world size "
                "(init_process_group) so that restore can agree on one checkpoint")
        # new_group is a collective: every rank constructs its Checkpointer at the same point.
        group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        return cls(rank, world_size, group)

    def all_true(self, ok: bool) -> bool:
        """True when ``ok`` holds on every rank (a collective)."""
        if self.world_size == 1:
            return ok
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def each(self, value: int) -> list[int]:
        """Every rank's ``value``, indexed by rank (a collective)."""
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        t = torch.zeros(self.world_size, dtype=torch.int64)
        t[self.rank] = value
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return [int(x) for x in t.tolist()]

    def each_list(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints, indexed by rank (a collective; no pickle on the wire): one all-reduce of
        each list's length and first seven values, a second only when some list is longer."""
        if self.world_size == 1:
            return [list(values)]
        import torch.distributed as dist

        head = torch.zeros(self.world_size, _HEAD, dtype=torch.int64)
        head[self.rank, 0] = len(values)
        head[self.rank, 1:1 + min(len(values), _HEAD - 1)] = torch.tensor(values[:_HEAD - 1], dtype=torch.int64)
        dist.all_reduce(head, op=dist.ReduceOp.SUM, group=self.group)  # each row is one rank's alone
        lengths = [int(n) for n in head[:, 0].tolist()]
        got = [[int(x) for x in head[r, 1:1 + min(n, _HEAD - 1)].tolist()] for r, n in enumerate(lengths)]
        if max(lengths) > _HEAD - 1:
            rest = torch.zeros(self.world_size, max(lengths) - _HEAD + 1, dtype=torch.int64)
            rest[self.rank, :max(0, len(values) - _HEAD + 1)] = torch.tensor(values[_HEAD - 1:], dtype=torch.int64)
            dist.all_reduce(rest, op=dist.ReduceOp.SUM, group=self.group)
            for r, n in enumerate(lengths):
                got[r] += [int(x) for x in rest[r, :max(0, n - _HEAD + 1)].tolist()]
        return got

    def all_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's ``values``, all of one length (a collective)."""
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in t.tolist()]

    def agreement_store(self, token: int | None = None) -> tuple[Any, str] | None:
        """Where the ranks' engines agree on each commit: :func:`store_clients` (nobody polls
        the file system), and a key namespace rank 0 draws at random for this call and broadcasts, so that two
        checkpointers, or a checkpointer opened again, never read each other's keys. None for one
        rank (a collective otherwise). ``token``: the namespace's number rank 0 drew (``secrets.randbits(62)``),
        where every rank has it already (no collective)."""
        if self.world_size == 1:
            return None
        if token is None:
            [token] = self.from_rank0([secrets.randbits(62)] if self.rank == 0 else [])
        return store_clients(), f"alpsck/{token:016x}/"

    def from_rank0(self, values: list[int]) -> list[int]:
        """Rank 0's list of ints, on every rank (a collective; no pickle on the wire): one broadcast of its
        length and first values, and a second only for a list longer than that holds."""
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        head = torch.zeros(_HEAD, dtype=torch.int64)
        if self.rank == 0:
            head[0] = len(values)
            head[1:1 + min(len(values), _HEAD - 1)] = torch.tensor(values[:_HEAD - 1], dtype=torch.int64)
        dist.broadcast(head, src=self.root, group=self.group)
        n = int(head[0].item())
        got = [int(x) for x in head[1:1 + min(n, _HEAD - 1)].tolist()]
        if n > _HEAD - 1:
            rest = torch.tensor(values[_HEAD - 1:] if self.rank == 0 else [0] * (n - _HEAD + 1), dtype=torch.int64)
            dist.broadcast(rest, src=self.root, group=self.group)
            got += [int(x) for x in rest.tolist()]
        return got


_HEAD = 8  # the ints of a list's first collective (from_rank0, each_list): its length, then its first seven values


def process_group_store() -> Any:
    """torch.distributed's default store (the process group's TCPStore, whose server wakes a waiting
    rank), where several ranks' engines agree on each commit: a Checkpointer's, and the DCP backend's."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


_clients: tuple[int, weakref.ref[Any], Any] | None = None  # (pid, the store, its StoreClients): store_clients()


def store_clients() -> Any:
    """The ``store=`` for the core's engines and commits: :func:`process_group_store`'s connections,
    one set per process and store, shared by every engine and commit (``_core.StoreClients``). A
    TCPStore clone is a connection to its server; a DCP save opens an engine per rank and commits
    through a clone, and with a clone per save a 2 MiB save at 2 ranks took 5 s about one time in
    ten (torch 2.13's clone waits 5 s on its ping now and then: ``cpp/core/kv_store.h``). A forked
    child, or a new process group, gets connections of its own. Neither the store nor its server
    (rank 0's TCPStore) is kept alive by this: the set is made from a clone (a client), and the
    store is known by a weak reference, so a destroyed process group's store goes with it."""
    global _clients
    store = process_group_store()
    have = _clients
    if have is None or have[0] != os.getpid() or have[1]() is not store:
        have = _clients = (os.getpid(), weakref.ref(store), _core.StoreClients(store.clone()))
    return have[2]
