"""Where a DCP checkpoint lives: what the checkpoint_id forms name, for the writer and the reader.

A DCP ``checkpoint_id`` names either an alpsck run directory (run-directory mode, with the step given
to the writer), one of its committed ``step-00000000N``, or a checkpoint directory of its own
(checkpoint-directory mode: ``folder/step-10``, marked by alpsck's ``.metadata``). Nothing here
imports the writer or the reader.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import _core
from ..errors import UsageError
from ..store.durable import read_small
from ..store.marker import marker_problem
from ..store.names import MARKER_FILE, MARKER_NAMES, entry_kind, is_committed_step_dir


def checkpoint_path(checkpoint_id: str | os.PathLike[str], who: str) -> Path:
    """``checkpoint_id`` as the path a writer or reader uses. An empty one is refused: ``Path("")`` is
    the current directory, where an unset variable or a typo would write (or look for) a checkpoint."""
    text = os.fsdecode(os.fspath(checkpoint_id))
    if not text:
        raise UsageError(f"{who}: the checkpoint path is empty; give a directory ('.' for the current one)")
    return Path(text)


def holds_alpsck_state(path: Path) -> bool:
    """Whether directory ``path`` is alpsck's: a LATEST, a history, an attempt ... or a step-N that holds a
    manifest. A bare ``step-10`` (a FileSystemWriter checkpoint, or a folder of named checkpoints) is not."""
    for name in os.listdir(path):
        kind = entry_kind(name)
        if kind == "step":
            if (path / name / _core.run_dir_names["manifest"]).is_file():
                return True
        elif kind not in ("other", "lock"):
            return True
    return False


def is_alpsck_checkpoint_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether checkpoint_id names an alpsck run directory, a checkpoint directory written by
    AlpsckStorageWriter, or a committed step-N inside one; never raises."""
    try:
        path = Path(checkpoint_id)
        return path.is_dir() and (is_committed_step_dir(path) or holds_alpsck_state(path))
    except (OSError, TypeError, ValueError):
        return False


def may_become_checkpoint(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether a writer can write a checkpoint at checkpoint_id: alpsck's already, an empty directory,
    or a path not there yet whose nearest existing parent is a writable directory (DCP's rule)."""
    try:
        if "://" in os.fspath(checkpoint_id):
            return False
        path = Path(checkpoint_id).absolute()
        if path.exists():
            return is_alpsck_checkpoint_id(path) or (path.is_dir() and not os.listdir(path))
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)
    except (OSError, TypeError, ValueError):
        return False


def refuse_folder_of_checkpoints(path: Path, names: list[str] | None = None) -> None:
    """Refuse ``path`` as one checkpoint when it is a trainer's folder of them (``folder/step-10``,
    ``folder/step-20``: names alpsck never gives a generation, or directories that are checkpoints
    themselves), for a writer (which would write a generation among them) and a reader alike.
    ``names``: the directory's entries, where the caller listed them already."""
    if names is None:
        try:
            names = os.listdir(path)
        except OSError:
            return  # not there (a new checkpoint), or not a directory: the caller says what it is
    nested = sorted(n for n in names if entry_kind(n) == "step" and (
        n != _core.step_dir_name(_core.parse_run_dir_name(n)[1]) or os.path.lexists(path / n / MARKER_FILE)))
    if nested:
        raise UsageError(f"checkpoint_id {str(path)!r} holds checkpoint directories ({', '.join(nested[:3])}"
                         f"{' ...' if len(nested) > 3 else ''}): it is a folder of checkpoints; name one checkpoint "
                         f"in it (such as {str(path / nested[-1])!r})")


def same_dir(a: str | os.PathLike[str], b: Path) -> bool:
    return Path(a).resolve() == b.resolve()


def rank_local_dir(rank: int) -> str:
    """The checkpoint of one rank saved with ``use_collectives=False`` beside the others: ``ID/__<rank>``
    (FileSystemWriter names that rank's files ``ID/__<rank>_*`` and its metadata ``ID/__<rank>.metadata``)."""
    return f"__{int(rank)}"


def is_rank_local_checkpoint(path: Path, name: str) -> bool:
    """Whether ``path/name`` is one rank's checkpoint saved with ``use_collectives=False`` beside the others'
    (:func:`rank_local_dir`): alpsck's own entry of a checkpoint directory, not someone else's file."""
    return name.startswith("__") and name[2:].isdigit() and name == rank_local_dir(int(name[2:])) \
        and is_alpsck_checkpoint_id(path / name)


def damaged_marker(path: Path) -> bool:
    """Whether ``path`` is an alpsck checkpoint directory whose ``.metadata`` marker is damaged (not a pickle,
    not alpsck's JSON), beside alpsck's entries only: a writer may write over it, a reader look past it."""
    try:
        if marker_problem(path) is None or read_small(path / MARKER_FILE, 1)[:1] == b"\x80":
            return False
        names = os.listdir(path)
        return (all(entry_kind(n) != "other" or n in MARKER_NAMES for n in names)
                and any(entry_kind(n) not in ("other", "lock") for n in names))
    except OSError:
        return False
