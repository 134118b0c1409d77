"""The durations budget (tests/budget.toml): each test's time against the ceiling of its tier, or its own.

Off unless asked for (``--budget``, or ALPSCK_BUDGET=1 as CI sets it): then every test's duration
(setup + call + teardown, as the controller sees each report, so it works under pytest-xdist) is held
against its ceiling, and the session fails with a table naming every test over it, and every tier whose
total is over the tier's. A test that outgrows its tier (a unit test that starts processes, a process test
that waits for a job) fails visibly instead of slowing CI down unnoticed. ``--budget-report=FILE`` writes
the measured durations (JSON) to set the ceilings from.

A ceiling is for the test on a machine of its own. CI runs five lanes on two cores (a load of 10 is usual
there), and a test then takes several times as long as alone: each test's wall time is judged divided by
the machine's slowdown while it ran, the 1-minute load average (sampled as it starts and as it ends) over
the cores, between 1 and MAX_SLOWDOWN. CI once failed on a process test at 106.8 s of a 100 s ceiling whose
time alone is 31 s; a test grown tenfold still fails loudly, a busier day does not.
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
LOAD = "budget_load"
"""A user property: the 1-minute load average as the test's setup starts, and again as its teardown starts."""
MAX_SLOWDOWN = 4.0
"""The most a test's time is divided by: its own processes load the machine too (16 ranks on 2 cores), and
a test that starts processes where it should not must not hide behind the load it makes itself."""


def slowdown(loads: list[float], cores: int) -> float:
    """How much slower than alone a test ran: its mean load over the cores, between 1 and MAX_SLOWDOWN."""
    if not loads:
        return 1.0
    return min(max(sum(loads) / len(loads) / max(cores, 1), 1.0), MAX_SLOWDOWN)


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
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds (setup + call + teardown, less a fixture's wait for its turn)."""
    slowdowns: dict[str, float] = field(default_factory=dict)
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
        loads = [float(v) for k, v in report.user_properties if k == LOAD]
        self.slowdowns[report.nodeid] = slowdown(loads, self.cores)

    def judged(self, nodeid: str) -> float:
        """A test's seconds as if alone: its wall time over the slowdown it ran under."""
        return self.seconds[nodeid] / self.slowdowns.get(nodeid, 1.0)

    def totals(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        for nodeid in self.seconds:
            n, total = out.get(self.tiers[nodeid], (0, 0.0))
            out[self.tiers[nodeid]] = (n + 1, total + self.judged(nodeid))
        return out

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        for nodeid in sorted(self.seconds, key=lambda k: -self.judged(k)):
            limit = self.budget.ceiling(nodeid, self.tiers[nodeid])
            if self.judged(nodeid) > limit:
                self.over.append((nodeid, self.tiers[nodeid], self.judged(nodeid), limit))
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
            tr.write_line(f"{tier:8} {n:5d} tests {total:9.1f} s in all (as if alone)" + (f" (ceiling {cap:g} s)" if cap else "")
                          + f", each under {self.budget.per_test[tier]:g} s unless named")
        if not (self.over or self.tiers_over):
            tr.write_line("every test within its ceiling")
            return
        tr.write_line("")
        tr.write_line("OVER BUDGET: a test slower than its ceiling has outgrown its tier (move it, make it cheaper, "
                      "or name it in tests/budget.toml with a reason):", red=True, bold=True)
        tr.write_line(f"{'alone':>9} {'ceiling':>9}  {'tier':8} test (wall seconds / slowdown)")
        for nodeid, tier, secs, limit in self.over:
            tr.write_line(f"{secs:9.1f} {limit:9.1f}  {tier:8} {_relative(nodeid)} ({self.seconds[nodeid]:.1f} s / "
                          f"{self.slowdowns.get(nodeid, 1.0):.2f})", red=True)
        for tier, total, cap in self.tiers_over:
            tr.write_line(f"{total:9.1f} {cap:9.1f}  {tier:8} (the tier's total)", red=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("alpsck budget")
    group.addoption("--budget", action="store_true", default=False,
                    help="fail the session when a test outlasts its ceiling in tests/budget.toml (also ALPSCK_BUDGET=1)")
    group.addoption("--budget-report", default=None, metavar="FILE",
                    help="write each test's measured duration (seconds, JSON) to FILE")


def _enforced(config: pytest.Config) -> bool:
    return bool(config.getoption("--budget") or os.environ.get("ALPSCK_BUDGET") == "1")


def _sample_load(item: pytest.Item) -> None:
    if _enforced(item.config) or item.config.getoption("--budget-report"):
        item.user_properties.append((LOAD, os.getloadavg()[0]))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _sample_load(item)  # in the process that runs the test (an xdist worker): its report carries it


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _sample_load(item)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sees every report and judges
        return
    report = config.getoption("--budget-report")
    enforce = _enforced(config)
    if enforce or report:
        config.pluginmanager.register(_Recorder(Budget.load(), enforce, Path(report) if report else None), "alpsck-budget")
