"""A run directory's names (as LevelDB's ``filename.h``): every name in a run directory or a checkpoint
directory is the core's (``_core.run_dir_names``, ``_core.parse_run_dir_name``, ``_core.step_dir_name``,
cpp/core/run_dir.h) or this module's (the DCP checkpoint-directory marker ``.metadata``, the run's identity
``.run-id``); nothing else
spells one. Names only: no I/O but the tests of what a name is (:func:`is_committed_step_dir`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .. import _core

# The run directory's names belong to the core (cpp/core/run_dir.h); these are its.
LOCK_NAME = _core.run_dir_names["lock"]
DELETING_PREFIX = _core.run_dir_names["deleting_prefix"]
TEMP_SUFFIX = _core.run_dir_names["temp_suffix"]


def is_text(value: str) -> bool:
    """Whether ``value`` is UTF-8 text: no surrogate escapes (the bytes of a file name or a file's content
    that are not valid UTF-8, as Python holds them), which the core's text parameters cannot take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def core_text(value: str) -> str:
    """``value`` as the core's text parameters take it: bytes that are not UTF-8 (surrogate escapes, from a
    file the core read, such as the lock's owner record, or from :func:`os.fsdecode`) each become U+FFFD.
    Text only, never a path: paths go to the core as bytes (its FsPath), whatever they hold."""
    if is_text(value):
        return value
    return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")  # any lone surrogate: U+FFFD


def temp_name(path: str) -> str:
    """The name a small file is written under before the rename that publishes it (the core's TempFileName)."""
    return path + TEMP_SUFFIX


def entry_kind(name: str) -> str:
    """What a run directory's entry is, by name (the core's ParseRunDirName): 'step', 'attempt',
    'aborted', 'free', 'free-pending', 'superseded', 'latest', 'lock', 'history', 'job-record', 'deleting', 'probe'
    (an engine's O_DIRECT probe file or the health gate's, left behind by a process killed while it probed) or
    'other'."""
    return str(_core.parse_run_dir_name(name)[0])



def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / _core.step_dir_name(step)


def is_committed_step_dir(path: Path) -> bool:
    """``run/step-N`` with its manifest: one committed checkpoint of a run directory."""
    return _core.parse_run_dir_name(path.name)[0] == "step" and (path / _core.run_dir_names["manifest"]).is_file()


def is_run_entry(name: str) -> bool:
    """Whether ``name`` is one of the entries alpsck itself keeps in a run directory."""
    return entry_kind(name) != "other"


def holds_run_state(names: Iterable[str]) -> bool:
    """Whether a directory with these entries is an alpsck run directory: any entry alpsck keeps,
    except a writer lock alone (the torch.save baseline's directories have one)."""
    return any(entry_kind(n) not in ("other", "lock") for n in names)


# The DCP checkpoint-directory marker (its I/O: alpsck.store.marker).
MARKER_FILE = _core.run_dir_names["dcp_marker"]
MARKER_FORMAT = "alpsck-dcp-checkpoint/1"
MARKER_BYTES = (json.dumps({"format": MARKER_FORMAT, "reader": "alpsck.dcp.AlpsckStorageReader",
                            "note": "written by alpsck; load with AlpsckStorageReader (docs/format.md)"},
                           indent=1) + "\n").encode()
MARKER_NAMES = (MARKER_FILE, MARKER_FILE + TEMP_SUFFIX)  # the entries the marker's writing uses
# The run directory's identity (alpsck.store.memory_tier.run_token): a random number, 16 hex digits, made
# the first time a memory tier opens on the run directory; a run directory made again has another one.
RUN_ID_NAME = ".run-id"
