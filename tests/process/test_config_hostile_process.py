"""Hostile job configs where only a real process shows the result: the generated batch script run by bash with a
stand-in srun, the dry-run command line; the rest is tests/unit/test_config_hostile.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from support.hostile_configs import GOOD, OPEN_BLOCKS, with_setup

from alpsck.errors import ConfigError
from alpsck.slurm.config import parse_config
from alpsck.slurm.submit import local_python, sbatch_script, setup_lines


@pytest.fixture()
def good(tmp_path: Path) -> str:
    return GOOD.format(run_dir=tmp_path / "run")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def fake_slurm_bin(tmp_path: Path) -> tuple[Path, Path]:
    """A bin dir whose ``srun`` records that it ran, with $A from the setup lines."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "srun-ran"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nprintf "srun A=%s\\n" "$A" > {shlex.quote(str(marker))}\n')
    (bin_dir / "srun").chmod(0o755)
    return bin_dir, marker


def run_batch_script(script: str, tmp_path: Path) -> Path:
    bin_dir, marker = fake_slurm_bin(tmp_path)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    r = subprocess.run(["bash", str(path)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return marker


def test_the_generated_batch_script_runs_its_setup_and_then_srun(good: str, tmp_path: Path) -> None:
    """Not only parsed: run under bash (with a stand-in srun), the script runs every setup line, a
    here-document over several items included, and then the srun line with what they exported."""
    lines = ["export A=from-setup", f"cat > {shlex.quote(str(tmp_path / 'heredoc'))} <<EOF", "in 'the' doc",
             "EOF", "if true; then", "  export A=$A-and-if", "fi"]
    marker = run_batch_script(sbatch_script(parse_config(with_setup(good, lines))), tmp_path)
    assert marker.read_text() == "srun A=from-setup-and-if\n"
    assert (tmp_path / "heredoc").read_text() == "in 'the' doc\n"


@pytest.mark.parametrize("lines", OPEN_BLOCKS, ids=lambda b: " / ".join(b))
def test_no_setup_line_can_reach_past_its_block_even_unchecked(good: str, tmp_path: Path, lines: list[str]) -> None:
    """The config refuses these; were one to get past it (a config object built in Python), the
    batch script still runs the lines after the block: the setup runs as one eval of its text."""
    cfg = parse_config(good)
    cfg.environment.setup = ["export A=before", *lines]
    marker = run_batch_script("\n".join([*setup_lines(cfg), "srun"]), tmp_path)
    assert marker.read_text() == "srun A=before\n"
    # ... and under the local executor, whose bash runs the same lines before exec-ing the job
    argv = [*shlex.split(local_python(cfg)), "-c", "import os; print('job ran', os.environ['A'])"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert "job ran before" in r.stdout, (r.stdout, r.stderr)


def test_dry_run_refuses_an_open_setup_block_and_prints_no_script(good: str, tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(with_setup(good, ["export A=1", "cat <<EOF"]))
    r = cli("submit", str(cfg), "--dry-run", cwd=tmp_path)
    assert r.returncode != 0 and r.stdout == ""
    assert re.search(r"job\.yaml:\d+: environment\.setup: .*here-document", r.stderr), r.stderr


@pytest.mark.parametrize("kind", ["file", "under-a-file", "dangling-link", "link-to-file"])
def test_a_run_dir_that_cannot_be_a_directory_is_refused(tmp_path: Path, kind: str) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    run_dir = {"file": f, "under-a-file": f / "run", "dangling-link": tmp_path / "dangling",
               "link-to-file": tmp_path / "link"}[kind]
    if kind == "dangling-link":
        run_dir.symlink_to(tmp_path / "nowhere")
    elif kind == "link-to-file":
        run_dir.symlink_to(f)
    good = GOOD.format(run_dir=run_dir)
    with pytest.raises(ConfigError, match=r"<config>:2: run_dir: .*(regular file|symbolic link to nothing)"):
        parse_config(good)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(good)
    r = cli("submit", str(cfg), "--dry-run", cwd=tmp_path)
    assert r.returncode != 0 and "run_dir" in r.stderr and r.stdout == "", r.stderr
