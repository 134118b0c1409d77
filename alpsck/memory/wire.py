"""One committed checkpoint directory sent from one rank to another over torch.distributed (gloo, host
memory): :func:`exchange` sends one to a rank and receives one from a rank at once (the replica ring: every
leader does both), and it serves one-way copies too (a restore's). No pickle on the wire: int64 headers and
raw bytes.

The messages, in each direction: a header (step, or -1 for nothing; the number of files; the length of their
names), the files' sizes and their names (``\\n``-joined), then the files' bytes in pieces of at most
:data:`PIECE` bytes, file by file. What arrives goes into ``INTO/step-N.tmp/`` and is renamed to
``INTO/step-N`` once every byte is written: the rename is the copy's commit, as for any checkpoint. The
files are the checkpoint's own (manifest, shards, extras), so what reads a checkpoint verifies a copy too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..store.names import TEMP_SUFFIX, step_dir

PIECE = 64 << 20
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _files(directory: Path) -> list[tuple[str, int]]:
    """The regular files of a checkpoint directory, by name, with their sizes."""
    out = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.is_file(follow_symlinks=False):
            out.append((entry.name, entry.stat(follow_symlinks=False).st_size))
    return out


def _pieces(sizes: list[int]) -> Iterator[tuple[int, int, int]]:
    """(file index, offset, length) of every piece, in order (an empty file has none)."""
    for i, size in enumerate(sizes):
        for off in range(0, size, PIECE):
            yield i, off, min(PIECE, size - off)


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
    _move_bytes(group, dst, source, out_files, src, into, got, in_files, send, works)
    for w in works:
        w.wait()
    if src is None or got < 0:
        return None
    return got


def _move_bytes(group: Any, dst: int | None, source: Path | None, out_files: list[tuple[str, int]], src: int | None,
                into: Path | None, step: int, in_files: list[tuple[str, int]], send: Any, works: list[Any]) -> None:
    """The files' bytes both ways, piece by piece (two send buffers, so a read overlaps a send)."""
    import torch.distributed as dist

    tmp: Path | None = None
    if src is not None and step >= 0:
        if into is None or any(not _NAME.fullmatch(n) or s < 0 for n, s in in_files):
            raise CheckpointError(f"rank {src} sent a checkpoint whose file names or sizes are not a checkpoint's")
        tmp = Path(str(step_dir(into, step)) + TEMP_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    outgoing = _pieces([s for _, s in out_files])
    incoming = _pieces([s for _, s in in_files]) if tmp is not None else iter(())
    buffers = [torch.empty(min(PIECE, max((s for _, s in out_files), default=0)), dtype=torch.uint8)
               for _ in range(2 if out_files else 0)]
    pending: list[Any] = [None, None]
    rbuf = torch.empty(min(PIECE, max((s for _, s in in_files), default=0)), dtype=torch.uint8)
    readers: dict[int, Any] = {}
    writer: tuple[int, Any] | None = None
    n = 0
    try:
        while True:
            o = next(outgoing, None)
            i = next(incoming, None)
            if o is None and i is None:
                break
            if o is not None and source is not None:
                k = n % 2
                if pending[k] is not None:  # a gloo send is waited for once (a second wait blocks for good)
                    works.remove(pending[k])
                    pending[k].wait()
                f = readers.get(o[0]) or readers.setdefault(o[0], open(source / out_files[o[0]][0], "rb"))
                view = buffers[k][:o[2]]
                f.seek(o[1])
                if f.readinto(view.numpy().data) != o[2]:
                    raise CheckpointError(f"{source / out_files[o[0]][0]}: shorter than its listing (changed while sent?)")
                pending[k] = dist.isend(view, dst, group=group)
                works.append(pending[k])
            if i is not None and tmp is not None:
                if writer is None or writer[0] != i[0]:
                    if writer is not None:
                        writer[1].close()
                    writer = (i[0], open(tmp / in_files[i[0]][0], "wb"))
                view = rbuf[:i[2]]
                dist.recv(view, src, group=group)
                writer[1].write(view.numpy().data)
            n += 1
    finally:
        for f in readers.values():
            f.close()
        if writer is not None:
            writer[1].close()
    if tmp is not None:
        for name, size in in_files:  # an empty file has no piece: made here
            (tmp / name).touch()
            if (tmp / name).stat().st_size != size:
                raise CheckpointError(f"{tmp / name}: {size} bytes sent, {(tmp / name).stat().st_size} arrived")
        final = step_dir(into, step)  # type: ignore[arg-type]
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)


def keep_only(directory: Path, name: str) -> None:
    """Remove every entry of ``directory`` but ``name`` (a replica's directory holds its newest copy only)."""
    for entry in os.scandir(directory):
        if entry.name == name:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
