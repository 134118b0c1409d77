"""What the tests share: helpers, the worker scripts tests start as child processes, golden files.

Importable as ``support.<module>`` wherever pytest runs from: tests/conftest.py puts tests/ on sys.path.
No test module imports another test module; what two of them need lives here (docs/testing.md).
"""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""This folder: the worker scripts (``SUPPORT / "dcp_worker.py"``) and ``golden/``."""
REPO = SUPPORT.parents[1]
"""The repository's root (README.md, docs/, slurm/, cpp/)."""
