"""alpsck status's goodput (alpsck.slurm.goodput): where a run's wall time went, from its history alone. The
parts add up to the wall time; each restart has its cause. On a real job: test_slurm_cluster.py's in-job
restart tests read it from ``status --json``."""

from __future__ import annotations

from typing import Any

import pytest

from alpsck.slurm import goodput, history


def _ev(t: float, event: str, **f: Any) -> dict[str, Any]:
    rec = history.normalise({"time": t, "event": event, "job_id": "7", **f})
    assert rec is not None
    return rec


def _times(t: float, start: float, step: float, save: float = 0.0, final: float = 0.0) -> dict[str, Any]:
    return _ev(t, "times", start_s=start, step_s=step, save_s=save, restore_s=0.0, final_s=final, polls=10)


RUN = [  # 0: submitted; a start SIGKILLed at 100 (in-job restart at 102); a time-limit requeue; a start that finishes
    _ev(0, "submitted", backend="slurm"),
    _ev(10, "started", restart=0, backend="slurm"),
    _ev(101.5, "crashed", attempt=0, exit_code=137, time_of_end=100.0, signal="SIGKILL"),
    _ev(102, "started", restart=0, attempt=1, down_s=2.0, backend="slurm"),
    _times(290, start=4.0, step=169.0, save=6.0, final=9.0),
    _ev(290, "signal", reason="timeout"), _ev(290.5, "final_checkpoint", reason="timeout", seconds=9.0, step=200),
    _ev(291, "requeued", reason="timeout", progress=True, mechanism="scontrol", step=200),
    _ev(400, "started", restart=1, backend="slurm", step=200, step_taken_at=289.0),
    _times(500, start=5.0, step=94.0, save=1.0),
    _ev(500, "finished", step=300),
]


def test_the_parts_add_up_to_the_wall_time_and_each_restart_has_its_cause() -> None:
    g = goodput.goodput(RUN)
    assert g is not None
    assert g["wall_s"] == 490.0  # first start to the end
    parts = sum(g[f"{k}_s"] for k in goodput.PARTS)
    assert parts == pytest.approx(g["wall_s"], rel=0.01)
    assert g["training_s"] == 263.0 and g["stall_s"] == 7.0 and g["final_s"] == 9.0 and g["startup_s"] == 9.0
    assert g["unaccounted_s"] == pytest.approx(90.0 + 1.0)  # the killed start (10 -> 100), a second of teardown
    assert g["restart_gap_s"] == 2.0 and g["queue_s"] == 109.0
    assert g["ettr"] == pytest.approx(263.0 / 490.0, abs=1e-4)
    assert [(r["cause"], r["in_allocation"], r["restart_s"]) for r in g["restarts"]] == [
        ("crashed", True, 6.0), ("timeout", False, 114.0)]
    text = goodput.line(g)
    assert text.startswith("goodput: ETTR 54% (training 4m23s of 8m10s;") and "restarts: 1 crashed, 1 timeout" in text


def test_a_hang_a_failure_and_a_run_still_going() -> None:
    events = [_ev(0, "started", restart=0, backend="slurm"),
              _ev(50, "hang", section="step", seconds=8.5, timeout_s=8.0, attempt=0),
              _ev(52, "started", restart=0, attempt=1, backend="slurm"),
              _times(80, start=3.0, step=25.0),
              _ev(80, "failed", message="RuntimeError: x", will_restart=True, will_requeue=False),
              _ev(81, "started", restart=0, attempt=2, backend="slurm")]
    g = goodput.goodput(events, now=100.0)
    assert g is not None and g["wall_s"] == 100.0
    assert [r["cause"] for r in g["restarts"]] == ["hang", "failed"]
    assert [r["restart_s"] for r in g["restarts"]] == [5.0, 1.0]  # to the first poll; the last start logged none yet
    assert g["restarts"][0]["detect_s"] == 8.5 and g["restarts"][0]["setup_s"] == 3.0
    parts = sum(g[f"{k}_s"] for k in goodput.PARTS)
    assert parts == pytest.approx(100.0, rel=0.01) and g["unaccounted_s"] == pytest.approx(50 + 19.0)


def test_work_lost_and_each_restart_split_into_its_parts() -> None:
    """A hang at 60 after 50 s of steps; the next start resumes from a state taken at 45: 15 s trained again
    (about 15 steps of 0.98 s). Its failure at 100 loses what it trained after 90. The restart's parts: the
    hang's detection, teardown to the step's end, the new step's start (srun, imports), set-up, restore and
    the first step; ETTR counts only the training that stayed."""
    steps = {"polls": 51}
    events = [_ev(0, "started", restart=0, backend="slurm"),
              _ev(60, "times", start_s=5.0, step_s=50.0, save_s=5.0, restore_s=0.0, final_s=0.0, **steps),
              _ev(60, "hang", section="step", seconds=9.0, timeout_s=8.0, attempt=0),
              _ev(65, "started", restart=0, attempt=1, down_s=2.0, step=40, step_taken_at=45.0, backend="slurm"),
              _ev(100, "times", start_s=3.0, restore_s=1.0, step_s=30.0, save_s=1.0, final_s=0.0, polls=31,
                  first_step_s=0.5),
              _ev(100, "failed", message="RuntimeError: x", will_restart=True, will_requeue=False),
              _ev(103, "started", restart=0, attempt=2, down_s=2.5, step=70, step_taken_at=90.0, backend="slurm"),
              _ev(104, "restored", step=75, resume_step=70, tier="memory"),  # memory held a newer step
              _ev(150, "times", start_s=2.0, restore_s=1.0, step_s=42.0, save_s=2.0, final_s=0.0, polls=43,
                  first_step_s=0.4),
              _ev(150, "finished", step=110)]
    g = goodput.goodput(events)
    assert g is not None and g["wall_s"] == 150.0
    assert g["lost_s"] == pytest.approx(15.0 + 10.0) and g["training_s"] == pytest.approx(35.0 + 20.0 + 42.0)
    assert sum(g[f"{k}_s"] for k in goodput.PARTS) == pytest.approx(150.0, rel=0.01)
    assert g["ettr"] == pytest.approx(97.0 / 150.0, abs=1e-4)
    hang, failed = g["restarts"]
    assert hang == {"cause": "hang", "at": 60.0, "in_allocation": True, "tier": "run_dir", "detect_s": 9.0,
                    "teardown_s": 3.0,
                    "start_s": 2.0, "setup_s": 3.0, "restore_s": 1.0, "first_step_s": 0.5, "restart_s": 9.5,
                    "lost_s": 15.0, "lost_steps": 15}
    assert failed["tier"] == "memory"  # where the start after it restored from
    assert failed["cause"] == "failed" and failed["restart_s"] == pytest.approx(3.0 + 2.0 + 1.0 + 0.4)
    assert failed["lost_s"] == 10.0 and failed["teardown_s"] == 0.5 and failed["start_s"] == 2.5
    assert [s["outcome"] for s in g["starts"]] == ["hang", "failed", "finished"]
    assert "work lost 25s" in goodput.line(g) and goodput.line(g).endswith(
        "restarts: 1 hang, 1 failed (the slowest in the allocation: 9.5 s to its first step); restored from the run "
        "directory 1, memory 1")
    # A stop with a final checkpoint of the step the next start resumes from loses nothing.
    stopped = [_ev(0, "started", restart=0, backend="slurm"), _times(50, start=2.0, step=40.0, final=3.0),
               _ev(50, "final_checkpoint", reason="timeout", step=80, seconds=3.0),
               _ev(50, "requeued", reason="timeout", progress=True),
               _ev(80, "started", restart=1, step=80, step_taken_at=48.0, backend="slurm")]
    g = goodput.goodput(stopped, now=90.0)
    assert g is not None and g["lost_s"] == 0.0 and g["restarts"][0]["queue_s"] == 30.0


def test_no_start_no_goodput_and_hostile_values_are_no_crash() -> None:
    assert goodput.goodput([_ev(0, "submitted", backend="slurm")]) is None
    # Values of the wrong type are dropped by history.normalise; times out of order never exceed the wall time.
    events = [_ev(10, "started"), _times(5, start=1e9, step=1e9), _ev(3, "finished")]
    g = goodput.goodput(events)
    assert g is not None and g["wall_s"] == 0.0 and g["ettr"] is None


def test_each_restart_names_the_tier_its_restore_read_and_status_counts_them() -> None:
    """The memory tier (docs/memory-tier.md): a crash restored from the node's memory, a lost node from a replica."""
    events = [_ev(0, "started", restart=0, backend="slurm"),
              _ev(40, "crashed", attempt=0, exit_code=137, time_of_end=39.0, signal="SIGKILL"),
              _ev(41, "started", restart=0, attempt=1, down_s=1.0, backend="slurm"),
              _ev(45, "restored", step=35, tier="memory", taken_at=37.0),  # trained again: 37 .. the end at 39
              _ev(80, "crashed", attempt=1, exit_code=137, time_of_end=79.0),
              _ev(81, "started", restart=0, attempt=2, down_s=1.0, backend="slurm", step=50),
              _ev(85, "restored", step=55, resume_step=50, tier="replica"),
              _times(120, start=4.0, step=30.0),
              _ev(120, "finished", step=70)]
    g = goodput.goodput(events, now=120)
    assert g is not None and [r["tier"] for r in g["restarts"]] == ["memory", "replica"]
    # Work lost from when the memory step's state was taken (the run directory had none at the first restart);
    # the second restore says no time and neither does its start: nothing says what was trained again.
    assert [r["lost_s"] for r in g["restarts"]] == [2.0, 0.0]
    assert goodput.line(g).endswith("restarts: 2 crashed (the slowest in the allocation: 6.0 s to its first step); "
                                    "restored from memory 1, a replica 1")


def test_what_each_bad_node_cost_is_summed_from_the_restarts_traced_to_it() -> None:
    """Two starts killed on node n2 (the health gate traced both there, then cordoned it), the third finishes."""
    events = [_ev(0, "started", restart=0, backend="slurm"),
              _ev(40, "crashed", attempt=0, exit_code=137, time_of_end=39.0, signal="SIGKILL"),
              _ev(40.5, "traced", attempt=0, node="n2", task=1, message="Killed"),
              _ev(41, "started", restart=0, attempt=1, down_s=1.0, backend="slurm", step=30, step_taken_at=30.0),
              _ev(80, "crashed", attempt=1, exit_code=137, time_of_end=79.0, signal="SIGKILL"),
              _ev(80.5, "traced", attempt=1, node="n2", task=1, message="Killed"),
              _ev(80.6, "cordoned", node="n2", checks="failures", reason="failed first on it 2 times"),
              _ev(82, "started", restart=0, attempt=2, down_s=1.0, backend="slurm", step=70, step_taken_at=75.0),
              _times(120, start=4.0, step=30.0),
              _ev(120, "finished", step=90)]
    g = goodput.goodput(events, now=120)
    assert g is not None and [r["node"] for r in g["restarts"]] == ["n2", "n2"]
    [bad] = g["bad_nodes"]
    assert bad == {"node": "n2", "failures": 2,
                   "cost_s": round(sum(r["lost_s"] + r["restart_s"] for r in g["restarts"]), 3)}
    assert bad["cost_s"] > 0 and goodput.line(g).endswith(f"; failures by node: n2 2 ({goodput.duration(bad['cost_s'])})")
    untraced = goodput.goodput([e for e in events if e["event"] != "traced"], now=120)
    assert untraced is not None and untraced["bad_nodes"] == [] and "failures by node" not in goodput.line(untraced)
