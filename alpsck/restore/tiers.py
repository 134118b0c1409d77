"""Restore across tiers (:func:`restore_across_tiers`): the memory tier's newest checkpoint when it is as new
as the run directory's or newer, else, or when it fails, the run directory's.

The newest step wins: the memory tier is tried only for a step at least as new as the run directory's
newest candidate (a final checkpoint at a stop goes to the run directory and is newer than any snapshot in
memory; the same step in both is read from memory, the faster). A memory checkpoint is verified as any
other (its data CRCs as it is read, the health of its metrics by the picker). One that cannot be read or
fails its CRCs is given up with one warning, and the run directory's restore runs next, exactly once: two
tiers, each tried once, so a bad copy can never send a job into a restart loop. A state that does not fit,
or any other error, is raised as it is.
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, NoCheckpointError
from ..ranks import Ranks
from ..store.picker import pick
from .into import restore_into

_NONE = -1


def _listed(run_dir: Path, ranks: Ranks, allow_unhealthy: bool, step: int | None = None) -> int:
    """Rank 0's newest candidate in ``run_dir``, or ``step`` when it is one (_NONE: none, or the directory
    cannot be listed: the restore that follows reports what is wrong with a run directory)."""
    try:
        got = pick(run_dir, kind="alpsck", world_size=ranks.world_size, step=step, allow_unhealthy=allow_unhealthy).step
    except Exception:
        return _NONE
    return _NONE if got is None else int(got)


def memory_step_to_try(run_dir: Path, memory_dir: Path, step: int | None, ranks: Ranks,
                       allow_unhealthy: bool) -> int | None:
    """The memory tier's step to restore first, as rank 0 sees both tiers (a collective), or None: the
    run directory's restore alone. With ``step`` given: that step, when the memory tier holds it."""
    mine = []
    if ranks.rank == 0:
        in_memory = _listed(memory_dir, ranks, allow_unhealthy, step)
        on_disk = _listed(run_dir, ranks, allow_unhealthy) if step is None else _NONE
        mine = [in_memory if in_memory != _NONE and in_memory >= on_disk else _NONE]
    [chosen] = ranks.from_rank0(mine)
    return None if chosen == _NONE else chosen


def restore_across_tiers(run_dir: Path, memory_dir: Path | None, state: MutableMapping[str, Any], *,
                         step: int | None, ranks: Ranks, allow_unhealthy: bool) -> tuple[int | None, str | None]:
    """Restore into ``state`` from the memory tier or the run directory (module docstring): the step
    restored and its tier (``"memory"`` or ``"run_dir"``), or (None, None) for a fresh start. Raises what
    :func:`alpsck.restore.into.restore_into` raises for the run directory."""
    failed: CorruptCheckpointError | NoCheckpointError | None = None
    m = memory_step_to_try(run_dir, memory_dir, step, ranks, allow_unhealthy) if memory_dir is not None else None
    if m is not None and memory_dir is not None:
        with warnings.catch_warnings(record=True) as said:  # one warning for a bad memory copy, not one per reader
            warnings.simplefilter("always")
            try:
                got = restore_into(memory_dir, state, step=m, ranks=ranks, allow_unhealthy=allow_unhealthy)
            except (CorruptCheckpointError, NoCheckpointError) as e:
                failed = e
        if failed is None:
            for w in said:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return got, "memory"
        warnings.warn(f"{memory_dir}: the memory checkpoint of step {m} is not usable ({_first_line(failed)}); "
                      f"restoring from the run directory {run_dir} instead", RuntimeWarning, stacklevel=3)
    restored = restore_into(run_dir, state, step=step, ranks=ranks, allow_unhealthy=allow_unhealthy)
    if restored is None:
        if isinstance(failed, CorruptCheckpointError):  # the memory copy's bytes are in the live tensors
            raise failed
        return None, None
    return restored, "run_dir"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
