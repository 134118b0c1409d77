"""accelerate's training state through alpsck (issue 56, item 3; docs/huggingface.md): a loop checkpointed by
:class:`alpsck.integrations.accelerate.AcceleratorCheckpointer` on one CPU process, SIGKILLed mid-epoch and started
again: it resumes from its newest checkpoint and every step's loss equals an uninterrupted run's, bit for bit (the
model has dropout: the RNG streams come back at the resumed epoch's first batch). 2 ranks under torchrun:
tests/ranks/test_accelerate_ddp.py. CI installs accelerate (.ci/run); without it the test skips here, and fails
under CI."""

from __future__ import annotations

from pathlib import Path

from support import SUPPORT
from support.framework_runs import check_kill_and_resume
from support.releases import require_release


def test_a_killed_accelerate_loop_resumes_bit_exact(tmp_path: Path) -> None:
    require_release("accelerate", "accelerate", "1.15.0", "this test and docs/huggingface.md")
    check_kill_and_resume(SUPPORT / "accelerate_worker.py", tmp_path, ranks=1)
