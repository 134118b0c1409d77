"""Lightning 2.6 through alpsck (issue 56, item 2; docs/lightning.md): a training on 2 CPU ranks (gloo), DDP whose
``CheckpointIO`` is :class:`alpsck.integrations.lightning.AlpsckCheckpointIO`, or FSDP2 under
:class:`alpsck.integrations.lightning_sharded.AlpsckModelParallelStrategy` (sharded checkpoints), SIGKILLed mid-epoch
(the whole process group) and resumed with ``fit(ckpt_path="last")``: the losses of every step equal an
uninterrupted run's, bit for bit. CI installs Lightning (.ci/run); without it the test skips here, and fails under
CI."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import SUPPORT
from support.releases import require_release

from alpsck.store.marker import is_marked

WORKER = SUPPORT / "lightning_worker.py"
LIGHTNING = "2.6.0"


@pytest.fixture(autouse=True)
def _needs_lightning() -> None:
    require_release("lightning", "lightning", LIGHTNING, "this test and docs/lightning.md")


def _start(run: Path, losses: Path, epochs: int, *extra: str) -> subprocess.Popen[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT.parent), os.environ.get("PYTHONPATH", "")])}
    for k in [k for k in env if k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK"))]:
        del env[k]  # Lightning would take the test's own job for its cluster
    return subprocess.Popen([sys.executable, str(WORKER), str(run), str(losses), str(epochs), *extra], env=env,
                            cwd=run.parent, start_new_session=True, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _finish(p: subprocess.Popen[str], timeout: float = 300) -> None:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]


def _losses(path: Path) -> dict[int, str]:
    """step -> loss; a step run twice (before a kill, and again after the resume) keeps its last."""
    out: dict[int, str] = {}
    for line in path.read_text().splitlines():
        step, loss = line.split()
        out[int(step)] = loss
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_training_killed_mid_epoch_resumes_from_alpscks_last_checkpoint_bit_exact(tmp_path: Path,
                                                                                    strategy: str) -> None:
    """DDP through AlpsckCheckpointIO; FSDP (sharded checkpoints) through AlpsckFSDPStrategy."""
    epochs, per_epoch = 4, 6  # 96 samples, 2 ranks, batches of 8
    extra = ("--fsdp",) if strategy == "fsdp" else ()
    clean = tmp_path / "clean"
    clean.mkdir()
    _finish(_start(clean / "ckpts", clean / "losses", epochs, *extra))
    want = _losses(clean / "losses")
    assert sorted(want) == list(range(1, epochs * per_epoch + 1))

    work = tmp_path / "work"
    work.mkdir()
    run = work / "ckpts"
    p = _start(run, work / "losses", epochs, "--stop-at", str(2 * per_epoch + 3), *extra)  # 3 steps into epoch 3
    deadline = time.monotonic() + 300
    while not (run / "stopped").exists():
        assert p.poll() is None, p.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "the training never reached its stop"
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    assert sorted(n.name for n in run.iterdir() if n.name.endswith(".ckpt")) == [
        "epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt", "last.ckpt"]
    assert all((run / n).is_dir() for n in ("last.ckpt", "epoch=1-step=12.ckpt"))  # alpsck run directories
    if strategy == "fsdp":  # alpsck's DCP checkpoints, not Lightning's sharded format (its pickled meta.pt)
        assert is_marked(run / "last.ckpt") and not list(run.rglob("meta.pt")) and not list(run.rglob("*.distcp"))
    (run / "stopped").unlink()
    _finish(_start(run, work / "resumed", epochs, "--resume", *extra))
    resumed = _losses(work / "resumed")
    assert min(resumed) == 2 * per_epoch + 1, sorted(resumed)  # from the end of the second epoch, not from scratch
    got = _losses(work / "losses") | resumed
    assert got == want, [s for s in want if got.get(s) != want[s]]
    assert sorted(n.name for n in run.iterdir() if n.name.endswith(".ckpt"))[-1] == "last.ckpt"
    assert (run / f"epoch={epochs - 1}-step={epochs * per_epoch}.ckpt").is_dir()
