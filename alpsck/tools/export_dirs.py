"""``alpsck export --format dcp`` and ``--format hf``: a checkpoint as a directory other tools read, the way out
of alpsck in one command (the command: :mod:`alpsck.tools.export`).

* ``dcp``: a checkpoint of torch.distributed.checkpoint's own format, written by its ``FileSystemWriter`` in this
  one process (``no_dist``), which stock ``dcp.load(..., checkpoint_id=OUT)`` (its ``FileSystemReader``) loads at
  any world size. From a checkpoint of alpsck's DCP backend (torchtitan's), the whole state: every tensor, resharded
  by DCP's planner, and the non-tensor values (which DCP's own format pickles); from a Checkpointer checkpoint, its
  tensors under their tree keys (``model/layers.0.attention.wq.weight``), or those under ``--subtree``.
* ``hf``: Hugging Face's sharded safetensors layout, ``model-0000K-of-0000N.safetensors`` of at most
  ``max_shard_bytes`` each (5 GB, as ``save_pretrained``) and ``model.safetensors.index.json`` (``total_size``,
  ``weight_map``). From a Checkpointer checkpoint streamed, shard by shard (:func:`.export_formats.write_safetensors`);
  from a DCP one its tensors, named by DCP's dotted keys (below ``--subtree``'s, if given).

Both are written into ``OUT.tmp`` (made afresh), every file fsync'ed, then renamed to OUT, which must not exist yet:
OUT is the whole export or absent. A DCP export holds the checkpoint in memory once (DCP's load and save need the
tensors whole); a Checkpointer one to ``hf`` needs about ``max(largest tensor, 64 MiB)``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CheckpointError, UsageError
from ..store.durable import fsync_path
from ..store.names import temp_name
from ..store.shards import CheckpointShards
from .export_formats import BATCH_BYTES, Item, write_safetensors, write_tensors_safetensors

if TYPE_CHECKING:
    import torch

DIR_FORMATS = ("dcp", "hf")
HF_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"
HF_INDEX = "model.safetensors.index.json"
_T = TypeVar("_T")


def check_new_dir(out: Path) -> None:
    """OUT of a directory export: a path that does not exist yet, in a directory that does."""
    if os.path.lexists(out):
        raise UsageError(f"{out} exists: --format dcp and hf write a new directory (never into one); give a new path")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{out}: directory {parent} does not exist")


def beside(out: Path, make: Callable[[Path], _T]) -> _T:
    """``make(OUT.tmp)``, or of ``OUT.tmp.N`` while ``make`` raises FileExistsError (a name taken: a file of the
    user's, a concurrent export's): what export writes into before it becomes OUT, never an existing one."""
    for n in range(100):
        try:
            return make(Path(temp_name(str(out)) if n == 0 else f"{temp_name(str(out))}.{n}"))
        except FileExistsError:
            continue
    raise CheckpointError(f"{out}: {out}.tmp and {out}.tmp.1 to .99 all exist (left by killed exports?); "
                          "remove them; nothing was written")


def _made_dir(path: Path) -> Path:
    path.mkdir()
    return path


def _publish(tmp: Path, out: Path) -> list[Path]:
    """Every file of ``tmp`` fsync'ed, then ``tmp`` itself, renamed to ``out``, and its parent fsync'ed."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for p in files:
        fsync_path(p)
    for d in sorted({p.parent for p in files} | {tmp}, key=lambda d: -len(d.parts)):
        fsync_path(d)
    os.rename(tmp, out)
    try:
        fsync_path(out.parent if str(out.parent) else Path("."))
    except OSError:  # best effort: some file systems refuse a directory fsync
        pass
    return [out / p.relative_to(tmp) for p in files]


def _hf_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """The names in order, cut into shards of at most ``max_bytes`` each (a larger tensor alone in its own)."""
    shards: list[list[str]] = []
    used = 0
    for name, n in sizes:
        if not shards or (used + n > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards or [[]]


def _shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _write_index(tmp: Path, cut: list[list[str]], total: int, metadata: dict[str, str]) -> None:
    weight_map = {name: _shard_name(k + 1, len(cut)) for k, names in enumerate(cut) for name in names}
    (tmp / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": total, **metadata}, "weight_map": weight_map},
                                           indent=2) + "\n")


def tree_to_dir(shards: CheckpointShards, items: list[Item], tmp: Path, fmt: str, metadata: dict[str, str],
                threads: int, max_shard_bytes: int) -> None:
    """A Checkpointer checkpoint's tensors (``items``, read through ``shards``) into ``tmp`` as ``fmt``."""
    if fmt == "hf":
        by_name = {it.name: it for it in items}
        cut = _hf_shards([(it.name, it.nbytes) for it in items], max_shard_bytes)
        for k, names in enumerate(cut):
            with open(tmp / _shard_name(k + 1, len(cut)), "xb") as fh:
                write_safetensors(fh, shards, [by_name[n] for n in names], {"format": "pt"}, threads, BATCH_BYTES)
        _write_index(tmp, cut, sum(it.nbytes for it in items), metadata)
        return
    import torch.distributed.checkpoint as dcp

    from ..dcp.convert import single_process

    with single_process():
        dcp.save(_read_whole(shards, items, threads), storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)


def _read_whole(shards: CheckpointShards, items: list[Item], threads: int) -> dict[str, torch.Tensor]:
    import torch

    out: dict[str, torch.Tensor] = {}
    dsts = []
    for it in items:
        t = torch.empty(it.spec.shape, dtype=it.spec.dtype)
        out[it.name] = t
        if it.nbytes:
            dsts.append((it.key, t.reshape(-1).view(torch.uint8)))
    shards.read_into(dsts, threads)  # every chunk CRC-checked
    return out


def dcp_state(path: Path) -> dict[str, Any]:
    """The whole state of a checkpoint of alpsck's DCP backend, loaded by DCP in this process (no process group)
    with the keys and nesting its metadata records: what torch's own ``dcp_to_torch_save`` does (its load planner
    that builds the state from the metadata, and the load that keeps the dict it fills; ``dcp.load`` fills a copy)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ..dcp import AlpsckStorageReader
    from ..dcp.convert import single_process

    state: dict[str, Any] = {}
    with single_process():
        _load_state_dict(state, storage_reader=AlpsckStorageReader(path), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    return state


def _flat_tensors(value: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(value, torch.Tensor):
        return [(prefix, value)]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in _flat_tensors(v, f"{prefix}.{i}" if prefix else str(i))]
    return []


def dcp_to_dir(path: Path, tmp: Path, fmt: str, subtree: str | None, metadata: dict[str, str],
               max_shard_bytes: int) -> tuple[int, int]:
    """A checkpoint of alpsck's DCP backend (``path``) into ``tmp`` as ``fmt``: (tensors, their bytes)."""
    import torch.distributed.checkpoint as dcp

    state = dcp_state(path)
    if subtree is not None:
        if subtree not in state:
            raise UsageError(f"--subtree {subtree!r}: the checkpoint has no such top-level key; it has "
                             f"{', '.join(map(repr, state)) or 'none'}")
        state = {subtree: state[subtree]}
    tensors = [(name.removeprefix(f"{subtree}.") if subtree is not None else name, t.detach().cpu().contiguous())
               for name, t in _flat_tensors(state)]
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    if fmt == "dcp":
        from ..dcp.convert import single_process

        with single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=True)
        return len(tensors), total
    named = dict(tensors)
    cut = _hf_shards([(n, t.numel() * t.element_size()) for n, t in tensors], max_shard_bytes)
    for k, names in enumerate(cut):
        with open(tmp / _shard_name(k + 1, len(cut)), "xb") as fh:
            write_tensors_safetensors(fh, [(n, named[n]) for n in names], {"format": "pt"})
    _write_index(tmp, cut, total, metadata)
    return len(tensors), total


def export_to_dir(out: Path, write: Callable[[Path], _T]) -> tuple[_T, list[Path]]:
    """``write(tmp)`` fills a fresh ``OUT.tmp``; then it becomes OUT (module docstring). What ``write`` returned, and
    the files written."""
    tmp = beside(out, _made_dir)
    try:
        done = write(tmp)
        return done, _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
