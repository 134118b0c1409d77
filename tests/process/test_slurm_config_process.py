"""The job config and the generated job command run for real (child processes: the dry-run CLI, the job python);
the rest of the config is tests/unit/test_slurm_config.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from alpsck.errors import ConfigError
from alpsck.slurm.config import parse_config

GOOD = """\
name: t
run_dir: /tmp/x
slurm:
  time: "00:02:00"
entry:
  function: alpsck.examples.llama.train:slurm_entry
"""

ROOT = Path(__file__).resolve().parents[2]


def test_the_job_python_never_imports_a_package_from_the_working_directory(tmp_path: Path) -> None:
    """The README's quickstart runs from a checkout: its alpsck/ (no compiled core) shadowed the
    installed package in the job, as a json/ here shadows the standard library's for ``-m``."""
    from alpsck.slurm.launch import job_python

    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("raise ImportError('imported from the working directory')\n")
    (tmp_path / "doc.json").write_text('{"a": [1, 2]}')
    plain = subprocess.run(f"{shlex.quote(sys.executable)} -u -m json.tool doc.json", shell=True, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode != 0 and "imported from the working directory" in plain.stderr  # the trap is real
    ours = subprocess.run(f"{job_python(shlex.quote(sys.executable))} -u -m json.tool doc.json", shell=True,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and json.loads(ours.stdout) == {"a": [1, 2]}, ours.stderr


def test_a_config_that_is_not_utf8_is_one_error(tmp_path: Path) -> None:
    import subprocess

    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(GOOD.replace("name: t", "name: t\xe9").encode("latin-1"))
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--dry-run"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == f"alpsck: error: {cfg}: not UTF-8 text (byte 7: invalid continuation byte)\n"


@pytest.mark.parametrize("example", ["alps-gh200", "alps-gh200-uenv"])
def test_the_alps_examples_dry_run_anywhere(tmp_path: Path, example: str) -> None:
    """The README offers --dry-run as the way to read the batch script; off Alps $USER may be unset,
    and the dry run refused the config. Now it prints the script with a stand-in that says so
    (and names it on stderr), and where the checkpoints go (Capstor scratch, as CSCS advises);
    a real submit still refuses an unset variable."""
    env = {k: v for k, v in os.environ.items() if k != "USER"}
    config = str(ROOT / "slurm" / "examples" / f"{example}.yaml")
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", config, "--dry-run"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash") and "\nsrun " in r.stdout
    assert "mkdir -p /capstor/scratch/cscs/USER-is-not-set-here/alpsck/" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == "alpsck: dry run: $USER is not set here; the script shows it as /USER-is-not-set-here"
    assert any(ln.startswith("alpsck: dry run: checkpoints go to /capstor/scratch/cscs/") and "Capstor" in ln
               and "30 days" in ln for ln in lines), lines
    assert "alpsck: dry run: not checked whether entry.function imports: its container or uenv exists only in the job" \
        in lines
    assert "ALPSCK_TEST_UNSET_VAR" not in os.environ
    with pytest.raises(ConfigError, match=r"run_dir: environment variable \$ALPSCK_TEST_UNSET_VAR is not set"):
        parse_config(GOOD.replace("run_dir: /tmp/x", "run_dir: $ALPSCK_TEST_UNSET_VAR/x"))


def test_dry_run_cli(tmp_path: Path) -> None:
    import subprocess

    cfg = tmp_path / "c.yaml"
    cfg.write_text(GOOD)
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--dry-run"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "#SBATCH --job-name=t" in r.stdout
    cfg.write_text(GOOD.replace("  time:", "  tme:"))
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "slurm.tme: unknown key (did you mean 'time'?)" in r.stderr


def test_dry_run_needs_no_slurm_here(tmp_path: Path) -> None:
    """submitit's SlurmExecutor refuses to start without srun on the PATH: the dry run only writes
    the script, so it must print it anyway (it was a traceback)."""
    import subprocess

    cfg = tmp_path / "c.yaml"
    cfg.write_text(GOOD)
    (tmp_path / "bin").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "bin")}
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--dry-run"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0 and "#SBATCH --job-name=t" in r.stdout and "\nsrun --unbuffered " in r.stdout, r.stderr


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in text.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(caught >> (sig - 1) & 1)


def test_the_job_python_survives_a_stop_signal_before_the_runner_and_hands_it_over(tmp_path: Path) -> None:
    """USR2 (the time-limit signal) during the seconds submitit spends importing torch used to kill
    the job (FAILED, no requeue): the launcher records it for the runner instead."""
    import signal
    import time

    from alpsck.slurm.launch import job_python

    (tmp_path / "slow_start.py").write_text(
        "import sys, time\ntime.sleep(3)\nprint([n for n, _ in getattr(sys, '_alpsck_early_signals', [])])\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for cmd, survives in ((f"{shlex.quote(sys.executable)} -u -m slow_start", False),
                          (f"{job_python(shlex.quote(sys.executable))} -u -m slow_start", True)):
        p = subprocess.Popen(["bash", "-c", f"exec {cmd}"], stdout=subprocess.PIPE, text=True, env=env)
        time.sleep(1.0)
        if survives:  # after the launcher's handler is in (a loaded machine can take over 1 s to get there)
            deadline = time.monotonic() + 30
            while not _catches(p.pid, signal.SIGUSR2) and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.05)
        p.send_signal(signal.SIGUSR2)
        out, _ = p.communicate(timeout=60)
        if survives:
            assert p.returncode == 0 and out.strip() == f"[{int(signal.SIGUSR2)}]", (p.returncode, out)
        else:
            assert p.returncode == -signal.SIGUSR2  # the trap is real: a bare python dies
