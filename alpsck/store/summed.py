"""Summed files: any file written through alpsck's ``alpsck://`` protocol (:mod:`alpsck.integrations.fsspec_fs`),
whatever its format (DCP's ``.distcp`` and ``.metadata``, Hugging Face safetensors, a Lightning ``.ckpt``), with
its size and CRC32C in a sidecar beside it, so a reader and ``inspect-checkpoints --verify`` can check every
byte. This module owns the sidecar's name and format, the durable write and the check.

* The sidecar of ``dir/NAME`` is ``dir/.NAME.alpsck-sum``: JSON ``{"bytes": N, "crc32c": C}``.
* :class:`SummedWriter` writes ``NAME`` under a temporary name, summing as it goes; :meth:`SummedWriter.close`
  fsyncs it, removes an older sidecar, renames the file into place and then writes the new sidecar durably. A
  crash leaves the old file with its sidecar, or the old or the new file without one ("no checksum"): never a
  sidecar that describes other bytes.
* :func:`verify_file` reads the whole file and raises :class:`~alpsck.errors.CorruptCheckpointError` naming it
  when the size or CRC32C differs, or when no sidecar says what the bytes should be.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import CorruptCheckpointError
from .durable import fsync_path, open_own, open_regular, read_small, replace_durably
from .names import temp_name

SIDECAR_SUFFIX = ".alpsck-sum"
_SIDECAR_BYTES = 4096
_READ_BYTES = 8 << 20


def sidecar(path: str | os.PathLike[str]) -> Path:
    """Where the size and CRC32C of the file at ``path`` are kept."""
    p = Path(path)
    return p.with_name(f".{p.name}{SIDECAR_SUFFIX}")


def is_sidecar(name: str) -> bool:
    return name.startswith(".") and name.endswith(SIDECAR_SUFFIX) and len(name) > 1 + len(SIDECAR_SUFFIX)


def summed_of(sidecar_path: Path) -> Path:
    """The file a sidecar describes."""
    return sidecar_path.with_name(sidecar_path.name[1:-len(SIDECAR_SUFFIX)])


class SummedWriter(io.RawIOBase):
    """A binary file being written to ``path``; it appears there, with its sidecar, only when closed.

    ``abort()`` (also what closing after an exception inside ``with`` does) removes the temporary file and leaves
    ``path`` as it was."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self._tmp = Path(temp_name(os.fspath(self.path)))
        self._fd = open_own(self._tmp)
        self._crc = 0
        self._bytes = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:  # DCP fsyncs what it wrote through the stream's descriptor
        return self._fd

    def tell(self) -> int:
        return self._bytes

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._crc = _core.crc32c(view, self._crc)
        n = len(view)
        while view:
            view = view[os.write(self._fd, view):]
        self._bytes += n
        return n

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._tmp.unlink(missing_ok=True)
        super().close()

    def close(self) -> None:
        if self._fd < 0:
            super().close()
            return
        try:
            os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._fd = -1
        sidecar(self.path).unlink(missing_ok=True)  # never an old sum beside new bytes
        os.rename(self._tmp, self.path)
        replace_durably(sidecar(self.path), json.dumps({"bytes": self._bytes, "crc32c": self._crc}).encode())
        super().close()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.abort()
        else:
            self.close()


def read_sum(path: str | os.PathLike[str]) -> tuple[int, int]:
    """The (bytes, crc32c) the sidecar of ``path`` records; CorruptCheckpointError when it is missing or
    malformed."""
    side = sidecar(path)
    try:
        doc = json.loads(read_small(side, _SIDECAR_BYTES))
        return int(doc["bytes"]), int(doc["crc32c"])
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: no checksum beside it ({side.name} is missing: not written through "
                                     "alpsck://, or its write was interrupted)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{path}: its checksum file {side.name} is unreadable ({e})") from e


def verify_file(path: str | os.PathLike[str]) -> int:
    """Read every byte of ``path`` and check it against its sidecar; its size in bytes. Raises
    CorruptCheckpointError naming the file when it differs, or when the file or its sidecar is missing."""
    want_bytes, want_crc = read_sum(path)
    crc, n = 0, 0
    try:
        fd = open_regular(path)
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: unreadable ({e.strerror or e})") from e
    try:
        buf = bytearray(_READ_BYTES)
        view = memoryview(buf)
        while (got := os.readv(fd, [buf])) > 0:
            crc = _core.crc32c(view[:got], crc)
            n += got
    finally:
        os.close(fd)
    if n != want_bytes:
        raise CorruptCheckpointError(f"{path}: {n} bytes, its checksum file says {want_bytes} (truncated or extended)")
    if crc != want_crc:
        raise CorruptCheckpointError(f"{path}: CRC32C {crc:#010x} differs from its checksum file's {want_crc:#010x}")
    return n


def survey(root: Path) -> tuple[list[Path], list[Path]]:
    """The files below ``root`` (one walk), sorted: (those with a sidecar, or whose sidecar is left without them;
    those, not sidecars nor temporary, with none: written some other way)."""
    with_sums: set[Path] = set()
    without: list[Path] = []
    for dirpath, _dirs, names in os.walk(root):
        have = set(names)
        for name in names:
            if is_sidecar(name):
                with_sums.add(summed_of(Path(dirpath) / name))
            elif not name.endswith(temp_name("")) and f".{name}{SIDECAR_SUFFIX}" not in have:
                without.append(Path(dirpath) / name)
    return sorted(with_sums), sorted(without)


def move(src: Path, dst: Path) -> None:
    """Rename a summed file and its sidecar (the file first: a crash in between leaves it "no checksum")."""
    sidecar(dst).unlink(missing_ok=True)
    os.rename(src, dst)
    if sidecar(src).exists():
        os.rename(sidecar(src), sidecar(dst))
    fsync_path(dst.parent)


def remove(path: Path) -> None:
    """Remove a summed file and its sidecar."""
    sidecar(path).unlink(missing_ok=True)
    path.unlink()
