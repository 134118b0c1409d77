"""alpsck.dcp in checkpoint-directory mode: DCP's checkpoint_id names the checkpoint (``folder/step-N``).

What a torchtitan-shaped trainer does with DCP's FileSystemWriter must work the same with alpsck's
writer and reader: unpadded step names it chooses, discovery of the newest step by listing the
folder and looking for ``step-N/.metadata``, saving again over a step, reusing one writer and one
reader, and purging old steps with ``rmtree``. On top, what DCP's own writer does not give: an
overwrite that a crash at any point leaves either old or new, never torn, and a corrupt newest
checkpoint skipped for the last good one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.dcp_named import latest_step, load_named
from support.dcp_worker import check, reference, template
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from alpsck import Checkpointer, _core
from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter
from alpsck.errors import CorruptCheckpointError, NoCheckpointError, UsageError
from alpsck.store.names import MARKER_FILE, MARKER_FORMAT


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _old_purge(folder: Path, keep: int) -> None:
    """An older torchtitan purge: ``int(re.search(...).group(1))`` on every entry (crashes on a foreign
    one), then ``rmtree(ignore_errors=True)`` of all but the newest ``keep``."""
    steps = sorted(int(re.search(r"step-(\d+)", name).group(1)) for name in os.listdir(folder))  # type: ignore[union-attr]
    for step in steps[:-keep]:
        shutil.rmtree(folder / f"step-{step}", ignore_errors=True)


def test_torchtitan_naming_discovery_overwrite_and_purge(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    writer, reader = AlpsckStorageWriter(), AlpsckStorageReader()
    assert latest_step(folder) == -1
    for step in (1, 10, 20):
        dcp.save(reference(step), checkpoint_id=folder / f"step-{step}", storage_writer=writer)
        assert writer.checkpoint_id == str(folder / f"step-{step}")
    # The folder holds only the trainer's names; each has a .metadata where a DCP trainer looks.
    assert sorted(os.listdir(folder)) == ["step-1", "step-10", "step-20"]
    for step in (1, 10, 20):
        marker = json.loads((folder / f"step-{step}" / MARKER_FILE).read_bytes())
        assert marker["format"] == MARKER_FORMAT and marker["reader"] == "alpsck.dcp.AlpsckStorageReader"
    assert latest_step(folder) == 20
    assert check(load_named(folder / "step-20", reader), 20) == []
    assert check(load_named(folder / "step-10", reader), 10) == []  # the same reader, another id
    # Saving over step-10 (a resumed run reaching it again) replaces it: one generation stays.
    dcp.save(reference(11), checkpoint_id=folder / "step-10", storage_writer=writer)
    assert check(load_named(folder / "step-10", reader), 11) == []
    committed = [i for i in _core.scan(str(folder / "step-10")) if i["status"] == "committed"]
    assert [i["step"] for i in committed] == [2]
    # A reused reader without a new id sees what was committed since its last load.
    dcp.save(reference(12), checkpoint_id=folder / "step-10", storage_writer=writer)
    state = template()
    dcp.load(state, storage_reader=reader)
    assert check(state, 12) == []
    # The older torchtitan purge meets nothing but step-N entries, and rmtree removes a checkpoint whole.
    _old_purge(folder, keep=2)
    assert sorted(os.listdir(folder)) == ["step-10", "step-20"] and latest_step(folder) == 20
    # The trainer's folder is not itself mistaken for an alpsck run directory.
    assert not AlpsckStorageReader.validate_checkpoint_id(folder)
    assert not AlpsckStorageWriter.validate_checkpoint_id(folder)
    with Checkpointer(folder / "step-20", keep_last=0):  # no save left the lock behind
        pass


def test_a_new_checkpoint_directory_is_neither_listed_nor_retired_from(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What a save into a directory it made skips (on Lustre each is a metadata server's round trip): the
    listings that check what the directory holds and pick the next generation, and retention's scan (a first
    generation has none older). Saving over it again does both, and keeps the newest generation alone."""
    called: list[str] = []
    for name in ("scan", "retain_newest"):
        real = getattr(_core, name)
        monkeypatch.setattr(_core, name, lambda *a, _f=real, _n=name, **k: (called.append(_n), _f(*a, **k))[1])
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p=".": (real_listdir(p), called.append("listdir"))[0])  # one that lists
    ckpt = tmp_path / "checkpoint" / "step-10"
    dcp.save(reference(10), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    assert called == [] and check(load_named(ckpt, AlpsckStorageReader()), 10) == []
    called.clear()
    dcp.save(reference(11), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    assert {"scan", "retain_newest", "listdir"} <= set(called), called
    monkeypatch.undo()
    assert [i["step"] for i in _core.scan(str(ckpt)) if i["status"] == "committed"] == [2]
    assert check(load_named(ckpt, AlpsckStorageReader()), 11) == []


def test_overwrite_false_refuses_with_dcps_wording_and_foreign_checkpoints_are_left_alone(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-3"
    dcp.save(reference(3), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter(overwrite=False))
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(reference(4), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter(overwrite=False))
    assert check(load_named(ckpt), 3) == []
    # A FileSystemWriter checkpoint: alpsck neither writes over it nor unpickles its .metadata.
    fs = tmp_path / "fs" / "step-7"
    dcp.save(reference(7), storage_writer=FileSystemWriter(fs))
    before = {p.name: p.read_bytes() for p in fs.iterdir()}
    with pytest.raises(CheckpointException, match=r"a pickle: a FileSystemWriter checkpoint.*does not write over"):
        dcp.save(reference(8), checkpoint_id=fs, storage_writer=AlpsckStorageWriter())
    assert {p.name: p.read_bytes() for p in fs.iterdir()} == before
    with pytest.raises(CheckpointException) as refused:
        load_named(fs)
    # One line that names both ways on (DCP's own reader, or import-dcp), and no clause about use_collectives=False,
    # which DCP's second try (a rank's own checkpoint) would otherwise add.
    said = str(refused.value).strip().splitlines()[-1]
    assert f"load it with DCP's FileSystemReader, or convert it to alpsck's format in place: alpsck import-dcp {fs} " \
           "--trust-pickle" in said and "use_collectives" not in str(refused.value), said
    other = tmp_path / "notes"
    other.mkdir()
    (other / "README").write_text("mine")
    with pytest.raises(CheckpointException, match="holds files alpsck did not write"):
        dcp.save(reference(8), checkpoint_id=other, storage_writer=AlpsckStorageWriter())
    assert os.listdir(other) == ["README"]
    # The O_DIRECT probe file of a writer killed while it probed is alpsck's own, not a stranger's: the next
    # save writes over the checkpoint (CI once killed one there: tests/process/test_dcp_named_process.py).
    (ckpt / ".alpsck-probe-0-13870").write_bytes(b"\0" * 4096)
    dcp.save(reference(5), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    assert check(load_named(ckpt), 5) == []


def test_validate_checkpoint_id_follows_dcps_rules(tmp_path: Path) -> None:
    fs_folder = tmp_path / "titan"
    dcp.save(reference(1), storage_writer=FileSystemWriter(fs_folder / "step-10"))
    named = tmp_path / "mine" / "step-10"
    dcp.save(reference(1), checkpoint_id=named, storage_writer=AlpsckStorageWriter())
    (tmp_path / "empty").mkdir()
    W, R = AlpsckStorageWriter.validate_checkpoint_id, AlpsckStorageReader.validate_checkpoint_id
    # A writer may create a checkpoint where DCP's FileSystemWriter may: new paths under a writable dir,
    # an empty dir; and its own. Never over a directory of someone else's files, nor at a URL.
    assert W(named) and W(tmp_path / "new" / "deeper" / "step-1") and W(tmp_path / "empty")
    assert not W(fs_folder) and not W(fs_folder / "step-10") and not W("s3://bucket/step-1")
    # A reader only where alpsck's checkpoint is: the unpadded step-10 of a FileSystemWriter folder is not.
    assert R(named) and R(named / _core.step_dir_name(1))
    assert not R(fs_folder) and not R(fs_folder / "step-10") and not R(tmp_path / "empty")
    assert not R(tmp_path / "missing") and not R("s3://bucket/step-1")


def test_a_corrupt_named_checkpoint_falls_back_to_the_last_good_one(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    writer = AlpsckStorageWriter()
    for step in (10, 20, 30):
        dcp.save(reference(step), checkpoint_id=folder / f"step-{step}", storage_writer=writer)
    gen = folder / "step-30" / _core.step_dir_name(1)
    meta = gen / "dcp-metadata.json"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    meta.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match=r"step-30 held no valid checkpoint \(.*CRC mismatch\); loading .*step-20 instead"):
        reader = AlpsckStorageReader()
        assert check(load_named(folder / "step-30", reader), 20) == []
    assert reader.path is not None and reader.path.parent == folder / "step-20"
    # DCP wraps what read_metadata raised in its own AssertionError; alpsck's message is inside.
    with pytest.raises(CheckpointException, match=r"step-30: no valid DCP checkpoint \(skipped: .*CRC mismatch"):
        load_named(folder / "step-30", AlpsckStorageReader(fallback=False))
    # An older step named (torchtitan's load_step=20) that is damaged: that step or an error naming it, never step 10.
    meta20 = folder / "step-20" / _core.step_dir_name(1) / "dcp-metadata.json"
    meta20.write_bytes(meta20.read_bytes()[:-1])
    with pytest.raises(CheckpointException, match=r"step-20: no valid DCP checkpoint .*; step-20 was asked for by name "
                                                  r"\(the folder has newer: step-30\), so no older step is loaded"):
        load_named(folder / "step-20")
    with pytest.warns(RuntimeWarning, match=r"step-30 held no valid checkpoint .*; loading .*step-10 instead"):
        assert check(load_named(folder / "step-30"), 10) == []  # the newest still falls back, past step-20
    with pytest.raises(NoCheckpointError, match=r"step-30: no valid DCP checkpoint .*no valid one of a lower number"):
        AlpsckStorageReader(folder / "step-30", fallback=True).read_metadata() if _damage_all(folder) else None
    with pytest.raises(NoCheckpointError, match="step-99: no valid DCP checkpoint"):
        AlpsckStorageReader(folder / "step-99").read_metadata()


def test_a_named_checkpoint_whose_data_fails_or_is_gone_falls_back_to_the_one_before(tmp_path: Path) -> None:
    """torchtitan loads ``folder/step-N`` with a plain ``dcp.load``: a data chunk that fails its CRC there
    (found only while reading) and a marked checkpoint whose generations an interrupted purge removed each
    load the newest good sibling, with a warning naming the checkpoint and why; never an error that would
    stop every restart of the job."""
    folder = tmp_path / "ckpt"
    writer = AlpsckStorageWriter()
    for step in (10, 20, 30):
        dcp.save(reference(step), checkpoint_id=folder / f"step-{step}", storage_writer=writer)
    shard = folder / "step-30" / _core.step_dir_name(1) / "rank-00000.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x40
    shard.write_bytes(bytes(data))
    reader = AlpsckStorageReader()
    with pytest.warns(RuntimeWarning, match=r"step-30 held no valid checkpoint \(.*data_crc: .*CRC mismatch"):
        assert check(load_named(folder / "step-30", reader), 20) == []
    assert reader.path is not None and reader.path.parent == folder / "step-20"
    # An interrupted purge (torchtitan's rmtree) left the marker and the lock of step-30, and nothing else.
    for name in os.listdir(folder / "step-30"):
        if name not in (MARKER_FILE, ".lock"):
            shutil.rmtree(folder / "step-30" / name) if (folder / "step-30" / name).is_dir() else \
                (folder / "step-30" / name).unlink()
    with pytest.warns(RuntimeWarning, match=r"step-30 held no valid checkpoint \(no committed checkpoint\)"):
        assert check(load_named(folder / "step-30"), 20) == []
    # The next save to step-30 writes it anew over what the purge left.
    dcp.save(reference(30), checkpoint_id=folder / "step-30", storage_writer=writer)
    assert check(load_named(folder / "step-30"), 30) == []


def _damage_all(folder: Path) -> bool:
    """Truncate the DCP metadata of every checkpoint in ``folder``."""
    for meta in folder.glob("step-*/step-*/dcp-metadata.json"):
        meta.write_bytes(meta.read_bytes()[:-1])
    return True


def test_reader_without_a_checkpoint_names_the_argument(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="pass checkpoint_id= to dcp.load"):
        AlpsckStorageReader().read_metadata()
    w = AlpsckStorageWriter()
    with pytest.raises(UsageError, match="pass checkpoint_id= to dcp.save"):
        w.set_up_storage_writer(True, rank=0)
    with pytest.raises(UsageError, match="step= needs the run directory"):
        AlpsckStorageWriter(None, 3)


def test_run_dir_mode_is_unchanged_by_a_checkpoint_id_naming_it(tmp_path: Path) -> None:
    """``AlpsckStorageWriter(run, 5)`` with checkpoint_id the run dir or its own step dir keeps the padded
    layout beside the Checkpointer's; another id switches that writer to checkpoint-directory mode."""
    run = tmp_path / "run"
    dcp.save(reference(5), checkpoint_id=run, storage_writer=AlpsckStorageWriter(run, 5))
    w = AlpsckStorageWriter(run, 6)
    dcp.save(reference(6), checkpoint_id=run / _core.step_dir_name(6), storage_writer=w)
    assert sorted(i["step"] for i in _core.scan(str(run))) == [5, 6]
    dcp.save(reference(7), checkpoint_id=tmp_path / "elsewhere", storage_writer=w)
    assert w.named and check(load_named(tmp_path / "elsewhere"), 7) == []
    assert check(load_named(run / _core.step_dir_name(5)), 5) == []  # a committed step names itself


def test_a_corrupt_overwrite_is_never_loaded_in_place_of_a_good_generation(tmp_path: Path) -> None:
    """Two generations left by a kill between commit and clean-up, the newer damaged: the older loads."""
    ckpt = tmp_path / "step-4"
    dcp.save(reference(4), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    keep = tmp_path / "gen1"
    shutil.copytree(ckpt / _core.step_dir_name(1), keep)
    dcp.save(reference(5), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    shutil.copytree(keep, ckpt / _core.step_dir_name(1))  # as if the kill came before retention
    shard = ckpt / _core.step_dir_name(2) / "dcp-metadata.json"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint"):
        assert check(load_named(ckpt), 4) == []
    with pytest.raises(CorruptCheckpointError):
        AlpsckStorageReader(ckpt, 2).read_metadata()


def test_bytes_and_bytesio_values_round_trip_without_any_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's state: a dataloader's per-rank bytes (a pickle the dataloader itself reads) and a
    train state of BytesIO buffers. They come back as bytes and BytesIO, and loading unpickles nothing."""
    import io
    import pickle

    losses = io.BytesIO()
    torch.save([1.5, 2.25], losses)
    losses.seek(3)  # a position other than 0: the whole buffer is saved, and restored at 0
    blob = pickle.dumps({"epoch": 3, "offset": 17})
    sd = {"model.w": torch.arange(6.0), "dataloader": {"dp_rank_0": blob, "world_size": 1},
          "train_state": {"step": torch.tensor(40), "global_avg_losses": losses, "log_steps": io.BytesIO(b"")},
          "lr_scheduler": {"last_epoch": 40, "base_lrs": [3e-4], "warmup": None}}
    dcp.save(sd, checkpoint_id=tmp_path / "step-40", storage_writer=AlpsckStorageWriter())

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pickle was loaded")

    for target, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, name, refuse)
    state: dict[str, Any] = {"model.w": torch.zeros(6), "dataloader": {"dp_rank_0": b"", "world_size": 0},
                             "train_state": {"step": torch.tensor(0), "global_avg_losses": io.BytesIO(),
                                             "log_steps": io.BytesIO()},
                             "lr_scheduler": {"last_epoch": 0, "base_lrs": [0.0], "warmup": 1}}
    dcp.load(state, checkpoint_id=tmp_path / "step-40", storage_reader=AlpsckStorageReader())
    monkeypatch.undo()
    assert torch.equal(state["model.w"], torch.arange(6.0)) and int(state["train_state"]["step"]) == 40
    assert state["dataloader"] == {"dp_rank_0": blob, "world_size": 1}
    got = state["train_state"]["global_avg_losses"]
    assert isinstance(got, io.BytesIO) and got.tell() == 0 and got.getvalue() == losses.getvalue()
    assert torch.load(got, weights_only=False) == [1.5, 2.25]  # the trainer's own unpickling, as it does
    assert isinstance(state["train_state"]["log_steps"], io.BytesIO) and state["train_state"]["log_steps"].getvalue() == b""
    assert state["lr_scheduler"] == {"last_epoch": 40, "base_lrs": [3e-4], "warmup": None}


def test_a_planner_with_its_own_load_bytes_gets_the_value_as_dcp_would_give_it(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    seen: list[Any] = []

    class Recording(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            seen.append((read_item.dest_index.fqn, torch.load(value, weights_only=True)))
            super().load_bytes(read_item, (value.seek(0), value)[1])

    dcp.save({"w": torch.ones(2), "lr": 0.5, "name": "adamw"}, checkpoint_id=tmp_path / "c",
             storage_writer=AlpsckStorageWriter())
    state: dict[str, Any] = {"w": torch.zeros(2), "lr": 0.0, "name": ""}
    dcp.load(state, checkpoint_id=tmp_path / "c", storage_reader=AlpsckStorageReader(), planner=Recording())
    assert sorted(seen) == [("lr", 0.5), ("name", "adamw")] and state["lr"] == 0.5 and state["name"] == "adamw"


def test_symlinks_at_the_markers_names_never_lead_a_write_outside(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    for name in (".metadata", ".metadata.tmp"):
        ckpt = tmp_path / f"ck{name}"
        ckpt.mkdir()
        (ckpt / name).symlink_to(outside)
        with pytest.raises(CheckpointException):
            dcp.save(reference(1), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
        assert outside.read_text() == "precious" and (ckpt / name).is_symlink()


def test_resolve_data_is_called_lazily_one_item_at_a_time(tmp_path: Path) -> None:
    """DCP's contract: a planner's resolve_data may allocate, so a writer calls it as it writes. With a
    planner that clones every tensor it resolves, at most the items of one chunk are alive at once, and
    the checkpoint is bit for bit the state."""
    import weakref

    from torch.distributed.checkpoint import DefaultSavePlanner

    alive: set[int] = set()
    most = 0

    class Cloning(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            nonlocal most
            data = super().resolve_data(write_item)
            if isinstance(data, torch.Tensor):
                data = data.clone()
                alive.add(id(data))
                weakref.finalize(data, alive.discard, id(data))
                most = max(most, len(alive))
            return data

    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(256, 300, generator=g) for i in range(8)}  # 300 KiB each, 64 KiB chunks
    sd["t"] = torch.randn(40, 30, generator=g).t()  # a view: resolved through the slots too
    dcp.save(sd, checkpoint_id=tmp_path / "c", storage_writer=AlpsckStorageWriter(chunk_bytes=64 << 10),
             planner=Cloning())
    assert 1 <= most <= 2, most
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    into["t"] = torch.zeros(30, 40)
    dcp.load(into, checkpoint_id=tmp_path / "c", storage_reader=AlpsckStorageReader())
    for k, v in sd.items():
        assert torch.equal(into[k], v), k


def test_a_run_directory_never_falls_back_to_another_run(tmp_path: Path) -> None:
    """runs/exp2 with every checkpoint corrupt must not load runs/exp1: only checkpoint directories
    (alpsck's .metadata marker) fall back to a lower-numbered sibling."""
    for name, step in (("exp1", 1), ("exp2", 2)):
        dcp.save(reference(step), storage_writer=AlpsckStorageWriter(tmp_path / name, step))
    _damage_all_runs(tmp_path / "exp2")
    with pytest.raises(NoCheckpointError, match="exp2: no valid DCP checkpoint"):
        AlpsckStorageReader(tmp_path / "exp2").read_metadata()


def _damage_all_runs(run: Path) -> None:
    for meta in run.glob("step-*/dcp-metadata.json"):
        meta.write_bytes(meta.read_bytes()[:-1])


def test_a_new_checkpoint_directory_is_made_durable_in_its_parent(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit fsyncs inside the checkpoint directory; the directory's own name, new at every save,
    must be durable too, or a power loss could take a committed checkpoint with it. The writer hands the
    directories holding the new names to its engine, which syncs them while the shard is written, before
    the shard counts as durable (cpp/core/dir_sync.h; the C++ tests show the order, tests/process the
    failure)."""
    given: list[list[str]] = []
    real = _core.Engine

    def engine(*args: Any, **kwargs: Any) -> Any:
        given.append(list(kwargs.get("unsynced_dirs", [])))
        return real(*args, **kwargs)

    monkeypatch.setattr(_core, "Engine", engine)
    ckpt = tmp_path / "new" / "folder" / "step-1"
    dcp.save(reference(1), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    assert given == [[str(tmp_path), str(tmp_path / "new"), str(tmp_path / "new" / "folder")]]
    given.clear()
    dcp.save(reference(2), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())  # exists: nothing to do
    assert given == [[]]


def test_an_empty_checkpoint_id_is_refused_not_the_current_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Path("") is the current directory: an unset variable in a trainer's checkpoint path wrote a
    checkpoint there. The writer and the reader refuse an empty path, built or given to dcp."""
    monkeypatch.chdir(tmp_path)
    for build in (AlpsckStorageWriter, AlpsckStorageReader):
        with pytest.raises(UsageError, match="the checkpoint path is empty; give a directory"):
            build("")
    with pytest.raises(UsageError, match="dcp.save's checkpoint_id: the checkpoint path is empty"):
        dcp.save({"a": torch.ones(3)}, storage_writer=AlpsckStorageWriter(), checkpoint_id="")
    with pytest.raises(UsageError, match="dcp.load's checkpoint_id: the checkpoint path is empty"):
        dcp.load({"a": torch.ones(3)}, storage_reader=AlpsckStorageReader(), checkpoint_id="")
    assert os.listdir(tmp_path) == []


def test_a_save_that_fails_at_its_commit_leaves_the_directory_unmarked(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker's temp file is written while the shard is (off the save's critical path), and put in
    place only after the commit: a save that fails at its commit leaves no ``.metadata`` that would make
    a trainer (torchtitan looks for one) take the folder for a checkpoint. The next save marks it."""
    import alpsck.dcp.writer

    real = _core.commit_step

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(5, "injected: the commit failed")

    ckpt = tmp_path / "step-1"
    monkeypatch.setattr(alpsck.dcp.writer._core, "commit_step", fail)
    with pytest.raises(CheckpointException, match="injected"):
        dcp.save(reference(1), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    assert not (ckpt / MARKER_FILE).exists()
    monkeypatch.setattr(alpsck.dcp.writer._core, "commit_step", real)
    dcp.save(reference(1), checkpoint_id=ckpt, storage_writer=AlpsckStorageWriter())
    assert json.loads((ckpt / MARKER_FILE).read_text())["format"] == MARKER_FORMAT
    assert not (ckpt / (MARKER_FILE + ".tmp")).exists()
    assert check(load_named(ckpt), 1) == []
