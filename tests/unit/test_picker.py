"""One picker: every reader of a run directory agrees on which checkpoint a restore uses.

Each test builds a run directory in a state where the readers used to disagree (D1-D5 below) and asks
every one of them: ``restore_into``, ``Checkpointer.restore``, ``Checkpointer.latest_step``, ``peek``
(quick and ``verify=True``), ``inspect-checkpoints --json`` (``latest_valid``, ``skipped``) and its
table's ``*``, with and without ``--verify``, the SLURM runner's ``newest_step``, ``export`` and the DCP
reader. The rule they share is :func:`alpsck.store.picker.pick` (docs/guarantees.md, "Which checkpoint
a restore uses"). The quick ones (no data CRC read: ``*`` and ``latest_valid`` without ``--verify``,
``newest_step``, ``latest_step``, ``peek()``) say what a restore *tries first*; the ones that read data
say what it *uses*; both are asserted.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.corrupt import flip_byte
from torch.distributed.checkpoint.api import CheckpointException

import alpsck
import alpsck.dcp
from alpsck import _core, cli
from alpsck.checkpointer import peek, restore_into
from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter
from alpsck.errors import NoCheckpointError
from alpsck.slurm.runner import newest_step
from alpsck.tools.export import export_checkpoint

N = 4096  # floats per tensor: byte 100 of a shard is tensor data


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((N,), float(step)), "at": step}


def _ck_save(run: Path, *steps: int) -> None:
    with alpsck.Checkpointer(run) as ck:
        for s in steps:
            ck.save(s, _state(s)).wait()


def _dcp_save(run: Path, step: int) -> None:
    dcp.save({"w": torch.full((N,), float(step))}, storage_writer=AlpsckStorageWriter(run, step))


def _step_dir(run: Path, step: int) -> Path:
    return run / _core.step_dir_name(step)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _marked(out: str) -> int | None:
    """The step of the table row marked '*'."""
    rows = [line for line in out.splitlines() if line.startswith("*") and not line.startswith("* =")]
    assert len(rows) <= 1, out
    return int(rows[0].split()[1]) if rows else None


def _inspect(capsys: pytest.CaptureFixture[str], run: Path, verify: bool) -> dict[str, Any]:
    extra = ["--verify"] if verify else []
    _, out, _ = _cli(capsys, "inspect-checkpoints", str(run), "--json", *extra)
    doc = json.loads(out)
    _, table, _ = _cli(capsys, "inspect-checkpoints", str(run), *extra)
    doc["marked"] = _marked(table)
    doc["note"] = next(line for line in table.splitlines() if line.startswith("* ="))
    return doc


def _ck_pickers(run: Path, capsys: pytest.CaptureFixture[str], tmp: Path) -> dict[str, Any]:
    """What every reader of Checkpointer checkpoints says of ``run`` (steps; warnings apart)."""
    got: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = _state(0)
        got["restore_into"] = restore_into(run, state)
        assert state["w"][0].item() == got["restore_into"] and state["at"] == got["restore_into"]
        got["peek"] = peek(run)["at"]
        got["peek_verify"] = peek(run, verify=True)["at"]
        out = tmp / "export.pt"
        got["export"] = export_checkpoint(str(run), str(out))["step"]
        # Checkpointer opens the run directory as its writer: on a copy, so the others see it as it was.
        copy = tmp / "copy"
        shutil.copytree(run, copy, symlinks=True)
        with alpsck.Checkpointer(copy) as ck:
            got["latest_step"] = ck.latest_step()
            state = _state(0)
            got["restore"] = ck.restore(state)
            assert state["at"] == got["restore"]
        shutil.rmtree(copy)
    got["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    got["newest_step"] = newest_step(str(run))
    quick, verified = _inspect(capsys, run, False), _inspect(capsys, run, True)
    # .get: so that on a build without the key the agreement assertions are what fail
    got["inspect"], got["inspect_mark"], got["inspect_skipped"] = quick["latest_valid"], quick["marked"], quick.get("skipped")
    got["inspect_note"] = quick["note"]
    got["inspect_verify"], got["inspect_verify_mark"] = verified["latest_valid"], verified["marked"]
    got["inspect_verify_skipped"] = verified.get("skipped")
    return got


QUICK = ("peek", "latest_step", "newest_step", "inspect", "inspect_mark")
USES = ("restore_into", "restore", "peek_verify", "export", "inspect_verify", "inspect_verify_mark")


def _agree(got: dict[str, Any], keys: tuple[str, ...], step: int) -> None:
    assert {k: got[k] for k in keys} == dict.fromkeys(keys, step), got


def _dcp_load(checkpoint_id: Path | None = None, reader: AlpsckStorageReader | None = None) -> tuple[int, float, list[str]]:
    """(step loaded, the value loaded, warnings) through alpsck.dcp.load."""
    state = {"w": torch.zeros(N)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = _load(state, checkpoint_id, reader)
    return step, state["w"][0].item(), [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _load(state: dict[str, Any], checkpoint_id: Path | None, reader: AlpsckStorageReader | None) -> int:
    """alpsck.dcp.load (where a build lacks it: dcp.load, so that a test fails on its assertions)."""
    load = getattr(alpsck.dcp, "load", None)
    if load is not None:
        return int(load(state, checkpoint_id, storage_reader=reader))
    reader = reader or AlpsckStorageReader(checkpoint_id)
    dcp.load(state, checkpoint_id=checkpoint_id, storage_reader=reader)
    return int(reader.step or -1)


# ----------------------------------------------------------------------------- D1


@pytest.mark.parametrize("attempt", [".aborted", ".tmp", ".a1.aborted"])
def test_d1_an_attempt_beside_a_committed_step_is_irrelevant(tmp_path: Path, attempt: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Attempt 0's step-2.aborted is kept until every rank saw it while attempt 1 commits step 2: step 2 is
    committed, and every reader picks it (restore_into and peek used to pick 1, silently)."""
    run = tmp_path / "run"
    _ck_save(run, 1, 2)
    (run / f"{_core.step_dir_name(2)}{attempt}").mkdir()
    got = _ck_pickers(run, capsys, tmp_path)
    _agree(got, QUICK + USES, 2)
    assert got["warnings"] == [] and got["inspect_skipped"] == [] and got["inspect_verify_skipped"] == [], got
    p = alpsck.store.picker.pick(run)
    assert (p.step, p.skipped, p.steps) == (2, (), [2, 1])


def test_d1_an_attempt_alone_is_skipped_as_incomplete_or_aborted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ck_save(run, 1)
    (run / _core.tmp_dir_name(3, 0)).mkdir()
    (run / f"{_core.step_dir_name(2)}.aborted").mkdir()
    p = alpsck.store.picker.pick(run)
    assert p.step == 1 and [(k.step, k.reason) for k in p.skipped] == [(3, "incomplete"), (2, "aborted")]


# ----------------------------------------------------------------------------- D2


def test_d2_a_data_crc_failure_is_what_restore_skips_and_quick_pickers_say_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 2's tensor bytes are damaged: everything that reads data uses step 1; the quick readers name
    step 2 as what a restore tries first, and say so (inspect's note)."""
    run = tmp_path / "run"
    _ck_save(run, 1, 2)
    flip_byte(_step_dir(run, 2) / "rank-00000.bin", 100)
    got = _ck_pickers(run, capsys, tmp_path)
    _agree(got, USES, 1)
    _agree(got, QUICK, 2)
    assert "tries first" in got["inspect_note"] and "data CRCs not checked" in got["inspect_note"], got
    assert got["inspect_skipped"] == []
    assert [(k["step"], k["reason"]) for k in got["inspect_verify_skipped"]] == [(2, "data_crc")], got
    assert any("step 2" in w or _core.step_dir_name(2) in w for w in got["warnings"]), got
    p = alpsck.store.picker.pick(run, verify_data=True)
    assert p.step == 1 and [(k.step, k.reason) for k in p.skipped] == [(2, "data_crc")]
    assert "CRC mismatch" in p.skipped[0].message


# ----------------------------------------------------------------------------- D3


def test_d3_mixed_kinds_each_reader_picks_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpointer step 1, AlpsckStorageWriter step 2: the Checkpointer's readers use 1 and say step 2 is
    another kind (restore_into used to call it corrupt); the DCP reader uses 2."""
    run = tmp_path / "run"
    _ck_save(run, 1)
    _dcp_save(run, 2)
    got = _ck_pickers(run, capsys, tmp_path)
    _agree(got, ("restore_into", "restore", "peek", "peek_verify", "export", "latest_step"), 1)
    assert got["warnings"] and all("other_kind" in w and "DCP" in w for w in got["warnings"]), got
    assert not any("corrupt" in w for w in got["warnings"]), got
    # inspect and the runner list any kind: the newest of them all.
    _agree(got, ("inspect", "inspect_mark", "inspect_verify", "newest_step"), 2)
    assert _dcp_load(run)[:2] == (2, 2.0)


def test_d3_reverse_the_dcp_reader_says_why_it_skipped_a_checkpointer_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _dcp_save(run, 1)
    _ck_save(run, 2)
    step, value, warned = _dcp_load(run)
    assert (step, value) == (1, 1.0)
    assert len(warned) == 1 and "other_kind" in warned[0] and _core.step_dir_name(2) in warned[0], warned
    assert restore_into(run, _state(0)) == 2 and peek(run)["at"] == 2
    p = alpsck.store.picker.pick(run, kind="dcp")
    assert p.step == 1 and [(k.step, k.reason) for k in p.skipped] == [(2, "other_kind")]


# ----------------------------------------------------------------------------- D4


def test_d4_dcp_data_crc_falls_back_to_the_step_before(tmp_path: Path) -> None:
    """The damage is found only while reading (every rank already planned the load): a plain dcp.load falls
    back within its read to step 1, as alpsck.dcp.load does; a reader with verify_data=True checks the
    CRCs before planning and picks step 1 at once; a pinned step raises."""
    run = tmp_path / "run"
    _dcp_save(run, 1)
    _dcp_save(run, 2)
    flip_byte(_step_dir(run, 2) / "rank-00000.bin", 100)
    state = {"w": torch.zeros(N)}
    with pytest.warns(RuntimeWarning, match="data_crc"):
        dcp.load(state, storage_reader=(reader := AlpsckStorageReader(run)))
    assert reader.step == 1 and state["w"][0].item() == 1.0
    step, value, warned = _dcp_load(run)
    assert (step, value) == (1, 1.0)
    assert len(warned) == 1 and "data_crc" in warned[0] and _core.step_dir_name(2) in warned[0], warned
    with pytest.warns(RuntimeWarning, match="data_crc"):
        dcp.load(state, storage_reader=(reader := AlpsckStorageReader(run, verify_data=True)))
    assert reader.step == 1 and state["w"][0].item() == 1.0
    with pytest.raises(CheckpointException):  # a pinned step is never swapped for another
        _load({"w": torch.zeros(N)}, None, AlpsckStorageReader(run, 2))


# ----------------------------------------------------------------------------- D5


@pytest.mark.parametrize("damage", ["manifest", "data", "tmp"])
def test_d5_checkpoint_directory_mode_falls_back_to_the_sibling(tmp_path: Path, damage: str) -> None:
    """folder/step-20's only generation: manifest gone, data damaged, or renamed to .tmp: step-10 is loaded."""
    folder = tmp_path / "checkpoint"
    for step in (10, 20):
        dcp.save({"w": torch.full((N,), float(step))}, checkpoint_id=folder / f"step-{step}",
                 storage_writer=AlpsckStorageWriter())
    named = folder / "step-20"
    (gen,) = [p for p in named.iterdir() if alpsck.store.names.entry_kind(p.name) == "step"]
    if damage == "manifest":
        (gen / "MANIFEST.json").unlink()
    elif damage == "data":
        flip_byte(gen / "rank-00000.bin", 100)
    else:
        gen.rename(named / _core.tmp_dir_name(_core.parse_run_dir_name(gen.name)[1], 0))
    state = {"w": torch.zeros(N)}
    reader = AlpsckStorageReader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load(state, named, reader)
    assert state["w"][0].item() == 10.0 and reader.path is not None and reader.path.parent == folder / "step-10"
    assert any(str(named) in str(w.message) and "step-10" in str(w.message) for w in caught), [str(w.message) for w in caught]


# ----------------------------------------------------------------------------- the rest


def test_a_missing_run_dir_is_no_checkpoint_for_every_reader(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    with pytest.raises(NoCheckpointError, match="no such directory"):
        peek(gone)
    with pytest.raises(NoCheckpointError, match="no such directory"):  # was CheckpointIOError
        restore_into(gone, _state(0))
    assert newest_step(str(gone)) is None
    with pytest.raises(NoCheckpointError, match="no such directory"):
        alpsck.store.picker.pick(gone)


def test_world_size_and_step_and_max_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ck_save(run, 1, 2, 3)
    pick = alpsck.store.picker.pick
    assert pick(run, max_step=2).steps == [2, 1] and pick(run, step=2).steps == [2]
    assert pick(run, step=5).step is None and pick(run, step=5).skipped == ()
    p = pick(run, world_size=2)
    assert p.step is None and [(k.step, k.reason) for k in p.skipped] == [(3, "other_world"), (2, "other_world"),
                                                                          (1, "other_world")]
    (_step_dir(run, 3) / "MANIFEST.json").unlink()
    assert [(k.step, k.reason) for k in pick(run).skipped] == [(3, "damaged")]
    (_step_dir(run, 2) / "rank-00000.bin").write_bytes(b"short")
    assert [(k.step, k.reason) for k in pick(run).skipped] == [(3, "damaged"), (2, "corrupt")]
    with pytest.raises(alpsck.errors.UsageError):
        pick(run, kind="torch")
