"""Metrics in every checkpoint, and health-gated restore (issue 43, items 1 and 2).

``save(step, state, metrics={...})`` records numbers in the checkpoint's manifest (NaN and the
infinities as such); the one picker (the core's PickCheckpoint, rule 5b) skips a checkpoint whose
metrics are not finite, for every reader, unless ``allow_unhealthy=True``; ``inspect-checkpoints``
and ``status`` show the metrics.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck.errors import NoCheckpointError, UsageError
from alpsck.slurm import history
from alpsck.slurm.runner import resume_point
from alpsck.store.picker import pick
from alpsck.store.scan import scan_run_dir


def _run(tmp_path: Path, losses: dict[int, float], keep_last: int = 0) -> Path:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=keep_last) as ck:
        for step, loss in losses.items():
            ck.save(step, {"w": torch.full((4,), float(step))}, metrics={"loss": loss, "lr": 0.5}).wait()
    return run


@pytest.mark.parametrize("overlap_copy", [False, True])  # the engine's copy, and the pipelined path (a GPU's)
def test_metrics_are_recorded_with_the_checkpoint_non_finite_ones_as_such(tmp_path: Path, overlap_copy: bool) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, overlap_copy=overlap_copy) as ck:
        ck.save(1, {"w": torch.ones(2)}, metrics={"loss": torch.tensor(2.5), "grad_norm": math.inf,
                                                  "val/loss": float("nan"), "tokens": 4096}).wait()
        ck.save(2, {"w": torch.ones(2)}).wait()  # none given: none recorded
    infos = {i["step"]: i for i in scan_run_dir(run)}
    m = infos[1]["metrics"]
    assert list(m) == ["loss", "grad_norm", "val/loss", "tokens"]  # in the order given
    assert m["loss"] == 2.5 and m["grad_norm"] == math.inf and math.isnan(m["val/loss"]) and m["tokens"] == 4096.0
    assert infos[2]["metrics"] == {}
    manifest = json.loads((run / "step-000000001" / "MANIFEST.json").read_text())
    assert manifest["metrics"] == {"loss": 2.5, "grad_norm": "inf", "val/loss": "nan", "tokens": 4096.0}


@pytest.mark.parametrize(("metrics", "match"), [
    ({"loss": "low"}, "metric 'loss' must be a number"),
    ({"ok": True}, "metric 'ok' must be a number"),
    ({"a b": 1.0}, "metric name 'a b'"),
    ({"": 1.0}, "metric name ''"),
    ({7: 1.0}, "metric name 7"),
    ({"x": torch.ones(3)}, "metric 'x' must be a number"),
    ({f"m{i}": 0.0 for i in range(65)}, "at most 64"),
    ([("loss", 1.0)], "must be a mapping"),
])
def test_metrics_a_manifest_cannot_hold_are_refused_naming_the_key(tmp_path: Path, metrics: object,
                                                                    match: str) -> None:
    with alpsck.Checkpointer(tmp_path / "run") as ck:
        with pytest.raises(UsageError, match=match):
            ck.save(1, {"w": torch.ones(2)}, metrics=metrics)  # type: ignore[arg-type]
        assert ck.latest_step() is None  # nothing was written


def test_restore_skips_an_unhealthy_checkpoint_for_the_newest_healthy_one_unless_allowed(tmp_path: Path) -> None:
    """The issue's run: loss 1/step for steps 1-50, NaN at 50. restore() returns 49 with its tensors, and
    warns naming step 50 and the metric; allow_unhealthy=True returns 50. Every reader picks alike."""
    run = _run(tmp_path, {s: (math.nan if s == 50 else 1.0 / s) for s in range(1, 51)})
    state = {"w": torch.zeros(4)}
    with alpsck.Checkpointer(run) as ck, pytest.warns(RuntimeWarning, match=r"step 50: unhealthy.*loss=nan"):
        assert ck.restore(state) == 49
    assert torch.equal(state["w"], torch.full((4,), 49.0))
    with alpsck.Checkpointer(run) as ck:
        assert ck.latest_step() == 49
        assert ck.restore(state, allow_unhealthy=True) == 50
    assert torch.equal(state["w"], torch.full((4,), 50.0))
    with pytest.warns(RuntimeWarning, match="unhealthy"):
        assert tuple(alpsck.peek(run)["w"].shape) == (4,)
    assert pick(run).step == 49 and pick(run, allow_unhealthy=True).step == 50
    assert resume_point(str(run))[0] == 49  # what a requeued job resumes from
    # Named, an unhealthy step is refused with the reason, unless allowed.
    with alpsck.Checkpointer(run) as ck, pytest.raises(NoCheckpointError, match="step 50: unhealthy"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck.restore(state, step=50)


def test_an_infinity_anywhere_makes_it_unhealthy_and_older_unhealthy_ones_are_no_fallback(tmp_path: Path) -> None:
    run = _run(tmp_path, {10: 1.0, 20: math.inf, 30: 0.5, 40: -math.inf})
    p = pick(run)
    assert p.step == 30 and [k.reason for k in p.skipped] == ["unhealthy"]
    assert p.steps == [30, 10]  # a fall-back past 30 lands on 10, never on the unhealthy 20


def test_inspect_checkpoints_and_status_show_the_metrics(tmp_path: Path) -> None:
    run = _run(tmp_path, {1: 0.75, 2: math.nan})
    table = subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run)], capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in table.stdout.splitlines()[1:3]}
    assert rows["1"].startswith("*") and rows["1"].endswith("loss=0.75 lr=0.5")
    assert rows["2"].endswith("unhealthy: loss=nan lr=0.5")
    doc = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run), "--json"],
                                    capture_output=True, text=True, timeout=120).stdout)
    assert [c["metrics"] for c in doc["checkpoints"]] == [{"loss": 0.75, "lr": 0.5}, {"loss": "nan", "lr": 0.5}]
    assert doc["latest_valid"] == 1 and doc["skipped"][0]["reason"] == "unhealthy"
    one = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run), "--step", "2",
                                     "--json"], capture_output=True, text=True, timeout=120).stdout)
    assert one["metrics"] == {"loss": "nan", "lr": 0.5}  # a named step is described whatever its health
    history.append(run, "started", job_id="5", restart=0, step=None)
    status = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run)], capture_output=True, text=True,
                            timeout=120)
    assert "metrics of the checkpoint a resume uses: loss=0.75 lr=0.5" in status.stdout, status.stdout
    assert "skipped as unhealthy: step 2: loss=nan; allow_unhealthy=True restores it" in status.stdout
    doc = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"],
                                    capture_output=True, text=True, timeout=120).stdout)
    assert doc["metrics"] == {"loss": 0.75, "lr": 0.5} and doc["unhealthy"][0]["step"] == 2


def test_a_run_whose_every_checkpoint_is_unhealthy_never_restarts_from_nothing(tmp_path: Path) -> None:
    """No healthy checkpoint left: restore() refuses to start afresh (that would throw the run away) and
    says how to go on; allow_unhealthy=True restores the newest."""
    run = _run(tmp_path, {10: math.nan, 20: math.inf})
    state = {"w": torch.zeros(4)}
    with alpsck.Checkpointer(run) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(NoCheckpointError, match=r"every checkpoint a restore could use is unhealthy.*"
                                                     r"allow_unhealthy=True"):
            ck.restore(state)
        with pytest.raises(NoCheckpointError, match="unhealthy"):
            alpsck.peek(run)
        assert ck.restore(state, allow_unhealthy=True) == 20
    # A run directory with no checkpoint at all is still a fresh start.
    with alpsck.Checkpointer(tmp_path / "empty") as ck:
        assert ck.restore(state) is None


def test_keep_last_never_expires_the_newest_healthy_checkpoint(tmp_path: Path) -> None:
    """The engine's retention (keep_last 2): with NaN at 40 and 50, step 30 stays beside them, the one a
    restore uses; once 60 is healthy, 30 and 40 go."""
    run = _run(tmp_path, {10: 1.0, 20: 0.5, 30: 0.25, 40: math.nan, 50: math.nan}, keep_last=2)
    assert [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"] == [30, 40, 50]
    with alpsck.Checkpointer(run, keep_last=2) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"w": torch.zeros(4)}
        assert ck.restore(state, allow_unhealthy=True) == 50  # the same history: nothing retired
        ck.save(60, state, metrics={"loss": 0.2}).wait()
    assert [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"] == [50, 60]


def test_prune_keeps_healthy_ones_and_keeps_newer_unhealthy_ones_for_inspection(tmp_path: Path) -> None:
    """keep_last counts the newest K whatever their health (40 stays for inspection); the newest healthy one
    (30) is kept beside them by its own rule; the dry run names the rule behind every decision."""
    run = _run(tmp_path, {10: 1.0, 20: math.nan, 30: 0.5, 40: math.inf})
    dry = subprocess.run([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "1", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert f"keep {run / 'step-000000040'}: keep_last 1" in lines
    assert f"keep {run / 'step-000000030'}: newest healthy" in lines
    gone = next(x for x in lines if str(run / "step-000000020") in x)
    assert gone.startswith("would remove") and "no rule keeps it" in gone and "unhealthy: loss=nan" in gone
    r = subprocess.run([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"] == [30, 40]
