"""The run directory's writer lock: taking it (:func:`lock_run_dir`, :func:`writer_lock`; the core's
RunDirLock) and saying who holds it (:func:`lock_holder`)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from .. import _core
from ..errors import CheckpointIOError, echo
from ..job_env import JobEnv
from .names import LOCK_NAME, core_text
from .scan import ACCESS_ERRNOS, denied


def lock_run_dir(run_dir: Path, rank: int) -> _core.RunDirLock:
    """Take the run directory's writer lock for this process as ``rank`` (the core's RunDirLock:
    one writer per run directory, whatever kind; see cpp/core/run_dir_lock.h). A live owner makes this
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
        if e.errno in ACCESS_ERRNOS:
            raise denied(lock, "cannot read the lock file") from None
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
