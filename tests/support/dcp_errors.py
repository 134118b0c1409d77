"""What a failed DCP save or load raised underneath torch.distributed.checkpoint's CheckpointException."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException


def root_cause(e: CheckpointException) -> BaseException:
    return next(iter(e.failures.values()))[0]
