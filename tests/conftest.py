"""Fixtures shared across the tiers, and the path to the support package (no test module imports another:
what they share is in tests/support/). The tiers' own conftest.py files mark their tests; the durations
budget (tests/budget.toml, ``--budget``) is tests/support/budget.py, registered here."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# `support.<module>` importable from any working directory (tests/run.sh runs pytest from a temporary one).
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

pytest_plugins = ["support.budget"]


@pytest.fixture(params=["fs", "alpsck"])
def backend(request: pytest.FixtureRequest) -> Any:
    """The DCP storage backend a contract case runs on: DCP's FileSystemWriter/Reader (the reference), then
    alpsck's (support/dcp_backends.py)."""
    from support.dcp_backends import BACKENDS

    return BACKENDS[request.param]


@pytest.fixture
def dcp_quiet() -> Iterator[None]:
    """DCP's warnings about running without a process group and its deprecated names, silenced (the DCP
    contract tests run its single-process cases on purpose)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*save_state_dict.*deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*load_state_dict.*deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        yield


@pytest.fixture(autouse=True)
def _no_warm_process_outlives_its_test() -> Iterator[None]:
    """A warm process (support/warm.py) a test left running is killed after it, with a warning naming it: a
    rank that runs on would hold the test process at exit, and a CI would hang instead of failing (CI13)."""
    yield
    warm = sys.modules.get("support.warm")
    if warm is not None:
        killed = warm.kill_leftovers()
        if killed:
            warnings.warn(f"warm processes still running after the test, killed: {killed}", RuntimeWarning,
                          stacklevel=1)
