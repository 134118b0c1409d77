"""Which of Alps' storage a path is on (:func:`storage`: Capstor, Iopsstor, Ritom, home, temporary or
local), its purge window (:func:`purge_days`), why it is a poor place for checkpoints if it is, and
whether a run's newest checkpoint comes near the purge (:func:`purge_warning`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

from .. import _core
from .filesystem import kind
from .names import is_committed_step_dir

# Days without access after which CSCS purges a scratch file, by file system (a path component).
PURGE_DAYS = {"capstor": 30, "iopsstor": 14}
PURGE_MARGIN_DAYS = 7  # warn this long before
# Alps' storage, named by a component of the resolved path (/capstor/scratch/cscs/$USER, ...).
ALPS_STORAGE = {"capstor": "Capstor", "iopsstor": "Iopsstor", "ritom": "Ritom"}
CHECKPOINT_SCRATCH = "/capstor/scratch/cscs/$USER"  # where CSCS advises checkpoints to go
HOME_QUOTA = "50 GB and 500k inodes"  # Alps home, per user (NFS)
NETWORK_KINDS = frozenset({"nfs", "lustre", "gpfs", "cifs", "smb2", "ceph"})
MEMORY_KINDS = frozenset({"tmpfs", "ramfs"})
TMP_DIRS = ("/tmp", "/dev/shm")  # node-local and temporary wherever they are
_KIND_NAMES = {"lustre": "Lustre", "nfs": "NFS", "gpfs": "GPFS", "cifs": "CIFS", "smb2": "SMB", "ceph": "Ceph"}


def _alps_area(parts: tuple[str, ...]) -> tuple[str, str] | None:
    """(storage, the component after it: ``scratch``, ``store``, ...) of the first Alps storage name
    among ``parts``, or None."""
    for i, part in enumerate(parts):
        if part in ALPS_STORAGE:
            return part, parts[i + 1] if i + 1 < len(parts) else ""
    return None


def purge_days(path: str | os.PathLike[str]) -> int | None:
    """The purge window of the scratch holding ``path``, from its name (``/capstor/...`` 30 days,
    ``/iopsstor/...`` 14; not a project store, ``/capstor/store/...``), or None where none is known."""
    area = _alps_area(Path(os.path.realpath(path)).parts)
    if area is None or area[1] == "store":
        return None
    return PURGE_DAYS.get(area[0])


@dataclasses.dataclass(frozen=True)
class Storage:
    """Which storage a run directory is on (:func:`storage`), and whether it is a good place for
    checkpoints. ``warning`` is one line without the path: callers name the path."""

    name: str  # "capstor", "iopsstor", "ritom", "home", "tmp", "local" or the file system's kind
    kind: str  # kind(path): lustre, nfs, ext4, ...
    purge_days: int | None  # days without access after which CSCS purges it, None if not purged
    warning: str | None  # one line: why this is a poor place for checkpoints and what to do; None when fine
    needs_opt_in: bool  # a run dir under $HOME on a network file system (Alps home: NFS, 50 GB, 500k inodes)

    def describe(self) -> str:
        """One line: ``Capstor scratch (Lustre), purged after 30 days without access``."""
        fs = _KIND_NAMES.get(self.kind, self.kind)
        purge = f", purged after {self.purge_days} days without access" if self.purge_days else ""
        if self.name in ALPS_STORAGE:
            label = ALPS_STORAGE[self.name]
            if self.name == "ritom":
                return f"{label} scratch ({'VAST over NFS' if self.kind == 'nfs' else fs}){purge}"
            if self.kind != "lustre":  # the path names Capstor or Iopsstor, which is not mounted on this machine
                fs = "Lustre on Alps; not mounted here"
            if self.purge_days is None:
                return f"{label}, not scratch ({fs}), not purged"
            return f"{label} scratch ({fs}){purge}"
        if self.name == "home":
            return f"home directory ({fs}" + (f", a {HOME_QUOTA} quota)" if self.needs_opt_in else ")")
        if self.name == "tmp":
            return f"temporary storage ({fs})"
        if self.name == "local":
            return f"local disk ({fs})"
        return f"{fs} file system{purge}"


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def storage(path: str | os.PathLike[str]) -> Storage:
    """Which storage ``path`` (or, where it does not exist yet, its nearest existing parent) is on,
    from its resolved path and :func:`kind`, in this order: Alps' Capstor, Iopsstor and Ritom (by
    path component: Iopsstor, ``$SCRATCH`` on Clariden and Bristen, warns of its 14-day purge);
    memory (tmpfs, ramfs) or under /tmp or /dev/shm (warns: gone with the node or the job); under
    the real ``$HOME`` (a network file system there needs an opt-in and warns of home's quota; a
    laptop's local disk is fine); a local disk; else the file system's kind."""
    real = os.path.realpath(path)
    fs = kind(real)
    days = purge_days(real)
    area = _alps_area(Path(real).parts)
    if area is not None:
        name = area[0]
        warning = None
        if name == "iopsstor" and days is not None:
            warning = (f"Iopsstor ($SCRATCH on Clariden and Bristen) purges files after {days} days without access "
                       f"and is meant for data sets: CSCS advises {CHECKPOINT_SCRATCH} for checkpoints (purged after "
                       f"{PURGE_DAYS['capstor']} days without access)")
        return Storage(name, fs, days, warning, False)
    home = os.path.realpath(os.path.expanduser("~"))
    at_home = home != os.sep and _under(real, home)
    if fs in MEMORY_KINDS or (not at_home and any(_under(real, os.path.realpath(t)) for t in TMP_DIRS)):
        return Storage("tmp", fs, None, "temporary storage does not survive the job or the node: a requeued job would "
                       f"find no checkpoint; put the run dir on persistent storage (on Alps {CHECKPOINT_SCRATCH})",
                       False)
    if at_home:
        if fs in NETWORK_KINDS:
            return Storage("home", fs, None, f"$HOME is {_KIND_NAMES.get(fs, fs)} with a {HOME_QUOTA} quota for all "
                           "your files; it is not purged, but checkpoints fill it and load a file system every login "
                           f"shares: put the run dir on {CHECKPOINT_SCRATCH} (copy checkpoints to keep with `alpsck "
                           "promote`)", True)
        return Storage("home", fs, None, None, False)
    if fs not in NETWORK_KINDS and fs != "fuse" and not fs.startswith("0x"):
        return Storage("local", fs, None, None, False)
    return Storage(fs, fs, None, None, False)


def newest_committed(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest ``step-N`` directory holding a manifest, found by names and lstat alone: reading a
    checkpoint (as the picker does) would reset the access time the purge goes by."""
    steps = []
    with contextlib.suppress(OSError):
        for name in os.listdir(run_dir):
            kind_, step, _ = _core.parse_run_dir_name(name)
            if kind_ == "step":
                steps.append((step, Path(run_dir) / name))
    return next((path for _, path in sorted(steps, reverse=True) if is_committed_step_dir(path)), None)


def last_access(checkpoint: str | os.PathLike[str]) -> float:
    """When the checkpoint's files were last read or written (the newest atime or mtime: purge goes
    by access, and a read resets it). lstat only: nothing is read, so nothing is reset."""
    newest = 0.0
    for entry in os.scandir(checkpoint):
        with contextlib.suppress(OSError):
            st = entry.stat(follow_symlinks=False)
            newest = max(newest, st.st_atime, st.st_mtime)
    return newest


def purge_warning(checkpoint: str | os.PathLike[str], days: int, now: float) -> str | None:
    """A warning when the checkpoint comes within PURGE_MARGIN_DAYS of ``days`` without access."""
    idle = (now - last_access(checkpoint)) / 86400
    if idle < days - PURGE_MARGIN_DAYS:
        return None
    left = days - idle
    when = f"in about {left:.0f} day(s)" if left >= 1 else "any time now"
    return (f"the newest checkpoint {checkpoint} was last accessed {idle:.0f} day(s) ago; this scratch purges files "
            f"after {days} days without access, so it may go {when}: copy it to a persistent store with `alpsck "
            "promote RUN_DIR DEST` (reading it also resets the clock)")
