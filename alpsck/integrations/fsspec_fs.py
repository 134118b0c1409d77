"""``alpsck://``: an fsspec protocol for writers and readers that take only a path or a URL (DCP's ``FsspecWriter``
and ``FsspecReader``, ``dcp.save(checkpoint_id="alpsck:///...")``, Lightning's ``TorchCheckpointIO`` and its
sharded strategies' paths, anything built on fsspec). ``alpsck:///scratch/run/ckpt`` is the local path
``/scratch/run/ckpt``; what changes is how its files are written and read:

* every file is written under a temporary name, fsync'ed and renamed into place when closed, with its size and
  CRC32C in a sidecar (:mod:`alpsck.store.summed`): a reader never sees half a file;
* every file opened for reading is checked first, whole, against its sidecar (once per process while it is
  unchanged): a flipped bit or a truncated file raises :class:`~alpsck.errors.CorruptCheckpointError` naming
  it, instead of loading wrong values; ``alpsck inspect-checkpoints --verify DIR`` checks a whole directory.

Registered with fsspec by alpsck's ``fsspec.specs`` entry point (pyproject.toml): importing alpsck is not needed.
``verify=False`` (``storage_options={"verify": False}``) skips the read check.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ..store import summed


class AlpsckFileSystem(LocalFileSystem):  # type: ignore[misc]  # fsspec is untyped
    protocol = ("alpsck",)
    cachable = True

    def __init__(self, verify: bool = True, **kwargs: Any) -> None:
        super().__init__(auto_mkdir=True, **kwargs)
        self.verify = verify
        self._checked: dict[str, tuple[int, int, int, int]] = {}
        self._lock = threading.Lock()

    @property
    def fsid(self) -> str:
        return "alpsck"

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "w" in mode or "x" in mode:
            if "+" in mode or "x" in mode:
                raise ValueError(f"alpsck:// opens a file to write whole ('wb'), not {mode!r}: {path}")
            self.makedirs(self._parent(path), exist_ok=True)
            return summed.SummedWriter(path)
        if "a" in mode or "+" in mode:
            raise ValueError(f"alpsck:// appends to no file (a summed file is written whole): {mode!r} {path}")
        if self.verify:
            self._check(path)
        return super()._open(path, mode, block_size, **kwargs)

    def _check(self, path: str) -> None:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if self._checked.get(path) == key:
                return
        summed.verify_file(path)
        with self._lock:
            self._checked[path] = key

    def ls(self, path: str, detail: bool = False, **kwargs: Any) -> list[Any]:
        """The directory's entries, without the sidecars."""
        return [e for e in super().ls(path, detail=detail, **kwargs)
                if not summed.is_sidecar(Path(e["name"] if detail else e).name)]

    def mv(self, path1: str, path2: str, recursive: bool = True, **kwargs: Any) -> None:
        src, dst = Path(self._strip_protocol(path1)), Path(self._strip_protocol(path2))
        if src.is_file():
            self.makedirs(str(dst.parent), exist_ok=True)
            summed.move(src, dst)
        else:
            super().mv(path1, path2, recursive=recursive, **kwargs)

    def rm_file(self, path: str) -> None:
        summed.remove(Path(self._strip_protocol(path)))

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        for p in path if isinstance(path, list) else [path]:
            if Path(self._strip_protocol(p)).is_file():
                self.rm_file(p)
            else:
                super().rm(p, recursive=recursive, maxdepth=maxdepth)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """A copy is read (checked) and written (summed) like any other file."""
        if self.isdir(path1):
            self.makedirs(path2, exist_ok=True)
            return
        with self.open(path1, "rb") as src, self.open(path2, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)


def local_path(url: str | os.PathLike[str]) -> str:
    """The local path an ``alpsck://`` URL (or a plain path) names."""
    return str(AlpsckFileSystem._strip_protocol(os.fspath(url)))
