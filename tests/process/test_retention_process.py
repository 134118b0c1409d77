"""Retention and pins through child processes (the alpsck command line, a prune killed at random while saves are
in flight); the rule itself is tests/unit/test_retention.py."""

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
from support.retention_cases import POLICIES, SAVE_DRAWS, committed_steps, infos_of

import alpsck
from alpsck.errors import NoCheckpointError, UsageError
from alpsck.store.picker import data_error, pick
from alpsck.store.retention import Policy, decide, pin
from alpsck.store.scan import scan_run_dir

NAN, INF = math.nan, math.inf


def _alpsck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, text=True, timeout=300)


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
    assert set(committed_steps(run)) == best | {100, newest_healthy, 33}
    assert not any(math.isnan(vals[s]) for s in best)
    # prune with keep_last 1 alone: the pin holds, the best go (no keep_best rule given to prune).
    dry = _alpsck("prune", str(run), "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"keep {run / 'step-000000033'}: pinned" in dry.stdout.splitlines()
    r = _alpsck("prune", str(run), "--keep-last", "1")
    assert r.returncode == 0, r.stderr
    assert set(committed_steps(run)) == {33, 100, newest_healthy}
    assert [i["pinned"] for i in scan_run_dir(run) if i["step"] == 33] == [True]
    assert _alpsck("unpin", str(run), "33").returncode == 0
    r = _alpsck("prune", str(run), "--keep-last", "1")
    assert r.returncode == 0 and set(committed_steps(run)) == {100, newest_healthy}


def test_save_pin_true_commits_a_pinned_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(2)}, pin=True)
        for s in range(2, 6):
            ck.save(s, {"w": torch.ones(2)})
        ck.wait()
        with pytest.raises(UsageError, match="pin must be True or False"):
            ck.save(6, {"w": torch.ones(2)}, pin=1)  # type: ignore[arg-type]
    assert committed_steps(run) == [1, 5]
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


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(policy=POLICIES, seq=st.lists(SAVE_DRAWS, min_size=3, max_size=14), in_flight=st.integers(1, 3),
       kill_ms=st.integers(0, 400))
def test_saves_in_flight_and_a_prune_killed_at_random_keep_the_promises(tmp_path_factory: pytest.TempPathFactory,
                                                                         policy: Policy, seq: list[dict[str, object]],
                                                                         in_flight: int, kill_ms: int) -> None:
    run = tmp_path_factory.mktemp("run") / "run"
    infos = infos_of(seq)
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
