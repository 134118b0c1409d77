"""Rollback (test_rollback.py's rule) across two DDP ranks (gloo on CPU): they roll back together."""

from __future__ import annotations

import math
from pathlib import Path

from support.losses import read_losses

from alpsck.restore import read_rollbacks


def test_two_ddp_ranks_roll_back_together(tmp_path: Path) -> None:
    """torchrun, two gloo ranks, NaN at step 7 (checkpoints every 5): both ranks go back to step 5 in the
    same step (the restore is a collective; a rank left behind would hang), and the run finishes."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "alpsck.examples.llama", "--training-steps", "10",
            "--checkpoint-freq", "5", "--dim", "32", "--multiple-of", "32", "--sequence-length", "16",
            "--batch-size", "4", "--warmup-steps", "2", "--device", "cpu", "--torch-threads", "1", "--log-every", "0",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--loss-file", str(tmp_path / "loss.csv"), "--nan-at-step", "7"]
    proc = subprocess.run(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(r.from_step, r.to_step, r.skip) for r in read_rollbacks(tmp_path / "ckpt")] == [(7, 5, 2)]
    losses = read_losses(tmp_path / "loss.csv")
    assert sorted(losses) == list(range(1, 11)) and all(math.isfinite(float(v)) for v in losses.values())
