"""Shared by the SLURM-layer tests: job configs for the reference training, and result checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from alpsck.slurm import history

# A small model: ~25 steps/s on one core here, so a run of N steps takes N/25 s.
MODEL_ARGS = ["--dim", "48", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--sequence-length", "32",
              "--batch-size", "4", "--torch-threads", "1", "--log-every", "0"]


def job_config(path: Path, run_dir: Path, *, steps: int, time: str = "2", delay: int = 60, every: int = 200,
               partition: str | None = "debug", max_restarts: int = 10, no_progress: int = 3,
               extra_args: list[str] | None = None, entry: str = "alpsck.examples.llama.train:slurm_entry",
               requeue_extra: str = "") -> Path:
    args = [*MODEL_ARGS, "--training-steps", str(steps), *(extra_args or [])]
    lines = [
        "name: alpsck-test",
        f"run_dir: {run_dir}",
        "slurm:",
        f"  time: '{time}'",
        "  cpus_per_task: 1",
        "  mem: 1G",
    ]
    if partition:
        lines.append(f"  partition: {partition}")
    lines += [
        "entry:",
        f"  function: {entry}",
        "  args: [" + ", ".join(f"'{a}'" for a in args) + "]",
        "checkpoint:",
        f"  every_steps: {every}",
        "requeue:",
        f"  signal_delay_s: {delay}",
        f"  max_restarts: {max_restarts}",
        f"  give_up_after_no_progress: {no_progress}",
    ]
    lines += [f"  {line}" for line in requeue_extra.splitlines() if line.strip()]
    path.write_text("\n".join(lines) + "\n")
    return path


def steps_for_seconds(seconds: float, tmp: Path) -> int:
    """How many steps of the test model take ``seconds`` here (measured, so tests do not depend on CPU speed)."""
    from alpsck.examples.llama.train import config_from_args, train

    cfg = config_from_args([*MODEL_ARGS, "--training-steps", "20", "--checkpoint-freq", "0", "--checkpointer", "torch",
                            "--checkpoint-dir", str(tmp / "calibrate")])
    train(cfg)  # warm-up (imports, allocator)
    cfg = config_from_args([*MODEL_ARGS, "--training-steps", "150", "--checkpoint-freq", "0", "--checkpointer", "torch",
                            "--checkpoint-dir", str(tmp / "calibrate2")])
    t = time.perf_counter()
    train(cfg)
    rate = 150 / (time.perf_counter() - t)
    return max(200, int(rate * seconds))


def clean_losses(tmp: Path, steps: int, extra_args: list[str] | None = None) -> str:
    """Loss trace of the same training run without interruption."""
    out = tmp / "clean-loss.csv"
    subprocess.run([sys.executable, "-m", "alpsck.examples.llama", *MODEL_ARGS, "--training-steps", str(steps),
                    *(extra_args or []), "--checkpoint-dir", str(tmp / "clean-ckpt"), "--checkpoint-freq", "0",
                    "--loss-file", str(out)], check=True, timeout=900, env=os.environ.copy())
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


def final_state(run_dir: Path) -> str:
    return history.state_of(history.read(run_dir))
