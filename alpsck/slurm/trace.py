"""Failures traced to their node (``health.cordon_after_failures``): when a job step dies, srun says on which node
and task it failed first (``srun: error: NODE: task N: Exited with exit code 7``, ``... Killed``, ``srun: error:
Node failure on NODE``; the tasks it then ends itself, ``--kill-on-bad-exit``, say ``Terminated``). The batch
script keeps srun's own messages of each step (its stderr; the tasks' output goes to their logs), and the health
gate before the next start (:mod:`.health_gate`) reads them: a ``traced`` event names the step's attempt, the
node, the task and srun's words, and a node the run's steps failed on first ``cordon_after_failures`` times is
cordoned (``cordoned``, checks ``failures``) and so kept out of the restart, which a spare takes instead.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from . import history, timeline
from .history import Cordoned, Traced

_TASK = re.compile(r"^srun: error: (\S+): tasks? (\d+)(?:[-,]\d+)*: (.+)$")
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)")
_ENDED_BY_SRUN = ("Terminated",)  # a task srun ended after another's failure: not where it failed first
MAX_LOG_BYTES = 1 << 20


def culprit(text: str) -> tuple[str, int | None, str] | None:
    """(node, task, srun's words) of where a step failed first, from srun's messages; None: nothing failed first
    (no such line, or the first ended by srun or SLURM itself: a cancel, a time limit)."""
    for line in text.splitlines():
        line = line.strip()
        node_failure = _NODE_FAILURE.match(line)
        if node_failure:
            return node_failure.group(1), None, "node failure"
        m = _TASK.match(line)
        if m:
            if m.group(3).strip() in _ENDED_BY_SRUN:
                return None
            return m.group(1), int(m.group(2)), m.group(3).strip()
    return None


def trace(run_dir: str, job_id: str, attempt: int, srun_log: str, cordon_after: int) -> None:
    """Before attempt ``attempt`` (> 0): trace the step before it from srun's messages in ``srun_log``, record it,
    and cordon its node when the run's steps have now failed first on it ``cordon_after`` times (0: never)."""
    if attempt <= 0 or not srun_log:
        return
    try:
        with open(srun_log, "rb") as f:
            text = f.read(MAX_LOG_BYTES).decode(errors="replace")
    except OSError:
        return
    found = culprit(text)
    if found is None:
        return
    node, task, message = found
    history.append(run_dir, Traced(attempt=attempt - 1, node=node, task=task, message=message), job_id=job_id)
    print(f"alpsck: the job step of attempt {attempt - 1} failed first on node {node}"
          + (f" (task {task}: {message})" if task is not None else f" ({message})"), file=sys.stderr, flush=True)
    tl = timeline.read(Path(run_dir))
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
