"""The slurm tier: jobs: the local SLURM cluster (the cluster fixture) or submitit's local executor. Every test
in this folder is marked `slurm` (docs/testing.md)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from support.budget import WAITED

# The tests of this tier share one cluster and run side by side (pytest-xdist, tests/run.sh). A test
# that changes the whole node (a preempting --exclusive job, a maintenance reservation) is marked
# `cluster_exclusive` and runs alone: it holds this file's lock exclusively, the others share it.
CLUSTER_LOCK = os.environ.get("ALPSCK_CLUSTER_LOCK", "/tmp/alpsck-cluster-tests.lock")


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


@pytest.fixture(autouse=True)
def _cluster_turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that uses the cluster takes its turn: shared with the other cluster tests, alone when
    it is marked ``cluster_exclusive`` (it waits for the running ones to end, and none starts meanwhile)."""
    if "cluster" not in request.fixturenames:
        yield
        return
    exclusive = request.node.get_closest_marker("cluster_exclusive") is not None
    with open(CLUSTER_LOCK, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        request.node.user_properties.append((WAITED, time.monotonic() - t0))  # not the test's own time
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
