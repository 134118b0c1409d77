"""One start of :class:`alpsck.slurm.runner.JobRunner` in a subprocess, as a SLURM job step would run it,
with a stand-in ``scontrol`` on PATH (it answers ``show job`` with the state the case sets and logs every call).
The entries (``ENTRY``) are the cases' trainings."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

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
    STATE.write_text("JobState=CANCELLED\n")      # the user runs scancel while the final save runs
    _signal(signal.SIGTERM)
    return "saved"

def cancelled_then_the_final_save_fails(job):
    STATE.write_text("JobState=CANCELLED\n")
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

def sigterm_stop(job):
    """SIGTERM, whatever the fake scontrol says it means; a checkpoint, then the stop."""
    import torch
    with job.checkpointer() as ck:
        ck.save(5, {"w": torch.ones(3)}).wait()
    _signal(signal.SIGTERM)
    assert job.stop_requested()
    with job.checkpointer() as ck:
        ck.save(6, {"w": torch.ones(3)}).wait()
    return job.stop_reason

def requeued_by_hand_then_crash(job):
    _signal(signal.SIGTERM)                       # scontrol requeue by hand; the loop never polls
    raise RuntimeError("NCCL peer went away")

def restore_damaged(job):
    """Step 2's data is damaged: the start names 2 (what a restore tries first), the restore uses 1."""
    import torch
    with job.checkpointer() as ck:
        got = ck.restore({"w": torch.zeros(4096)})
    assert (job.resume_step, got, job.restored_step) == (2, 1, 1), (job.resume_step, got, job.restored_step)

def memory_then_killed(job):
    """Steps 0..7: the run directory at 0, node memory at 5 (checkpoint.memory_every: 5); SIGKILLed at 7."""
    import torch
    state = {"w": torch.zeros(4096), "step": 0}
    ck = job.checkpointer()
    for step in range(8):
        state["w"] += 1
        state["step"] = step
        due = "run_dir" if step == 0 else job.checkpoint_due(step)
        if due:
            ck.save(step, state, tier=due).wait()
    os.kill(os.getpid(), signal.SIGKILL)

def restore_from_memory(job):
    """The start after memory_then_killed: the run directory's pick is step 0, the memory tier's 5 wins."""
    import torch
    state = {"w": torch.zeros(4096), "step": 0}
    with job.checkpointer() as ck:
        got = ck.restore(state)
        tier = ck.restored_tier
    assert (job.resume_step, got, job.restored_step, tier) == (0, 5, 5, "memory"), (job.resume_step, got, tier)
    assert float(state["w"][0]) == 6.0 and state["step"] == 5

def interrupted(job):
    _signal(signal.SIGINT)                        # scancel --signal=INT: KeyboardInterrupt
    time.sleep(1)
'''


def run_start(tmp_path: Path, entry: str, *, local: bool = False, extra: str = "", fields: str = "JobState=RUNNING",
         env_extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]], str]:
    """Run one start of ``entry``; the fake scontrol answers ``show job`` with ``fields`` (until the
    entry changes them)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    log, state = tmp_path / "scontrol.log", tmp_path / "state"
    state.write_text(fields + "\n")
    scontrol = fake / "scontrol"
    scontrol.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$1 $2" in
  "show job") echo "JobId=$4 JobName=t $(cat {state}) EndTime=2099-01-01T00:00:00";;
  "show reservation") echo "No reservations in the system";;
esac
exit 0
""")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "runner_entry.py").write_text(ENTRY)
    run = tmp_path / "run"
    cfg = (f"name: t\nrun_dir: {run}\nentry:\n  function: runner_entry:{entry}\n"
           f"requeue:\n  on_maintenance: false\n{extra}")
    if "hang_timeout_s" not in extra:  # the runner's logic alone (the watchdog: test_in_job_restart.py)
        cfg += "  hang_timeout_s: 0\n"
    # SIGINT as in an srun task: Python's KeyboardInterrupt. A job started in the background by a
    # non-interactive shell (a CI runner's `cmd &`) inherits SIGINT ignored, and Python then leaves
    # it ignored: the interrupt scenario would not be one.
    code = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from alpsck.slurm.config import parse_config\nfrom alpsck.slurm.runner import JobRunner\n"
            "JobRunner(parse_config(sys.argv[1]))()\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SUBMITIT_"))}
    env.update({"PATH": f"{fake}{os.pathsep}{env['PATH']}", "FAKE_SLURM_STATE": str(state),
                "PYTHONPATH": os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])})
    env.update({"SUBMITIT_LOCAL_JOB_ID": "L1"} if local else {"SLURM_JOB_ID": "999"})
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", code, cfg], env=env, capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    return r, history.read(run), log.read_text() if log.exists() else ""
