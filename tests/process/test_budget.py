"""The durations budget (tests/support/budget.py) in a pytest of its own: a test over its tier's ceiling fails
the session with a table naming it, serially and under pytest-xdist; a named test's own ceiling and a tier's
total are held too; without --budget nothing is judged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import SUPPORT
from support.budget import MAX_SLOWDOWN, slowdown

BUDGET = """
[tiers.unit]
per_test = 0.2
total = {total}
[tiers.process]
per_test = 60
[tiers.ranks]
per_test = 60
[tiers.slurm]
per_test = 60
[tiers.gpu]
per_test = 60
[tests]
"tests/unit/test_probe.py::test_named" = 5
"""

PROBE = """
import time
import pytest

def test_fast():
    pass

def test_slow():
    time.sleep(1.2)

def test_named():
    time.sleep(1.2)

@pytest.mark.parametrize("n", [1, 2])
def test_cases(n):
    pass
"""


def _pytest(tmp_path: Path, *args: str, total: float = 100) -> subprocess.CompletedProcess[str]:
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True, exist_ok=True)
    (tests / "unit" / "test_probe.py").write_text(PROBE)
    (tests / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(SUPPORT.parent)!r})\n"
                                       "pytest_plugins = ['support.budget']\n")
    (tmp_path / "budget.toml").write_text(BUDGET.format(total=total))
    env = {**os.environ, "ALPSCK_BUDGET_FILE": str(tmp_path / "budget.toml")}
    env.pop("ALPSCK_BUDGET", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, str(tests), *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)


@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_test_over_its_ceiling_fails_the_session_naming_it(tmp_path: Path, xdist: list[str]) -> None:
    r = _pytest(tmp_path, "--budget", *xdist)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "5 passed" in r.stdout, r.stdout
    table = r.stdout[r.stdout.index("OVER BUDGET"):]
    # 1.2 s of sleep over a 0.2 s ceiling: over it whatever the load (the most it is divided by is 4)
    assert "tests/unit/test_probe.py::test_slow" in table, table
    assert "test_named" not in table and "test_fast" not in table, table  # its own ceiling; well under


def test_a_tiers_total_over_its_ceiling_fails(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "--budget", "-k", "not slow", total=0.1)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "(the tier's total)" in r.stdout[r.stdout.index("OVER BUDGET"):], r.stdout


def test_without_budget_nothing_is_judged_and_a_report_is_written(tmp_path: Path) -> None:
    report = tmp_path / "durations.json"
    r = _pytest(tmp_path, f"--budget-report={report}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OVER BUDGET" in r.stdout  # reported, not judged
    import json
    seconds = json.loads(report.read_text())
    assert set(seconds) == {f"tests/unit/test_probe.py::{t}" for t in
                            ("test_fast", "test_slow", "test_named", "test_cases[1]", "test_cases[2]")}
    assert seconds["tests/unit/test_probe.py::test_slow"] >= 1.2


def test_a_test_is_judged_by_its_time_alone_the_load_it_ran_under_divided_out_up_to_a_bound() -> None:
    assert slowdown([], 2) == 1.0  # no samples: judged as measured
    assert slowdown([0.5, 1.5], 2) == 1.0  # an idle machine never makes a test faster than measured
    assert slowdown([6.0, 10.0], 2) == 4.0  # CI's five lanes on two cores: a 4x slower day
    assert slowdown([3.0, 3.0], 2) == 1.5
    assert slowdown([40.0, 40.0], 2) == MAX_SLOWDOWN  # its own 16 ranks must not hide a test's cost
