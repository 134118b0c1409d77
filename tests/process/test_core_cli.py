"""The core through the command line, in child processes: the parts of test_core.py that run `alpsck` or a second Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck import _core


def test_a_run_dir_whose_name_is_not_utf8_works_end_to_end(tmp_path: Path) -> None:
    """File names are bytes: one that is not valid UTF-8 (Python holds it with surrogate escapes)
    was a TypeError traceback from the extension. Now the core gets the bytes os.fsencode gives."""
    run = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/run-\xff\xfe"))
    with alpsck.Checkpointer(run, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(1000)}).wait()
        h = ck.save(2, {"w": torch.full((1000,), 2.0)})
        h.wait()
        assert Path(h.result()["path"]) == run / "step-000000002"
    infos = _core.scan(run, verify=True)
    assert [(i["step"], i["status"]) for i in infos] == [(2, "committed")]
    assert Path(infos[0]["path"]).is_dir() and _core.scan(os.fsencode(run))[0]["step"] == 2
    back = {"w": torch.zeros(1000)}
    assert alpsck.restore_into(run, back) == 2 and back["w"][0].item() == 2.0
    r = subprocess.run([sys.executable, "-m", "alpsck", "inspect-checkpoints", os.fsencode(run), "--verify"],
                       capture_output=True)
    assert r.returncode == 0 and b"committed" in r.stdout, r.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, text=True, timeout=120)


def test_inspect_checkpoints_cli(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path, keep_last=0) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"w": torch.full((100_000,), float(s))}).wait()
    (tmp_path / "step-000000004.tmp").mkdir()
    r = _cli("inspect-checkpoints", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["latest_valid"] == 3
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [
        (1, "committed"), (2, "committed"), (3, "committed"), (4, "incomplete")]
    with open(tmp_path / "step-000000003" / "rank-00000.bin", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff\xff")
    assert json.loads(_cli("inspect-checkpoints", str(tmp_path), "--json").stdout)["latest_valid"] == 3  # quick: sizes only
    r = _cli("inspect-checkpoints", str(tmp_path), "--verify", "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["latest_valid"] == 2 and doc["checkpoints"][2]["status"] == "corrupt"
    assert "CRC" in doc["checkpoints"][2]["error"]
    table = _cli("inspect-checkpoints", str(tmp_path)).stdout
    assert "committed" in table and "incomplete" in table
    r = _cli("inspect-checkpoints", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such directory" in r.stderr


def test_version_names_the_package_and_the_format_it_writes(tmp_path: Path) -> None:
    r = _cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"alpsck {alpsck.__version__} (writes ")
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.zeros(4)}).wait()
    written = json.loads((tmp_path / "step-000000001" / "MANIFEST.json").read_text())["format"]
    assert f"(writes {written};" in r.stdout and f"crc32c: {_core.crc32c_backend()};" in r.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    # `alpsck status RUN | head -1`: far more output than a pipe holds, and the reader leaves.
    lines = [json.dumps({"time": 1.7e9 + i, "event": "started", "job_id": "7", "restart": i}) for i in range(5000)]
    (tmp_path / "history.jsonl").write_text("\n".join(lines) + "\n")
    # --events 5000: some 270 KB, far more than a pipe holds (the default shows the last few events only,
    # which fit in it: the command could end before the reader leaves, and the test would race).
    p = subprocess.Popen([sys.executable, "-m", "alpsck", "status", str(tmp_path), "--events", "5000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    assert p.stdout.readline().startswith(f"{tmp_path}: ")
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=60) == 141 and err == "", err


LOCK_HOLDER = r"""
import sys, time, alpsck
ck = alpsck.Checkpointer(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def test_second_writer_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken_over(tmp_path: Path) -> None:
    import signal
    import socket

    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**__import__("os").environ, "SLURM_JOB_ID": "4242"})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(alpsck.errors.RunDirLockedError, match=f"job 4242 .* host {socket.gethostname()}"):
            alpsck.Checkpointer(tmp_path)
        restore_only = {"w": torch.zeros(3)}
        assert alpsck.restore_into(tmp_path, restore_only) is None  # readers take no lock
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with alpsck.Checkpointer(tmp_path) as ck:  # the dead holder's lock is stale: taken over
        ck.save(1, {"w": torch.ones(3)}).wait()
    with alpsck.Checkpointer(tmp_path):  # released on close
        pass
