"""The requeue cycle without a cluster: submitit's local executor (the embedded default), and
the runner's decisions (finish, requeue, cancel, give up) in this process on real signals, with
the job state scontrol would report set by the test (fast)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.slurm_helpers import clean_losses, events, final_state, job_config, steps_for_seconds

from alpsck.slurm import history
from alpsck.slurm import stop as stop_mod
from alpsck.slurm.config import parse_config
from alpsck.slurm.context import JobContext
from alpsck.slurm.runner import JobRunner
from alpsck.slurm.stop import StopController


@pytest.fixture
def handlers() -> Iterator[None]:
    """The runner installs its own SIGTERM/USR handlers in this process: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _send(stop: StopController, sig: int) -> None:
    """Signal this process and wait until the handler recorded it (it runs between bytecodes)."""
    n = len(stop._signals)
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 10
    while len(stop._signals) == n:
        assert time.monotonic() < deadline, f"signal {sig} never reached the handler"
        time.sleep(0.001)


class _Job:
    """JobRunner on an entry function, in this process: ``state`` is what scontrol reports for the
    job (SLURM's COMPLETING/CANCELLED after scancel), and a requeue is recorded, not executed."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: Callable[[JobContext], Any], *,
                 local: bool = False, requeue: str = "") -> None:
        self.run_dir = tmp_path / "run"
        self.state = "RUNNING"
        self.reason = "None"
        self.restarts = 0
        self.requeues: list[str] = []
        for k in [k for k in os.environ if k.startswith(("SLURM_", "SUBMITIT_"))]:
            monkeypatch.delenv(k)
        monkeypatch.setenv("ALPSCK_NO_SCONTROL", "1")  # nothing reaches a real cluster
        monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID" if local else "SLURM_JOB_ID", "L1" if local else "999")
        self.end_time: str | None = None  # scontrol's EndTime, when a test sets it
        monkeypatch.setattr(stop_mod, "job_fields", lambda job_id, run=None: {
            "JobState": self.state, "Reason": self.reason, "Restarts": str(self.restarts),
            **({"EndTime": self.end_time} if self.end_time else {})})
        monkeypatch.setattr(JobRunner, "_requeue", lambda runner, reason, step, **kw: self.requeues.append(reason))
        # A restart in the allocation ends the process (exit 75): recorded here instead, never run in pytest's.
        monkeypatch.setattr(JobRunner, "_restart_here", lambda runner, ctx, step: self.requeues.append("in-job restart"))
        module = types.ModuleType("alpsck_test_entry")
        module.main = entry  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "alpsck_test_entry", module)
        self.config = parse_config(f"name: t\nrun_dir: {self.run_dir}\nentry:\n  function: alpsck_test_entry:main\n"
                                   f"requeue:\n  on_maintenance: false\n  hang_timeout_s: 0\n{requeue}")

    def __call__(self) -> int:
        """Run one start; the exit code it would end with (0, or 1 from SystemExit)."""
        try:
            JobRunner(self.config)()
        except SystemExit as e:
            return int(e.code or 0)
        return 0

    def events(self) -> list[str]:
        return [e["event"] for e in history.read(self.run_dir)]


def test_a_scancel_during_the_final_checkpoint_is_a_cancel_not_a_requeue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handlers: None) -> None:
    def entry(ctx: JobContext) -> str:
        _send(ctx.stop, signal.SIGUSR2)  # the time limit approaches
        assert ctx.stop_requested() and ctx.stop_reason == "timeout"
        job.state = "CANCELLED"          # the user runs scancel while the final checkpoint is written
        _send(ctx.stop, signal.SIGTERM)
        return "saved"

    job = _Job(tmp_path, monkeypatch, entry)
    assert job() == 0
    assert job.requeues == [] and job.events()[-1] == "cancelled"
    assert events(job.run_dir, "final_checkpoint")[0]["reason"] == "cancel"


def test_a_stop_signal_another_rank_took_first_is_a_stop_on_rank_0_too(handlers: None) -> None:
    """Two ranks agree on each step's stop: rank 1 polled after the time-limit signal came, rank 0 just
    before it, and then waited in the agreement that stopped them both, never polling again. Rank 0's
    entry returns early with a signal it never answered: with peers that is the stop (CI once saw a
    2-rank run called finished at step 301 of 600); alone, the loop would have polled it."""
    for peers, want in ((True, "timeout"), (False, None)):
        stop = StopController("4242", timeout_signal="USR1", slurm=False)
        stop.install()
        assert not stop.requested()  # the poll before the signal
        _send(stop, signal.SIGUSR1)
        assert stop.settle(peers=peers) == want
        stop.close()


def test_a_signal_the_launcher_recorded_before_the_handlers_is_a_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handlers: None) -> None:
    """The time-limit signal came while submitit was still unpickling (alpsck.slurm.launch kept
    it): the loop sees the stop at its first poll, and the runner requeues."""
    monkeypatch.setattr(sys, "_alpsck_early_signals", [(int(signal.SIGUSR1), time.time()),
                                                       (int(signal.SIGUSR2), time.time())], raising=False)

    def entry(ctx: JobContext) -> int:
        assert ctx.stop_requested() and ctx.stop_reason == "timeout"
        return 0

    job = _Job(tmp_path, monkeypatch, entry)
    assert job() == 0
    assert job.requeues == ["timeout"] and sys._alpsck_early_signals == []  # type: ignore[attr-defined]


def test_a_later_sigterm_that_is_a_preemption_keeps_the_stop_a_requeue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handlers: None) -> None:
    def entry(ctx: JobContext) -> str:
        _send(ctx.stop, signal.SIGUSR2)
        assert ctx.stop_requested()
        _send(ctx.stop, signal.SIGTERM)  # the job stays RUNNING: preemption's grace signal, not scancel
        return "saved"

    job = _Job(tmp_path, monkeypatch, entry)
    assert job() == 0
    assert job.requeues == ["timeout"]


@pytest.mark.parametrize("seen", [True, False], ids=["loop-saw-the-cancel", "loop-never-polled"])
def test_a_job_that_fails_after_scancel_is_not_requeued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        handlers: None, seen: bool) -> None:
    """The final save failed (disk full), or a peer rank went away, after the user's scancel."""
    def entry(ctx: JobContext) -> str:
        job.state = "CANCELLED"
        _send(ctx.stop, signal.SIGTERM)
        if seen:
            assert ctx.stop_requested() and ctx.stop_reason == "cancel"
        raise OSError(28, "No space left on device")

    job = _Job(tmp_path, monkeypatch, entry)
    assert job() == 1
    failed = events(job.run_dir, "failed")[-1]
    assert job.requeues == [] and failed["will_requeue"] is False and failed["cancelled"] is True
    assert final_state(job.run_dir) == "failed"


def test_a_failure_without_a_cancel_is_still_requeued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      handlers: None) -> None:
    def entry(ctx: JobContext) -> str:
        _send(ctx.stop, signal.SIGTERM)  # preemption (the job stays RUNNING), then a crash
        raise RuntimeError("boom")

    # A restart in the allocation first (SLURM shows a step's own end and a preemption's grace time alike).
    job = _Job(tmp_path, monkeypatch, entry)
    job()
    assert job.requeues == ["in-job restart"] and events(job.run_dir, "failed")[-1]["will_restart"] is True
    # Without restarts in the allocation: requeued.
    (tmp_path / "norestart").mkdir()
    job = _Job(tmp_path / "norestart", monkeypatch, entry, requeue="  in_job_restarts: 0\n")
    job()
    assert job.requeues == ["failure"] and events(job.run_dir, "failed")[-1]["will_requeue"] is True


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_stop_the_loop_never_saw_leaves_a_finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         handlers: None, restarts: int) -> None:
    """The time-limit signal came during the last step: job.steps() ended without polling again,
    so the run is complete, whatever restarts are left (none: it used to give up, exit 1)."""
    def entry(ctx: JobContext) -> str:
        for step in ctx.steps(0, 3):
            if step == 2:
                _send(ctx.stop, signal.SIGUSR2)
        return "trained all 3 steps"

    job = _Job(tmp_path, monkeypatch, entry, requeue=f"  max_restarts: {restarts}\n")
    assert job() == 0
    assert job.events() == ["started", "finished"] and job.requeues == []


def test_a_stop_the_loop_saw_takes_a_final_checkpoint_and_requeues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   handlers: None) -> None:
    def entry(ctx: JobContext) -> int:
        last = -1
        for step in ctx.steps(0, 1000):
            last = step
            if step == 2:
                _send(ctx.stop, signal.SIGUSR2)
        return last

    job = _Job(tmp_path, monkeypatch, entry)
    assert job() == 0
    assert job.events() == ["started", "signal", "final_checkpoint"] and job.requeues == ["timeout"]


@pytest.mark.parametrize("saves", [True, False], ids=["progress", "no-progress"])
def test_a_stop_after_progress_is_requeued_whatever_the_restarts_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handlers: None, saves: bool) -> None:
    """Six earlier time-limit requeues that each advanced the checkpoint (free), max_restarts 1: a
    seventh stop is requeued when this start committed a newer step too; a stop with no newer
    checkpoint is charged, and a second charged start is past the budget (gave_up)."""
    import torch

    def entry(ctx: JobContext) -> None:
        if saves:
            with ctx.checkpointer() as ck:
                ck.save(7, {"x": torch.zeros(4)}).wait()
        _send(ctx.stop, signal.SIGUSR2)
        assert ctx.stop_requested()

    job = _Job(tmp_path, monkeypatch, entry, local=True, requeue="  max_restarts: 1\n  give_up_after_no_progress: 50\n")
    history.append(job.run_dir, "started", job_id="L1", restart=0)
    history.append(job.run_dir, "requeued", job_id="L1", reason="timeout", step=None, progress=False)  # charged
    for i in range(6):
        history.append(job.run_dir, "started", job_id="L1", restart=i + 1, step=i)
        history.append(job.run_dir, "requeued", job_id="L1", reason="timeout", step=i + 1, progress=True)
    rc = job()
    if saves:
        assert rc == 0 and job.requeues == ["timeout"], job.events()
    else:
        assert rc == 93 and job.requeues == [] and job.events()[-1] == "gave_up"  # NVRx's "do not requeue"
        assert "requeue.max_restarts is 1" in events(job.run_dir, "gave_up")[-1]["message"]


def _submit_local(cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alpsck", "submit", str(cfg), "--local"], capture_output=True,
                          text=True, timeout=600)


def test_local_executor_timeout_requeue_cycle_is_bit_exact(tmp_path: Path) -> None:
    # 1-minute limit, signal 30 s before it: each start trains at most 30 s (less its start-up, which
    # under CI's load took up to 30 s with a 20 s window: no progress), so 75 s of paced steps need at
    # least 3 starts: >= 2 requeues, and at most 5 (submitit's local executor restarts a task at most 5
    # times). USR1, not the default USR2: submitit's local controller must be told which signal to send.
    steps = steps_for_seconds(75)
    cfg = job_config(tmp_path / "job.yaml", tmp_path / "run", steps=steps, time="1", delay=30, every=max(50, steps // 20),
                     requeue_extra="signal: USR1")
    r = _submit_local(cfg)
    assert r.returncode == 0, r.stdout + r.stderr
    assert final_state(tmp_path / "run") == "finished"
    requeues = events(tmp_path / "run", "requeued")
    assert len(requeues) >= 2, events(tmp_path / "run")
    assert all(e["reason"] == "timeout" and e["mechanism"] == "local" for e in requeues)
    finals = events(tmp_path / "run", "final_checkpoint")
    assert len(finals) == len(requeues) and all(isinstance(e["step"], int) for e in finals)
    starts = events(tmp_path / "run", "started")
    assert [s.get("step") for s in starts[1:]] == [f["step"] for f in finals]  # each start resumed the final one
    assert (tmp_path / "run" / "loss.csv").read_text() == clean_losses(tmp_path, steps)


def _user_layout(tmp_path: Path, module: str, yaml_tail: str = "") -> tuple[Path, Path, Path]:
    """A user's layout: ``conf/job.yaml`` with ``conf/mytrain.py`` beside it, submitted from
    ``work/``, which holds a source tree named ``alpsck`` without the compiled core (a checkout,
    as the README's quickstart is run from). (work dir, config, run dir)"""
    work, conf = tmp_path / "work", tmp_path / "conf"
    (work / "alpsck").mkdir(parents=True)
    (work / "alpsck" / "__init__.py").write_text("raise ImportError('the source tree was imported, not the install')\n")
    conf.mkdir()
    (conf / "mytrain.py").write_text("import alpsck  # the installed one, whatever the working directory holds\n" + module)
    cfg = conf / "job.yaml"
    cfg.write_text(f"name: user\nrun_dir: run\nslurm:\n  time: '1'\nentry:\n  function: mytrain:main\n"
                   f"requeue:\n  signal_delay_s: 20\n  on_maintenance: false\n{yaml_tail}")
    return work, cfg, work / "run"


def _alpsck(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The installed ``alpsck`` command (``python -m alpsck`` would import ``cwd``'s source tree:
    that is Python's rule for ``-m``, which no package can change), with no PYTHONPATH."""
    script = Path(sys.executable).parent / "alpsck"
    assert script.is_file(), f"{script}: the console script is not installed (pip install .)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_a_module_beside_the_config_runs_from_a_directory_holding_an_alpsck_source_tree(tmp_path: Path) -> None:
    """The job imports the installed alpsck (the working directory's alpsck/ raises on import) and
    the user's mytrain.py beside the config, with no PYTHONPATH."""
    work, cfg, run = _user_layout(tmp_path, "import os\n\ndef main(job):\n"
                                            "    open(os.path.join(job.run_dir, 'ran'), 'w').write(os.getcwd())\n")
    r = _alpsck(["submit", str(cfg), "--local"], work)
    assert r.returncode == 0, r.stdout + r.stderr
    assert final_state(run) == "finished" and (run / "ran").read_text() == str(work)  # the job runs where submit ran
    assert f"run dir: {run}" in r.stdout and "ended: finished" in r.stdout
    again = _alpsck(["submit", str(cfg), "--local"], work)  # a finished run: nothing would happen
    assert again.returncode == 2 and "this run has finished" in again.stderr and "--continue" in again.stderr
    assert len(events(run, "submitted")) == 1
    again = _alpsck(["submit", str(cfg), "--local", "--continue"], work)
    assert again.returncode == 0 and len(events(run, "submitted")) == 2, again.stdout + again.stderr


def test_an_entry_that_raises_at_every_start_ends_failed_showing_the_error(tmp_path: Path) -> None:
    work, cfg, run = _user_layout(tmp_path, "def main(job):\n    raise RuntimeError('boom at start')\n")
    r = _alpsck(["submit", str(cfg), "--local"], work)
    assert r.returncode == 1, r.stdout + r.stderr
    assert final_state(run) == "failed" and "RuntimeError: boom at start" in r.stdout, r.stdout
    fails = events(run, "failed")
    assert [f["will_requeue"] for f in fails] == [True, False]  # the same error twice: not worth a third start
    assert fails[-1]["time"] - events(run, "started")[-1]["time"] < 60
    import json

    doc = json.loads(_alpsck(["status", str(run), "--json"], work, 120).stdout)
    assert doc["state"] == "failed" and any("boom at start" in line for line in doc["log_tail"])


def test_an_entry_that_does_not_import_is_refused_at_submit_or_fails_at_its_first_start(tmp_path: Path) -> None:
    work, cfg, run = _user_layout(tmp_path, "import no_such_module_here\n\ndef main(job):\n    pass\n")
    r = _alpsck(["submit", str(cfg), "--local"], work)
    assert r.returncode == 2 and not run.exists(), r.stdout + r.stderr
    assert "entry.function: mytrain:main does not import" in r.stderr and "no_such_module_here" in r.stderr
    r = _alpsck(["submit", str(cfg), "--local", "--no-check"], work)
    assert r.returncode == 1 and final_state(run) == "failed", r.stdout + r.stderr
    fails = events(run, "failed")
    assert len(fails) == 1 and "ModuleNotFoundError" in fails[0]["message"] and "no_such_module_here" in r.stdout
    assert len(events(run, "started")) == 1


def test_a_job_that_dies_before_it_starts_is_reported_failed_not_pending(tmp_path: Path) -> None:
    """A setup line that exits: the job never reaches the runner, so it records nothing itself."""
    work, cfg, run = _user_layout(tmp_path, "def main(job):\n    pass\n",
                                  "environment:\n  setup: ['echo no GPU on this node >&2; exit 7']\n")
    r = _alpsck(["submit", str(cfg), "--local", "--no-check"], work)
    assert r.returncode == 1 and "ended: failed" in r.stdout and "no GPU on this node" in r.stdout, r.stdout
    assert final_state(run) == "failed" and events(run, "failed")[-1]["recorded_by"] == "alpsck submit"
    st = _alpsck(["status", str(run)], work, 120)
    assert ": failed " in st.stdout, st.stdout


_ENV_ENTRY = """\
import json, os, sys

def main(ctx):
    keys = ("VIRTUAL_ENV", "ALPSCK_SETUP_WORDS", "ALPSCK_SETUP_SAW_VENV", "CUDA_VISIBLE_DEVICES", "PATH")
    doc = {k: os.environ.get(k) for k in keys}
    doc["python"] = sys.executable
    with open(os.path.join(ctx.run_dir, "job-env.json"), "w") as f:
        json.dump(doc, f)
"""


def _submit_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, yaml_tail: str) -> tuple[Path, str]:
    """Submit a job that records its environment through the local executor, in this process (no
    CLI); wait for it. (run dir, the job's log)."""
    from alpsck.slurm.submit import submit

    (tmp_path / "alpsck_env_entry.py").write_text(_ENV_ENTRY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    for k in ("VIRTUAL_ENV", "ALPSCK_SETUP_WORDS", "ALPSCK_SETUP_SAW_VENV"):
        monkeypatch.delenv(k, raising=False)
    run_dir = tmp_path / "run"
    cfg = parse_config(f"name: env\nrun_dir: {run_dir}\nentry:\n  function: alpsck_env_entry:main\n{yaml_tail}",
                       source="env.yaml")
    job = submit(cfg, local=True)
    deadline = time.monotonic() + 300
    while not job.done():
        assert time.monotonic() < deadline, "the local job never ended"
        time.sleep(0.2)
    log = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_log.out"))
    assert final_state(run_dir) == "finished", log
    return run_dir, log


def test_the_local_executor_runs_the_venv_and_setup_lines_before_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the batch script does: bash activates environment.venv, then runs environment.setup
    verbatim (a comment, quotes, a failing line), and what they export reaches the job; the job
    sees slurm.gpus_per_node GPUs. The local executor ignored all three (and hid every GPU)."""
    import json

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    run_dir, log = _submit_in_process(tmp_path, monkeypatch, (
        "slurm:\n  gpus_per_node: 2\nenvironment:\n"
        f"  venv: {venv}\n"
        "  setup:\n"
        "    - '# a comment line: the lines after it run too'\n"
        "    - export ALPSCK_SETUP_WORDS=\"two 'quoted' words\"\n"
        "    - 'false'\n"
        "    - export ALPSCK_SETUP_SAW_VENV=\"$VIRTUAL_ENV\"\n"))
    env = json.loads((run_dir / "job-env.json").read_text())
    assert env["VIRTUAL_ENV"] == str(venv) and env["ALPSCK_SETUP_SAW_VENV"] == str(venv), log
    assert env["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    assert env["ALPSCK_SETUP_WORDS"] == "two 'quoted' words"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["python"] == sys.executable  # the submitting Python, as in the batch script's command


def test_the_local_executor_warns_about_the_container_and_uenv_it_cannot_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _submit_in_process(tmp_path, monkeypatch, "environment:\n  container: /edf/pytorch.toml\n  uenv: prgenv/24.7\n")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "alpsck: warning: env.yaml: environment.container (/edf/pytorch.toml) is not used by the local executor: "
        "the job runs on this machine, outside the container",
        "alpsck: warning: env.yaml: environment.uenv (prgenv/24.7) is not used by the local executor: the job runs "
        "on this machine, outside the uenv"]


_REQUEUE_CHILD = """
import sys
from alpsck.job_env import JobEnv
from alpsck.slurm.config import parse_config
from alpsck.slurm.runner import JobRunner
from alpsck.slurm.stop import StopController

run_dir = sys.argv[1]
runner = JobRunner(parse_config(f"name: t\\nrun_dir: {run_dir}\\nentry:\\n  function: m:f\\n"))
runner._job = JobEnv.detect()  # as __call__ does at the start
runner._job_id = runner._job.job_id  # rank 0 of job 4242 records its events (JobRunner._log)
runner._stop = StopController("4242", slurm_restarts=0)
runner._stop.install()
runner._stop.request("timeout")
runner._requeue("timeout", 7, progress=True)
"""


@pytest.mark.parametrize("signals", ["kill -TERM $PPID", "kill -TERM $PPID $$; sleep 0.2", "kill -TERM $PPID; kill -KILL $$"],
                         ids=["term-after-exit", "term-before-exit", "scontrol-killed-after-it-took-effect"])
def test_a_requeue_that_slurm_answers_with_sigterm_is_recorded_as_the_runners(tmp_path: Path, signals: str) -> None:
    """A successful ``scontrol requeue`` makes SLURM send SIGTERM to the job's processes, scontrol
    included, often before it has exited. Seen on the real cluster: the runner took that for a
    failed requeue and fell back to the batch script's request. The stand-in scontrol does what
    SLURM does: raises the restart count, then SIGTERMs the runner and itself, then exits 0. One
    that dies anyway (SIGKILL cannot be ignored) took effect too: the restart count says so."""
    bin_dir, run_dir = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    run_dir.mkdir()
    restarts = tmp_path / "restarts"
    restarts.write_text("0")
    (bin_dir / "scontrol").write_text(f"""#!/bin/sh
case "$1" in
  requeue) [ "$2" = 4242 ] || exit 9; echo 1 > '{restarts}'; {signals}; exit 0;;
  show) echo "JobId=4242 JobState=COMPLETING Reason=None Restarts=$(cat '{restarts}')"; exit 0;;
esac
exit 1
""")
    (bin_dir / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "ALPSCK_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="4242")
    proc = subprocess.run([sys.executable, "-c", _REQUEUE_CHILD, str(run_dir)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    requeued = [e for e in history.read(run_dir) if e["event"] == "requeued"]
    assert [(e["reason"], e["mechanism"], e["step"], e["progress"]) for e in requeued] == [
        ("timeout", "scontrol", 7, True)], proc.stderr
    assert not (run_dir / ".requeue-request").exists() and "asking the batch script" not in proc.stderr


@pytest.mark.parametrize("left_s", [30, 3600])
def test_a_restart_in_the_allocation_past_the_signal_stops_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    handlers: None, left_s: int) -> None:
    """The time-limit signal comes once, to the job step running then: a step restarted in the allocation after
    that point (30 s left, the signal comes 60 s before the end) stops at its first poll, with a final
    checkpoint and the requeue, as if the signal had reached it; with an hour left it trains."""
    import datetime as dt

    def entry(ctx: JobContext) -> str:
        return "stopped" if ctx.stop_requested() else "trained"

    monkeypatch.setenv("ALPSCK_ATTEMPT", "1")
    monkeypatch.setenv("ALPSCK_PREVIOUS_EXIT", "137")
    job = _Job(tmp_path, monkeypatch, entry, requeue="  signal_delay_s: 60\n")
    job.end_time = (dt.datetime.now() + dt.timedelta(seconds=left_s)).strftime("%Y-%m-%dT%H:%M:%S")
    job()
    if left_s < 60:
        assert job.requeues == ["timeout"] and "final_checkpoint" in job.events(), job.events()
    else:
        assert job.requeues == [] and job.events()[-1] == "finished", job.events()


@pytest.mark.parametrize("limit", [1, 0])
def test_reference_training_rolls_back_under_the_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        handlers: None, limit: int) -> None:
    """The reference training under the runner with a NaN loss at step 6 (checkpoints every 4 steps): with
    one rollback allowed the history shows ``rollback`` (to step 4, from 6) and the run finishes; with none
    allowed the job ends ``gave_up``, exit 93 (do not requeue), its message naming max_rollbacks."""
    from alpsck.examples.llama.train import slurm_entry

    job = _Job(tmp_path, monkeypatch, slurm_entry, local=True)
    job.config.checkpoint.every_steps = 4
    job.config.entry.args = ["--dim", "32", "--n-layers", "1", "--n-heads", "4", "--n-kv-heads", "2",
                             "--multiple-of", "32", "--sequence-length", "16", "--batch-size", "4",
                             "--training-steps", "8", "--warmup-steps", "2",
                             "--log-every", "0", "--device", "cpu", "--nan-at-step", "6",
                             "--max-rollbacks", str(limit)]
    rc = job()
    rollbacks = events(job.run_dir, "rollback")
    if limit:
        assert rc == 0 and final_state(job.run_dir) == "finished", job.events()
        assert [(e["step"], e["from_step"], e["reason"], e["skip"]) for e in rollbacks] == [(4, 6, "loss is nan", 2)]
    else:
        assert rc == 93 and job.requeues == [] and job.events()[-1] == "gave_up" and rollbacks == []
        assert "max_rollbacks (0)" in events(job.run_dir, "gave_up")[-1]["message"]
