"""The Hugging Face Trainer through alpsck under DDP (issue 56, item 3; docs/huggingface.md): ``torchrun`` with 2 CPU
ranks (gloo) training :class:`alpsck.integrations.transformers.AlpsckTrainer`, every rank SIGKILLed mid-epoch and
resumed with ``resume_from_checkpoint=True``: every step's loss equals an uninterrupted run's, bit for bit, each
rank's RNG streams its own (the model has dropout). The one-process case: tests/process/test_transformers.py."""

from __future__ import annotations

from pathlib import Path

from support import SUPPORT
from support.framework_runs import check_kill_and_resume
from support.releases import require_release


def test_a_killed_ddp_trainer_resumes_bit_exact(tmp_path: Path) -> None:
    require_release("transformers", "transformers", "5.24.0", "this test and docs/huggingface.md")
    check_kill_and_resume(SUPPORT / "hf_trainer_worker.py", tmp_path, ranks=2, resume=("--resume",))
