"""alpsck.dcp in this process at world size 1 (no process group): values, the writer's lock, failures between
plan and write, a coordinator other than rank 0, metadata too large, the reader's refusals; what 2 and 4 ranks
save and load is tests/ranks/test_dcp.py."""

from __future__ import annotations

import gc
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_errors import root_cause
from torch.distributed.checkpoint.api import CheckpointException

from alpsck import Checkpointer, _core
from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter
from alpsck.errors import (
    CorruptCheckpointError,
    NoCheckpointError,
    RunDirLockedError,
    UnsafeCheckpointError,
    UsageError,
)
from alpsck.store.values import decode_value


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _Opaque:
    pass


@pytest.mark.parametrize(("value", "message"), [
    (_Opaque(), "never as pickles"),
    (range(3), "never as pickles"),
    ((torch.ones(2).to_sparse(), 3), "plain strided tensors"),
])
def test_values_json_cannot_hold_are_refused(tmp_path: Path, value: Any, message: str) -> None:
    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.ones(3), "v": value}, storage_writer=AlpsckStorageWriter(tmp_path, 1))
    cause = root_cause(e.value)
    assert isinstance(cause, UsageError) and message in str(cause) and str(cause).startswith(("v: ", "v/0: "))
    assert not [i for i in _core.scan(str(tmp_path)) if i["status"] == "committed"]
    # nothing stays locked or half-written: the same step saves fine afterwards
    dcp.save({"w": torch.ones(3), "v": [1, 2]}, storage_writer=AlpsckStorageWriter(tmp_path, 1))
    state = {"w": torch.zeros(3), "v": None}
    dcp.load(state, storage_reader=AlpsckStorageReader(tmp_path))
    assert state["v"] == [1, 2] and torch.equal(state["w"], torch.ones(3))


@pytest.mark.parametrize(("doc", "error"), [
    ({"format": "alpsck-dcp-value/1", "value": {"__t": "pickle", "v": "gASVAAAA"}}, UnsafeCheckpointError),
    ({"format": "alpsck-dcp-value/1", "value": {"__t": "tensor", "key": "x", "dtype": "float32", "shape": [1]}},
     UnsafeCheckpointError),
    ({"format": "torch-save", "value": 1}, UnsafeCheckpointError),
    ({"format": "alpsck-dcp-value/1", "value": {"__t": "bytes", "b64": 3}}, CorruptCheckpointError),
])
def test_stored_values_decode_only_known_tags(doc: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_value(json.dumps(doc).encode(), "v@json")
    assert decode_value(json.dumps({"format": "alpsck-dcp-value/1", "value": {"__t": "dtype", "v": "bfloat16"}})
                         .encode(), "v@json") is torch.bfloat16


def test_async_save_with_the_thread_executor_and_odd_tensors(tmp_path: Path) -> None:
    """async_save; empty, 0-d, fp8, complex, bool and non-contiguous tensors round-trip bit for bit."""
    g = torch.Generator().manual_seed(1)
    sd = {"w": torch.randn(64, 8, generator=g).to(torch.bfloat16), "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5),
          "fp8": torch.randn(5, generator=g).to(torch.float8_e4m3fn), "c": torch.randn(4, dtype=torch.complex64, generator=g),
          "mask": torch.rand(7, generator=g) > 0.5, "t": torch.randn(6, 4, generator=g).t(),
          "opt": {"lr": 0.25, "step": 7}}
    dcp.async_save(sd, storage_writer=AlpsckStorageWriter(tmp_path, 4)).result()
    state = {k: torch.zeros_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
    state["t"] = torch.zeros(4, 6)
    state["opt"] = {"lr": None, "step": None}
    dcp.load(state, storage_reader=AlpsckStorageReader(tmp_path))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert state[k].dtype == v.dtype and torch.equal(state[k].reshape(-1).view(torch.uint8),
                                                             v.contiguous().reshape(-1).view(torch.uint8)), k
    assert state["opt"] == {"lr": 0.25, "step": 7}


def test_validate_checkpoint_id_is_true_for_an_alpsck_run_dir_and_its_checkpoints(tmp_path: Path) -> None:
    """The reader: only where an alpsck checkpoint is. The writer, as DCP's FileSystemWriter: also where
    one can be made (a new path, an empty directory); checkpoint-directory mode: tests/unit/test_dcp_named.py."""
    run = tmp_path / "run"
    assert AlpsckStorageWriter.validate_checkpoint_id(run) and not AlpsckStorageReader.validate_checkpoint_id(run)
    dcp.save({"w": torch.ones(3)}, storage_writer=AlpsckStorageWriter(run, 5))
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for cls in (AlpsckStorageWriter, AlpsckStorageReader):
        assert cls.validate_checkpoint_id(run) and cls.validate_checkpoint_id(str(run))
        assert cls.validate_checkpoint_id(run / _core.step_dir_name(5))
        for other in (tmp_path / "file", "s3://bucket/x"):
            assert not cls.validate_checkpoint_id(other), other
    for other in (tmp_path / "empty", tmp_path / "missing"):
        assert AlpsckStorageWriter.validate_checkpoint_id(other) and not AlpsckStorageReader.validate_checkpoint_id(other)


def test_writer_takes_the_run_dir_lock_and_writes_a_step_once(tmp_path: Path) -> None:
    sd = {"w": torch.arange(4.0)}
    with Checkpointer(tmp_path, keep_last=0):
        with pytest.raises(CheckpointException) as e:
            dcp.save(sd, storage_writer=AlpsckStorageWriter(tmp_path, 3))
        assert isinstance(root_cause(e.value), RunDirLockedError)
    dcp.save(sd, storage_writer=AlpsckStorageWriter(tmp_path, 3))
    with pytest.raises(CheckpointException, match="already committed"):
        dcp.save(sd, storage_writer=AlpsckStorageWriter(tmp_path, 3))
    with Checkpointer(tmp_path, keep_last=0):  # the DCP save released the lock
        pass


def test_a_save_failing_between_plan_and_write_releases_the_lock(tmp_path: Path) -> None:
    """The coordinator opens its engine (and the run dir's lock) in prepare_global_plan; a planner
    failing after that (finish_plan) never reaches write_data. The lock must not outlive the save:
    the same writer saves again, and a dropped writer frees the run dir."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class FailingPlanner(DefaultSavePlanner):
        def finish_plan(self, new_plan: Any) -> Any:
            raise ValueError("planner failed after the global plan")

    sd = {"w": torch.arange(4.0)}
    writer = AlpsckStorageWriter(tmp_path, 3)
    with pytest.raises(CheckpointException, match="planner failed"):
        dcp.save(sd, storage_writer=writer, planner=FailingPlanner())
    dcp.save(sd, storage_writer=writer)  # reused: its own leftover lock does not block it
    with Checkpointer(tmp_path, keep_last=0):
        pass
    other = AlpsckStorageWriter(tmp_path, 4)
    with pytest.raises(CheckpointException, match="planner failed"):
        dcp.save(sd, storage_writer=other, planner=FailingPlanner())
    del other
    gc.collect()  # the failed save's traceback held it in a cycle
    with Checkpointer(tmp_path, keep_last=0):  # the dropped writer's lock is gone
        pass
    # A plan without alpsck's rank assignment fails inside write_data's cleanup as well.
    third = AlpsckStorageWriter(tmp_path, 5)
    third.set_up_storage_writer(True, rank=0)
    third.prepare_global_plan([dcp.SavePlan([])])
    with pytest.raises(UsageError, match="no alpsck rank assignment"):
        third.write_data(dcp.SavePlan([]), DefaultSavePlanner())
    with Checkpointer(tmp_path, keep_last=0):
        pass


def test_one_rank_agrees_with_itself_in_memory_not_through_a_done_record(tmp_path: Path) -> None:
    """A save at world size 1 commits through a store in its own memory (its engine's record of the sealed shard,
    which the commit reads): no DONE record written, renamed and read back, none left in the checkpoint; it loads."""
    state = {"w": torch.arange(6.0), "n": 3}
    dcp.save(state, storage_writer=AlpsckStorageWriter(tmp_path / "ckpt"))
    [step] = [p for p in (tmp_path / "ckpt").iterdir() if p.is_dir()]
    assert sorted(p.name for p in step.iterdir()) == ["MANIFEST.json", "dcp-metadata.json", "rank-00000.bin"]
    got = {"w": torch.zeros(6), "n": 0}
    dcp.load(got, storage_reader=AlpsckStorageReader(tmp_path / "ckpt"))
    assert torch.equal(got["w"], state["w"]) and got["n"] == 3


def test_a_coordinator_other_than_rank_0_writes_shard_0(tmp_path: Path) -> None:
    """The deprecated save_state_dict(coordinator_rank=1): the coordinator's shard is 0 (its engine tidies and
    commits), the others follow in process-rank order; each plan names the process rank it is for."""
    w = AlpsckStorageWriter(tmp_path, 3)
    w.set_up_storage_writer(True, rank=1)
    plans = w.prepare_global_plan([dcp.SavePlan([]), dcp.SavePlan([]), dcp.SavePlan([])])
    assert [(p.storage_data.rank, p.storage_data.process_rank) for p in plans] == [(2, 0), (0, 1), (1, 2)]
    w.close()
    other = AlpsckStorageWriter(tmp_path, 3)
    other.set_up_storage_writer(False, rank=0)
    with pytest.raises(UsageError, match="the plan is for rank 1, this is rank 0"):
        other.write_data(plans[1], dcp.DefaultSavePlanner())


def test_metadata_too_large_to_commit_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import alpsck.dcp.writer

    monkeypatch.setattr(alpsck.dcp.writer, "MAX_METADATA_BYTES", 200)  # stands for the core's 16 MiB
    with pytest.raises(CheckpointException, match="more than the 200"):
        dcp.save({f"w{i}": torch.ones(2) for i in range(8)}, storage_writer=AlpsckStorageWriter(tmp_path, 1))
    assert not [i for i in _core.scan(str(tmp_path)) if i["status"] == "committed"]
    monkeypatch.undo()  # the same step saved again, once it fits, commits
    dcp.save({f"w{i}": torch.ones(2) for i in range(8)}, storage_writer=AlpsckStorageWriter(tmp_path, 1))
    assert [(i["step"], i["status"]) for i in _core.scan(str(tmp_path), verify=True)] == [(1, "committed")]


def test_reader_refuses_native_checkpoints(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep_last=0) as ck:
        ck.save(1, {"w": torch.ones(2)}).wait()
    with pytest.raises(UsageError, match="not a DCP checkpoint"):
        AlpsckStorageReader(tmp_path, 1).read_metadata()
    with pytest.raises(NoCheckpointError):
        AlpsckStorageReader(tmp_path).read_metadata()


def test_the_writer_applies_every_retention_rule_and_records_its_metrics(tmp_path: Path) -> None:
    """Run-directory mode: the Checkpointer's retention rules, after each commit (an AlpsckModelParallelStrategy
    route under ``alpsck submit`` passes the config's), and ``metrics=`` in the manifest for ``keep_best``."""
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0, 6: 7.0, 7: 8.0}
    for step, loss in losses.items():
        writer = AlpsckStorageWriter(tmp_path, step, keep_last=2, keep_every_steps=3, keep_best=("loss", "min", 1),
                                     metrics={"loss": loss})
        dcp.save({"w": torch.full((4,), float(step))}, storage_writer=writer)
    infos = {i["step"]: i for i in _core.scan(str(tmp_path)) if i["status"] == "committed"}
    # the newest 2 (6, 7), the milestones (3, 6), the best loss (2); 1, 4 and 5 expired
    assert sorted(infos) == [2, 3, 6, 7]
    assert infos[2]["metrics"] == {"loss": 1.0}
    with pytest.raises(UsageError, match="keep_every_steps"):  # keep_last 0 keeps all: another rule is refused
        AlpsckStorageWriter(tmp_path, 8, keep_every_steps=3)
    with pytest.raises(UsageError, match="metric"):
        AlpsckStorageWriter(tmp_path, 8, metrics={"loss": "low"})
