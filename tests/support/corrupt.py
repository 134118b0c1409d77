"""Damaging a checkpoint file in a test: one byte changed in place, as a bad sector or a bit flip would."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, offset: int, mask: int = 0x04) -> None:
    """XOR the byte at ``offset`` of ``path`` with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
