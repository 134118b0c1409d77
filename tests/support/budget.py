"""The durations budget (tests/budget.toml): each test's time against the ceiling of its tier, or its own.

Off unless asked for (``--budget``, or ALPSCK_BUDGET=1 as CI sets it): then every test's duration
(setup + call + teardown, as the controller sees each report, so it works under pytest-xdist) is held
against its ceiling, and the session fails with a table naming every test over it, and every tier whose
total is over the tier's. A test that outgrows its tier (a unit test that starts processes, a process test
that waits for a job) fails visibly instead of slowing CI down unnoticed. ``--budget-report=FILE`` writes
the measured durations (JSON) to set the ceilings from.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

BUDGET_FILE = Path(__file__).resolve().parents[1] / "budget.toml"
"""The ceilings CI holds the tests to (ALPSCK_BUDGET_FILE names another, as the plugin's own test does)."""
TIERS = ("unit", "process", "ranks", "slurm", "gpu")
WAITED = "budget_waited_s"
"""A user property (seconds) a fixture records when it waited for its turn (the slurm tier's cluster lock): the
budget leaves that wait out of the test's setup time."""


@dataclass(frozen=True)
class Budget:
    """Ceilings in seconds: per test and in total by tier, and the named tests' own."""

    per_test: dict[str, float]
    total: dict[str, float]
    named: dict[str, float]

    @classmethod
    def load(cls, path: Path | None = None) -> Budget:
        path = path or Path(os.environ.get("ALPSCK_BUDGET_FILE", BUDGET_FILE))
        data = tomllib.loads(path.read_text())
        tiers = data.get("tiers", {})
        unknown = sorted(set(tiers) - set(TIERS))
        if unknown:
            raise pytest.UsageError(f"{path}: unknown tier(s) {', '.join(unknown)} (the tiers: {', '.join(TIERS)})")
        missing = [t for t in TIERS if "per_test" not in tiers.get(t, {})]
        if missing:
            raise pytest.UsageError(f"{path}: no per_test ceiling for tier(s) {', '.join(missing)}")
        return cls(per_test={t: float(tiers[t]["per_test"]) for t in TIERS},
                   total={t: float(tiers[t]["total"]) for t in TIERS if "total" in tiers[t]},
                   named={str(k): float(v) for k, v in data.get("tests", {}).items()})

    def ceiling(self, nodeid: str, tier: str) -> float:
        """A named test's own ceiling (its id, its id without the parameters, or its file names it), else its tier's."""
        key = _relative(nodeid)
        for name in (key, re.sub(r"\[.*\]$", "", key), key.split("::")[0]):
            if name in self.named:
                return self.named[name]
        return self.per_test[tier]


def _relative(nodeid: str) -> str:
    """The id from tests/ on (``tests/unit/test_x.py::test_y``), whatever the rootdir."""
    i = nodeid.find("tests/")
    return nodeid[i:] if i >= 0 else nodeid


def tier_of(nodeid: str, keywords: Any) -> str | None:
    """The tier a report belongs to: its folder, else its marker (a test's keywords also hold its
    parameters' ids, and ``test_x[process]`` in tests/ranks/ is a ranks test)."""
    parts = _relative(nodeid).split("/")
    if len(parts) > 2 and parts[1] in TIERS:
        return parts[1]
    for tier in TIERS:
        if tier in keywords:
            return tier
    return None


@dataclass(eq=False)  # a plugin object: hashed by identity
class _Recorder:
    budget: Budget
    enforce: bool
    report_path: Path | None
    seconds: dict[str, float] = field(default_factory=dict)
    tiers: dict[str, str] = field(default_factory=dict)
    over: list[tuple[str, str, float, float]] = field(default_factory=list)
    tiers_over: list[tuple[str, float, float]] = field(default_factory=list)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        tier = tier_of(report.nodeid, report.keywords)
        if tier is None or report.skipped:
            return
        self.tiers[report.nodeid] = tier
        secs = report.duration
        if report.when == "setup":  # time a test waited for its turn at a shared resource is not its own
            secs -= sum(v for k, v in report.user_properties if k == WAITED)
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + max(secs, 0.0)

    def totals(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        for nodeid, secs in self.seconds.items():
            n, total = out.get(self.tiers[nodeid], (0, 0.0))
            out[self.tiers[nodeid]] = (n + 1, total + secs)
        return out

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        for nodeid, secs in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            limit = self.budget.ceiling(nodeid, self.tiers[nodeid])
            if secs > limit:
                self.over.append((nodeid, self.tiers[nodeid], secs, limit))
        for tier, (_, total) in sorted(self.totals().items()):
            if tier in self.budget.total and total > self.budget.total[tier]:
                self.tiers_over.append((tier, total, self.budget.total[tier]))
        if self.report_path is not None:
            self.report_path.write_text(json.dumps({_relative(k): round(v, 3) for k, v in sorted(self.seconds.items())},
                                                   indent=1) + "\n")
        passed = session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.enforce and (self.over or self.tiers_over) and passed:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        tr = terminalreporter
        tr.section("durations budget (tests/budget.toml)")
        for tier, (n, total) in sorted(self.totals().items(), key=lambda kv: TIERS.index(kv[0])):
            cap = self.budget.total.get(tier)
            tr.write_line(f"{tier:8} {n:5d} tests {total:9.1f} s in all" + (f" (ceiling {cap:g} s)" if cap else "")
                          + f", each under {self.budget.per_test[tier]:g} s unless named")
        if not (self.over or self.tiers_over):
            tr.write_line("every test within its ceiling")
            return
        tr.write_line("")
        tr.write_line("OVER BUDGET: a test slower than its ceiling has outgrown its tier (move it, make it cheaper, "
                      "or name it in tests/budget.toml with a reason):", red=True, bold=True)
        tr.write_line(f"{'seconds':>9} {'ceiling':>9}  {'tier':8} test")
        for nodeid, tier, secs, limit in self.over:
            tr.write_line(f"{secs:9.1f} {limit:9.1f}  {tier:8} {_relative(nodeid)}", red=True)
        for tier, total, cap in self.tiers_over:
            tr.write_line(f"{total:9.1f} {cap:9.1f}  {tier:8} (the tier's total)", red=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("alpsck budget")
    group.addoption("--budget", action="store_true", default=False,
                    help="fail the session when a test outlasts its ceiling in tests/budget.toml (also ALPSCK_BUDGET=1)")
    group.addoption("--budget-report", default=None, metavar="FILE",
                    help="write each test's measured duration (seconds, JSON) to FILE")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sees every report and judges
        return
    report = config.getoption("--budget-report")
    enforce = bool(config.getoption("--budget") or os.environ.get("ALPSCK_BUDGET") == "1")
    if enforce or report:
        config.pluginmanager.register(_Recorder(Budget.load(), enforce, Path(report) if report else None), "alpsck-budget")
