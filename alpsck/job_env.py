"""The job this process runs in: its id, this task's rank, the task count, the restart count, its nodes.

:class:`JobEnv` is the one reader of the variables SLURM and submitit set for a job; everything
else (the run directory's lock record, the SLURM layer's runner and requeue) asks it. In a
submitit job (``SUBMITIT_EXECUTOR`` set: the SLURM or the local executor) submitit's own
``JobEnvironment`` says what the job id, rank and task count are; outside one (a runner started
by hand or by a test, a training under plain ``srun``) the SLURM, submitit-local and torchrun
variables do, in that order. SLURM's restart count (``SLURM_RESTART_COUNT``), which
``JobEnvironment`` does not expose, is read here too, and so are the batch script's in-job restart
variables (which start of the job step this is in its allocation, and how the one before ended).

It reads the environment when it is built (:meth:`JobEnv.detect`), and nothing after that.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


def _int(env: Mapping[str, str], *names: str, default: int = 0) -> int:
    """The first of ``names`` that holds an integer, else ``default``."""
    for n in names:
        v = env.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return default


# Set by the batch script's restart loop for each start of the job step (alpsck.slurm.submit).
ATTEMPT_ENV = "ALPSCK_ATTEMPT"
PREVIOUS_EXIT_ENV = "ALPSCK_PREVIOUS_EXIT"
PREVIOUS_END_ENV = "ALPSCK_PREVIOUS_END"


def rendezvous_port(*key: object) -> int:
    """A TCP port for a group of a job's tasks to meet on, the same on every task and drawn from ``key`` (the job's
    id and the start's attempt: a new one for each, so that new tasks never meet an old store still closing).

    Drawn below Linux's default range of ephemeral ports (32768-60999): a port in it can be the local port of
    any outgoing connection on the node, and the store's listen then fails with EADDRINUSE (seen in CI:
    submitit's draw, 20000-60000, gave 48974 while other jobs' connections held it)."""
    import random

    return random.Random("/".join(map(str, key))).randint(*_PORTS)


_PORTS = (20000, 32767)  # below the ephemeral ports (rendezvous_port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no socket is bound to now, drawn as :func:`rendezvous_port`'s are (below the
    ephemeral ports, which any outgoing connection may take between this check and the listen): for a store
    that one process starts on its own host (tests, benchmarks)."""
    import random
    import socket

    for _ in range(1000):
        port = random.randint(*_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port in {_PORTS[0]}-{_PORTS[1]} on {host}")


def hostnames(nodelist: str) -> list[str]:
    """SLURM's hostlist syntax (``n[1-3,5]``, as in ``SLURM_JOB_NODELIST``) as names: submitit's own reader."""
    from submitit.slurm.slurm import _parse_node_list

    return list(_parse_node_list(nodelist)) if nodelist else []


def _float(v: str | None) -> float | None:
    try:
        f = float(v) if v else None
    except ValueError:
        return None
    return f if f is not None and f == f and abs(f) < 1e12 else None


@dataclass(frozen=True)
class JobEnv:
    """Where this process runs; the defaults describe a process outside any job."""

    job_id: str | None = None        # the job's id (an array task's is "ARRAY_TASK"); None outside a job
    rank: int = 0                    # this task's global rank
    world_size: int = 1              # tasks in the job step
    local: bool = False              # run by submitit's local executor (no SLURM)
    slurm_job_id: str | None = None  # $SLURM_JOB_ID, the id scontrol takes; None outside SLURM
    slurm_restarts: int | None = None  # this start's SLURM restart count; None where SLURM does not say
    # The batch script's in-job restarts (alpsck.slurm.submit.restart_loop_lines): which start of the job step
    # in this allocation this is (0: the first), and how the one before ended (its srun exit code, and when).
    attempt: int = 0
    previous_exit: int | None = None
    previous_end: float | None = None
    # SLURM's nodes, in its hostlist syntax as it set them (``nodes``/``step_nodes`` expand them): the allocation's
    # ($SLURM_JOB_NODELIST) and the job step's ($SLURM_STEP_NODELIST; a step on some of them: a spare, a lost node),
    # and the job's partition ($SLURM_JOB_PARTITION). Empty outside SLURM.
    job_nodelist: str = ""
    step_nodelist: str = ""
    partition: str = ""

    @property
    def nodes(self) -> list[str]:
        """The allocation's nodes by name ([] outside SLURM)."""
        return hostnames(self.job_nodelist)

    @property
    def step_nodes(self) -> list[str]:
        """The job step's nodes by name ([] outside a SLURM job step)."""
        return hostnames(self.step_nodelist)

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
        env = os.environ if environ is None else environ
        slurm_job_id = env.get("SLURM_JOB_ID") or None
        local_id = env.get("SUBMITIT_LOCAL_JOB_ID") or None
        # SLURM sets the restart count only once the job was requeued: 0 before that in a SLURM job.
        restarts = (_int(env, "SLURM_RESTART_COUNT") if "SLURM_RESTART_COUNT" in env
                    else 0 if slurm_job_id else None)
        attempt = max(0, _int(env, ATTEMPT_ENV))
        previous_exit = _int(env, PREVIOUS_EXIT_ENV, default=-1) if attempt else -1
        previous_end = _float(env.get(PREVIOUS_END_ENV)) if attempt else None
        ended = previous_exit if previous_exit >= 0 else None
        slurm = {"job_nodelist": env.get("SLURM_JOB_NODELIST", "").strip(),
                 "step_nodelist": env.get("SLURM_STEP_NODELIST", "").strip(),
                 "partition": env.get("SLURM_JOB_PARTITION", "").strip()}
        if env.get("SUBMITIT_EXECUTOR") and environ is None:
            import submitit

            sub = submitit.JobEnvironment()
            return cls(str(sub.job_id), sub.global_rank, sub.num_tasks, local_id is not None, slurm_job_id, restarts,
                       attempt, ended, previous_end, **slurm)
        return cls(job_id=slurm_job_id or local_id,
                   rank=_int(env, "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID", "RANK"),
                   world_size=_int(env, "SLURM_NTASKS", "SUBMITIT_LOCAL_NTASKS", "WORLD_SIZE", default=1),
                   local=local_id is not None, slurm_job_id=slurm_job_id, slurm_restarts=restarts, attempt=attempt,
                   previous_exit=ended, previous_end=previous_end, **slurm)
