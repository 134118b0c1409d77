"""Run directories for the inspection tools' tests (steps saved in-process, shards damaged on purpose), and the
real command line run in-process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck import cli


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the real ``alpsck`` command line in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse refused an argument (exit 2, its message on stderr)
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def save_steps(run_dir: Path, steps: list[int], n: int = 2000) -> None:
    with alpsck.Checkpointer(run_dir, keep_last=0, chunk_bytes=64 << 10) as ck:
        for s in steps:
            ck.save(s, {"w": torch.full((n,), float(s)), "b": torch.arange(n, dtype=torch.int32), "step": s}).wait()


def shard_of(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:09d}" / "rank-00000.bin"


def truncate_shard(run_dir: Path, step: int) -> None:
    shard = shard_of(run_dir, step)
    os.truncate(shard, shard.stat().st_size - 100)


def run_listing(run: Path) -> list[str]:
    return sorted(n for n in os.listdir(run) if n != ".lock")  # the writer lock stays (emptied) after close


def prunable_run(run: Path) -> None:
    """Committed 1, 2, 4, 5, 7; corrupt 3 (older than the newest valid) and 8 (newer); step-9.tmp; free-*; step-6 w/o manifest."""
    save_steps(run, [1, 2, 3, 4, 5, 7, 8])
    truncate_shard(run, 3)
    truncate_shard(run, 8)
    (run / "step-000000009.tmp").mkdir()
    (run / "step-000000009.tmp" / "rank-00000.bin").write_bytes(b"x" * 1000)
    (run / "step-000000006").mkdir()
    (run / "free-2-1234").mkdir()
    (run / "free-2-1234" / "rank-00000.bin").write_bytes(b"x" * 1000)
