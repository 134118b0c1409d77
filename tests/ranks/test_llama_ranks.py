"""The reference training (alpsck.examples.llama) on two DDP ranks under torchrun (gloo on CPU): a crash and the
resume; the in-process cases are tests/unit/test_llama.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.llama_runs import finish, training_env
from support.ranks import free_port

from alpsck.examples.llama.train import (
    FAIL_EXIT_CODE,
)


def _launch_ddp(tmp_path: Path, name: str, port: int, *extra: str) -> subprocess.Popen[str]:
    """Two gloo ranks of the reference training under torchrun (torch.distributed.run)."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "alpsck.examples.llama", "--training-steps", "12", "--checkpoint-freq", "5",
            "--dim", "32", "--multiple-of", "32", "--sequence-length", "16", "--batch-size", "4",
            "--warmup-steps", "2", "--device", "cpu", "--torch-threads", "1", "--log-every", "0",
            "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"), "--loss-file", str(tmp_path / f"{name}.csv"), *extra]
    return subprocess.Popen(args, env=training_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_ddp_gloo_crash_and_resume(tmp_path: Path) -> None:
    """torchrun, two gloo ranks, crash at step 8, resume: rank 0's loss file equals the clean run's."""
    clean = _launch_ddp(tmp_path, "a", free_port())
    crash = _launch_ddp(tmp_path, "c", free_port(), "--fail-at-step", "8")
    finish(clean)
    out, _ = crash.communicate(timeout=120)
    assert crash.returncode != 0 and f"exitcode  : {FAIL_EXIT_CODE}" in out, out  # torchrun reports the crash
    finish(_launch_ddp(tmp_path, "c", free_port(), "--load-checkpoint"))
    ref = (tmp_path / "a.csv").read_bytes()
    assert len(ref.splitlines()) == 13 and (tmp_path / "c.csv").read_bytes() == ref
    # Every checkpoint is sharded: one file per rank, the model and optimizer written once.
    from alpsck import _core

    infos = [i for i in _core.scan(str(tmp_path / "ckpt-c"), verify=True) if i["status"] == "committed"]
    assert infos and all(i["shards"] == ["rank-00000.bin", "rank-00001.bin"] for i in infos)
    extents = [{n for n, _, _ in _core.ShardReader(f"{infos[-1]['path']}/rank-{r:05d}.bin").extents} for r in (0, 1)]
    assert not {n for n in extents[0] & extents[1] if n.startswith(("model/", "optim/"))}
