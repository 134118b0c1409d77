"""matplotlib drawing to files, for every command that plots (``alpsck plot``, ``alpsck bench``, the
reference training's plot)."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files (the Agg backend), or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
