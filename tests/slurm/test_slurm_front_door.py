"""The front door on a real one-node SLURM (slurm/local-cluster/start.sh; tests/run.sh starts it):
a controller that answers late still gets the job (never a run on this host), a lost sbatch answer
makes one job, ``alpsck cancel`` ends a run for good, and ``status --follow`` follows it to its end.

SLURM's own commands are real; a stand-in ``sinfo`` or ``sbatch`` early on the PATH fails its first N
calls (as a busy controller does), then hands over to the real one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from support.slurm_helpers import events, flaky_command, job_config, steps_for_seconds, wait_for

from alpsck.slurm import commands


def _flaky(bin_dir: Path, name: str, fail_first: int, said: str, *, submit_first: bool = False) -> Path:
    """The real ``name`` behind a stand-in that fails its first ``fail_first`` calls with ``said`` (after
    running the real command when ``submit_first``: its answer is lost)."""
    real = shutil.which(name)
    assert real is not None, f"{name} is not installed"
    first = f'"{real}" "$@" > "{bin_dir}/{name}.lost"; ' if submit_first else ""
    return flaky_command(bin_dir, name, fail_first, said, then=f'exec "{real}" "$@"', before_failing=first)


def _alpsck(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _pending_config(tmp_path: Path) -> Path:
    """A job that stays pending (it may begin in an hour): what is tested is its submission."""
    cfg = job_config(tmp_path / "job.yaml", tmp_path / "run", steps=10)
    cfg.write_text(cfg.read_text().replace("slurm:\n", "slurm:\n  extra: {begin: now+1hour}\n", 1))
    return cfg


def _queue(job_id: str) -> str:
    r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    return r.stdout.strip()


def test_a_controller_that_answers_late_still_gets_the_job_and_cancel_ends_it(cluster: None, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    calls = _flaky(bin_dir, "sinfo", 2, "Socket timed out on send/recv operation")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    run = tmp_path / "run"
    r = _alpsck("submit", str(_pending_config(tmp_path)), "--json", "--no-check", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    job = json.loads(r.stdout.strip().splitlines()[-1])["job_id"]
    try:
        assert calls.read_text().strip() == "3" and "local executor" not in r.stdout + r.stderr
        (sub,) = events(run, "submitted")
        assert sub["backend"] == "slurm" and sub["job_id"] == job and _queue(job) == "PENDING"
        st = json.loads(_alpsck("status", str(run), "--json").stdout)
        assert st["backend"] == "slurm" and st["host"] is None and st["state"] == "pending"
        c = _alpsck("cancel", str(run), env=env)
        assert c.returncode == 0, c.stdout + c.stderr
        assert f"cancelled job {job} of {run}" in c.stdout and "job ended: cancelled (SLURM: CANCELLED" in c.stdout
        last = events(run)[-1]
        assert last["event"] == "cancelled" and last["recorded_by"] == "alpsck cancel" and last["job_id"] == job
        again = _alpsck("cancel", str(run))
        assert again.returncode == 0 and "no live job to cancel (state: cancelled)" in again.stdout
    finally:
        subprocess.run(["scancel", job], timeout=30)


def test_a_controller_that_never_answers_is_one_line_and_no_job(cluster: None, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    _flaky(bin_dir, "sinfo", 10**6, "Unable to contact slurm controller (connect failure)")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", commands.RETRY_ENV: "4"}
    started = time.monotonic()
    r = _alpsck("submit", str(_pending_config(tmp_path)), env=env)
    took = time.monotonic() - started
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("alpsck: error: `sinfo -h -o %P` failed (") and \
        "Unable to contact slurm controller" in lines[0] and "--local" in lines[0], lines
    assert took < 60 and not events(tmp_path / "run") and not (tmp_path / "run" / "submitit").exists()


def test_a_lost_sbatch_answer_makes_one_job_not_two(cluster: None, tmp_path: Path) -> None:
    """sbatch submits, then its answer is lost ("Socket timed out"): submit finds the job by its tag
    (the job's comment) instead of submitting it again."""
    bin_dir = tmp_path / "bin"
    calls = _flaky(bin_dir, "sbatch", 1, "Socket timed out on send/recv operation", submit_first=True)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = _alpsck("submit", str(_pending_config(tmp_path)), "--json", "--no-check", env=env)
    lost = (bin_dir / "sbatch.lost").read_text().split()[-1]
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1])["job_id"] == lost
        assert calls.read_text().strip() == "1"  # never run again
        comment = subprocess.run(["squeue", "-h", "-j", lost, "-o", "%k"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
        assert comment.startswith("alpsck:")
        mine = subprocess.run(["squeue", "-h", "-o", "%k"], capture_output=True, text=True, timeout=30).stdout.split()
        assert mine.count(comment) == 1
    finally:
        subprocess.run(["scancel", lost], timeout=30)


def test_cancel_a_running_job_takes_its_final_checkpoint_and_follow_sees_the_end(cluster: None, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = job_config(tmp_path / "job.yaml", run, steps=steps_for_seconds(600), time="15", every=20)
    r = _alpsck("submit", str(cfg), "--json", "--no-check")
    assert r.returncode == 0, r.stdout + r.stderr
    job = json.loads(r.stdout.strip().splitlines()[-1])["job_id"]
    try:
        wait_for(lambda: events(run, "started") and (run / "LATEST").exists(), 300, "the job to start and checkpoint")
        follow = subprocess.Popen([sys.executable, "-m", "alpsck", "status", str(run), "--follow"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines: list[str] = []
        following = threading.Event()  # it has taken the log's end: what comes next, it prints

        def read() -> None:
            assert follow.stdout is not None
            for ln in follow.stdout:
                lines.append(ln.rstrip("\n"))
                if ln.startswith("  following "):
                    following.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert following.wait(120), lines
        c = _alpsck("cancel", str(run), timeout=300)
        assert c.returncode == 0, c.stdout + c.stderr
        assert "job ended: cancelled (SLURM: CANCELLED" in c.stdout, c.stdout
        assert follow.wait(timeout=120) == 0, follow.stderr.read() if follow.stderr else ""
        reader.join(30)
        out = "\n".join(lines)
        at = next(i for i, ln in enumerate(lines) if ln.startswith("  following "))
        after = lines[at + 1:]
        assert any(" final_checkpoint " in ln and "reason=cancel" in ln for ln in after), out
        assert any(" cancelled " in ln for ln in after) and after[-1].startswith("run ended: cancelled; newest "
                                                                                 "checkpoint: step "), out
        assert not events(run, "requeued")
        final = events(run, "final_checkpoint")[-1]
        assert final["reason"] == "cancel" and f"step {final['step']}" in after[-1]
        time.sleep(15)  # a requeued job would be back in the queue by now
        assert _queue(job) == ""
        st = json.loads(_alpsck("status", str(run), "--json").stdout)
        assert st["state"] == "cancelled" and st["slurm"]["state"] == "CANCELLED"
    finally:
        subprocess.run(["scancel", job], timeout=30)


def test_cancel_of_a_local_run_ends_it_and_status_says_it_ran_here(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = job_config(tmp_path / "job.yaml", run, steps=steps_for_seconds(600), time="15", every=20, partition=None)
    out = tmp_path / "submit.out"
    with out.open("w") as f:  # not a pipe: the job, a child of submit, keeps its stdout open
        rc = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--local", "--no-wait", "--no-check"],
                            stdout=f, stderr=subprocess.STDOUT, timeout=180).returncode
    assert rc == 0, out.read_text()
    wait_for(lambda: events(run, "started"), 180, "the local job to start")
    st = json.loads(_alpsck("status", str(run), "--json").stdout)
    assert st["backend"] == "local" and st["host"] == os.uname().nodename and st["state"] == "running"
    text = _alpsck("status", str(run)).stdout
    assert f"ran through submitit's local executor on {os.uname().nodename}, not through SLURM" in text
    c = _alpsck("cancel", str(run), timeout=120)
    assert c.returncode == 0 and "job ended: cancelled" in c.stdout, c.stdout + c.stderr
    job = events(run, "submitted")[-1]["job_id"]
    assert not Path(f"/proc/{job}").exists() or b"submitit" not in Path(f"/proc/{job}/cmdline").read_bytes()
    assert events(run)[-1]["event"] == "cancelled"
