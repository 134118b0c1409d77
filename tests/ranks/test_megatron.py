"""Megatron-LM's distributed checkpoints through alpsck (issue 56, item 1; docs/megatron.md): a tiny megatron-core
0.16.1 GPT on CPU, tensor-parallel over 1 and 2 ranks (gloo), checkpointed with ``dist_checkpointing.save`` and
alpsck's save strategy, every rank SIGKILLed mid-run and started again: it loads the newest iteration through
alpsck's load strategy (picked by ``metadata.json``) and every later step's loss equals an uninterrupted run's,
bit for bit (model and Adam state). A damaged newest iteration is found by ``checked_latest`` and the run resumes
from the one before. The asynchronous path (``--async-save``'s) too: every rank killed right after scheduling a
save, which Megatron never finalized, resumes from the one before it. CI installs megatron-core (.ci/run); without
it the test skips here, and fails under CI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from support import SUPPORT
from support.corrupt import flip_byte
from support.framework_runs import check_kill_and_resume, losses_of, run_worker
from support.ranks import outputs_of, rank_env
from support.releases import require_release
from support.warm import WarmProcess

from alpsck import _core
from alpsck.job_env import free_port
from alpsck.store import memory_tier

WORKER = SUPPORT / "megatron_worker.py"


@pytest.fixture(autouse=True)
def _needs_megatron() -> None:
    require_release("megatron.core", "megatron-core", "0.16.1", "this test and docs/megatron.md")


def _is_alpscks(out: Path, damage: bool) -> None:
    iteration = out / "iter_0000010"
    assert json.loads((iteration / "metadata.json").read_text())["sharded_backend"] == "alpsck"
    assert not list(iteration.glob("*.distcp"))  # no torch_dist shard: the tensors are in alpsck's
    if damage:
        flip_byte(next(iteration.glob(f"alpsck/step-*/{_core.shard_file_name(0)}")), 100)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_killed_megatron_gpt_resumes_bit_exact(tmp_path: Path, ranks: int) -> None:
    check_kill_and_resume(WORKER, tmp_path, ranks, damage=lambda out: _is_alpscks(out, False))


def test_a_damaged_newest_iteration_resumes_from_the_one_before(tmp_path: Path) -> None:
    log = check_kill_and_resume(WORKER, tmp_path, 2, damage=lambda out: _is_alpscks(out, True), resumed_from=6)
    assert "iteration 10 cannot be loaded" in log and "resuming from iteration 5" in log, log[-3000:]


def test_an_async_save_never_finalized_is_not_resumed_and_the_one_before_is(tmp_path: Path) -> None:
    """``async_sharded_save=True`` through Megatron's AsyncCallsQueue, 2 ranks: every rank is killed right after
    scheduling the save of step 15. That save may have reached alpsck's commit or not, but Megatron never
    finalized it: no metadata.json, the tracker still names 10. The resume loads 10, and every step equals an
    uninterrupted run's (also asynchronous). The finalized ones hold alpsck's checkpoint, as the sync path's."""
    def unfinalized(out: Path) -> None:
        assert (out / alpsck_tracker()).read_text() == "10" and not (out / "iter_0000015" / "metadata.json").exists()
        _is_alpscks(out, False)

    check_kill_and_resume(WORKER, tmp_path, 2, options=("--async",), kill_at=15, damage=unfinalized)


@pytest.mark.parametrize("options", [("--fully-parallel",), ("--fully-parallel", "--async")])
def test_a_fully_parallel_save_spreads_the_replicas_over_the_ranks_and_resumes_bit_exact(
        tmp_path: Path, options: tuple[str, ...]) -> None:
    """Megatron-LM's ``--ckpt-fully-parallel-save`` (its default) and ``--ckpt-fully-parallel-load``, 2 data-parallel
    ranks holding one replica, synchronous and with ``--async-save``: ``training_save_strategy`` wraps alpsck's
    strategy in megatron-core's ``FullyParallelSaveStrategyWrapper``, so each rank writes about half of the
    replicated tensors (without it the first rank writes them all and the other's shard holds nothing), and the
    load's wrapper reads them back through alpsck's strategy and exchanges them; every rank SIGKILLed mid-run
    resumes from iteration 10 bit-exact."""
    def spread(out: Path) -> None:
        _is_alpscks(out, False)
        step = next((out / "iter_0000010" / "alpsck").glob("step-*"))
        sizes = [(step / _core.shard_file_name(rank)).stat().st_size for rank in (0, 1)]
        assert min(sizes) > 0.3 * sum(sizes), sizes

    # Asynchronous: killed right after scheduling the save of 15, which finalized 10 (as the async test above).
    check_kill_and_resume(WORKER, tmp_path, 2, options=options, damage=spread, kill_at=15 if "--async" in options else 12)


def test_training_save_strategy_wraps_only_where_megatron_lm_would() -> None:
    """Without ``ckpt_fully_parallel_save`` (Megatron-LM's ``--no-ckpt-fully-parallel-save``) the strategy is
    alpsck's own, with the options given."""
    from argparse import Namespace

    from alpsck.integrations.megatron import AlpsckSaveStrategy, training_save_strategy

    plain = training_save_strategy(Namespace(ckpt_fully_parallel_save=False), threads=3)
    assert isinstance(plain, AlpsckSaveStrategy) and plain.options == {"threads": 3}


def alpsck_tracker() -> str:
    from alpsck.integrations.megatron import TRACKER

    return TRACKER


def test_the_async_waiter_removes_the_done_file_it_saw(tmp_path: Path) -> None:
    """An async save's waiter (in Megatron's async process) removes the trainer's done file once it saw it,
    so a trainer killed before its finalize leaves no file in the temp directory."""
    from alpsck.integrations.megatron_local import wait_for

    done = tmp_path / ".alpsck-megatron-done"
    done.touch()
    wait_for(str(done), os.getppid())
    assert not done.exists()
    wait_for(str(tmp_path / "never-made"), -1)  # the trainer is gone: back at once, nothing to remove


def _local_checkpoints(out: Path, ranks: int, damage_rank: int | None = None) -> None:
    """Each rank's own run directory under ``local/`` holds alpsck checkpoints 5 and 10 (keep_last 2), no pickle;
    ``damage_rank``: one byte of that rank's iteration 10 flipped."""
    for rank in range(ranks):
        run = out / "local" / f"rank-{rank:05d}"
        assert sorted(i["step"] for i in _core.scan(str(run)) if i["status"] == "committed") == [5, 10]
        assert not [p for p in run.rglob("*") if p.suffix in (".pt", ".pkl")]
        if rank == damage_rank:
            flip_byte(next(run.glob(f"step-*10/{_core.shard_file_name(0)}")), 100)


@pytest.mark.parametrize(("options", "ranks"), [(("--mcore-local",), 2), (("--mcore-local", "--async"), 2)])
def test_megatron_local_checkpoints_resume_bit_exact(tmp_path: Path, options: tuple[str, ...], ranks: int) -> None:
    """Megatron-LM's local checkpoints (``--non-persistent-ckpt-type local``) through ``AlpsckLocalCheckpointManager``,
    as Megatron-LM's save and load call it: the ``MCoreTensorAwareStateDict`` of each rank (nvidia-resiliency-ext's
    type) written to its own run directory, synchronously or as Megatron's ``AsyncRequest``; every rank SIGKILLed at
    step 12 resumes from ``find_latest()``/``load()`` at iteration 10, every later loss equal, bit for bit."""
    require_release("nvidia_resiliency_ext", "nvidia-resiliency-ext", "0.4.1", "this test and docs/megatron.md")
    log = check_kill_and_resume(WORKER, tmp_path, ranks, options=options,
                                damage=lambda out: _local_checkpoints(out, ranks))
    assert "resuming from iteration 10" in log, log[-3000:]


@pytest.mark.parametrize("options", [("--mcore-local",), ("--mcore-local", "--async")])
def test_a_local_save_that_fails_on_one_rank_raises_on_every_rank(tmp_path: Path, options: tuple[str, ...]) -> None:
    """Rank 1's save of iteration 10 fails before it starts (a value alpsck cannot hold): both ranks raise, rank 1
    its own error and rank 0 that another rank failed, by themselves (each rank its own process, no launcher to end
    the other): synchronous at the save, asynchronous in the finalize Megatron runs on every rank, not in a
    collective whose peer is gone. No iteration 10 is there for every rank to resume from."""
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    procs = [WarmProcess(WORKER, [str(out), str(tmp_path / "losses"), *options, "--fail-local-save-at", "10"],
                         rank_env(rank, 2, port), tmp_path / f"rank-{rank}.out") for rank in range(2)]
    first, last = outputs_of(procs, 120, fail=True)
    assert "common/unsaveable: cannot checkpoint a value of type builtins.object" in last, last[-3000:]
    assert "a local checkpoint through alpsck failed on another rank" in first, first[-3000:]
    mine = [{i["step"] for i in _core.scan(str(out / "local" / f"rank-{r:05d}")) if i["status"] == "committed"}
            for r in range(2)]
    assert mine[1] == {5} and set.intersection(*mine) == {5}, mine


@pytest.mark.parametrize("options", [("--mcore-local", "--memory"), ("--mcore-local", "--memory", "--async")])
def test_megatron_local_checkpoints_in_the_memory_tier_resume_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         options: tuple[str, ...]) -> None:
    """``AlpsckLocalCheckpointManager(memory=True)`` on one node of 2 ranks: every save in node memory (a temporary
    directory stands in for /dev/shm), nothing in the run directory; every rank SIGKILLed at step 12 resumes from
    iteration 10 read from memory, every loss bit-exact, synchronous and with ``--async-save``'s queue."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv(memory_tier.ROOT_ENV, str(shm))  # the ranks inherit it
    log = check_kill_and_resume(WORKER, tmp_path, 2, options=options)
    assert log.count("resuming from iteration 10: ") == 2 and log.count("iteration 10 (memory)") == 2, log[-3000:]
    assert not list((tmp_path / "out" / "local").rglob("*.bin"))  # the run directory holds the run's identity only
    nodes = sorted(shm.glob(f"alpsck-{os.getuid()}/*/ranks-00000-00001"))  # the whole run's, and the resumed one's
    held = [[(i["step"], i["status"]) for i in _core.scan(str(d))] for d in nodes]
    assert held == [[(20, "committed")]] * 2, held  # the memory tier keeps one checkpoint


def test_a_damaged_memory_copy_with_no_other_makes_megatron_start_from_its_persistent_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One node, rank 1's memory copy of iteration 10 damaged (one byte) and no replica: ``find_latest()`` is -1
    on every rank, with a warning naming the copy, so Megatron-LM would load its persistent checkpoint (this
    worker has none: it starts again from step 1, and every loss still equals the uninterrupted run's). Tried once,
    never a crash or a restart loop."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv(memory_tier.ROOT_ENV, str(shm))

    def damage(_out: Path) -> None:
        [shard] = [f for f in shm.glob(f"alpsck-{os.getuid()}/*/ranks-00000-00001/step-000000010/rank-00001.bin")]
        flip_byte(shard, shard.stat().st_size // 2)

    log = check_kill_and_resume(WORKER, tmp_path, 2, options=("--mcore-local", "--memory"), damage=damage,
                                resumed_from=1)
    assert log.count("the memory checkpoint of step 10 is not usable for every node's ranks") == 2, log[-3000:]


def test_a_node_lost_with_its_memory_resumes_its_ranks_from_the_replica_another_node_holds(tmp_path: Path) -> None:
    """Two nodes of one rank (each its own name and its own /dev/shm: one machine stands in for both), local
    checkpoints in the memory tier. Every rank SIGKILLed at step 12, and node b lost with its memory: its rank starts
    again on a spare, whose memory is empty. It reads iteration 10 from the replica node a holds, node a's rank from
    its own memory, and every loss from step 11 on equals an uninterrupted run's, bit for bit."""
    run_worker(WORKER, tmp_path / "full", tmp_path / "full.losses", "--mcore-local", ranks=2)
    want = dict(losses_of(tmp_path / "full.losses"))
    out, losses = tmp_path / "out", tmp_path / "losses"

    def on_nodes(names: list[str], *extra: str, fail: bool = False) -> list[str]:
        port = free_port()
        for name in names:
            (tmp_path / name).mkdir(exist_ok=True)
        procs = [WarmProcess(WORKER, [str(out), str(losses), "--mcore-local", "--memory", *extra],
                             rank_env(r, 2, port, **{memory_tier.ROOT_ENV: str(tmp_path / names[r]),
                                                     memory_tier.NODE_ENV: names[r]}),
                             tmp_path / f"{names[r]}-{len(extra)}.out") for r in range(2)]
        return outputs_of(procs, 180, fail=fail)

    on_nodes(["node-a", "node-b"], "--kill-at", "12", fail=True)
    replica = list((tmp_path / "node-a").glob(f"alpsck-{os.getuid()}/*/ranks-00001-00001/step-000000010"))
    assert replica, "node a holds no replica of node b's iteration 10"
    shutil.rmtree(tmp_path / "node-b")  # node b is gone, its memory with it
    before = len(losses_of(losses))
    outs = on_nodes(["node-a", "spare"])
    assert [o.count("resuming from iteration 10: ") for o in outs] == [1, 1], outs[1][-3000:]
    assert all("iteration 10 (replica)" in o for o in outs), outs[1][-3000:]  # the restore as a whole: a replica read
    resumed = losses_of(losses)[before:]
    assert [s for s, _ in resumed] == list(range(11, 21)) and dict(resumed) == {s: want[s] for s in range(11, 21)}


def test_a_damaged_local_checkpoint_on_one_rank_makes_every_rank_resume_from_the_one_before(tmp_path: Path) -> None:
    """One byte of rank 1's iteration 10 flipped: its read fails its CRC, every rank warns and loads iteration 5,
    and the run goes on from step 6 bit for bit (never a wrong value, never a rank on another iteration)."""
    require_release("nvidia_resiliency_ext", "nvidia-resiliency-ext", "0.4.1", "this test and docs/megatron.md")
    log = check_kill_and_resume(WORKER, tmp_path, 2, options=("--mcore-local",), resumed_from=6,
                                damage=lambda out: _local_checkpoints(out, 2, damage_rank=1))
    assert "iteration 10 cannot be loaded" in log and "resuming from iteration 5" in log, log[-3000:]
