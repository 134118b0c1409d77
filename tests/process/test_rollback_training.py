"""Rollback in whole trainings of the reference model in the pytest process (NaN injected, the requeue, the
budget of rollbacks across starts); seconds of CPU each, so they run with the process tier; the rule itself is
tests/unit/test_rollback.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.llama_runs import rollback_training_config
from support.losses import read_losses

from alpsck.errors import RollbackLimitError
from alpsck.examples.llama.train import train
from alpsck.restore import ROLLBACKS_FILE, read_rollbacks


def test_nan_rolls_back_to_the_newest_healthy_checkpoint_and_finishes(tmp_path: Path) -> None:
    res = train(rollback_training_config(tmp_path, nan_at_step=10))
    assert res.rollbacks == [(10, 8)] and res.final_step == 16 and not res.stopped
    assert res.last_loss is not None and math.isfinite(res.last_loss)
    recs = read_rollbacks(tmp_path / "ckpt")
    assert [(r.from_step, r.to_step, r.reason, r.skip) for r in recs] == [(10, 8, "loss is nan", 2)]
    assert recs[0].wait_s + recs[0].restore_s < 2.0  # the in-process cost (the budget: 2 s plus the restore)
    losses = read_losses(tmp_path / "loss.csv")
    assert sorted(losses) == list(range(1, 17)) and all(math.isfinite(float(v)) for v in losses.values())
    # The window was skipped: step 9 onwards drew the batches from position 10 on (steps 9, 10 skipped) ...
    clean = tmp_path / "clean"
    train(rollback_training_config(clean, rollback=False))
    ref = read_losses(clean / "loss.csv")
    assert all(losses[s] == ref[s] for s in range(1, 9))  # ... the history up to the restored step is kept
    assert losses[9] != ref[9]
    # ... and the data position of the final checkpoint says so: 16 steps drew 18 batches.
    import alpsck

    assert alpsck.peek(tmp_path / "ckpt")["data"]["position"] == 18


def test_a_requeue_skips_the_window_again_and_does_not_reinject(tmp_path: Path) -> None:
    """The run rolls back 10 -> 8 and is stopped a few steps later (its final checkpoint); a requeued start resumes
    there without injecting again; and a start that finds only step 8 (the newer ones lost) skips the
    window again and reproduces the same losses."""
    polls = iter(range(100))
    first = train(rollback_training_config(tmp_path, nan_at_step=10, checkpoint_freq=8), stop_requested=lambda: next(polls) == 14)
    assert first.rollbacks == [(10, 8)] and first.stopped
    once = read_losses(tmp_path / "loss.csv")
    # The requeued start: restores the newest (the stop's final checkpoint), finishes, never re-injects.
    second = train(rollback_training_config(tmp_path, nan_at_step=10, checkpoint_freq=8, load_checkpoint=True))
    assert second.rollbacks == [] and second.final_step == 16
    # A start that restores step 8 (before the skipped window) skips it again: the same losses as the first run.
    full = read_losses(tmp_path / "loss.csv")
    assert all(full[s] == once[s] for s in once)
    third = train(rollback_training_config(tmp_path, nan_at_step=10, checkpoint_freq=8, load_checkpoint=True,
                       checkpoint_dir=str(_only_step(tmp_path, 8)), loss_file=str(tmp_path / "again.csv")))
    assert third.restored_step == 8 and third.rollbacks == []
    again = read_losses(tmp_path / "again.csv")
    assert all(again[s] == full[s] for s in range(9, 17))
    assert len(read_rollbacks(tmp_path / "ckpt")) == len(read_rollbacks(tmp_path / "only8")) == 1


def _only_step(tmp_path: Path, step: int) -> Path:
    """The run directory as a start finds it whose newer checkpoints are lost: the checkpoint of ``step``
    and the rollback records only."""
    import shutil

    from alpsck.store.names import step_dir

    dst = tmp_path / f"only{step}"
    shutil.copytree(step_dir(tmp_path / "ckpt", step), step_dir(dst, step))
    shutil.copy(tmp_path / "ckpt" / ROLLBACKS_FILE, dst / ROLLBACKS_FILE)
    return dst


def test_without_a_bad_loss_the_trace_is_bit_exact_with_rollback_off(tmp_path: Path) -> None:
    on, off = tmp_path / "on", tmp_path / "off"
    a = train(rollback_training_config(on, spike_factor=50.0))
    train(rollback_training_config(off, rollback=False))
    assert a.rollbacks == [] and (on / "loss.csv").read_bytes() == (off / "loss.csv").read_bytes()
    assert not (on / "ckpt" / ROLLBACKS_FILE).exists()


def test_a_fresh_start_on_a_used_run_directory_forgets_its_rollbacks(tmp_path: Path) -> None:
    train(rollback_training_config(tmp_path, nan_at_step=6, training_steps=8))
    assert len(read_rollbacks(tmp_path / "ckpt")) == 1
    (tmp_path / "loss.csv").unlink()
    train(rollback_training_config(tmp_path, training_steps=8))  # no --load-checkpoint: a new history in the same directory
    assert read_rollbacks(tmp_path / "ckpt") == []
    clean = tmp_path / "clean"
    train(rollback_training_config(clean, training_steps=8, rollback=False))
    assert (tmp_path / "loss.csv").read_bytes() == (clean / "loss.csv").read_bytes()


def test_gives_up_after_n_rollbacks_of_the_run_across_starts(tmp_path: Path) -> None:
    train(rollback_training_config(tmp_path, nan_at_step=6, max_rollbacks=1))  # one rollback, 6 -> 4
    (tmp_path / "loss.csv").unlink()
    with pytest.raises(RollbackLimitError, match=r"max_rollbacks \(1\).*6 -> 4 \(loss is nan\)"):
        train(rollback_training_config(tmp_path, nan_at_step=18, max_rollbacks=1, training_steps=20, load_checkpoint=True))
