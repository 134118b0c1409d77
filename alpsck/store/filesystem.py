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
from pathlib import Path

from .. import _core
from ..errors import CheckpointError, DiskFullError, UsageError
from .run_dir import entry_kind, is_committed_step_dir

KIND_ENV = "ALPSCK_FS_KIND"
# statfs f_type values (linux/magic.h and the file systems' own headers).
_MAGIC = {0x0BD00BD0: "lustre", 0x6969: "nfs", 0xEF53: "ext4", 0x58465342: "xfs", 0x01021994: "tmpfs",
          0x794C7630: "overlay", 0x9123683E: "btrfs", 0x65735546: "fuse", 0x2FC12FC1: "zfs", 0x47504653: "gpfs"}
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


def lfs(*args: str) -> str:
    """Runs ``lfs ARGS`` (an argument list: no shell) and returns its output; CheckpointError naming
    the command and what it said when it is missing, fails or hangs."""
    exe = shutil.which("lfs")
    if exe is None:
        raise CheckpointError(f"`lfs {' '.join(args)}`: the file system is Lustre but no `lfs` command is on PATH")
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=LFS_TIMEOUT_S, check=False,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"`lfs {shlex.join(args)}` did not answer within {LFS_TIMEOUT_S:.0f} s") from None
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip().splitlines()
        raise CheckpointError(f"`lfs {shlex.join(args)}` failed (exit {r.returncode})"
                              + (f": {said[-1]}" if said else ""))
    return r.stdout


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

    def __str__(self) -> str:
        if self.kind != "lustre":
            return f"{self.kind}: no layout (not Lustre)"
        return ("lustre: kept the layout set on it" if self.kept else
                f"lustre: set layout {shlex.join(self.set_args)}" if self.set_args else "lustre: layout left as it is")


def ensure_layout(run_dir: str | os.PathLike[str], setting: str, chunk_bytes: int) -> LayoutReport:
    """Gives ``run_dir`` (which exists) the layout of ``setting`` when it is on Lustre and has none
    of its own; no ``lfs`` call elsewhere, nor with ``none``. CheckpointError when ``lfs`` fails."""
    args = layout_args(setting, chunk_bytes)  # a bad setting is refused on every file system
    fs = kind(run_dir)
    if fs != "lustre" or not args:
        return LayoutReport(fs)
    if has_own_layout(lfs("getstripe", "-d", "--raw", str(run_dir))):
        return LayoutReport(fs, kept=True)
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


def _quota(run_dir: Path) -> Room | None:
    """The user's Lustre quota on the file system of ``run_dir`` (``lfs quota -q -u UID``): what
    its hard limits (else its soft ones) leave; None when it sets none."""
    out = lfs("quota", "-q", "-u", str(os.getuid()), str(run_dir))
    tokens = out.split()
    start = next((i for i, t in enumerate(tokens) if t.startswith("/")), None)
    if start is None or len(tokens) < start + 8:
        raise CheckpointError(f"`lfs quota -q -u {os.getuid()} {run_dir}`: cannot read its answer: {out.strip()!r}")

    def num(t: str) -> int:
        t = t.rstrip("*")  # over quota
        if not t.isdigit():
            raise CheckpointError(f"`lfs quota -q -u {os.getuid()} {run_dir}`: {t!r} is not a number: {out.strip()!r}")
        return int(t)

    kbytes, kquota, klimit = (num(t) for t in tokens[start + 1:start + 4])
    files, fquota, flimit = (num(t) for t in tokens[start + 5:start + 8])
    blimit = klimit or kquota
    ilimit = flimit or fquota
    if not blimit and not ilimit:
        return None
    return Room(max(0, blimit - kbytes) * 1024 if blimit else None, max(0, ilimit - files) if ilimit else None,
                f"the user's Lustre quota (`lfs quota -u {os.getuid()}`: {kbytes * 1024} of {blimit * 1024 or '-'} "
                f"bytes, {files} of {ilimit or '-'} inodes used)")


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
    Lustre the user's quota. ``fs``: :func:`kind` of it, when the caller has it."""
    path = Path(run_dir)
    st = os.statvfs(path)
    found = [Room(st.f_bavail * st.f_frsize, st.f_favail if st.f_files else None,
                  f"the file system's free space (statvfs {path})")]
    if (fs or kind(path)) == "lustre":
        quota = _quota(path)
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
    full target fails a write with ENOSPC however much the file system has free)."""
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
    targets = _targets(path)
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


def purge_days(path: str | os.PathLike[str]) -> int | None:
    """The purge window of the scratch holding ``path``, from its name (``/capstor/...`` 30 days,
    ``/iopsstor/...`` 14), or None where none is known."""
    parts = Path(os.path.realpath(path)).parts
    return next((days for name, days in PURGE_DAYS.items() if name in parts), None)


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

