"""The memory tier with two ranks on one node (gloo): each rank's shard in node memory, committed once by
the store's agreement like the run directory's; restore is a collective across the tiers, and a memory copy
one rank cannot read sends every rank to the run directory together."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from support import SUPPORT
from support.corrupt import flip_byte
from support.ranks import free_port, outputs_of, rank_env, run_ranks
from support.warm import WarmProcess

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


def _collectives(out: str) -> list[str]:
    return next(line.split()[2:] for line in out.splitlines() if line.startswith("COLLECTIVES "))


def test_two_ranks_restore_the_memory_tier_and_fall_back_together(tmp_path: Path, memory_root: Path) -> None:
    run = tmp_path / "run"
    run_ranks("save", run, 2, WORKER)
    [memory] = memory_root.glob(f"alpsck-{os.getuid()}/run-*/ranks-00000-00001")
    [info] = [i for i in _core.scan(str(memory), verify=True) if i["status"] == "committed"]
    assert info["step"] == 5 and info["ranks"] == 2 and info["shards"] == ["rank-00000.bin", "rank-00001.bin"]
    outs = run_ranks("restore", run, 2, WORKER)
    assert _restored(outs) == [["5", "memory", "True"]] * 2
    # A restart from memory: seven collectives, each one rank's word or a verdict the next step needs. Opening:
    # rank 0's word that the run directory's engine opened (with the run's identity), every rank's (with its
    # node), and the same two for the node's engine in memory. Restoring: the plan (each node's steps and the run
    # directory's newest), each rank's verdict on its read, each node's outcome.
    assert [_collectives(out) for out in outs] == [["broadcast", "all_reduce", "broadcast", "all_reduce",
                                                    "all_reduce", "all_reduce", "all_reduce"]] * 2

    bad = memory / "step-000000005" / "rank-00001.bin"  # only rank 1's copy is bad
    flip_byte(bad, bad.stat().st_size // 2)
    outs = run_ranks("restore", run, 2, WORKER)
    assert _restored(outs) == [["0", "run_dir", "True"]] * 2
    assert sum(out.count("not usable") for out in outs) == 2, outs  # one warning on each rank


def _on_nodes(mode: str, run: Path, nodes: list[Path], per_node: int, *args: str) -> list[str]:
    """The worker on ``len(nodes) * per_node`` ranks, node ``i``'s ranks consecutive, each node its own name and
    its own memory root (``nodes[i]``: the node's /dev/shm; one machine stands in for several)."""
    world, port = len(nodes) * per_node, free_port()
    outputs = Path(tempfile.mkdtemp(prefix=f"nodes-{mode}-", dir=run.parent))
    procs = [WarmProcess(WORKER, [mode, str(run), *args],
                         rank_env(r, world, port, **{memory_tier.ROOT_ENV: str(nodes[r // per_node]),
                                                     memory_tier.NODE_ENV: nodes[r // per_node].name}),
                         outputs / f"rank-{r}.out") for r in range(world)]
    return outputs_of(procs, 180)


def _held(root: Path) -> dict[str, list[str]]:
    """What a node's memory holds: each ranks-* directory's committed steps."""
    return {d.name: sorted(s.name for s in d.glob("step-*") if s.suffix == "") for d in sorted(root.glob("*/*/ranks-*"))}


def test_two_nodes_keep_a_replica_each_and_restore_from_memory_a_replica_or_the_run_directory(tmp_path: Path) -> None:
    """Two nodes of two ranks: each node commits its own memory checkpoint and keeps the other's newest; a
    restart restores from own memory, a lost node's ranks from the replica (also when they restart on another
    node, in another order), a bad own copy from the replica with one warning, and both bad from the run
    directory."""
    run, a, b, spare = tmp_path / "run", tmp_path / "node-a", tmp_path / "node-b", tmp_path / "node-c"
    for d in (a, b, spare):
        d.mkdir()
    _on_nodes("save", run, [a, b], 2, "0:run_dir,5:memory,10:memory")
    both = {"ranks-00000-00001": ["step-000000010"], "ranks-00002-00003": ["step-000000010"]}
    assert _held(a) == both and _held(b) == both  # own newest, and the other node's: a ring of two
    assert _restored(_on_nodes("restore", run, [a, b], 2)) == [["10", "memory", "True"]] * 4

    shutil.rmtree(b)  # node b is lost with its memory; a spare takes its ranks, then the nodes swap places
    assert _restored(_on_nodes("restore", run, [a, spare], 2)) == [["10", "replica", "True"]] * 4
    assert _restored(_on_nodes("restore", run, [spare, a], 2)) == [["10", "replica", "True"]] * 4
    assert not list(spare.glob("*/*/fetched-*")) and not list(a.glob("*/*/fetched-*"))  # copies sent for a restore go

    bad = next(a.glob("*/*/ranks-00000-00001")) / "step-000000010" / "rank-00001.bin"
    flip_byte(bad, bad.stat().st_size // 2)  # node a's own copy of ranks 0-1; the spare's replica is good
    _on_nodes("save", run, [a, spare], 2, "15:memory")  # the ring again: the spare holds a's replica now
    flip_byte(next(a.glob("*/*/ranks-00000-00001")) / "step-000000015" / "rank-00000.bin", 4096)
    outs = _on_nodes("restore", run, [a, spare], 2)
    assert _restored(outs) == [["15", "replica", "True"]] * 4
    assert [out.count("not usable") for out in outs] == [1, 1, 0, 0], outs  # one warning, on the bad copy's node

    flip_byte(next(spare.glob("*/*/ranks-00000-00001")) / "step-000000015" / "rank-00001.bin", 4096)
    outs = _on_nodes("restore", run, [a, spare], 2)
    assert _restored(outs) == [["0", "run_dir", "True"]] * 4  # both copies bad: the run directory, once
    assert all("restoring from the run directory" in out for out in outs), outs
