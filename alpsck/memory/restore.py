"""Restore across tiers and nodes (:func:`restore_across_tiers`): a step held in memory for every node's
ranks, when it is as new as the run directory's newest or newer; else, or when no copy of it can be read,
the run directory's.

Each node's leader lists which steps it holds for each node's ranks (its own copy, a replica, or a copy a
node that ran those ranks before left: all named after the ranks, ``ranks-FIRST-LAST``), and every rank
takes the newest step held for every node's ranks somewhere. The copy tried first for a node's ranks is its
own (its node holds it), else another node's, sent over (:mod:`.wire`); a copy that cannot be read or fails
its CRCs gives one warning on that node's ranks and the next holder's copy is tried, once; when a node's
ranks are left without a good copy, every rank restores from the run directory, once, with one warning.
Each copy is tried once and each tier once, so a bad copy can never send a job into a restart loop
(Megatron-LM issue 5281). A state that does not fit, or any other error, is raised as it is.

The tier a restore reports: ``memory`` when every node read its own memory, ``replica`` when some node's
ranks read a copy another node held, ``run_dir``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from ..options import DEFAULTS
from ..ranks import Ranks
from ..restore.into import restore_into
from ..store.memory_tier import FETCHED_PREFIX
from ..store.names import step_dir
from ..store.picker import pick
from ..store.scan import remove_entries
from .nodes import Nodes
from .wire import exchange

_NONE = -1
SLOTS = 2  # steps a node reports for each node's ranks: the engine keeps one, and a crash can leave two
_OK, _BAD, _FAILED, _IDLE = 0, 1, 2, 3


def _steps(directory: Path, world: int, step: int | None, allow_unhealthy: bool) -> list[int]:
    """The committed steps of ``directory`` a restore would try, newest first ([] when it cannot be listed)."""
    try:
        return [int(s) for s in pick(directory, kind="alpsck", world_size=world, step=step,
                                     allow_unhealthy=allow_unhealthy).steps]
    except Exception:
        return []


def _plan(run_dir: Path, base: Path, nodes: Nodes, step: int | None,
          allow_unhealthy: bool) -> tuple[int, list[list[int]]] | None:
    """The memory step to restore and, for each node's ranks, the nodes holding it, own node first (a
    collective of every rank); None: the run directory's restore alone."""
    k = nodes.count
    row = [_NONE] * (k * k * SLOTS + 1)  # each node's steps of each node's ranks, and the run directory's newest
    if nodes.leader:
        for g in range(k):
            for j, s in enumerate(_steps(base / nodes.name(g), len(nodes.groups[g]), step, allow_unhealthy)[:SLOTS]):
                row[(nodes.index * k + g) * SLOTS + j] = s
    if nodes.ranks.rank == 0 and step is None:  # rank 0 lists the run directory (the others leave it at _NONE)
        row[-1] = (_steps(run_dir, nodes.ranks.world_size, None, allow_unhealthy)[:1] or [_NONE])[0]
    *table, newest_on_disk = nodes.ranks.all_max(row)  # one collective

    def holders(g: int, s: int) -> list[int]:
        have = [n for n in range(k) if s in table[(n * k + g) * SLOTS:(n * k + g + 1) * SLOTS]]
        return sorted(have, key=lambda n: (n != g, n))

    steps = sorted({s for s in table if s != _NONE}, reverse=True)
    for s in steps:
        if s < newest_on_disk:
            break
        held = [holders(g, s) for g in range(k)]
        if all(held):
            return s, held
    return None


def _copy_over(base: Path, nodes: Nodes, s: int, moves: list[tuple[int, int]]) -> None:
    """Send node ``src``'s copy of node ``g``'s ranks to node ``g`` for each (g, src) in ``moves``, one after
    another in the same order on every leader (the leaders only)."""
    if not nodes.leader:
        return
    for g, src in moves:
        if nodes.index == src:
            exchange(nodes.moves, dst=nodes.leader_of(g), step=s, source=step_dir(base / nodes.name(g), s))
        elif nodes.index == g:
            exchange(nodes.moves, src=nodes.leader_of(src), into=base / (FETCHED_PREFIX + nodes.name(g)))


def restore_across_tiers(run_dir: Path, base: Path | None, nodes: Nodes | None, state: MutableMapping[str, Any], *,
                         step: int | None, ranks: Ranks, allow_unhealthy: bool) -> tuple[int | None, str | None]:
    """Restore into ``state`` from memory (the run's memory directory ``base``, the job's ``nodes``) or the run
    directory (module docstring): the step restored and its tier (``memory``, ``replica`` or ``run_dir``), or
    (None, None) for a fresh start. Raises what :func:`alpsck.restore.into.restore_into` raises for the run
    directory."""
    failed: CorruptCheckpointError | NoCheckpointError | None = None
    plan = _plan(run_dir, base, nodes, step, allow_unhealthy) if base is not None and nodes is not None else None
    if plan is not None and base is not None and nodes is not None:
        s, held = plan
        got, failed, remote = _from_memory(base, nodes, s, held, state, allow_unhealthy)
        if got is not None:
            return got, "replica" if remote else "memory"
        warnings.warn(f"{base}: the memory checkpoint of step {s} is not usable for every node's ranks "
                      f"({_first_line(failed)}); "
                      f"restoring from the run directory {run_dir} instead", RuntimeWarning, stacklevel=3)
    restored = restore_into(run_dir, state, step=step, ranks=ranks, allow_unhealthy=allow_unhealthy)
    if restored is None:
        if isinstance(failed, CorruptCheckpointError):  # a memory copy's bytes are in the live tensors
            raise failed
        return None, None
    return restored, "run_dir"


def _from_memory(base: Path, nodes: Nodes, s: int, held: list[list[int]], state: MutableMapping[str, Any],
                 allow_unhealthy: bool) -> tuple[int | None, Any, bool]:
    """Step ``s`` from memory, each node's ranks from the holders ``held`` in turn: (the step, or None when some
    node's ranks found no good copy; this node's last error; whether some node read another node's copy)."""
    k, me = nodes.count, nodes.index
    done = [False] * k
    remote = False
    error: Any = None
    said: list[warnings.WarningMessage] = []
    try:
        for attempt in range(max(len(h) for h in held)):
            active = [g for g in range(k) if not done[g] and attempt < len(held[g])]
            if not active:
                break
            _copy_over(base, nodes, s, [(g, held[g][attempt]) for g in active if held[g][attempt] != g])
            remote = remote or any(held[g][attempt] != g for g in active)
            code, failure = _IDLE, None
            if me in active:
                own = held[me][attempt] == me
                where = base / (nodes.name(me) if own else FETCHED_PREFIX + nodes.name(me))
                code, error, failure, heard = _read(where, nodes, s, state, allow_unhealthy, listed=own)
                said += heard
            codes = nodes.ranks.each(code)
            if _FAILED in codes:
                if failure is not None:
                    raise failure
                bad = sorted({r for r, c in enumerate(codes) if c == _FAILED})
                raise CheckpointError(f"{base}: restoring step {s} from memory failed on rank(s) {bad} (their own "
                                      "error says why), so no rank loaded it")
            for g in active:
                done[g] = all(codes[r] == _OK for r in nodes.groups[g])
            if me in active and code == _BAD and attempt + 1 < len(held[me]):
                warnings.warn(f"{where}: the memory copy of step {s} of ranks {nodes.name(me)} is not usable "
                              f"({_first_line(error)}); reading the copy node {held[me][attempt + 1]} holds instead",
                              RuntimeWarning, stacklevel=4)
    finally:
        if nodes.leader:
            remove_entries(base, [FETCHED_PREFIX + nodes.name(me)])  # its error dropped: a copy left costs memory only
    if not all(done):
        return None, error, remote
    for w in said:  # the read went through: what it warned about on the way is worth saying
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return s, None, remote


def _read(where: Path, nodes: Nodes, s: int, state: MutableMapping[str, Any], allow_unhealthy: bool,
          listed: bool) -> tuple[int, Any, Exception | None, list[warnings.WarningMessage]]:
    """This node's ranks read step ``s`` from ``where`` (a collective of the node): (code, the read's error
    when it is a bad copy, any other failure, what it warned about). ``listed``: the node's own copy, which its
    leader listed for the plan (every rank reads it at its name); else a copy the leader has just received,
    which it lists first (its broadcast is what tells the node's other ranks that the copy is there)."""
    with warnings.catch_warnings(record=True) as said:  # one warning for a bad copy, not one per reader
        warnings.simplefilter("always")
        try:
            restore_into(where, state, step=s, ranks=nodes.local, allow_unhealthy=allow_unhealthy,
                         threads=_read_threads(), agreed=listed)
            return _OK, None, None, list(said)
        except (CorruptCheckpointError, NoCheckpointError) as e:
            return _BAD, e, None, []
        except Exception as e:
            return _FAILED, None, e, []


def _read_threads() -> int:
    """Reader threads for a copy in node memory: its read is a copy on the CPU, so at most one per CPU this
    process may run on. The run directory's default (``read_threads``, 16) hides a file system's latency; here
    each thread more only adds its own chunk buffer and switching (300 MiB on the 2-CPU VM: 74 ms with 16
    threads, 40 ms with 2; docs/benchmarks.md)."""
    return max(1, min(DEFAULTS["read_threads"], len(os.sched_getaffinity(0))))


def _first_line(e: BaseException | None) -> str:
    if e is None:
        return "another node's ranks found no good copy"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
