"""``alpsck export``: one checkpoint's tensors as ONE standard file (safetensors or torch.save format).

``alpsck export RUN_DIR OUT [--step N] [--format {safetensors,torch}] [--rank R] [--subtree KEY]``
writes the tensors of the newest valid checkpoint (or of step N) under their tree keys
(``"model/layers.0.attention.wq.weight"``, ``"optim/state/0/exp_avg"``, ...). Non-tensor state is
not exported (use ``alpsck inspect-checkpoints --step N`` or :func:`alpsck.peek` to see it).

``--subtree KEY`` writes only the tensors under the top-level state key KEY, named by their path
below it: for a module that is its ``state_dict`` key (``"layers.0.attention.wq.weight"``), so
``model.load_state_dict(torch.load(OUT, weights_only=True))`` (or
``safetensors.torch.load_file(OUT)``) loads it; under an optimizer ``"state/0/exp_avg"``. A KEY
that is a single tensor is written under the name KEY. A KEY the checkpoint does not have, or one
that holds no tensor, is refused naming the keys it has.

Both formats are *streamed*: the file's header is written from the state tree's tensor specs,
then the tensors are read (every chunk CRC-checked, :meth:`_core.ShardReader.read_into`) in
batches into ONE reusable buffer and appended to the file. Peak memory is about
``max(largest tensor, 64 MiB)`` plus the reader's chunk buffers (``threads`` x chunk size),
whatever the checkpoint's size.

* safetensors: the header (``{"key": {"dtype", "shape", "data_offsets"}, "__metadata__": ...}``,
  dtype codes F64/F32/F16/BF16/F8_E4M3/F8_E5M2/I64/I32/I16/I8/U64/U32/U16/U8/BOOL/C64) is written by hand,
  padded to 8 bytes. complex64 uses the ``C64`` code, which older safetensors readers reject.
* torch: the same zip archive ``torch.save`` writes (``data.pkl`` + one ``data/<k>`` record per
  tensor) through torch's own ``PyTorchFileWriter``; ``data.pkl`` is pickled from stand-in objects
  that reduce exactly like tensors do (byte-identical to what ``torch.save`` pickles for a dict of
  contiguous CPU tensors), so ``torch.load(OUT, weights_only=True)`` gives a ``dict[str, Tensor]``.

The file is written to ``OUT.tmp`` (``OUT.tmp.N`` if that exists: an existing file is never
truncated), fsync'ed, renamed to OUT and the directory fsync'ed: OUT is
either the complete previous file or the complete new one. An OUT that is a symlink is followed
(its target is replaced, the link stays); one that is not a regular file (a device, a FIFO) is
refused, and so is an OUT among the run directory's own files (``RUN/LATEST``, ``RUN/step-N/...``).
Without ``--step``, a checkpoint whose data fails its CRC during the export is skipped
(with a warning) for the previous valid one, as ``restore()`` does; with ``--step`` it is refused.
A checkpoint written by the DCP backend (:mod:`alpsck.dcp`) holds no state tree: it is refused, not
called corrupt.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import AlpsckError, CheckpointError, CorruptCheckpointError, NoCheckpointError, UsageError
from ..options import DEFAULTS, SPECS, arg_option, arg_rank, arg_step
from ..out import jsonout
from ..out.textout import printable
from ..store.durable import fsync_path
from ..store.lock import writer_lock
from ..store.names import is_run_entry, is_text, temp_name
from ..store.picker import pick, pick_checkpoint, read_failure
from ..store.scan import check_run_dir, open_shard
from ..store.shards import DCP_META_FORMAT, CheckpointShards, shard_name
from .export_dirs import DIR_FORMATS, HF_SHARD_BYTES, beside, check_new_dir, dcp_to_dir, export_to_dir, tree_to_dir
from .export_formats import BATCH_BYTES, plan, write_safetensors, write_torch
from .progress import human

# torch (and alpsck.tree, which imports it) only inside the functions that export: the CLI imports this
# module to register `export`, on login nodes without torch too.
if TYPE_CHECKING:

    pass

FORMATS = ("safetensors", "torch", *DIR_FORMATS)
_SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}

# ----------------------------------------------------------------------------- command


def _fsync_dir(path: Path) -> None:
    """Best effort: the export file itself is already durable; some file systems refuse a directory fsync."""
    try:
        fsync_path(path)
    except OSError:
        pass


def _is_dcp(info: dict[str, Any], rank: int) -> bool:
    """Whether a checkpoint was written by the DCP backend (alpsck.dcp): its shards hold DCP chunks, no state tree."""
    try:
        meta = json.loads(open_shard(Path(info["path"]) / shard_name(rank)).meta)
    except (AlpsckError, OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and meta.get("format") == DCP_META_FORMAT


def _destination(out: str) -> Path:
    """The file export writes for OUT: a symlink is followed to its target, which is replaced; OUT (or
    that target) must be a regular file or not exist yet. A device, FIFO or socket (``/dev/null``,
    ``/dev/stdout``) is refused: renaming the new file onto it would replace the node itself."""
    try:
        mode: int | None = os.stat(out).st_mode  # through symlinks
    except OSError:  # not there (or a dangling symlink), or its directory is not: _check_out names why
        mode = None
    if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise UsageError(f"{out} is not a regular file (a device, FIFO or socket), which export would replace; "
                         "give a file name")
    path = Path(os.path.realpath(out)) if os.path.islink(out) else Path(out)
    _check_out(path)
    return path


def _create_tmp(out: Path) -> tuple[BinaryIO, Path]:
    """A new file beside OUT to write the export into (:func:`.export_dirs.beside`). Created exclusively: never
    truncates an existing file, never writes through a symlink."""
    def create(tmp: Path) -> tuple[BinaryIO, Path]:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        return os.fdopen(fd, "wb"), tmp

    return beside(out, create)


def _check_not_in_run(out: Path, run_dir: str) -> bool:
    """Refuse an OUT that is one of the run directory's own files or lies in one of its checkpoints
    (``RUN/LATEST``, ``RUN/step-N/rank-00000.bin``, ...): replacing it would lose run state. True
    when OUT lies elsewhere in the run directory (export then writes there as its writer)."""
    real_run = Path(os.path.realpath(run_dir))
    real_out = Path(os.path.realpath(out.parent)) / out.name
    if real_out.is_relative_to(real_run):
        first = real_out.relative_to(real_run).parts[0]
        if is_run_entry(first):
            raise UsageError(f"{out}: {first} belongs to the run directory {run_dir} (its checkpoints and their "
                             "bookkeeping), which export would overwrite; give a path outside them")
        return True
    return False


def _check_out(out: Path) -> None:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{out}: directory {parent} does not exist" if not parent.exists()
                         else f"{out}: {parent} is not a directory")
    if out.is_dir():
        raise UsageError(f"{out} is a directory; give a file name")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{out}: permission denied (cannot write into {parent})")


def format_for(out: Path, fmt: str | None) -> str:
    if fmt is not None:
        return fmt
    guessed = _SUFFIXES.get(out.suffix.lower())
    if guessed is None:
        raise UsageError(f"{out}: cannot tell the format from the suffix; give --format {{{','.join(FORMATS)}}} (dcp "
                         "and hf: a new directory)")
    return guessed


def export_checkpoint(run_dir: str, out: str, step: int | None = None, fmt: str | None = None, rank: int = 0,
                      threads: int = DEFAULTS["read_threads"], batch_bytes: int | None = None,
                      subtree: str | None = None, max_shard_bytes: int = HF_SHARD_BYTES) -> dict[str, Any]:
    """Write one checkpoint's tensors (only those under ``subtree``, if given) to ``out`` (see the
    module docstring); returns what was written.

    Returns ``{"run_dir", "source", "step", "rank", "subtree", "path", "format", "tensors", "tensor_bytes",
    "bytes", "files", "skipped"}``: the checkpoint directory read and its step, the file written (``bytes``: its
    size; ``tensor_bytes``: the tensors' data in it; ``files``: for ``dcp`` and ``hf``, every file of the new
    directory, and ``bytes`` their sum) and each newer step passed over, with why
    (``{"step", "path", "reason", "message"}``). ``export --json`` prints it.
    """
    if rank < 0:
        raise UsageError(f"--rank must be 0 or more, not {rank}")
    if subtree is not None and not is_text(subtree):  # a tree key is UTF-8 text (JSON): no such key, ever
        raise UsageError(f"--subtree {printable(subtree, 80)}: bytes that are not UTF-8; a checkpoint's state keys "
                         "are UTF-8 text")
    if fmt in DIR_FORMATS:
        if max_shard_bytes < 1:
            raise UsageError(f"--max-shard-bytes must be 1 or more, not {max_shard_bytes}")
        out_path = Path(out)
        check_new_dir(out_path)
    else:
        out_path = _destination(out)
        fmt = format_for(Path(out), fmt)  # the suffix of the name given, also for a symlink
        if fmt not in FORMATS:
            raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    check_run_dir(run_dir)
    # Writing into the run directory makes export one of its writers: the one writer lock, held
    # while it writes (RunDirLockedError naming a training that has it).
    with writer_lock(run_dir) if _check_not_in_run(out_path, run_dir) else contextlib.nullcontext():
        return _export(run_dir, out_path, step, fmt, rank, threads, batch_bytes, subtree, max_shard_bytes)


def _export(run_dir: str, out_path: Path, step: int | None, fmt: str, rank: int,
            threads: int, batch_bytes: int | None, subtree: str | None, max_shard_bytes: int) -> dict[str, Any]:
    # The picker's choice (store.picker.pick): with no --step, of the Checkpointer's kind, as restore picks (a
    # directory format reads DCP checkpoints too); a DCP checkpoint named by --step is refused below, by name.
    try:
        first, picked = pick_checkpoint(run_dir, step, kind="any" if step is not None or fmt in DIR_FORMATS
                                        else "alpsck")
    except NoCheckpointError:
        other = pick(run_dir) if step is None else None
        if other is not None and other.info is not None and _is_dcp(other.info, rank):
            raise UsageError(_dcp_refusal(other.path, fmt)) from None
        raise
    if first["status"] != "committed":
        raise CorruptCheckpointError(f"{run_dir}: checkpoint of step {first['step']} is {first['status']}: {first['error']}; "
                                     "not exporting it")
    skipped: list[dict[str, Any]] = []
    for k in picked.skipped if step is None else ():
        print(f"alpsck: warning: {k.warning()}", file=sys.stderr)
        skipped.append(dataclasses.asdict(k))
    candidates = [first] if step is not None else list(picked.candidates)
    tmp = Path(temp_name(str(out_path)))
    for info in candidates:
        try:
            tensors, tensor_bytes, files = _write(info, out_path, fmt, rank, threads, batch_bytes, subtree,
                                                  max_shard_bytes)
        except CorruptCheckpointError as e:
            if fmt not in DIR_FORMATS and _is_dcp(info, rank):  # not corrupt: written by dcp.save
                raise UsageError(_dcp_refusal(info["path"], fmt)) from None
            if step is not None:
                raise CorruptCheckpointError(f"checkpoint of step {info['step']} failed verification: {e}; "
                                             "nothing was written") from None
            failed = read_failure(info, e)
            print(f"alpsck: warning: {failed.warning()}", file=sys.stderr)
            skipped.append(dataclasses.asdict(failed))
            continue
        except NoCheckpointError as e:
            raise NoCheckpointError(f"checkpoint of step {info['step']} has no shard for rank {rank}: {e}") from None
        except PermissionError as e:
            raise CheckpointError(f"{e.filename or tmp}: permission denied") from None
        except OSError as e:
            if isinstance(e, AlpsckError):
                raise
            raise CheckpointError(f"{e.filename or tmp}: {e.strerror or e}; nothing was written") from None
        _fsync_dir(out_path.parent if str(out_path.parent) else Path("."))
        return {"run_dir": str(run_dir), "source": str(info["path"]), "step": int(info["step"]), "rank": rank,
                "subtree": subtree, "path": str(out_path), "format": fmt, "tensors": tensors,
                "tensor_bytes": tensor_bytes, "bytes": sum(f.stat().st_size for f in files),
                "files": [str(f) for f in files] if fmt in DIR_FORMATS else None, "skipped": skipped}
    raise NoCheckpointError(f"{run_dir}: no valid checkpoint left to export (every one failed verification)")


def _dcp_refusal(path: object, fmt: str) -> str:
    return (f"{path}: a torch.distributed.checkpoint (DCP) checkpoint, whose whole state no single {fmt} file holds "
            "(it has no state tree): export it with --format dcp (DCP's own format) or --format hf (safetensors), a "
            "new directory; nothing was written")


def _write(info: dict[str, Any], out_path: Path, fmt: str, rank: int, threads: int, batch_bytes: int | None,
           subtree: str | None, max_shard_bytes: int) -> tuple[int, int, list[Path]]:
    """One checkpoint (``info``) exported to ``out_path``: (tensors, their bytes, the files written)."""
    step_meta = {"alpsck.step": str(info["step"])}
    if fmt in DIR_FORMATS and _is_dcp(info, 0):  # alpsck's DCP backend: the whole state, through DCP
        (tensors, tensor_bytes), files = export_to_dir(
            out_path, lambda tmp: dcp_to_dir(Path(info["path"]), tmp, fmt, subtree, step_meta, max_shard_bytes))
        return tensors, tensor_bytes, files
    shards = CheckpointShards(info["path"], rank, open_shard)
    meta, items = shards.meta, plan(shards, subtree)
    metadata = {"format": "pt", "alpsck.step": str(meta.get("step", info["step"])), "alpsck.rank": str(rank)}
    if subtree is not None:
        metadata["alpsck.subtree"] = subtree
    tensor_bytes = sum(it.nbytes for it in items)
    if fmt in DIR_FORMATS:
        _, files = export_to_dir(out_path, lambda tmp: tree_to_dir(shards, items, tmp, fmt, metadata, threads,
                                                                   max_shard_bytes))
        return len(items), tensor_bytes, files
    fh, tmp = _create_tmp(out_path)
    try:
        with fh:
            if fmt == "safetensors":
                write_safetensors(fh, shards, items, metadata, threads, batch_bytes or BATCH_BYTES)
            else:
                write_torch(fh, shards, items, threads, batch_bytes or BATCH_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(items), tensor_bytes, [out_path]


def _export_cmd(a: argparse.Namespace) -> int:
    r = export_checkpoint(a.run_dir, a.out, a.step, a.format, a.rank, a.threads, subtree=a.subtree,
                          max_shard_bytes=a.max_shard_bytes)
    if a.json:
        print(jsonout.dumps(r))
        return 0
    files = f" in {len(r['files'])} files" if r["files"] else ""
    print(f"exported step {r['step']} ({r['tensors']} tensors, {r['format']}) to {r['path']}: "
          f"{human(r['bytes'])} ({r['bytes']} bytes){files}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ex = sub.add_parser(
        "export", help="write a checkpoint's tensors as one safetensors or torch.save file, or as a DCP or Hugging Face "
                       "checkpoint directory",
        description="Write the tensors of the newest valid checkpoint of RUN_DIR (or of --step N) to OUT, keyed by "
                    "their tree keys (e.g. model/layers.0.attention.wq.weight). Streamed: peak memory is about "
                    "max(largest tensor, 64 MiB), for both file formats. Written to OUT.tmp, fsync'ed, renamed. "
                    "--format dcp and hf write a new directory OUT: a checkpoint stock DCP loads (the whole state of a "
                    "DCP checkpoint, held in memory once) or sharded safetensors with their index.")
    ex.add_argument("run_dir")
    ex.add_argument("out")
    ex.add_argument("--step", type=arg_step, help="export this checkpoint (default: the newest valid one)")
    ex.add_argument("--format", choices=FORMATS,
                    help="safetensors, or torch (loadable with torch.load(OUT, weights_only=True)); default from OUT's "
                         "suffix (.safetensors; .pt/.pth/.bin). dcp: a directory DCP's FileSystemReader loads; hf: a "
                         "directory of model-0000K-of-0000N.safetensors and model.safetensors.index.json")
    ex.add_argument("--max-shard-bytes", type=int, default=HF_SHARD_BYTES,
                    help=f"--format hf: the most bytes of tensors per safetensors file (default {HF_SHARD_BYTES}, "
                         "save_pretrained's 5GB)")
    ex.add_argument("--rank", type=arg_rank, default=0, help="shard to export (default 0)")
    ex.add_argument("--threads", type=arg_option("read_threads"), default=DEFAULTS["read_threads"],
                    help=f"reader threads, {SPECS['read_threads']['min']}-{SPECS['read_threads']['max']} "
                         f"(default {DEFAULTS['read_threads']})")
    ex.add_argument("--subtree", metavar="KEY",
                    help="only the tensors under top-level state key KEY, named below it: --subtree model writes the "
                         "model's plain state_dict (model.load_state_dict(torch.load(OUT, weights_only=True)))")
    ex.add_argument("--json", action="store_true",
                    help="print one JSON document: the checkpoint read (source, step), the file written (path, format, "
                         "tensors, tensor_bytes, bytes) and the newer steps skipped")
    ex.set_defaults(func=_export_cmd)
