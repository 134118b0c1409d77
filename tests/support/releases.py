"""Packages the tests drive as released but alpsck does not depend on (torchtitan, Lightning): .ci/run installs
each, pinned. Where one is missing a test skips, and under ``$CI`` fails; another version fails everywhere, since
the docs' recipe and the test are for the pinned one."""

from __future__ import annotations

import importlib
import os
from importlib.metadata import version

import pytest


def require_release(module: str, distribution: str, pinned: str, for_what: str) -> None:
    """``module`` importable and ``distribution`` at ``pinned``, or the test skips (fails under CI) or fails."""
    try:
        importlib.import_module(module)
        v = version(distribution)
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"{distribution} {pinned} is missing ({e}): .ci/run installs it")
        pytest.skip(f"{distribution} {pinned} is not installed ({e})")
    if v != pinned:
        pytest.fail(f"{distribution} {v} is installed; {for_what} are for {pinned}")
