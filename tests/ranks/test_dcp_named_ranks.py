"""Named DCP checkpoints saved at 2 ranks (support/dcp_worker.py) and loaded at 1; the in-process cases are
tests/unit/test_dcp_named.py."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dcp_named import latest_step, load_named
from support.dcp_worker import check
from support.ranks import run_ranks

from alpsck import _core


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def test_saved_at_2_ranks_by_name_with_overwrite_and_async_loads_at_1(tmp_path: Path) -> None:
    folder = tmp_path / "titan"
    outs = run_ranks("named", folder, 2)
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"]
    assert sorted(os.listdir(folder)) == ["step-10", "step-15", "step-5"] and latest_step(folder) == 15
    for name, step in (("step-5", 5), ("step-10", 11), ("step-15", 15)):
        info = [i for i in _core.scan(str(folder / name), verify=True) if i["status"] == "committed"]
        assert len(info) == 1 and info[0]["ranks"] == 2 and info[0]["verified"], name
        assert check(load_named(folder / name), step) == [], name
