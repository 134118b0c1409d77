"""The run directory's Python face: its names (the core's, cpp/core/run_dir.h), what it holds, its lock.

Every name in a run directory or a checkpoint directory is the core's (``_core.run_dir_names``,
``_core.parse_run_dir_name``, ``_core.step_dir_name``) or this module's (the DCP checkpoint-directory
marker ``.metadata``); nothing else spells one. Here: what an entry is (:func:`entry_kind`), whether a
directory is a run directory (:func:`check_run_dir`), the scan with clear refusals (:func:`scan_run_dir`),
which checkpoint a restore uses and why not the newer ones (:func:`pick`, the one picker: every reader
asks it), which checkpoint a step or "the newest" names (:func:`pick_checkpoint`), the data-CRC check of a whole
checkpoint (:func:`data_error`), and the writer lock (:func:`lock_run_dir`, :func:`writer_lock`,
:func:`lock_holder`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import (
    CheckpointError,
    CheckpointIOError,
    NoCheckpointError,
    UsageError,
    echo,
)
from ..job_env import JobEnv
from ..options import DEFAULTS
from .durable import fsync_path, open_own, read_small

_ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)
# The run directory's names belong to the core (cpp/core/run_dir.h); these are its.
LOCK_NAME = _core.run_dir_names["lock"]
DELETING_PREFIX = _core.run_dir_names["deleting_prefix"]
TEMP_SUFFIX = _core.run_dir_names["temp_suffix"]


def is_text(value: str) -> bool:
    """Whether ``value`` is UTF-8 text: no surrogate escapes (the bytes of a file name or a file's content
    that are not valid UTF-8, as Python holds them), which the core's text parameters cannot take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def core_text(value: str) -> str:
    """``value`` as the core's text parameters take it: bytes that are not UTF-8 (surrogate escapes, from a
    file the core read, such as the lock's owner record, or from :func:`os.fsdecode`) each become U+FFFD.
    Text only, never a path: paths go to the core as bytes (its FsPath), whatever they hold."""
    if is_text(value):
        return value
    return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")  # any lone surrogate: U+FFFD


def temp_name(path: str) -> str:
    """The name a small file is written under before the rename that publishes it (the core's TempFileName)."""
    return path + TEMP_SUFFIX


def entry_kind(name: str) -> str:
    """What a run directory's entry is, by name (the core's ParseRunDirName): 'step', 'attempt',
    'aborted', 'free', 'free-pending', 'superseded', 'latest', 'lock', 'history', 'job-record', 'deleting' or 'other'."""
    return str(_core.parse_run_dir_name(name)[0])



def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / _core.step_dir_name(step)


def is_committed_step_dir(path: Path) -> bool:
    """``run/step-N`` with its manifest: one committed checkpoint of a run directory."""
    return _core.parse_run_dir_name(path.name)[0] == "step" and (path / _core.run_dir_names["manifest"]).is_file()


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
            found.append({"step": step, "path": str(p), "bytes": dir_bytes(p)})
    return sorted(found, key=lambda d: (d["step"], d["path"]))


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


def pick_checkpoint(run_dir: str | os.PathLike[str], step: int | None, *, kind: str = "any") -> tuple[dict[str, Any], Pick]:
    """The checkpoint of ``step`` (any status, to report it), or the one :func:`pick` picks when step is None;
    with the pick itself (its candidates and what it skipped).

    A missing step raises NoCheckpointError naming it and listing the steps that exist; no usable
    checkpoint at all, NoCheckpointError saying why the newer ones were skipped.
    """
    p = pick(run_dir, kind=kind, step=step, allow_unhealthy=step is not None)  # a named step, whatever its health
    if p.info is not None:
        return p.info, p
    if step is None:
        why = p.why_not()
        raise NoCheckpointError(f"{run_dir}: no valid checkpoint" + (f" ({why})" if why else ""))
    found = [i for i in p.scanned if i["step"] == step]
    if not found:
        avail = ", ".join(f"{i['step']} ({i['status']})" for i in p.scanned) or "none"
        raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}; available: {avail}")
    # Only step-N directories are checkpoints: the step-N one (its status says why it is not used), else an attempt.
    found.sort(key=lambda i: i["status"] == "incomplete")
    return found[0], p


# ----------------------------------------------------------------------------- the picker

# Why a step newer than the pick was not picked (the core's PickCheckpoint, cpp/core/recovery.h;
# the rule is stated once, in docs/guarantees.md "Which checkpoint a restore uses").
REASONS = ("damaged", "corrupt", "unreadable", "incomplete", "aborted", "other_kind", "other_world", "unhealthy",
           "data_crc")
KINDS = ("any", "alpsck", "dcp")
# An attempt (a save in flight, or one a crash or an abort left): expected, so the readers skip it without
# a warning (inspect-checkpoints --json lists it in ``skipped`` all the same).
QUIET_REASONS = ("incomplete", "aborted")


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A step newer than the pick, and why it was not picked (``reason`` one of :data:`REASONS`)."""

    step: int
    path: str
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}: {self.message}"

    @property
    def quiet(self) -> bool:
        """An attempt (in flight, abandoned or aborted): expected, so readers skip it without a warning."""
        return self.reason in QUIET_REASONS

    def warning(self) -> str:
        """What every reader says when it skips this step (restore, peek, the DCP reader, export): one wording."""
        what = "corrupt" if self.reason == "data_crc" else self.reason.replace("_", "-")
        return f"skipping {what} checkpoint {self.path} (step {self.step}: {self.reason}): {self.message}"


def metrics_text(metrics: Mapping[str, float]) -> str:
    """A checkpoint's metrics in one line, ``loss=2.31 val_loss=nan``: four significant digits."""
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def read_failure(info: Mapping[str, Any], error: BaseException | str, corrupt: str = "data_crc") -> Skipped:
    """A candidate the picker passed whose reading failed, as a skipped step: ``unreadable`` for an
    access error (an OSError such as CheckpointIOError: permission denied, EIO, ESTALE; nothing is
    known about the bytes, so it is never treated as corrupt), else ``corrupt`` (``data_crc`` by
    default: its data failed a CRC; ``corrupt`` for its metadata). A str is another rank's report:
    unreadable."""
    reason = "unreadable" if isinstance(error, (OSError, str)) else corrupt
    return Skipped(int(info["step"]), str(info["path"]), reason, str(error))


@dataclasses.dataclass(frozen=True)
class Pick:
    """Which checkpoint of a run directory a restore uses (:func:`pick`).

    ``step``/``path``/``info``: the pick (None: nothing passes: a fresh start, or no such ``step``);
    ``candidates``: the pick first, then every older one passing the quick rule, newest first (what a
    reader tries next when reading the pick's data fails); ``skipped``: every step newer than the pick,
    newest first, with its reason; ``scanned``: every entry of the run directory (``_core.scan``'s
    dicts, ascending; with ``verify_all`` every committed one verified).
    """

    step: int | None
    path: str | None
    info: dict[str, Any] | None
    candidates: tuple[dict[str, Any], ...]
    skipped: tuple[Skipped, ...]
    scanned: tuple[dict[str, Any], ...]

    @property
    def steps(self) -> list[int]:
        """The candidates' steps, newest first."""
        return [int(c["step"]) for c in self.candidates]

    def why_not(self, limit: int = 3) -> str:
        """The skipped steps in one line (for an error message), or ''."""
        if not self.skipped:
            return ""
        more = len(self.skipped) - limit
        return "; ".join(f"step {k.step}: {k.reason}: {k.message}" for k in self.skipped[:limit]) + (
            f"; and {more} more" if more > 0 else "")


def pick(
    run_dir: str | os.PathLike[str],
    *,
    verify_data: bool = False,
    verify_all: bool = False,
    kind: str = "any",
    step: int | None = None,
    max_step: int | None = None,
    world_size: int | None = None,
    threads: int = DEFAULTS["read_threads"],
    progress: Callable[[int], None] | None = None,
    allow_unhealthy: bool = False,
) -> Pick:
    """Which checkpoint of ``run_dir`` a restore uses, and why not the newer ones: the one picker.

    The rule (docs/guarantees.md, "Which checkpoint a restore uses"): only ``step-N`` directories count
    (an attempt beside a committed step of the same number is irrelevant); newest first, within
    ``step`` (exactly) or ``max_step`` (at most); each must pass the quick check (manifest, shard
    footers and indexes, extra files), be of ``kind`` ("alpsck": Checkpointer's, "dcp": one that
    committed ``dcp-metadata.json``, "any"), have ``world_size`` ranks (None: any), unless
    ``allow_unhealthy`` have only finite metrics (what ``save(..., metrics=)`` recorded: a NaN or
    infinite loss is a diverged run's checkpoint, skipped as ``unhealthy``) and, with
    ``verify_data``, every chunk CRC (checked lazily, newest first, up to the first that passes).
    ``verify_all`` verifies every committed checkpoint (for a listing of them all).

    A missing ``run_dir`` raises NoCheckpointError; one this user may not list, CheckpointIOError saying so.
    """
    if kind not in KINDS:
        raise UsageError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    try:
        d = _core.pick(str(run_dir), verify_data=verify_data, verify_all=verify_all, kind=kind, step=step,
                       max_step=max_step, world_size=world_size or 0, threads=threads, progress=progress,
                       allow_unhealthy=allow_unhealthy)
    except CheckpointIOError as e:
        if e.errno == errno.ENOENT:
            raise NoCheckpointError(f"{run_dir}: no such directory, so no checkpoint") from None
        if e.errno in _ACCESS_ERRNOS:  # still a CheckpointIOError: restore_into's ranks report it as such
            raise CheckpointIOError(e.errno, f"{run_dir}: permission denied ({e.strerror or e}); run as the user "
                                    "who owns the run or fix its permissions") from None
        raise
    return Pick(step=d["step"], path=d["path"], info=d["info"], candidates=tuple(d["candidates"]),
                skipped=tuple(Skipped(**k) for k in d["skipped"]), scanned=tuple(d["scanned"]))


def data_error(info: dict[str, Any]) -> Skipped | None:
    """None if every chunk of every shard of a committed checkpoint matches its CRC, else why it is
    skipped (:func:`read_failure`: ``data_crc``, or ``unreadable`` when reading failed for a
    reason other than its bytes)."""
    try:
        for name in info["shards"]:
            open_shard(Path(info["path"]) / name).verify(DEFAULTS["read_threads"])
    except CheckpointError as e:
        return read_failure(info, e)
    return None


def remove_entries(run_dir: str | os.PathLike[str], names: Iterable[str]) -> tuple[list[int], CheckpointError | None]:
    """Removes these entries of ``run_dir`` through the run-directory unit (``RemoveEntries``,
    run_dir.h: renamed to ``.deleting-*``, RUN_DIR fsync'ed, deleted without following a symlink).
    Returns the indices of the names removed, and the error of the first failure (permission
    denied worded as :func:`_denied` words it) or None: the caller reports what went before raising."""
    removed, failure = _core.remove_entries(run_dir, list(names))
    if failure is None:
        return list(removed), None
    where, renaming, err, message = failure
    if err in (errno.EACCES, errno.EPERM):
        return list(removed), _denied(where, "cannot rename it" if renaming else "cannot delete it")
    return list(removed), CheckpointIOError(err, message) if err else CheckpointError(message)


def dir_bytes(path: Path) -> int:
    if path.is_symlink():  # removing it unlinks the link only: it frees nothing behind it
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total



# ----------------------------------------------------------------------------- the writer lock


def lock_run_dir(run_dir: Path, rank: int) -> _core.RunDirLock:
    """Take the run directory's writer lock for this process as ``rank`` (the core's RunDirLock:
    one writer per run directory, whatever kind; see cpp/core/run_dir.h). A live owner makes this
    raise RunDirLockedError naming its job, pid and host; a lock name that is a symlink or not a
    regular file, UsageError (it is never followed or opened). Keep the object while writing;
    ``release()`` (or dropping it) lets go."""
    me = {"pid": os.getpid(), "host": socket.gethostname(), "rank": rank, "job_id": JobEnv.detect().job_id}
    return _core.RunDirLock(str(run_dir), rank, json.dumps(me))


def _this_host(name: str) -> bool:
    here = socket.gethostname()
    return name in (here, here.split(".")[0], "localhost") or name.split(".")[0] == here.split(".")[0]


def lock_holder(run_dir: str | os.PathLike[str], *, others_only: bool = False) -> str | None:
    """Why the run directory's writer lock says a writer may be active (a message naming it), or None;
    ``others_only``: None too when the writer holding it is this process (an async save of its own in flight).

    A writer holds an ``flock`` on ``RUN_DIR/.lock`` while it writes and keeps its owner there
    (JSON ``{"pid", "host", "job_id"}``), emptying it on a clean close (the core's RunDirLock). So:
    no file or an empty one → no writer; an flock held → a writer on this host; content naming
    another host, whose flock may not be visible from here (Lustre without ``-o flock``), → refuse
    with advice; content of a process on this host that holds no flock → a crashed writer, stale.
    A lock name that is a symlink or not a regular file raises UsageError (never followed or opened).
    """
    def printable(value: object, limit: int) -> str:  # as it is, or escaped (repr) when it holds a control character
        return echo(value, limit, quoted=not str(value).isprintable())

    lock = Path(run_dir) / LOCK_NAME
    try:
        held, text = _core.probe_lock(str(run_dir), 0)
    except CheckpointIOError as e:
        if e.errno in _ACCESS_ERRNOS:
            raise _denied(lock, "cannot read the lock file") from None
        raise
    # The core's one parser of the record. Bytes that are not UTF-8 in it (a garbled or foreign file) are
    # read as U+FFFD: the record keeps its shape, and a host name it garbles is not this host.
    owner = _core.parse_lock_owner(core_text(text))
    host, job = printable(owner["host"], 200), printable(owner["job_id"], 100)
    who = f"pid {printable(owner['pid'], 40) or '?'}" + (f", job {job}" if job else "")
    if held:
        if others_only and owner["pid"] == str(os.getpid()) and (not host or _this_host(host)):
            return None
        return f"{lock}: a writer holds it ({who}{f' on {host}' if host else ''})"
    if host and not _this_host(host):
        return (f"{lock} names a writer on host {host} ({who}), which cannot be checked from {socket.gethostname()}; "
                f"remove {lock} if that job is gone")
    return None


@contextlib.contextmanager
def writer_lock(run_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the run directory's writer lock for the block (prune, an export into the run directory):
    they write too, and one writer at a time (RunDirLockedError naming the holder)."""
    lock = lock_run_dir(Path(run_dir), 0)
    try:
        yield
    finally:
        lock.release()


# ----------------------------------------------------------------------------- the .metadata marker

MARKER_FILE = _core.run_dir_names["dcp_marker"]
MARKER_FORMAT = "alpsck-dcp-checkpoint/1"
MARKER_BYTES = (json.dumps({"format": MARKER_FORMAT, "reader": "alpsck.dcp.AlpsckStorageReader",
                            "note": "written by alpsck; load with AlpsckStorageReader (docs/format.md)"},
                           indent=1) + "\n").encode()
MARKER_NAMES = (MARKER_FILE, MARKER_FILE + TEMP_SUFFIX)  # the entries the marker's writing uses




def marker_problem(path: Path) -> str | None:
    """Why the ``.metadata`` at ``path`` is not alpsck's marker (a FileSystemWriter checkpoint's
    pickle, say), or None: absent or alpsck's. Never unpickles anything."""
    try:
        data = read_small(path / MARKER_FILE, 4096)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path / MARKER_FILE} cannot be read ({e.strerror or e})"
    try:
        if json.loads(data).get("format") == MARKER_FORMAT:
            return None
    except (ValueError, AttributeError):
        pass
    what = "a pickle: a FileSystemWriter checkpoint" if data[:1] == b"\x80" else "not alpsck's"
    return f"{path / MARKER_FILE} is {what}"


def write_marker(path: Path) -> None:
    """Make ``path/.metadata`` alpsck's marker, durably (tmp file, fsync, rename, fsync of the directory)."""
    if marker_problem(path) is None and (path / MARKER_FILE).is_file():
        return
    tmp = path / MARKER_NAMES[1]
    fd = open_own(tmp)
    try:
        os.write(fd, MARKER_BYTES)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path / MARKER_FILE)
    fsync_path(path)


def is_marked(path: Path) -> bool:
    """A checkpoint directory AlpsckStorageWriter wrote (checkpoint-directory mode): it has alpsck's marker."""
    return (path / MARKER_NAMES[0]).is_file() and marker_problem(path) is None
