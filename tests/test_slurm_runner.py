"""The job runner's decisions (finish, requeue, cancel, give up) in a real process, on real signals.

Each case runs :class:`alpsck.slurm.runner.JobRunner` in a subprocess, as a SLURM job step would,
with a stand-in ``scontrol`` on PATH (it answers ``show job`` with the state the case sets and logs
every call) — the decision logic under test is the runner's own; the real-cluster path is covered
by tests/test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from alpsck import cli
from alpsck.slurm import history

ENTRY = r'''
import os, signal, time
from pathlib import Path
STATE = Path(os.environ["FAKE_SLURM_STATE"])

def _signal(sig):
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs between bytecodes

def scancel_during_the_final_checkpoint(job):
    _signal(signal.SIGUSR2)                       # the time limit approaches
    assert job.stop_requested() and job.stop_reason == "timeout"
    STATE.write_text("CANCELLED\n")               # the user runs scancel while the final save runs
    _signal(signal.SIGTERM)
    return "saved"

def cancelled_then_the_final_save_fails(job):
    STATE.write_text("CANCELLED\n")
    _signal(signal.SIGTERM)
    assert job.stop_requested() and job.stop_reason == "cancel"
    raise OSError(28, "No space left on device (final checkpoint)")

def signalled_during_the_last_step(job):
    for step in job.steps(0, 3):
        if step == 2:
            _signal(signal.SIGUSR2)               # the loop ends before it polls again
    return "trained all 3 steps"

def stopped_early(job):
    for step in job.steps(0, 1000):
        if step == 2:
            _signal(signal.SIGUSR2)
    return "stopped"

def crashes(job):
    raise RuntimeError("boom")
'''


def _run(tmp_path: Path, entry: str, *, local: bool = False, extra: str = "") -> tuple[subprocess.CompletedProcess[str],
                                                                                       list[dict[str, object]], str]:
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    log, state = tmp_path / "scontrol.log", tmp_path / "state"
    state.write_text("RUNNING\n")
    scontrol = fake / "scontrol"
    scontrol.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$1 $2" in
  "show job") echo "JobId=$4 JobState=$(cat {state}) EndTime=2099-01-01T00:00:00";;
  "show reservation") echo "No reservations in the system";;
esac
exit 0
""")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "runner_entry.py").write_text(ENTRY)
    run = tmp_path / "run"
    cfg = (f"name: t\nrun_dir: {run}\nentry:\n  function: runner_entry:{entry}\n"
           f"requeue:\n  on_maintenance: false\n{extra}")
    code = ("import sys\nfrom alpsck.slurm.config import parse_config\nfrom alpsck.slurm.runner import JobRunner\n"
            "JobRunner(parse_config(sys.argv[1]))()\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update({"PATH": f"{fake}{os.pathsep}{env['PATH']}", "FAKE_SLURM_STATE": str(state),
                "PYTHONPATH": os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])})
    env.update({"SUBMITIT_LOCAL_JOB_ID": "L1"} if local else {"SLURM_JOB_ID": "999"})
    r = subprocess.run([sys.executable, "-c", code, cfg], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    return r, history.read(run), log.read_text() if log.exists() else ""


def _events(events: list[dict[str, object]]) -> list[object]:
    return [e["event"] for e in events]


def test_scancel_during_the_final_checkpoint_is_a_cancel_not_a_requeue(tmp_path: Path) -> None:
    r, events, calls = _run(tmp_path, "scancel_during_the_final_checkpoint")
    assert r.returncode == 0, r.stderr
    assert _events(events)[-1] == "cancelled", events
    assert "requeued" not in _events(events)
    assert "requeue" not in calls.split()
    assert next(e for e in events if e["event"] == "final_checkpoint")["reason"] == "cancel"


def test_a_cancelled_job_whose_final_save_fails_is_not_requeued(tmp_path: Path) -> None:
    r, events, calls = _run(tmp_path, "cancelled_then_the_final_save_fails")
    assert r.returncode == 1
    failed = events[-1]
    assert failed["event"] == "failed" and failed.get("will_requeue") is False, events
    assert "requeue" not in calls.split()


def test_a_stop_the_entry_never_polled_leaves_a_finished_run(tmp_path: Path) -> None:
    """The signal came during the last step and the loop (job.steps) ended without polling again:
    the run is complete, not stopped, even with no restarts left."""
    r, events, calls = _run(tmp_path, "signalled_during_the_last_step", extra="  max_restarts: 0\n")
    assert r.returncode == 0, r.stderr
    assert _events(events) == ["started", "finished"], events
    assert "requeue" not in calls.split()


def test_a_stop_the_entry_saw_requeues(tmp_path: Path) -> None:
    r, events, calls = _run(tmp_path, "stopped_early")
    assert r.returncode == 0, r.stderr
    assert _events(events)[-3:] == ["signal", "final_checkpoint", "requeued"], events
    assert "requeue 999" in calls


@pytest.mark.parametrize("progress", [False, True], ids=["earlier-starts-crashed", "earlier-requeues-progressed"])
def test_only_starts_without_progress_count_against_max_restarts(tmp_path: Path, progress: bool) -> None:
    """Two earlier starts: both crashed (charged), or both ended in a requeue after the newest
    checkpoint advanced (free). With max_restarts 2, a third crash fails the run in the first case
    and is requeued in the second (each start a different error: no repeated-error verdict)."""
    run = tmp_path / "run"
    for i in range(2):
        history.append(run, "started", job_id="L1", restart=i, step=i)
        if progress:
            history.append(run, "requeued", job_id="L1", reason="timeout", step=i + 1, progress=True)
    r, events, _ = _run(tmp_path, "crashes", local=True, extra="  max_restarts: 2\n  give_up_after_no_progress: 50\n")
    failed = events[-1] if events[-1]["event"] == "failed" else [e for e in events if e["event"] == "failed"][-1]
    assert failed.get("will_requeue") is progress, events
    if progress:
        assert events[-1]["event"] == "requeued" and events[-1]["progress"] is False  # this crash is charged
    else:
        assert r.returncode == 1 and "requeue.max_restarts is 2" in failed["not_requeued"], events
        assert history.state_of(events) == "failed"


def test_status_of_what_is_no_job_history_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:

    (tmp_path / "file").touch()
    (tmp_path / "dir" / history.HISTORY).mkdir(parents=True)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / history.HISTORY).write_bytes(b"\xff\xfe not json\n{}\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / history.HISTORY).touch()
    for name, says in (("file", "file: not a directory"), ("gone", "gone: no such directory"),
                       ("dir", "history.jsonl: not a regular file"),
                       ("junk", "history.jsonl: no readable event in its 2 line(s)"),
                       ("empty", "history.jsonl: no readable event in its 0 line(s)")):
        rc = cli.main(["status", str(tmp_path / name)])  # in-process: one CLI start per case would take seconds
        out = capsys.readouterr()
        assert rc == 2 and says in out.err and not out.out, (name, out)


def test_status_survives_a_damaged_history(tmp_path: Path) -> None:
    run = tmp_path / "run"
    history.append(run, "started", job_id="1", restart=0)
    with open(run / history.HISTORY, "a") as fh:
        fh.write('{"event": "x"}\n{"event": "x", "time": "yesterday"}\n{"event": "x", "time": 1e30}\n')
        fh.write("[" * 100_000 + "\n" + '{"event": "finished", "time": 1700000000.5, "loss": NaN}\n')
    assert _events(history.read(run)) == ["started", "finished"]
    r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    json.loads(r.stdout, parse_constant=refuse)
