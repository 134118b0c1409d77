"""torchtitan's way of finding and loading a named DCP checkpoint, as the named-checkpoint tests use it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from alpsck.dcp import AlpsckStorageReader
from support.dcp_worker import template


def latest_step(folder: Path) -> int:
    """torchtitan's discovery: an unanchored ``step-(\\d+)`` over the listing, counted where
    ``.metadata`` is a file; -1: start from scratch."""
    if not folder.is_dir():
        return -1
    steps = [int(m.group(1)) for name in os.listdir(folder)
             if (m := re.search(r"step-(\d+)", name)) and (folder / name / ".metadata").is_file()]
    return max(steps, default=-1)


def load_named(checkpoint_id: Path, reader: AlpsckStorageReader | None = None) -> dict[str, Any]:
    state = template()
    dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=reader or AlpsckStorageReader())
    return state
