"""``alpsck inspect-checkpoints`` and ``alpsck prune``: what a run directory holds, and housekeeping.

``inspect-checkpoints RUN_DIR [--verify] [--json]`` lists every checkpoint with its status
(committed / incomplete / corrupt / unreadable) and which one a restart would use. ``--verify`` re-reads every
byte and checks every CRC (a progress bar on a terminal; exit 1 on corruption).
``--step N`` (or ``--tensors`` alone, for the newest valid one) describes one checkpoint from its
state tree, without reading tensor data: the tensor inventory (``--tensors``: name, dtype, shape,
bytes) and a summary of the non-tensor state (step, learning rates, RNG streams, data position,
entry kinds). Superseded directories (below) are listed apart, after the table (``--json``: the
top-level ``superseded`` list).

A run that resumed from an older checkpoint (the newest was corrupt, or an explicit older step was
restored) renames, at its first save, each ``step-N`` newer than the step it went on from to
``superseded-step-N-<pid>-<seq>`` (``step-N`` as the core names it, zero-padded). They are an
abandoned history: never restored, never counted as checkpoints, kept on disk until ``prune``.

``prune RUN_DIR --keep-last K [--dry-run] [--verify]`` removes committed checkpoints beyond the
newest K, abandoned ``step-N.tmp`` directories, expired ``free-*`` and ``superseded-*`` directories
(and ``.deleting-*`` leftovers of an interrupted prune). Corrupt checkpoints and manifest-less
``step-N`` directories (never committed) older than the newest valid checkpoint are removed; newer
ones are kept (with a warning) for inspection.
Unreadable ones (permission denied, EIO, ESTALE) are never removed.
The checkpoints kept are always verified to the last byte first (``--verify`` verifies every
checkpoint), so the newest valid checkpoint is never removed. It refuses to run while ``RUN_DIR/.lock`` names a live
process (see :func:`lock_holder`). Each directory is first renamed to ``.deleting-<name>`` (atomic
expiry: the checkpoint disappears from scans at once), the run directory is fsync'ed, then the
files are deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import errno
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from . import _core, jsonout, tree
from .durable import fsync_path
from .errors import (
    AlpsckError,
    CheckpointError,
    CheckpointIOError,
    CorruptCheckpointError,
    NoCheckpointError,
    RunDirLockedError,
    UsageError,
)
from .options import DEFAULTS, arg_int, arg_rank, arg_step
from .shards import UNUSABLE, CheckpointShards

_ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)
# The run directory's names belong to the core (cpp/core/run_dir.h); these are its.
LOCK_NAME = _core.run_dir_names["lock"]
DELETING_PREFIX = _core.run_dir_names["deleting_prefix"]


def entry_kind(name: str) -> str:
    """What a run directory's entry is, by name (the core's ParseRunDirName): 'step', 'attempt',
    'aborted', 'free', 'free-pending', 'superseded', 'latest', 'lock', 'history', 'deleting' or 'other'."""
    return str(_core.parse_run_dir_name(name)[0])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


human = _human


# ----------------------------------------------------------------------------- run directory


def _denied(path: str | os.PathLike[str], what: str) -> CheckpointError:
    return CheckpointError(f"{path}: permission denied ({what}); run as the user who owns the run or fix its permissions")


def is_run_entry(name: str) -> bool:
    """Whether ``name`` is one of the entries alpsck itself keeps in a run directory."""
    return entry_kind(name) != "other"


def holds_run_state(names: Iterable[str]) -> bool:
    """Whether a directory with these entries is an alpsck run directory: any entry alpsck keeps,
    except a writer lock alone (the torch.save baseline's directories have one)."""
    return any(entry_kind(n) not in ("other", "lock") for n in names)


def _refuse_folder_of_named_checkpoints(path: Path, names: list[str]) -> None:
    """A trainer's folder of DCP checkpoints written by alpsck (``folder/step-10``, each a run directory of
    its own with a ``.metadata`` marker) is not a run directory: its ``step-N`` would read as damaged."""
    steps = [n for n in names if entry_kind(n) == "step"]
    if not steps or any(entry_kind(n) not in ("step", "other", "lock") for n in names):
        return
    if any((path / n / _core.run_dir_names["manifest"]).exists() or not (path / n / ".metadata").is_file()
           for n in steps):
        return
    from .dcp_paths import is_marked  # torch's DCP types: imported only for such a folder

    if not all(is_marked(path / n) for n in steps):
        return
    newest = max(steps, key=lambda n: _core.parse_run_dir_name(n)[1])
    raise UsageError(f"{path}: a folder of DCP checkpoints written by AlpsckStorageWriter ({len(steps)}: "
                     f"{', '.join(sorted(steps)[:3])}{' ...' if len(steps) > 3 else ''}), each a run directory of its "
                     f"own; name one, e.g. {path / newest}")


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The run directory as a Path, or a one-line AlpsckError saying why it is not usable.

    Missing, not a directory, not readable (permission denied), or not an alpsck run directory
    (no ``step-*`` directories, no ``LATEST``, no ``history.jsonl``).
    """
    path = Path(run_dir)
    try:
        path.stat()
    except FileNotFoundError:
        raise UsageError(f"{run_dir}: no such directory") from None
    except PermissionError:
        raise _denied(run_dir, "cannot reach it") from None
    except OSError as e:
        raise CheckpointError(f"{run_dir}: {e.strerror or e}") from None
    if not path.is_dir():
        raise UsageError(f"{run_dir}: not a directory")
    try:
        names = os.listdir(path)
    except PermissionError:
        raise _denied(run_dir, "cannot list it") from None
    except OSError as e:
        raise CheckpointError(f"{run_dir}: cannot list it: {e.strerror or e}") from None
    _refuse_folder_of_named_checkpoints(path, names)
    if not holds_run_state(names):
        baseline = sorted(n for n in names if n.startswith("torch-step-") and n.endswith(".pt"))
        hint = (f"; its {len(baseline)} torch-step-*.pt file(s) are the torch.save baseline's (--checkpointer torch), "
                "which these tools do not read: load them with alpsck.TorchSaveCheckpointer") if baseline else ""
        raise UsageError(f"{run_dir}: not an alpsck run directory (no step-* checkpoints, no LATEST, no history.jsonl)"
                         + hint)
    return path


def superseded_dirs(run_dir: Path) -> list[dict[str, Any]]:
    """The superseded directories of ``run_dir`` (``{"step", "path", "bytes"}``, by step), as prune removes them.

    Only real directories whose whole name is one the core writes; anything else is not listed.
    """
    found = []
    for n in os.listdir(run_dir):
        kind, step, _ = _core.parse_run_dir_name(n)
        p = run_dir / n
        if kind == "superseded" and p.is_dir() and not p.is_symlink():
            found.append({"step": step, "path": str(p), "bytes": _dir_bytes(p)})
    return sorted(found, key=lambda d: (d["step"], d["path"]))


def _superseded_line(found: list[dict[str, Any]], limit: int = 10) -> str:
    names = [f"step {d['step']} ({Path(d['path']).name})" for d in found[:limit]]
    if len(found) > limit:
        names.append(f"... and {len(found) - limit} more")
    one = len(found) == 1
    return (f"{len(found)} superseded checkpoint director{'y' if one else 'ies'} (an abandoned history, never "
            f"restored): {', '.join(names)}; `alpsck prune` removes {'it' if one else 'them'}")


def scan_run_dir(
    run_dir: str | os.PathLike[str],
    verify: bool = False,
    threads: int = DEFAULTS["read_threads"],
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """``_core.scan`` after :func:`check_run_dir`, with permission errors turned into clear messages."""
    path = check_run_dir(run_dir)
    try:
        return list(_core.scan(str(path), verify=verify, threads=threads, progress=progress))
    except CheckpointIOError as e:
        if e.errno in _ACCESS_ERRNOS:
            raise _denied(run_dir, e.strerror or str(e)) from None
        raise
    except PermissionError as e:  # pragma: no cover - the core reports CheckpointIOError
        raise _denied(e.filename or run_dir, "scan") from None


def open_shard(path: str | os.PathLike[str]) -> Any:
    """``_core.ShardReader(path)`` with permission and missing-file errors named clearly."""
    try:
        return _core.ShardReader(str(path))
    except CheckpointIOError as e:
        if e.errno in _ACCESS_ERRNOS:
            raise _denied(path, "cannot read the shard") from None
        if e.errno == errno.ENOENT:
            raise NoCheckpointError(f"{path}: no such shard file") from None
        raise


def pick_checkpoint(infos: list[dict[str, Any]], run_dir: str | os.PathLike[str], step: int | None) -> dict[str, Any]:
    """The checkpoint of ``step`` (any status), or the newest committed one when step is None.

    A missing step raises NoCheckpointError naming it and listing the steps that exist.
    """
    if step is None:
        committed = [i for i in infos if i["status"] == "committed"]
        if not committed:
            raise NoCheckpointError(f"{run_dir}: no valid checkpoint")
        return committed[-1]
    found = [i for i in infos if i["step"] == step]
    if not found:
        avail = ", ".join(f"{i['step']} ({i['status']})" for i in infos) or "none"
        raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}; available: {avail}")
    committed = [i for i in found if i["status"] == "committed"]
    return committed[0] if committed else found[0]


# ----------------------------------------------------------------------------- progress bar


class ProgressBar:
    """A one-line terminal bar: ``label [#####.....]  42.0%  1.2 GiB / 2.9 GiB`` (redrawn at most 10x/s)."""

    def __init__(self, total: int, stream: TextIO, label: str = "verifying", width: int = 30) -> None:
        self.total, self.stream, self.label, self.width = max(0, int(total)), stream, label, width
        self.done = 0
        self._last_draw = 0.0
        self._drawn = False

    def update(self, done: int) -> None:
        self.done = min(max(int(done), self.done), self.total) if self.total else int(done)
        now = time.monotonic()
        if now - self._last_draw >= 0.1 or (self.total and self.done >= self.total):
            self._last_draw = now
            self.draw()

    def draw(self) -> None:
        frac = (self.done / self.total) if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {100 * frac:5.1f}%  {_human(self.done)} / {_human(self.total)}")
        self.stream.flush()
        self._drawn = True

    def close(self, complete: bool = True) -> None:
        if complete:
            self.done = self.total
        self.draw()
        self.stream.write("\n")
        self.stream.flush()


class ShardProgress:
    """Turns the core's progress callbacks (bytes done *in the current shard*) into one running total.

    The core verifies shards one after another (in directory order) and restarts its count at each;
    a count that does not grow means a new shard began, so the previous one's count is banked. (A
    shard smaller than the next one's first chunk can go unnoticed: the total then lags by less
    than one chunk.)
    """

    def __init__(self, bar: ProgressBar) -> None:
        self.bar = bar
        self.base, self.last = 0, 0

    def __call__(self, done: int) -> None:
        if done <= self.last:
            self.base += self.last
        self.last = done
        self.bar.update(self.base + done)


def _verify_sizes(infos: list[dict[str, Any]]) -> list[int]:
    """Bytes the core reads to verify each shard of each committed checkpoint (data padded to ``align``)."""
    sizes: list[int] = []
    for info in infos:
        if info["status"] != "committed":
            continue
        shards = info.get("shards") or []
        for name in shards:
            try:
                r = _core.ShardReader(str(Path(info["path"]) / name))
                align = max(1, int(r.align))
                sizes.append(-(-int(r.data_bytes) // align) * align)
            except (AlpsckError, OSError):
                sizes.append(int(info["data_bytes"]) // max(1, len(shards)))
    return sizes


# ----------------------------------------------------------------------------- inspect


def inspect_checkpoints(run_dir: str, verify: bool, as_json: bool, progress_stream: TextIO | None = None) -> int:
    """The checkpoint table (or JSON document) of ``run_dir``; exit code 1 if ``verify`` found corruption.

    The bar goes to ``progress_stream``; by default to stderr when it is a terminal and not ``as_json``.
    """
    path = check_run_dir(run_dir)
    if progress_stream is None and verify and not as_json and sys.stderr.isatty():
        progress_stream = sys.stderr
    tracker: ShardProgress | None = None
    bar: ProgressBar | None = None
    if verify and progress_stream is not None:
        bar = ProgressBar(sum(_verify_sizes(scan_run_dir(path))), progress_stream)
        tracker = ShardProgress(bar)
    infos = scan_run_dir(path, verify=verify, progress=tracker)
    if bar is not None:
        bar.close(complete=not any(i["status"] in UNUSABLE for i in infos))
    committed = [i["step"] for i in infos if i["status"] == "committed"]
    latest = max(committed) if committed else None
    superseded = superseded_dirs(path)
    if as_json:
        doc = {
            "latest_valid": latest,
            "checkpoints": [
                {k: i[k] for k in ("step", "path", "status", "bytes", "created", "ranks", "tensors", "verified", "error")}
                for i in infos
            ],
            "superseded": superseded,
        }
        print(jsonout.dumps(doc))
    else:
        if not infos:
            print(f"{run_dir}: no checkpoints")
        else:
            print(f"{'':1} {'step':>10}  {'status':<10} {'size':>10}  {'created':<19}  {'ranks':>5}  {'tensors':>7}  "
                  f"{'GB/s':>6}  note")
            for i in infos:
                mark = "*" if i["step"] == latest and i["status"] == "committed" else ""
                created = dt.datetime.fromtimestamp(i["created"]).strftime("%Y-%m-%d %H:%M:%S") if i["created"] else "-"
                rate = f"{i['bytes'] / i['write_seconds'] / 1e9:6.2f}" if i["write_seconds"] else "     -"
                ranks = str(i["ranks"]) if i["ranks"] else "-"
                print(f"{mark:1} {i['step']:>10}  {i['status']:<10} {_human(i['bytes']):>10}  {created:<19}  {ranks:>5}  "
                      f"{i['tensors']:>7}  {rate}  {i['error'] or ''}")
            print("* = what restore would pick" if latest is not None else "no valid checkpoint: restore would start fresh")
        if superseded:
            print(_superseded_line(superseded))
    bad = any(i["status"] in UNUSABLE for i in infos)
    return 1 if (verify and bad) else 0


def _plain(v: Any) -> Any:
    """A JSON-able rendering of a decoded scalar (tensor references become their description)."""
    if isinstance(v, tree.TensorRef):
        return f"<tensor {v.key} {tree.dtype_name(v.dtype)} {list(v.shape)}>"
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return repr(v)


_RNG_STREAMS = ("python", "numpy", "torch", "cuda")


def _walk(v: Any, path: str, depth: int = 0) -> Iterator[tuple[str, dict[Any, Any]]]:
    """Every dict in a decoded value, with its path (depth-limited)."""
    if depth > 8:
        return
    if isinstance(v, dict):
        yield path, v
        for k, x in v.items():
            if isinstance(x, (dict, list, tuple)):
                yield from _walk(x, f"{path}/{k}", depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if isinstance(x, (dict, list, tuple)):
                yield from _walk(x, f"{path}/{i}", depth + 1)


def summarize_state(tree_doc: dict[str, Any]) -> dict[str, Any]:
    """What a state tree says besides tensor bytes: entry kinds, learning rates, RNG streams, data position.

    Decodes with the tree's own validating decoder; tensors are only references (nothing is read).
    """
    entries = tree.decode_refs(tree_doc)
    kinds = {key: kind for key, (kind, _, _) in entries.items()}
    lrs: list[dict[str, Any]] = []
    rng: dict[str, list[str]] = {}
    data: dict[str, dict[str, Any]] = {}
    values: dict[str, Any] = {}
    for key, (kind, decoded, _) in entries.items():
        if kind == "value" and (decoded is None or isinstance(decoded, (bool, int, float, str))):
            values[key] = decoded
        for path, d in _walk(decoded, key):
            groups = d.get("param_groups")
            if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
                lrs.append({"path": path, "source": "param_groups", "lr": [_plain(g.get("lr")) for g in groups]})
            for name in ("_last_lr", "last_lr"):
                if isinstance(d.get(name), (list, tuple)):
                    lrs.append({"path": path, "source": "last_lr", "lr": _plain(d[name])})
                    break
            if "torch" in d and sum(s in d for s in _RNG_STREAMS) >= 2:
                streams = []
                for s in _RNG_STREAMS:
                    x = d.get(s)
                    if x is None or (isinstance(x, (list, tuple)) and not x):
                        continue
                    streams.append(f"cuda ({len(x)} devices)" if s == "cuda" and isinstance(x, (list, tuple)) else s)
                rng[path] = streams
            elif ("position" in d or "epoch" in d) and "param_groups" not in d:
                pos = {str(k): _plain(x) for k, x in d.items()
                       if x is None or isinstance(x, (bool, int, float, str))}
                if any(k in pos for k in ("position", "epoch")):
                    data[path] = pos
    return {"entries": kinds, "values": values, "learning_rates": lrs, "rng": rng, "data": data}


def describe_checkpoint(info: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    """Tensor inventory and state summary of one checkpoint (rank ``rank``'s shard), from its tree only."""
    shards = CheckpointShards(info["path"], rank, open_shard)
    meta, specs = shards.meta, shards.specs
    tensors = [
        {"name": key, "dtype": tree.dtype_name(specs[key].dtype), "shape": list(specs[key].shape),
         "bytes": specs[key].nbytes}
        for key in shards.keys_in_file_order()
    ]
    summary = summarize_state(meta["tree"])
    return {
        "step": meta.get("step", info["step"]),
        "path": info["path"],
        "status": info["status"],
        "rank": rank,
        "ranks": info["ranks"],
        "tensor_count": len(tensors),
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "state": summary,
    }


def _print_description(d: dict[str, Any], show_tensors: bool) -> None:
    print(f"checkpoint step {d['step']}: {d['path']} ({d['status']}"
          + (f", rank {d['rank']} of {d['ranks']}" if d["ranks"] > 1 else "") + ")")
    print(f"tensors: {d['tensor_count']}, {_human(d['tensor_bytes'])}")
    if show_tensors and d["tensors"]:
        w = max(len("name"), *(len(t["name"]) for t in d["tensors"]))
        print(f"  {'name':<{w}}  {'dtype':<14} {'shape':<20} {'bytes':>12}")
        for t in d["tensors"]:
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            print(f"  {t['name']:<{w}}  {t['dtype']:<14} {shape:<20} {t['bytes']:>12}")
    s = d["state"]
    print("state:")
    print("  entries: " + (", ".join(f"{k} ({v})" for k, v in s["entries"].items()) or "none"))
    for k, v in s["values"].items():
        print(f"  {k} = {v!r}")
    if s["learning_rates"]:
        for lr in s["learning_rates"]:
            print(f"  learning rate: {lr['path']} ({lr['source']}) = {', '.join(map(str, lr['lr']))}")
    else:
        print("  learning rate: none found (no optimizer param_groups or scheduler last_lr)")
    if s["rng"]:
        for k, v in s["rng"].items():
            absent = [x for x in _RNG_STREAMS if not any(y.startswith(x) for y in v)]
            print(f"  rng streams ({k}): {', '.join(v) or 'none'}" + (f" (absent: {', '.join(absent)})" if absent else ""))
    else:
        print("  rng streams: none saved")
    if s["data"]:
        for k, v in s["data"].items():
            print(f"  data position ({k}): " + " ".join(f"{a}={b}" for a, b in v.items()))
    else:
        print("  data position: none found")


def inspect_one(run_dir: str, step: int | None, show_tensors: bool, as_json: bool, verify: bool, rank: int = 0,
                progress_stream: TextIO | None = None) -> int:
    """``inspect-checkpoints --step N [--tensors]``: one checkpoint's inventory and state summary.

    With ``verify``, exit 1 when the checkpoint is corrupt or unreadable, whether its CRCs or the quick
    scan (a truncated shard, a bad footer or manifest) found it; without, such a checkpoint is an error.
    """
    infos = scan_run_dir(run_dir)
    info = pick_checkpoint(infos, run_dir, step)
    if verify and info["status"] in UNUSABLE:  # what --verify looks for: reported, exit 1 (as without --step)
        doc = {k: info[k] for k in ("step", "path", "status", "ranks")} | {"rank": rank, "verified": False,
                                                                         "error": info["error"]}
        if as_json:
            print(jsonout.dumps(doc))
        else:
            print(f"checkpoint step {info['step']}: {info['path']} ({info['status']})")
            print(f"{info['status'].upper()}: {info['error']}")
        return 1
    if info["status"] != "committed":
        raise CorruptCheckpointError(f"{run_dir}: checkpoint of step {info['step']} is {info['status']}: {info['error']}")
    if not 0 <= rank < max(1, info["ranks"]):
        raise UsageError(f"--rank {rank}: checkpoint of step {info['step']} has {info['ranks']} rank(s)")
    desc = describe_checkpoint(info, rank)
    rc = 0
    if verify:
        if progress_stream is None and not as_json and sys.stderr.isatty():
            progress_stream = sys.stderr
        desc["verified"], desc["error"] = True, None
        readers = [open_shard(Path(info["path"]) / name) for name in info["shards"]]
        bar = ProgressBar(sum(int(r.data_bytes) for r in readers), progress_stream) if progress_stream else None
        done = 0
        for r in readers:
            try:
                r.verify(DEFAULTS["read_threads"])
            except CorruptCheckpointError as e:
                desc["verified"], desc["error"], rc = False, str(e), 1
                break
            done += int(r.data_bytes)
            if bar:
                bar.update(done)
        if bar:
            bar.close(complete=rc == 0)
    if as_json:
        if not show_tensors:
            desc.pop("tensors")
        print(jsonout.dumps(desc))
    else:
        _print_description(desc, show_tensors)
        if verify:
            print("verified: every chunk CRC matches" if rc == 0 else f"CORRUPT: {desc['error']}")
    return rc


# ----------------------------------------------------------------------------- prune


def _parse_lock(text: str) -> dict[str, str]:
    """Fields of a lock file: JSON ``{"pid": ..}`` or ``key=value`` lines (a bare number is the pid)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):  # not a lock alpsck wrote: read it as key=value lines
            doc = None
        if isinstance(doc, dict):
            return {str(k).lower(): str(v) for k, v in doc.items() if v is not None}
    out: dict[str, str] = {}
    for i, line in enumerate(text.splitlines()):
        line = line.strip()
        for sep in ("=", ":"):
            if sep in line:
                k, v = line.split(sep, 1)
                out.setdefault(k.strip().lower(), v.strip().strip('"'))
                break
        else:
            if i == 0 and line.isdigit():
                out["pid"] = line
    return out


def _this_host(name: str) -> bool:
    here = socket.gethostname()
    return name in (here, here.split(".")[0], "localhost") or name.split(".")[0] == here.split(".")[0]


def lock_holder(run_dir: str | os.PathLike[str]) -> str | None:
    """Why the run directory's writer lock says a writer may be active (a message naming it), or None.

    A writer holds an ``flock`` on ``RUN_DIR/.lock`` while it writes and keeps its owner there
    (JSON ``{"pid", "host", "job_id"}``), emptying it on a clean close (the core's RunDirLock). So:
    no file or an empty one → no writer; an flock held → a writer on this host; content naming
    another host, whose flock may not be visible from here (Lustre without ``-o flock``), → refuse
    with advice; content of a process on this host that holds no flock → a crashed writer, stale.
    A lock name that is a symlink or not a regular file raises UsageError (never followed or opened).
    """
    lock = Path(run_dir) / LOCK_NAME
    try:
        held, text = _core.probe_lock(str(run_dir), 0)
    except CheckpointIOError as e:
        if e.errno in _ACCESS_ERRNOS:
            raise _denied(lock, "cannot read the lock file") from None
        raise
    fields = _parse_lock(text)
    host = fields.get("host") or fields.get("hostname") or fields.get("node")
    job = fields.get("job_id") or fields.get("jobid") or fields.get("job") or fields.get("slurm_job_id")
    who = f"pid {fields.get('pid', '?')}" + (f", job {job}" if job else "")
    if held:
        return f"{lock}: a writer holds it ({who}{f' on {host}' if host else ''})"
    if host and not _this_host(host):
        return (f"{lock} names a writer on host {host} ({who}), which cannot be checked from {socket.gethostname()}; "
                f"remove {lock} if that job is gone")
    return None


@contextlib.contextmanager
def writer_lock(run_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the run directory's writer lock for the block (prune, an export into the run directory):
    they write too, and one writer at a time (RunDirLockedError naming the holder)."""
    from .checkpointer import lock_run_dir

    lock = lock_run_dir(Path(run_dir), 0)
    try:
        yield
    finally:
        lock.release()


def _dir_bytes(path: Path) -> int:
    if path.is_symlink():  # removing it unlinks the link only: it frees nothing behind it
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _data_error(info: dict[str, Any]) -> tuple[str, str] | None:
    """None if every chunk of every shard of a committed checkpoint matches its CRC, else its
    state ("corrupt", or "unreadable" when reading failed for a reason other than its bytes) and why."""
    try:
        for name in info["shards"]:
            open_shard(Path(info["path"]) / name).verify(DEFAULTS["read_threads"])
    except CorruptCheckpointError as e:
        return "corrupt", str(e)
    except CheckpointError as e:  # permission denied, EIO, ESTALE: nothing known about the bytes
        return "unreadable", str(e)
    return None


def plan_prune(run_dir: Path, keep_last: int, verify: bool = False) -> tuple[list[tuple[Path, str]], list[str], list[int]]:
    """(directories to remove with the reason, warnings, steps kept) — nothing is touched.

    The checkpoints kept are checked to the last byte whatever ``verify`` says: the quick scan
    sees sizes, footers and manifests only, and trusting it could remove every good checkpoint
    while keeping one whose data is corrupt. Newest first, each committed checkpoint's CRCs are
    verified until ``keep_last`` pass; one that fails counts as corrupt. ``verify`` verifies every
    checkpoint, including those removed.
    """
    infos = scan_run_dir(run_dir, verify=verify)
    kept_steps: set[int] = set()
    for i in reversed(infos):
        if len(kept_steps) == keep_last:
            break
        if i["status"] != "committed":
            continue
        err = None if verify else _data_error(i)
        if err is not None:
            i["status"], i["error"] = err
            continue
        kept_steps.add(i["step"])
    newest_valid = max(kept_steps) if kept_steps else None
    remove: list[tuple[Path, str]] = []
    warnings: list[str] = []
    for i in infos:
        p = Path(i["path"])
        if i["status"] == "committed":
            if i["step"] not in kept_steps:
                remove.append((p, f"committed step {i['step']}, beyond the newest {keep_last}"))
        elif i["status"] == "unreadable":  # maybe intact: never removed on an access error
            warnings.append(f"kept unreadable checkpoint {p} (fix its access and run prune again): {i['error']}")
        elif i["status"] == "incomplete" and entry_kind(p.name) != "step":  # an attempt: in flight, abandoned or aborted
            remove.append((p, f"incomplete step {i['step']}: {i['error']}"))
        elif newest_valid is not None and i["step"] < newest_valid:
            remove.append((p, f"{i['status']} step {i['step']}: {i['error']}"))
        else:  # corrupt, or a step-N without MANIFEST.json: kept, like a newer corrupt one
            why = "newer than the newest valid one" if newest_valid is not None else "no valid checkpoint exists"
            what = "corrupt checkpoint" if i["status"] == "corrupt" else "damaged checkpoint"
            warnings.append(f"kept {what} {p} ({why}) for inspection: {i['error']}")
    names = sorted(os.listdir(run_dir))
    for n in names:
        p = run_dir / n
        kind = entry_kind(n)
        if kind in ("free", "free-pending") and p.is_dir() and not p.is_symlink():
            remove.append((p, "expired (free-*) directory"))
        elif kind == "superseded" and p.is_dir() and not p.is_symlink():
            remove.append((p, "superseded (abandoned history)"))
        elif kind == "deleting" and (p.is_dir() or p.is_file()) and not p.is_symlink():
            remove.append((p, "left over by an interrupted prune"))
    return remove, warnings, sorted(kept_steps)


def _deleting_name(run_dir: Path, name: str) -> Path:
    base = run_dir / f"{DELETING_PREFIX}{name}"
    target, n = base, 1
    while target.exists() or target.is_symlink():
        n += 1
        target = Path(f"{base}-{os.getpid()}-{n}")
    return target


def prune(run_dir: str, keep_last: int, dry_run: bool = False, verify: bool = False) -> int:
    """``alpsck prune``: see the module docstring. Exit 0; refusals raise (exit 2)."""
    if keep_last < 1:
        raise UsageError(f"--keep-last must be at least 1 (the newest valid checkpoint is always kept), not {keep_last}")
    path = check_run_dir(run_dir)
    holder = lock_holder(path)
    if holder is not None:
        raise RunDirLockedError(f"not pruning {run_dir}: {holder}")
    with contextlib.nullcontext() if dry_run else writer_lock(path):
        remove, warnings, kept = plan_prune(path, keep_last, verify)
        for w in warnings:
            print(f"alpsck: warning: {w}", file=sys.stderr)
        sizes = {p: _dir_bytes(p) for p, _ in remove}
        if dry_run:
            for p, why in remove:
                print(f"would remove {p} ({_human(sizes[p])}): {why}")
            print(f"dry run: would free {_human(sum(sizes.values()))}; keeping step(s) {', '.join(map(str, kept)) or 'none'}")
            return 0
        # 1. atomic expiry: rename everything first, so scans stop seeing these at once
        renamed: list[tuple[Path, Path, str]] = []
        for p, why in remove:
            if p.name.startswith(DELETING_PREFIX):
                renamed.append((p, p, why))
                continue
            target = _deleting_name(path, p.name)
            try:
                os.rename(p, target)
            except FileNotFoundError:
                continue  # gone meanwhile
            except PermissionError:
                raise _denied(p, "cannot rename it") from None
            renamed.append((p, target, why))
        if renamed:
            fsync_path(path)
        # 2. delete the files
        freed = 0
        for p, target, why in renamed:
            try:
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            except PermissionError:
                raise _denied(target, "cannot delete it") from None
            freed += sizes.get(p, 0)
            print(f"removed {p} ({_human(sizes.get(p, 0))}): {why}")
        if renamed:
            fsync_path(path)
        print(f"freed {_human(freed)}; keeping step(s) {', '.join(map(str, kept)) or 'none'}")
    return 0


# ----------------------------------------------------------------------------- command line


def _inspect_cmd(a: argparse.Namespace) -> int:
    if a.step is not None or a.tensors:
        return inspect_one(a.run_dir, a.step, a.tensors, a.json, a.verify, a.rank)
    return inspect_checkpoints(a.run_dir, a.verify, a.json)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ins = sub.add_parser(
        "inspect-checkpoints", help="list the checkpoints of a run directory and their status",
        description="List the checkpoints of RUN_DIR (committed / incomplete / corrupt / unreadable) and which one a "
                    "restart uses. "
                    "With --step N (or --tensors) describe one checkpoint from its state tree, without reading tensor data.")
    ins.add_argument("run_dir")
    ins.add_argument("--verify", action="store_true", help="re-read every byte and check every CRC (exit 1 on corruption)")
    ins.add_argument("--json", action="store_true", help="print one JSON document")
    ins.add_argument("--step", type=arg_step, help="describe checkpoint N: state summary (step, lr, RNG streams, data position)")
    ins.add_argument("--tensors", action="store_true",
                     help="list the tensors (name, dtype, shape, bytes) of --step N (default: the newest valid checkpoint)")
    ins.add_argument("--rank", type=arg_rank, default=0, help="shard to describe with --step/--tensors (default 0)")
    ins.set_defaults(func=_inspect_cmd)

    pr = sub.add_parser(
        "prune", help="remove old checkpoints, abandoned .tmp, expired free-* and superseded-* directories",
        description="Remove committed checkpoints beyond the newest K, incomplete step-N.tmp directories, free-* "
                    "directories, superseded-* directories (an abandoned history, never restored), and corrupt or "
                    "never committed (no MANIFEST.json) checkpoints older than the newest valid one (newer ones are "
                    "kept for inspection; unreadable ones are never removed). Refuses while RUN_DIR/.lock names a live "
                    "process.")
    pr.add_argument("run_dir")
    pr.add_argument("--keep-last", type=arg_int(1), required=True, metavar="K", help="committed checkpoints to keep (K >= 1)")
    pr.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    pr.add_argument("--verify", action="store_true",
                    help="check every checkpoint's CRCs, not only those of the checkpoints kept (which are always "
                         "checked)")
    pr.set_defaults(func=lambda a: prune(a.run_dir, a.keep_last, a.dry_run, a.verify))
