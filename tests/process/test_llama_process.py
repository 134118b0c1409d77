"""The reference training (alpsck.examples.llama) as a child process: killed and resumed byte for byte, resumed
from another run's checkpoints, the plot without matplotlib; the in-process cases are
tests/unit/test_llama.py."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from support.llama_runs import training_env
from support.warm import WarmProcess

from alpsck.examples.llama.train import (
    FAIL_EXIT_CODE,
)


def test_plot_without_matplotlib_says_how_to_install(tmp_path: Path) -> None:
    from alpsck.examples.llama import plot

    csv = tmp_path / "l.csv"
    csv.write_text("step,loss\n1,2.5\n2,2.0\n")
    out = tmp_path / "l.png"
    proc = subprocess.run([sys.executable, "-m", "alpsck.examples.llama.plot", str(csv), "-o", str(out)],
                          capture_output=True, text=True, env=training_env(), check=False)
    if importlib.util.find_spec("matplotlib") is None:
        assert proc.returncode == 2 and "pip install matplotlib" in proc.stderr
    else:
        assert proc.returncode == 0 and out.stat().st_size > 0
    assert plot.read_losses(csv) == ([1, 2], [2.5, 2.0])


def _launch(tmp_path: Path, name: str, checkpointer: str, dtype: str, *extra: str,
            env: dict[str, str] | None = None) -> WarmProcess:
    """A training, forked warm (support/warm.py: import torch once per test process, not 3-4 CPU s a launch)."""
    args = ["--seed", "3", "--training-steps", "70",
            "--checkpoint-freq", "25", "--model-dtype", dtype, "--checkpointer", checkpointer,
            "--dim", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--multiple-of", "32",
            "--sequence-length", "32", "--batch-size", "4", "--warmup-steps", "5", "--device", "cpu",
            "--torch-threads", "1", "--log-every", "0", "--checkpoint-dir", str(tmp_path / f"ckpt-{name}"),
            "--loss-file", str(tmp_path / f"{name}.csv"), *extra]
    out = tmp_path / f"{name}.out"
    out.unlink(missing_ok=True)  # a resumed run's output is its own
    return WarmProcess("-malpsck.examples.llama", args, env or training_env(), out)


def finish(proc: WarmProcess, expected_rc: int = 0) -> str:
    """Wait for a training; assert its exit code; its output."""
    rc = proc.wait(timeout=300)  # a hang guard: beside a loaded CI a training can take minutes
    out = proc.read_output()
    assert rc == expected_rc, out
    return out


@pytest.mark.parametrize(("checkpointer", "dtype"), [
    ("torch", "fp32"), ("torch", "bf16"), ("alpsck", "fp32"), ("alpsck", "bf16"),
    # The pipelined snapshot (the GPU path, run here on CPU): copies overlap the next step.
    ("alpsck --overlap-copy", "bf16")])
def test_crash_and_resume_reproduces_losses_byte_for_byte(tmp_path: Path, checkpointer: str, dtype: str) -> None:
    # A (clean) and C's first half (crash on reaching step 51) run side by side.
    kind, *flags = checkpointer.split()
    a = _launch(tmp_path, "a", kind, dtype, *flags)
    c = _launch(tmp_path, "c", kind, dtype, "--fail-at-step", "51", *flags)
    finish(a)
    finish(c, FAIL_EXIT_CODE)
    assert len((tmp_path / "c.csv").read_text().splitlines()) == 1 + 50
    finish(_launch(tmp_path, "c", kind, dtype, "--load-checkpoint", *flags))
    ref = (tmp_path / "a.csv").read_bytes()
    assert len(ref.splitlines()) == 1 + 70
    assert (tmp_path / "c.csv").read_bytes() == ref


def test_a_crash_between_run_directory_checkpoints_resumes_from_the_memory_tier_byte_for_byte(tmp_path: Path) -> None:
    """Every 50 steps to the run directory, every 5 to node memory; a crash at step 37 (before the run
    directory holds anything) resumes from the memory tier's newest snapshot, and the trace is the clean run's."""
    from alpsck import _core
    from alpsck.store import memory_tier

    env = {**training_env(), memory_tier.ROOT_ENV: str(tmp_path / "shm")}
    tiers = ("--checkpoint-freq", "50", "--memory-every", "5")
    a = _launch(tmp_path, "a", "alpsck", "fp32", *tiers, env=env)
    c = _launch(tmp_path, "c", "alpsck", "fp32", "--fail-at-step", "37", *tiers, env=env)
    finish(a)
    finish(c, FAIL_EXIT_CODE)
    assert [i for i in _core.scan(str(tmp_path / "ckpt-c")) if i["status"] == "committed"] == []
    [memory] = (tmp_path / "shm").glob("alpsck-*/ckpt-c-*/ranks-00000-00000")
    # The tier keeps one, but a crash right after a commit can come before the one before it is removed.
    kept = [i["step"] for i in _core.scan(str(memory)) if i["status"] == "committed"]
    newest = max(kept)
    assert len(kept) <= 2 and newest in (30, 35), kept  # 35 unless the crash two steps later beat its commit
    out = finish(_launch(tmp_path, "c", "alpsck", "fp32", "--load-checkpoint", *tiers, env=env))
    assert f"resumed from step {newest} of" in out, out
    assert (tmp_path / "c.csv").read_bytes() == (tmp_path / "a.csv").read_bytes()


@pytest.mark.parametrize("checkpointer", ["alpsck", "torch"])
def test_resume_from_another_runs_checkpoints(tmp_path: Path, checkpointer: str) -> None:
    """--load-checkpoint PATH: start from the newest checkpoint of another run, save into our own dir."""
    a = _launch(tmp_path, "a", checkpointer, "fp32")
    c = _launch(tmp_path, "c", checkpointer, "fp32", "--fail-at-step", "51")
    finish(a)
    finish(c, FAIL_EXIT_CODE)
    finish(_launch(tmp_path, "d", checkpointer, "fp32", "--load-checkpoint", str(tmp_path / "ckpt-c")))
    ref = (tmp_path / "a.csv").read_text().splitlines()
    # c saved every 25 steps and crashed at 51, so its newest checkpoint is step 50, or 25 when the
    # crash beat the step-50 save to durability. d starts right after it, exactly as the clean run.
    if checkpointer == "alpsck":
        from alpsck import _core

        newest = max(i["step"] for i in _core.scan(str(tmp_path / "ckpt-c")) if i["status"] == "committed")
    else:
        newest = max(int(p.stem.rsplit("-", 1)[1]) for p in (tmp_path / "ckpt-c").glob("torch-step-*.pt"))
    assert newest in (25, 50)
    assert (tmp_path / "d.csv").read_text().splitlines() == ref[:1] + ref[newest + 1:]
    before = sorted(p.name for p in (tmp_path / "ckpt-c").iterdir())
    assert any(p.name.endswith(("000000070", "000000070.pt")) for p in (tmp_path / "ckpt-d").iterdir())
    assert sorted(p.name for p in (tmp_path / "ckpt-c").iterdir()) == before  # the source run is only read
