"""Stragglers named (issue 55, item 4): each rank's own part of a save, carried to rank 0 in its record, compared
with its peers' (alpsck/slurm/stragglers.py); the real core's records through a Checkpointer's save hook; status
and the gate's cordon."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import alpsck
from alpsck.errors import ConfigError
from alpsck.progress import SAVED_HOOKS
from alpsck.slurm import health_gate, history, status, stragglers, timeline
from alpsck.slurm.config import parse_config
from alpsck.slurm.history import Straggler
from alpsck.slurm.stragglers import PaceWatch
from alpsck.slurm.submit import sbatch_script


def _save(works: list[float], t: float = 1_800_000_000.0, lates: list[float] | None = None) -> dict[str, Any]:
    """A committed save's result as rank 0's core reports it: each rank's node, arrival and own work."""
    lates = lates or [0.0] * len(works)
    return {"step": 1, "ranks": [{"rank": r, "node": f"n{r + 1}", "arrived": t + lates[r], "work_seconds": w}
                                 for r, w in enumerate(works)]}


def _stragglers(run: Path) -> list[Straggler]:
    return timeline.read(run).of_kind(Straggler)


def test_a_rank_persistently_slower_than_its_peers_is_named_once_with_its_node(tmp_path: Path) -> None:
    watch = PaceWatch(str(tmp_path), "77", 1, factor=2.0, saves=5)
    for i in range(4):  # not yet: fewer saves than the window
        assert watch.saw(_save([0.10, 0.11, 0.45, 0.10], lates=[0, 0, 0.3, 0])) == [], i
    [named] = watch.saw(_save([0.10, 0.11, 0.45, 0.10], lates=[0, 0, 0.3, 0]))
    assert (named.node, named.rank, named.factor, named.saves, named.attempt) == ("n3", 2, 4.5, 5, 1)
    assert (named.work_s, named.peers_s, named.late_s) == (0.45, 0.1, 0.3)
    for _ in range(10):  # once per start
        assert watch.saw(_save([0.10, 0.11, 0.45, 0.10])) == []
    [e] = _stragglers(tmp_path)
    assert (e.node, e.rank, e.factor, e.job_id) == ("n3", 2, 4.5, "77")


def test_one_slow_save_is_no_straggler_and_nor_is_noise_on_a_tiny_save(tmp_path: Path) -> None:
    watch = PaceWatch(str(tmp_path), "77", 0, factor=2.0, saves=5)
    for works in ([0.1, 0.9], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1], [0.1, 0.1], [0.1, 0.12]):  # one spike in six
        assert watch.saw(_save(works)) == []
    tiny = PaceWatch(str(tmp_path), "77", 0, factor=2.0, saves=3)
    for _ in range(6):  # 5x slower, but 4 ms: under MIN_GAP_S
        assert tiny.saw(_save([0.001, 0.005])) == []
    off = PaceWatch(str(tmp_path), "77", 0, factor=0, saves=2)
    for _ in range(4):
        assert off.saw(_save([0.1, 5.0])) == []
    assert _stragglers(tmp_path) == []


def _save_on(nodes: list[tuple[str, float]]) -> dict[str, Any]:
    """A committed save's result whose ranks run on the nodes given, in rank order: (node, own work)."""
    return {"step": 1, "ranks": [{"rank": r, "node": n, "arrived": 1_800_000_000.0, "work_seconds": w}
                                 for r, (n, w) in enumerate(nodes)]}


def test_a_rank_is_compared_with_other_nodes_ranks_only_and_a_lone_node_with_nobody(tmp_path: Path) -> None:
    """What is named is a node. Ranks sharing one share its disk: the second one's fsync waits for the first's
    journal commit, a queue's order, not the node's health. One node's two ranks at 9x name nobody; two nodes whose
    second rank each takes 2.5x its first name nobody (each rank's reference is the other node's median); a node
    whose two ranks are both slow is named twice."""
    watch = PaceWatch(str(tmp_path), "77", 0, factor=2.0, saves=3)
    for _ in range(5):
        assert watch.saw(_save_on([("n1", 0.1), ("n1", 0.9)])) == []
        assert watch.saw(_save_on([("n1", 0.1), ("n1", 0.25), ("n2", 0.1), ("n2", 0.25)])) == []
    assert _stragglers(tmp_path) == []
    slow = PaceWatch(str(tmp_path), "77", 0, factor=2.0, saves=3)
    named = [e for _ in range(3) for e in slow.saw(_save_on([("n1", 0.1), ("n1", 0.12), ("n2", 0.5), ("n2", 0.55)]))]
    assert [(e.node, e.rank, e.factor, e.peers_s) for e in named] == [("n2", 2, 4.55, 0.11), ("n2", 3, 5.0, 0.11)]


def test_of_two_ranks_the_slow_one_is_named_and_records_without_a_pace_are_left_out(tmp_path: Path) -> None:
    watch = PaceWatch(str(tmp_path), "77", 0, factor=3.0, saves=3)
    old = {"step": 1, "ranks": [{"rank": 0, "node": "", "arrived": 0.0, "work_seconds": 0.0}, {"rank": 1}]}
    assert watch.saw(old) == [] and watch.saw({"step": 1}) == []  # an older core's records: nothing to compare
    named = [e for _ in range(3) for e in watch.saw(_save([0.05, 0.30]))]
    assert [(e.node, e.rank, e.factor) for e in named] == [("n2", 1, 6.0)]


def test_status_lists_the_stragglers_and_the_gate_cordons_them_when_asked(tmp_path: Path) -> None:
    history.append(tmp_path, history.Submitted(backend="local", name="t"), job_id="4000000000")  # no such pid
    for attempt in (0, 1):
        watch = PaceWatch(str(tmp_path), "77", attempt, factor=2.0, saves=2)
        for _ in range(2):
            watch.saw(_save([0.1, 0.5], lates=[0, 0.4]))
    s = status.report(tmp_path, shown=50, purge_days=None)
    [g] = s.stragglers
    assert (g["node"], g["rank"], g["factor"], g["times"], g["late_s"]) == ("n2", 1, 5.0, 2, 0.4)
    assert 0 < g["since"] <= g["last"]
    r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PATH": str(tmp_path / "no-slurm-here")})
    assert "straggler: n2 (rank 1): its part of a save took 5.0x its peers' (0.5 s against 0.1 s" in r.stdout, r.stdout
    stragglers.cordon(str(tmp_path), "77", 2)
    stragglers.cordon(str(tmp_path), "77", 3)  # once
    [c] = timeline.read(tmp_path).cordoned().values()
    assert (c.node, c.checks, c.attempt) == ("n2", "pace", 2) and "5.0x its peers'" in str(c.reason)
    assert len(timeline.read(tmp_path).of_kind(history.Cordoned)) == 1


def test_rank_zeros_save_carries_each_ranks_node_arrival_and_work_to_the_hook(tmp_path: Path) -> None:
    seen: list[tuple[Path, dict[str, Any]]] = []

    def hook(run_dir: Path, result: dict[str, Any]) -> None:
        seen.append((run_dir, result))

    SAVED_HOOKS.append(hook)
    try:
        with alpsck.Checkpointer(tmp_path / "run") as ck:
            ck.save(1, {"w": torch.arange(4096.0)}).wait()
            assert seen == []  # a handle's own wait() is not the Checkpointer's: seen at its next call
            ck.save(2, {"w": torch.arange(4096.0)})
            assert [r["step"] for _, r in seen] == [1]
    finally:
        SAVED_HOOKS.remove(hook)
    assert [r["step"] for _, r in seen] == [1, 2]  # step 2 at close(): each once
    for run_dir, r in seen:
        assert run_dir == tmp_path / "run"
        [me] = r["ranks"]
        assert me["rank"] == 0 and me["node"] == socket.gethostname()
        assert 0 < me["work_seconds"] <= r["durable_seconds"] and abs(me["arrived"] - os.path.getmtime(r["path"])) < 60


def test_the_straggler_keys_are_checked_and_the_gate_passes_the_cordon_on(tmp_path: Path) -> None:
    base = f"name: t\nrun_dir: {tmp_path / 'run'}\nslurm:\n  nodes: 2\nentry:\n  function: m:f\nhealth:\n"
    with pytest.raises(ConfigError, match=re.escape("health.straggler_factor: 1.05 would name ranks no slower")):
        parse_config(base + "  straggler_factor: 1.05\n")
    with pytest.raises(ConfigError, match=re.escape("health.cordon_stragglers: the health gate cordons them")):
        parse_config(base + "  cordon_stragglers: true\n")
    with pytest.raises(ConfigError, match=re.escape("health.straggler_saves: 1: must be between 2 and 1000")):
        parse_config(base + "  straggler_saves: 1\n")
    assert parse_config(base + "  straggler_factor: 0\n").health.straggler_factor == 0
    text = sbatch_script(parse_config(base + "  gate: true\n  cordon_stragglers: true\n"))
    gate = text[text.index(f"{health_gate.GATE}() {{"):]
    assert "--cordon-stragglers" in gate[:gate.index("\n}\n")]
    assert "--cordon-stragglers" not in sbatch_script(parse_config(base + "  gate: true\n"))


def test_a_nodes_peers_median_is_the_median_of_the_others_without_a_list_per_node() -> None:
    import random
    import statistics

    from alpsck.slurm.stragglers import _median_without

    rng = random.Random(0)
    for n in range(1, 30):
        for _ in range(50):
            xs = [rng.choice([rng.random(), 0.5, 0.25]) for _ in range(n)]  # ties too
            ordered = sorted(xs)
            out = rng.sample(range(n), rng.randint(1, min(n, 5)))  # a node's ranks
            rest = [x for j, x in enumerate(xs) if j not in out]
            want = statistics.median(rest) if rest else None
            assert _median_without(ordered, sorted(xs[j] for j in out)) == want, (xs, out)
