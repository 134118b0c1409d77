"""Rollback in the training loop (issue #43, item 3): a bad loss restores the newest healthy checkpoint
in-process, skips the data window that led to it (also after a requeue), and gives up after N rollbacks;
a run without a rollback is bit-exact with rollback off."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from alpsck.errors import CheckpointError, ConfigError, RollbackLimitError
from alpsck.examples.llama.train import TrainConfig, config_from_args, train
from alpsck.restore import ROLLBACKS_FILE, loss_problem, read_rollbacks


def _cfg(tmp_path: Path, **kw: object) -> TrainConfig:
    base = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "sequence_length": 32,
            "batch_size": 8, "training_steps": 16, "checkpoint_freq": 4, "warmup_steps": 3, "lr": 1e-2,
            "checkpoint_dir": str(tmp_path / "ckpt"), "log_every": 0, "device": "cpu",
            "loss_file": str(tmp_path / "loss.csv")}
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def _losses(path: Path) -> dict[int, str]:
    return {int(s): v for s, v in (line.split(",") for line in path.read_text().splitlines()[1:])}


# -- the health rule of one value ----------------------------------------------------------------

def test_loss_problem() -> None:
    assert loss_problem(float("nan"), [1.0, 2.0], None) == "loss is nan"
    assert loss_problem(math.inf, [], None) == "loss is +inf"
    assert loss_problem(-math.inf, [], 3.0) == "loss is -inf"
    assert loss_problem(2.0, [2.0, 2.1, 2.2], None) is None  # spikes off
    assert loss_problem(7.0, [2.0, 2.1, 2.2], 3.0) == "loss 7 is above 3 x the median 2.1 of the last 3"
    assert loss_problem(6.0, [2.0, 2.1, 2.2], 3.0) is None
    assert loss_problem(100.0, [2.0], 3.0) is None  # fewer than two recent values decide nothing


# -- the reference training ------------------------------------------------------------------------

def test_nan_rolls_back_to_the_newest_healthy_checkpoint_and_finishes(tmp_path: Path) -> None:
    res = train(_cfg(tmp_path, nan_at_step=10))
    assert res.rollbacks == [(10, 8)] and res.final_step == 16 and not res.stopped
    assert res.last_loss is not None and math.isfinite(res.last_loss)
    recs = read_rollbacks(tmp_path / "ckpt")
    assert [(r.from_step, r.to_step, r.reason, r.skip) for r in recs] == [(10, 8, "loss is nan", 2)]
    assert recs[0].wait_s + recs[0].restore_s < 2.0  # the in-process cost (the budget: 2 s plus the restore)
    losses = _losses(tmp_path / "loss.csv")
    assert sorted(losses) == list(range(1, 17)) and all(math.isfinite(float(v)) for v in losses.values())
    # The window was skipped: step 9 onwards drew the batches from position 10 on (steps 9, 10 skipped) ...
    clean = tmp_path / "clean"
    train(_cfg(clean, rollback=False))
    ref = _losses(clean / "loss.csv")
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
    first = train(_cfg(tmp_path, nan_at_step=10, checkpoint_freq=8), stop_requested=lambda: next(polls) == 14)
    assert first.rollbacks == [(10, 8)] and first.stopped
    once = _losses(tmp_path / "loss.csv")
    # The requeued start: restores the newest (the stop's final checkpoint), finishes, never re-injects.
    second = train(_cfg(tmp_path, nan_at_step=10, checkpoint_freq=8, load_checkpoint=True))
    assert second.rollbacks == [] and second.final_step == 16
    # A start that restores step 8 (before the skipped window) skips it again: the same losses as the first run.
    full = _losses(tmp_path / "loss.csv")
    assert all(full[s] == once[s] for s in once)
    third = train(_cfg(tmp_path, nan_at_step=10, checkpoint_freq=8, load_checkpoint=True,
                       checkpoint_dir=str(_only_step(tmp_path, 8)), loss_file=str(tmp_path / "again.csv")))
    assert third.restored_step == 8 and third.rollbacks == []
    again = _losses(tmp_path / "again.csv")
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
    a = train(_cfg(on, spike_factor=50.0))
    train(_cfg(off, rollback=False))
    assert a.rollbacks == [] and (on / "loss.csv").read_bytes() == (off / "loss.csv").read_bytes()
    assert not (on / "ckpt" / ROLLBACKS_FILE).exists()


def test_a_fresh_start_on_a_used_run_directory_forgets_its_rollbacks(tmp_path: Path) -> None:
    train(_cfg(tmp_path, nan_at_step=6, training_steps=8))
    assert len(read_rollbacks(tmp_path / "ckpt")) == 1
    (tmp_path / "loss.csv").unlink()
    train(_cfg(tmp_path, training_steps=8))  # no --load-checkpoint: a new history in the same directory
    assert read_rollbacks(tmp_path / "ckpt") == []
    clean = tmp_path / "clean"
    train(_cfg(clean, training_steps=8, rollback=False))
    assert (tmp_path / "loss.csv").read_bytes() == (clean / "loss.csv").read_bytes()


def test_gives_up_after_max_rollbacks(tmp_path: Path) -> None:
    # max_rollbacks=0: the first bad loss is already one too many.
    with pytest.raises(RollbackLimitError, match=r"max_rollbacks \(0\)"):
        train(_cfg(tmp_path, nan_at_step=6, max_rollbacks=0))
    assert isinstance(RollbackLimitError("x"), CheckpointError)


def test_gives_up_after_n_rollbacks_of_the_run_across_starts(tmp_path: Path) -> None:
    train(_cfg(tmp_path, nan_at_step=6, max_rollbacks=1))  # one rollback, 6 -> 4
    (tmp_path / "loss.csv").unlink()
    with pytest.raises(RollbackLimitError, match=r"max_rollbacks \(1\).*6 -> 4 \(loss is nan\)"):
        train(_cfg(tmp_path, nan_at_step=18, max_rollbacks=1, training_steps=20, load_checkpoint=True))


@pytest.mark.parametrize(("key", "value"), [("max_rollbacks", -1), ("rollback_skip_batches", -2),
                                            ("nan_at_step", 0), ("spike_factor", 0.5), ("spike_factor", math.nan)])
def test_bad_config_names_the_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        train(_cfg(tmp_path, **{key: value}))


def test_cli_flags() -> None:
    cfg = config_from_args(["--no-rollback", "--max-rollbacks", "5", "--rollback-skip-batches", "7",
                            "--spike-factor", "4", "--nan-at-step", "9"])
    assert (cfg.rollback, cfg.max_rollbacks, cfg.rollback_skip_batches, cfg.spike_factor, cfg.nan_at_step) == (
        False, 5, 7, 4.0, 9)
    assert config_from_args([]).rollback is True


def test_a_bad_rollback_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / ROLLBACKS_FILE).write_text(json.dumps({"format": 1, "rollbacks": [{"from_step": "x"}]}))
    with pytest.raises(CheckpointError, match="from_step"):
        read_rollbacks(tmp_path)


def test_two_ddp_ranks_roll_back_together(tmp_path: Path) -> None:
    """torchrun, two gloo ranks, NaN at step 7 (checkpoints every 5): both ranks go back to step 5 in the
    same step (the restore is a collective; a rank left behind would hang), and the run finishes."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "alpsck.examples.llama", "--training-steps", "10",
            "--checkpoint-freq", "5", "--dim", "32", "--multiple-of", "32", "--sequence-length", "16",
            "--batch-size", "4", "--warmup-steps", "2", "--device", "cpu", "--torch-threads", "1", "--log-every", "0",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--loss-file", str(tmp_path / "loss.csv"), "--nan-at-step", "7"]
    proc = subprocess.run(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(r.from_step, r.to_step, r.skip) for r in read_rollbacks(tmp_path / "ckpt")] == [(7, 5, 2)]
    losses = _losses(tmp_path / "loss.csv")
    assert sorted(losses) == list(range(1, 11)) and all(math.isfinite(float(v)) for v in losses.values())
