"""Retention policies (issue 43, item 4): keep_last, keep_every_steps, keep_every_seconds, keep_best,
the newest healthy checkpoint and pins — one rule (cpp/core/retention.h) for the engine's saves and for
``alpsck prune`` — and its invariants under random sequences (hypothesis).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.retention_cases import POLICIES, SAVE_DRAWS, committed_steps, infos_of

import alpsck
from alpsck import _core
from alpsck.errors import UsageError
from alpsck.store.retention import Policy, decide
from alpsck.store.scan import scan_run_dir

NAN, INF = math.nan, math.inf


# ----------------------------------------------------------------------------- the acceptance


def test_milestones_and_the_newest_healthy_step_survive_and_restore_skips_the_nan(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=2, keep_every_steps=10) as ck:
        for s in range(1, 51):
            ck.save(s, {"w": torch.full((8,), float(s))}, metrics={"loss": NAN if s == 50 else 1.0 / s})
        ck.wait()
    assert committed_steps(run) == [10, 20, 30, 40, 49, 50]
    live = {"w": torch.zeros(8)}
    with alpsck.Checkpointer(run, keep_last=2, keep_every_steps=10) as ck:
        with pytest.warns(RuntimeWarning, match=r"step 50.*loss=nan"):
            assert ck.restore(live) == 49
        assert torch.equal(live["w"], torch.full((8,), 49.0))
    with alpsck.Checkpointer(run, keep_last=2, keep_every_steps=10) as ck:
        assert ck.restore(live, allow_unhealthy=True) == 50
        assert torch.equal(live["w"], torch.full((8,), 50.0))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"keep_last": 0, "keep_every_steps": 10}, "keep_every_steps is set, but keep_last is 0"),
    ({"keep_best": "loss:median:2"}, "keep_best: 'loss:median:2': it must read METRIC:min:K"),
    ({"keep_best": ("loss", "min", 0)}, "keep_best: 'loss:min:0'"),
    ({"keep_best": 3}, "keep_best: 3: must be a string"),
    ({"keep_every_seconds": -1.0}, "keep_every_seconds: -1.0: must be between 0"),
    ({"keep_every_steps": 2.5}, "keep_every_steps: 2.5: must be an integer"),
])
def test_a_bad_policy_is_refused_by_name_before_anything_is_touched(tmp_path: Path, kwargs: dict[str, object],
                                                                    match: str) -> None:
    with pytest.raises(UsageError, match=match):
        alpsck.Checkpointer(tmp_path / "run", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()


def test_the_job_config_carries_the_same_options(tmp_path: Path) -> None:
    from alpsck.errors import ConfigError
    from alpsck.slurm.config import parse_config

    good = "name: r\nentry:\n  function: m:f\n"
    cfg = parse_config(good + "checkpoint:\n  keep_last: 2\n  keep_every_steps: 100\n  keep_best: val_loss:min:3\n")
    assert (cfg.checkpoint.keep_every_steps, cfg.checkpoint.keep_best) == (100, "val_loss:min:3")
    with pytest.raises(ConfigError, match=r"checkpoint\.keep_best: .*'val_loss:best:3'"):
        parse_config(good + "checkpoint:\n  keep_best: val_loss:best:3\n")
    with pytest.raises(ConfigError, match=r"checkpoint\.keep_every_seconds: keep_every_seconds is set, but keep_last"):
        parse_config(good + "checkpoint:\n  keep_last: 0\n  keep_every_seconds: 60\n")


# ----------------------------------------------------------------------------- the rule's invariants


@settings(max_examples=1000, deadline=None)
@given(policy=POLICIES, seq=st.lists(SAVE_DRAWS, min_size=1, max_size=40), kill_after=st.integers(0, 40))
def test_the_rule_keeps_what_it_promises_in_any_sequence(policy: Policy, seq: list[dict[str, object]],
                                                         kill_after: int) -> None:
    infos = infos_of(seq)
    steps = [int(i["step"]) for i in infos]  # type: ignore[call-overload]
    batch = decide(policy, infos)
    kept = {s for s, why in batch.items() if why}
    # Pinned ones, the newest K and the newest healthy one are never deleted.
    assert {int(i["step"]) for i in infos if i["pinned"]} <= kept  # type: ignore[call-overload]
    assert set(steps[-policy.keep_last:]) <= kept
    healthy = [int(i["step"]) for i in infos if not i["unhealthy"]]  # type: ignore[call-overload]
    if healthy:
        assert max(healthy) in kept and "newest healthy" in batch[max(healthy)]
    if policy.keep_every_steps:
        assert {s for s in steps if s % policy.keep_every_steps == 0} <= kept
    if policy.keep_best:
        metric, mode, k = policy.keep_best.split(":")
        by_best = [i for i in infos if math.isfinite(dict(i["metrics"]).get(metric, NAN))]  # type: ignore[call-overload]
        # NaN, infinities and no value rank worst: never kept as best; the K best always are.
        for i in infos:
            if "keep_best" in batch[int(i["step"])]:  # type: ignore[call-overload]
                assert i in by_best
        sign = 1 if mode == "min" else -1
        ranked = sorted(by_best, key=lambda i: (sign * dict(i["metrics"])[metric], -int(i["step"])))  # type: ignore
        assert {int(i["step"]) for i in ranked[:int(k)]} <= kept  # type: ignore[call-overload]
    # Every decision names its rule; nothing is kept for no reason.
    assert all(why == "" or any(r in why for r in ("pinned", "newest healthy", "keep_")) for why in batch.values())
    # Saving: the engine decides after every commit over what it still knows, and forgets the victims.
    # That ends where one decision over every step ends (so a new process that lists the survivors agrees).
    known: list[dict[str, object]] = []
    for i in infos:
        known.append(i)
        now = decide(policy, known)
        known = [j for j in known if now[int(j["step"])]]  # type: ignore[call-overload]
    assert {int(j["step"]) for j in known} == kept  # type: ignore[call-overload]
    # Deciding again over the survivors keeps them all (prune after the engine removes nothing).
    assert all(decide(policy, known).values())
    # A prune killed after removing some of its victims, then run again, ends the same.
    victims = [i for i in infos if not batch[int(i["step"])]]  # type: ignore[call-overload]
    left = [i for i in infos if i not in victims[:kill_after]]
    again = decide(policy, left)
    assert {s for s, why in again.items() if why} == kept


# ----------------------------------------------------------------------------- on a real run directory


def test_decide_refuses_steps_out_of_order() -> None:
    with pytest.raises(ValueError, match="ascending"):
        _core.decide_retention([(2, 0.0, [], "", False), (1, 0.0, [], "", False)], 1)


# ----------------------------------------------------------------------------- spikes and the reference training


def test_a_saved_loss_spike_is_recorded_unhealthy_and_never_resumed_from(tmp_path: Path) -> None:
    run = tmp_path / "run"
    losses = {1: 2.0, 2: 2.1, 3: 1.9, 4: 2.0, 5: 50.0}
    with alpsck.Checkpointer(run, keep_last=1, spike_factor=3.0) as ck:
        for s, loss in losses.items():
            ck.save(s, {"w": torch.full((4,), float(s))}, metrics={"loss": loss})
        ck.wait()
    infos = {i["step"]: i for i in scan_run_dir(run) if i["status"] == "committed"}
    assert set(infos) == {4, 5}  # keep_last 1 keeps the spike; the newest healthy (4) stays beside it
    assert infos[5]["unhealthy"] == "loss 50 is above 3 x the median 2 of the last 4"
    assert infos[4]["unhealthy"] is None
    live = {"w": torch.zeros(4)}
    with alpsck.Checkpointer(run) as ck:
        with pytest.warns(RuntimeWarning, match=r"step 5.*loss 50 is above 3 x the median"):
            assert ck.restore(live) == 4
    with pytest.raises(UsageError, match=r"spike_factor: 0.5: must be between 1 and 1e\+06 \(0: off\)"):
        alpsck.Checkpointer(tmp_path / "other", spike_factor=0.5)
