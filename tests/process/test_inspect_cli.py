"""The inspection tools (inspect, prune, status, verify) as child processes: what only a real process shows (a
reader that goes away, signals, exit codes); the in-process cases are tests/unit/test_inspect.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.inspect_runs import prunable_run, run_cli, run_listing, save_steps, shard_of

from alpsck import _core


def test_permission_denied_for_real(tmp_path: Path) -> None:
    """A run dir the user cannot read (as root, CI's user: without the capabilities that bypass permissions)."""
    run = tmp_path / "run"
    save_steps(run, [1])
    cmd = [sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run)]
    if os.geteuid() == 0:
        assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's permission bypass"
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    run.chmod(0)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        run.chmod(0o755)
    assert r.returncode == 2 and "permission denied" in r.stderr and str(run) in r.stderr, r.stderr


def _without_root_bypass(cmd: list[str]) -> list[str]:
    if os.geteuid() == 0:
        assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop root's permission bypass"
        return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *cmd]
    return cmd


def test_prune_never_removes_a_checkpoint_it_only_could_not_read(tmp_path: Path) -> None:
    """Permission denied (or EIO, ESTALE) says nothing about the bytes: the checkpoint is
    "unreadable", kept by prune with a warning, and not counted as one of the newest K."""
    run = tmp_path / "run"
    save_steps(run, [10, 20, 30, 40])
    shard = shard_of(run, 30)
    shard.chmod(0)
    try:
        r = subprocess.run(_without_root_bypass([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "2"]),
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
        listing = subprocess.run(_without_root_bypass([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(run),
                                                       "--json"]), capture_output=True, text=True, timeout=120,
                                 cwd=tmp_path)
    finally:
        shard.chmod(0o644)
    assert r.returncode == 0, r.stderr
    assert "kept unreadable checkpoint" in r.stderr + r.stdout and "ermission denied" in r.stderr + r.stdout
    assert shard.exists()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step-")) == [
        "step-000000020", "step-000000030", "step-000000040"]
    doc = json.loads(listing.stdout)
    assert {c["step"]: c["status"] for c in doc["checkpoints"]} == {20: "committed", 30: "unreadable",
                                                                     40: "committed"}


def test_prune_that_cannot_delete_says_so_and_the_next_one_finishes(tmp_path: Path) -> None:
    """The run-directory unit removes (RemoveEntries): a checkpoint whose files cannot be deleted
    is expired all the same (renamed to .deleting-*, gone from scans), the error names it, exit 2;
    once its permissions are fixed the next prune finishes it."""
    run = tmp_path / "run"
    save_steps(run, [10, 20, 30])
    stuck = run / "step-000000010"
    stuck.chmod(0o555)
    try:
        r = subprocess.run(_without_root_bypass([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "1"]),
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        for p in run.iterdir():
            if p.name.endswith("step-000000010"):
                p.chmod(0o755)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "permission denied (cannot delete it)" in r.stderr and ".deleting-step-000000010" in r.stderr, r.stderr
    assert f"removed {run / 'step-000000020'}" in r.stdout  # the others are removed all the same
    assert [i["step"] for i in _core.scan(str(run))] == [30]  # step 10 expired at once: no longer a checkpoint
    assert sorted(p.name for p in run.iterdir() if p.name != ".lock") == [
        ".deleting-step-000000010", "LATEST", "step-000000030"]
    r = subprocess.run([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "1"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in run.iterdir() if p.name != ".lock") == ["LATEST", "step-000000030"]


def test_an_exception_in_the_verify_progress_callback_is_raised_not_aborting(tmp_path: Path) -> None:
    """Ctrl-C at the terminal during --verify: the callback's KeyboardInterrupt used to unwind through
    the reader threads (std::terminate, SIGABRT). It now cancels the scan and is raised."""
    run = tmp_path / "run"
    save_steps(run, [1, 2, 3], n=200_000)
    code = ("import sys; from alpsck import _core\n"
            "def cb(done):\n    raise KeyboardInterrupt\n"
            "try:\n    _core.scan(sys.argv[1], verify=True, threads=2, progress=cb)\n"
            "except KeyboardInterrupt:\n    print('interrupted')\n")
    r = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "interrupted", (r.returncode, r.stderr)
    calls: list[int] = []

    def stop_after_two(done: int) -> None:
        calls.append(done)
        if len(calls) == 2:
            raise ValueError("enough")

    with pytest.raises(ValueError, match="enough"):
        _core.scan(str(run), verify=True, threads=2, progress=stop_after_two)
    assert len(calls) == 2  # no further call once it raised
    assert [i["status"] for i in _core.scan(str(run), verify=True)] == ["committed"] * 3


def test_commands_are_registered_with_the_cli() -> None:
    r = subprocess.run([sys.executable, "-m", "alpsck", "prune", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--keep-last" in r.stdout


def test_prune_refuses_while_a_live_checkpointer_holds_the_run_dir(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prunable_run(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time, alpsck; c = alpsck.Checkpointer(sys.argv[1]); "
                               "print('ok', flush=True); time.sleep(60)", str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "SLURM_JOB_ID": "77"})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        before = run_listing(tmp_path)  # (opening a writer recycles abandoned .tmp dirs)
        rc, _, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2
    assert f"pid {holder.pid}, job 77" in err and str(tmp_path / ".lock") in err
    assert run_listing(tmp_path) == before
    rc, _, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")  # the killed writer's lock is stale
    assert rc == 0, err


def test_prune_lock_of_a_dead_pid_or_other_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_steps(tmp_path, [1, 2])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / ".lock").write_text(json.dumps({"pid": dead.pid, "host": "no-such-node-x", "job_id": 5}))
    rc, _, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert rc == 2 and "no-such-node-x" in err  # another host's pid cannot be checked from here
    (tmp_path / ".lock").write_text(f"pid={dead.pid}\n")
    rc, _, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert rc == 0, err
    assert run_listing(tmp_path) == ["LATEST", "step-000000002"]
