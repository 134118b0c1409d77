"""The SLURM layer on a real one-node SLURM (slurm/local-cluster/start.sh; tests/run.sh starts it).

In CI these must run: without a working cluster they fail; elsewhere they skip.
Timings on the local cluster: a requeued job runs again ~13 s later; ``--time=2`` with
``--signal=USR2@60`` signals 33-57 s after the start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.slurm_helpers import (
    clean_losses,
    events,
    final_state,
    in_queue,
    job_config,
    steps_for_seconds,
    submit,
    training,
    wait_done,
    wait_for,
)


def running_with_checkpoint(run_dir: Path) -> bool:
    return any(e["event"] == "started" for e in events(run_dir)) and (run_dir / "LATEST").exists()


def test_time_limit_requeues_at_least_twice_and_is_bit_exact(cluster: None, tmp_path: Path) -> None:
    """Two tasks (DDP over gloo, a checkpoint shard per rank) through at least two time-limit cycles."""
    # > 2 x the 48-72 s a --time=2 start with its signal 45 s ahead trains (paced steps: the load cannot shorten
    # it). Not 60 s ahead: SLURM's signal then came 33 s after a start at worst, and in CI the two tasks'
    # start-up beside the other lanes took longer three times in a row, so the run gave up (no progress). This
    # test is about the requeue cycles, not that rule (test_slurm_runner), so it tolerates 5 such starts.
    steps = steps_for_seconds(150)
    run = tmp_path / "run"
    clean = clean_losses(tmp_path, steps, world=2)  # first: the job's two tasks take both CPUs
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps, time="2", delay=45, every=max(50, steps // 20),
                            tasks=2, no_progress=5))
    assert wait_done(run, job, 900) == "finished", events(run)
    requeues = events(run, "requeued")
    assert len(requeues) >= 2, (f"{steps} steps (150 s of training) finished after "
                                f"{len(requeues)} requeue(s)", events(run))
    assert all(e["reason"] == "timeout" and e["mechanism"] == "scontrol" for e in requeues), events(run)
    assert all(e["job_id"] == job for e in events(run))  # requeued, not resubmitted
    finals = events(run, "final_checkpoint")
    starts = events(run, "started")
    assert [s["restart"] for s in starts] == list(range(len(starts)))  # SLURM_RESTART_COUNT honoured
    assert [s.get("step") for s in starts[1:]] == [f["step"] for f in finals]
    assert (run / "loss.csv").read_text() == clean
    log = next((run / "submitit").glob(f"{job}_0_log.out")).read_text()
    assert log.count("Starting with JobEnvironment") >= 3  # --open-mode=append kept every start's log
    assert all(s["world_size"] == 2 for s in starts)
    from alpsck import _core

    committed = [i for i in _core.scan(str(run), verify=True) if i["status"] == "committed"]
    assert committed and all(i["shards"] == ["rank-00000.bin", "rank-00001.bin"] for i in committed)


def test_a_time_limit_signal_in_the_first_second_of_a_start_is_a_stop_not_a_failure(cluster: None,
                                                                                    tmp_path: Path) -> None:
    """USR2 about 1 s after the job step starts, while submitit is still unpickling the runner
    (importing torch): it used to kill the job (FAILED, no requeue). Now the launcher records it,
    the loop stops at its first step, and the job requeues and finishes with the exact losses.
    (scancel --signal reaches the job's steps, not its batch shell: timed from the job's RUNNING, the
    signal once came before the batch script had started the step, under CI's load, and reached nothing.)"""
    steps = steps_for_seconds(20)
    run = tmp_path / "run"
    clean = clean_losses(tmp_path, steps)
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps, time="3", delay=60, every=20))

    def step_running() -> bool:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True,
                             timeout=30)
        return any(re.fullmatch(rf"{job}\.\d+", line.strip()) for line in out.stdout.splitlines())

    wait_for(step_running, 120, f"job {job}'s step to run", poll=0.1)
    time.sleep(1.0)
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    assert wait_done(run, job, 600) == "finished", events(run)
    signals = events(run, "signal")
    assert signals and signals[0]["reason"] == "timeout" and events(run, "requeued")[0]["reason"] == "timeout"
    assert signals[0]["time_of_signal"] - events(run, "started")[0]["time"] < 10  # it came early in that start
    assert (run / "loss.csv").read_text() == clean


SIGNALS = {  # name: scancel arguments
    "usr2-to-the-tasks": ["--signal=USR2"],
    "term-to-the-tasks": ["--signal=TERM"],      # the preemption path: the job stays RUNNING
    "usr2-to-the-batch-shell": ["--batch", "--signal=USR2"],
    "term-to-the-batch-shell": ["--batch", "--signal=TERM"],
}


def test_a_signal_at_any_moment_of_a_start_still_ends_in_the_exact_losses(cluster: None, tmp_path: Path) -> None:
    """Three jobs per kind of signal, each signalled 0.3-2.5 s after SLURM shows it RUNNING: before
    the launcher, during submitit's unpickling, the imports, the first steps. Every one finishes
    with the uninterrupted run's losses: a time-limit or preemption signal to the tasks leads to a
    checkpoint (or nothing to save) and a requeue; one to the batch shell changes nothing."""
    import random
    import threading

    steps = steps_for_seconds(8)
    clean = clean_losses(tmp_path, steps)
    rng = random.Random(os.getpid())
    jobs: dict[str, tuple[str, Path]] = {}
    sent: dict[str, float] = {}
    timers: list[threading.Timer] = []
    submitted = threading.Event()

    def watch() -> None:  # from before the first submission: every job is seen as it enters RUNNING
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and not (submitted.is_set() and len(sent) == len(jobs)):
            ids = list(jobs)
            if ids:
                out = subprocess.run(["squeue", "-h", "-o", "%i %T", "-j", ",".join(ids)], capture_output=True,
                                     text=True, timeout=30).stdout
                for line in out.splitlines():
                    job, state = line.split()
                    if state == "RUNNING" and job not in sent:
                        delay = sent[job] = round(rng.uniform(0.3, 2.5), 2)
                        t = threading.Timer(delay, subprocess.run, args=(["scancel", *SIGNALS[jobs[job][0]], job],),
                                            kwargs={"timeout": 30})
                        t.start()
                        timers.append(t)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for kind in SIGNALS:
            for i in range(3):
                run = tmp_path / f"{kind}-{i}"
                cfg = job_config(tmp_path / f"{kind}-{i}.yaml", run, steps=steps, time="5", every=8)
                cfg.write_text(cfg.read_text().replace("slurm:\n", "slurm:\n  extra: {hold: true}\n", 1))
                job = submit(cfg)  # held: it runs once the watcher knows it
                jobs[job] = (kind, run)
        subprocess.run(["scontrol", "release", *jobs], check=True, timeout=60)
    finally:
        submitted.set()
        watcher.join()
    for t in timers:
        t.join()
    assert len(sent) == len(jobs), f"not every job ran: {sent}"
    for job, (kind, run) in jobs.items():
        assert wait_done(run, job, 900) == "finished", (kind, sent[job], events(run))
        assert not events(run, "failed") and not events(run, "cancelled"), (kind, sent[job], events(run))
        assert (run / "loss.csv").read_text() == clean, (kind, sent[job])
        if kind.endswith("batch-shell"):
            assert not events(run, "requeued"), (kind, events(run))
    # Most signals to the tasks found a task to stop (one sent before srun started its step is lost).
    stopped = [job for job, (kind, run) in jobs.items() if kind.endswith("tasks") and events(run, "requeued")]
    assert len(stopped) >= 3, {job: (jobs[job][0], sent[job]) for job in jobs}


def test_a_usr2_sent_to_the_batch_shell_does_not_end_the_job(cluster: None, tmp_path: Path) -> None:
    """scancel --batch --signal=USR2 reaches only the batch shell: it used to kill it (FAILED, the
    history said cancelled). The job now trains on and finishes with the exact losses."""
    steps = steps_for_seconds(20)
    run = tmp_path / "run"
    clean = clean_losses(tmp_path, steps)
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps, time="3", delay=60, every=20))
    wait_for(lambda: events(run, "started"), 120, f"job {job} to start", poll=0.2)
    time.sleep(2.0)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], check=True, timeout=30)
    assert wait_done(run, job, 600) == "finished", events(run)
    assert not events(run, "failed") and not events(run, "cancelled")
    assert (run / "loss.csv").read_text() == clean


@pytest.mark.cluster_exclusive  # preempts / reserves the whole node: alone (conftest.py)
def test_preemption_checkpoints_in_grace_time_and_requeues_from_the_batch_script(cluster: None, tmp_path: Path) -> None:
    steps = steps_for_seconds(50)
    run = tmp_path / "run"
    cfg = job_config(tmp_path / "job.yaml", run, steps=steps, time="10", delay=60, every=max(50, steps // 20))
    # Hide scontrol from the job, as inside an Alps container: SIGTERM is then taken as preemption
    # and the requeue goes through RUN_DIR/.requeue-request and the batch script's EXIT trap.
    job = submit(cfg, env={"ALPSCK_NO_SCONTROL": "1"})
    wait_for(lambda: running_with_checkpoint(run), 300, "the job to run and checkpoint")
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-o", str(tmp_path / "urgent.out"),
                             "--wrap", "sleep 10"], capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    clean = clean_losses(tmp_path, steps)
    try:
        assert wait_done(run, job, 600) == "finished", events(run)
    finally:
        subprocess.run(["scancel", urgent], timeout=30)
    # The job could not tell preemption from scancel ("term"); the batch script, on the host, could.
    req = events(run, "requeued")
    assert len(req) == 1 and req[0]["reason"] == "preemption" and req[0]["mechanism"] == "batch-script", events(run)
    assert req[0]["recorded_by"] == "batch script"
    final = events(run, "final_checkpoint")[0]
    assert final["reason"] == "term" and final["seconds"] < 30  # inside GraceTime
    assert not (run / ".requeue-request").exists()
    assert (run / "loss.csv").read_text() == clean


@pytest.mark.cluster_exclusive  # preempts / reserves the whole node: alone (conftest.py)
def test_maintenance_reservation_checkpoints_and_requeues_ahead(cluster: None, tmp_path: Path) -> None:
    steps = steps_for_seconds(240)
    run = tmp_path / "run"
    cfg = job_config(tmp_path / "job.yaml", run, steps=steps, time="15", delay=60, every=max(50, steps // 20),
                     requeue_extra="maintenance_margin_s: 60\nmaintenance_poll_s: 3")
    job = submit(cfg)
    wait_for(lambda: running_with_checkpoint(run), 300, "the job to run and checkpoint")
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 90))
    name = f"alpsck-maint-{os.getpid()}"
    subprocess.run(["scontrol", "create", "reservation", f"reservationname={name}", f"starttime={start}",
                    "duration=5", "nodes=ALL", "users=root", "flags=maint,ignore_jobs"], check=True, timeout=60)
    try:
        req = wait_for(lambda: events(run, "requeued"), 240, "a requeue before the reservation")
        assert req[0]["reason"] == "maintenance", events(run)
        assert req[0]["time"] < time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))  # ahead of it
    finally:
        subprocess.run(["scontrol", "delete", f"reservationname={name}"], timeout=60)
        subprocess.run(["scancel", job], timeout=30)
    assert events(run, "final_checkpoint")[0]["reason"] == "maintenance"


def test_scancel_takes_a_final_checkpoint_and_does_not_requeue(cluster: None, tmp_path: Path) -> None:
    steps = steps_for_seconds(300)
    run = tmp_path / "run"
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps, time="15", delay=60, every=10**9))
    wait_for(lambda: training(run), 300, "the job to train")
    subprocess.run(["scancel", job], check=True, timeout=30)
    assert wait_done(run, job, 120) == "cancelled", events(run)
    assert not events(run, "requeued")
    final = events(run, "final_checkpoint")[0]
    assert final["reason"] == "cancel" and isinstance(final["step"], int) and final["step"] > 0
    assert "maintenance_watch" not in events(run, "started")[0]  # scontrol is there: the watcher runs
    ck = subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run), "--verify", "--json"],
                        capture_output=True, text=True, timeout=120)
    assert json.loads(ck.stdout)["latest_valid"] == final["step"]


def test_in_a_container_scancel_is_a_cancel_with_no_requeue_and_no_leftover_request(cluster: None,
                                                                                     tmp_path: Path) -> None:
    """No scontrol in the job (as inside an Alps container): the job checkpoints on SIGTERM and
    asks the batch script, which (on the host) sees the cancel, does not requeue, records it."""
    run = tmp_path / "run"
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps_for_seconds(300), time="15", every=10**9),
                 env={"ALPSCK_NO_SCONTROL": "1"})
    wait_for(lambda: training(run), 300, "the job to train")
    subprocess.run(["scancel", job], check=True, timeout=30)
    assert wait_done(run, job, 120) == "cancelled", events(run)
    assert not events(run, "requeued") and events(run)[-1]["recorded_by"] == "batch script"
    final = events(run, "final_checkpoint")[0]
    assert final["reason"] == "term" and isinstance(final["step"], int) and final["step"] > 0
    assert events(run, "cancelled")[0]["step"] == final["step"]
    assert not (run / ".requeue-request").exists()
    # The maintenance watcher (requeue.on_maintenance, on by default) could not run without scontrol: status says so.
    st = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"], capture_output=True, text=True,
                        timeout=120)
    assert json.loads(st.stdout)["watchers_off"] == {"maintenance": "off: ALPSCK_NO_SCONTROL=1 hides scontrol from the job"}
    time.sleep(15)  # a requeued job would be back in the queue by now
    assert not in_queue(job)


def test_a_hand_scontrol_requeue_shows_requeued_and_the_job_resumes(cluster: None, tmp_path: Path) -> None:
    """It used to read as a cancel (COMPLETING, as scancel gives): the job recorded cancelled and
    SLURM started it again anyway."""
    run = tmp_path / "run"
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps_for_seconds(300), time="15", every=10**9))
    try:
        wait_for(lambda: training(run), 300, "the job to train")
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        req = wait_for(lambda: events(run, "requeued"), 60, "the requeue to be recorded", poll=0.5)
        assert req[0]["reason"] == "requeue" and req[0]["mechanism"] == "slurm", events(run)
        assert events(run, "final_checkpoint")[0]["reason"] == "requeue" and not events(run, "cancelled")
        st = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"],
                                       capture_output=True, text=True, timeout=120).stdout)
        assert st["state"] in ("requeued", "running"), st
        again = wait_for(lambda: len(events(run, "started")) >= 2 and events(run, "started"), 180, "the next start")
        assert again[1]["restart"] == 1 and again[1]["step"] == req[0]["step"], events(run)
    finally:
        subprocess.run(["scancel", job], timeout=30)


def test_a_job_that_exits_hard_at_every_start_shows_failed_with_its_exit_code(cluster: None, tmp_path: Path) -> None:
    """os._exit(7): no Python handler runs, the history stops at "started"; status asks SLURM."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "hard_exit.py").write_text("import os\n\ndef main(job):\n    os._exit(7)\n")
    run = tmp_path / "run"
    job = submit(job_config(conf / "job.yaml", run, steps=10, time="5", entry="hard_exit:main",
                            requeue_extra="in_job_restarts: 0"))  # no restart in the allocation (tested below)
    wait_for(lambda: not in_queue(job), 180, f"job {job} to end", poll=1)
    ended = time.monotonic()

    def shown() -> dict[str, object] | None:
        r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"], capture_output=True,
                           text=True, timeout=120)
        doc = json.loads(r.stdout)
        return doc if doc["state"] == "failed" else None

    doc = wait_for(shown, 60, "status to show the failure")
    assert time.monotonic() - ended < 60
    assert doc["slurm"] == {"state": "FAILED", "exit_code": "7:0"}, doc
    assert [e["event"] for e in events(run)] == ["submitted", "started"]


def test_a_stop_signal_while_a_finished_task_tears_down_leaves_slurm_completed(cluster: None, tmp_path: Path) -> None:
    """The time-limit signal can come while a finished task exits: after Python has reset its
    signal handlers to the default action (which ends the process), during a teardown that takes
    seconds (torch's can). It used to end the task with 128 + the signal, and SLURM recorded a run
    the history calls finished as FAILED (afterok chains, mails and accounting saw a failure).
    Here the entry's module holds an object whose teardown writes a mark and sleeps; USR2, USR1
    and TERM are sent to the job's tasks then. SLURM's record must be COMPLETED, exit 0."""
    from alpsck.slurm.watch import slurm_record

    conf = tmp_path / "conf"
    conf.mkdir()
    mark = tmp_path / "tearing-down"
    (conf / "slow_teardown.py").write_text(
        "import os, pathlib, time\n\n\n"
        "class SlowTeardown:\n"
        f"    def __del__(self, sleep=time.sleep, mark=pathlib.Path({str(mark)!r}), job=os.environ.get('SLURM_JOB_ID')):\n"
        "        if job:  # in the job, not in submit's check that the entry imports\n"
        "            mark.write_text('tearing down')\n"
        "            sleep(8)\n\n\n"
        "_teardown = SlowTeardown()  # deleted at interpreter shutdown, after the signal handlers are reset\n\n\n"
        "def main(job):\n"
        "    return None\n")
    run = tmp_path / "run"
    job = submit(job_config(conf / "job.yaml", run, steps=10, time="5", entry="slow_teardown:main"))
    wait_for(mark.exists, 180, f"job {job} to finish and tear down", poll=0.1)
    assert events(run)[-1]["event"] == "finished", events(run)
    for sig in ("USR2", "USR1", "TERM"):  # to the tasks of the job's steps, not the batch shell
        subprocess.run(["scancel", f"--signal={sig}", job], timeout=30)
        time.sleep(0.5)
    wait_for(lambda: not in_queue(job), 120, f"job {job} to end", poll=0.5)
    record = wait_for(lambda: slurm_record(job), 60, f"SLURM's record of job {job}")
    assert record == {"state": "COMPLETED", "exit_code": "0:0"}, record
    assert final_state(run) == "finished"


def test_sigalrm_to_the_batch_shell_ends_the_job_and_status_says_how(cluster: None, tmp_path: Path) -> None:
    """Fatal by choice (docs/slurm.md): no final checkpoint, and status reports SLURM's record."""
    run = tmp_path / "run"
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps_for_seconds(300), time="15", every=10**9))
    wait_for(lambda: events(run, "started"), 300, "the job to start")
    subprocess.run(["scancel", "--batch", "--signal=ALRM", job], check=True, timeout=30)
    wait_for(lambda: not in_queue(job), 120, f"job {job} to end", poll=1)
    doc = wait_for(lambda: (d := json.loads(subprocess.run(
        [sys.executable, "-m", "alpsck", "status", str(run), "--json"], capture_output=True, text=True,
        timeout=120).stdout)) and d["state"] not in ("running", "pending") and d, 60, "status to see the end")
    # The job saw SLURM end it (a SIGTERM while COMPLETING, as a scancel gives) and may record a
    # cancel; SLURM's own record says how the batch shell died.
    assert doc["state"] in ("failed", "cancelled") and doc["slurm"] == {"state": "FAILED", "exit_code": "0:14"}, doc
    assert not events(run, "requeued")
    text = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run)], capture_output=True, text=True,
                          timeout=120).stdout
    assert "SLURM: FAILED, exit code 0:14" in text, text


def test_the_same_crash_at_two_starts_ends_the_run_failed_with_the_error(cluster: None, tmp_path: Path) -> None:
    """The first crash may be transient (requeued); the same error again with no checkpoint in
    between is not: the run ends failed at the second start, not after the whole budget. The
    module sits beside the config (no PYTHONPATH), as a user's own training would."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "crash_entry.py").write_text("def crash(job):\n    raise RuntimeError('boom')\n")
    run = tmp_path / "run"
    cfg = job_config(conf / "job.yaml", run, steps=10, time="5", delay=60, entry="crash_entry:crash",
                     max_restarts=5, no_progress=5, requeue_extra="in_job_restarts: 0")  # requeues, not restarts
    job = submit(cfg)
    assert wait_done(run, job, 300) == "failed", events(run)
    fails = events(run, "failed")
    assert [f["will_requeue"] for f in fails] == [True, False] and len(events(run, "requeued")) == 1
    assert "RuntimeError: boom" in fails[-1]["message"] and "same error" in fails[-1]["not_requeued"]
    assert fails[-1]["time"] - events(run, "started")[-1]["time"] < 60
    r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run)], capture_output=True, text=True, timeout=120)
    assert ": failed " in r.stdout and "RuntimeError: boom" in r.stdout, r.stdout


def test_a_job_sbatch_refuses_is_a_one_line_error_naming_sbatchs_reason(cluster: None, tmp_path: Path) -> None:
    cfg = job_config(tmp_path / "job.yaml", tmp_path / "run", steps=10, partition="no-such-partition")
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"alpsck: error: {cfg}: sbatch refused the job: ") and "partition" in last, r.stderr
    assert "Traceback" not in r.stderr
    assert not events(tmp_path / "run", "submitted")


def test_a_second_job_on_a_live_jobs_run_dir_is_refused(cluster: None, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = job_config(tmp_path / "job.yaml", run, steps=10**6, time="15", every=10**9)
    first = submit(cfg)
    try:
        r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"is the run directory of job {first} (" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert [e["job_id"] for e in events(run, "submitted")] == [first]  # nothing else was submitted
        st = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"], capture_output=True,
                            text=True, timeout=120)
        assert st.returncode == 0 and json.loads(st.stdout)["note"] is None, st.stdout + st.stderr  # it is live
    finally:
        subprocess.run(["scancel", first], timeout=30)
    wait_for(lambda: not in_queue(first), 120, f"job {first} to leave the queue", poll=2)
    # Once it is gone, the run directory takes a new job, and submit says which step it resumes from.
    import torch

    import alpsck

    with alpsck.Checkpointer(run, keep_last=0) as ck:  # far beyond any step the cancelled job reached
        ck.save(10**7, {"w": torch.zeros(4)}).wait()
    r = subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg)], capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"resumes from step {10**7}," in r.stdout, r.stdout
    finally:
        second = [e["job_id"] for e in events(run, "submitted")][-1]
        subprocess.run(["scancel", second], timeout=30)


def test_a_job_scancelled_while_pending_shows_cancelled(cluster: None, tmp_path: Path) -> None:
    """Its history holds only "submitted" (no start ever ran): SLURM's own record names the end."""
    run = tmp_path / "run"
    cfg = job_config(tmp_path / "job.yaml", run, steps=10)
    cfg.write_text(cfg.read_text().replace("slurm:\n", "slurm:\n  extra: {begin: now+1hour}\n", 1))
    job = submit(cfg)
    subprocess.run(["scancel", job], check=True, timeout=30)

    def shown() -> dict[str, object] | None:
        r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"], capture_output=True,
                           text=True, timeout=120)
        doc = json.loads(r.stdout)
        return doc if doc["state"] != "pending" else None

    doc = wait_for(shown, 60, "status to see the cancel")
    assert doc["state"] == "cancelled" and doc["slurm"]["state"] == "CANCELLED", doc


def test_status_calls_a_job_slurm_no_longer_knows_failed(cluster: None, tmp_path: Path) -> None:
    # A job that died with its node (or a cluster restarted under it) records no end.
    from alpsck.slurm import history

    history.append(tmp_path, "submitted", job_id="987654321", backend="slurm")
    history.append(tmp_path, "started", job_id="987654321", restart=0)
    r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert ": failed " in r.stdout and "note: job 987654321 no longer exists" in r.stdout, r.stdout
    # An squeue that gives no answer (controller busy or down) proves nothing: no note then.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\n"
                                 "exit 1\n")
    (fake / "squeue").chmod(0o755)
    r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(tmp_path)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert r.returncode == 0 and ": running " in r.stdout and "note:" not in r.stdout, r.stdout + r.stderr


def test_usr1_as_the_time_limit_signal_checkpoints_and_requeues(cluster: None, tmp_path: Path) -> None:
    # The whole path: SLURM sends USR1 (--signal=USR1@60) 33-57 s after the start, the job takes it
    # as the time-limit signal, checkpoints and requeues. (Before, SLURM sent submitit's USR2.)
    run = tmp_path / "run"
    job = submit(job_config(tmp_path / "job.yaml", run, steps=10**6, time="2", delay=60, every=10**9,
                            requeue_extra="signal: USR1"))
    try:
        wait_for(lambda: events(run, "requeued"), 300, "the requeue after the time-limit signal")
        finals = events(run, "final_checkpoint")
        assert finals, f"requeued without alpsck's final checkpoint: {events(run)}"
        final = finals[0]
        assert final["reason"] == "timeout" and isinstance(final["step"], int) and final["step"] > 0, events(run)
        assert events(run, "requeued")[0]["mechanism"] == "scontrol"
        from alpsck import _core

        assert [i["step"] for i in _core.scan(str(run), verify=True) if i["status"] == "committed"] == [final["step"]]
    finally:
        subprocess.run(["scancel", job], timeout=30)


# ---------------------------------------------------------------------------- in-job restarts (#42)

_DIES_ONCE = '''"""The reference training, and once, on the first start of the job step in its allocation, a death: {how}."""
import os
import signal
import threading
import time

from alpsck.examples.llama.train import slurm_entry
from alpsck.store.picker import pick


def main(job):
    if os.environ.get("ALPSCK_ATTEMPT", "0") == "0" and job.rank == {rank}:
        def watch():
            while (pick(job.config.run_dir).step or 0) < {after}:  # once a checkpoint past step {after} is durable
                time.sleep(0.1)
            {action}

        threading.Thread(target=watch, daemon=True).start()
    return slurm_entry(job)
'''


def _dies_once(conf: Path, how: str, action: str, *, rank: int, after: int) -> None:
    conf.mkdir(exist_ok=True)
    (conf / "dies_once.py").write_text(_DIES_ONCE.format(how=how, action=action, rank=rank, after=after))


def test_a_task_sigkilled_mid_run_restarts_in_its_allocation_bit_exact(cluster: None, tmp_path: Path) -> None:
    """Rank 1 of 2 is SIGKILLed once, mid-run: srun ends the step (--kill-on-bad-exit), the batch script
    starts a new one in the same allocation (one job id, no requeue), the new step records the crash and
    resumes from the newest checkpoint, and the losses equal an uninterrupted run's, bit for bit. The entry
    lives in a module beside the config, as a user's would."""
    steps = steps_for_seconds(45)
    conf = tmp_path / "conf"
    _dies_once(conf, "rank 1 SIGKILLs itself", "os.kill(os.getpid(), signal.SIGKILL)", rank=1, after=steps // 3)
    run = tmp_path / "run"
    clean = clean_losses(tmp_path, steps, world=2)
    job = submit(job_config(conf / "job.yaml", run, steps=steps, time="10", every=10, tasks=2,
                            entry="dies_once:main"))
    assert wait_done(run, job, 600) == "finished", events(run)
    evs = events(run)
    assert all(e["job_id"] == job for e in evs) and not events(run, "requeued"), evs
    crashed = events(run, "crashed")
    assert len(crashed) == 1 and crashed[0]["attempt"] == 0, evs
    assert crashed[0]["exit_code"] not in (0, 1, 3), crashed
    starts = events(run, "started")
    assert [s.get("attempt", 0) for s in starts] == [0, 1] and [s["restart"] for s in starts] == [0, 0], starts
    assert starts[1]["step"] is not None and starts[1]["step"] >= steps // 3 and starts[1]["down_s"] < 60, starts
    assert (run / "loss.csv").read_text() == clean
    text = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run)], capture_output=True, text=True,
                          timeout=120).stdout
    assert "crashed" in text and "goodput: ETTR" in text and "restarts: 1 crashed" in text, text
    _check_goodput(run, ["crashed"])


def _check_goodput(run: Path, causes: list[str]) -> None:
    """status --json's goodput: the restarts' causes, each in the allocation within seconds, the parts adding up."""
    doc = json.loads(subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), "--json"], capture_output=True,
                                    text=True, timeout=120).stdout)
    g = doc["goodput"]
    assert [r["cause"] for r in g["restarts"]] == causes, g
    # Within the allocation, and far below a requeue's queue wait: the new step's start-up (two ranks importing
    # torch) takes 10 s on a quiet machine, 40 s beside the rest of CI, and once more than 60 s there (load 14).
    assert all(r["in_allocation"] and 0 < r["restart_s"] < 180 for r in g["restarts"]), g
    from alpsck.slurm.goodput import PARTS

    parts = sum(g[f"{k}_s"] for k in PARTS)
    assert abs(parts - g["wall_s"]) <= 0.01 * g["wall_s"] and 0 < g["ettr"] < 1, g
    # Each restart split (the new step's start, its set-up, restore and first step) and its work lost.
    for r in g["restarts"]:
        split = sum(r.get(k, 0.0) for k in ("teardown_s", "start_s", "setup_s", "restore_s", "first_step_s"))
        assert "first_step_s" in r and abs(split - r["restart_s"]) < 0.01 and r["lost_s"] >= 0, r
    assert [s["outcome"] for s in g["starts"]] == [*causes, "finished"], g


def test_an_exception_restarts_in_the_allocation_and_a_hard_crash_at_every_start_is_bounded(cluster: None,
                                                                                             tmp_path: Path) -> None:
    """An exception once, after a checkpoint: the runner records ``failed`` with ``will_restart`` and the step
    starts again in the allocation (no requeue), finishing bit for bit. A task that exits hard at every start
    (no checkpoint ever) is restarted, and the third start in a row from the same step gives up: the job ends
    with no requeue and no endless loop, whatever ``in_job_restarts`` allows."""
    steps = steps_for_seconds(25)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "raise_once.py").write_text(
        "import os\n\nfrom alpsck.examples.llama.train import slurm_entry\nfrom alpsck.store.picker import pick\n\n\n"
        "def main(job):\n"
        "    if os.environ.get('ALPSCK_ATTEMPT', '0') == '0':\n"
        "        polled = job.stop_requested\n\n"
        "        def stop_requested():  # polled once per step: raises once a checkpoint past a third is durable\n"
        f"            if (pick(job.run_dir).step or 0) >= {steps // 3}:\n"
        "                raise RuntimeError('injected after a checkpoint')\n"
        "            return polled()\n\n"
        "        job.stop_requested = stop_requested\n"
        "    return slurm_entry(job)\n")
    run = tmp_path / "run"
    clean = clean_losses(tmp_path, steps)
    job = submit(job_config(conf / "job.yaml", run, steps=steps, time="10", every=10, entry="raise_once:main"))
    assert wait_done(run, job, 600) == "finished", events(run)
    evs = events(run)
    failed = events(run, "failed")
    assert len(failed) == 1 and failed[0]["will_restart"] is True and failed[0]["will_requeue"] is False, evs
    assert "RuntimeError: injected after a checkpoint" in failed[0]["message"]
    assert not events(run, "requeued") and not events(run, "crashed") and all(e["job_id"] == job for e in evs), evs
    assert [s.get("attempt", 0) for s in events(run, "started")] == [0, 1]
    assert (run / "loss.csv").read_text() == clean
    # A hard exit at every start, before any checkpoint.
    (conf / "hard_exit.py").write_text("import os\n\n\ndef main(job):\n    os._exit(7)\n")
    run2 = tmp_path / "run2"
    job2 = submit(job_config(conf / "job2.yaml", run2, steps=10, time="10", entry="hard_exit:main",
                             requeue_extra="in_job_restarts: 5"))
    assert wait_done(run2, job2, 300) == "gave_up", events(run2)
    starts = events(run2, "started")
    assert [s.get("attempt", 0) for s in starts] == [0, 1, 2, 3], events(run2)
    assert [c["exit_code"] for c in events(run2, "crashed")] == [7, 7, 7], events(run2)
    assert "no progress" in events(run2, "gave_up")[0]["message"] and not events(run2, "requeued")
    # The job's end, as SLURM recorded it: the resiliency extension's "do not requeue" code.
    from alpsck.slurm.watch import slurm_record

    record = wait_for(lambda: slurm_record(job2), 60, "SLURM's record of the job's end")
    assert record == {"state": "FAILED", "exit_code": "93:0"}, record


def test_a_main_thread_blocked_forever_is_a_hang_every_rank_dumps_and_the_step_restarts(cluster: None,
                                                                                         tmp_path: Path) -> None:
    """Rank 0's main thread blocks forever once (after a checkpoint), rank 1 waits for it in a collective:
    both watchdogs see no progress for the step timeout, every rank's threads' stacks reach its log, rank 0
    records ``hang``, the step is ended and restarted in the allocation (one job id, no requeue), and the
    losses equal an uninterrupted run's, bit for bit."""
    steps = steps_for_seconds(40)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "blocks_once.py").write_text(
        "import os\nimport threading\n\nfrom alpsck.examples.llama.train import slurm_entry\n"
        "from alpsck.store.picker import pick\n\n\n"
        "def main(job):\n"
        "    if os.environ.get('ALPSCK_ATTEMPT', '0') == '0' and job.rank == 0:\n"
        "        polled = job.stop_requested\n\n"
        "        def stop_requested():\n"
        f"            if (pick(job.run_dir).step or 0) >= {steps // 3}:\n"
        "                threading.Event().wait()  # blocked forever, in C, holding nothing\n"
        "            return polled()\n\n"
        "        job.stop_requested = stop_requested\n"
        "    return slurm_entry(job)\n")
    run = tmp_path / "run"
    clean = clean_losses(tmp_path, steps, world=2)
    job = submit(job_config(conf / "job.yaml", run, steps=steps, time="10", every=10, tasks=2,
                            entry="blocks_once:main", requeue_extra="hang_timeout_s: 20"))
    assert wait_done(run, job, 600) == "finished", events(run)
    evs = events(run)
    hang = events(run, "hang")
    assert len(hang) == 1 and hang[0]["section"] == "step" and 20 <= hang[0]["seconds"] < 60, evs
    assert not events(run, "requeued") and not events(run, "crashed") and all(e["job_id"] == job for e in evs), evs
    assert [s.get("attempt", 0) for s in events(run, "started")] == [0, 1], evs
    assert (run / "loss.csv").read_text() == clean
    for rank in (0, 1):
        log = (run / "submitit" / f"{job}_{rank}_log.out").read_text()
        assert f"alpsck: rank {rank}: no progress in section 'step'" in log, log[-3000:]
        assert "most recent call first" in log, log[-3000:]
    assert "stop_requested" in (run / "submitit" / f"{job}_0_log.out").read_text()  # where rank 0 blocked
    _check_goodput(run, ["hang"])


def test_every_auto_chooses_the_interval_from_the_measured_save_cost_and_status_shows_why(cluster: None,
                                                                                       tmp_path: Path) -> None:
    """checkpoint.every: auto with an MTBF of 60 s: the job measures what a save costs its loop, records Daly's
    interval (an interval event), checkpoints by it, and finishes with the losses of an uninterrupted run;
    status names the interval and the numbers it came from."""
    steps = steps_for_seconds(20)
    run = tmp_path / "run"
    clean = clean_losses(tmp_path, steps)
    job = submit(job_config(tmp_path / "job.yaml", run, steps=steps, time="10", every=10 ** 6,
                            checkpoint_extra="every: auto\nmtbf_s: 60"))
    assert wait_done(run, job, 600) == "finished", events(run)
    chosen = events(run, "interval")
    assert chosen and chosen[0]["mtbf_s"] == 60 and chosen[0]["mtbf_from"] == "configured", events(run)
    assert 0 <= chosen[0]["save_cost_s"] < 5 and 1 <= chosen[0]["seconds"] <= 60, chosen
    from alpsck import _core

    committed = [i["step"] for i in _core.scan(str(run)) if i["status"] == "committed"]
    assert len(committed) >= 2, committed  # saves by the interval: every_steps (10**6) alone leaves the final one
    assert (run / "loss.csv").read_text() == clean
    text = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run)], capture_output=True, text=True,
                          timeout=120).stdout
    assert "checkpoint interval (every: auto):" in text and "MTBF of 60 s (configured)" in text, text
