"""Megatron-LM's distributed checkpoints through alpsck (issue 56, item 1; docs/megatron.md): a tiny megatron-core
0.16.1 GPT on CPU, tensor-parallel over 1 and 2 ranks (gloo), checkpointed with ``dist_checkpointing.save`` and
alpsck's save strategy, every rank SIGKILLed mid-run and started again: it loads the newest iteration through
alpsck's load strategy (picked by ``metadata.json``) and every later step's loss equals an uninterrupted run's,
bit for bit (model and Adam state). A damaged newest iteration is found by ``checked_latest`` and the run resumes
from the one before. CI installs megatron-core (.ci/run); without it the test skips here, and fails under CI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import SUPPORT
from support.corrupt import flip_byte
from support.framework_runs import check_kill_and_resume
from support.releases import require_release

from alpsck import _core

WORKER = SUPPORT / "megatron_worker.py"


@pytest.fixture(autouse=True)
def _needs_megatron() -> None:
    require_release("megatron.core", "megatron-core", "0.16.1", "this test and docs/megatron.md")


def _is_alpscks(out: Path, damage: bool) -> None:
    iteration = out / "iter_0000010"
    assert json.loads((iteration / "metadata.json").read_text())["sharded_backend"] == "alpsck"
    assert not list(iteration.glob("*.distcp"))  # no torch_dist shard: the tensors are in alpsck's
    if damage:
        flip_byte(next(iteration.glob(f"alpsck/step-*/{_core.shard_file_name(0)}")), 100)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_killed_megatron_gpt_resumes_bit_exact(tmp_path: Path, ranks: int) -> None:
    check_kill_and_resume(WORKER, tmp_path, ranks, damage=lambda out: _is_alpscks(out, False))


def test_a_damaged_newest_iteration_resumes_from_the_one_before(tmp_path: Path) -> None:
    log = check_kill_and_resume(WORKER, tmp_path, 2, damage=lambda out: _is_alpscks(out, True), resumed_from=6)
    assert "iteration 10 cannot be loaded" in log and "resuming from iteration 5" in log, log[-3000:]
