"""Shared by the SLURM-layer tests: job configs for the reference training, and result checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from alpsck.slurm import history, timeline

# A small model: ~40 ms of compute per step on one core here. The jobs pad every step to PACE
# seconds of wall time (--min-step-seconds), so N steps take N * PACE seconds whatever the load
# (no calibration to go wrong on a busy machine); the clean reference runs unpadded, with the same
# losses, in a fraction of that.
MODEL_ARGS = ["--dim", "48", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--sequence-length", "32",
              "--batch-size", "4", "--torch-threads", "1", "--log-every", "0"]
PACE = 0.25


def job_config(path: Path, run_dir: Path, *, steps: int, time: str = "2", delay: int = 60, every: int = 200,
               partition: str | None = "debug", max_restarts: int = 10, no_progress: int = 3,
               extra_args: list[str] | None = None, entry: str = "alpsck.examples.llama.train:slurm_entry",
               requeue_extra: str = "", tasks: int = 1, checkpoint_extra: str = "", slurm_extra: str = "",
               health: str = "") -> Path:
    args = [*MODEL_ARGS, "--min-step-seconds", str(PACE), "--training-steps", str(steps), *(extra_args or [])]
    lines = [
        "name: alpsck-test",
        f"run_dir: {run_dir}",
        "slurm:",
        f"  time: '{time}'",
        "  cpus_per_task: 1",
        f"  tasks_per_node: {tasks}",
        f"  mem: {tasks}G",
        *[f"  {line}" for line in slurm_extra.splitlines() if line.strip()],
    ]
    if partition:
        lines.append(f"  partition: {partition}")
    lines += [
        "entry:",
        f"  function: {entry}",
        "  args: [" + ", ".join(f"'{a}'" for a in args) + "]",
        "checkpoint:",
        f"  every_steps: {every}",
        *[f"  {line}" for line in checkpoint_extra.splitlines() if line.strip()],
        "requeue:",
        f"  signal_delay_s: {delay}",
        f"  max_restarts: {max_restarts}",
        f"  give_up_after_no_progress: {no_progress}",
    ]
    lines += [f"  {line}" for line in requeue_extra.splitlines() if line.strip()]
    if health:
        lines += ["health:", *[f"  {line}" for line in health.splitlines() if line.strip()]]
    path.write_text("\n".join(lines) + "\n")
    return path


def steps_for_seconds(seconds: float) -> int:
    """How many steps a job (paced by ``job_config``) trains in ``seconds``."""
    return round(seconds / PACE)


def clean_losses(tmp: Path, steps: int, extra_args: list[str] | None = None, world: int = 1) -> str:
    """Loss trace (rank 0's) of the same training run without interruption, on ``world`` gloo ranks."""
    import socket

    out = tmp / "clean-loss.csv"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    procs = []
    for rank in range(world):
        env = os.environ.copy()
        if world > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(world), RANK=str(rank),
                       LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-m", "alpsck.examples.llama", *MODEL_ARGS, "--training-steps",
                                       str(steps), *(extra_args or []), "--checkpoint-dir", str(tmp / "clean-ckpt"),
                                       "--checkpoint-freq", "0", "--loss-file", str(out)], env=env))
    for p in procs:
        assert p.wait(timeout=900) == 0, f"the clean reference run failed ({p.args})"
    return out.read_text()


def wait_for(pred: Any, timeout: float, what: str, poll: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def events(run_dir: Path, name: str | None = None) -> list[dict[str, Any]]:
    ev = history.read(run_dir)
    return [e for e in ev if name is None or e["event"] == name]


def training(run_dir: Path) -> bool:
    """The job is in its training loop: its loss file holds a step (start-up, torch's import included,
    is over; under a loaded machine that takes from 2 to 30 s after the job's ``started``)."""
    try:
        return len((run_dir / "loss.csv").read_text().splitlines()) >= 2
    except FileNotFoundError:
        return False


def final_state(run_dir: Path) -> str:
    return timeline.state_of(history.read(run_dir))


def flaky_command(bin_dir: Path, name: str, fail_first: int, said: str, *, then: str, before_failing: str = "") -> Path:
    """A stand-in ``name`` in ``bin_dir`` that fails its first ``fail_first`` calls saying ``said`` (after
    running ``before_failing``), then runs ``then``; it counts its calls in bin_dir/NAME.calls, which it
    returns. Shell builtins only, so it works on any PATH."""
    bin_dir.mkdir(exist_ok=True)
    calls = bin_dir / f"{name}.calls"
    (bin_dir / name).write_text(
        "#!/bin/sh\n"
        f'n=0; [ -f "{calls}" ] && read -r n < "{calls}"; n=$((n + 1)); echo $n > "{calls}"\n'
        f'if [ "$n" -le {fail_first} ]; then {before_failing}echo "{name}: error: {said}" >&2; exit 1; fi\n'
        f"{then}\n")
    (bin_dir / name).chmod(0o755)
    return calls


TERMINAL = ("finished", "failed", "cancelled", "gave_up")


def submit(cfg: Path, env: dict[str, str] | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--json"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stdout + r.stderr
    return str(json.loads(r.stdout.strip().splitlines()[-1])["job_id"])


def in_queue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() not in ("", "COMPLETED", "FAILED", "CANCELLED")


def wait_done(run_dir: Path, job_id: str, timeout: float) -> str:
    def done() -> str | None:
        st = final_state(run_dir)
        return st if st in TERMINAL and not in_queue(job_id) else None

    try:
        return str(wait_for(done, timeout, f"job {job_id} to end", poll=2))
    except AssertionError:
        subprocess.run(["scancel", job_id], timeout=30)
        log = "\n".join(p.read_text()[-3000:] for p in (run_dir / "submitit").glob("*_log.out"))
        raise AssertionError(f"job {job_id} did not end: {events(run_dir)}\n{log}") from None
