"""The Hugging Face Trainer through alpsck under DDP (issue 56, item 3; docs/huggingface.md): ``torchrun`` with 2 CPU
ranks (gloo) training :class:`alpsck.integrations.transformers.AlpsckTrainer`, its whole process group SIGKILLed
mid-epoch and resumed with ``resume_from_checkpoint=True``: every step's loss equals an uninterrupted run's, bit for
bit, and each rank's RNG streams come back as its own (the model has dropout). The one-process case:
tests/process/test_transformers.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import SUPPORT
from support.releases import require_release

WORKER = SUPPORT / "hf_trainer_worker.py"


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    require_release("transformers", "transformers", "5.24.0", "this test and docs/huggingface.md")


def _start(out: Path, losses: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT.parent), os.environ.get("PYTHONPATH", "")])}
    for k in [k for k in env if k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))]:
        del env[k]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           str(out), str(losses), *extra]
    return subprocess.Popen(cmd, env=env, cwd=out.parent, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(p: subprocess.Popen[str]) -> None:
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out[-4000:]


def _losses(path: Path) -> list[tuple[int, str]]:
    return [(int(s), v) for s, v in (line.split() for line in path.read_text().splitlines())]


def test_a_killed_ddp_trainer_resumes_bit_exact(tmp_path: Path) -> None:
    _finish(_start(tmp_path / "full", tmp_path / "full.losses"))
    want = dict(_losses(tmp_path / "full.losses"))
    assert sorted(want) == list(range(1, 21))

    out, losses = tmp_path / "out", tmp_path / "losses"
    p = _start(out, losses, "--kill-at", "12")  # each rank SIGKILLs itself at step 12 (checkpoint-10 committed)
    log, _ = p.communicate(timeout=300)
    assert p.returncode != 0 and "Signal 9 (SIGKILL) received" in log, log[-4000:]
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-5"]
    before = len(_losses(losses))
    _finish(_start(out, losses, "--resume"))
    resumed = _losses(losses)[before:]
    assert [s for s, _ in resumed] == list(range(11, 21)), resumed
    assert dict(resumed) == {s: want[s] for s in range(11, 21)}
