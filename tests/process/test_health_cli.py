"""The health of checkpoints as the command line shows and prunes it (child processes); the rule itself is
tests/unit/test_health.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from support.health_runs import saved_run_with_losses

from alpsck.slurm import history
from alpsck.store.scan import scan_run_dir


def test_inspect_checkpoints_and_status_show_the_metrics(tmp_path: Path) -> None:
    run = saved_run_with_losses(tmp_path, {1: 0.75, 2: math.nan})
    table = subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run)], capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in table.stdout.splitlines()[1:3]}
    assert rows["1"].startswith("*") and rows["1"].endswith("loss=0.75 lr=0.5")
    assert rows["2"].endswith("unhealthy: loss=nan lr=0.5")
    doc = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run), "--json"],
                                    capture_output=True, text=True, timeout=120).stdout)
    assert [c["metrics"] for c in doc["checkpoints"]] == [{"loss": 0.75, "lr": 0.5}, {"loss": "nan", "lr": 0.5}]
    assert doc["latest_valid"] == 1 and doc["skipped"][0]["reason"] == "unhealthy"
    one = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run), "--step", "2",
                                     "--json"], capture_output=True, text=True, timeout=120).stdout)
    assert one["metrics"] == {"loss": "nan", "lr": 0.5}  # a named step is described whatever its health
    history.append(run, "started", job_id="5", restart=0, step=None)
    status = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run)], capture_output=True, text=True,
                            timeout=120)
    assert "metrics of the checkpoint a resume uses: loss=0.75 lr=0.5" in status.stdout, status.stdout
    assert "skipped as unhealthy: step 2: loss=nan; allow_unhealthy=True restores it" in status.stdout
    doc = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"],
                                    capture_output=True, text=True, timeout=120).stdout)
    assert doc["metrics"] == {"loss": 0.75, "lr": 0.5} and doc["unhealthy"][0]["step"] == 2


def test_prune_keeps_healthy_ones_and_keeps_newer_unhealthy_ones_for_inspection(tmp_path: Path) -> None:
    """keep_last counts the newest K whatever their health (40 stays for inspection); the newest healthy one
    (30) is kept beside them by its own rule; the dry run names the rule behind every decision."""
    run = saved_run_with_losses(tmp_path, {10: 1.0, 20: math.nan, 30: 0.5, 40: math.inf})
    dry = subprocess.run([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "1", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert f"keep {run / 'step-000000040'}: keep_last 1" in lines
    assert f"keep {run / 'step-000000030'}: newest healthy" in lines
    gone = next(x for x in lines if str(run / "step-000000020") in x)
    assert gone.startswith("would remove") and "no rule keeps it" in gone and "unhealthy: loss=nan" in gone
    r = subprocess.run([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "1"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"] == [30, 40]
