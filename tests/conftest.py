"""Fixtures shared by the test modules (pytest finds them here; no test module imports another)."""

from __future__ import annotations

import os
import subprocess

import pytest


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

