"""A torchtitan-shaped trainer (tests/support/titan_trainer.py: FSDP2 on 2 gloo ranks, its checkpoint
manager's naming, discovery and purge) checkpoints through alpsck, is SIGKILLed right after a save
starts, and resumes from alpsck's checkpoint (not from scratch): the losses of every step and the
final parameters equal an uninterrupted run's, bit for bit. Sync, thread-async and process-async saves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import SUPPORT
from support.ranks import free_port

TRAINER = SUPPORT / "titan_trainer.py"
STEPS, INTERVAL = 12, 4


def _train(folder: Path, mode: str, kill_at: int | None = None) -> list[int]:
    """Run the trainer on 2 ranks until they exit; returns their exit codes (-9: killed as asked)."""
    port = free_port()
    procs = []
    args = [sys.executable, str(TRAINER), str(folder), str(STEPS), str(INTERVAL), mode]
    if kill_at is not None:
        args.append(str(kill_at))
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:  # a rank that failed leaves the other in a collective; a process save's daemon lingers
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    codes = [p.returncode for p in procs]
    expected = [-signal.SIGKILL] * 2 if kill_at is not None else [0, 0]
    assert codes == expected, "\n".join(f"rank {r} exit {c}:\n{o}" for r, (c, o) in enumerate(zip(codes, outs,
                                                                                                   strict=True)))
    return codes


def _losses(folder: Path) -> tuple[dict[int, str], list[int]]:
    """Rank 0's loss per step (the last line for a step run twice) and the steps in order of running."""
    lines = (folder.parent / "losses-rank-0.txt").read_text().split("\n")
    ran = [(int(a), b) for a, b in (line.split() for line in lines if line)]
    return dict(ran), [s for s, _ in ran]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    folder = tmp_path_factory.mktemp("reference") / "checkpoint"
    _train(folder, "sync")
    losses, order = _losses(folder)
    assert order == list(range(1, STEPS + 1))
    return losses, torch.load(folder.parent / "final.pt", weights_only=True)


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_killed_after_a_save_starts_resumes_bit_exact(mode: str, tmp_path: Path,
                                                      reference: tuple[dict[int, str], dict[str, torch.Tensor]]) -> None:
    folder = tmp_path / "checkpoint"
    kill_at = 2 * INTERVAL
    _train(folder, mode, kill_at=kill_at)
    names = sorted(os.listdir(folder))
    assert set(names) <= {"step-1", f"step-{INTERVAL}", f"step-{kill_at}"} and f"step-{INTERVAL}" in names
    _train(folder, mode)
    losses, order = _losses(folder)
    resumed_after = order[kill_at]  # the first step of the second run
    assert resumed_after in (INTERVAL + 1, kill_at + 1), order  # from a checkpoint, never from scratch
    if mode == "sync":
        assert resumed_after == kill_at + 1  # its save of kill_at was durable before the kill
    ref_losses, ref_final = reference
    assert losses == ref_losses  # every step's loss, repr of the float: bit for bit
    final = torch.load(folder.parent / "final.pt", weights_only=True)
    assert final.keys() == ref_final.keys()
    for k, v in ref_final.items():
        assert torch.equal(final[k], v), k
    assert sorted(os.listdir(folder)) == sorted({f"step-{kill_at}", f"step-{STEPS}"})  # the purge kept 2
