"""The memory tier with two ranks on one node (gloo): each rank's shard in node memory, committed once by
the store's agreement like the run directory's; restore is a collective across the tiers, and a memory copy
one rank cannot read sends every rank to the run directory together."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import SUPPORT
from support.corrupt import flip_byte
from support.ranks import run_ranks

from alpsck import _core
from alpsck.store import memory_tier

WORKER = SUPPORT / "memory_worker.py"


@pytest.fixture
def memory_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv(memory_tier.ROOT_ENV, str(root))  # the ranks inherit it
    return root


def _restored(outs: list[str]) -> list[list[str]]:
    return [next(line.split()[1:] for line in out.splitlines() if line.startswith("RESTORED ")) for out in outs]


def test_two_ranks_restore_the_memory_tier_and_fall_back_together(tmp_path: Path, memory_root: Path) -> None:
    run = tmp_path / "run"
    run_ranks("save", run, 2, WORKER)
    [memory] = memory_root.glob(f"alpsck-{os.getuid()}/run-*")
    [info] = [i for i in _core.scan(str(memory), verify=True) if i["status"] == "committed"]
    assert info["step"] == 5 and info["ranks"] == 2 and info["shards"] == ["rank-00000.bin", "rank-00001.bin"]
    assert _restored(run_ranks("restore", run, 2, WORKER)) == [["5", "memory", "True"]] * 2

    bad = memory / "step-000000005" / "rank-00001.bin"  # only rank 1's copy is bad
    flip_byte(bad, bad.stat().st_size // 2)
    outs = run_ranks("restore", run, 2, WORKER)
    assert _restored(outs) == [["0", "run_dir", "True"]] * 2
    assert sum(out.count("not usable") for out in outs) == 2, outs  # one warning on each rank
