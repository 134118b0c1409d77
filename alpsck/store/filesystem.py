"""The file system under a run directory: what it is, and on Lustre its layout, quota and targets.

Alps' scratch is Lustre (Capstor, Iopsstor) or VAST over NFS (Ritom), and home is NFS. What users
share there is metadata, so alpsck asks ``statfs`` what a run directory lies on (:func:`kind`)
before it makes any Lustre call, and calls the ``lfs`` command (never through a shell) only on
Lustre:

- **Layout** (:func:`ensure_layout`): a run directory without a layout of its own gets one, which
  every checkpoint directory and shard made in it inherits: CSCS's progressive layout (one stripe
  up to 4 MiB, 4 up to 64 MiB, then 32) with the last stripe size matched to the engine's chunk
  (``lustre_layout="auto"``), the ``lfs setstripe`` options given instead, or nothing (``"none"``).
  A layout the user set (on the run directory, or inherited from the directory it was made in) is
  kept.
- **Pre-flight** (:func:`preflight`): before the first save of a start, and when a save grows,
  rank 0 checks that what retention will hold fits, bytes and inodes: ``statvfs`` everywhere, the
  user's ``lfs quota`` and the free space of the storage targets (``lfs df``) on Lustre. A save that
  cannot fit fails before it writes a byte, with the numbers.
- **No lfs** (:class:`LfsUnavailable`: not on PATH, or it cannot run, as in a container image
  without Lustre's client tools): the layout, quota and targets steps are skipped with one
  warning per process; saves go on (statvfs still checks). An ``lfs`` that runs and fails is an
  error, as before: it says something about the file system.
- **Where** (:func:`storage`): which of Alps' storage a path is on (Capstor, Iopsstor, Ritom, home,
  temporary or local), its purge window, and why it is a poor place for checkpoints, if it is.

``ALPSCK_FS_KIND`` (``lustre``, ``nfs`` or any other name) overrides what ``statfs`` says: for a
file system it misreports (a bind or FUSE mount of Lustre), and for the tests, which run the same
code against a stand-in ``lfs`` (Lustre cannot run on a test machine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

from .. import _core
from ..errors import CheckpointError, DiskFullError, UsageError
from .names import entry_kind, is_committed_step_dir

KIND_ENV = "ALPSCK_FS_KIND"
# statfs f_type values (linux/magic.h and the file systems' own headers).
_MAGIC = {0x0BD00BD0: "lustre", 0x6969: "nfs", 0xEF53: "ext4", 0x58465342: "xfs", 0x01021994: "tmpfs",
          0x794C7630: "overlay", 0x9123683E: "btrfs", 0x65735546: "fuse", 0x2FC12FC1: "zfs", 0x47504653: "gpfs",
          0x858458F6: "ramfs", 0xFF534D42: "cifs", 0xFE534D42: "smb2", 0x00C36400: "ceph"}
LAYOUTS = ("auto", "none")  # the named settings of lustre_layout; anything else is lfs setstripe options
LFS_TIMEOUT_S = 120.0
_MiB = 1 << 20


def kind(path: str | os.PathLike[str]) -> str:
    """What the file system holding ``path`` (or its nearest existing parent) is: ``lustre``,
    ``nfs``, ``ext4``, ... or its statfs magic in hex; ``ALPSCK_FS_KIND`` overrides it."""
    forced = os.environ.get(KIND_ENV, "").strip()
    if forced:
        return forced.lower()
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    magic = int(_core.fs_magic(str(p)))
    return _MAGIC.get(magic, f"0x{magic:x}")


# ----------------------------------------------------------------------------- the lfs command


class LfsUnavailable(CheckpointError):
    """``lfs`` cannot run here: not on PATH, or not executable (a container image without Lustre's
    client tools, or a host binary mounted in without its libraries)."""


def lfs(*args: str) -> str:
    """Runs ``lfs ARGS`` (an argument list: no shell) and returns its output; LfsUnavailable when it
    is missing or cannot run (exit 126 or 127: the shell's "cannot execute" and "not found"), and
    CheckpointError naming the command and what it said when it fails or hangs."""
    exe = shutil.which("lfs")
    if exe is None:
        raise LfsUnavailable("no `lfs` command is on PATH (a container image without Lustre's client tools?)")
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=LFS_TIMEOUT_S, check=False,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"`lfs {shlex.join(args)}` did not answer within {LFS_TIMEOUT_S:.0f} s") from None
    except OSError as e:
        raise LfsUnavailable(f"`{exe}` cannot run ({e.strerror or e})") from None
    said = (r.stderr or r.stdout).strip().splitlines()
    if r.returncode in (126, 127):
        raise LfsUnavailable(f"`{exe}` cannot run (exit {r.returncode}" + (f": {said[-1]})" if said else ")"))
    if r.returncode != 0:
        raise CheckpointError(f"`lfs {shlex.join(args)}` failed (exit {r.returncode})"
                              + (f": {said[-1]}" if said else ""))
    return r.stdout


_lfs_warned = False  # whether this process has warned that lfs is unavailable (once per process)
_lfs_warned_lock = threading.Lock()


def warn_lfs_unavailable(run_dir: str | os.PathLike[str], why: LfsUnavailable) -> None:
    """The one warning per process that ``run_dir`` is on Lustre but ``lfs`` cannot run: what alpsck
    then skips, and what to do."""
    global _lfs_warned
    with _lfs_warned_lock:
        if _lfs_warned:
            return
        _lfs_warned = True
    warnings.warn(f"{run_dir} is on Lustre but {why}: alpsck neither sets its Lustre layout nor checks the Lustre "
                  "quota and storage targets before saves (statvfs still checks free space); saves go on. Run "
                  "where `lfs` works (the host, or mount it into the container) to have them", RuntimeWarning,
                  stacklevel=3)


# ----------------------------------------------------------------------------- layout


def layout_problem(setting: object) -> str | None:
    """Why ``setting`` is not a valid ``lustre_layout`` (``auto``, ``none``, or ``lfs setstripe``
    options such as ``-c 8 -S 4M``), or None."""
    if not isinstance(setting, str):
        return f"{setting!r}: must be 'auto', 'none' or lfs setstripe options (a string)"
    if setting in LAYOUTS:
        return None
    try:
        args = shlex.split(setting)
    except ValueError as e:
        return f"{setting!r}: {e}"
    if not args or not args[0].startswith("-"):
        return f"{setting!r}: must be 'auto', 'none' or lfs setstripe options starting with '-' (e.g. '-c 8 -S 4M')"
    if any("\0" in a for a in args):
        return f"{setting!r}: contains a NUL character"
    return None


def layout_args(setting: str, chunk_bytes: int) -> list[str]:
    """The ``lfs setstripe`` options of ``setting`` (UsageError when it is not valid; [] for none).

    ``auto``: CSCS's progressive layout, ``-E 4M -c 1 -E 64M -c 4 -E -1 -c 32 -S <S>``, with S the
    engine's chunk (a writer thread writes one chunk at a time, so each write goes to one target),
    as a power of two between 1 MiB and 64 MiB (Lustre wants a multiple of 64 KiB that divides the
    component's start, 64 MiB)."""
    why = layout_problem(setting)
    if why is not None:
        raise UsageError(f"lustre_layout: {why}")
    if setting == "none":
        return []
    if setting != "auto":
        return shlex.split(setting)
    stripe = _MiB
    while stripe * 2 <= min(max(chunk_bytes, _MiB), 64 * _MiB):
        stripe *= 2
    return ["-E", "4M", "-c", "1", "-E", "64M", "-c", "4", "-E", "-1", "-c", "32", "-S", f"{stripe // _MiB}M"]


def has_own_layout(getstripe: str) -> bool:
    """Whether ``lfs getstripe -d --raw DIR`` shows a layout set on DIR (or copied to it from its
    parent when it was made): a composite one, or a stripe count or size other than 0 (``--raw``
    shows 0 where the file system's default applies)."""
    if re.search(r"lcm_entry_count|components:", getstripe):
        return True
    values = re.findall(r"(?:stripe_count|stripe_size):\s*(-?\d+)", getstripe)
    return any(int(v) != 0 for v in values)


@dataclasses.dataclass(frozen=True)
class LayoutReport:
    """What :func:`ensure_layout` found and did."""

    kind: str
    set_args: tuple[str, ...] = ()  # the lfs setstripe options it set ([] when it set none)
    kept: bool = False  # the directory had a layout of its own
    unavailable: str = ""  # why lfs could not run (nothing was set), or ''

    def __str__(self) -> str:
        if self.kind != "lustre":
            return f"{self.kind}: no layout (not Lustre)"
        if self.unavailable:
            return f"lustre: no layout set ({self.unavailable})"
        return ("lustre: kept the layout set on it" if self.kept else
                f"lustre: set layout {shlex.join(self.set_args)}" if self.set_args else "lustre: layout left as it is")


def ensure_layout(run_dir: str | os.PathLike[str], setting: str, chunk_bytes: int) -> LayoutReport:
    """Gives ``run_dir`` (which exists) the layout of ``setting`` when it is on Lustre and has none
    of its own; no ``lfs`` call elsewhere, nor with ``none``. CheckpointError when ``lfs`` fails;
    when it cannot run at all (:class:`LfsUnavailable`), a warning (once per process) and nothing set."""
    args = layout_args(setting, chunk_bytes)  # a bad setting is refused on every file system
    fs = kind(run_dir)
    if fs != "lustre" or not args:
        return LayoutReport(fs)
    try:
        if has_own_layout(lfs("getstripe", "-d", "--raw", str(run_dir))):
            return LayoutReport(fs, kept=True)
    except LfsUnavailable as e:
        warn_lfs_unavailable(run_dir, e)
        return LayoutReport(fs, unavailable=str(e))
    lfs("setstripe", *args, str(run_dir))
    return LayoutReport(fs, set_args=tuple(args))


def describe_layout(run_dir: str | os.PathLike[str]) -> str | None:
    """The run directory's layout in one line (``lfs getstripe -d``) on Lustre, else None."""
    if kind(run_dir) != "lustre":
        return None
    return " ".join(lfs("getstripe", "-d", str(run_dir)).split()) or "(the file system's default)"


# ----------------------------------------------------------------------------- room and pre-flight


@dataclasses.dataclass(frozen=True)
class Room:
    """What one limit leaves: bytes and inodes (None: no limit of that kind), and where it comes from."""

    bytes: int | None
    inodes: int | None
    source: str


@dataclasses.dataclass(frozen=True)
class Quota:
    """The user's Lustre quota on one file system (``lfs quota``): what is used, and the hard limit
    (else the soft one; None where neither is set), in bytes and inodes."""

    used_bytes: int
    limit_bytes: int | None
    used_inodes: int
    limit_inodes: int | None


def lustre_quota(path: str | os.PathLike[str]) -> Quota:
    """The user's Lustre quota on the file system of ``path`` (which exists): ``lfs quota -q -u UID``.
    CheckpointError (LfsUnavailable where lfs cannot run) when it cannot be read."""
    out = lfs("quota", "-q", "-u", str(os.getuid()), str(path))
    tokens = out.split()
    start = next((i for i, t in enumerate(tokens) if t.startswith("/")), None)
    if start is None or len(tokens) < start + 8:
        raise CheckpointError(f"`lfs quota -q -u {os.getuid()} {path}`: cannot read its answer: {out.strip()!r}")

    def num(t: str) -> int:
        t = t.rstrip("*")  # over quota
        if not t.isdigit():
            raise CheckpointError(f"`lfs quota -q -u {os.getuid()} {path}`: {t!r} is not a number: {out.strip()!r}")
        return int(t)

    kbytes, kquota, klimit = (num(t) for t in tokens[start + 1:start + 4])
    files, fquota, flimit = (num(t) for t in tokens[start + 5:start + 8])
    blimit, ilimit = klimit or kquota, flimit or fquota
    return Quota(kbytes * 1024, blimit * 1024 or None, files, ilimit or None)


def _quota(run_dir: Path) -> Room | None:
    """What the user's Lustre quota on the file system of ``run_dir`` leaves; None when it sets none."""
    q = lustre_quota(run_dir)
    if q.limit_bytes is None and q.limit_inodes is None:
        return None
    return Room(max(0, q.limit_bytes - q.used_bytes) if q.limit_bytes is not None else None,
                max(0, q.limit_inodes - q.used_inodes) if q.limit_inodes is not None else None,
                f"the user's Lustre quota (`lfs quota -u {os.getuid()}`: {q.used_bytes} of {q.limit_bytes or '-'} "
                f"bytes, {q.used_inodes} of {q.limit_inodes or '-'} inodes used)")


def _targets(run_dir: Path) -> list[tuple[str, int]]:
    """Each active storage target (OST) of the file system and its free bytes (``lfs df``)."""
    found = []
    for line in lfs("df", str(run_dir)).splitlines():
        t = line.split()
        if len(t) >= 6 and "[OST:" in t[-1] and t[3].isdigit():
            found.append((t[0], int(t[3]) * 1024))
    return found


def rooms(run_dir: str | os.PathLike[str], fs: str | None = None) -> list[Room]:
    """Every limit on what ``run_dir`` can still take: the file system's free space (statvfs), and on
    Lustre the user's quota (skipped, with the once-per-process warning, where ``lfs`` cannot run).
    ``fs``: :func:`kind` of it, when the caller has it."""
    path = Path(run_dir)
    st = os.statvfs(path)
    found = [Room(st.f_bavail * st.f_frsize, st.f_favail if st.f_files else None,
                  f"the file system's free space (statvfs {path})")]
    if (fs or kind(path)) == "lustre":
        try:
            quota = _quota(path)
        except LfsUnavailable as e:
            warn_lfs_unavailable(path, e)
            quota = None
        if quota is not None:
            found.append(quota)
    return found


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / _MiB:.1f} MiB"


def preflight(run_dir: str | os.PathLike[str], *, checkpoint_bytes: int, checkpoint_files: int, keep: int,
              estimate: str = "", stripes: int = 32) -> None:
    """DiskFullError, with the numbers, when ``keep`` checkpoints of ``checkpoint_bytes`` and
    ``checkpoint_files`` inodes each do not fit beside what ``run_dir`` holds: checkpoints it holds
    (committed, and expired ones kept for reuse) count as room already taken by the run. On Lustre
    the bytes must also fit the storage targets: the new bytes spread over ``stripes`` targets (at
    most as many as there are), and fewer targets than that with room for their share fails too (a
    full target fails a write with ENOSPC however much the file system has free). Where ``lfs``
    cannot run, only statvfs is checked (one warning per process)."""
    path = Path(run_dir)
    held = sum(1 for n in os.listdir(path) if entry_kind(n) in ("step", "free"))  # one readdir
    more = max(0, keep - held)
    need_bytes, need_inodes = more * checkpoint_bytes, more * checkpoint_files
    if more == 0:
        return
    what = (f"{path}: pre-flight: this run holds up to {keep} checkpoint(s) of about {_size(checkpoint_bytes)} and "
            f"{checkpoint_files} inodes each{f' ({estimate})' if estimate else ''}; beside the {held} it holds now it "
            f"needs {_size(need_bytes)} ({need_bytes} bytes) and {need_inodes} inodes more")
    fs = kind(path)
    for room in rooms(path, fs):
        short_bytes = room.bytes is not None and room.bytes < need_bytes
        short_inodes = room.inodes is not None and room.inodes < need_inodes
        if short_bytes or short_inodes:
            left = (f"{_size(room.bytes)} ({room.bytes} bytes)" if room.bytes is not None else "unlimited bytes") + \
                   f" and {room.inodes if room.inodes is not None else 'unlimited'} inodes"
            raise DiskFullError(f"{what}, but {room.source} leaves {left}. Free space, raise the quota, lower "
                                "keep_last, or turn the pre-flight check off (preflight=False; checkpoint.preflight: "
                                "false in a job config)")
    if fs != "lustre":
        return
    try:
        targets = _targets(path)
    except LfsUnavailable as e:
        warn_lfs_unavailable(path, e)
        return
    if not targets:
        return
    wanted = min(stripes, len(targets))
    share = -(-need_bytes // wanted)
    roomy = [t for t in targets if t[1] >= share]
    if len(roomy) < wanted:
        full = sorted((t for t in targets if t[1] < share), key=lambda t: t[1])
        raise DiskFullError(f"{what}, spread over {wanted} storage target(s) ({_size(share)} each), but only "
                            f"{len(roomy)} of the {len(targets)} have that much free (`lfs df`): "
                            + ", ".join(f"{name} {_size(free)}" for name, free in full[:8])
                            + (f" and {len(full) - 8} more" if len(full) > 8 else "")
                            + ". A full target fails the write with ENOSPC whatever the total free space: "
                            "choose a layout with fewer stripes (lustre_layout) or free space")


def checkpoint_files(world_size: int) -> int:
    """Inodes one checkpoint takes: its directory, one shard per rank and the manifest."""
    return 2 + world_size


# ----------------------------------------------------------------------------- purge


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

