"""Which ranks share a node (:func:`node_layout`): the memory tier's unit. Each node's ranks write and commit
their memory checkpoint among themselves (their own :class:`alpsck.ranks.Ranks`, a gloo group of the node),
and the first rank of each node, its leader, speaks for the node to the others (two gloo groups of the
leaders: one the replica ring uses from its thread, one restores use).

Nodes are ordered by their first rank; node ``i`` runs ``groups[i]``. A node is told apart by its name
(:func:`alpsck.store.memory_tier.node_name`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ranks import Ranks
from ..store import memory_tier


@dataclass
class Nodes:
    """This rank's node among the nodes of a job (module docstring)."""

    groups: list[list[int]]  # the global ranks of each node, ordered by their first rank
    index: int  # this rank's node
    local: Ranks  # this node's ranks (rank: the position in groups[index])
    ranks: Ranks  # every rank
    ring: Any = None  # the leaders' gloo group of the replica ring (several nodes only)
    moves: Any = None  # the leaders' gloo group of the restores' copies (several nodes only)

    @property
    def count(self) -> int:
        return len(self.groups)

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for its node (its first rank)."""
        return self.local.rank == 0

    def leader_of(self, node: int) -> int:
        return self.groups[node][0]

    def name(self, node: int) -> str:
        """The directory name of node ``node``'s ranks' checkpoints (:func:`memory_tier.group_dir_name`)."""
        return memory_tier.group_dir_name(self.groups[node])


def node_layout(ranks: Ranks, keys: list[int]) -> Nodes:
    """This rank's node and the others, from every rank's :func:`alpsck.store.memory_tier.host_key` (``keys``,
    indexed by rank; the ranks said them as the run directory's engine opened). With several nodes a collective
    of every rank: every rank makes each node's group and the leaders' two, in the same order."""
    order: dict[int, list[int]] = {}
    for r, k in enumerate(keys):
        order.setdefault(k, []).append(r)
    groups = sorted(order.values(), key=lambda g: g[0])
    index = next(i for i, g in enumerate(groups) if ranks.rank in g)
    if len(groups) == 1:
        return Nodes(groups, 0, ranks, ranks)
    import torch.distributed as dist

    made = [dist.new_group(ranks=g, backend="gloo") for g in groups]  # every rank makes every group
    mine = groups[index]
    local = Ranks(mine.index(ranks.rank), len(mine), made[index] if len(mine) > 1 else None, root=mine[0])
    leaders = [g[0] for g in groups]
    ring = dist.new_group(ranks=leaders, backend="gloo")
    moves = dist.new_group(ranks=leaders, backend="gloo")
    return Nodes(groups, index, local, ranks, ring, moves)
