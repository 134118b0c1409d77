"""PyTorch's storage-contract cases for torch.distributed.checkpoint at 2 ranks, on both backends side by side
(support/dcp_contract_worker.py, one process per rank); the single-process cases are tests/unit/test_dcp_contract.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import SUPPORT
from support.dcp_backends import Backend
from support.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("dcp_quiet")


def test_two_ranks(backend: Backend, tmp_path: Path) -> None:
    outs = run_ranks(backend.name, tmp_path, 2, script=SUPPORT / "dcp_contract_worker.py")
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"], outs


def test_two_ranks_through_alpsck_urls(tmp_path: Path) -> None:
    """The same cases with DCP's own fsspec writer and reader at alpsck:// paths: each rank's files written whole
    with their CRC32C, checked as they are read, resharded."""
    outs = run_ranks("url", tmp_path, 2, script=SUPPORT / "dcp_contract_worker.py")
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"], outs
    sums = sorted(p.name for p in (tmp_path / "reshard").iterdir() if p.name.endswith(".alpsck-sum"))
    assert sums == ["..metadata.alpsck-sum", ".__0_0.distcp.alpsck-sum", ".__1_0.distcp.alpsck-sum"], sums
