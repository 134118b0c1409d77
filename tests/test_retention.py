"""Retention policies (issue 43, item 4): keep_last, keep_every_steps, keep_every_seconds, keep_best,
the newest healthy checkpoint and pins — one rule (cpp/core/retention.h) for the engine's saves and for
``alpsck prune`` — and its invariants under random sequences (hypothesis).
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import alpsck
from alpsck import _core
from alpsck.errors import NoCheckpointError, UsageError
from alpsck.store.picker import data_error, pick
from alpsck.store.retention import Policy, decide, pin
from alpsck.store.scan import scan_run_dir

NAN, INF = math.nan, math.inf


def _committed(run: Path) -> list[int]:
    return [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"]


def _alpsck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, text=True, timeout=300)


# ----------------------------------------------------------------------------- the acceptance


def test_milestones_and_the_newest_healthy_step_survive_and_restore_skips_the_nan(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=2, keep_every_steps=10) as ck:
        for s in range(1, 51):
            ck.save(s, {"w": torch.full((8,), float(s))}, metrics={"loss": NAN if s == 50 else 1.0 / s})
        ck.wait()
    assert _committed(run) == [10, 20, 30, 40, 49, 50]
    live = {"w": torch.zeros(8)}
    with alpsck.Checkpointer(run, keep_last=2, keep_every_steps=10) as ck:
        with pytest.warns(RuntimeWarning, match=r"step 50.*loss=nan"):
            assert ck.restore(live) == 49
        assert torch.equal(live["w"], torch.full((8,), 49.0))
    with alpsck.Checkpointer(run, keep_last=2, keep_every_steps=10) as ck:
        assert ck.restore(live, allow_unhealthy=True) == 50
        assert torch.equal(live["w"], torch.full((8,), 50.0))


def test_keep_best_keeps_the_two_best_and_the_newest_and_a_pin_survives_everything(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rng = random.Random(43)
    vals: dict[int, float] = {}
    with alpsck.Checkpointer(run, keep_last=1, keep_best=("val_loss", "min", 2)) as ck:
        for s in range(1, 101):
            v = rng.choice([NAN, INF, -INF]) if s % 7 == 0 else rng.uniform(0.5, 5.0)
            vals[s] = v
            ck.save(s, {"w": torch.full((4,), float(s))}, metrics={"val_loss": v})
            if s == 33:
                ck.wait()
                assert _alpsck("pin", str(run), "33").returncode == 0  # while the job runs
        ck.wait()
    finite = sorted((v, s) for s, v in vals.items() if math.isfinite(v))
    best = {s for _, s in finite[:2]}
    newest_healthy = max(s for s, v in vals.items() if math.isfinite(v))
    assert set(_committed(run)) == best | {100, newest_healthy, 33}
    assert not any(math.isnan(vals[s]) for s in best)
    # prune with keep_last 1 alone: the pin holds, the best go (no keep_best rule given to prune).
    dry = _alpsck("prune", str(run), "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"keep {run / 'step-000000033'}: pinned" in dry.stdout.splitlines()
    r = _alpsck("prune", str(run), "--keep-last", "1")
    assert r.returncode == 0, r.stderr
    assert set(_committed(run)) == {33, 100, newest_healthy}
    assert [i["pinned"] for i in scan_run_dir(run) if i["step"] == 33] == [True]
    assert _alpsck("unpin", str(run), "33").returncode == 0
    r = _alpsck("prune", str(run), "--keep-last", "1")
    assert r.returncode == 0 and set(_committed(run)) == {100, newest_healthy}


def test_save_pin_true_commits_a_pinned_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(2)}, pin=True)
        for s in range(2, 6):
            ck.save(s, {"w": torch.ones(2)})
        ck.wait()
        with pytest.raises(UsageError, match="pin must be True or False"):
            ck.save(6, {"w": torch.ones(2)}, pin=1)  # type: ignore[arg-type]
    assert _committed(run) == [1, 5]
    inspect = _alpsck("inspect-checkpoints", str(run))
    assert inspect.returncode == 0 and "pinned" in inspect.stdout


def test_pin_of_a_step_that_is_no_checkpoint_names_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
    with pytest.raises(NoCheckpointError, match="step 7 is not a committed checkpoint"):
        pin(run, 7)
    r = _alpsck("pin", str(run), "7")
    assert r.returncode != 0 and "step 7 is not a committed checkpoint" in r.stderr


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

_VALUES = st.one_of(st.floats(min_value=-10, max_value=10), st.sampled_from([NAN, INF, -INF]))
_STEP = st.fixed_dictionaries({
    "gap": st.integers(1, 7),  # the next step is this much later
    "dt": st.floats(0, 100),   # and saved this many seconds later
    "metrics": st.dictionaries(st.sampled_from(["loss", "val"]), _VALUES, max_size=2),
    "pinned": st.booleans(),
})
_POLICY = st.builds(Policy, keep_last=st.integers(1, 5), keep_every_steps=st.sampled_from([0, 2, 5, 10]),
                    keep_every_seconds=st.sampled_from([0.0, 30.0, 120.0]),
                    keep_best=st.sampled_from(["", "val:min:1", "val:max:2", "loss:min:3"]))


def _infos(seq: list[dict[str, object]]) -> list[dict[str, object]]:
    infos, step, t = [], 0, 0.0
    for s in seq:
        step += int(s["gap"])  # type: ignore[call-overload]
        t += float(s["dt"])  # type: ignore[arg-type]
        metrics = dict(s["metrics"])  # type: ignore[call-overload]
        sick = ", ".join(f"{k}={v}" for k, v in metrics.items() if not math.isfinite(v))
        infos.append({"step": step, "created": t, "metrics": metrics, "unhealthy": sick or None,
                      "pinned": s["pinned"]})
    return infos


@settings(max_examples=3000, deadline=None)
@given(policy=_POLICY, seq=st.lists(_STEP, min_size=1, max_size=40), kill_after=st.integers(0, 40))
def test_the_rule_keeps_what_it_promises_in_any_sequence(policy: Policy, seq: list[dict[str, object]],
                                                         kill_after: int) -> None:
    infos = _infos(seq)
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


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(policy=_POLICY, seq=st.lists(_STEP, min_size=3, max_size=14), in_flight=st.integers(1, 3),
       kill_ms=st.integers(0, 400))
def test_saves_in_flight_and_a_prune_killed_at_random_keep_the_promises(tmp_path_factory: pytest.TempPathFactory,
                                                                         policy: Policy, seq: list[dict[str, object]],
                                                                         in_flight: int, kill_ms: int) -> None:
    run = tmp_path_factory.mktemp("run") / "run"
    infos = _infos(seq)
    with alpsck.Checkpointer(run, keep_last=policy.keep_last, keep_every_steps=policy.keep_every_steps,
                             keep_best=policy.keep_best, max_in_flight=in_flight) as ck:
        for i in infos:  # not waited for: up to in_flight saves persist while the next is taken
            ck.save(int(i["step"]), {"w": torch.full((64,), float(i["step"]))},  # type: ignore[call-overload]
                    metrics=i["metrics"], pin=bool(i["pinned"]))  # type: ignore[arg-type]
        ck.wait()
    on_disk = {i["step"]: i for i in scan_run_dir(run) if i["status"] == "committed"}
    # (keep_every_seconds is left out of the engine here: its clock is the commit's, not the sequence's.)
    engine_policy = Policy(policy.keep_last, policy.keep_every_steps, 0.0, policy.keep_best)
    assert set(on_disk) == {s for s, why in decide(engine_policy, infos).items() if why}
    # A prune with the full policy, SIGKILLed at a random moment, then run again.
    args = [sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", str(policy.keep_last),
            "--keep-every-steps", str(policy.keep_every_steps), "--keep-every-seconds", str(policy.keep_every_seconds)]
    if policy.keep_best:
        args += ["--keep-best", policy.keep_best]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(kill_ms / 1000)
    p.send_signal(signal.SIGKILL)
    p.wait()
    # Whatever it had done: the newest healthy checkpoint, the pinned ones and the newest K are whole.
    listed = {i["step"]: i for i in scan_run_dir(run) if i["status"] == "committed"}
    must = {s for s, i in on_disk.items() if i["pinned"]} | set(sorted(on_disk)[-policy.keep_last:])
    healthy = [s for s, i in on_disk.items() if not i["unhealthy"]]
    if healthy:
        must.add(max(healthy))
        assert pick(run).step == max(healthy)
    assert must <= set(listed)
    assert all(data_error(listed[s]) is None for s in must)
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    final = {i["step"]: i for i in scan_run_dir(run) if i["status"] == "committed"}
    created = [dict(i, created=on_disk[s]["created"]) for s, i in on_disk.items()]
    assert set(final) == {s for s, why in decide(policy, created).items() if why}
    assert not [n for n in os.listdir(run) if n.startswith(".deleting-")]


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


def test_the_reference_training_keeps_the_best_losses_it_records(tmp_path: Path) -> None:
    from alpsck.examples.llama.train import TrainConfig, train

    cfg = TrainConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, sequence_length=32, batch_size=8,
                      training_steps=24, checkpoint_freq=2, warmup_steps=3, lr=1e-2, log_every=0, device="cpu",
                      checkpoint_dir=str(tmp_path / "ckpt"), loss_file=str(tmp_path / "loss.csv"), keep_last=1,
                      keep_every_steps=10, keep_best="loss:min:2")
    train(cfg)
    losses = {int(s): float(v) for s, v in (x.split(",") for x in (tmp_path / "loss.csv").read_text().splitlines()[1:])}
    saved = {s: losses[s] for s in range(2, 25, 2)}
    best = sorted(saved, key=lambda s: (saved[s], -s))[:2]
    assert set(_committed(tmp_path / "ckpt")) == {*best, 10, 20, 24}


def test_a_pinned_checkpoint_of_an_abandoned_history_is_moved_aside_never_deleted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=3) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((4,), float(s))}, pin=s == 3)
        ck.wait()
    live = {"w": torch.zeros(4)}
    with alpsck.Checkpointer(run, keep_last=3) as ck:
        assert ck.restore(live, step=2) == 2  # the run goes on from 2: the old 3 is another history's
        with pytest.warns(RuntimeWarning, match="abandoned history"):
            ck.save(3, live)
            ck.wait()
    moved = [p for p in run.iterdir() if p.name.startswith("superseded-")]
    assert len(moved) == 1 and (moved[0] / "PINNED").exists()
    r = _alpsck("prune", str(run), "--keep-last", "1")
    assert r.returncode == 0, r.stderr
    assert moved[0].exists() and "kept pinned" in r.stderr
    (moved[0] / "PINNED").unlink()
    assert _alpsck("prune", str(run), "--keep-last", "1").returncode == 0 and not moved[0].exists()
