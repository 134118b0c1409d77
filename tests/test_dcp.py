"""alpsck.dcp: torch.distributed.checkpoint on the alpsck core, resharded by DCP's planner.

Real processes (gloo on CPU, tests/dcp_worker.py) save at world size 2 and load at world size 4;
the other tests load in this process at world size 1 (no process group) from a copy of that run.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dcp_worker import check, reference, template
from manifests import sealed
from torch.distributed.checkpoint.api import CheckpointException

from alpsck import Checkpointer, _core
from alpsck.dcp import METADATA_FILE, AlpsckStorageReader, AlpsckStorageWriter
from alpsck.dcp import load as alpsck_dcp_load
from alpsck.errors import (
    CorruptCheckpointError,
    NoCheckpointError,
    RunDirLockedError,
    UnsafeCheckpointError,
    UsageError,
)
from alpsck.store.values import decode_value
from alpsck.tools.inspect_checkpoints import inspect_checkpoints

WORKER = Path(__file__).with_name("dcp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(mode: str, run_dir: Path, world: int, script: Path = WORKER) -> list[str]:
    """Run ``script mode run_dir`` (the worker) on ``world`` ranks; every rank must exit 0. Returns their outputs."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(run_dir)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            outs.append(out)
    finally:
        for p in procs:  # a rank that failed leaves the others waiting in a collective
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{out}"
    return outs


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 5, 10, 15 saved at world size 2 (the last with keep_last=2, so step 5 is gone)."""
    run = tmp_path_factory.mktemp("dcp") / "run"
    outs = _ranks("save", run, 2)
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"]
    return run


@pytest.fixture
def run(saved: Path, tmp_path: Path) -> Path:
    """A private copy of the saved run, to damage."""
    dst = tmp_path / "run"
    shutil.copytree(saved, dst)
    return dst


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _load(run: Path, step: int | None = None) -> tuple[dict[str, Any], AlpsckStorageReader]:
    state = template()
    reader = AlpsckStorageReader(run, step)
    dcp.load(state, storage_reader=reader)
    return state, reader


def _root_cause(e: CheckpointException) -> BaseException:
    return next(iter(e.failures.values()))[0]


# ------------------------------------------------------------------------------ resharding


def test_saved_at_2_loads_at_4_resharded(saved: Path) -> None:
    """Four ranks load into DTensors sharded on other dims (Shard(1) for Shard(0), and back): bit for bit."""
    outs = _ranks("load", saved, 4)
    assert all(o.strip().splitlines()[-1].startswith(f"OK rank {r} step 15") for r, o in enumerate(outs)), outs


def test_saved_at_2_loads_at_1_into_plain_tensors(saved: Path) -> None:
    state, reader = _load(saved)
    assert reader.step == 15 and check(state, 15) == []
    state, reader = _load(saved, step=10)
    assert reader.step == 10 and check(state, 10) == []
    # the check can fail: another step's values differ
    assert check(state, 15) != []


def test_layout_is_an_ordinary_alpsck_checkpoint(saved: Path, capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    infos = _core.scan(str(saved), verify=True)
    assert [i["step"] for i in infos] == [10, 15]  # keep_last=2 removed step 5
    # The two ranks agreed through the process group's store: no rank wrote a DONE record, and
    # rank 0 read none (DONE records stay in a committed directory where ranks agree through files).
    assert not list(saved.glob("step-*/rank-*.done")), sorted(p.name for p in saved.glob("step-*/*"))
    probe = _core.Engine(str(tmp_path / "probe"))  # does this file system take O_DIRECT?
    direct = probe.direct_io
    probe.close()
    for i in infos:
        assert i["status"] == "committed" and i["verified"] and i["ranks"] == 2
        # The manifest tells how the ranks wrote (their DONE records say) and how long the save took.
        assert i["direct_io"] == direct and i["write_seconds"] > 0
        assert i["shards"] == ["rank-00000.bin", "rank-00001.bin"] and i["extra_files"] == [METADATA_FILE]
    assert (saved / "LATEST").read_text().strip() == "15"
    assert inspect_checkpoints(str(saved), verify=True, as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest_valid"] == 15 and [c["status"] for c in doc["checkpoints"]] == ["committed"] * 2
    # Extents are named by fqn and chunk offset; values are JSON documents, not pickles.
    names: dict[str, tuple[int, int]] = {}
    for r in range(2):
        reader = _core.ShardReader(str(saved / "step-000000015" / f"rank-{r:05d}.bin"))
        assert json.loads(reader.meta) == {"format": "alpsck-dcp/1", "step": 15, "rank": r, "world_size": 2}
        for name, _, size in reader.extents:
            names[name] = (r, size)
    assert names["model.w@0,0"] == (0, 5 * 6 * 4) and names["model.w@5,0"] == (1, 5 * 6 * 4)
    assert names["model.wb@0,0"][1] == 7 * 5 * 2 and names["model.wb@0,5"][1] == 7 * 4 * 2
    rank, size = names["extra.betas@json"]
    buf = torch.empty(size, dtype=torch.uint8)
    _core.ShardReader(str(saved / "step-000000015" / f"rank-{rank:05d}.bin")).read_into([("extra.betas@json", buf)])
    assert json.loads(buf.numpy().tobytes()) == {"format": "alpsck-dcp-value/1",
                                                 "value": {"__t": "tuple", "items": [0.9, 0.95]}}


# ------------------------------------------------------------------------------ damage


def _flip(shard: Path, offset: int = 3) -> None:
    with open(shard, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def test_bit_flip_in_a_shard_falls_back_within_one_dcp_load(run: Path) -> None:
    """A plain ``dcp.load`` (as torchtitan calls it) whose newest checkpoint's data fails its CRC loads the one
    before, with a warning naming the step and the chunk, over the values the damaged one had filled in; a
    pinned step, or fallback=False, raises the data failure instead."""
    _flip(run / "step-000000015" / "rank-00001.bin")
    assert [i["status"] for i in _core.scan(str(run), verify=True)] == ["committed", "corrupt"]
    with pytest.warns(RuntimeWarning, match=r"step-000000015 \(step 15: data_crc\): .*rank-00001.bin: CRC mismatch"):
        state, reader = _load(run)
    assert reader.step == 10 and check(state, 10) == [] and reader.path == run / "step-000000010"
    for pinned in ({"step": 15}, {"fallback": False}):
        with pytest.raises(CheckpointException) as e:
            dcp.load(template(), storage_reader=AlpsckStorageReader(run, **pinned))  # type: ignore[arg-type]
        assert isinstance(_root_cause(e.value), CorruptCheckpointError) and "CRC" in str(_root_cause(e.value))
    _flip(run / "step-000000010" / "rank-00000.bin")  # nothing valid left: the data failure of the last one tried
    with pytest.raises(CheckpointException, match=r"no valid DCP checkpoint \(skipped: .*15: data_crc: .*10: data_crc: .*CRC"):
        _load(run)


def test_alpsck_dcp_load_plans_again_for_a_fallback_saved_at_another_world_size(run: Path) -> None:
    """Step 10 saved again at world size 1 (one chunk per tensor), step 15 at 2 (DTensor shards) and damaged:
    step 10 cannot stand in for step 15's plan, so ``dcp.load`` raises naming why, and ``alpsck.dcp.load``
    plans again for it (the reader remembers step 15 failed) and returns 10."""
    shutil.rmtree(run / "step-000000010")
    dcp.save(reference(10), storage_writer=AlpsckStorageWriter(run, 10))
    _flip(run / "step-000000015" / "rank-00000.bin")
    with pytest.raises(CheckpointException, match="otherwise than the checkpoint whose data failed"):
        _load(run)
    state = template()
    reader = AlpsckStorageReader(run)
    with pytest.warns(RuntimeWarning, match=r"step 15: data_crc"):
        assert alpsck_dcp_load(state, storage_reader=reader) == 10
    assert check(state, 10) == []
    with pytest.raises(CheckpointException, match="CRC mismatch"):  # pinned: nothing is retried
        alpsck_dcp_load(template(), storage_reader=AlpsckStorageReader(run, 15))


def test_a_data_failure_on_one_rank_makes_every_rank_fall_back(run: Path) -> None:
    """Two ranks load in the sharding of the save, so only rank 0 reads its shard (its parts of ``w`` and
    ``wb``; rank 1's shard holds the values both read): the ranks agree through the store (no collective of
    their own inside DCP's read) and both load step 10, bit for bit; rank 1 names rank 0's failure."""
    _flip(run / "step-000000015" / "rank-00000.bin")
    outs = _ranks("same", run, 2)
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0 step 10", "OK rank 1 step 10"], outs
    assert "(step 15: data_crc)" in outs[0] and "rank-00000.bin: CRC mismatch" in outs[0], outs[0]
    assert "(step 15: unreadable): rank 0: " in outs[1] and "CRC mismatch" in outs[1], outs[1]


def test_bit_flip_in_the_metadata_falls_back(run: Path) -> None:
    md = run / "step-000000015" / METADATA_FILE
    data = bytearray(md.read_bytes())
    data[len(data) // 2] ^= 0x01
    md.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=METADATA_FILE):
        state, reader = _load(run)
    assert reader.step == 10 and check(state, 10) == []
    with pytest.raises(CorruptCheckpointError, match=METADATA_FILE):
        AlpsckStorageReader(run, 15).read_metadata()
    with pytest.raises(CheckpointException, match="CRC mismatch"):
        _load(run, step=15)


def _rewrite_metadata(run: Path, step: int, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Replace a checkpoint's dcp-metadata.json by an edited one, with the manifest's size and CRC updated to match."""
    d = run / f"step-{step:09d}"
    doc = json.loads((d / METADATA_FILE).read_bytes())
    data = edit(doc)
    data = data if isinstance(data, bytes) else json.dumps(doc).encode()
    (d / METADATA_FILE).write_bytes(data)
    manifest = json.loads((d / "MANIFEST.json").read_text())
    (entry,) = manifest["extra"]
    entry["bytes"], entry["crc"] = len(data), _core.crc32c(data)
    (d / "MANIFEST.json").write_bytes(sealed(manifest))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        *keys, last = path.split("/")
        node: Any = doc
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node[k]
        node[int(last) if isinstance(node, list) else last] = value
    return edit


def _overlap(doc: dict[str, Any]) -> None:
    doc["state_dict_metadata"]["model.w"]["chunks"][1][0] = [4, 0]  # rows 4..8 after rows 0..4


CRAFTED = {
    "dtype": (_set("state_dict_metadata/model.w/dtype", "float128"), UnsafeCheckpointError, r"\['model.w'\].dtype"),
    "type": (_set("state_dict_metadata/model.b/type", "pickle"), UnsafeCheckpointError, r"\['model.b'\].type"),
    "layout": (_set("state_dict_metadata/model.b/layout", "sparse_coo"), UnsafeCheckpointError, "layout"),
    "format": (_set("format", "alpsck-dcp-metadata/2"), UnsafeCheckpointError, "format"),
    "unknown field": (_set("reduce", "os.system"), UnsafeCheckpointError, "unknown field 'reduce'"),
    "huge size": (_set("state_dict_metadata/model.b/size", [2**40, 2**40]), CorruptCheckpointError, "exceeds"),
    "chunk outside": (_set("state_dict_metadata/model.w/chunks/1/1", [6, 6]), CorruptCheckpointError, "outside"),
    "overlap": (_overlap, CorruptCheckpointError, "overlap"),
    "not covered": (_set("state_dict_metadata/model.w/size", [11, 6]), CorruptCheckpointError, "hold 60 elements"),
    "chunk without rank": (_set("state_dict_metadata/model.emb/chunks/0", [[0, 0], [5, 3]]), CorruptCheckpointError,
                           r"chunks\[0\]: expected \[offsets, sizes, rank\]"),
    "rank": (_set("state_dict_metadata/model.b/chunks/0/2", 7), CorruptCheckpointError, r"chunks\[0\].rank: 7"),
    "bool as int": (_set("state_dict_metadata/extra.lr/bytes", True), CorruptCheckpointError, r"\['extra.lr'\].bytes"),
    "huge value": (_set("state_dict_metadata/extra.lr/bytes", 2**40), CorruptCheckpointError, "outside"),
    "value with chunks": (_set("state_dict_metadata/extra.lr/chunks", []), UnsafeCheckpointError, "unknown field 'chunks'"),
    "world size": (_set("world_size", 3), CorruptCheckpointError, "world_size"),
    "planner data": (_set("planner_data/model.w", [{"__reduce__": 1}]), CorruptCheckpointError, "planner_data"),
    "not json": (lambda doc: b"\x80\x04\x95pickle", CorruptCheckpointError, "not valid JSON"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_metadata_is_refused(run: Path, case: str) -> None:
    edit, error, field = CRAFTED[case]
    _rewrite_metadata(run, 15, edit)
    assert _core.scan(str(run))[-1]["status"] == "committed"  # the CRCs match: only validation stands in the way
    with pytest.raises(error, match=field):
        AlpsckStorageReader(run, 15).read_metadata()
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint"):
        assert AlpsckStorageReader(run).read_metadata() is not None
    if case == "dtype":  # and the newest-valid search falls back to step 10
        with pytest.warns(RuntimeWarning, match="float128"):
            state, reader = _load(run)
        assert reader.step == 10 and check(state, 10) == []


def test_extent_of_the_wrong_length_fails_the_load(run: Path) -> None:
    _rewrite_metadata(run, 15, _set("state_dict_metadata/extra.lr/bytes", 5))
    AlpsckStorageReader(run, 15).read_metadata()  # plausible on its own; the shard disagrees
    with pytest.raises(CheckpointException) as e:
        _load(run, step=15)
    assert isinstance(_root_cause(e.value), CorruptCheckpointError)
    assert "extent 'extra.lr@json' has" in str(_root_cause(e.value)) and "the metadata says 5" in str(_root_cause(e.value))


# ------------------------------------------------------------------------------ no pickle


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
    cause = _root_cause(e.value)
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


# ------------------------------------------------------------------------------ writer rules


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
    one can be made (a new path, an empty directory); checkpoint-directory mode: tests/test_dcp_named.py."""
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
        assert isinstance(_root_cause(e.value), RunDirLockedError)
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


def test_native_restore_of_a_dcp_checkpoint_points_to_the_reader(saved: Path) -> None:
    from alpsck.checkpointer import read_checkpoint

    with pytest.raises(CorruptCheckpointError, match="AlpsckStorageReader"):
        read_checkpoint(saved / "step-000000015", rank=0)


def test_bench_ranks_cli_json(tmp_path: Path) -> None:
    """``alpsck bench --ranks``: both backends at 1 rank on a tiny state; its scratch directory goes away."""
    cmd = [sys.executable, "-m", "alpsck", "bench", "--ranks", "1", "--size-gib", "0.005", "--repeats", "1",
           "--dcp-threads", "1", "--threads", "2", "--dir", str(tmp_path), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert [(m["ranks"], m["method"]) for m in doc["measurements"]] == [(1, "alpsck t=2"), (1, "dcp-fs t=1")]
    assert all(m["save_gbps"] > 0 and m["load_gbps"] > 0 and len(m["save_seconds"]) == 1 for m in doc["measurements"])
    assert doc["state_bytes"] > 0.005 * 2**30 * 0.5 and not list(tmp_path.iterdir())
