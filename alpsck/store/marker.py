"""The DCP checkpoint-directory marker (``.metadata``, :data:`alpsck.store.names.MARKER_FILE`): whether a
directory has alpsck's (or DCP's FileSystemWriter's pickle), writing it, and what each step of a trainer's folder
of checkpoints is (:func:`folder_steps`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .durable import read_small, rename_durably, write_temp
from .names import MARKER_BYTES, MARKER_FILE, MARKER_FORMAT, MARKER_NAMES

ALPSCK, FILESYSTEMWRITER, OTHER = "alpsck", "filesystemwriter", "other"  # the kinds of a folder's steps
_STEP = re.compile(r"step-(\d{1,18})")  # a trainer's name for a step's directory (torchtitan: step-10)


PICKLE = b"\x80"  # a pickle's first byte (the protocol opcode): FileSystemWriter's .metadata


def has_pickled_metadata(path: Path) -> bool:
    """Whether ``path/.metadata`` is a pickle: what DCP's FileSystemWriter leaves. Reads one byte; unpickles nothing."""
    try:
        return (path / MARKER_FILE).is_file() and read_small(path / MARKER_FILE, 1)[:1] == PICKLE
    except OSError:
        return False


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
    what = "a pickle: a FileSystemWriter checkpoint" if data[:1] == PICKLE else "not alpsck's"
    return f"{path / MARKER_FILE} is {what}"


def write_marker(path: Path) -> None:
    """Make ``path/.metadata`` alpsck's marker, durably (tmp file, fsync, rename, fsync of the directory)."""
    if stage_marker(path):
        publish_marker(path)


def stage_marker(path: Path) -> bool:
    """:func:`write_marker`'s first half, done while the checkpoint is written: whether ``path`` needs the
    marker put in place, having then written and fsync'ed its temp file (``.metadata.tmp``, which no
    trainer reads). :func:`publish_marker` then puts it in place, after the commit."""
    if marker_problem(path) is None and (path / MARKER_FILE).is_file():
        return False
    write_temp(path / MARKER_NAMES[1], MARKER_BYTES)
    return True


def publish_marker(path: Path) -> None:
    """The marker :func:`stage_marker` wrote, renamed into place and made durable."""
    rename_durably(path / MARKER_NAMES[1], path / MARKER_FILE)


def is_marked(path: Path) -> bool:
    """A checkpoint directory AlpsckStorageWriter wrote (checkpoint-directory mode): it has alpsck's marker."""
    return (path / MARKER_NAMES[0]).is_file() and marker_problem(path) is None


def folder_steps(path: Path, names: list[str] | None = None) -> list[tuple[int, Path, str]] | None:
    """A trainer's folder of checkpoints (torchtitan's ``checkpoint/step-10``, ``step-20``): each step directory's
    step, path and kind (:data:`ALPSCK`: an alpsck checkpoint directory, which alpsck's DCP reader loads;
    :data:`FILESYSTEMWRITER`: DCP's own format; :data:`OTHER`: neither), ascending by step. None when ``path``
    holds no step of either kind (a run directory, whose ``step-N`` are its own checkpoints). ``names``: the
    directory's entries, where the caller listed them already."""
    if names is None:
        try:
            names = os.listdir(path)
        except OSError:
            return None
    steps = []
    for name in names:
        m = _STEP.fullmatch(name)
        if m is None or not (path / name).is_dir():
            continue
        kind = ALPSCK if is_marked(path / name) else FILESYSTEMWRITER if has_pickled_metadata(path / name) else OTHER
        steps.append((int(m.group(1)), path / name, kind))
    if not any(kind != OTHER for _, _, kind in steps):
        return None
    return sorted(steps, key=lambda s: (s[0], s[1].name))
