"""The DCP checkpoint-directory marker (``.metadata``, :data:`alpsck.store.names.MARKER_FILE`): whether a
directory has alpsck's, and writing it."""

from __future__ import annotations

import json
from pathlib import Path

from .durable import read_small, replace_durably
from .names import MARKER_BYTES, MARKER_FILE, MARKER_FORMAT, MARKER_NAMES


def marker_problem(path: Path) -> str | None:
    """Why the ``.metadata`` at ``path`` is not alpsck's marker (a FileSystemWriter checkpoint's
    pickle, say), or None: absent or alpsck's. Never unpickles anything."""
    try:
        data = read_small(path / MARKER_FILE, 4096)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path / MARKER_FILE} cannot be read ({e.strerror or e})"
    try:
        if json.loads(data).get("format") == MARKER_FORMAT:
            return None
    except (ValueError, AttributeError):
        pass
    what = "a pickle: a FileSystemWriter checkpoint" if data[:1] == b"\x80" else "not alpsck's"
    return f"{path / MARKER_FILE} is {what}"


def write_marker(path: Path) -> None:
    """Make ``path/.metadata`` alpsck's marker, durably (tmp file, fsync, rename, fsync of the directory)."""
    if marker_problem(path) is None and (path / MARKER_FILE).is_file():
        return
    replace_durably(path / MARKER_FILE, MARKER_BYTES, path / MARKER_NAMES[1])


def is_marked(path: Path) -> bool:
    """A checkpoint directory AlpsckStorageWriter wrote (checkpoint-directory mode): it has alpsck's marker."""
    return (path / MARKER_NAMES[0]).is_file() and marker_problem(path) is None
