"""Spare nodes (``slurm.spare_nodes``): a node's loss costs a restart inside the allocation, not a requeue.

The job is allocated ``nodes + spare_nodes`` nodes and submitted with ``--no-kill``, so that SLURM keeps the
allocation when one of its nodes fails. Measured on the multi-node local SLURM (slurm/local-cluster,
SlurmdTimeout 10 s): 25 s after a node was killed, srun reported "Node failure" and ended the step (exit
137), and SLURM had dropped the node from the job (its NodeList went from ``n[1-3]`` to ``n[1,3]``) and
marked it down; the job kept running and its id. Every job step runs on ``nodes`` of the allocation's nodes
(``srun --nodes --ntasks``, :func:`srun_arguments`), so the step the batch script's restart loop starts next
lands on the survivors and a spare, and the lost node's ranks restore from the memory tier's replica on
another node (:mod:`alpsck.memory.restore`) or from the run directory.

Before each restart the loop calls :data:`PLACE` (:func:`batch_lines`): SLURM is asked which of the
allocation's nodes cannot take a step (down, drained, failing, not responding: a node that died moments ago
shows as not responding before SLURM drops it) and those are excluded (``srun --exclude``). When fewer than
``nodes`` remain, the job is requeued (a new allocation, which resumes from the run directory: memory does
not survive the allocation), as a job without spares is requeued by SLURM when it loses a node.

Without spares nothing here applies: SLURM ends the job on a node's failure and requeues it (``--requeue``).
"""

from __future__ import annotations

from . import history
from .config import JobConfig

PLACE = "alpsck_place_step"  # the batch script's function; sets EXCLUDE, or fails: too few nodes left
EXCLUDE = "alpsck_exclude"   # the nodes a restarted step must not use, comma-separated (empty: none)

# The node states (sinfo %t) a step can start on; a flag suffix that leaves the node up is dropped first
# (_HARMLESS_FLAGS: $ in a maintenance reservation, @ a reboot pending after the jobs, ^ a reboot issued, - planned
# for a waiting job); any other (* not responding, ~ # % ! powered off or powering up or down) makes it unusable.
_USABLE = ("alloc", "mix", "idle", "comp", "resv", "plnd")
_HARMLESS_FLAGS = "$@^-"


# What the history says when too few nodes are left: a requeue, by scontrol (the health gate's is reason "health").
REQUEUED = history.Requeued(reason="nodes", mechanism="scontrol")


def in_use(cfg: JobConfig) -> bool:
    return cfg.slurm.spare_nodes > 0


def allocated_nodes(cfg: JobConfig) -> int:
    """The nodes sbatch asks for: the step's and the spares."""
    return cfg.slurm.nodes + cfg.slurm.spare_nodes


def srun_arguments(cfg: JobConfig) -> list[str]:
    """Each job step on ``nodes`` nodes of the allocation, ``tasks_per_node`` tasks each (the allocation's
    own counts, which srun would take by default, include the spares)."""
    if not in_use(cfg):
        return []
    s = cfg.slurm
    # --overlap: a step that ran on a node that died stays behind, completing, holding its other nodes' resources
    # (measured: SLURM 22.05 listed it for minutes, and a new step waited "Requested nodes are busy" until it gave
    # up); its tasks are gone, so the new step may share what it holds.
    return [f"--nodes={s.nodes}", f"--ntasks={s.nodes * s.tasks_per_node}", f"--ntasks-per-node={s.tasks_per_node}",
            "--overlap"]


def step_lines(srun_line: str) -> list[str]:
    """The restart loop's start of a job step (submitit's ``srun_line``): a restart (an attempt after the
    first, ``ALPSCK_ATTEMPT``) first places the step (:data:`PLACE`), or leaves the loop when the job was
    requeued; srun then leaves out :data:`EXCLUDE`'s nodes."""
    assert srun_line.startswith("srun ")
    return [f'  if [ "$alpsck_attempt" -gt 0 ]; then {PLACE} || break; fi',
            f'srun ${{{EXCLUDE}:+"--exclude=${EXCLUDE}"}}' + srun_line[len("srun"):]]


def batch_lines(cfg: JobConfig) -> list[str]:
    """The batch script's :data:`PLACE` function (only with spares): every value in it is an int from the
    config or SLURM's own output, never config text. A requeue is recorded in the history (:data:`REQUEUED`,
    by :func:`history.shell_event_lines`)."""
    if not in_use(cfg):
        return []
    need = int(cfg.slurm.nodes)
    usable = "|".join(_USABLE)
    return [
        *history.shell_event_lines(),
        "# slurm.spare_nodes: before a restart, the nodes of this allocation SLURM cannot start a step on are excluded",
        f"{EXCLUDE}=",
        f"{PLACE}() {{",
        "  local nodes bad total left",
        '  nodes=$(squeue -h -j "$SLURM_JOB_ID" -o %N 2>/dev/null)',
        '  [ -n "$nodes" ] || return 0  # no answer: SLURM places the step itself',
        f"  bad=$(sinfo -h -N -n \"$nodes\" -o '%N %t' 2>/dev/null | awk '{{s = $2; gsub(/[{_HARMLESS_FLAGS}]+$/, "
        f"\"\", s)}} s !~ /^({usable})$/ {{print $1}}' | sort -u | paste -sd, -)",
        '  total=$(scontrol show hostnames "$nodes" | wc -l)',
        '  left=$((total - $(printf "%s" "$bad" | tr , "\\n" | grep -c .)))',
        f'  {EXCLUDE}=$bad',
        f'  if [ "$left" -lt {need} ]; then',
        f'    echo "alpsck: $left usable node(s) left in this allocation ($nodes; not usable: ${{bad:-none}}), the job '
        f'step needs {need}: requeueing the job" >&2',
        "    trap '' TERM  # the SIGTERM the requeue brings must not kill what records it (the script ends here)",
        f'    if scontrol requeue "$SLURM_JOB_ID"; then {history.shell_event(REQUEUED)}',
        '    else echo "alpsck: the requeue failed: the job ends here" >&2; fi',
        "    return 1",
        "  fi",
        '  [ -z "$bad" ] || echo "alpsck: the restarted job step excludes $bad (SLURM cannot start a step there)" >&2',
        "}",
    ]
