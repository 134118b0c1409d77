"""The reference training (alpsck.examples.llama) in the tests: its small configurations, and as a child process
its environment and waiting for its end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from alpsck.examples.llama.train import TrainConfig


def training_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def finish(proc: subprocess.Popen[str], expected_rc: int = 0) -> str:
    """Wait for a training started with its output piped; assert its exit code; its output."""
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == expected_rc, out
    return str(out)


def small_training_config(tmp_path: Path, **kw: object) -> TrainConfig:
    base = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "sequence_length": 32,
            "batch_size": 8, "training_steps": 30, "checkpoint_freq": 0, "warmup_steps": 3, "lr": 1e-2,
            "checkpoint_dir": str(tmp_path / "ckpt"), "log_every": 0, "device": "cpu"}
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]


def rollback_training_config(tmp_path: Path, **kw: object) -> TrainConfig:
    base = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32, "sequence_length": 32,
            "batch_size": 8, "training_steps": 16, "checkpoint_freq": 4, "warmup_steps": 3, "lr": 1e-2,
            "checkpoint_dir": str(tmp_path / "ckpt"), "log_every": 0, "device": "cpu",
            "loss_file": str(tmp_path / "loss.csv")}
    return TrainConfig(**{**base, **kw})  # type: ignore[arg-type]
