"""PyTorch's storage-contract cases for torch.distributed.checkpoint, run on both backends side by side.

Each case is written here after one in PyTorch's own suite (test/distributed/checkpoint/:
test_file_system_checkpoint_cpu.py, test_checkpoint.py, e2e/test_e2e_save_and_load.py,
test_fsspec.py, test_save_load_api.py), with the same assertions, and runs once with DCP's
FileSystemWriter/Reader (the reference) and once with alpsck's writer and reader. A regression
reads "fs passes, alpsck fails". Single-process cases; the multi-rank ones are in
tests/unit/test_dcp.py and tests/unit/test_dcp_named.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_backends import Backend, faulty
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from alpsck import Checkpointer

pytestmark = pytest.mark.usefixtures("dcp_quiet")


def _save(b: Backend, sd: dict[str, Any], path: Path, **options: Any) -> None:
    dcp.save(sd, checkpoint_id=path, storage_writer=b.writer(path, **options))


def _load(b: Backend, sd: dict[str, Any], path: Path) -> None:
    dcp.load(sd, checkpoint_id=path, storage_reader=b.reader(path))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.EmbeddingBag(11, 3))


def _assert_equal_dicts(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- test_file_system_checkpoint_cpu.py


@pytest.mark.parametrize("threads", [1, 2])
def test_read_write_only_tensor(backend: Backend, tmp_path: Path, threads: int) -> None:
    """The deprecated save_state_dict/load_state_dict (no checkpoint_id: reset() without one)."""
    sd = _model(0).state_dict()
    from torch.distributed.checkpoint import load_state_dict, save_state_dict

    save_state_dict(state_dict=sd, storage_writer=backend.writer(tmp_path, threads=threads), no_dist=True)
    sd2 = _model(1).state_dict()
    with pytest.raises(AssertionError):
        _assert_equal_dicts(sd, sd2)
    load_state_dict(state_dict=sd2, storage_reader=backend.reader(tmp_path), no_dist=True)
    _assert_equal_dicts(sd, sd2)


def test_dtype_mismatch_casts_on_load(backend: Backend, tmp_path: Path) -> None:
    sd = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))}
    _save(backend, sd, tmp_path)
    into = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    _load(backend, into, tmp_path)
    assert into["w"].dtype == torch.bfloat16 and torch.equal(into["w"], sd["w"].to(torch.bfloat16))


class BlobState(Stateful):
    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def state_dict(self) -> dict[str, Any]:
        return {"blob": self.blob}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.blob = state_dict["blob"]


def test_read_write_tensor_and_blob(backend: Backend, tmp_path: Path) -> None:
    sd = {"model": _model(0).state_dict(), "blob": BlobState(b"SomeBlobForTesting")}
    _save(backend, sd, tmp_path)
    into = {"model": _model(1).state_dict(), "blob": BlobState(b"")}
    _load(backend, into, tmp_path)
    _assert_equal_dicts(sd["model"], into["model"])
    assert into["blob"].blob == b"SomeBlobForTesting"


def test_save_load_bytes(backend: Backend, tmp_path: Path) -> None:
    _save(backend, {"bytes0": [1], "bytes1": "string"}, tmp_path)
    into: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    _load(backend, into, tmp_path)
    assert into == {"bytes0": [1], "bytes1": "string"}


# -- test_fsspec.py / e2e: overwrite


def test_overwrite(backend: Backend, tmp_path: Path) -> None:
    t1, t2 = torch.randn(10), torch.randn(10)
    _save(backend, {"random": t1}, tmp_path, overwrite=False)
    _save(backend, {"random": t2}, tmp_path, overwrite=True)
    into = {"random": torch.zeros(10)}
    _load(backend, into, tmp_path)
    assert torch.equal(into["random"], t2)
    with pytest.raises(CheckpointException, match=".*Checkpoint already exists.*"):
        _save(backend, {"random": t2}, tmp_path, overwrite=False)


# -- test_checkpoint.py: a failure at each stage names the failing rank, with its own error

WRITER_STAGES = ["set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data",
                 "write_data_async", "finish"]
READER_STAGES = ["set_up_storage_reader", "prepare_local_plan", "prepare_global_plan", "read_data",
                 "read_data_async"]


@pytest.mark.parametrize("stage", WRITER_STAGES)
def test_save_error_handling_no_dist(backend: Backend, tmp_path: Path, stage: str) -> None:
    base = type(backend.writer(tmp_path / "probe"))
    writer = faulty(base, stage)(tmp_path / "ckpt")
    with pytest.raises(CheckpointException) as e:
        dcp.save({"w": torch.ones(3), "lr": 0.1}, checkpoint_id=tmp_path / "ckpt", storage_writer=writer)
    assert list(e.value.failures) == [0]
    err = e.value.failures[0][0]
    assert isinstance(err, ValueError) and f"injected failure in {stage}" in str(err)
    assert not (tmp_path / "ckpt" / ".metadata").exists()  # nothing a trainer would take for a checkpoint
    if backend.name == "alpsck":
        with Checkpointer(tmp_path / "ckpt", keep_last=0):  # no lock left behind, with the writer still alive
            pass
        writer.close()  # its engine (opened by the global plan; write_data, which closes it, was replaced)


@pytest.mark.parametrize("stage", READER_STAGES)
def test_load_error_handling_no_dist(backend: Backend, tmp_path: Path, stage: str) -> None:
    _save(backend, {"w": torch.ones(3), "lr": 0.1}, tmp_path)
    reader = faulty(type(backend.reader(tmp_path)), stage)(tmp_path)
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": torch.zeros(3), "lr": 0.0}, checkpoint_id=tmp_path, storage_reader=reader)
    assert list(e.value.failures) == [0]
    err = e.value.failures[0][0]
    assert isinstance(err, ValueError) and f"injected failure in {stage}" in str(err)


# -- test_save_load_api.py: automatic storage selection rejects what neither backend stores


def test_validate_checkpoint_id_rejects_other_schemes(backend: Backend, tmp_path: Path) -> None:
    writer, reader = type(backend.writer(tmp_path / "a")), type(backend.reader(tmp_path))
    assert not writer.validate_checkpoint_id("abc://abc.abc")
    assert not reader.validate_checkpoint_id("abc://abc.abc")
    assert writer.validate_checkpoint_id(tmp_path / "new")


# -- e2e/test_e2e_save_and_load.py


class Counter(Stateful):
    def __init__(self) -> None:
        self.data = torch.rand(10, 10)
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.data = state_dict["data"]
        self.loaded += 1


def test_stateful_and_non_stateful_loads(backend: Backend, tmp_path: Path) -> None:
    saved = {"stateful": Counter(), "plain": {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}}
    _save(backend, saved, tmp_path)
    _save(backend, saved, tmp_path)  # the same checkpoint_id again
    into = {"stateful": Counter(), "plain": {"replicated": torch.zeros(10, 10), "bytes": [0]}}
    stateful = into["stateful"]
    _load(backend, into, tmp_path)
    assert into["stateful"] is stateful and stateful.loaded == 1  # loaded in place, through load_state_dict
    assert torch.equal(stateful.data, saved["stateful"].data)
    assert torch.equal(into["plain"]["replicated"], saved["plain"]["replicated"])
    assert into["plain"]["bytes"] == [1, 2, 3, 4]


def test_no_dist_empty_state_dict(backend: Backend, tmp_path: Path) -> None:
    _save(backend, {}, tmp_path)
    into: dict[str, Any] = {}
    _load(backend, into, tmp_path)
    assert into == {}


def test_partial_load(backend: Backend, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    model = _model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    loss = model[0](torch.randn(2, 5)).sum() + model[1](torch.randint(0, 11, (2, 3))).sum()
    loss.backward()
    optim.step()
    _save(backend, {"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path)
    fresh = _model(1)
    into = {"model": fresh.state_dict()}
    _load(backend, into, tmp_path)  # a subset of what was saved
    _assert_equal_dicts(model.state_dict(), into["model"])
    got = _load_state_dict_from_keys("model", checkpoint_id=tmp_path, storage_reader=backend.reader(tmp_path))
    _assert_equal_dicts(model.state_dict(), got["model"])
    got = _load_state_dict_from_keys("optim.state", checkpoint_id=tmp_path, storage_reader=backend.reader(tmp_path))
    saved_state = optim.state_dict()["state"]  # DCP gives the parameter ids back as strings, on both backends
    assert sorted(got["optim"]["state"]) == sorted(str(pid) for pid in saved_state)
    for pid, st in saved_state.items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][str(pid)][k], v), (pid, k)


def test_load_is_in_place(backend: Backend, tmp_path: Path) -> None:
    model = _model(0)
    _save(backend, {"model": model.state_dict(), "lr": 0.1}, tmp_path)
    target = _model(1)
    msd = target.state_dict()
    into: dict[str, Any] = {"model": msd, "lr": 0.2}
    _load(backend, into, tmp_path)
    assert into["model"] is msd and into["lr"] == 0.1
    for k, v in target.state_dict().items():  # the module's own parameters received the values
        assert torch.equal(v, model.state_dict()[k]), k


# -- the 2-rank cases (tests/support/dcp_contract_worker.py): resharding on load into a checkpoint saved again and
# again, sharded <-> plain tensors, ranks listing their keys in another order with collectives in Stateful
