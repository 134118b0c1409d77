"""Lustre under a run directory, through the ``lfs`` command (never through a shell), called only where
:func:`alpsck.store.filesystem.kind` says Lustre:

- **Layout** (:func:`ensure_layout`): a run directory without a layout of its own gets one, which
  every checkpoint directory and shard made in it inherits: CSCS's progressive layout (one stripe
  up to 4 MiB, 4 up to 64 MiB, then 32) with the last stripe size matched to the engine's chunk
  (``lustre_layout="auto"``), the ``lfs setstripe`` options given instead, or nothing (``"none"``).
  A layout the user set (on the run directory, or inherited from the directory it was made in) is
  kept.
- **Quota and targets** (:func:`lustre_quota`, :func:`quota_room`, :func:`targets`): what the
  pre-flight (:mod:`alpsck.store.preflight`) checks beside statvfs.
- **No lfs** (:class:`LfsUnavailable`: not on PATH, or it cannot run, as in a container image
  without Lustre's client tools): the layout, quota and targets steps are skipped with one
  warning per process; saves go on (statvfs still checks). An ``lfs`` that runs and fails is an
  error, as before: it says something about the file system.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

from ..errors import CheckpointError, UsageError
from .filesystem import kind

LAYOUTS = ("auto", "none")  # the named settings of lustre_layout; anything else is lfs setstripe options
LFS_TIMEOUT_S = 120.0
_MiB = 1 << 20


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


def layout_for_run(run_dir: Path, setting: str, chunk_bytes: int, stacklevel: int = 2) -> LayoutReport | None:
    """The Checkpointer's layout step (:func:`ensure_layout`): lfs failing is a warning for the automatic
    layout (the checkpoints are as safe without it) and an error (UsageError) for one the user gave; an lfs
    that cannot run at all is ensure_layout's one warning for either."""
    try:
        return ensure_layout(run_dir, setting, chunk_bytes)
    except CheckpointError as e:
        if setting != "auto":
            raise UsageError(f"lustre_layout {setting!r}: {e}") from None
        warnings.warn(f"{run_dir}: the Lustre layout was not set: {e}", RuntimeWarning, stacklevel=stacklevel)
        return None


# ----------------------------------------------------------------------------- quota and targets


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


def quota_room(run_dir: Path) -> Room | None:
    """What the user's Lustre quota on the file system of ``run_dir`` leaves; None when it sets none."""
    q = lustre_quota(run_dir)
    if q.limit_bytes is None and q.limit_inodes is None:
        return None
    return Room(max(0, q.limit_bytes - q.used_bytes) if q.limit_bytes is not None else None,
                max(0, q.limit_inodes - q.used_inodes) if q.limit_inodes is not None else None,
                f"the user's Lustre quota (`lfs quota -u {os.getuid()}`: {q.used_bytes} of {q.limit_bytes or '-'} "
                f"bytes, {q.used_inodes} of {q.limit_inodes or '-'} inodes used)")


def targets(run_dir: Path) -> list[tuple[str, int]]:
    """Each active storage target (OST) of the file system and its free bytes (``lfs df``)."""
    found = []
    for line in lfs("df", str(run_dir)).splitlines():
        t = line.split()
        if len(t) >= 6 and "[OST:" in t[-1] and t[3].isdigit():
            found.append((t[0], int(t[3]) * 1024))
    return found
