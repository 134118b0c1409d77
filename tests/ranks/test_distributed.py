"""Multi-rank checkpoints with real processes and a real gloo process group.

Each rank writes its own shard; replicated tensors are written once; the core commits once every
shard is durable; restore is a collective; a rank killed mid-save never leaves a committed
checkpoint missing a shard.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.ranks import free_port, outputs_of
from support.warm import ColdProcess, WarmProcess

import alpsck
from alpsck import _core

WORKER = r"""
import datetime, json, os, shutil, sys, time, warnings, torch, torch.distributed as dist, alpsck
torch.set_num_threads(1)
mode, run_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT_S", 1800))))
rank, world = dist.get_rank(), dist.get_world_size()
run_dir = run_dir.replace("{rank}", str(rank))  # each rank its own view of the run directory

def model_state(step):   # identical on every rank, like a DDP model
    g = torch.Generator().manual_seed(step)
    return {f"layer{i}": torch.randn(1000 * (i + 1), generator=g) for i in range(6)}

def local(step):          # differs per rank, like RNG streams or a data position
    return torch.full((3000,), float(100 * rank + step))

if mode == "save":
    ck = alpsck.Checkpointer(run_dir, replicated=("model",), keep_last=2, commit_timeout_s=60)
    for step in (1, 2, 3):
        state = {"model": model_state(step), "local": local(step), "step": step, "who": rank}
        ck.save(step, state).wait()
    ck.close()
elif mode == "restore":
    state = {"model": {k: torch.zeros_like(v) for k, v in model_state(0).items()}, "local": torch.zeros(3000),
             "step": 0, "who": -1}
    with alpsck.Checkpointer(run_dir) as ck:
        got = ck.restore(state)
    ok = all(torch.equal(state["model"][k], v) for k, v in model_state(got).items())
    print(json.dumps({"rank": rank, "step": got, "model_ok": ok, "local": state["local"][0].item(),
                      "who": state["who"]}), flush=True)
elif mode == "churn":      # saves back to back until killed; reports what became durable
    ck = alpsck.Checkpointer(run_dir, replicated=("model",), keep_last=3, max_in_flight=2, commit_timeout_s=3,
                             chunk_bytes=64 << 10)
    big = {f"w{i}": torch.zeros(250_000) for i in range(8)}
    pending, step = [], int(sys.argv[3])
    while True:
        for t in big.values():
            t.fill_(float(step))
        pending.append(ck.save(step, {"model": big, "local": local(step), "step": step}))
        for h in [h for h in pending if h.done()]:
            pending.remove(h)
            try:
                h.wait()
                print(f"durable {h.step}", flush=True)
            except alpsck.errors.CheckpointError as e:
                print(f"failed {h.step} {e}", flush=True)
        step += 1
elif mode == "retry":      # rank 1's first save of step 2 fails; every rank saves step 2 again
    ck = alpsck.Checkpointer(run_dir, replicated=("model",), keep_last=0, commit_timeout_s=60)
    state = lambda step: {"model": model_state(step), "local": local(step), "step": step}
    ck.save(1, state(1)).wait()
    blocker = os.path.join(run_dir, "step-000000002.tmp", f"rank-{rank:05d}.bin")
    if rank == 1:  # a directory where the shard goes: its open fails (EISDIR), a stand-in for ENOSPC
        os.makedirs(blocker)
    dist.barrier()
    try:
        ck.save(2, state(2)).wait()
        print("first attempt: saved", flush=True)
    except alpsck.errors.CheckpointError as e:
        print(f"first attempt: {type(e).__name__}: {e}", flush=True)
    if rank == 1:  # the blocker moved with the aborted attempt (step-2.aborted) unless it was already removed
        for attempt_dir in ("step-000000002.tmp", "step-000000002.aborted"):
            shutil.rmtree(os.path.join(run_dir, attempt_dir, f"rank-{rank:05d}.bin"), ignore_errors=True)
    dist.barrier()
    ck.save(2, state(2)).wait()
    ck.save(3, state(3)).wait()
    ck.close()
    print(json.dumps({"rank": rank, "retried": True}), flush=True)
elif mode == "skew":       # rank 0 saves ~big_bytes, rank 1 a few KB; commit_timeout_s 0.3 on odd steps, 60 on even
    reps, big_bytes = int(sys.argv[3]), int(sys.argv[4])
    state = {"w": torch.ones(big_bytes // 4) if rank == 0 else torch.arange(256, dtype=torch.float32)}
    for step in range(1, reps + 1):
        with alpsck.Checkpointer(run_dir, keep_last=0, commit_timeout_s=0.3 if step % 2 else 60, max_in_flight=1) as ck:
            try:
                ck.save(step, state).wait()
                out = {"step": step, "ok": True}
            except alpsck.errors.CheckpointError as e:
                out = {"step": step, "ok": False, "error": str(e)}
        print(json.dumps(out), flush=True)
elif mode == "missing":    # rank 1 saves step 1 and never step 2: rank 0 traces the failed commit to rank 1's node
    from alpsck.progress import SAVED_HOOKS
    from alpsck.slurm import trace
    from alpsck.slurm.stragglers import PaceWatch
    watch = PaceWatch(run_dir, "77", 0, factor=2.0, saves=5)
    SAVED_HOOKS.append(lambda _dir, result: watch.saw(result))
    out = {}
    with alpsck.Checkpointer(run_dir, keep_last=0, commit_timeout_s=5) as ck:
        ck.save(1, {"w": torch.arange(256.0)}).wait()
        if rank == 0:  # step 1's result reaches the hook at this save
            try:
                ck.save(2, {"w": torch.arange(256.0)}).wait()
            except alpsck.errors.CheckpointError as e:
                out["error"] = str(e)
                out["traced"] = trace.trace_missing(run_dir, "77", 0, str(e), watch.nodes)
    out["nodes"] = {str(k): v for k, v in watch.nodes.items()}  # rank 1's results carry no ranks: none
    dist.barrier()
    print(json.dumps(out), flush=True)
elif mode == "restore-or-fail":  # the step restored or the error restore raised, then the script's next collective
    state = {"model": {k: torch.zeros_like(v) for k, v in model_state(0).items()}, "local": torch.zeros(3000),
             "step": 0, "who": -1}
    if rank == 1 and sys.argv[3:] == ["mismatch"]:
        state["local"] = torch.zeros(10)
    if rank == 1 and sys.argv[3:] == ["unsupported"]:
        state["handle"] = object()
    step = int(sys.argv[4]) if sys.argv[3:4] == ["step"] else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if sys.argv[3:4] == ["read-only"]:  # restore_into: no lock, no engine, only the restore's collectives
                got = alpsck.restore_into(run_dir, state, ranks=alpsck.ranks.Ranks.detect(None, None))
            else:
                with alpsck.Checkpointer(run_dir) as ck:
                    got = ck.restore(state, step=step)
            out = {"step": got, "model_ok": all(torch.equal(state["model"][k], v) for k, v in model_state(got).items()),
                   "local": state["local"][0].item()}
        except Exception as e:
            out = {"error": type(e).__name__, "message": str(e)}
    dist.barrier()
    print(json.dumps({"rank": rank, **out, "warnings": [str(w.message) for w in caught]}), flush=True)
elif mode == "open-or-fail":  # every rank opens a Checkpointer on its view of the run directory, then a collective
    try:
        with alpsck.Checkpointer(run_dir):
            out = {"opened": True}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    dist.barrier()
    print(json.dumps({"rank": rank, **out}), flush=True)
elif mode == "from-rank0":  # rank 0's lists of several lengths, as every rank receives them
    ranks = alpsck.ranks.Ranks.detect(None, None)
    got = [ranks.from_rank0([10 * n + i for i in range(n)] if rank == 0 else []) for n in (0, 1, 2, 7, 8, 30)]
    each = [ranks.each_list([100 * rank + i for i in range(n)]) for n in ((0, 3, 7, 8, 20) if rank == 0 else (5, 0, 9, 7, 1))]
    print(json.dumps({"rank": rank, "got": got, "each": each}), flush=True)
elif mode == "restore-churn":
    state = {"model": {f"w{i}": torch.empty(250_000) for i in range(8)}, "local": torch.zeros(3000), "step": 0}
    with alpsck.Checkpointer(run_dir) as ck:
        got = ck.restore(state)
    ok = all(torch.equal(t, torch.full((250_000,), float(got))) for t in state["model"].values())
    print(json.dumps({"rank": rank, "step": got, "model_ok": ok, "local": state["local"][0].item()}), flush=True)
dist.destroy_process_group()
"""


def _launch(tmp_path: Path, world: int, *args: str, env: dict[str, str] | None = None,
            wrap: dict[int, list[str]] | None = None) -> list[WarmProcess | ColdProcess]:
    """The worker on ``world`` ranks, forked warm (support/warm.py), but a rank with a wrapper command (cold);
    each rank's output in a file of its own (``proc.output``)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    outputs = Path(tempfile.mkdtemp(prefix=f"{args[0]}-", dir=tmp_path))
    procs: list[WarmProcess | ColdProcess] = []
    for rank in range(world):
        rank_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                    "WORLD_SIZE": str(world), "RANK": str(rank), "OMP_NUM_THREADS": "1"}
        out = outputs / f"rank-{rank}.out"
        if rank in (wrap or {}):
            procs.append(ColdProcess([*(wrap or {})[rank], sys.executable, str(script), *args], rank_env, out))
        else:
            procs.append(WarmProcess(script, list(args), rank_env, out))
    return procs


def _outputs(procs: list[WarmProcess | ColdProcess]) -> list[str]:
    return outputs_of(procs, 120)


def _root_without_dac_bypass_for(rank: int) -> dict[int, list[str]]:
    """The wrapper that makes ``rank`` subject to file permissions while the other rank (root) is not."""
    if os.geteuid() != 0:
        why = "needs root: rank 0 must read what rank 1 may not (CI runs as root)"
        if os.environ.get("CI"):
            pytest.fail(why)  # in CI a skip would count as passing
        pytest.skip(why)
    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's permission bypass"
    return {rank: ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]}


def _restore_results(tmp_path: Path, run_dir: Path | str, *args: str,
                     wrap: dict[int, list[str]] | None = None) -> list[dict[str, Any]]:
    """Every rank's outcome of restore-or-fail, promptly: a rank left waiting fails the gloo timeout."""
    start = time.monotonic()
    outs = _outputs(_launch(tmp_path, 2, "restore-or-fail", str(run_dir), *args, env={"GLOO_TIMEOUT_S": "20"},
                            wrap=wrap))
    assert time.monotonic() - start < 60, "restore waited for the gloo timeout"
    return sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda r: r["rank"])


def test_each_rank_writes_a_shard_and_replicated_tensors_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _outputs(_launch(tmp_path, 2, "save", str(run)))
    infos = _core.scan(str(run), verify=True)
    assert [(i["step"], i["status"], i["ranks"]) for i in infos] == [(2, "committed", 2), (3, "committed", 2)]
    assert infos[-1]["shards"] == ["rank-00000.bin", "rank-00001.bin"]
    names = [{n for n, _, _ in _core.ShardReader(str(Path(infos[-1]["path"]) / f"rank-{r:05d}.bin")).extents}
             for r in (0, 1)]
    model = {f"model/layer{i}" for i in range(6)}
    # Each replicated tensor lies in exactly one shard, and the work is split; the local one in both.
    assert not (names[0] & names[1] & model) and (names[0] | names[1]) >= model
    assert names[0] & model and names[1] & model
    assert "local" in names[0] and "local" in names[1]
    sizes = [sum(s for n, _, s in _core.ShardReader(str(Path(infos[-1]["path"]) / f"rank-{r:05d}.bin")).extents)
             for r in (0, 1)]
    assert max(sizes) < 0.7 * sum(sizes)  # balanced by size, not all on rank 0
    # No leftovers of the coordination: no .tmp dirs; expired step 1 is kept for reuse as a
    # free-* directory holding its two shards and its manifest (replaced by the commit of the save
    # that claims it), no DONE records.
    dirs = sorted(p.name for p in run.iterdir() if p.is_dir())
    assert dirs[1:] == ["step-000000002", "step-000000003"] and dirs[0].startswith("free-"), dirs
    assert not dirs[0].endswith(".new")
    assert sorted(p.name for p in (run / dirs[0]).iterdir()) == ["MANIFEST.json", "rank-00000.bin", "rank-00001.bin"]

    results = sorted((json.loads(o.strip().splitlines()[-1]) for o in _outputs(_launch(tmp_path, 2, "restore", str(run)))),
                     key=lambda r: r["rank"])
    assert [r["step"] for r in results] == [3, 3]
    assert all(r["model_ok"] for r in results)
    assert [r["local"] for r in results] == [3.0, 103.0]  # each rank gets its own tree back
    assert [r["who"] for r in results] == [0, 1]


def test_restore_at_another_world_size_is_refused_clearly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _outputs(_launch(tmp_path, 2, "save", str(run)))
    with pytest.raises(alpsck.errors.UsageError, match="written by 2 rank.*this job has 1.*alpsck.dcp"):
        alpsck.restore_into(run, {"local": torch.zeros(3000)})
    # Naming a rank without ranks= once returned None ("no checkpoint") for any rank but 0.
    with pytest.raises(alpsck.errors.UsageError, match=r"restore_into\(rank=1\) without ranks=.*read_checkpoint"):
        alpsck.restore_into(run, {"local": torch.zeros(3000)}, rank=1)
    meta, tensors = alpsck.checkpointer.read_checkpoint(next(run.glob("step-*")), rank=1)  # what it points to
    assert meta["rank"] == 1 and meta["world_size"] == 2 and tensors


def _wait_until(pred: Any, timeout: float, what: str, procs: list[WarmProcess | ColdProcess]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            raise AssertionError(f"no {what} within {timeout:.0f} s (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.1)


def test_a_rank_killed_mid_save_never_commits_a_checkpoint_without_its_shard(tmp_path: Path) -> None:
    run = tmp_path / "run"
    start = 1
    for round_ in range(3):
        procs = _launch(tmp_path, 2, "churn", str(run), str(start))
        log0 = procs[0].output

        def seen(word: str, log: Path = log0) -> bool:
            return any(line.startswith(word) for line in log.read_text().splitlines())

        # Waits on what rank 0 reports, not on fixed sleeps: start-up under load takes longer.
        _wait_until(lambda: seen("durable "), 120, "rank 0's first durable save", procs)
        time.sleep(0.5 + round_ * 0.7)  # each round kills at another moment of the save cycle
        procs[1].send_signal(signal.SIGKILL)  # rank 1 dies mid-save
        procs[1].wait()
        # rank 0 goes on: its saves must time out (commit_timeout_s=3) and fail, not commit
        _wait_until(lambda: seen("failed "), 120, "rank 0's first failed save", procs[:1])
        time.sleep(1.0)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        out0 = log0.read_text()
        durable = [int(line.split()[1]) for line in out0.splitlines() if line.startswith("durable ")]
        failed = [int(line.split()[1]) for line in out0.splitlines() if line.startswith("failed ")]
        assert durable and failed, out0[-2000:]
        infos = _core.scan(str(run), verify=True)
        assert not [i for i in infos if i["status"] == "corrupt"], infos
        committed = [i for i in infos if i["status"] == "committed"]
        assert all(i["ranks"] == 2 and len(i["shards"]) == 2 for i in committed), committed
        assert committed and max(i["step"] for i in committed) >= max(durable)
        assert not set(failed) & {i["step"] for i in committed}
        for info in committed:
            for r in (0, 1):
                assert _core.ShardReader(str(Path(info["path"]) / f"rank-{r:05d}.bin")).rank == r
        start = max(i["step"] for i in committed) + 1
    # Two new ranks restore the newest complete checkpoint, each its own tree.
    results = sorted((json.loads(o.strip().splitlines()[-1])
                      for o in _outputs(_launch(tmp_path, 2, "restore-churn", str(run)))), key=lambda r: r["rank"])
    assert [r["step"] for r in results] == [start - 1] * 2
    assert all(r["model_ok"] for r in results)
    assert [r["local"] for r in results] == [float(start - 1), float(100 + start - 1)]


def test_every_rank_can_save_a_step_again_after_one_rank_failed_it(tmp_path: Path) -> None:
    """A failed save is retried for the same step in the same processes (say, after a transient
    error): each attempt writes a directory of its own, so the retry does not meet the aborted
    attempt's verdict or files, and commits."""
    run = tmp_path / "run"
    outs = _outputs(_launch(tmp_path, 2, "retry", str(run)))
    first = [next(line for line in o.splitlines() if line.startswith("first attempt:")) for o in outs]
    assert "CheckpointWriteError" in first[1] and "rank-00001.bin" in first[1], first[1]
    assert "rank 1 failed to write its shard" in first[0] and "Is a directory" in first[0], first[0]
    assert all(json.loads(o.strip().splitlines()[-1])["retried"] for o in outs)
    infos = _core.scan(str(run), verify=True)
    assert [(i["step"], i["status"], i["ranks"]) for i in infos] == [(1, "committed", 2), (2, "committed", 2),
                                                                     (3, "committed", 2)]
    # The aborted attempt's directory went once the retry committed.
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == [f"step-00000000{s}" for s in (1, 2, 3)]
    for r in (0, 1):  # what each rank wrote on the retry is there
        local = torch.empty(3000)
        _core.ShardReader(str(run / "step-000000002" / f"rank-{r:05d}.bin")).read_into([("local", local.view(torch.uint8))])
        assert torch.equal(local, torch.full((3000,), float(100 * r + 2)))


def test_skewed_ranks_with_a_tiny_commit_timeout_report_one_verdict_that_the_disk_agrees_with(tmp_path: Path) -> None:
    """Rank 0 saves ~1.5 GB, rank 1 a few KB, commit_timeout_s=0.3 (odd steps): rank 1 gives up long
    before rank 0's shard is durable. It used to report failure while rank 0 went on to commit the
    step (a split verdict) and leave a step-N.a1.tmp on retry. Now every step has one verdict on
    both ranks, inspect-checkpoints agrees with it, and nothing of any attempt is left. (Even steps
    wait 60 s and commit: both outcomes in one run.)"""
    run = tmp_path / "run"
    reps, big = 8, int(os.environ.get("ALPSCK_SKEW_BYTES", 1_500_000_000))  # 4 steps of each outcome
    outs = _outputs(_launch(tmp_path, 2, "skew", str(run), str(reps), str(big)))
    results = [[json.loads(line) for line in o.splitlines() if line.startswith("{")] for o in outs]
    assert [len(r) for r in results] == [reps, reps], outs
    verdicts = {}
    for r0, r1 in zip(*results, strict=True):
        assert r0["ok"] == r1["ok"], (r0, r1)
        verdicts[r0["step"]] = r0["ok"]
        if not r0["ok"]:  # both name the one reason the winner recorded
            assert "was aborted: rank " in r0["error"] and "was aborted: rank " in r1["error"], (r0, r1)
    # Both outcomes happened (0.3 s is far too short for rank 0's 1.5 GB; 60 s is not).
    assert not all(verdicts.values()) and any(verdicts.values()), verdicts
    inspected = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run), "--json"],
                                          capture_output=True, text=True, check=True).stdout)
    committed = sorted(c["step"] for c in inspected["checkpoints"] if c["status"] == "committed")
    assert committed == sorted(step for step, ok in verdicts.items() if ok)
    left = sorted(p.name for p in run.iterdir() if _core.parse_run_dir_name(p.name)[0] not in ("step", "latest", "lock"))
    assert left == [], left


def test_a_commit_that_misses_a_rank_is_traced_to_the_node_its_records_named(tmp_path: Path) -> None:
    """Issue 55, item 2: rank 0's first save hears every rank's node (their records, through the core's agreement);
    at the second, rank 1 never arrives: rank 0's error names it, and the trace puts it on rank 1's node."""
    import socket

    procs = _launch(tmp_path, 2, "missing", str(tmp_path / "run"))
    r0, r1 = (json.loads(o.strip().splitlines()[-1]) for o in _outputs(procs))
    assert r0["nodes"] == {"0": socket.gethostname(), "1": socket.gethostname()} and r1["nodes"] == {}, (r0, r1)
    assert "no shard from rank(s) 1 after 5 s" in r0["error"], r0
    assert r0["traced"] == [socket.gethostname()], r0
    [t] = [e for e in (json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines())
           if e["event"] == "traced"]
    assert (t["node"], t["task"], t["attempt"]) == (socket.gethostname(), 1, 0), t


def test_restore_skips_a_checkpoint_one_rank_cannot_read_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 gets EACCES on its own shard of step 3 (a CheckpointIOError, not corruption: rank 0's
    scan sees step 3 committed, so both ranks try it). Every rank must reach the agreement: both skip
    to step 2, promptly, rather than rank 1 leaving restore while rank 0 waits for it."""
    wrap = _root_without_dac_bypass_for(1)
    run = tmp_path / "run"
    _outputs(_launch(tmp_path, 2, "save", str(run)))
    shard = run / "step-000000003" / "rank-00001.bin"
    shard.chmod(0)
    try:
        results = _restore_results(tmp_path, run, wrap=wrap)
    finally:
        shard.chmod(0o644)
    assert [r.get("step") for r in results] == [2, 2], results
    assert all(r["model_ok"] for r in results) and [r["local"] for r in results] == [2.0, 102.0]
    assert any("skipping unreadable checkpoint" in w and "Permission denied" in w for w in results[1]["warnings"]), results[1]
    assert any("step 3" in w and "rank 1" in w for w in results[0]["warnings"]), results[0]


def test_a_rank_whose_restore_fails_otherwise_stops_every_rank(tmp_path: Path) -> None:
    """Rank 1's state does not fit the checkpoint (StateMismatchError), or cannot be captured at all
    (StateTypeError): rank 1 raises its error, rank 0 a CheckpointError naming rank 1; neither restores
    alone, nor waits for the other."""
    run = tmp_path / "run"
    _outputs(_launch(tmp_path, 2, "save", str(run)))
    for variant, error, says in (("mismatch", "StateMismatchError", "local"), ("unsupported", "StateTypeError", "handle")):
        start = time.monotonic()
        outs = _outputs(_launch(tmp_path, 2, "restore-or-fail", str(run), variant, env={"GLOO_TIMEOUT_S": "20"}))
        assert time.monotonic() - start < 60, f"{variant}: restore waited for the gloo timeout"
        results = sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda r: r["rank"])
        assert results[1].get("error") == error and says in results[1]["message"], results[1]
        assert results[0].get("error") == "CheckpointError", results[0]
        assert "step 3 failed on rank 1" in results[0]["message"], results[0]
    # With no checkpoint to try, too: rank 0 does not go on as if nothing were wrong while rank 1 raises.
    results = _restore_results(tmp_path, tmp_path / "empty", "unsupported")
    assert results[1].get("error") == "StateTypeError" and results[0].get("error") == "CheckpointError", results
    assert "rank 1 cannot restore into its state" in str(results[0]["message"]), results


def test_only_rank_0_lists_the_run_dir_and_when_it_cannot_every_rank_stops(tmp_path: Path) -> None:
    """Rank 0 alone lists the run directory and picks; the others read the steps it names at their
    names. So a rank > 0 that gets EACCES listing it restores all the same (it never lists), and
    when rank 0 cannot list it, rank 0 raises its error and rank 1 a CheckpointError naming rank 0,
    rather than waiting for rank 0's candidates."""
    run = tmp_path / "run"
    _outputs(_launch(tmp_path, 2, "save", str(run)))
    results = []
    for rank in (1, 0):
        wrap = _root_without_dac_bypass_for(rank)
        run.chmod(0o300)  # files inside can be opened, the directory cannot be listed
        try:
            results.append(_restore_results(tmp_path, run, "read-only", wrap=wrap))
        finally:
            run.chmod(0o755)
    blind_1, blind_0 = results
    assert [(r.get("step"), r.get("model_ok")) for r in blind_1] == [(3, True)] * 2, blind_1
    assert blind_0[0].get("error") == "CheckpointIOError" and "Permission denied" in str(blind_0[0]["message"]), blind_0
    assert blind_0[1].get("error") == "CheckpointError", blind_0
    assert "rank 0 could not list the run directory" in str(blind_0[1]["message"]), blind_0


def test_a_checkpointer_one_rank_cannot_open_is_closed_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 opens first (its engine tidies the run directory) and tells the others, with the namespace of
    their agreements; then every rank must have opened. When rank 1 cannot open (a run directory it may not
    write), or rank 0 cannot, that rank raises its own error and the other a CheckpointError naming no
    checkpointer it left open: neither waits for the other, and the run directory's lock is free again."""
    views = tmp_path / "view-{rank}"
    for failing in (1, 0):
        for r in (0, 1):
            shutil.rmtree(tmp_path / f"view-{r}", ignore_errors=True)
            (tmp_path / f"view-{r}").mkdir()
        (tmp_path / f"view-{failing}").chmod(0o555)  # its run directory cannot be made there
        try:
            start = time.monotonic()
            outs = _outputs(_launch(tmp_path, 2, "open-or-fail", str(views / "run"), env={"GLOO_TIMEOUT_S": "20"},
                                    wrap=_root_without_dac_bypass_for(failing)))
            assert time.monotonic() - start < 60, "an open waited for the gloo timeout"
        finally:
            (tmp_path / f"view-{failing}").chmod(0o755)
        results = sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda r: r["rank"])
        other = 1 - failing
        assert "Permission denied" in results[failing].get("message", ""), results
        assert results[other].get("error") == "CheckpointError", results
        assert "another rank could not open its checkpointer" in results[other]["message"], results
        with alpsck.Checkpointer(tmp_path / f"view-{other}" / "run"):  # rank `other`'s lock went with its engine
            pass


def test_a_run_directory_one_rank_sees_as_a_file_stops_every_rank_at_once(tmp_path: Path) -> None:
    """A refusal that one rank's view alone gives (its run directory is a file there) is said through the open's
    collectives: that rank raises it before touching anything, the other a CheckpointError, neither waiting for
    the other until the process group's timeout, and nothing stays locked."""
    views = tmp_path / "view-{rank}"
    for failing in (1, 0):
        for r in (0, 1):
            shutil.rmtree(tmp_path / f"view-{r}", ignore_errors=True)
            (tmp_path / f"view-{r}").mkdir()
        (tmp_path / f"view-{failing}" / "run").write_text("not a directory")
        start = time.monotonic()
        outs = _outputs(_launch(tmp_path, 2, "open-or-fail", str(views / "run"), env={"GLOO_TIMEOUT_S": "60"}))
        assert time.monotonic() - start < 50, "an open waited for the gloo timeout"
        results = sorted((json.loads(o.strip().splitlines()[-1]) for o in outs), key=lambda r: r["rank"])
        other = 1 - failing
        assert results[failing].get("error") == "UsageError", results
        assert "exists but is not a directory" in results[failing]["message"], results
        assert results[other].get("error") == "CheckpointError", results
        assert "another rank could not open its checkpointer" in results[other]["message"], results
        assert (tmp_path / f"view-{failing}" / "run").read_text() == "not a directory"
        with alpsck.Checkpointer(tmp_path / f"view-{other}" / "run"):  # rank `other`'s lock went with its engine
            pass


def test_lists_of_ints_reach_every_rank_whatever_their_length(tmp_path: Path) -> None:
    """``Ranks.from_rank0`` (rank 0's list) and ``Ranks.each_list`` (every rank's) send a list's length and first
    seven values in one collective, the rest in a second."""
    outs = [json.loads(o.strip().splitlines()[-1]) for o in _outputs(_launch(tmp_path, 2, "from-rank0", str(tmp_path)))]
    want = [[10 * n + i for i in range(n)] for n in (0, 1, 2, 7, 8, 30)]
    assert [o["got"] for o in outs] == [want, want]
    each = [[list(range(a)), [100 + i for i in range(b)]] for a, b in ((0, 5), (3, 0), (7, 9), (8, 7), (20, 1))]
    assert [o["each"] for o in outs] == [each, each]


def test_rank_0s_listing_decides_an_explicit_step_and_the_world_size(tmp_path: Path) -> None:
    """The ranks see the run directory differently (a stale client cache, say; here each rank has
    its own copy): rank 0 decides whether the step asked for exists and whether the newest
    checkpoint fits the world size, and every rank ends the same way, none waiting for another."""
    run = tmp_path / "run"
    _outputs(_launch(tmp_path, 2, "save", str(run)))
    for r in (0, 1):
        shutil.copytree(run, tmp_path / f"run-{r}", symlinks=True)
    views = str(tmp_path / "run-{rank}")

    shutil.rmtree(tmp_path / "run-1" / "step-000000003")  # rank 0 sees step 3, rank 1 does not
    results = _restore_results(tmp_path, views, "step", "3")
    # Rank 0 read its part straight into its live tensors before it knew: every rank is told to rebuild.
    assert [r.get("error") for r in results] == ["CorruptCheckpointError"] * 2, results
    assert "overwrote live tensors on rank 0; rebuild the state on every rank" in str(results[1]["message"]), results
    assert any("step 3 is not visible from rank 1" in w for w in results[1]["warnings"]), results[1]
    assert any("step 3" in w and "rank 1 could not read it" in w for w in results[0]["warnings"]), results[0]
    assert [r.get("step") for r in _restore_results(tmp_path, views, "step", "2")] == [2, 2]

    shutil.rmtree(tmp_path / "run-0" / "step-000000003")
    shutil.copytree(run / "step-000000003", tmp_path / "run-1" / "step-000000003")  # now only rank 1 sees it
    results = _restore_results(tmp_path, views, "step", "3")
    assert [r.get("error") for r in results] == ["NoCheckpointError"] * 2, results
    assert "no checkpoint of step 3 (rank 0 lists none" in str(results[1]["message"]), results[1]

    solo = tmp_path / "solo"  # rank 0 sees a newer checkpoint written by one rank, rank 1 does not
    with alpsck.Checkpointer(solo) as ck:
        ck.save(4, {"local": torch.zeros(3000)}).wait()
    shutil.copytree(solo / "step-000000004", tmp_path / "run-0" / "step-000000004")
    results = _restore_results(tmp_path, views)
    assert [r.get("error") for r in results] == ["UsageError"] * 2, results
    assert all("step 4 was written by 1 rank(s), this job has 2" in str(r["message"]) for r in results), results


def test_dtensor_state_is_pointed_to_the_dcp_backend(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        dt = distribute_tensor(torch.arange(8.0), DeviceMesh("cpu", [0]), [Shard(0)])
        with alpsck.Checkpointer(tmp_path) as ck, pytest.raises(TypeError, match="w: a DTensor.*AlpsckStorageWriter"):
            ck.save(1, {"w": dt})
        assert not [i for i in _core.scan(str(tmp_path)) if i["status"] == "committed"]
    finally:
        dist.destroy_process_group()
