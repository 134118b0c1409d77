"""accelerate's training state through alpsck under DDP (issue 56, item 3; docs/huggingface.md): the loop of
tests/process/test_accelerate.py under ``torchrun`` with 2 CPU ranks (gloo), every rank SIGKILLed mid-epoch, then
started again: the resumed losses equal an uninterrupted run's, bit for bit, each rank's RNG streams its own."""

from __future__ import annotations

from pathlib import Path

from support import SUPPORT
from support.framework_runs import check_kill_and_resume
from support.releases import require_release


def test_a_killed_ddp_accelerate_loop_resumes_bit_exact(tmp_path: Path) -> None:
    require_release("accelerate", "accelerate", "1.15.0", "this test and docs/huggingface.md")
    check_kill_and_resume(SUPPORT / "accelerate_worker.py", tmp_path, ranks=2)
