"""``alpsck://`` (alpsck/integrations/fsspec_fs.py, alpsck/store/summed.py): fsspec finds it by its entry point;
DCP's fsspec writer and reader and its Hugging Face safetensors writer and reader reach it; every file lands
whole with its CRC32C; a damaged, truncated or unsummed file is refused by name, by the readers and by
``inspect-checkpoints --verify``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from support.corrupt import flip_byte
from support.dcp_errors import root_cause
from support.inspect_runs import run_cli
from torch.distributed.checkpoint.api import CheckpointException

from alpsck.errors import CorruptCheckpointError, UsageError
from alpsck.integrations.fsspec_fs import AlpsckFileSystem
from alpsck.integrations.hf_storage import AlpsckHuggingFaceStorageReader, AlpsckHuggingFaceStorageWriter
from alpsck.store import summed

pytestmark = pytest.mark.usefixtures("dcp_quiet")
CapSys = pytest.CaptureFixture[str]
HF_FILE = "model-00001-of-00001.safetensors"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"layer.weight": torch.randn(16, 8, generator=g), "layer.bias": torch.randn(8, generator=g),
            "steps": torch.arange(5, dtype=torch.int64)}


def _zeros() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in _state().items()}


def _inspect(capsys: CapSys, path: Path, *args: str) -> tuple[int, str]:
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", f"alpsck://{path}", *args)
    return rc, out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsspec_finds_the_protocol_by_its_entry_point_without_importing_alpsck(tmp_path: Path) -> None:
    code = ("import sys, fsspec; before = 'alpsck' in sys.modules; fs, p = fsspec.core.url_to_fs(sys.argv[1]); "
            "print(type(fs).__module__, p, before)")
    out = subprocess.run([sys.executable, "-c", code, f"alpsck://{tmp_path}/x"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["alpsck.integrations.fsspec_fs", f"{tmp_path}/x", "False"]


def test_dcp_picks_the_fsspec_writer_for_a_url_and_every_file_gets_its_sum(tmp_path: Path, capsys: CapSys) -> None:
    url = f"alpsck://{tmp_path}/ckpt"
    dcp.save({**_state(), "lr": 0.25}, checkpoint_id=url, no_dist=True)
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["..metadata.alpsck-sum", ".__0_0.distcp.alpsck-sum", ".metadata", "__0_0.distcp"]
    for f in (".metadata", "__0_0.distcp"):
        assert summed.verify_file(tmp_path / "ckpt" / f) == (tmp_path / "ckpt" / f).stat().st_size
    into: dict[str, Any] = {**_zeros(), "lr": 0.0}
    dcp.load(into, checkpoint_id=url, no_dist=True)
    assert into.pop("lr") == 0.25 and _equal(into, _state())
    rc, out = _inspect(capsys, tmp_path / "ckpt", "--verify")
    assert rc == 0 and "every byte read, every CRC32C matches" in out


def test_a_damaged_shard_is_refused_by_name_when_dcp_reads_it(tmp_path: Path, capsys: CapSys) -> None:
    url = f"alpsck://{tmp_path}/ckpt"
    dcp.save(_state(), checkpoint_id=url, no_dist=True)
    flip_byte(tmp_path / "ckpt" / "__0_0.distcp", 100)
    with pytest.raises(CheckpointException) as e:
        dcp.load(_zeros(), checkpoint_id=url, no_dist=True)
    err = root_cause(e.value)
    assert isinstance(err, CorruptCheckpointError) and "__0_0.distcp: CRC32C" in str(err)
    rc, out = _inspect(capsys, tmp_path / "ckpt", "--verify")
    assert rc == 1 and "corrupt" in out and "__0_0.distcp: CRC32C" in out
    rc, out = _inspect(capsys, tmp_path / "ckpt")  # without --verify only sizes are compared: this one's is right
    assert rc == 0 and "size ok" in out


def test_the_hugging_face_writer_at_an_alpsck_url_writes_what_the_readers_load(tmp_path: Path, capsys: CapSys) -> None:
    url = f"alpsck://{tmp_path}/hf"
    dcp.save(_state(), storage_writer=AlpsckHuggingFaceStorageWriter(url), no_dist=True)
    rc, out = _inspect(capsys, tmp_path / "hf", "--verify")
    rows = {line.split()[-1]: line.split()[0] for line in out.splitlines()[2:-1]}
    assert rc == 0 and rows == {HF_FILE: "ok", "model.safetensors.index.json": "ok"}, out
    into = _zeros()
    dcp.load(into, storage_reader=AlpsckHuggingFaceStorageReader(url), no_dist=True)
    assert _equal(into, _state())
    assert _equal(load_file(tmp_path / "hf" / HF_FILE), _state())  # plain safetensors, for any reader
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_state())
    flip_byte(tmp_path / "hf" / HF_FILE, (tmp_path / "hf" / HF_FILE).stat().st_size - 5)
    with pytest.raises(CheckpointException) as e:
        dcp.load(_zeros(), storage_reader=AlpsckHuggingFaceStorageReader(url), no_dist=True)
    assert isinstance(root_cause(e.value), CorruptCheckpointError) and HF_FILE in str(root_cause(e.value))
    with pytest.raises(UsageError, match="enable_consolidation"):
        AlpsckHuggingFaceStorageWriter(url, enable_consolidation=True)


def test_a_truncated_an_unsummed_and_a_missing_file_are_each_named(tmp_path: Path, capsys: CapSys) -> None:
    fs = AlpsckFileSystem()
    for name in ("a.bin", "b.bin", "c.bin"):
        with fs.open(f"{tmp_path}/d/{name}", "wb") as f:
            f.write(b"x" * 1000)
    os.truncate(tmp_path / "d" / "a.bin", 999)
    (tmp_path / "d" / "c.bin").unlink()
    (tmp_path / "d" / "stray.bin").write_bytes(b"y")
    with pytest.raises(CorruptCheckpointError, match="a.bin: 999 bytes, its checksum file says 1000"):
        fs.open(f"alpsck://{tmp_path}/d/a.bin", "rb")
    with pytest.raises(CorruptCheckpointError, match="stray.bin: no checksum beside it"):
        fs.open(f"alpsck://{tmp_path}/d/stray.bin", "rb")
    assert fs.cat_file(f"alpsck://{tmp_path}/d/b.bin") == b"x" * 1000
    rc, out = _inspect(capsys, tmp_path / "d")
    rows = {line.split()[-1]: line.split()[0] for line in out.splitlines() if line.endswith(".bin")}
    assert rc == 1 and rows == {"a.bin": "corrupt", "b.bin": "size", "c.bin": "missing", "stray.bin": "no"}, out
    assert AlpsckFileSystem(verify=False).cat_file(f"{tmp_path}/d/stray.bin") == b"y"  # storage_options verify=False


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    fs = AlpsckFileSystem()
    path = f"{tmp_path}/f.bin"
    with fs.open(path, "wb") as f:
        f.write(b"old")
    with pytest.raises(RuntimeError), fs.open(path, "wb") as f:
        f.write(b"new, half")
        raise RuntimeError("killed mid-write")
    assert fs.cat_file(path) == b"old" and sorted(os.listdir(tmp_path)) == [".f.bin.alpsck-sum", "f.bin"]
    with fs.open(path, "w") as t:  # text mode: fsspec wraps the binary writer
        t.write("text")
    assert fs.cat_file(path) == b"text"
    with pytest.raises(ValueError, match="appends to no file"):
        fs.open(path, "ab")


def test_listing_moving_copying_and_removing_keep_each_sum_with_its_file(tmp_path: Path) -> None:
    fs = AlpsckFileSystem()
    with fs.open(f"{tmp_path}/a/one", "wb") as f:
        f.write(b"1" * 10)
    assert fs.ls(f"alpsck://{tmp_path}/a") == [f"{tmp_path}/a/one"]
    fs.mv(f"alpsck://{tmp_path}/a/one", f"alpsck://{tmp_path}/a/two")
    fs.cp_file(f"{tmp_path}/a/two", f"{tmp_path}/a/three")
    assert sorted(os.listdir(tmp_path / "a")) == [".three.alpsck-sum", ".two.alpsck-sum", "three", "two"]
    assert summed.verify_file(tmp_path / "a" / "two") == 10 == summed.verify_file(tmp_path / "a" / "three")
    fs.rm(f"{tmp_path}/a/two")
    fs.rm_file(f"{tmp_path}/a/three")
    assert os.listdir(tmp_path / "a") == []
