"""A training's loss.csv (``step,loss`` rows after a header), read as the tests compare it."""

from __future__ import annotations

from pathlib import Path


def read_losses(path: Path) -> dict[int, str]:
    """Step -> the loss as written (text, so a comparison is bit-exact)."""
    return {int(s): v for s, v in (line.split(",") for line in path.read_text().splitlines()[1:])}
