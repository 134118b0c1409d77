"""The slurm tier: jobs: the local SLURM cluster (the cluster fixture) or submitit's local executor. Every test
in this folder is marked `slurm` (docs/testing.md)."""

from __future__ import annotations

import os
import subprocess

import pytest


def pytest_itemcollected(item: pytest.Item) -> None:
    """Called for the items of this folder only (conftest scoping), before ``-m`` selects."""
    item.add_marker(pytest.mark.slurm)


@pytest.fixture(scope="module")
def cluster() -> None:
    """A SLURM controller that answers (slurm/local-cluster/start.sh; tests/run.sh starts it): in CI a
    test that needs it fails without it, elsewhere it skips."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
        ok = out.returncode == 0 and out.stdout.strip() != ""
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        msg = "no SLURM cluster reachable: run slurm/local-cluster/start.sh (tests/run.sh does)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
