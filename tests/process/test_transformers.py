"""The Hugging Face Trainer through alpsck (issue 56, item 3; docs/huggingface.md): a transformers 5.24 Trainer on
one CPU process whose checkpoints are :class:`alpsck.integrations.transformers.AlpsckTrainer`'s, SIGKILLed mid-epoch
and resumed with ``train(resume_from_checkpoint=True)``: every step's loss equals an uninterrupted run's, bit for
bit, also when the newest checkpoint is damaged (the one before it is used), and no checkpoint holds a file of the
Trainer's own. 2 ranks under torchrun: tests/ranks/test_transformers_ddp.py. CI installs transformers (.ci/run);
without it the test skips here, and fails under CI."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import SUPPORT
from support.corrupt import flip_byte
from support.framework_runs import check_kill_and_resume
from support.releases import require_release

from alpsck import _core

TRAINERS_FILES = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                  "training_args.bin"}


def _only_alpscks(out: Path, damage: bool) -> None:
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10", "checkpoint-5"]
    assert not [p for p in out.rglob("*") if p.name in TRAINERS_FILES or p.suffix in (".pt", ".pth", ".pkl")]
    if damage:
        flip_byte(next((out / "checkpoint-10").glob(f"step-*/{_core.shard_file_name(0)}")), 100)


@pytest.mark.parametrize("damage", [False, True], ids=["killed", "killed-newest-damaged"])
def test_a_killed_trainer_resumes_bit_exact(tmp_path: Path, damage: bool) -> None:
    require_release("transformers", "transformers", "5.24.0", "this test and docs/huggingface.md")
    log = check_kill_and_resume(SUPPORT / "hf_trainer_worker.py", tmp_path, ranks=1, resume=("--resume",),
                                damage=lambda out: _only_alpscks(out, damage), resumed_from=6 if damage else 11)
    if damage:
        assert "resuming from" in log and "checkpoint-5" in log and "checkpoint-10" in log, log[-2000:]
