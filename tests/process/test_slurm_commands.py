"""alpsck.slurm.commands: one retry rule for SLURM's commands, and where ``submit`` may run a job.

Real processes (stand-in SLURM commands written as shell scripts on a private PATH), no mocks:
the retry loop, its budget, the split between reads and actions, and the backend decision.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.slurm_helpers import flaky_command

from alpsck.errors import SlurmError
from alpsck.slurm import commands


def _stand_in(bin_dir: Path, name: str, fail_first: int, said: str, then: str = "echo ok") -> Path:
    return flaky_command(bin_dir, name, fail_first, said, then=then)


def test_a_read_is_retried_until_it_answers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _stand_in(tmp_path / "bin", "sinfo", 2, "Socket timed out on send/recv operation")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    slept: list[float] = []
    answer = commands.run(["sinfo"], read=True, budget=30, sleep=slept.append)
    assert answer.stdout.strip() == "ok" and answer.tries == 3 and calls.read_text().strip() == "3"
    assert slept == [1.0, 2.0]  # backoff doubles


def test_a_read_that_never_answers_fails_in_one_line_after_its_budget(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    calls = _stand_in(tmp_path / "bin", "squeue", 10**6, "Unable to contact slurm controller (connect failure)")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(SlurmError) as e:
        commands.run(["squeue", "-h"], read=True, budget=2.5)
    text = str(e.value)
    assert "\n" not in text and text.startswith("`squeue -h` failed (") and "tries over" in text
    assert text.endswith("squeue: error: Unable to contact slurm controller (connect failure)")
    assert int(calls.read_text()) == 2  # 1 s, then 2 s more would pass the budget of 2.5 s


def test_an_action_is_retried_only_while_the_controller_is_not_reached(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    refused = _stand_in(bin_dir, "sbatch", 10**6, "Batch job submission failed: Invalid account or account/partition")
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(SlurmError, match="Invalid account"):
        commands.run(["sbatch", "x.sh"], read=False, budget=30, sleep=lambda s: None)
    assert refused.read_text().strip() == "1"  # a refusal is the controller's answer: no second try
    (bin_dir / "sbatch.calls").unlink()
    busy = _stand_in(bin_dir, "sbatch", 1, "Batch job submission failed: Resource temporarily unavailable",
                     then="echo 'Submitted batch job 7'")
    assert commands.run(["sbatch", "x.sh"], read=False, budget=30, sleep=lambda s: None).stdout.strip() == \
        "Submitted batch job 7"
    assert busy.read_text().strip() == "2"


def test_a_lost_answer_is_looked_for_before_an_action_runs_again(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    calls = _stand_in(tmp_path / "bin", "sbatch", 10**6, "Socket timed out on send/recv operation")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    seen: list[str] = []

    def found(said: str) -> commands.Answer | None:
        seen.append(said)
        return commands.Answer("Submitted batch job 42", "", 0)

    answer = commands.run(["sbatch", "x.sh"], read=False, budget=30, before_retry=found, sleep=lambda s: None)
    assert answer.stdout == "Submitted batch job 42" and calls.read_text().strip() == "1"
    assert seen == ["sbatch: error: Socket timed out on send/recv operation"]


def test_submit_runs_locally_only_where_no_slurm_is_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert commands.backend() == "local"  # no sbatch: a laptop
    _stand_in(bin_dir, "sbatch", 0, "", then="exit 0")
    _stand_in(bin_dir, "sinfo", 10**6, "Unable to contact slurm controller (connect failure)")
    with pytest.raises(SlurmError) as e:  # installed, controller down: an error, never a local run
        commands.backend(budget=0)
    assert "SLURM is installed here, so the job is not run on this host" in str(e.value) and "--local" in str(e.value)
    (bin_dir / "sinfo.calls").unlink()
    _stand_in(bin_dir, "sinfo", 1, "Socket timed out on send/recv operation", then="echo debug")
    monkeypatch.setenv(commands.RETRY_ENV, "5")
    assert commands.backend() == "slurm"


@pytest.mark.parametrize("value", ["x", "-1", "4000"])
def test_a_bad_retry_budget_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(commands.RETRY_ENV, value)
    with pytest.raises(SlurmError, match=commands.RETRY_ENV):
        commands.retry_budget()


def test_submit_with_slurm_installed_and_no_controller_runs_nothing_here(tmp_path: Path) -> None:
    """The CLI end to end: one line naming sinfo and its error, exit 2, no job recorded, no local run."""
    bin_dir = tmp_path / "bin"
    _stand_in(bin_dir, "sbatch", 0, "", then="exit 0")
    _stand_in(bin_dir, "sinfo", 10**6, "Socket timed out on send/recv operation")
    run = tmp_path / "run"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(f"name: t\nrun_dir: {run}\nslurm:\n  time: '00:05:00'\n  gpus_per_node: 1\n  account: a-g34\n"
                   "entry:\n  function: alpsck.examples.llama.train:slurm_entry\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", commands.RETRY_ENV: "2"}
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--no-check"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("alpsck: error: `sinfo -h -o %P` failed (2 tries over "), lines
    assert "Socket timed out" in lines[0] and "pass --local" in lines[0], lines
    assert "local executor" not in r.stdout and not (run / "submitit").exists() and not (run / "history.jsonl").exists()
