"""JobEnv: the one reader of job ids, ranks and restart counts (alpsck/job_env.py)."""

from __future__ import annotations

import pytest

from alpsck.job_env import JobEnv


def test_outside_any_job() -> None:
    assert JobEnv.detect({}) == JobEnv(job_id=None, rank=0, world_size=1, local=False, slurm_job_id=None,
                                       slurm_restarts=None)


def test_a_slurm_task_before_and_after_a_requeue() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "8"}
    first = JobEnv.detect(env)
    assert (first.job_id, first.rank, first.world_size, first.slurm_job_id) == ("4242", 3, 8, "4242")
    assert first.slurm_restarts == 0 and not first.local  # SLURM sets the count only once the job was requeued
    assert JobEnv.detect({**env, "SLURM_RESTART_COUNT": "2"}).slurm_restarts == 2


def test_the_allocations_nodes_the_steps_and_the_partition() -> None:
    """The nodes as SLURM's hostlist syntax gives them, expanded when asked; none outside SLURM."""
    job = JobEnv.detect({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "nid[001-003,007]", "SLURM_STEP_NODELIST": "nid[002-003]",
                         "SLURM_JOB_PARTITION": "normal"})
    assert job.nodes == ["nid001", "nid002", "nid003", "nid007"] and job.step_nodes == ["nid002", "nid003"]
    assert job.partition == "normal"
    outside = JobEnv.detect({})
    assert (outside.nodes, outside.step_nodes, outside.partition) == ([], [], "")


def test_the_local_executor_and_torchrun_variables() -> None:
    local = JobEnv.detect({"SUBMITIT_LOCAL_JOB_ID": "L1", "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_NTASKS": "2"})
    assert (local.job_id, local.rank, local.world_size, local.local) == ("L1", 1, 2, True)
    assert local.slurm_job_id is None and local.slurm_restarts is None  # the runner counts starts in the history
    torchrun = JobEnv.detect({"RANK": "5", "WORLD_SIZE": "6"})
    assert (torchrun.job_id, torchrun.rank, torchrun.world_size) == (None, 5, 6)
    # SLURM's variables come first; a value that is not a number is not taken
    mixed = JobEnv.detect({"SLURM_JOB_ID": "9", "SLURM_PROCID": "x", "RANK": "4", "SLURM_NTASKS": "7", "WORLD_SIZE": "2"})
    assert (mixed.rank, mixed.world_size) == (4, 7)


def test_a_free_port_is_one_nothing_holds_below_the_ephemeral_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """free_port (the tests' and benchmarks' stores) draws as rendezvous_port does, below 32768, where no outgoing
    connection takes a port between the draw and the store's listen; a port something holds is drawn again."""
    import random
    import socket

    from alpsck import job_env

    with socket.socket() as held:
        held.bind(("127.0.0.1", job_env.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken, taken + 1 if taken < 32767 else taken - 1])
        monkeypatch.setattr(random, "randint", lambda lo, hi: next(draws))
        port = job_env.free_port()
    assert port != taken and 20000 <= port <= 32767
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free indeed
