"""One writer per run directory, whatever kind: the Checkpointer, the torch.save baseline, the DCP
backend and prune take the same lock (the core's RunDirLock), and a second writer of any kind is
refused with the holder named, while the first writer's checkpoints stay valid. The lock's name
is never followed as a symlink nor opened as a FIFO: no hang, nothing outside touched."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import alpsck
from alpsck import _core, cli
from alpsck.dcp import AlpsckStorageWriter
from alpsck.errors import RunDirLockedError
from alpsck.torch_save import TorchSaveCheckpointer


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((10_000,), v)}


def _cause(e: BaseException) -> BaseException:
    """DCP wraps a rank's error in a CheckpointException: {rank: (error, traceback)}."""
    failures = getattr(e, "failures", None)
    return next(iter(failures.values()))[0] if failures else e


def _committed(run: Path) -> list[int]:
    return [i["step"] for i in _core.scan(str(run), verify=True) if i["status"] == "committed"]


def test_a_second_writer_of_every_kind_is_refused_naming_the_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    holder = f"job 4242 (pid {os.getpid()}) on host {socket.gethostname()}"
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        ck.save(1, _state(1.0)).wait()
        with pytest.raises(RunDirLockedError, match=holder.replace("(", r"\(").replace(")", r"\)")):
            alpsck.Checkpointer(run)
        base = TorchSaveCheckpointer(run)
        with pytest.raises(RunDirLockedError, match="4242"):
            base.save(2, _state(2.0))
        base.close()
        with pytest.raises(CheckpointException) as e:  # (a BaseException, as DCP defines it)
            dcp.save(_state(3.0), storage_writer=AlpsckStorageWriter(run, 3))
        assert isinstance(_cause(e.value), RunDirLockedError), e.value
        capsys.readouterr()
        assert cli.main(["prune", str(run), "--keep-last", "1"]) == 2
        assert "4242" in capsys.readouterr().err
        ck.save(4, _state(4.0)).wait()  # the first writer goes on, undisturbed
    assert _committed(run) == [1, 4]
    assert not list(run.glob("torch-step-*"))


def test_the_baseline_holds_the_lock_from_its_first_save_until_close(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with TorchSaveCheckpointer(run) as base:
        base.save(1, _state(1.0))
        with pytest.raises(RunDirLockedError):
            alpsck.Checkpointer(run)
    with alpsck.Checkpointer(run, keep_last=0) as ck:  # released by close()
        ck.save(2, _state(2.0)).wait()


def test_an_export_into_the_run_dir_is_a_writer_and_waits_its_turn(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        ck.save(1, _state(1.0)).wait()
        capsys.readouterr()
        assert cli.main(["export", str(run), str(run / "weights.safetensors")]) == 2
        assert "is being written by" in capsys.readouterr().err
        assert not (run / "weights.safetensors").exists()
        assert cli.main(["export", str(run), str(tmp_path / "weights.safetensors")]) == 0  # elsewhere: no lock
    assert cli.main(["export", str(run), str(run / "weights.safetensors")]) == 0  # the writer is gone
    assert (run / "weights.safetensors").is_file()
    with alpsck.Checkpointer(run, keep_last=0) as ck:  # and export released the lock
        ck.save(2, _state(2.0)).wait()
