"""What a run directory holds: whether a directory is one (:func:`check_run_dir`), the scan with clear
refusals (:func:`scan_run_dir`), a shard opened with clear errors (:func:`open_shard`), its superseded
directories and their sizes, and prune's removal through the core (:func:`remove_entries`)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import CheckpointError, CheckpointIOError, NoCheckpointError, UsageError
from ..options import DEFAULTS
from .marker import ALPSCK, folder_steps
from .names import holds_run_state

ACCESS_ERRNOS = (errno.EACCES, errno.EPERM)


def denied(path: str | os.PathLike[str], what: str) -> CheckpointError:
    return CheckpointError(f"{path}: permission denied ({what}); run as the user who owns the run or fix its permissions")


def _refuse_folder_of_checkpoints(path: Path, names: list[str]) -> None:
    """A trainer's folder of checkpoints (``folder/step-10``, each alpsck's checkpoint directory or DCP's
    FileSystemWriter's: :func:`alpsck.store.marker.folder_steps`) is not a run directory: its ``step-N`` would read
    as damaged."""
    steps = folder_steps(path, names)
    if steps is None:
        return
    mine = [p for _, p, kind in steps if kind == ALPSCK]
    names = [p.name for _, p, _ in steps]
    raise UsageError(f"{path}: a folder of checkpoints, one directory per step ({len(steps)}: {', '.join(names[:3])}"
                     f"{' ...' if len(names) > 3 else ''}), not a run directory; "
                     + (f"name one, e.g. {mine[-1]}" if mine else "its steps are DCP FileSystemWriter checkpoints "
                        f"(alpsck import-dcp {path} --trust-pickle converts them)")
                     + f" (alpsck inspect-checkpoints {path} lists them)")


def check_run_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The run directory as a Path, or a one-line AlpsckError saying why it is not usable.

    Missing, not a directory, not readable (permission denied), or not an alpsck run directory
    (no ``step-*`` directories, no ``LATEST``, no ``history.jsonl``).
    """
    path = Path(run_dir)
    try:
        path.stat()
    except FileNotFoundError:
        raise UsageError(f"{run_dir}: no such directory") from None
    except PermissionError:
        raise denied(run_dir, "cannot reach it") from None
    except OSError as e:
        raise CheckpointError(f"{run_dir}: {e.strerror or e}") from None
    if not path.is_dir():
        raise UsageError(f"{run_dir}: not a directory")
    try:
        names = os.listdir(path)
    except PermissionError:
        raise denied(run_dir, "cannot list it") from None
    except OSError as e:
        raise CheckpointError(f"{run_dir}: cannot list it: {e.strerror or e}") from None
    _refuse_folder_of_checkpoints(path, names)
    if not holds_run_state(names):
        baseline = sorted(n for n in names if n.startswith("torch-step-") and n.endswith(".pt"))
        hint = (f"; its {len(baseline)} torch-step-*.pt file(s) are the torch.save baseline's (--checkpointer torch), "
                "which these tools do not read: load them with alpsck.TorchSaveCheckpointer") if baseline else ""
        raise UsageError(f"{run_dir}: not an alpsck run directory (no step-* checkpoints, no LATEST, no history.jsonl)"
                         + hint)
    return path


def superseded_dirs(run_dir: Path) -> list[dict[str, Any]]:
    """The superseded directories of ``run_dir`` (``{"step", "path", "bytes"}``, by step), as prune removes them.

    Only real directories whose whole name is one the core writes; anything else is not listed.
    """
    found = []
    for n in os.listdir(run_dir):
        kind, step, _ = _core.parse_run_dir_name(n)
        p = run_dir / n
        if kind == "superseded" and p.is_dir() and not p.is_symlink():
            found.append({"step": step, "path": str(p), "bytes": dir_bytes(p)})
    return sorted(found, key=lambda d: (d["step"], d["path"]))


def scan_run_dir(
    run_dir: str | os.PathLike[str],
    verify: bool = False,
    threads: int = DEFAULTS["read_threads"],
    progress: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """``_core.scan`` after :func:`check_run_dir`, with permission errors turned into clear messages."""
    path = check_run_dir(run_dir)
    try:
        return list(_core.scan(str(path), verify=verify, threads=threads, progress=progress))
    except CheckpointIOError as e:
        if e.errno in ACCESS_ERRNOS:
            raise denied(run_dir, e.strerror or str(e)) from None
        raise
    except PermissionError as e:  # pragma: no cover - the core reports CheckpointIOError
        raise denied(e.filename or run_dir, "scan") from None


def open_shard(path: str | os.PathLike[str]) -> Any:
    """``_core.ShardReader(path)`` with permission and missing-file errors named clearly."""
    try:
        return _core.ShardReader(str(path))
    except CheckpointIOError as e:
        if e.errno in ACCESS_ERRNOS:
            raise denied(path, "cannot read the shard") from None
        if e.errno == errno.ENOENT:
            raise NoCheckpointError(f"{path}: no such shard file") from None
        raise


def remove_entries(run_dir: str | os.PathLike[str], names: Iterable[str]) -> tuple[list[int], CheckpointError | None]:
    """Removes these entries of ``run_dir`` through the run-directory unit (``RemoveEntries``,
    run_dir_actions.h: renamed to ``.deleting-*``, RUN_DIR fsync'ed, deleted without following a symlink).
    Returns the indices of the names removed, and the error of the first failure (permission
    denied worded as :func:`denied` words it) or None: the caller reports what went before raising."""
    removed, failure = _core.remove_entries(run_dir, list(names))
    if failure is None:
        return list(removed), None
    where, renaming, err, message = failure
    if err in (errno.EACCES, errno.EPERM):
        return list(removed), denied(where, "cannot rename it" if renaming else "cannot delete it")
    return list(removed), CheckpointIOError(err, message) if err else CheckpointError(message)


def dir_bytes(path: Path) -> int:
    if path.is_symlink():  # removing it unlinks the link only: it frees nothing behind it
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def retired_warning(run_dir: Path, retired: Iterable[tuple[int, str]], continued_from: int | None, step: int) -> str:
    """The warning that a save of ``step`` retired the abandoned history's checkpoints ``retired`` (step, the
    ``superseded-step-N-*`` path each was moved to); ``continued_from``: the step the run restored (-1: none
    valid; None: no restore)."""
    base = continued_from
    why = (f"this run continues from step {base}" if base is not None and base >= 0 else
           "this run restored no checkpoint" if base is not None else
           f"this run did not restore, and saves step {step}")
    done = sorted(retired)
    return (f"{run_dir}: {why}; the checkpoint(s) of step(s) {', '.join(str(s) for s, _ in done)} belong to an "
            f"abandoned history: moved to {', '.join(Path(p).name for _, p in done)} (never restored; `alpsck prune` "
            "removes them)")
