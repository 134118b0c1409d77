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
from pathlib import Path

import pytest
from support import SUPPORT
from support.corrupt import flip_byte
from support.framework_runs import check_kill_and_resume
from support.ranks import outputs_of, rank_env
from support.releases import require_release
from support.warm import WarmProcess

from alpsck import _core
from alpsck.job_env import free_port

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


def test_a_damaged_local_checkpoint_on_one_rank_makes_every_rank_resume_from_the_one_before(tmp_path: Path) -> None:
    """One byte of rank 1's iteration 10 flipped: its read fails its CRC, every rank warns and loads iteration 5,
    and the run goes on from step 6 bit for bit (never a wrong value, never a rank on another iteration)."""
    require_release("nvidia_resiliency_ext", "nvidia-resiliency-ext", "0.4.1", "this test and docs/megatron.md")
    log = check_kill_and_resume(WORKER, tmp_path, 2, options=("--mcore-local",), resumed_from=6,
                                damage=lambda out: _local_checkpoints(out, 2, damage_rank=1))
    assert "iteration 10 cannot be loaded" in log and "resuming from iteration 5" in log, log[-3000:]
