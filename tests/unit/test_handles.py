"""A save handle is a future of the checkpoint being durable, with concurrent.futures' surface:
result() raises the save's error or returns its record, exception(), done(), callbacks. For the
concurrent checkpointer and the torch.save baseline alike."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck.errors import CheckpointError, DiskFullError
from alpsck.handles import SaveHandle
from alpsck.torch_save import TorchSaveCheckpointer


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((50_000,), v)}


def test_a_durable_save_is_a_future_that_resolves_to_its_record(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path, keep_last=0) as ck:
        h = ck.save(1, _state(1.0))
        assert isinstance(h, SaveHandle)
        called = threading.Event()
        seen: list[object] = []
        h.add_done_callback(lambda f: (seen.append(f), called.set()))
        rec = h.result(timeout=60)
        assert Path(rec["path"]) == tmp_path / alpsck._core.step_dir_name(1) and not rec["skipped"]
        assert rec["durable_seconds"] > 0
        assert h.done() and not h.running() and not h.cancel() and not h.cancelled()
        assert h.exception() is None
        assert called.wait(10) and seen == [h]
        late: list[object] = []
        h.add_done_callback(late.append)  # already done: called at once, in this thread
        assert late == [h]


def test_a_failed_save_raises_from_result_and_is_returned_by_exception(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path, keep_last=0,
                             _faults=[{"op": "pwrite", "error": errno.ENOSPC, "count": 1000}]) as ck:
        h = ck.save(1, _state(1.0))
        got: list[BaseException | None] = []
        done = threading.Event()
        h.add_done_callback(lambda f: (got.append(f.exception()), done.set()))
        with pytest.raises(DiskFullError):
            h.result(timeout=60)
        assert isinstance(h.exception(), DiskFullError)
        assert done.wait(10) and isinstance(got[0], DiskFullError)
        assert isinstance(h.exception(), CheckpointError)
        ck.wait()  # the error reached the caller through the handle: not raised a second time


def test_a_callback_does_not_swallow_the_error_the_caller_never_looked_at(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path, keep_last=0,
                             _faults=[{"op": "pwrite", "error": errno.ENOSPC, "count": 1000}]) as ck:
        h = ck.save(1, _state(1.0))
        done = threading.Event()
        h.add_done_callback(lambda f: done.set())
        assert done.wait(60)
        with pytest.raises(DiskFullError):
            ck.wait()  # the callback saw it done; the error is still the caller's to hear


def test_a_timeout_is_a_timeout_not_an_error_of_the_save(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path, keep_last=0,
                             _faults=[{"op": "pwrite", "error": 0, "count": 1000, "delay_us": 1_000_000}]) as ck:
        h = ck.save(1, _state(1.0))
        with pytest.raises(TimeoutError):
            h.result(timeout=0.01)
        with pytest.raises(TimeoutError):
            h.exception(timeout=0.01)
        assert h.result(timeout=120)["path"]


def test_the_baseline_handle_is_the_same_kind_of_future(tmp_path: Path) -> None:
    with TorchSaveCheckpointer(tmp_path) as ck:
        h = ck.save(3, _state(3.0))
        assert isinstance(h, SaveHandle) and h.done() and h.exception() is None
        assert Path(h.result()["path"]).is_file()
