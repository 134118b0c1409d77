"""One writer per run directory, probed from a child process; the in-process cases are tests/unit/test_writers.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from alpsck import _core
from alpsck.errors import UsageError


@pytest.mark.parametrize("kind", ["symlink", "dangling-symlink", "fifo", "directory"])
def test_a_lock_name_that_is_not_a_regular_file_is_refused_at_once_and_nothing_outside_changes(
        tmp_path: Path, kind: str) -> None:
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.write_text("sentinel")
    lock = run / ".lock"
    if kind == "symlink":
        lock.symlink_to(outside)
    elif kind == "dangling-symlink":
        lock.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.mkdir()
    # In a child with a deadline: a FIFO opened for the lock used to block forever. 90 s, not 30: in CI (run of
    # 2e583be, beside the other lanes) a child had printed its refusal and still not exited (torch's import and
    # teardown) at 30 s; here it takes 2 s.
    code = ("import sys, alpsck\n"
            "from alpsck.errors import UsageError\n"
            "try:\n    alpsck.Checkpointer(sys.argv[1])\nexcept UsageError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and ".lock" in out.stdout and "not alpsck's lock file" in out.stdout, out.stdout
    prune = subprocess.run([sys.executable, "-m", "alpsck", "prune", str(run), "--keep-last", "1"],
                           capture_output=True, text=True, timeout=30)
    assert prune.returncode == 2, prune
    assert outside.read_text() == "sentinel"
    assert not (tmp_path / "nowhere").exists()
    with pytest.raises(UsageError):
        _core.probe_lock(str(run))
