"""Named DCP checkpoints (torchtitan's layout) under child processes: a writer refused in a folder in use, an
overwrite killed at any point, the tools on a trainer's folder; the in-process cases are
tests/unit/test_dcp_named.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_named import load_named
from support.dcp_worker import reference

from alpsck import _core
from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter
from alpsck.errors import RunDirLockedError, UsageError


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def test_a_folder_of_checkpoints_or_a_directory_in_use_is_refused_where_the_writer_is_made(tmp_path: Path) -> None:
    """Refused in one line before DCP starts (not as a CheckpointException of every rank's traceback): a
    trainer's folder of named checkpoints given as one checkpoint (a writer would add a generation among
    them), to a writer or a reader, made or pointed at it by checkpoint_id; and a directory another live
    process writes. A reused writer whose own save holds the lock is not refused."""
    folder = tmp_path / "ckpt"
    writer = AlpsckStorageWriter()
    for step in (10, 20):
        dcp.save(reference(step), checkpoint_id=folder / f"step-{step}", storage_writer=writer)
    before = sorted(os.listdir(folder))
    folder_error = r"'.*ckpt' holds checkpoint directories \(step-10, step-20\): it is a folder of checkpoints; name one"
    for attempt in (lambda: AlpsckStorageWriter(folder), lambda: AlpsckStorageReader(folder),
                    lambda: dcp.save(reference(30), checkpoint_id=folder, storage_writer=AlpsckStorageWriter()),
                    lambda: load_named(folder)):
        with pytest.raises(UsageError, match=folder_error):
            attempt()
    assert sorted(os.listdir(folder)) == before  # nothing written among them
    # Another process's Checkpointer holds run/: refused where the writer is made, naming its pid.
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", f"import alpsck, time; c = alpsck.Checkpointer({str(run)!r}); "
                               "print('holding', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        for attempt in (lambda: AlpsckStorageWriter(run, 5),
                        lambda: dcp.save(reference(5), checkpoint_id=run, storage_writer=AlpsckStorageWriter())):
            with pytest.raises(RunDirLockedError, match=rf"a writer holds it \(pid {holder.pid} .*two writers in one"):
                attempt()
    finally:
        holder.kill()
        holder.wait()
    AlpsckStorageWriter(run, 5)  # the holder is gone: its lock went with it
    # This process's own save in flight holds step-20's lock: pointing a writer at it again is no refusal.
    from alpsck.store.lock import lock_run_dir
    own = lock_run_dir(folder / "step-20", 0)
    try:
        AlpsckStorageWriter(folder / "step-20")
    finally:
        own.release()


_OVERWRITER = textwrap.dedent("""
    import os, sys, warnings
    import torch, torch.distributed.checkpoint as dcp
    from alpsck.dcp import AlpsckStorageWriter
    warnings.filterwarnings("ignore")
    ckpt, n = sys.argv[1], int(sys.argv[2])
    writer = AlpsckStorageWriter(threads=2, chunk_bytes=1 << 20)
    i = 0
    while True:
        i += 1
        dcp.save({"w": torch.full((n,), float(i)), "i": torch.tensor(i)}, checkpoint_id=ckpt, storage_writer=writer)
        print(i, flush=True)
""")


def test_overwrite_killed_at_any_point_leaves_old_or_new_never_torn(tmp_path: Path) -> None:
    """SIGKILL a process that saves over one checkpoint id again and again: after every kill the id
    loads, whole (every element the same save's), at least as new as the last save it reported."""
    ckpt = tmp_path / "step-10"
    n = 16 << 20  # 64 MiB of float32: a save takes long enough to be killed inside it
    script = tmp_path / "overwriter.py"
    script.write_text(_OVERWRITER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    for kill_after in (0.35, 0.8, 1.3):
        p = subprocess.Popen([sys.executable, str(script), str(ckpt), str(n)], stdout=subprocess.PIPE, text=True,
                             env=env)
        assert p.stdout is not None
        first = p.stdout.readline()  # one save done: the kill lands in a later one
        assert first.strip(), "the overwriter saved nothing"
        time.sleep(kill_after)
        p.send_signal(signal.SIGKILL)
        out = first + p.stdout.read()
        p.wait()
        reported = int(out.split()[-1])
        state = {"w": torch.zeros(n), "i": torch.tensor(0)}
        dcp.load(state, checkpoint_id=ckpt, storage_reader=AlpsckStorageReader(fallback=False))
        i = int(state["i"])
        # Each process counts from 1 and reported one save before the kill: what loads is its own, whole.
        assert i >= reported and torch.equal(state["w"], torch.full((n,), float(i))), (i, reported)
    committed = [i for i in _core.scan(str(ckpt)) if i["status"] == "committed"]
    assert 1 <= len(committed) <= 2  # a kill between the commit and the removal of the old generation: two
    state = {"w": torch.zeros(n), "i": torch.tensor(0)}
    dcp.save({"w": torch.full((n,), -1.0), "i": torch.tensor(-1)}, checkpoint_id=ckpt,
             storage_writer=AlpsckStorageWriter())  # the next save tidies what the kills left
    dcp.load(state, checkpoint_id=ckpt, storage_reader=AlpsckStorageReader())
    assert int(state["i"]) == -1
    assert [e for e in os.listdir(ckpt) if e.endswith(".tmp")] == []
    assert len([i for i in _core.scan(str(ckpt)) if i["status"] == "committed"]) == 1


def test_the_tools_name_a_checkpoint_of_a_trainers_folder_instead_of_calling_them_damaged(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    writer = AlpsckStorageWriter()
    for step in (1, 10):
        dcp.save(reference(step), checkpoint_id=folder / f"step-{step}", storage_writer=writer)
    for cmd in (["prune", str(folder), "--keep-last", "1"], ["export", str(folder), str(tmp_path / "o.pt")]):
        p = subprocess.run([sys.executable, "-m", "alpsck", *cmd], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and f"name one, e.g. {folder / 'step-10'}" in p.stderr, p.stderr
    assert sorted(os.listdir(folder)) == ["step-1", "step-10"]
    p = subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(folder)], capture_output=True,
                       text=True, timeout=120)  # listed, each step alpsck's, the newest marked
    assert p.returncode == 0 and "damaged" not in p.stdout, p.stdout + p.stderr
    assert [line.split()[:3] for line in p.stdout.splitlines()[2:4]] == [["1", "alpsck", "alpsck's;"],
                                                                       ["*", "10", "alpsck"]], p.stdout
    p = subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", str(folder / "step-10"), "--verify"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "committed" in p.stdout, p.stdout + p.stderr
