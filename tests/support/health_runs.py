"""A run directory whose checkpoints carry metrics (the health rule's input), saved in-process."""

from __future__ import annotations

from pathlib import Path

import torch

import alpsck


def saved_run_with_losses(tmp_path: Path, losses: dict[int, float], keep_last: int = 0) -> Path:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=keep_last) as ck:
        for step, loss in losses.items():
            ck.save(step, {"w": torch.full((4,), float(step))}, metrics={"loss": loss, "lr": 0.5}).wait()
    return run
