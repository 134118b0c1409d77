"""JobEnv in a real submitit job (the local executor, two tasks); the rest of JobEnv is tests/unit/test_job_env.py."""

from __future__ import annotations

from pathlib import Path

import submitit

from alpsck.job_env import JobEnv


def test_in_a_submitit_job_submitits_job_environment_says(tmp_path: Path) -> None:
    """A real submitit job (the local executor, two tasks): what JobEnv reports is what submitit's
    JobEnvironment says, task by task."""
    ex = submitit.LocalExecutor(folder=tmp_path)
    ex.update_parameters(tasks_per_node=2, nodes=1, timeout_min=2)
    job = ex.submit(JobEnv.detect)  # importable in the job (this test module is not)
    envs = job.results()
    assert sorted(e.rank for e in envs) == [0, 1]
    assert {e.world_size for e in envs} == {2} and {e.job_id for e in envs} == {str(job.job_id)}
    assert all(e.local and e.slurm_job_id is None for e in envs)
