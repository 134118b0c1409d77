"""Running the reference training (alpsck.examples.llama) as a child process: its environment and waiting for its end."""

from __future__ import annotations

import os
import subprocess


def training_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def finish(proc: subprocess.Popen[str], expected_rc: int = 0) -> None:
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == expected_rc, out
