"""Whole trainings of the reference model (alpsck.examples.llama) in the pytest process: the loss decreases, a
stop saves and the resume matches, a resume past a corrupt checkpoint, the pace; seconds of CPU each, so they
run with the process tier, not the parallel unit tier."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from support.llama_runs import small_training_config

from alpsck.errors import ConfigError
from alpsck.examples.llama.train import (
    train,
)


def test_loss_decreases(tmp_path: Path) -> None:
    cfg = small_training_config(tmp_path, loss_file=str(tmp_path / "loss.csv"))
    train(cfg)
    losses = [float(line.split(",")[1]) for line in (tmp_path / "loss.csv").read_text().splitlines()[1:]]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_stop_requested_saves_and_resume_matches(tmp_path: Path) -> None:
    full = tmp_path / "full.csv"
    train(small_training_config(tmp_path, training_steps=12, checkpoint_dir=str(tmp_path / "a"), loss_file=str(full)))
    polls = iter(range(100))
    cfg = small_training_config(tmp_path, training_steps=12, checkpoint_freq=5, loss_file=str(tmp_path / "c.csv"))
    first = train(cfg, stop_requested=lambda: next(polls) == 7)  # polled before steps 1..8
    assert first.stopped and first.final_step == 7 and first.saved_steps == [5, 7]
    second = train(small_training_config(tmp_path, training_steps=12, checkpoint_freq=5, loss_file=str(tmp_path / "c.csv"),
                        load_checkpoint=True))
    assert second.restored_step == 7 and not second.stopped and second.final_step == 12
    assert (tmp_path / "c.csv").read_bytes() == full.read_bytes()


def test_a_resume_past_a_corrupt_newest_checkpoint_keeps_its_progress(tmp_path: Path) -> None:
    """The job stops at step 25 (final checkpoint); step 25 turns out corrupt, so the next start
    resumes from 20 and stops at 25 again. That final save of step 25 used to be skipped as 'already
    committed': the corrupt checkpoint stayed, and every later start went back to step 20. Now it
    is written (the corrupt one is moved aside), the third start resumes from 25, and the loss
    trace still equals the uninterrupted run's byte for byte."""
    full = tmp_path / "full.csv"
    train(small_training_config(tmp_path, training_steps=30, checkpoint_dir=str(tmp_path / "a"), loss_file=str(full)))
    loss = str(tmp_path / "c.csv")

    def stop_after(step: int, start: int) -> object:
        polls = iter(range(start + 1, 1000))  # polled before each step from start + 1 on
        return lambda: next(polls) == step + 1

    first = train(small_training_config(tmp_path, training_steps=30, checkpoint_freq=10, loss_file=loss),
                  stop_requested=stop_after(25, 0))  # type: ignore[arg-type]
    assert first.saved_steps == [10, 20, 25]
    shard = tmp_path / "ckpt" / "step-000000025" / "rank-00000.bin"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning) as caught:
        second = train(small_training_config(tmp_path, training_steps=30, checkpoint_freq=10, loss_file=loss,
                                             load_checkpoint=True),
                       stop_requested=stop_after(25, 20))  # type: ignore[arg-type]
    msgs = [str(w.message) for w in caught]
    assert any("step-000000025" in m and "CRC mismatch" in m for m in msgs), msgs
    assert any("abandoned history" in m for m in msgs), msgs
    assert second.restored_step == 20 and second.stopped and second.saved_steps == [25]
    third = train(small_training_config(tmp_path, training_steps=30, checkpoint_freq=10, loss_file=loss, load_checkpoint=True))
    assert third.restored_step == 25 and third.final_step == 30
    assert Path(loss).read_bytes() == full.read_bytes()
    assert [p.name[:len("superseded-step-000000025")] for p in (tmp_path / "ckpt").iterdir()
            if p.name.startswith("superseded-")] == ["superseded-step-000000025"]


def test_min_step_seconds_sets_the_pace_and_changes_no_loss(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast.csv", tmp_path / "slow.csv"
    train(small_training_config(tmp_path / "a", training_steps=5, loss_file=str(fast)))
    t = time.perf_counter()
    train(small_training_config(tmp_path / "b", training_steps=5, loss_file=str(slow), min_step_seconds=0.3))
    assert time.perf_counter() - t >= 5 * 0.3
    assert slow.read_text() == fast.read_text()
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ConfigError, match=r"min_step_seconds must be finite and >= 0"):
            train(small_training_config(tmp_path / "c", min_step_seconds=bad))
