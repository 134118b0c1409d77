"""One checkpoint directory as rank ``rank`` reads it: its own tree, each tensor from its shard.

A checkpoint holds one shard file per rank (``rank-RRRRR.bin``). Each shard's index carries that
rank's state tree (tagged JSON, :mod:`alpsck.tree`) and the tensors that rank wrote. With several
ranks, replicated tensors (identical on every rank, such as a DDP model and its optimizer state)
are written once, by one owner rank, so a rank restoring finds some of its tensors in other
ranks' shards. :class:`CheckpointShards` hides that: it opens rank ``rank``'s shard for the tree and
maps every tensor the tree names to the shard that holds it (its own first). Every size is checked
against the tree before a byte is read; reads go through the core, which checks every chunk's
CRC32C. Used by restore, ``alpsck export`` and ``alpsck inspect-checkpoints``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import _core
from ..errors import CorruptCheckpointError

if TYPE_CHECKING:  # torch only where a shard is read (alpsck status/doctor import this without torch)
    import torch

    from .. import tree

META_FORMAT = "alpsck-tree/1"  # the meta document in each shard index: {format, step, rank, world_size, tree}
DCP_META_FORMAT = "alpsck-dcp/1"  # ... of a shard written by the DCP backend (alpsck.dcp): no tree
MAX_RANKS = 1 << 20
#: Scan states (``_core.scan``) of checkpoints restore skips with a warning and inspect reports: bytes
#: that fail their checks ("corrupt"), a step-N directory whose manifest is gone ("damaged"), or, for a
#: reason that says nothing about their bytes (permission denied, EIO, ESTALE), impossible to read
#: ("unreadable").
UNUSABLE = frozenset({"corrupt", "damaged", "unreadable"})


def shard_name(rank: int) -> str:
    """File name of rank ``rank``'s shard inside a checkpoint directory."""
    return str(_core.shard_file_name(rank))


def encode_meta(step: int, rank: int, world_size: int, tree_doc: dict[str, Any]) -> str:
    """The meta document of one rank's shard (:data:`META_FORMAT`): its step, rank, world size and state tree,
    as strict JSON (a tree holds no NaN: :mod:`alpsck.tree` spells them). :func:`read_meta` reads it back."""
    return json.dumps({"format": META_FORMAT, "step": step, "rank": rank, "world_size": world_size,
                       "tree": tree_doc}, allow_nan=False)


def read_meta(reader: _core.ShardReader, shard: Path) -> tuple[dict[str, Any], dict[str, tree.TensorSpec]]:
    """A shard's meta document and its tensor specs, validated (JSON, format, tree, dtypes, shapes)."""
    try:
        meta = json.loads(reader.meta)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{shard}: the state tree is not valid JSON: {e}") from e
    if isinstance(meta, dict) and meta.get("format") == DCP_META_FORMAT:
        raise CorruptCheckpointError(f"{shard}: a torch.distributed.checkpoint checkpoint, not a state tree: load it with "
                                     "dcp.load(..., storage_reader=alpsck.dcp.AlpsckStorageReader(run_dir))")
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT or not isinstance(meta.get("tree"), dict):
        raise CorruptCheckpointError(f"{shard}: the state tree is not an {META_FORMAT} document")
    from .. import tree

    return meta, tree.tensor_specs(meta["tree"])


class CheckpointShards:
    """The tree of rank ``rank`` in checkpoint directory ``path`` and where each of its tensors lies.

    Attributes: ``meta`` (the meta document: ``step``, ``tree``, ``rank``, ``world_size``),
    ``specs`` (tensor key -> :class:`alpsck.tree.TensorSpec`), ``world_size``.
    """

    def __init__(self, path: str | os.PathLike[str], rank: int = 0,
                 open_shard: Callable[[Path], _core.ShardReader] | None = None) -> None:
        self.path = Path(path)
        self.rank = rank
        self._open = open_shard or (lambda p: _core.ShardReader(str(p)))
        own = self.path / shard_name(rank)
        self._readers: dict[int, _core.ShardReader] = {rank: self._open(own)}
        self.meta, self.specs = read_meta(self._readers[rank], own)
        world = self.meta.get("world_size", 1)
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= MAX_RANKS or rank >= world:
            raise CorruptCheckpointError(f"{own}: world_size {world!r} is not valid for rank {rank}")
        self.world_size = world
        # key -> (rank of the shard holding it, offset in that shard)
        self._where: dict[str, tuple[int, int]] = {}
        self._claim(rank)
        for r in range(world):
            if len(self._where) == len(self.specs):
                break
            if r != rank:
                self._readers[r] = self._open(self.path / shard_name(r))
                self._claim(r)
        missing = [k for k in self.specs if k not in self._where]
        if missing:
            raise CorruptCheckpointError(f"{self.path}: tensor {missing[0]!r} is in none of its {world} shard(s)")

    def _claim(self, r: int) -> None:
        shard = self.path / shard_name(r)
        for name, offset, size in self._readers[r].extents:
            spec = self.specs.get(name)
            if spec is None or name in self._where:
                continue
            if size != spec.nbytes:
                raise CorruptCheckpointError(f"{shard}: tensor {name!r} has {size} bytes on disk, its spec needs {spec.nbytes}")
            self._where[name] = (r, offset)

    def keys_in_file_order(self) -> list[str]:
        """Tensor keys sorted by (shard, offset): the order that reads each chunk once, sequentially."""
        return sorted(self.specs, key=lambda k: self._where[k])

    def read_into(self, dsts: Sequence[tuple[str, torch.Tensor]], threads: int) -> None:
        """Read tensors (key, contiguous uint8 CPU tensor of exactly its size) from their shards."""
        by_shard: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for key, t in dsts:
            by_shard.setdefault(self._where[key][0], []).append((key, t))
        for r in sorted(by_shard):
            self._readers[r].read_into(by_shard[r], threads)
