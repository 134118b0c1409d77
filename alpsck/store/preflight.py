"""The pre-flight (:func:`preflight`): before the first save of a start, and when a save grows, rank 0
checks that what retention will hold fits, bytes and inodes: ``statvfs`` everywhere, the user's
``lfs quota`` and the free space of the storage targets (``lfs df``) on Lustre (:mod:`alpsck.store.lustre`).
A save that cannot fit fails before it writes a byte, with the numbers. Where ``lfs`` cannot run, only
statvfs is checked (one warning per process)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DiskFullError
from .filesystem import kind
from .lustre import LfsUnavailable, Room, quota_room, warn_lfs_unavailable
from .lustre import targets as lustre_targets
from .names import entry_kind

_MiB = 1 << 20


def rooms(run_dir: str | os.PathLike[str], fs: str | None = None) -> list[Room]:
    """Every limit on what ``run_dir`` can still take: the file system's free space (statvfs); on a tmpfs
    (the memory tier) the node's available memory; and on Lustre the user's quota (skipped, with the
    once-per-process warning, where ``lfs`` cannot run).
    ``fs``: :func:`kind` of it, when the caller has it."""
    path = Path(run_dir)
    st = os.statvfs(path)
    found = [Room(st.f_bavail * st.f_frsize, st.f_favail if st.f_files else None,
                  f"the file system's free space (statvfs {path})")]
    fs = fs or kind(path)
    if fs == "tmpfs":  # its pages are the node's memory, which the training needs too: /dev/shm's size is no promise
        available = mem_available()
        if available is not None:
            found.append(Room(available, None, "the node's available memory (MemAvailable in /proc/meminfo, which "
                                               "a tmpfs's pages come out of)"))
    if fs == "lustre":
        try:
            quota = quota_room(path)
        except LfsUnavailable as e:
            warn_lfs_unavailable(path, e)
            quota = None
        if quota is not None:
            found.append(quota)
    return found


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of the memory new allocations can take without swapping, in bytes (None: unknown)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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
        targets = lustre_targets(path)
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


def preflight_refusal(run_dir: Path, shard_bytes: int, world_size: int, keep: int, checked: int) -> tuple[str, int]:
    """Rank 0's pre-flight of a save whose shard is ``shard_bytes`` (the Checkpointer's ``preflight``): why it
    must not start ('' when it may), and the shard size checked now (``checked``, the last one, when this
    save did not grow by more than a tenth and was not checked again)."""
    if checked and shard_bytes <= checked * 1.1:
        return "", checked
    try:
        preflight(run_dir, checkpoint_bytes=shard_bytes * world_size, checkpoint_files=checkpoint_files(world_size),
                  keep=keep, estimate=f"rank 0's shard of {shard_bytes} bytes times {world_size} rank(s)")
    except DiskFullError as e:
        return str(e), checked
    return "", shard_bytes
