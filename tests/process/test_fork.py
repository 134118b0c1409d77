"""A forked child (a DataLoader worker, a multiprocessing child) and the parent's Checkpointer.

A child that calls the parent's Checkpointer gets a UsageError that says so and touches nothing
on disk; close() there lets go without waiting for the parent's saves. That the child does not
inherit the staging memory at all is tests/unit/test_staging_memory.py's.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck.errors import RunDirLockedError, UsageError


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g)}


def _wait_child(pid: int, timeout: float = 60.0) -> int:
    """The child's exit status; kills it and fails when it is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child hung for {timeout:.0f} s")


def test_a_forked_child_is_refused_by_name_and_its_close_lets_go(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = _state()
    ck = alpsck.Checkpointer(run, keep_last=5)
    ck.save(1, state).wait()
    in_flight = ck.save(2, state)  # may still be written while the child runs
    pid = os.fork()
    if pid == 0:  # the child: report by exit code, never return into pytest
        code = 10
        try:
            for call in (lambda: ck.save(3, state), lambda: ck.restore(_state(1)), ck.wait,
                         lambda: ck.prepare(state)):
                code += 1
                try:
                    call()
                except UsageError as e:
                    assert "is a fork of it" in str(e), str(e)
                else:
                    raise AssertionError("the parent's checkpointer worked in a forked child")
            code = 20
            ck.close()  # returns at once: the saves and the threads are the parent's
            ck.close()
            code = 0
        except BaseException as e:  # anything at all is the child's failure
            os.write(2, f"forked child failed at {code}: {type(e).__name__}: {e}\n".encode())
        os._exit(code)
    status = _wait_child(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    in_flight.wait()
    ck.save(4, state).wait()
    ck.close()
    assert not (run / "step-000000003").exists()
    restored = _state(7)
    with alpsck.Checkpointer(run) as again:
        assert again.restore(restored) == 4
    assert all(torch.equal(restored[k], state[k]) for k in state)


def test_a_forked_child_leaves_the_run_directory_lock_to_its_parent(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ck = alpsck.Checkpointer(run)
    ck.save(1, _state()).wait()
    owner = (run / ".lock").read_text()
    assert f'"pid": {os.getpid()}' in owner
    pid = os.fork()
    if pid == 0:  # a child that closes and drops everything it inherited
        code = 1
        try:
            ck.close()
            del ck  # the lock's last reference in the child goes too
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    status = _wait_child(pid)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert (run / ".lock").read_text() == owner, "the child emptied the parent's owner record"
    with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()}"):
        alpsck.Checkpointer(run)  # still the parent's, and named as such
    ck.close()


def test_the_lock_is_free_after_close_while_a_forked_child_lives(tmp_path: Path) -> None:
    # A persistent DataLoader worker holds a copy of the lock file's descriptor; closing the
    # checkpointer must still free the run directory for the next one in this process.
    run = tmp_path / "run"
    ck = alpsck.Checkpointer(run)
    ck.save(1, _state()).wait()
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    try:
        ck.close()
        with alpsck.Checkpointer(run) as again:
            assert again.latest_step() == 1
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_restart_waits_for_the_killed_trainings_forked_child(tmp_path: Path) -> None:
    # A training killed (SIGKILL: time limit, node trouble) while a process it forked lives on
    # (a DataLoader worker notices its parent's death only after a few seconds): that child holds
    # the lock's open file, so the restart on this host waits for it instead of being refused.
    run = tmp_path / "run"
    code = (
        "import os, sys, time, torch, alpsck\n"
        f"ck = alpsck.Checkpointer({str(run)!r})\n"
        "ck.save(1, {'w': torch.ones(4)}).wait()\n"
        "if os.fork() == 0:\n"
        "    time.sleep(2)\n"
        "    os._exit(0)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    training = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert training.stdout is not None and training.stdout.readline() == "ready\n"
    finally:
        training.kill()
        training.wait()
    t0 = time.monotonic()
    with alpsck.Checkpointer(run) as again:  # refused at once before: "job ? (pid N) on host H"
        assert again.latest_step() == 1
    assert time.monotonic() - t0 < 30  # RunDirLock::kOrphanLockWaitS: the child exited long before


@pytest.mark.parametrize("workers", [2])
def test_saves_every_step_beside_a_forking_dataloader(tmp_path: Path, workers: int) -> None:
    # The user's path: DataLoader workers are forked at every epoch while the writers run.
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64, 64))
    state = {"model": model, "optim": opt}
    step = 0
    with alpsck.Checkpointer(tmp_path / "run", keep_last=2) as ck:
        ck.restore(state)
        for _epoch in range(3):
            loader = torch.utils.data.DataLoader(data, batch_size=16, num_workers=workers,
                                                 multiprocessing_context="fork")
            for x, y in loader:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                step += 1
                ck.save(step, state)
        ck.wait()
        assert ck.latest_step() == step == 12
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = torch.nn.Linear(64, 64)
    with alpsck.Checkpointer(tmp_path / "run") as again:
        assert again.restore({"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.01)}) == 12
    assert all(torch.equal(fresh.state_dict()[k], want[k]) for k in want)
