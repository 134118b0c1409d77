"""The option table at the command line (child processes); the rest is tests/unit/test_options.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import alpsck

# Every number a command takes is checked where it enters: argparse's one line naming the option,
# exit 2, no traceback, nothing done.
CLI_BAD = [
    (["bench", "--size-gib", "-1"], "--size-gib: -1 is out of range"),
    (["bench", "--size-gib", "nan"], "--size-gib: nan is out of range"),
    (["bench", "--size-gib", "1e30"], "--size-gib: 1e30 is out of range"),
    (["bench", "--repeats", "0"], "--repeats: 0 is out of range"),
    (["bench", "--slowdown", "1"], "--slowdown: 1 is out of range"),
    (["bench", "--overhead", "--iters", "0"], "--iters: 0 is out of range"),
    (["bench", "--overhead", "--seed", "-3"], "--seed: -3 is out of range"),
    (["bench", "--threads", "0,2"], "--threads: expected positive integers"),
    (["export", "RUN", "OUT.safetensors", "--step", "-5"], "--step: -5 is out of range"),
    (["export", "RUN", "OUT.safetensors", "--step", str(2**63)], f"--step: {2**63} is out of range"),
    (["export", "RUN", "OUT.safetensors", "--threads", "0"], "--threads: 0: must be between"),
    (["inspect-checkpoints", "RUN", "--rank", "-1"], "--rank: -1 is out of range"),
    (["inspect-checkpoints", "RUN", "--step", "x"], "--step: not a whole number: 'x'"),
    (["prune", "RUN", "--keep-last", "-1"], "--keep-last: -1 is out of range: at least 0"),
]


@pytest.mark.parametrize(("argv", "match"), CLI_BAD, ids=[" ".join(a) for a, _ in CLI_BAD])
def test_a_command_line_number_out_of_range_is_one_line_naming_the_option(tmp_path: Path, argv: list[str],
                                                                           match: str) -> None:
    import subprocess
    import sys

    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
    before = sorted(p.name for p in run.iterdir())
    argv = [str(run) if a == "RUN" else str(tmp_path / a) if a.startswith("OUT") else a for a in argv]
    r = subprocess.run([sys.executable, "-m", "alpsck", *argv], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert match in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in run.iterdir()) == before and not (tmp_path / "OUT.safetensors").exists()


def test_a_run_dir_entry_whose_name_is_not_utf8_is_listed_as_foreign_not_a_crash(tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
    os.mkdir(os.fsencode(run) + b"/step-\xff")
    for argv in (["inspect-checkpoints", str(run), "--json"], ["prune", str(run), "--keep-last", "1"],
                 ["export", str(run), str(tmp_path / "o.safetensors")]):
        r = subprocess.run([sys.executable, "-m", "alpsck", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (argv, r.stderr)
        if "--json" in argv:
            assert json.loads(r.stdout)["latest_valid"] == 1
    assert os.path.isdir(os.fsencode(run) + b"/step-\xff")  # not alpsck's: left alone
