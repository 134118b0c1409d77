"""The Python side's file primitives for a run directory: fsync by path, opening a file of
alpsck's own for writing (the same rules as the core's OpenMaybeDirect, cpp/core/file_io.cc),
reading a small file (also without following symlinks, or only inside a directory), creating
directories durably, and THE durable small-file write: :func:`replace_durably` (a whole file: temp
file, fsync, rename, fsync of the directory; its halves :func:`write_temp` and :func:`rename_durably`
for a caller that overlaps the first with other work) and :func:`append_durably` (a line of a log). Every
small file the Python side writes durably goes through one of these two."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from .names import temp_name


def _fsync(path: str | os.PathLike[str]) -> None:
    fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync the file or directory at ``path``; raises OSError if it cannot be opened or synced."""
    _fsync(path)


def open_own(path: str | os.PathLike[str], *, append: bool = False) -> int:
    """Open ``path`` for writing as a file of alpsck's own and return the descriptor.

    Never through a symlink (O_NOFOLLOW), never a FIFO or a device (O_NONBLOCK, then a type
    check; OSError EINVAL names the kind), never a file hard-linked elsewhere or owned by someone
    else: for a write from the start such a name is replaced by a new file (the other name keeps
    its bytes); for an append (a log that must keep its lines) it is refused. Truncates only after
    the checks."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    for attempt in range(2):
        try:
            fd = os.open(path, flags | (os.O_EXCL if attempt else 0), 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "a symbolic link: alpsck never writes through one", str(path)) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file: alpsck writes only its own files", str(path))
        if st.st_nlink == 1 and st.st_uid == os.geteuid():
            if not append:
                os.ftruncate(fd, 0)
            return fd
        os.close(fd)
        if append:
            raise OSError(errno.EPERM, "linked elsewhere too, or not ours: alpsck will not append to it", str(path))
        os.unlink(path)
    raise OSError(errno.EEXIST, "replaced while alpsck opened it", str(path))


def open_regular(path: str | os.PathLike[str], *, follow: bool = True, dir_fd: int | None = None) -> int:
    """Open ``path`` (relative to ``dir_fd`` if given) read-only if it is a regular file and return
    the descriptor. A FIFO or a device there is OSError EINVAL, never a hang (O_NONBLOCK, then a
    type check); with ``follow=False`` a symlink is OSError ELOOP (O_NOFOLLOW)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def read_at(fd: int, offset: int, n: int) -> bytes:
    """Up to ``n`` bytes of ``fd`` from ``offset`` (fewer only at its end)."""
    chunks = []
    while n > 0:
        b = os.pread(fd, min(n, 1 << 20), offset)
        if not b:
            break
        chunks.append(b)
        offset += len(b)
        n -= len(b)
    return b"".join(chunks)


def _read_fd(fd: int, limit: int, tail: bool) -> bytes:
    size = os.fstat(fd).st_size
    return read_at(fd, max(0, size - limit), limit) if tail else read_at(fd, 0, limit + 1)


def read_small(path: str | os.PathLike[str], limit: int, *, tail: bool = False, follow: bool = True) -> bytes:
    """The bytes of a small file of the run directory, at most ``limit + 1`` of them (a caller
    that gets more knows the file is over its limit), or with ``tail`` its last ``limit`` bytes.
    A FIFO or a device there is OSError EINVAL, never a hang. Symlinks are followed unless
    ``follow=False`` (then a symlink is OSError ELOOP)."""
    fd = open_regular(path, follow=follow)
    try:
        return _read_fd(fd, limit, tail)
    finally:
        os.close(fd)


def read_small_inside(root: str | os.PathLike[str], parts: tuple[str, ...], limit: int, *, tail: bool = False) -> bytes:
    """:func:`read_small` of ``root/parts[0]/.../parts[-1]`` where nothing below ``root`` is followed:
    each directory in ``parts`` and the file are opened with O_NOFOLLOW, each relative to the one
    before, so what is read lies inside ``root`` (a symlink on the way is OSError ELOOP, a part
    that is empty, ``.``, ``..`` or holds a ``/`` is OSError EINVAL). A file with more than one link is
    OSError EMLINK: a hard link's content may be a file outside ``root`` (no path shows it)."""
    if not parts or any(p in ("", ".", "..") or "/" in p or "\0" in p for p in parts):
        raise OSError(errno.EINVAL, "not a name inside the directory", str(Path(root, *parts)))
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    try:
        for part in parts[:-1]:
            fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
        fds.append(open_regular(parts[-1], follow=False, dir_fd=fds[-1]))
        if os.fstat(fds[-1]).st_nlink > 1:
            raise OSError(errno.EMLINK, "a hard link: its content may be a file outside the directory",
                          str(Path(root, *parts)))
        return _read_fd(fds[-1], limit, tail)
    finally:
        for fd in fds:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def replace_durably(path: str | os.PathLike[str], data: bytes, tmp: str | os.PathLike[str] | None = None) -> None:
    """Replace the file at ``path`` with ``data``, durably: written whole to ``tmp`` (a file of alpsck's
    own: :func:`open_own`; by default the core's temp name, ``path`` + ``.tmp``), fsync'ed, renamed over
    ``path``, and the directory fsync'ed, so a power loss leaves the old content or the new, never a torn
    file. The one durable small-file write of the Python side."""
    tmp = temp_name(os.fspath(path)) if tmp is None else tmp
    write_temp(tmp, data)
    rename_durably(tmp, path)


def write_temp(tmp: str | os.PathLike[str], data: bytes) -> None:
    """:func:`replace_durably`'s first half, for a caller that overlaps it with other work: ``data`` written
    whole to ``tmp`` (a file of alpsck's own) and fsync'ed. :func:`rename_durably` then puts it in place."""
    fd = open_own(tmp)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def rename_durably(tmp: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """:func:`replace_durably`'s second half: ``tmp`` (written by :func:`write_temp`) renamed over ``path``,
    and the directory fsync'ed."""
    os.replace(tmp, path)
    _fsync(Path(path).parent)


def append_durably(path: str | os.PathLike[str], data: bytes) -> None:
    """Append ``data`` to the log at ``path`` (a file of alpsck's own, created if missing: :func:`open_own`
    with ``append``), fsync'ed before it returns."""
    fd = open_own(path, append=True)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durably(path: Path) -> None:
    """``mkdir -p path``, each directory it creates made durable in its parent, so what is committed
    inside later does not vanish with its name (a DCP checkpoint directory is new at every save)."""
    for parent in make_dirs(path):
        fsync_path(parent)


def fsync_dirs_quietly(dirs: list[Path]) -> None:
    """fsync each of :func:`make_dirs`'s directories, on a way out where an error is already being raised (the
    engine that was to sync them did not open): as far as it goes, so a later open finds the names durable."""
    for d in dirs:
        with contextlib.suppress(OSError):
            fsync_path(d)


def make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``, returning the directories whose fsync makes the new names durable (the parent
    of each directory it created, outermost first): :func:`make_dirs_durably` for a caller that
    syncs them later, before what it commits inside counts as durable (an engine opened with them as
    ``unsynced_dirs``)."""
    missing: list[Path] = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return [d.parent for d in reversed(missing)]
