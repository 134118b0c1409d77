"""``alpsck import-dcp`` (alpsck.dcp.convert): FileSystemWriter checkpoints become alpsck ones, in place.

Sharded checkpoints of 2 ranks convert into one-shard alpsck checkpoints that load resharded at 2
ranks and at 1; without ``--trust-pickle`` nothing is read past a byte; an import stopped before, in
the middle of, or after its swap leaves one whole checkpoint under the name (or the original whole
aside) and the same command finishes it. torchtitan's own manager on it: test_torchtitan_release.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support import SUPPORT
from support.dcp_worker import check, reference
from support.ranks import run_ranks

from alpsck.cli import main
from alpsck.dcp import AlpsckStorageReader, AlpsckStorageWriter, convert
from alpsck.dcp.convert import import_dcp, is_filesystemwriter_checkpoint
from alpsck.dcp.paths import is_alpsck_checkpoint_id
from alpsck.errors import UsageError

WORKER = SUPPORT / "dcp_import_worker.py"


@pytest.fixture(autouse=True)
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.fixture(scope="module")
def saved_2_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step-5 and step-10 written by FileSystemWriter at 2 ranks, DTensors sharded (never changed: copy it)."""
    folder = tmp_path_factory.mktemp("fsw") / "checkpoint"
    outs = run_ranks("save", folder, 2, script=WORKER)
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"]
    assert sorted(n for n in os.listdir(folder / "step-10") if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    return folder


@pytest.fixture()
def folder(saved_2_ranks: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved_2_ranks, tmp_path / "checkpoint")
    return tmp_path / "checkpoint"


def _load(step_dir: Path) -> dict[str, Any]:
    state = {"model": {k: torch.zeros_like(v) for k, v in reference(0)["model"].items()},
             "step_t": torch.tensor(-1), "extra": dict.fromkeys(reference(0)["extra"])}
    dcp.load(state, checkpoint_id=str(step_dir), storage_reader=AlpsckStorageReader(fallback=False))
    return state


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_2_rank_sharded_checkpoint_converts_and_loads_resharded_at_2_ranks_and_at_1(folder: Path) -> None:
    original = _snapshot(folder / "step-10")
    done = import_dcp(folder, trust_pickle=True)
    assert [(c.path.name, c.action) for c in done] == [("step-5", "converted"), ("step-10", "converted")]
    assert "2 shard files" in done[1].detail
    for name in ("step-5", "step-10"):
        assert is_alpsck_checkpoint_id(folder / name) and not is_filesystemwriter_checkpoint(folder / name)
    assert sorted(os.listdir(folder)) == [".alpsck-import", "step-10", "step-5"]
    kept = folder / ".alpsck-import" / "step-10.filesystemwriter"
    assert done[1].original == kept and _snapshot(kept) == original  # the original, as it was
    outs = run_ranks("load", folder, 2, script=WORKER)
    assert [o.strip().splitlines()[-1] for o in outs] == ["OK rank 0", "OK rank 1"]
    assert check(_load(folder / "step-5"), 5) == [] and check(_load(folder / "step-10"), 10) == []
    # the planner data (the nesting of the keys) is the original's
    from torch.distributed.checkpoint import FileSystemReader
    before = FileSystemReader(str(kept)).read_metadata()
    after = AlpsckStorageReader(str(folder / "step-10")).read_metadata()
    assert after.planner_data == before.planner_data
    assert set(after.state_dict_metadata) == set(before.state_dict_metadata)


def test_without_trust_pickle_it_refuses_in_one_line_naming_the_risk_and_reads_nothing(
        folder: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    before = _snapshot(folder)

    def no_unpickling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unpickled without --trust-pickle")

    monkeypatch.setattr("pickle.load", no_unpickling)
    monkeypatch.setattr("pickle.loads", no_unpickling)
    monkeypatch.setattr(torch, "load", no_unpickling)
    assert main(["import-dcp", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "step-5" in err and "step-10" in err
    assert "runs any code" in err and "--trust-pickle" in err
    assert main(["import-dcp", str(folder / "step-10")]) == 2
    assert _snapshot(folder) == before and sorted(os.listdir(folder)) == ["step-10", "step-5"]


def test_alpsck_checkpoints_are_skipped_and_a_second_run_says_converted_before(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(folder / "step-20"), storage_writer=AlpsckStorageWriter())
    (folder / "notes").mkdir()
    assert main(["import-dcp", str(folder), "--trust-pickle"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["converted", "converted", "skipped"]
    assert "original kept at" in lines[0] and "an alpsck checkpoint" in lines[2]
    assert main(["import-dcp", str(folder), "--trust-pickle"]) == 0  # nothing to unpickle: no risk either
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["already", "already", "skipped"]
    assert main(["import-dcp", str(folder), "--delete-original"]) == 0  # removing needs no trust
    assert sorted(os.listdir(folder)) == ["notes", "step-10", "step-20", "step-5"]
    assert check(_load(folder / "step-10"), 10) == []


def test_delete_original_removes_each_once_its_conversion_is_durable(folder: Path) -> None:
    done = import_dcp(folder / "step-10", trust_pickle=True, delete_original=True)
    assert [(c.action, c.original) for c in done] == [("converted", None)]
    assert sorted(os.listdir(folder)) == ["step-10", "step-5"]  # .alpsck-import is gone once empty
    assert is_filesystemwriter_checkpoint(folder / "step-5") and check(_load(folder / "step-10"), 10) == []


def test_stopped_between_the_two_renames_the_original_is_whole_aside_and_a_rerun_finishes(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The original goes aside, then the new one takes the name: a kill between leaves the original whole."""
    original = _snapshot(folder / "step-10")
    real_rename = os.rename

    def stop_at_the_second(src: Any, dst: Any) -> None:
        if str(src).endswith(".alpsck"):
            raise KeyboardInterrupt  # the process dies here
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        import_dcp(folder / "step-10", trust_pickle=True)
    monkeypatch.setattr(os, "rename", real_rename)
    kept = folder / ".alpsck-import" / "step-10.filesystemwriter"
    assert not (folder / "step-10").exists() and _snapshot(kept) == original
    with pytest.raises(UsageError, match="trust-pickle"):  # the rerun unpickles the original aside: same opt-in
        import_dcp(folder, trust_pickle=False)
    done = import_dcp(folder, trust_pickle=True)
    assert [(c.path.name, c.action) for c in done] == [("step-5", "converted"), ("step-10", "resumed")]
    assert check(_load(folder / "step-10"), 10) == [] and _snapshot(kept) == original


def test_stopped_before_the_swap_the_original_keeps_its_name_and_a_rerun_starts_again(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = _snapshot(folder / "step-10")
    real = convert._same

    def stop(a: Any, b: Any) -> bool:
        raise KeyboardInterrupt  # while verifying: the new one is written, not yet swapped in

    monkeypatch.setattr(convert, "_same", stop)
    with pytest.raises(KeyboardInterrupt):
        import_dcp(folder / "step-10", trust_pickle=True)
    assert _snapshot(folder / "step-10") == original and (folder / ".alpsck-import" / "step-10.alpsck").is_dir()
    monkeypatch.setattr(convert, "_same", real)
    assert [c.action for c in import_dcp(folder / "step-10", trust_pickle=True)] == ["converted"]
    assert os.listdir(folder / ".alpsck-import") == ["step-10.filesystemwriter"]
    assert check(_load(folder / "step-10"), 10) == []


def test_a_conversion_that_reads_back_differently_is_never_swapped_in(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = _snapshot(folder / "step-10")
    monkeypatch.setattr(convert, "_same", lambda a, b: False)
    with pytest.raises(UsageError, match="differs from the original"):
        import_dcp(folder / "step-10", trust_pickle=True)
    assert _snapshot(folder / "step-10") == original


def test_the_command_is_listed_with_its_risk_in_its_help() -> None:
    p = subprocess.run([sys.executable, "-m", "alpsck", "import-dcp", "--help"], capture_output=True, text=True,
                       timeout=120)
    text = " ".join(p.stdout.split())  # argparse wraps at the terminal's width
    assert p.returncode == 0 and "--trust-pickle" in text and "runs any code" in text
