"""Moving in: convert DCP FileSystemWriter checkpoints (``folder/step-N``) into alpsck DCP checkpoints.

A run whose older steps were written by DCP's default FileSystemWriter (torchtitan before it passed
alpsck's writer) goes on with alpsck storage once those steps are converted: ``alpsck import-dcp
FOLDER --trust-pickle``. FileSystemWriter's ``.metadata`` is a pickle, and so is every non-tensor value
it stored (read back with ``torch.load(weights_only=False)``): reading them runs whatever code the
files name. This module is the one place in alpsck that unpickles, and only when the caller says it
trusts the files (``trust_pickle=True``); without that it refuses before reading anything but the
first byte of each ``.metadata``.

One checkpoint, ``folder/step-N`` (docs/dcp.md, "Moving in from FileSystemWriter"):

1. DCP loads it in this one process (no process group) into full-size empty tensors built from its
   metadata, every shard of every rank, and its non-tensor values (the unpickling);
2. ``dcp.save`` writes that state with :class:`AlpsckStorageWriter` to
   ``folder/.alpsck-import/step-N.alpsck`` (committed atomically and durably, as every alpsck save);
   the nesting is rebuilt from the metadata's ``planner_data``, so the new checkpoint has the same
   keys and planner data;
3. verify: :class:`AlpsckStorageReader` loads it back and every tensor is compared bit for bit, and
   every value, with what FileSystemReader loaded;
4. swap: the new directory takes the name ``folder/step-N`` and the original goes to
   ``folder/.alpsck-import/step-N.filesystemwriter``: two renames (between them ``step-N`` is absent: a
   trainer resumes from an older step, and running the command again finishes the move), each made
   durable (an atomic exchange, ``renameat2(RENAME_EXCHANGE)``, would need the core to expose it);
5. the original is kept there unless ``delete_original``; it is removed only after the swap is durable.

The result is a one-shard alpsck checkpoint: DCP's planner reshards it on load at any world size.
``.alpsck-import`` holds no name a trainer takes for a step (torchtitan looks for ``step-<digits>``
in the entries of ``folder`` only), so torchtitan neither loads nor purges what is kept there.
"""

from __future__ import annotations

import io
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..store.durable import fsync_path, make_dirs_durably
from ..store.marker import has_pickled_metadata
from .paths import is_alpsck_checkpoint_id

WORK_DIR = ".alpsck-import"
NEW_SUFFIX = ".alpsck"
ORIGINAL_SUFFIX = ".filesystemwriter"
METADATA = ".metadata"

RISK = ("a FileSystemWriter checkpoint is a pickle: converting it unpickles its .metadata and its non-tensor "
        "values, which runs any code those files name; pass --trust-pickle only for checkpoints your own runs wrote")


@contextmanager
def single_process() -> Iterator[None]:
    """DCP in this one process (no process group), without the warning torch prints at every such call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_filesystemwriter_checkpoint(path: Path) -> bool:
    """A directory whose ``.metadata`` is a pickle and that is not alpsck's: what DCP's FileSystemWriter leaves.
    Reads one byte; unpickles nothing."""
    return has_pickled_metadata(path) and not is_alpsck_checkpoint_id(path)


@dataclass
class Converted:
    """What happened to one ``step-N``: ``action`` is converted, resumed (an interrupted import finished),
    already (converted before), skipped (alpsck's own, or not a checkpoint)."""
    path: Path
    action: str
    detail: str = ""
    original: Path | None = None  # where the FileSystemWriter original is kept (None: removed, or none)


def _work_paths(step_dir: Path) -> tuple[Path, Path, Path]:
    work = step_dir.parent / WORK_DIR
    return work, work / (step_dir.name + NEW_SUFFIX), work / (step_dir.name + ORIGINAL_SUFFIX)


def plan(target: Path) -> list[Path]:
    """The ``step-N`` directories an import of ``target`` looks at: ``target`` itself when it is one
    checkpoint (or the name of one whose import was interrupted), else every ``step-<digits>`` entry of
    the folder ``target`` and every one an interrupted import left only in ``.alpsck-import``, by number."""
    target = Path(os.fspath(target))
    if not str(target):
        raise UsageError("import-dcp: the path is empty")
    if (target / METADATA).is_file() or _work_paths(target)[2].is_dir():
        return [target]
    if not target.is_dir():
        raise UsageError(f"{target}: no such checkpoint or folder")
    names = {e.name for e in os.scandir(target) if e.is_dir(follow_symlinks=False) and _step_number(e.name) is not None}
    work = target / WORK_DIR
    if work.is_dir():
        names |= {e.name[:-len(ORIGINAL_SUFFIX)] for e in os.scandir(work)
                  if e.name.endswith(ORIGINAL_SUFFIX) and _step_number(e.name[:-len(ORIGINAL_SUFFIX)]) is not None}
    return [target / n for n in sorted(names, key=lambda n: (_step_number(n), n))]


def _step_number(name: str) -> int | None:
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def needs_pickle(paths: list[Path]) -> list[Path]:
    """Those of ``paths`` whose import would unpickle: FileSystemWriter checkpoints, under their name or kept
    aside by an interrupted import."""
    return [p for p in paths if is_filesystemwriter_checkpoint(p) or
            (not p.exists() and is_filesystemwriter_checkpoint(_work_paths(p)[2]))]


def import_dcp(target: str | os.PathLike[str], *, trust_pickle: bool, delete_original: bool = False,
               report: Callable[[Converted], None] | None = None) -> list[Converted]:
    """Convert the FileSystemWriter checkpoint ``target`` (``folder/step-N``), or every one in the folder
    ``target``, into alpsck DCP checkpoints under the same names (module docstring). alpsck checkpoints
    are skipped. ``trust_pickle`` must be True when there is one to convert (:data:`RISK`)."""
    paths = plan(Path(os.fspath(target)))
    risky = needs_pickle(paths)
    if risky and not trust_pickle:
        raise UsageError(f"{', '.join(str(p) for p in risky[:3])}{' ...' if len(risky) > 3 else ''}: {RISK}")
    done = []
    for p in paths:
        c = convert_one(p, delete_original=delete_original)
        done.append(c)
        if report is not None:
            report(c)
    return done


def convert_one(step_dir: Path, *, delete_original: bool = False) -> Converted:
    """Convert one FileSystemWriter checkpoint (the caller has the user's trust for the pickle)."""
    work, new, aside = _work_paths(step_dir)
    if step_dir.exists() and not step_dir.is_dir():
        return Converted(step_dir, "skipped", "not a directory")
    if step_dir.is_dir() and not is_filesystemwriter_checkpoint(step_dir):
        if aside.is_dir() and is_alpsck_checkpoint_id(step_dir):
            if delete_original:
                _remove(aside, work)
                return Converted(step_dir, "already", "converted before; its original is now removed")
            return Converted(step_dir, "already", "converted before", aside)
        what = "an alpsck checkpoint" if is_alpsck_checkpoint_id(step_dir) else "not a FileSystemWriter checkpoint"
        return Converted(step_dir, "skipped", what)
    resuming = not step_dir.exists()
    if resuming:  # an import stopped between its two renames: the original is whole, aside
        source = aside
    else:
        if aside.exists():
            raise UsageError(f"{step_dir}: {aside} is in the way (an earlier import's original): move or remove it first")
        source = step_dir
    make_dirs_durably(work)
    if new.exists():  # an earlier import stopped before its swap: start again
        if is_filesystemwriter_checkpoint(new):
            raise UsageError(f"{step_dir}: {new} holds a FileSystemWriter checkpoint (an earlier import's original?): "
                             "move it away first")
        shutil.rmtree(new)
    shards, nbytes = _copy(source, new)
    fsync_path(work)
    if resuming:
        os.rename(new, step_dir)
    else:  # two renames, each made durable: a kill between them leaves the original whole, aside (resumed above)
        os.rename(step_dir, aside)
        fsync_path(work)
        fsync_path(step_dir.parent)
        os.rename(new, step_dir)
    fsync_path(work)
    fsync_path(step_dir.parent)
    detail = f"{shards} shard file{'s' if shards != 1 else ''}, {nbytes / 2**20:.1f} MiB of tensors"
    action = "resumed" if resuming else "converted"
    if delete_original:
        _remove(aside, work)
        return Converted(step_dir, action, detail + "; original removed")
    return Converted(step_dir, action, detail, aside)


def _remove(aside: Path, work: Path) -> None:
    shutil.rmtree(aside)
    fsync_path(work)
    try:
        work.rmdir()  # the last one: leave the folder as a trainer left it
        fsync_path(work.parent)
    except OSError:
        pass


def _set_element(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (DCP's planner_data: str keys into dicts, int indices into lists), as DCP's
    own unflattening does."""
    cur: Any = root
    for i in range(1, len(path)):
        prev, key = path[i - 1], path[i]
        default: Any = {} if isinstance(key, str) else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, default)
        else:
            cur.extend([None] * (prev + 1 - len(cur)))
            if cur[prev] is None:
                cur[prev] = default
            cur = cur[prev]
    last = path[-1]
    if isinstance(last, int) and isinstance(cur, list):
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value


def _empty_flat(metadata: Any) -> dict[str, Any]:
    """A flat state dict for ``metadata``: full-size empty tensors, None for the values to be read."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            flat[key] = None
    return flat


@single_process()
def _load_flat(metadata: Any, reader: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    flat = _empty_flat(metadata)
    # Flat keys as the metadata's; flatten_sharded_tensors would make the planner's state_dict a copy,
    # and the values read (load_bytes) would land in the copy.
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    return flat


@single_process()
def _copy(source: Path, new: Path) -> tuple[int, int]:
    """Load the FileSystemWriter checkpoint ``source`` (the unpickling), save it to ``new`` with alpsck, load
    that back and compare. Returns (FileSystemWriter shard files, tensor bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from .reader import AlpsckStorageReader
    from .writer import AlpsckStorageWriter

    fs_reader = FileSystemReader(str(source))
    metadata = fs_reader.read_metadata()  # pickle.load: the caller has the user's --trust-pickle
    flat = _load_flat(metadata, fs_reader)
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        path = mapping.get(key)
        _set_element(nested, tuple(path) if path else (key,), value)
    dcp.save(nested, storage_writer=AlpsckStorageWriter(str(new)), no_dist=True)

    reader = AlpsckStorageReader(str(new), fallback=False)
    got_md = reader.read_metadata()
    if set(got_md.state_dict_metadata) != set(metadata.state_dict_metadata):
        missing = set(metadata.state_dict_metadata) ^ set(got_md.state_dict_metadata)
        raise UsageError(f"{source}: the converted checkpoint's keys differ from the original's: {sorted(missing)[:5]}")
    reader = AlpsckStorageReader(str(new), fallback=False)
    back = _load_flat(got_md, reader)
    for key, value in flat.items():
        if not _same(value, back[key]):
            raise UsageError(f"{source}: {key!r} read back from the converted checkpoint differs from the original; "
                             f"the original is untouched, the conversion is left in {new}")
    shards = sum(1 for n in os.listdir(source) if n.endswith(".distcp"))
    nbytes = sum(v.numel() * v.element_size() for v in flat.values() if isinstance(v, torch.Tensor))
    return shards, nbytes


def _same(a: Any, b: Any) -> bool:
    """Bit for bit for tensors (NaNs included), by content for BytesIO, recursively for containers."""
    import torch

    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bytes_of(a), _bytes_of(b))
    if isinstance(a, io.BytesIO):
        return isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b) or _numpy_equal(a, b)
    except (TypeError, ValueError):  # NumPy arrays' == is elementwise
        return _numpy_equal(a, b)


def _numpy_equal(a: Any, b: Any) -> bool:
    try:
        import numpy as np
    except ImportError:
        return False
    return isinstance(a, (np.ndarray, np.generic)) and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


def _bytes_of(t: Any) -> Any:
    import torch

    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat

