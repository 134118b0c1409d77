"""The requeue cycle without a cluster: submitit's local executor (the embedded default)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from slurm_helpers import clean_losses, events, final_state, job_config, steps_for_seconds


def _submit_local(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--local"], capture_output=True,
                          text=True, timeout=600)


def test_local_executor_timeout_requeue_cycle_is_bit_exact(tmp_path: Path) -> None:
    # 1-minute limit, signal 40 s before it: each start trains ~20 s, so ~60 s of steps need about 3
    # requeues: >= 2 even when the calibration is 1.3x off, and at most 5 (submitit's local executor
    # restarts a task at most 5 times) when it is 1.5x off the other way.
    # USR1, not the default USR2: submitit's local controller must be told which signal to send.
    steps = steps_for_seconds(60, tmp_path)
    cfg = job_config(tmp_path / "job.yaml", tmp_path / "run", steps=steps, time="1", delay=40, every=max(50, steps // 20),
                     requeue_extra="signal: USR1")
    r = _submit_local(cfg)
    assert r.returncode == 0, r.stdout + r.stderr
    assert final_state(tmp_path / "run") == "finished"
    requeues = events(tmp_path / "run", "requeued")
    assert len(requeues) >= 2, events(tmp_path / "run")
    assert all(e["reason"] == "timeout" and e["mechanism"] == "local" for e in requeues)
    finals = events(tmp_path / "run", "final_checkpoint")
    assert len(finals) == len(requeues) and all(isinstance(e["step"], int) for e in finals)
    starts = events(tmp_path / "run", "started")
    assert [s.get("step") for s in starts[1:]] == [f["step"] for f in finals]  # each start resumed the final one
    assert (tmp_path / "run" / "loss.csv").read_text() == clean_losses(tmp_path, steps)


def test_crash_at_every_start_gives_up_with_a_clear_message(tmp_path: Path) -> None:
    cfg = job_config(tmp_path / "job.yaml", tmp_path / "run", steps=100, time="1", delay=20,
                     extra_args=["--fail-at-step", "1000000"], entry="tests_crash_entry:crash", no_progress=2)
    (tmp_path / "tests_crash_entry.py").write_text("def crash(job):\n    raise RuntimeError('boom at start')\n")
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--local"], capture_output=True, text=True,
                       timeout=600, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:" +
                                                        __import__("os").environ.get("PYTHONPATH", "")})
    assert r.returncode == 1
    ev = events(tmp_path / "run")
    assert final_state(tmp_path / "run") == "gave_up"
    assert [e["event"] for e in ev].count("failed") == 2
    gave = events(tmp_path / "run", "gave_up")[0]
    assert "no progress" in gave["message"]
    status = subprocess.run([sys.executable, "-m", "alpsck", "status", str(tmp_path / "run"), "--json"],
                            capture_output=True, text=True, timeout=60)
    import json

    doc = json.loads(status.stdout)
    assert doc["state"] == "gave_up" and any(e["event"] == "failed" and "boom" in e["message"] for e in doc["events"])
