"""PyTorch's own DCP tests that need 2 gloo ranks (support/dcp_torch_suite_worker.py), on both backends; the
single-process ones are tests/unit/test_dcp_torch_suite.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import SUPPORT
from support.dcp_backends import Backend
from support.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("dcp_quiet")


# test_checkpoint.py::TestDistributedFailure::_test_save with coordinator_rank=1, and the coordinator ranks of
# test_load_error_handling, on the real storage: 2 gloo ranks (dcp_torch_suite_worker.py "coordinator")
def test_coordinator_rank_1(backend: Backend, tmp_path: Path) -> None:
    outs = run_ranks(f"{backend.name}:coordinator", tmp_path, 2, script=SUPPORT / "dcp_torch_suite_worker.py")
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"], outs


# state_dict_saver.save(use_collectives=False) (test_file_system_checkpoint.py's no-collectives saves): 2 gloo
# ranks, each saving and loading without rank coordination
def test_no_collectives_two_ranks(backend: Backend, tmp_path: Path) -> None:
    outs = run_ranks(f"{backend.name}:nocoll", tmp_path, 2, script=SUPPORT / "dcp_torch_suite_worker.py")
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"], outs
