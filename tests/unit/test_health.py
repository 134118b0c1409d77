"""Metrics in every checkpoint, and health-gated restore (issue 43, items 1 and 2).

``save(step, state, metrics={...})`` records numbers in the checkpoint's manifest (NaN and the
infinities as such); the one picker (the core's PickCheckpoint, rule 5b) skips a checkpoint whose
metrics are not finite, for every reader, unless ``allow_unhealthy=True``; ``inspect-checkpoints``
and ``status`` show the metrics.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from support.health_runs import saved_run_with_losses

import alpsck
from alpsck.errors import NoCheckpointError, UsageError
from alpsck.slurm.runner import resume_point
from alpsck.store.picker import pick
from alpsck.store.scan import scan_run_dir


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
    run = saved_run_with_losses(tmp_path, {s: (math.nan if s == 50 else 1.0 / s) for s in range(1, 51)})
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
    run = saved_run_with_losses(tmp_path, {10: 1.0, 20: math.inf, 30: 0.5, 40: -math.inf})
    p = pick(run)
    assert p.step == 30 and [k.reason for k in p.skipped] == ["unhealthy"]
    assert p.steps == [30, 10]  # a fall-back past 30 lands on 10, never on the unhealthy 20


def test_a_run_whose_every_checkpoint_is_unhealthy_never_restarts_from_nothing(tmp_path: Path) -> None:
    """No healthy checkpoint left: restore() refuses to start afresh (that would throw the run away) and
    says how to go on; allow_unhealthy=True restores the newest."""
    run = saved_run_with_losses(tmp_path, {10: math.nan, 20: math.inf})
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
    run = saved_run_with_losses(tmp_path, {10: 1.0, 20: 0.5, 30: 0.25, 40: math.nan, 50: math.nan}, keep_last=2)
    assert [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"] == [30, 40, 50]
    with alpsck.Checkpointer(run, keep_last=2) as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"w": torch.zeros(4)}
        assert ck.restore(state, allow_unhealthy=True) == 50  # the same history: nothing retired
        ck.save(60, state, metrics={"loss": 0.2}).wait()
    assert [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"] == [50, 60]
