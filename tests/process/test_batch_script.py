"""The batch script's host side, run by a real bash: how a SIGTERM is read (the Python verdict and
its shell twin, driven through one table), and the EXIT trap that acts on a requeue request.

``scontrol`` is a stand-in on PATH that prints the fields a case sets and logs its calls; the
whole path on a real SLURM is in tests/slurm/test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from alpsck.slurm import history, timeline
from alpsck.slurm.runner import REQUEST_FILE, request_text
from alpsck.slurm.stop import term_verdict, term_verdict_shell
from alpsck.slurm.submit import BATCH_SIGNAL_LINES, requeue_trap_lines

# (scontrol's fields for the job, SLURM_RESTART_COUNT of the start, the verdict). The states are
# the ones measured on the local Slurm 22.05 (stop.term_verdict's docstring).
TABLE = [
    ("JobState=RUNNING Reason=None Restarts=0", 0, "preemption"),             # GraceTime preemption
    ("JobState=RUNNING Reason=None Restarts=2", 2, "preemption"),             # same, on a requeued start
    ("JobState=COMPLETING Reason=None Restarts=0", 0, "cancel"),              # scancel, first moments
    ("JobState=CANCELLED Reason=None Restarts=3", 3, "cancel"),               # scancel, later
    ("JobState=COMPLETING Reason=None Restarts=1", 0, "requeue"),             # scontrol requeue by hand
    ("JobState=COMPLETING Reason=None Restarts=4", 3, "requeue"),
    ("JobState=COMPLETING Reason=TimeLimit Restarts=0", 0, "timeout"),        # the time limit itself
    ("JobState=TIMEOUT Reason=None Restarts=1", 1, "timeout"),
    ("JobState=DEADLINE Reason=None Restarts=0", 0, "timeout"),
    ("JobState=RUNNING Reason=None Restarts=x", 0, "preemption"),             # a restart count that is no number
    ("JobState=RUNNING Comment=JobState=CANCELLED Restarts=0", 0, "preemption"),  # the first field wins
]


def _fake_scontrol(tmp_path: Path, fields: str, *, requeue_rc: int = 0) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "scontrol.log"
    script = bin_dir / "scontrol"
    script.write_text(f"""#!/bin/sh
echo "$*" >> '{log}'
case "$1 $2" in
  "show job") echo "JobId=$4 JobName=t {fields}"; exit 0;;
  "requeue $SLURM_JOB_ID") exit {requeue_rc};;
esac
exit 1
""")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


@pytest.mark.parametrize(("fields", "restarts", "verdict"), TABLE)
def test_the_python_verdict_and_its_shell_twin_agree(tmp_path: Path, fields: str, restarts: int, verdict: str) -> None:
    parsed = dict(f.split("=", 1) for f in reversed(fields.split()))  # reversed: the first of each name wins
    assert term_verdict(parsed, restarts) == verdict
    env = _fake_scontrol(tmp_path, fields)
    env["SLURM_RESTART_COUNT"] = str(restarts)
    if restarts == 0:
        del env["SLURM_RESTART_COUNT"]  # SLURM sets it only once the job was requeued
    r = subprocess.run(["bash", "-c", "\n".join([*term_verdict_shell(), "alpsck_term_verdict"])], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == verdict, r.stdout + r.stderr


def test_without_an_answer_from_scontrol_python_says_term_and_the_shell_tries_the_requeue(tmp_path: Path) -> None:
    assert term_verdict(None, 0) == "term" and term_verdict({"Reason": "None"}, 0) == "term"
    env = {**os.environ, "PATH": "/nonexistent:/usr/bin:/bin", "SLURM_JOB_ID": "4242"}
    r = subprocess.run(["bash", "-c", "\n".join([*term_verdict_shell(), "alpsck_term_verdict"])], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "preemption"


def _batch_exit(tmp_path: Path, fields: str, request: str | None, *, restarts: int = 0, requeue_rc: int = 0,
                body: str = "true") -> tuple[list[dict[str, object]], list[str], Path]:
    """Run the batch script's signal and trap lines, then ``body``, in bash; return the history,
    scontrol's calls and the run dir."""
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    history.append(run, "started", job_id="4242", restart=restarts)
    if request is not None:
        (run / REQUEST_FILE).write_text(request)
    env = _fake_scontrol(tmp_path, fields, requeue_rc=requeue_rc)
    if restarts:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    script = "\n".join([*BATCH_SIGNAL_LINES, *requeue_trap_lines(str(run)), body])
    subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    log = tmp_path / "scontrol.log"
    calls = log.read_text().splitlines() if log.exists() else []
    return history.read(run), calls, run


@pytest.mark.parametrize(("fields", "reason", "event", "want_reason", "requeues"), [
    ("JobState=RUNNING Restarts=0", "term", "requeued", "preemption", True),
    ("JobState=CANCELLED Restarts=0", "term", "cancelled", None, False),
    ("JobState=COMPLETING Restarts=0", "timeout", "cancelled", None, False),       # scancel during a timeout stop
    ("JobState=COMPLETING Restarts=1", "term", "requeued", "requeue", False),      # SLURM requeued it already
    ("JobState=COMPLETING Reason=TimeLimit Restarts=0", "term", "requeued", "timeout", True),
    ("JobState=RUNNING Restarts=0", "maintenance", "requeued", "maintenance", True),
], ids=["preempted", "scancelled", "scancelled-during-timeout-stop", "requeued-by-hand", "time-limit",
        "maintenance"])
def test_the_exit_trap_acts_on_the_request_and_records_the_outcome(
        tmp_path: Path, fields: str, reason: str, event: str, want_reason: str | None, requeues: bool) -> None:
    events, calls, run = _batch_exit(tmp_path, fields, request_text("4242", 0, reason, 17, True))
    assert ("requeue 4242" in calls) is requeues, calls
    last = events[-1]
    assert last["event"] == event and last["step"] == 17 and last["recorded_by"] == "batch script", events
    assert last.get("reason") == want_reason
    if event == "requeued":
        assert last["mechanism"] == ("slurm" if want_reason == "requeue" else "batch-script")
    assert timeline.state_of(events) == ("cancelled" if event == "cancelled" else "requeued")
    assert not (run / REQUEST_FILE).exists()


def test_a_failed_scontrol_requeue_records_no_requeue(tmp_path: Path) -> None:
    events, calls, run = _batch_exit(tmp_path, "JobState=RUNNING Restarts=0", request_text("4242", 0, "timeout", 3, True),
                                     requeue_rc=1)
    assert "requeue 4242" in calls and [e["event"] for e in events] == ["started"]
    assert not (run / REQUEST_FILE).exists()


@pytest.mark.parametrize("first", ["4241 0", "4242 1", "4242", "", "$(touch pwned) 0"],
                         ids=["another-job", "another-start", "no-restart-count", "empty", "shell-text"])
def test_a_request_from_another_job_or_start_is_removed_and_ignored(tmp_path: Path, first: str) -> None:
    text = request_text("4242", 0, "term", 3, True).split("\n", 1)[1]
    events, calls, run = _batch_exit(tmp_path, "JobState=RUNNING Restarts=0", f"{first}\n{text}")
    assert [e["event"] for e in events] == ["started"] and not any("requeue" in c for c in calls)
    assert not (run / REQUEST_FILE).exists() and not (tmp_path / "pwned").exists()


def test_request_lines_are_copied_never_run(tmp_path: Path) -> None:
    hostile = f"4242 0\npreemption $(touch {tmp_path}/pwned) `touch {tmp_path}/pwned2`\n"
    events, calls, run = _batch_exit(tmp_path, "JobState=RUNNING Restarts=0", hostile)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert "requeue 4242" in calls and not (run / REQUEST_FILE).exists()
    assert f"preemption $(touch {tmp_path}/pwned)" not in (run / history.HISTORY).read_text()  # the verdict word is cut
    assert history.read(run)[-1]["event"] == "started"  # not a valid event: read skips it


def test_symlinked_request_and_history_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text(request_text("4242", 0, "term", 3, True))
    run = tmp_path / "run"
    run.mkdir()
    (run / REQUEST_FILE).symlink_to(outside)
    events, calls, _ = _batch_exit(tmp_path, "JobState=RUNNING Restarts=0", None)
    assert not (run / REQUEST_FILE).is_symlink() and outside.read_text().startswith("4242 0")
    assert not any("requeue" in c for c in calls)
    # A history that is a symlink gets nothing appended through it.
    target = tmp_path / "elsewhere.jsonl"
    target.write_text("")
    run2 = tmp_path / "two"
    (tmp_path / "two").mkdir()
    (run2 / history.HISTORY).symlink_to(target)
    (run2 / REQUEST_FILE).write_text(request_text("4242", 0, "term", 3, True))
    env = _fake_scontrol(tmp_path, "JobState=RUNNING Restarts=0")
    subprocess.run(["bash", "-c", "\n".join([*requeue_trap_lines(str(run2)), "true"])], env=env, timeout=60)
    assert target.read_text() == "" and not (run2 / REQUEST_FILE).exists()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT,
                                 signal.SIGTERM])
def test_the_batch_shell_outlives_the_signals_it_handles(tmp_path: Path, sig: signal.Signals) -> None:
    """USR1, USR2, HUP and INT are ignored (QUIT too: bash always ignores it); TERM waits for the
    foreground step (here a sleep that then leaves a request, as the job's final checkpoint would)
    before the EXIT trap decides."""
    marker = tmp_path / "after"
    body = (f"echo ready; sleep 1.5; echo '{request_text('4242', 0, 'term', 9, True).strip()}' > {tmp_path}/run/{REQUEST_FILE}; "
            f"touch {marker}")
    proc_env = _fake_scontrol(tmp_path, "JobState=CANCELLED Restarts=0")
    run = tmp_path / "run"
    run.mkdir()
    history.append(run, "started", job_id="4242", restart=0)
    script = "\n".join([*BATCH_SIGNAL_LINES, *requeue_trap_lines(str(run)), body])
    p = subprocess.Popen(["bash", "-c", script], env=proc_env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"  # its traps are set
    p.send_signal(sig)
    assert p.wait(timeout=30) == 0
    assert marker.exists()  # the shell went on after the signal
    assert history.read(run)[-1]["event"] == "cancelled"  # and its EXIT trap ran, after the step
    assert not (run / REQUEST_FILE).exists()


@pytest.mark.parametrize("sig", [signal.SIGALRM, signal.SIGPIPE, signal.SIGVTALRM])
def test_other_signals_end_the_batch_shell_by_choice(tmp_path: Path, sig: signal.Signals) -> None:
    """Documented as fatal (docs/slurm.md): an explicit signal to the batch shell asks to end it."""
    run = tmp_path / "run"
    run.mkdir()
    script = "\n".join([*BATCH_SIGNAL_LINES, *requeue_trap_lines(str(run)), "sleep 20 >/dev/null & wait", "echo survived"])
    p = subprocess.Popen(["bash", "-c", script], env=_fake_scontrol(tmp_path, "JobState=RUNNING"),
                         stdout=subprocess.PIPE, text=True)
    import time
    time.sleep(0.5)
    p.send_signal(sig)
    out, _ = p.communicate(timeout=30)
    assert p.returncode != 0 and "survived" not in out


def test_request_text_is_json_per_verdict(tmp_path: Path) -> None:
    lines = request_text("7", 3, "timeout", None, False).splitlines()
    assert lines[0] == "7 3"
    for ln in lines[1:]:
        verdict, doc = ln.split(" ", 1)
        rec = json.loads(doc)
        assert rec["job_id"] == "7" and "step" not in rec and rec["recorded_by"] == "batch script", rec
        assert rec.get("reason") == {"preemption": "timeout", "timeout": "timeout", "requeue": "requeue"}.get(verdict)


def test_the_sigterm_our_own_requeue_brings_does_not_cut_the_exit_trap_short(tmp_path: Path) -> None:
    """With proctrack/linuxproc (the local cluster) or pgid, the SIGTERM that follows a requeue
    reaches every process of the batch step, the EXIT trap's scontrol and sed too; the trap
    ignores it, so the requeue that went through is recorded."""
    run = tmp_path / "run"
    run.mkdir()
    history.append(run, "started", job_id="4242", restart=0)
    (run / REQUEST_FILE).write_text(request_text("4242", 0, "timeout", 17, True))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("""#!/bin/bash
case "$1" in
  show) echo "JobId=4242 JobName=t JobState=RUNNING Reason=None Restarts=0";;
  requeue) kill -TERM 0; sleep 0.2; exit 0;;
esac
""")
    (bin_dir / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    script = "\n".join([*BATCH_SIGNAL_LINES, *requeue_trap_lines(str(run)), "true"])
    subprocess.run(["bash", "-c", script], env=env, capture_output=True, timeout=60, start_new_session=True)
    assert [e["event"] for e in history.read(run)] == ["started", "requeued"]
    assert not (run / REQUEST_FILE).exists()
