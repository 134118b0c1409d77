"""checkpoint.every: auto (alpsck.slurm.interval): Daly's interval from the measured save cost and the MTBF."""

from __future__ import annotations

import math
from typing import Any

import pytest

from alpsck.errors import ConfigError
from alpsck.slurm import history
from alpsck.slurm.config import parse_config
from alpsck.slurm.interval import DEFAULT_MTBF_S, AutoInterval, daly_interval, observed_mtbf


def test_daly_is_young_for_a_small_cost_and_the_mtbf_for_a_huge_one() -> None:
    assert daly_interval(1.0, 1e8) == pytest.approx(math.sqrt(2 * 1e8), rel=1e-3)  # Young's limit, C << M
    assert daly_interval(10.0, 3600.0) == pytest.approx(math.sqrt(2 * 10 * 3600) * (1 + math.sqrt(10 / 7200) / 3
                                                                                    + 10 / 7200 / 9) - 10)
    assert daly_interval(5000.0, 1000.0) == 1000.0  # C >= 2M: checkpoint once per MTBF
    assert daly_interval(0.0, 3600.0) == 1.0  # a free save: never more often than each second


def _ev(t: float, event: str, **f: Any) -> dict[str, Any]:
    rec = history.normalise({"time": t, "event": event, "job_id": "7", **f})
    assert rec is not None
    return rec


def test_the_mtbf_observed_in_a_history() -> None:
    assert observed_mtbf([_ev(0, "started"), _ev(100, "finished")]) is None  # no failure yet
    events = [_ev(0, "started"), _ev(101, "crashed", time_of_end=100.0), _ev(102, "started", attempt=1),
              _ev(302, "hang"), _ev(310, "started", attempt=2), _ev(410, "times", step_s=90.0),
              _ev(410, "finished")]
    assert observed_mtbf(events) == pytest.approx((100 + 200 + 100) / 2)


def test_auto_interval_measures_the_save_cost_and_records_the_interval() -> None:
    """Steps of 1 s; a step that saves takes 0.5 s more. The first save comes after 3 measured steps; from then
    on the interval is Daly's for C = 0.5 s and the configured M, and the steps between saves follow it."""
    clock = [0.0]
    recorded: list[dict[str, Any]] = []
    auto = AutoInterval(200.0, [], lambda **kw: recorded.append(kw), clock=lambda: clock[0])
    saves = []
    for step in range(200):
        if auto.due():
            saves.append(step)
            clock[0] += 1.5
        else:
            clock[0] += 1.0
    want = daly_interval(0.5, 200.0)
    assert saves[0] == 3 and auto.interval_s == pytest.approx(want)
    gaps = {b - a for a, b in zip(saves[1:], saves[2:], strict=False)}
    assert gaps <= {math.ceil(want), math.ceil(want) + 1}, (saves, want)
    assert recorded == [{"seconds": round(want, 3), "save_cost_s": 0.5, "mtbf_s": 200.0, "mtbf_from": "configured",
                         "rule": "daly"}]


def test_the_mtbf_comes_from_the_history_else_a_day() -> None:
    events = [_ev(0, "started"), _ev(61, "crashed", time_of_end=60.0), _ev(62, "started", attempt=1)]
    assert AutoInterval(None, events, lambda **kw: None).mtbf_from == "observed"
    assert AutoInterval(None, events, lambda **kw: None).mtbf_s == 60.0
    auto = AutoInterval(None, [], lambda **kw: None)
    assert (auto.mtbf_s, auto.mtbf_from) == (DEFAULT_MTBF_S, "default")


def test_the_config_takes_auto_only() -> None:
    base = "name: t\nrun_dir: /tmp/x\nentry:\n  function: m:f\ncheckpoint:\n"
    cfg = parse_config(base + "  every: auto\n  mtbf_s: 3600\n")
    assert cfg.checkpoint.every == "auto" and cfg.checkpoint.mtbf_s == 3600
    with pytest.raises(ConfigError, match=r"checkpoint\.every.*the only value is auto"):
        parse_config(base + "  every: sometimes\n")
    with pytest.raises(ConfigError, match=r"checkpoint\.mtbf_s"):
        parse_config(base + "  every: auto\n  mtbf_s: 0\n")
