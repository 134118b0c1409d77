"""fsync by path: the Python side's one way to make a file's data or a directory's entries durable."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync the file or directory at ``path``; raises OSError if it cannot be opened or synced."""
    fd = os.open(Path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
