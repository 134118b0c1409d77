"""One history per run directory: a run that resumes from an older checkpoint replaces the newer ones.

The newest checkpoint proves corrupt and restore falls back, or an older step is restored on
purpose: the run then trains through steps that already have checkpoint directories. Those belong
to an abandoned future. Before this was handled, a save of such a step was a silent no-op (the
engine counted it as committed), so every requeue lost the same progress again; and a newer
abandoned checkpoint shadowed the new history in restore and crowded it out of keep_last.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import alpsck
from alpsck import _core
from alpsck.errors import CorruptCheckpointError


def _state(step: int, history: int = 0) -> dict[str, Any]:
    return {"w": torch.arange(200_000, dtype=torch.float32) * step + 1000 * history,
            "b": torch.full((3,), step, dtype=torch.int64), "history": history}


def _save(run_dir: Path, steps: list[int], history: int = 0, **kw: Any) -> None:
    with alpsck.Checkpointer(run_dir, chunk_bytes=64 << 10, **kw) as ck:
        for s in steps:
            ck.save(s, _state(s, history)).wait()


def _restored(run_dir: Path) -> tuple[int | None, int, torch.Tensor]:
    back: dict[str, Any] = {"w": torch.empty(200_000), "b": torch.empty(3, dtype=torch.int64), "history": -1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = alpsck.restore_into(run_dir, back)
    return step, back["history"], back["w"]


def _superseded(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("superseded-"))


def _corrupt_data(step_dir: Path) -> None:
    with open(step_dir / "rank-00000.bin", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_run_resumed_past_a_corrupt_newest_checkpoint_saves_that_step_again(tmp_path: Path) -> None:
    _save(tmp_path, [1, 2, 3], keep_last=0)
    _corrupt_data(tmp_path / "step-000000003")
    with alpsck.Checkpointer(tmp_path, keep_last=0, chunk_bytes=64 << 10) as ck:
        state = _state(0, history=-1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ck.restore(state) == 2
            assert _superseded(tmp_path) == []  # restore alone changes nothing on disk
            h = ck.save(3, _state(3, history=1))
            h.wait()
        msgs = [str(w.message) for w in caught if "abandoned history" in str(w.message)]
        assert len(msgs) == 1 and "continues from step 2" in msgs[0] and "step(s) 3" in msgs[0], msgs
        assert not h.result()["skipped"]  # before: skipped, nothing written, the corrupt 3 stayed
    step, history, w = _restored(tmp_path)
    assert (step, history) == (3, 1) and torch.equal(w, _state(3, 1)["w"])
    (moved,) = _superseded(tmp_path)
    assert moved.startswith("superseded-step-000000003-")
    assert (tmp_path / moved / "rank-00000.bin").exists()  # kept for inspection, not deleted
    assert [i["step"] for i in _core.scan(str(tmp_path))] == [1, 2, 3]


def test_restoring_an_older_step_on_purpose_abandons_the_newer_ones(tmp_path: Path) -> None:
    """Rolled back to step 2 (a loss spike, say): the old 3 and 4 never come back in a later restore."""
    _save(tmp_path, [1, 2, 3, 4], keep_last=3)
    with alpsck.Checkpointer(tmp_path, keep_last=3, chunk_bytes=64 << 10) as ck:
        state = _state(0, history=-1)
        assert ck.restore(state, step=2) == 2 and state["history"] == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save(3, _state(3, history=1)).wait()
        assert any("step(s) 3, 4" in str(w.message) for w in caught), [str(w.message) for w in caught]
        # A crash here: restore must find the new history's 3, not the abandoned 4.
        assert _restored(tmp_path)[:2] == (3, 1)
        for s in (4, 5, 6):
            ck.save(s, _state(s, history=1)).wait()
    assert [i["step"] for i in _core.scan(str(tmp_path))] == [4, 5, 6]  # keep_last counts this history only
    step, history, w = _restored(tmp_path)
    assert (step, history) == (6, 1) and torch.equal(w, _state(6, 1)["w"])
    assert (tmp_path / "LATEST").read_text().strip() == "6"


def test_a_rollback_in_the_same_process_saves_the_steps_again(tmp_path: Path) -> None:
    """A loss spike at step 6: restore step 3 in the same Checkpointer and train on. Found by a
    review: only checkpoints found when the engine opened were retired, so saves 4-6 were skipped
    and a later restore returned the spiked step 6."""
    with alpsck.Checkpointer(tmp_path, keep_last=0, chunk_bytes=64 << 10) as ck:
        for s in range(1, 7):
            ck.save(s, _state(s)).wait()
        state = _state(0, history=-1)
        assert ck.restore(state, step=3) == 3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for s in (4, 5, 6):
                h = ck.save(s, _state(s, history=1))
                h.wait()
                assert not h.result()["skipped"]
        assert [str(w.message) for w in caught if "abandoned history" in str(w.message)][0].count("step(s) 4, 5, 6") == 1
    step, history, w = _restored(tmp_path)
    assert (step, history) == (6, 1) and torch.equal(w, _state(6, 1)["w"])
    assert len(_superseded(tmp_path)) == 3


def test_saving_the_restored_step_again_is_a_no_op_and_retires_nothing(tmp_path: Path) -> None:
    """A requeued job that resumes at step 3 and is told to stop at once takes its final checkpoint at 3."""
    _save(tmp_path, [1, 2, 3])
    with alpsck.Checkpointer(tmp_path, chunk_bytes=64 << 10) as ck:
        state = _state(0, history=-1)
        assert ck.restore(state) == 3
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no superseding warning
            h = ck.save(3, state)
            h.wait()
        assert h.result()["skipped"]
    assert _superseded(tmp_path) == [] and _restored(tmp_path)[:2] == (3, 0)


def test_a_fresh_run_in_a_used_run_dir_does_not_resume_into_the_old_history(tmp_path: Path) -> None:
    """No restore (a new experiment pointed at an old run dir): its saves replace the old steps they meet."""
    _save(tmp_path, [10, 20, 30], keep_last=0)
    with alpsck.Checkpointer(tmp_path, keep_last=0, chunk_bytes=64 << 10) as ck:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save(20, _state(20, history=1)).wait()
        assert any("did not restore" in str(w.message) and "step(s) 20, 30" in str(w.message) for w in caught)
    step, history, _ = _restored(tmp_path)
    assert (step, history) == (20, 1)
    assert [i["step"] for i in _core.scan(str(tmp_path))] == [10, 20]


def test_a_run_whose_every_checkpoint_is_corrupt_starts_over_without_them(tmp_path: Path) -> None:
    _save(tmp_path, [5, 10], keep_last=0)
    for s in (5, 10):
        _corrupt_data(tmp_path / f"step-{s:09d}")
    (tmp_path / "step-000000005" / "MANIFEST.json").write_text("{}")  # found before any byte is read
    with alpsck.Checkpointer(tmp_path, keep_last=0, chunk_bytes=64 << 10) as ck:
        state = _state(0, history=-1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CorruptCheckpointError, match="rebuild the state"):
                ck.restore(state)  # step 10's read already landed in the live tensors
            ck.save(1, _state(1, history=1)).wait()
    assert len(_superseded(tmp_path)) == 2  # both: the run restored nothing
    assert _restored(tmp_path)[:2] == (1, 1)
    shutil.rmtree(tmp_path / _superseded(tmp_path)[0])
    with alpsck.Checkpointer(tmp_path, keep_last=0, chunk_bytes=64 << 10) as ck:  # a clean None
        (tmp_path / "step-000000001" / "MANIFEST.json").unlink()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ck.restore(_state(0, history=-1)) is None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ck.save(7, _state(7, history=2)).wait()
        assert any("restored no checkpoint" in str(w.message) and "step(s) 1" in str(w.message) for w in caught)
    assert _restored(tmp_path)[:2] == (7, 2)
