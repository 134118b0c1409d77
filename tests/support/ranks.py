"""Start a worker script on several ranks (gloo on CPU, one process each) and collect what they print."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from support import SUPPORT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(mode: str, run_dir: Path, world: int, script: Path = SUPPORT / "dcp_worker.py") -> list[str]:
    """Run ``script mode run_dir`` (the worker) on ``world`` ranks; every rank must exit 0. Returns their outputs."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(run_dir)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outs.append(out)
    finally:
        for p in procs:  # a rank that failed leaves the others waiting in a collective
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out}"
    return outs
