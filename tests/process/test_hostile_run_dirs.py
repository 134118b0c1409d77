"""Hostile run directories: a symlink pointing out, a FIFO, or a hard link to a file outside, at
each name alpsck uses, in turn. Every tool (save with retention, restore, the DCP writer and
reader, the job log, inspect --verify, export, prune) must leave the files outside the run
directory byte-identical, finish within 30 s (a FIFO opened for reading or writing would block
forever), and never show a user a Python traceback. Written to find defects (#24)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.warm import WarmProcess

import alpsck
from alpsck import _core

STEP = _core.step_dir_name

# One process per case runs every tool in turn (torch is imported once), timing each; an error
# the tools raise on purpose (AlpsckError) is a refusal, anything else escapes as a traceback.
DRIVER = """
import sys, time, torch, alpsck
import torch.distributed.checkpoint as dcp
from alpsck import cli
from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter
from alpsck.slurm import history
run, out = sys.argv[1], sys.argv[2]

def save():
    with alpsck.Checkpointer(run, keep_last=1, max_in_flight=1) as ck:
        for step in (3, 4):
            ck.save(step, {"w": torch.full((5000,), float(step))}).wait()

def restore():
    alpsck.restore_into(run, {"w": torch.zeros(5000)})

def dcp_tool():
    dcp.save({"w": torch.full((5000,), 5.0)}, storage_writer=AlpsckStorageWriter(run, step=5, keep_last=1))
    dcp.load({"w": torch.zeros(5000)}, storage_reader=AlpsckStorageReader(run))

def history_tool():
    history.append(run, "running", job_id="1")
    history.read(run)

tools = {"save": save, "restore": restore, "dcp": dcp_tool, "history": history_tool,
         "inspect": lambda: cli.main(["inspect-checkpoints", run, "--verify"]),
         "export": lambda: cli.main(["export", run, out]),
         "prune": lambda: cli.main(["prune", run, "--keep-last", "1"])}
for name, tool in tools.items():
    t0 = time.monotonic()
    try:
        tool()
    except alpsck.errors.AlpsckError as e:
        print("refused:", name, e)
    except dcp.api.CheckpointException as e:  # DCP wraps what its storage raised, with a trace
        assert all(isinstance(exc, alpsck.errors.AlpsckError) for exc, _ in e.failures.values()), e
        print("refused:", name, *(exc for exc, _ in e.failures.values()))
    print(f"took {name} {time.monotonic() - t0:.1f}", flush=True)
"""


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((5000,), float(step))}).wait()
    return run


def _outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "sentinel").write_text("keep me")
    (out / "rank-00000.bin").write_bytes(b"not a shard" * 100)
    (out / "MANIFEST.json").write_text('{"not": "a manifest"}')
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _place(run: Path, name: str, kind: str, outside: Path) -> None:
    target = run / name
    if target.is_dir() and not target.is_symlink():
        for f in target.iterdir():
            f.unlink()
        target.rmdir()
    elif target.exists() or target.is_symlink():
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    source = outside / Path(name).name if (outside / Path(name).name).exists() else outside / "sentinel"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "hardlink":  # a file alpsck writes in place (a recycled shard) or appends to
        os.link(source, target)
    elif name.endswith((".bin", ".json")) or name in ("LATEST", "LATEST.tmp", ".lock", "history.jsonl"):
        target.symlink_to(source)
    else:
        target.symlink_to(outside)


NAMES = [
    STEP(2),                                   # the newest committed checkpoint (a link: read, never expired)
    STEP(1),                                   # a committed checkpoint retention would expire
    _core.tmp_dir_name(3),                     # the next save's attempt directory
    STEP(2).replace("step-", "step-") + ".aborted",
    "free-1-99-0",                             # a recycled directory a save would claim
    "LATEST",
    "LATEST.tmp",
    ".lock",
    f"{STEP(2)}/rank-00000.bin",               # a committed shard
    f"{STEP(1)}/rank-00000.bin",               # the shard of the checkpoint retention recycles in place
    "free-1-99-0/rank-00000.bin",              # the shard of a recycled directory a save would claim
    f"{STEP(2)}/MANIFEST.json",
    "history.jsonl",                           # the job's log (appended to)
]
FILES = [n for n in NAMES if n.endswith((".bin", ".json", ".jsonl")) or n.startswith("LATEST")]


@pytest.mark.parametrize(("name", "kind"), [(n, k) for n in NAMES for k in ("symlink", "fifo")]
                         + [(n, "hardlink") for n in FILES])
def test_no_tool_touches_anything_outside_or_hangs(tmp_path: Path, name: str, kind: str) -> None:
    run = _run_dir(tmp_path)
    outside = _outside(tmp_path)
    _place(run, name, kind, outside)
    before = _tree(outside)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    # Forked warm (support.warm: torch is imported once per test process, not once per case).
    p = WarmProcess(driver, [str(run), str(tmp_path / "w.safetensors")], dict(os.environ), tmp_path / "driver.out")
    try:  # seven tools, each bounded at 30 s below: a hang anywhere ends here
        p.wait(210)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"a tool hung with a {kind} at {name}: {p.read_output()!r}")
    out = p.read_output()
    assert p.returncode == 0 and "Traceback" not in out, f"a {kind} at {name}:\n{out}"
    took = {line.split()[1]: float(line.split()[2]) for line in out.splitlines() if line.startswith("took ")}
    assert set(took) == {"save", "restore", "dcp", "history", "inspect", "export", "prune"}, out
    assert all(t < 30 for t in took.values()), took
    assert _tree(outside) == before, f"a file outside the run directory changed ({kind} at {name}):\n{out}"
