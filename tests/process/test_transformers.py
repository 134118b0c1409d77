"""The Hugging Face Trainer through alpsck (issue 56, item 3; docs/huggingface.md): a transformers 5.24 Trainer on
CPU whose checkpoints are :class:`alpsck.integrations.transformers.AlpsckTrainer`'s, SIGKILLed mid-epoch and resumed
with ``train(resume_from_checkpoint=True)``: every step's loss equals an uninterrupted run's, bit for bit, also when
the newest checkpoint is damaged (the one before it is used). CI installs transformers (.ci/run); without it the test
skips here, and fails under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import SUPPORT
from support.corrupt import flip_byte
from support.releases import require_release

from alpsck import _core

WORKER = SUPPORT / "hf_trainer_worker.py"
TRANSFORMERS = "5.24.0"


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    require_release("transformers", "transformers", TRANSFORMERS, "this test and docs/huggingface.md")


def _run(out: Path, losses: Path, *extra: str, rc: int = 0) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT.parent), os.environ.get("PYTHONPATH", "")])}
    for k in [k for k in env if k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))]:
        del env[k]
    p = subprocess.run([sys.executable, str(WORKER), str(out), str(losses), *extra], env=env, cwd=out.parent,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == rc, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p.stderr


def _losses(path: Path) -> list[tuple[int, str]]:
    return [(int(s), v) for s, v in (line.split() for line in path.read_text().splitlines())]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    root = tmp_path_factory.mktemp("full")
    _run(root / "out", root / "losses")
    got = dict(_losses(root / "losses"))
    assert sorted(got) == list(range(1, 21))
    return got


@pytest.mark.parametrize("damage_newest", [False, True], ids=["killed", "killed-newest-damaged"])
def test_a_killed_trainer_resumes_bit_exact(tmp_path: Path, uninterrupted: dict[int, str],
                                           damage_newest: bool) -> None:
    out, losses = tmp_path / "out", tmp_path / "losses"
    _run(out, losses, "--kill-at", "12", rc=-9)  # SIGKILL at the end of step 12; checkpoints at 5 and 10
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-5"]
    trainers = {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
                "training_args.bin"}
    assert not [p for p in out.rglob("*") if p.name in trainers or p.suffix in (".pt", ".pth", ".pkl")]
    if damage_newest:
        flip_byte(next((out / "checkpoint-10").glob(f"step-*/{_core.shard_file_name(0)}")), 100)
    before = len(_losses(losses))
    err = _run(out, losses, "--resume")
    resumed = _losses(losses)[before:]
    first = 6 if damage_newest else 11
    assert [s for s, _ in resumed] == list(range(first, 21)), resumed
    assert dict(resumed) == {s: uninterrupted[s] for s in range(first, 21)}
    if damage_newest:
        assert "checkpoint-10" in err and "resuming from" in err and "checkpoint-5" in err, err[-2000:]
