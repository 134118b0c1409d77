"""The benchmarks' parts run in-process (the overhead's paired blocks and its targets, a restore held against the
raw reads, the arena); the benchmark commands are tests/process/test_bench.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alpsck.bench.overhead import OverheadConfig, plot, run_overhead, table
from alpsck.bench.run import restore_vs_raw_read

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def overhead_result(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("overhead")
    cfg = OverheadConfig(ks=[1, 5], iters=20, warmup=2, block=10, methods=["alpsck", "alpsck-overlap", "torch"], dim=64,
                         n_layers=2, n_heads=4, batch_size=2, sequence_length=32)
    messages: list[str] = []
    return d, run_overhead(d, cfg, progress=messages.append), messages


def test_overhead_runs_every_configuration_in_paired_blocks(overhead_result) -> None:  # type: ignore[no-untyped-def]
    d, r, messages = overhead_result
    assert messages, "progress was reported"
    timed = {(s.method, s.k): s for s in r.runs}
    assert set(timed) == {(m, k) for m in ("alpsck f=2", "alpsck f=2 overlap", "torch.save") for k in (1, 5)}
    for s in r.runs:
        # Blocks of 10 (a multiple of k), 2 pairs: 20 iterations with checkpoints and 20 without.
        assert s.block == 10 and s.iterations == 20 and s.seconds > 0
        assert s.its == pytest.approx(s.iterations / s.seconds) and s.its_off > 0
        assert s.overhead_pct == pytest.approx((1 - s.its / s.its_off) * 100)
        assert len(s.pair_overheads_pct) == 2
        assert min(s.pair_overheads_pct) - 1e-9 <= s.overhead_pct <= max(s.pair_overheads_pct) + 1e-9
    assert r.model["state_bytes"] > 0 and r.model["params"] > 0
    assert min(s.its_off for s in r.runs) <= r.baseline_its <= max(s.its_off for s in r.runs)
    # Checkpoints after block iterations 1, 1+k, ... of the blocks with checkpoints only.
    for (_, k), s in timed.items():
        assert s.checkpoints == len(s.saved_steps) == 20 // k
        assert s.stall_mean > 0 and s.stall_max >= s.stall_mean
        assert s.persist_seconds is not None and s.persist_seconds > 0
        # What one copy cost the loop: the stall at least, against the plain copy of the state.
        assert s.exposed_copy_seconds is not None and s.exposed_copy_seconds >= s.stall_mean
        assert s.after_save_iter_median is not None and s.rss_growth_bytes is not None
        # The first pair has the block with checkpoints first: its steps are the run's first ones.
        first = s.saved_steps[: 10 // k]
        assert first == list(range(first[0], first[0] + 10, k))
        # The second pair goes off-on: after the first pair's off block and its own, 20 steps without saves.
        assert s.saved_steps[10 // k] == first[0] + 30
    assert r.device == "cpu" and r.copy_limit_seconds is not None and r.copy_limit_seconds > 0
    # Checkpoints reached the disk while the blocks ran; each block with checkpoints ends with all durable.
    for s in timed.values():
        assert s.committed_before_drain and set(s.committed_before_drain) <= set(s.saved_steps) | {s.saved_steps[0] - 1}, s
        assert s.committed_after_drain[-1] == s.saved_steps[-1], s
        assert set(s.committed_after_drain) <= set(s.saved_steps) | {s.saved_steps[0] - 1}
    assert not list(d.iterdir()), "the scratch run dirs are removed"


def test_overhead_targets_json_table_plot(overhead_result, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, r, _ = overhead_result
    doc = json.loads(json.dumps(r.to_json()))
    assert doc["runs"][0]["method"] == "alpsck f=2" and doc["baseline_its"] > 0 and doc["drift_pct"] >= 0
    t, t_overlap = doc["targets"]
    assert t_overlap["method"] == "alpsck f=2 overlap"
    assert t["method"] == "alpsck f=2" and t["max_in_flight"] == 2 and t["persist_seconds"] > 0
    assert t["every_10"] is None  # 10 not among ks
    e1 = t["every_1"]
    assert e1["threshold_seconds"] == pytest.approx(t["persist_seconds"] / 2)
    assert e1["condition_held"] == (e1["iteration_seconds"] > e1["threshold_seconds"])
    assert e1["met"] == (e1["overhead_pct"] <= 5.0) and len(e1["pairs_pct"]) == 2
    assert e1["reliable"] == ((e1["other_cpu_cores"] or 0.0) <= 0.2)
    text = table(r)
    assert "alpsck f=2" in text and "torch.save" in text and "every iteration" in text and "felt copy" in text
    assert "pairs %" in text and "without" in text
    png = tmp_path / "overhead.png"
    assert plot(r, png)  # matplotlib is a test dependency: the plot is drawn in CI
    assert png.stat().st_size > 0


def test_overhead_rejects_k_beyond_iters(tmp_path: Path) -> None:
    from alpsck.errors import UsageError

    with pytest.raises(UsageError):
        run_overhead(tmp_path, OverheadConfig(ks=[20], iters=10))
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--device cuda"):
            run_overhead(tmp_path, OverheadConfig(device="cuda"))
    with pytest.raises(UsageError, match="--device tpu"):
        run_overhead(tmp_path, OverheadConfig(device="tpu"))


def test_each_restore_is_held_against_the_raw_reads_beside_it() -> None:
    # The disk slowed down for the first two restores and the raw read between them: paired, the
    # restores ran at the raw read's speed; medians of all samples would say half of it.
    assert restore_vs_raw_read([2.0, 2.0, 1.0], [1.0, 3.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert restore_vs_raw_read([2.0], [1.0, 1.0]) == pytest.approx(0.5)  # twice the raw read's time
    with pytest.raises(ValueError, match="2 restores need 3 raw reads"):
        restore_vs_raw_read([1.0, 1.0], [1.0, 1.0])


def test_the_arena_holds_the_training_state_bit_for_bit_and_page_aligned() -> None:
    """What the zero-copy benchmark measures rests on the rehoming: every parameter and moment
    moved into one page-aligned arena, the values unchanged, training still updating them there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("zero_copy_arena", REPO / "benchmarks" / "zero_copy_arena.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    arena = mod.rehome(model, opt)
    assert arena.data_ptr() % 4096 == 0
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    for p, b, m in zip(model.parameters(), before, moments, strict=True):
        for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
            assert lo <= t.data_ptr() < hi and t.data_ptr() % 4096 == 0
        assert torch.equal(p.detach(), b) and torch.equal(opt.state[p]["exp_avg"], m)
    snapshot = arena.clone()
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    assert not torch.equal(arena, snapshot)  # the step wrote into the arena
