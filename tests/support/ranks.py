"""Start a worker script on several ranks (gloo on CPU, one process each, forked warm: :mod:`support.warm`) and
collect what they print."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from alpsck.job_env import free_port
from support import SUPPORT
from support.warm import ColdProcess, WarmProcess


def rank_env(rank: int, world: int, port: int | str, **extra: str) -> dict[str, str]:
    """A rank's environment: this process's, with torch.distributed's variables and one OMP thread."""
    return {**os.environ, **extra, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}


def kill_all(procs: Sequence[WarmProcess | ColdProcess]) -> None:
    """SIGKILL every rank still running, and wait for each."""
    for p in procs:
        p.kill()
    for p in procs:
        p.wait(60)


def run_ranks(mode: str, run_dir: Path, world: int, script: Path = SUPPORT / "dcp_worker.py") -> list[str]:
    """Run ``script mode run_dir`` (the worker) on ``world`` ranks; every rank must exit 0 within 180 s. Returns
    their outputs."""
    port = free_port()
    outputs = Path(tempfile.mkdtemp(prefix=f"ranks-{mode}-", dir=Path(run_dir).parent))
    procs = [WarmProcess(script, [mode, str(run_dir)], rank_env(rank, world, port), outputs / f"rank-{rank}.out")
             for rank in range(world)]
    return outputs_of(procs, 180)


def outputs_of(procs: Sequence[WarmProcess | ColdProcess], timeout: float, *, fail: bool = False) -> list[str]:
    """Every rank's output, once all exited 0 within ``timeout`` seconds (asserted, naming the rank); ``fail``:
    once all exited with another code, by themselves (a rank still running then is killed, and fails the test)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if not fail:
            raise
    finally:
        running = [r for r, p in enumerate(procs) if p.poll() is None]
        kill_all(procs)  # a rank that failed leaves the others waiting in a collective
    outs = [p.read_output() for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        if fail:
            assert r not in running and p.returncode not in (0, None), f"rank {r} (exit {p.returncode}):\n{out}"
        else:
            assert p.returncode == 0, f"rank {r}:\n{out}"
    return outs
