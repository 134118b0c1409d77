"""The job runner's decisions (finish, requeue, cancel, give up) in a real process, on real signals.

Each case runs :class:`alpsck.slurm.runner.JobRunner` in a subprocess, as a SLURM job step would,
with a stand-in ``scontrol`` on PATH (it answers ``show job`` with the state the case sets and logs
every call) — the decision logic under test is the runner's own; the real-cluster path is covered
by tests/slurm/test_slurm_cluster.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.runner_start import run_start as _run

from alpsck import cli
from alpsck.slurm import history, timeline


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
        assert timeline.state_of(events) == "failed"


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


def test_a_hand_scontrol_requeue_is_a_requeue_not_a_cancel(tmp_path: Path) -> None:
    """``scontrol requeue`` by hand: SIGTERM with JobState=COMPLETING (as scancel gives) but the
    restart count already up. It used to read as a cancel; SLURM then started the job again."""
    r, events, calls = _run(tmp_path, "sigterm_stop", fields="JobState=COMPLETING Reason=None Restarts=1")
    assert r.returncode == 0, r.stderr
    assert _events(events)[-3:] == ["signal", "final_checkpoint", "requeued"], events
    assert events[-1]["reason"] == "requeue" and events[-1]["mechanism"] == "slurm" and events[-1]["step"] == 6
    assert "requeue" not in calls.split()  # SLURM requeued it already


def test_the_time_limit_itself_is_a_timeout_stop(tmp_path: Path) -> None:
    """SIGTERM at the time limit (the --signal warning came too late or not at all): the final
    checkpoint, then a requeue, not a cancel."""
    r, events, calls = _run(tmp_path, "sigterm_stop", fields="JobState=COMPLETING Reason=TimeLimit Restarts=0")
    assert r.returncode == 0, r.stderr
    assert events[-1]["event"] == "requeued" and events[-1]["reason"] == "timeout", events
    assert "requeue 999" in calls


def test_in_a_container_sigterm_leaves_the_verdict_to_the_batch_script(tmp_path: Path) -> None:
    """No scontrol (ALPSCK_NO_SCONTROL, as inside an Alps container): the job cannot tell scancel
    from preemption, so it records ``term``, writes the request for this start (job id and
    SLURM_RESTART_COUNT first), records no requeue itself, and exits 3."""
    r, events, calls = _run(tmp_path, "sigterm_stop", env_extra={"ALPSCK_NO_SCONTROL": "1", "SLURM_RESTART_COUNT": "2"})
    assert r.returncode == 3, r.stderr
    assert _events(events)[-2:] == ["signal", "final_checkpoint"] and events[-1]["reason"] == "term", events
    lines = (tmp_path / "run" / ".requeue-request").read_text().splitlines()
    assert lines[0] == "999 2"
    verdicts = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1]) for ln in lines[1:]}
    assert set(verdicts) == {"preemption", "timeout", "cancel", "requeue"}
    assert verdicts["preemption"]["event"] == "requeued" and verdicts["preemption"]["reason"] == "preemption"
    assert verdicts["timeout"]["reason"] == "timeout" and verdicts["cancel"]["event"] == "cancelled"
    assert verdicts["requeue"]["mechanism"] == "slurm"
    assert all(v["step"] == 6 and v["job_id"] == "999" for v in verdicts.values())
    assert calls == ""


def test_a_stale_request_is_removed_when_the_next_start_begins(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".requeue-request").write_text("999 0\npreemption {}\n")
    r, events, _ = _run(tmp_path, "signalled_during_the_last_step", env_extra={"SLURM_RESTART_COUNT": "1"})
    assert r.returncode == 0, r.stderr
    assert not (run / ".requeue-request").exists()


def test_sigint_to_the_tasks_is_an_interrupt_that_is_not_requeued(tmp_path: Path) -> None:
    r, events, calls = _run(tmp_path, "interrupted")
    assert r.returncode == 1
    failed = events[-1]
    assert failed["event"] == "failed" and failed["not_requeued"] == "interrupted (SIGINT)", events
    assert "requeue" not in calls.split()


# Every transition seen in the scenarios on the local SLURM: (the events, whether the job still
# exists, SLURM's record of its end) -> the state status shows.
_S = {"event": "submitted", "job_id": "7", "backend": "slurm"}
_ST = {"event": "started", "job_id": "7"}
_RQ = {"event": "requeued", "job_id": "7", "reason": "timeout"}
STATE_TABLE = [
    ("pending, queued", [_S], True, None, "pending"),
    ("pending, SLURM cannot tell", [_S], None, None, "pending"),
    ("scancelled while pending", [_S], False, {"state": "CANCELLED", "exit_code": "0:0"}, "cancelled"),
    ("could not start", [_S], False, {"state": "FAILED", "exit_code": "1:0"}, "failed"),
    ("vanished with no record", [_S, _ST], False, None, "failed"),
    ("running", [_S, _ST], True, None, "running"),
    ("os._exit at a start", [_S, _ST], False, {"state": "FAILED", "exit_code": "7:0"}, "failed"),
    ("killed at the time limit", [_S, _ST], False, {"state": "TIMEOUT", "exit_code": "0:0"}, "timeout"),
    ("requeued, pending again", [_S, _ST, _RQ], True, None, "requeued"),
    ("requeued, then scancelled while pending", [_S, _ST, _RQ], False, {"state": "CANCELLED", "exit_code": "0:0"},
     "cancelled"),
    ("requeued by hand", [_S, _ST, {**_RQ, "reason": "requeue", "mechanism": "slurm"}], True, None, "requeued"),
    ("restarted after a requeue", [_S, _ST, _RQ, _ST], True, None, "running"),
    ("a crash that will be requeued", [_S, _ST, {"event": "failed", "job_id": "7", "will_requeue": True}, _RQ],
     True, None, "requeued"),
    ("failed, not requeued", [_S, _ST, {"event": "failed", "job_id": "7", "will_requeue": False}],
     False, {"state": "FAILED", "exit_code": "1:0"}, "failed"),
    ("finished", [_S, _ST, {"event": "finished", "job_id": "7"}], False, {"state": "COMPLETED", "exit_code": "0:0"},
     "finished"),
    ("cancelled, recorded by the batch script", [_S, _ST, {"event": "cancelled", "job_id": "7"}], False,
     {"state": "CANCELLED", "exit_code": "0:15"}, "cancelled"),
    ("gave up", [_S, _ST, {"event": "gave_up", "job_id": "7"}], False, {"state": "FAILED", "exit_code": "1:0"},
     "gave_up"),
    ("signalled, final checkpoint under way", [_S, _ST, {"event": "signal", "job_id": "7"}], True, None, "running"),
]


@pytest.mark.parametrize(("events", "alive", "slurm", "want"), [row[1:] for row in STATE_TABLE],
                         ids=[row[0] for row in STATE_TABLE])
def test_the_status_state_machine(events: list[dict[str, object]], alive: bool | None,
                                  slurm: dict[str, object] | None, want: str) -> None:
    from alpsck.slurm import watch

    evs = [{"time": 1000.0 + i, **e} for i, e in enumerate(events)]
    state, note = watch.decide(timeline.state_of(evs), alive, slurm, "7")
    assert state == want and state in history.STATES
    # A note says why exactly when the history's own state was overruled (the job is gone).
    assert (note is not None) == (alive is False and timeline.state_of(evs) in watch.LIVE_STATES)


@pytest.mark.parametrize(("retries", "earlier", "requeued"), [
    (0, 0, False), (1, 0, True), (1, 1, False), (2, 1, True), (2, 2, False), (3, 2, True)])
def test_same_error_retries_bounds_the_requeues_of_a_repeating_crash(tmp_path: Path, retries: int, earlier: int,
                                                                    requeued: bool) -> None:
    """``earlier`` starts already failed with this error and no checkpoint since: the crash is
    requeued while fewer than ``requeue.same_error_retries`` did."""
    run = tmp_path / "run"
    for i in range(earlier):
        history.append(run, "started", job_id="L1", restart=i)
        history.append(run, "failed", job_id="L1", message="RuntimeError: boom", will_requeue=True)
        history.append(run, "requeued", job_id="L1", reason="failure", progress=False)
    r, events, _ = _run(tmp_path, "crashes", local=True,
                        extra=f"  same_error_retries: {retries}\n  max_restarts: 50\n  give_up_after_no_progress: 50\n")
    failed = [e for e in events if e["event"] == "failed"][-1]
    assert failed["message"] == "RuntimeError: boom" and failed["will_requeue"] is requeued, events
    if not requeued:
        assert r.returncode == 1 and "same_error_retries is" in failed["not_requeued"], failed


def test_a_crash_after_a_hand_requeue_the_loop_never_saw_does_not_requeue_again(tmp_path: Path) -> None:
    r, events, calls = _run(tmp_path, "requeued_by_hand_then_crash", fields="JobState=COMPLETING Reason=None Restarts=1")
    assert "requeue" not in calls.split(), calls
    assert events[-1]["event"] == "requeued" and events[-1]["mechanism"] == "slurm", events


def test_a_local_job_never_asks_slurm_what_a_sigterm_means(tmp_path: Path) -> None:
    """Its job id is a pid, which SLURM may know as another job (here: one being cancelled)."""
    r, events, calls = _run(tmp_path, "sigterm_stop", local=True, fields="JobState=CANCELLED Reason=None Restarts=0")
    assert events[-1]["event"] == "requeued" and events[-1]["reason"] == "preemption", events
    assert "show job" not in calls


def test_a_term_stop_on_the_host_leaves_the_requeue_to_the_batch_script(tmp_path: Path) -> None:
    """scontrol gave no answer when the SIGTERM came ("term"), and answers later: the job still
    writes the request, so that the batch script asks again, instead of a requeue here
    overriding what may be a scancel."""
    r, events, calls = _run(tmp_path, "sigterm_stop", fields="Reason=None")  # no JobState: no verdict
    assert r.returncode == 3, r.stderr
    assert events[-1]["event"] == "final_checkpoint" and events[-1]["reason"] == "term", events
    assert "requeue" not in calls.split() and (tmp_path / "run" / ".requeue-request").exists()


def test_the_step_a_restore_used_is_recorded_when_it_fell_back(tmp_path: Path) -> None:
    """The runner's resume step is the picker's quick answer (no data read); when the job's restore then
    falls back (a data CRC), the step it used is recorded: JobContext.restored_step and a 'restored' event."""
    import torch
    from support.corrupt import flip_byte

    import alpsck

    run = tmp_path / "run"
    with alpsck.Checkpointer(run) as ck:
        for s in (1, 2):
            ck.save(s, {"w": torch.full((4096,), float(s))}).wait()
    flip_byte(run / "step-000000002" / "rank-00000.bin", 100)
    r, events, _ = _run(tmp_path, "restore_damaged")
    assert r.returncode == 0, r.stderr
    assert [e["step"] for e in events if e["event"] == "started"] == [2]
    assert [(e["step"], e["resume_step"]) for e in events if e["event"] == "restored"] == [(1, 2)], events
