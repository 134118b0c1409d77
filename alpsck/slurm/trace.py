"""Failures traced to their node (``health.cordon_after_failures``): when a job step dies, srun says on which node
and task it failed first (``srun: error: NODE: task N: Exited with exit code 7``, ``... Killed``, ``srun: error:
Node failure on NODE``; the tasks it then ends itself, ``--kill-on-bad-exit``, say ``Terminated``). The batch
script keeps srun's own messages of each step (its stderr; the tasks' output goes to their logs), and the health
gate before the next start (:mod:`.health_gate`) reads them: a ``traced`` event names the step's attempt, the
node, the task and srun's words, and a node the run's steps failed on first ``cordon_after_failures`` times is
cordoned (``cordoned``, checks ``failures``) and so kept out of the restart, which a spare takes instead.

What srun's first word does not blame: a task that exited with alpsck's own codes (:data:`exits.RESTART_EXIT`:
every rank asked for the restart after an exception; :data:`exits.GIVE_UP_EXIT`), and a step the hang watchdog
ended (a ``hang`` of that attempt: every rank's watchdog kills its own task, in no telling order). Where rank 0
knows better, it says so first (:func:`trace_missing`: the ranks the commit agreement heard nothing from, on the
nodes their earlier saves' records named), and the gate then counts its ``traced`` events instead of srun's.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path

from . import history, timeline
from .exits import GIVE_UP_EXIT, RESTART_EXIT
from .history import Cordoned, Hang, Started, Traced

_TASK = re.compile(r"^srun: error: (\S+): tasks? (\d+)(?:[-,]\d+)*: (.+)$")
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)")
_ENDED_BY_SRUN = "Terminated"  # srun (or SLURM: a cancel, a time limit) ended the task: the step failed first elsewhere
_ALPSCKS_OWN = (f"Exited with exit code {RESTART_EXIT}", f"Exited with exit code {GIVE_UP_EXIT}")  # as alpsck decided
# The commit agreement's words for the ranks it heard nothing from (cpp/core/coordinate.cc, NoShardFrom).
_NO_SHARD = re.compile(r"no shard from rank\(s\) (\d+(?:, \d+)*)")
MAX_LOG_BYTES = 1 << 20


def culprit(text: str) -> tuple[str, int | None, str] | None:
    """(node, task, srun's words) of where a step failed first, from srun's messages; None: nothing failed first
    (no such line, or the first ended by srun or SLURM itself: a cancel, a time limit). Tasks that exited with
    alpsck's own codes are passed over."""
    for line in text.splitlines():
        line = line.strip()
        node_failure = _NODE_FAILURE.match(line)
        if node_failure:
            return node_failure.group(1), None, "node failure"
        m = _TASK.match(line)
        if not m or m.group(3).strip() in _ALPSCKS_OWN:
            continue
        if m.group(3).strip() == _ENDED_BY_SRUN:
            return None
        return m.group(1), int(m.group(2)), m.group(3).strip()
    return None


def trace_missing(run_dir: str, job_id: str, attempt: int, message: str, nodes: Mapping[int, str]) -> list[str]:
    """Rank 0's, when its start failed with ``message``: a ``traced`` event for each rank the commit agreement heard
    nothing from, on its node (``nodes``: rank -> node, from the records of this start's earlier saves; a rank
    without one is left out). The nodes traced."""
    found = _NO_SHARD.search(message)
    traced = []
    for rank in map(int, found.group(1).split(", ")) if found else ():
        node = nodes.get(rank)
        if node:
            history.append(run_dir, Traced(attempt=attempt, node=node, task=rank,
                                           message="no shard from it at the commit agreement"), job_id=job_id)
            traced.append(node)
    return traced


def trace(run_dir: str, job_id: str, attempt: int, srun_log: str, cordon_after: int) -> None:
    """Before attempt ``attempt`` (> 0): trace the step before it (rank 0's own ``traced`` events of it, else srun's
    messages in ``srun_log``: module docstring), and cordon each node the run's steps have now failed first on
    ``cordon_after`` times (0: never)."""
    if attempt <= 0:
        return
    tl = timeline.read(Path(run_dir))
    # What the log holds after the step before's own start (a requeue reuses attempt numbers): by the log's order,
    # not by times, which two events written within a millisecond share.
    begun = max((i for i, e in enumerate(tl.records) if isinstance(e, Started) and e.job_id == job_id), default=-1)
    since = [e for e in tl.records[begun + 1:] if e.job_id == job_id and e.get("attempt") == attempt - 1]
    nodes = sorted({str(e.node) for e in since if isinstance(e, Traced) and e.node})
    if not nodes:
        if any(isinstance(e, Hang) for e in since):
            print(f"alpsck: the job step of attempt {attempt - 1} hung: the watchdog ended its tasks, so where it "
                  "ended says nothing of a node", file=sys.stderr, flush=True)
            return
        found = _srun_culprit(srun_log)
        if found is None:
            return
        node, task, message = found
        history.append(run_dir, Traced(attempt=attempt - 1, node=node, task=task, message=message), job_id=job_id)
        print(f"alpsck: the job step of attempt {attempt - 1} failed first on node {node}"
              + (f" (task {task}: {message})" if task is not None else f" ({message})"), file=sys.stderr, flush=True)
        nodes = [node]
        tl = timeline.read(Path(run_dir))
    for node in nodes:
        _cordon_if_due(run_dir, job_id, attempt, tl, node, cordon_after)


def _srun_culprit(srun_log: str) -> tuple[str, int | None, str] | None:
    if not srun_log:
        return None
    try:
        with open(srun_log, "rb") as f:
            text = f.read(MAX_LOG_BYTES).decode(errors="replace")
    except OSError:
        return None
    return culprit(text)


def _cordon_if_due(run_dir: str, job_id: str, attempt: int, tl: timeline.Timeline, node: str, cordon_after: int) -> None:
    if cordon_after <= 0 or node in tl.cordoned():
        return
    mine = [e for e in tl.of_kind(Traced) if e.node == node]
    if len(mine) >= cordon_after:
        said = "; ".join(f"job {e.job_id} attempt {e.attempt}: "
                         + (f"task {e.task}: {e.message}" if e.task is not None else str(e.message)) for e in mine)
        history.append(run_dir, Cordoned(node=node, reason=f"the job step failed first on it {len(mine)} times "
                                                            f"({said})", checks="failures", attempt=attempt),
                       job_id=job_id)
        print(f"alpsck: health gate: node {node} cordoned: the job step failed first on it {len(mine)} times",
              file=sys.stderr, flush=True)
