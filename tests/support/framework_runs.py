"""Running a framework's training worker (support/hf_trainer_worker.py, support/accelerate_worker.py) in a child
process, alone or under ``torchrun``, and reading the losses it recorded (``step float.hex`` per line)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from support import SUPPORT

KILLED_UNDER_TORCHRUN = "Signal 9 (SIGKILL) received"  # torchrun's report of a worker that SIGKILLed itself


def run_worker(worker: Path, out: Path, losses: Path, *extra: str, ranks: int = 1, rc: int | None = 0) -> str:
    """``worker OUT LOSSES *extra``, alone (``ranks=1``) or under ``torchrun --standalone`` with ``ranks``
    processes; its output. ``rc``: the exit code it must end with (None: any failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(SUPPORT.parent), os.environ.get("PYTHONPATH", "")])}
    for k in [k for k in env if k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "ACCELERATE"))]:
        del env[k]  # the test's own job or launcher must not become the worker's
    launch = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    p = subprocess.run([sys.executable, *launch, str(worker), str(out), str(losses), *extra], env=env,
                       cwd=out.parent, capture_output=True, text=True, timeout=300, start_new_session=True)
    ok = p.returncode == rc if rc is not None else p.returncode != 0
    assert ok, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p.stdout + p.stderr


def losses_of(path: Path) -> list[tuple[int, str]]:
    """(step, loss) in the order the worker recorded them: a step run again after a resume appears twice."""
    return [(int(s), v) for s, v in (line.split() for line in path.read_text().splitlines())]


def check_kill_and_resume(worker: Path, root: Path, ranks: int, *, resume: tuple[str, ...] = (),
                          damage: Callable[[Path], None] | None = None, resumed_from: int = 11,
                          options: tuple[str, ...] = (), kill_at: int = 12) -> str:
    """A worker's 20 steps run whole, then again SIGKILLed at step ``kill_at`` (every rank; checkpoints every 5
    steps, the one of step 10 durable) and started again with ``resume``: the resumed run starts at
    ``resumed_from`` and every step's loss equals the whole run's, bit for bit. ``options`` go to every run;
    ``damage(out)`` runs between the kill and the resume. The resumed run's output."""
    run_worker(worker, root / "full", root / "full.losses", *options, ranks=ranks)
    want = dict(losses_of(root / "full.losses"))
    assert sorted(want) == list(range(1, 21))
    out, losses = root / "out", root / "losses"
    log = run_worker(worker, out, losses, *options, "--kill-at", str(kill_at), ranks=ranks,
                     rc=-9 if ranks == 1 else None)
    assert ranks == 1 or KILLED_UNDER_TORCHRUN in log, log[-3000:]
    if damage is not None:
        damage(out)
    before = len(losses_of(losses))
    log = run_worker(worker, out, losses, *options, *resume, ranks=ranks)
    resumed = losses_of(losses)[before:]
    assert [s for s, _ in resumed] == list(range(resumed_from, 21)), resumed
    assert dict(resumed) == {s: want[s] for s in range(resumed_from, 21)}
    return log
