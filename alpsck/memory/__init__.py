"""The memory tier across nodes: which ranks share a node (:mod:`.nodes`), a node's checkpoint sent to another
over torch.distributed (:mod:`.wire`), the replica ring that keeps each node's latest memory checkpoint on the
next node too (:mod:`.replica`), and the restore that takes a step every node's ranks hold, from own memory, a
replica or the run directory (:mod:`.restore`).

A memory checkpoint is written by one engine per node (:mod:`alpsck.store.memory_tier`): the node's ranks
commit it among themselves, in the node's shared memory, in the format of any checkpoint. docs/memory-tier.md
says what is promised.
"""
