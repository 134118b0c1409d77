"""One committed checkpoint directory sent from one rank to another over torch.distributed (gloo, host
memory): :func:`exchange` sends one to a rank and receives one from a rank at once (the replica ring: every
leader does both), and it serves one-way copies too (a restore's). No pickle on the wire: int64 headers and
raw bytes.

The messages, in each direction: a header (step, or -1 for nothing; the number of files; the length of their
names), the files' sizes and their names (``\\n``-joined), then each file's bytes as one message, sent
from and received into a map of the file. What arrives goes into ``INTO/step-N.tmp/`` and is renamed to
``INTO/step-N`` once every byte is written: the rename is the copy's commit, as for any checkpoint. The
files are the checkpoint's own (manifest, shards, extras), so what reads a checkpoint verifies a copy too.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from pathlib import Path
from typing import Any

import torch

from .. import _core
from ..errors import CheckpointError
from ..store.names import step_dir
from ..store.scan import remove_entries

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _files(directory: Path) -> list[tuple[str, int]]:
    """The regular files of a checkpoint directory, by name, with their sizes."""
    out = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_file(follow_symlinks=False):
            out.append((entry.name, entry.stat(follow_symlinks=False).st_size))
    return out


def exchange(group: Any, *, dst: int | None = None, step: int = -1, source: Path | None = None,
             src: int | None = None, into: Path | None = None) -> int | None:
    """Send checkpoint directory ``source`` of ``step`` to rank ``dst`` (None: nothing to send to; ``source``
    None: tell ``dst`` there is nothing) and, at the same time, receive one from rank ``src`` into directory
    ``into`` (module docstring). Returns the step received (its directory: ``step_dir(into, step)``), or None
    when ``src`` sent nothing or there was no ``src``. Every rank of the pair must call it."""
    import torch.distributed as dist

    works: list[Any] = []
    keep: list[torch.Tensor] = []  # what an isend still reads

    def send(t: torch.Tensor) -> None:
        assert dst is not None
        keep.append(t)
        works.append(dist.isend(t, dst, group=group))

    out_files = _files(source) if dst is not None and source is not None else []
    if dst is not None:
        names = "\n".join(n for n, _ in out_files).encode()
        send(torch.tensor([step if source is not None else -1, len(out_files), len(names)], dtype=torch.int64))
        if out_files:
            send(torch.tensor([s for _, s in out_files], dtype=torch.int64))
            send(torch.frombuffer(bytearray(names), dtype=torch.uint8))
    got, in_files = -1, []
    if src is not None:
        head = torch.zeros(3, dtype=torch.int64)
        dist.recv(head, src, group=group)
        got, count, name_bytes = (int(x) for x in head.tolist())
        if count:
            sizes = torch.zeros(count, dtype=torch.int64)
            dist.recv(sizes, src, group=group)
            raw = torch.zeros(name_bytes, dtype=torch.uint8)
            dist.recv(raw, src, group=group)
            in_files = list(zip(bytes(raw.numpy()).decode().split("\n"), [int(x) for x in sizes.tolist()], strict=True))
    _move_bytes(group, source, out_files, src, into, got, in_files, send, works, keep)  # waits for the sends
    if src is None or got < 0:
        return None
    return got


def _move_bytes(group: Any, source: Path | None, out_files: list[tuple[str, int]], src: int | None, into: Path | None,
                step: int, in_files: list[tuple[str, int]], send: Any, works: list[Any], keep: list[Any]) -> None:
    """The files' bytes both ways, one message a file, straight from and into memory-mapped files (on a tmpfs:
    the pages themselves; no copy through a buffer)."""
    import torch.distributed as dist

    tmp: Path | None = None
    if src is not None and step >= 0:
        if into is None or any(not _NAME.fullmatch(n) or s < 0 for n, s in in_files):
            raise CheckpointError(f"rank {src} sent a checkpoint whose file names or sizes are not a checkpoint's")
        into.mkdir(parents=True, exist_ok=True)
        tmp = into / _core.tmp_dir_name(step)
        _removed(into, [tmp.name])  # an exchange a crash cut short
        tmp.mkdir()
    maps: list[mmap.mmap] = []
    try:
        for i in range(max(len(out_files), len(in_files) if tmp is not None else 0)):
            if i < len(out_files) and source is not None and out_files[i][1] > 0:
                send(_mapped(source / out_files[i][0], out_files[i][1], maps, write=False))
            if tmp is not None and i < len(in_files):
                name, size = in_files[i]
                with open(tmp / name, "wb") as f:
                    f.truncate(size)
                if size > 0:
                    dist.recv(_mapped(tmp / name, size, maps, write=True), src, group=group)
        for w in works:
            w.wait()
        works.clear()
    finally:
        for w in works:  # an error part-way: the sends still read the maps
            with contextlib.suppress(Exception):
                w.wait()
        works.clear()
        keep.clear()  # the tensors over the maps go first
        for m in maps:
            with contextlib.suppress(BufferError):
                m.close()
    if tmp is not None:
        final = step_dir(tmp.parent, step)
        _removed(tmp.parent, [final.name])  # a copy of the same step made before
        os.rename(tmp, final)


def _mapped(path: Path, size: int, maps: list[mmap.mmap], *, write: bool) -> torch.Tensor:
    """The bytes of file ``path`` (``size`` of them) as a uint8 tensor over a map of the file (read: a private
    map, so the tensor may be writable without the file changing)."""
    with open(path, "r+b" if write else "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise CheckpointError(f"{path}: {os.fstat(f.fileno()).st_size} bytes, {size} listed (changed while sent?)")
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_WRITE if write else mmap.ACCESS_COPY)
    maps.append(m)
    return torch.frombuffer(m, dtype=torch.uint8)


def keep_only(directory: Path, name: str) -> None:
    """Remove every entry of ``directory`` but ``name`` (a replica's directory holds its newest copy only)."""
    _removed(directory, [e for e in os.listdir(directory) if e != name])


def _removed(directory: Path, names: list[str]) -> None:
    """Remove these entries of ``directory`` (those that exist) through the run-directory unit's removal."""
    _, error = remove_entries(directory, names)
    if error is not None:
        raise error
