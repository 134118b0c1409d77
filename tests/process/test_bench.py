"""``alpsck bench``: the training-overhead benchmark end to end on a tiny model, and the save/restore
benchmark's command line and JSON document. Small sizes throughout: the file runs in well under a
minute on 2 cores."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.tmpfs import mounted_tmpfs

from alpsck.bench.overhead import OverheadConfig, plot, run_overhead, table
from alpsck.bench.run import disk_needed, restore_vs_raw_read

REPO = Path(__file__).resolve().parents[2]
# A guard against a hang, not a measure of speed (the durations budget is that): CI ran a 10 s command
# for over 60 s while every lane started at once.
HANG_S = 600


def _env() -> dict[str, str]:
    # Subprocesses import the same alpsck as this process (the installed package in CI): putting the
    # source tree first would shadow it with a tree that has no compiled _core.
    return dict(os.environ)


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


def test_save_restore_bench_cli_json(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "alpsck", "bench", "--size-gib", "0.02", "--threads", "2", "--chunk-mib", "1",
           "--in-flight", "1", "--repeats", "2", "--json"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["raw_write_bps"] > 0 and doc["raw_read_bps"] > 0 and doc["state_bytes"] > 0
    names = [m["method"] for m in doc["measurements"]]
    assert "torch.save+fsync" in names and any(n.startswith("alpsck") for n in names)
    for m in doc["measurements"]:
        assert m["durable"] > 0 and m["restore"] > 0 and m["stall"] >= 0
        # The restore is the median of as many restores as saves (one was too noisy to compare).
        assert len(m["restores"]) == 2 and m["restore"] == pytest.approx(sum(m["restores"]) / 2), m
        # Each restore is held against the raw reads just before and after it.
        assert len(m["raw_reads"]) == 3 and m["restore_vs_raw"] == pytest.approx(
            restore_vs_raw_read(m["restores"], m["raw_reads"])), m
        # Every save copies or writes the state: it costs CPU (a zero here means it was not counted).
        assert 0 < m["cpu"] < 60, (m["method"], m["cpu"])
    assert doc["best"] in names and doc["best"].startswith("alpsck")
    assert doc["ratios"]["torch.save+fsync: CPU per save / alpsck"] > 0
    assert doc["ratios"]["durable_vs_raw_write"] > 0 and "torch.save+fsync: durable / alpsck" in doc["ratios"]
    assert doc["advice"]["min_interval_iterations"] >= 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("alpsck-bench-")], "its scratch dir is removed"


def test_bench_size_sweep_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "sizes.png"
    cmd = [sys.executable, "-m", "alpsck", "bench", "--size-gib", "0.01,0.02", "--threads", "2", "--chunk-mib", "1",
           "--in-flight", "1", "--repeats", "1", "--no-peers", "--json", "--plot", str(png)]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    docs = json.loads(p.stdout)["sizes"]
    assert [round(d["state_bytes"] / 2**30, 2) for d in docs] == [0.01, 0.02]
    assert png.stat().st_size > 0 and "plot written" in p.stderr
    # Each size out of range is named; a sweep is refused where one size is meant.
    for bad, why in (("0.5,0", "--size-gib"), ("1,nan", "--size-gib")):
        q = subprocess.run([sys.executable, "-m", "alpsck", "bench", "--size-gib", bad], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=HANG_S)
        assert q.returncode == 2 and why in q.stderr, q.stderr
    q = subprocess.run([sys.executable, "-m", "alpsck", "bench", "--ranks", "1", "--size-gib", "0.01,0.02", "--dir",
                        str(tmp_path)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert q.returncode != 0 and "one --size-gib" in q.stderr, q.stderr


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 MiB tmpfs: a file system with less room than a state the bench accepts (at most this
    machine's memory), which a large disk (78 GB free: a third of it is more than the 24 GiB of memory
    --size-gib allows) cannot be. Needs root, as CI and the developers' machines have."""
    with mounted_tmpfs(tmp_path / "small", "size=256m") as mnt:
        yield mnt


def test_bench_refuses_a_directory_without_room_before_writing_anything(small_fs: Path) -> None:
    # A full disk used to end the bench mid-run with a traceback from inside a peer (torch.save).
    tmp_path = small_fs
    free_gib = shutil.disk_usage(tmp_path).free / 2**30
    cmd = [sys.executable, "-m", "alpsck", "bench", "--dir", str(tmp_path), "--size-gib", f"{free_gib / 3:.3f}",
           "--repeats", "3"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 2, p.stderr
    assert f"--dir {tmp_path}: a " in p.stderr and "GiB free there" in p.stderr and "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written, no state built
    # What it asks for: the probe's file plus the greediest method's copies of the state.
    assert disk_needed(1, repeats=3, in_flight=2, peers=True) == 5  # probe + 4 (alpsck: 1 kept + 2 + 1 expired)
    assert disk_needed(1, repeats=9, in_flight=2, peers=True) == 11  # probe + a peer's 10 saves
    assert disk_needed(1, repeats=9, in_flight=2, peers=False) == 5


def test_overhead_cli_json(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "alpsck", "bench", "--overhead", "--dir", str(tmp_path), "--ks", "2", "--iters", "4",
           "--block", "2", "--warmup", "1", "--model-dim", "32", "--model-layers", "1", "--model-heads", "2",
           "--batch-size", "1", "--seq-len", "16", "--methods", "alpsck", "--rounds", "2", "--torch-threads", "1",
           "--json"]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    # One configuration, measured in both rounds; it reports its median round (the lower of two).
    assert [(r["method"], r["k"]) for r in doc["runs"]] == [("alpsck f=2", 2)]
    run = doc["runs"][0]
    assert doc["rounds"] == 2 and len(run["overhead_rounds"]) == 2
    assert run["overhead_pct"] == min(run["overhead_rounds"])
    assert run["block"] == 2 and run["iterations"] == 4 and len(run["pair_overheads_pct"]) == 2
    assert doc["model"]["dim"] == 32 and doc["iters"] == 4
    assert doc["machine"]["torch_threads"] == 1  # --torch-threads: the training's threads during the run
    assert "[overhead]" in p.stderr  # progress goes to stderr


def test_overhead_cli_rejects_save_bench_flags(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "alpsck", "bench", "--overhead", "--dir", str(tmp_path), "--chunk-mib", "4"],
                       env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 2 and "--chunk-mib" in p.stderr


def test_save_cpu_benchmark_reports_where_the_cpu_goes(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "save_cpu.py"), "--dir", str(tmp_path), "--saves", "2"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    figures = dict(re.findall(r"(stall|caller CPU|other CPU|total CPU|durable) ([0-9.]+) ms", p.stdout))
    assert set(figures) == {"stall", "caller CPU", "other CPU", "total CPU", "durable"}, p.stdout
    # The snapshot copy runs on the caller, the writes and the commit on other threads: both cost CPU.
    assert float(figures["caller CPU"]) > 0 and float(figures["other CPU"]) > 0, p.stdout
    assert float(figures["durable"]) >= float(figures["stall"]) > 0, p.stdout
    assert not (tmp_path / "save-cpu").exists(), "its run directory is removed"
    bad = subprocess.run([*cmd[:-1], "0"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert bad.returncode == 2 and "--saves must be at least 1" in bad.stderr


def test_zero_copy_arena_benchmark_runs_both_variants_and_checks_what_it_rehomed(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "zero_copy_arena.py"), "--dir", str(tmp_path), "--runs", "1",
           "--pairs", "1", "--block", "2", "--dim", "128", "--layers", "2"]
    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    rows = re.findall(r"run 1: (arena|default) +overhead +(-?[0-9.]+) % .* stall +([0-9.]+) ms", p.stdout)
    assert [r[0] for r in rows] == ["arena", "default"], p.stdout
    assert all(float(stall) > 0 for _, _, stall in rows), p.stdout
    assert list(tmp_path.iterdir()) == [], "its run directories are removed"
    bad = subprocess.run([*cmd[:9], "0"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert bad.returncode == 2 and "must be at least 1" in bad.stderr


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
