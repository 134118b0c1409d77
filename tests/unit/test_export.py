"""``alpsck export``: one checkpoint's tensors as a safetensors or torch.save file, streamed and atomic."""

from __future__ import annotations

import io
import json
import os
import stat
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support.inspect_runs import run_cli as _run

import alpsck
from alpsck import _core, cli
from alpsck.capture import capture
from alpsck.tools import export


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Module()
    layer = torch.nn.Linear(16, 8)
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].attention = torch.nn.Module()
    model.layers[0].attention.wq = layer
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, 16, generator=g))
        layer.bias.fill_(float(step))
    x = torch.randn(33, 7, generator=g) * 4
    return {
        "model": model,
        "bf16": x.to(torch.bfloat16),
        "fp16": x.to(torch.float16),
        "fp64": x.to(torch.float64),
        "e4m3": x.to(torch.float8_e4m3fn),
        "e5m2": x.to(torch.float8_e5m2),
        "i8": torch.randint(-100, 100, (5, 3), generator=g).to(torch.int8),
        "i16": torch.randint(-100, 100, (5,), generator=g).to(torch.int16),
        "i32": torch.randint(-100, 100, (2, 2, 2), generator=g).to(torch.int32),
        "i64": torch.tensor(step),  # 0-dim
        "u8": torch.randint(0, 255, (300_000,), generator=g).to(torch.uint8),  # spans several 64 KiB chunks
        # uint16/32/64 have few kernels: random bytes viewed as them, the top bit set too
        "u16": torch.randint(0, 256, (6, 2), generator=g).to(torch.uint8).view(torch.uint16),
        "u32": torch.randint(0, 256, (8,), generator=g).to(torch.uint8).view(torch.uint32),
        "u64": torch.randint(0, 256, (2, 8), generator=g).to(torch.uint8).view(torch.uint64),
        "bool": torch.rand(10, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "c64": torch.randn(4, 3, dtype=torch.complex64, generator=g),
        "step": step,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    with alpsck.Checkpointer(run_dir, keep_last=0, chunk_bytes=64 << 10) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step)).wait()
    return run_dir


def _expected(step: int) -> dict[str, torch.Tensor]:
    return capture(_state(step)).tensors


def _flip_data_byte(shard: Path, extent: str) -> None:
    offsets = {name: off for name, off, _ in _core.ShardReader(str(shard)).extents}
    with open(shard, "r+b") as fh:
        fh.seek(offsets[extent] + 1000)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 1]))


def test_safetensors_round_trip(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.safetensors"
    rc, stdout, err = _run(capsys, "export", str(run), str(out), "--format", "safetensors")
    assert rc == 0, err
    assert str(out) in stdout and f"{out.stat().st_size} bytes" in stdout
    loaded = load_file(str(out))
    want = _expected(3)  # the newest valid checkpoint by default
    assert list(loaded) == list(want)
    assert "model/layers.0.attention.wq.weight" in loaded
    for k, v in want.items():
        assert _same(loaded[k], v), k
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["alpsck.step"] == "3"
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header["bf16"]["dtype"] == "BF16" and header["bf16"]["shape"] == [33, 7]
    assert header["e4m3"]["dtype"] == "F8_E4M3" and header["e5m2"]["dtype"] == "F8_E5M2"
    assert header["bool"]["dtype"] == "BOOL" and header["c64"]["dtype"] == "C64"
    assert [header[k]["dtype"] for k in ("u16", "u32", "u64")] == ["U16", "U32", "U64"]
    assert not Path(f"{out}.tmp").exists()


def test_torch_round_trip(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "model.pt"
    rc, _, err = _run(capsys, "export", str(run), str(out), "--format", "torch")
    assert rc == 0, err
    loaded = torch.load(out, weights_only=True)
    want = _expected(3)
    assert type(loaded) is dict and list(loaded) == list(want)
    for k, v in want.items():
        assert _same(loaded[k], v), k
    mapped = torch.load(out, weights_only=True, mmap=True)  # storages are aligned as torch.save aligns them
    assert all(_same(mapped[k], v) for k, v in want.items())


def test_torch_pickle_is_what_torch_save_writes(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    export.export_checkpoint(str(run), str(out), step=2)
    ours = zipfile.ZipFile(out)
    buf = io.BytesIO()
    torch.save(torch.load(out, weights_only=True), buf)
    theirs = zipfile.ZipFile(io.BytesIO(buf.getvalue()))

    def record(z: zipfile.ZipFile, name: str) -> bytes:
        return z.read(next(n for n in z.namelist() if n.split("/", 1)[1] == name))

    assert record(ours, "data.pkl") == record(theirs, "data.pkl")
    assert sorted(n.split("/", 1)[1] for n in ours.namelist()) == sorted(n.split("/", 1)[1] for n in theirs.namelist())


def test_step_picks_the_checkpoint(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for fmt, name in (("safetensors", "a.safetensors"), ("torch", "a.pt")):
        rc, stdout, err = _run(capsys, "export", str(run), str(tmp_path / name), "--step", "1", "--format", fmt)
        assert rc == 0, err
        assert "exported step 1" in stdout
    want = _expected(1)
    a, b = load_file(str(tmp_path / "a.safetensors")), torch.load(tmp_path / "a.pt", weights_only=True)
    for k, v in want.items():
        assert _same(a[k], v) and _same(b[k], v), k
    assert a["model/layers.0.attention.wq.bias"][0].item() == 1.0


def test_format_from_suffix_and_small_batches(run: Path, tmp_path: Path) -> None:
    want = _expected(2)
    for name in ("x.safetensors", "x.pth"):
        r = export.export_checkpoint(str(run), str(tmp_path / name), step=2, batch_bytes=1)  # one tensor per read
        assert r["format"] == ("safetensors" if name.endswith("safetensors") else "torch")
        got = load_file(str(tmp_path / name)) if name.endswith("safetensors") else torch.load(tmp_path / name,
                                                                                                 weights_only=True)
        assert all(_same(got[k], v) for k, v in want.items())


def test_corrupt_and_incomplete_checkpoints_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=0, chunk_bytes=64 << 10) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step)).wait()
    _flip_data_byte(run / "step-000000003" / "rank-00000.bin", "u8")
    shard2 = run / "step-000000002" / "rank-00000.bin"
    os.truncate(shard2, shard2.stat().st_size - 1)
    (run / "step-000000004.tmp").mkdir()
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous")
    for fmt in ("safetensors", "torch"):
        rc, _, err = _run(capsys, "export", str(run), str(out), "--step", "3", "--format", fmt)
        assert rc == 2 and "step 3" in err and "CRC mismatch" in err and "u8" in err
        assert out.read_bytes() == b"previous" and not Path(f"{out}.tmp").exists()
    rc, _, err = _run(capsys, "export", str(run), str(out), "--step", "2")
    assert rc == 2 and "step 2 is corrupt" in err
    rc, _, err = _run(capsys, "export", str(run), str(out), "--step", "4")
    assert rc == 2 and "step 4 is incomplete" in err
    rc, _, err = _run(capsys, "export", str(run), str(out), "--step", "9")
    assert rc == 2 and "no checkpoint of step 9" in err
    # without --step: 3 fails its CRC while exporting, 2 is corrupt, so 1 is exported (with a warning)
    rc, stdout, err = _run(capsys, "export", str(run), str(out))
    assert rc == 0 and "exported step 1" in stdout and "skipping corrupt checkpoint" in err
    assert all(_same(load_file(str(out))[k], v) for k, v in _expected(1).items())


def test_bad_destinations(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "m.safetensors"
    rc, _, err = _run(capsys, "export", str(run), str(missing))
    assert rc == 2 and f"directory {missing.parent} does not exist" in err
    rc, _, err = _run(capsys, "export", str(run), str(tmp_path))
    assert rc == 2 and "is a directory" in err
    rc, _, err = _run(capsys, "export", str(run), str(tmp_path / "m.out"))
    assert rc == 2 and "--format" in err
    rc, _, err = _run(capsys, "export", str(tmp_path / "nope"), str(tmp_path / "m.pt"))
    assert rc == 2 and "no such directory" in err
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_is_written_through_and_a_fifo_is_never_replaced(run: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The file is renamed onto OUT: that must not replace a FIFO or device node (``/dev/null`` as root), nor
    turn a symlink into a file while its target keeps the old bytes."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    rc, _, err = _run(capsys, "export", str(run), str(fifo), "--format", "torch")
    assert rc == 2 and f"{fifo} is not a regular file" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "blob"
    target.write_bytes(b"old")
    link = tmp_path / "model.safetensors"
    link.symlink_to(target)
    rc, out, err = _run(capsys, "export", str(run), str(link))
    assert rc == 0 and "safetensors" in out, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert all(_same(load_file(str(target))[k], v) for k, v in _expected(3).items())
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["blob"]


def test_the_run_directorys_own_files_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``.bin`` means torch format: ``export RUN RUN/step-N/rank-00000.bin`` used to replace the shard (and
    ``RUN/LATEST --format torch`` the LATEST file) with the export."""
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        ck.save(1, {"w": torch.ones(4)}).wait()
    shard = run / "step-000000001" / "rank-00000.bin"
    before = {p: p.read_bytes() for p in (shard, run / "LATEST")}
    for out, extra in ((shard, []), (run / "LATEST", ["--format", "torch"]),
                       (run / ".." / "run" / "step-000000001" / "x.pt", [])):
        rc, _, err = _run(capsys, "export", str(run), str(out), *extra)
        assert rc == 2 and "belongs to the run directory" in err and "\n" not in err.rstrip(), err
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in shard.parent.iterdir()) == ["MANIFEST.json", "rank-00000.bin"]
    rc, out, err = _run(capsys, "export", str(run), str(run / "model.pt"))  # beside the checkpoints: fine
    assert rc == 0 and "exported step 1" in out, err


def test_an_existing_out_tmp_is_never_truncated(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """OUT.tmp was opened with "wb": a user's file of that name was truncated and renamed away, and a symlink
    there had its target overwritten."""
    out = tmp_path / "m.safetensors"
    mine = tmp_path / "m.safetensors.tmp"
    mine.write_bytes(b"mine")
    victim = tmp_path / "victim"
    victim.write_bytes(b"victim")
    Path(f"{out}.tmp.1").symlink_to(victim)
    rc, stdout, err = _run(capsys, "export", str(run), str(out))
    assert rc == 0 and "exported step 3" in stdout, err
    assert mine.read_bytes() == b"mine" and victim.read_bytes() == b"victim"
    assert Path(f"{out}.tmp.1").is_symlink() and not Path(f"{out}.tmp.2").exists()
    assert all(_same(load_file(str(out))[k], v) for k, v in _expected(3).items())


def test_a_dcp_checkpoint_is_refused_not_called_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Export reads state trees; a DCP checkpoint is a healthy one it cannot read, not a corrupt one to skip."""
    import torch.distributed.checkpoint as dcp

    from alpsck.dcp import AlpsckStorageWriter

    run = tmp_path / "run"
    for step in (1, 2):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"w": torch.ones(3)}, storage_writer=AlpsckStorageWriter(run, step))
    out = tmp_path / "m.pt"
    for extra in ([], ["--step", "1"]):
        rc, _, err = _run(capsys, "export", str(run), str(out), *extra)
        assert rc == 2 and "torch.distributed.checkpoint (DCP) checkpoint" in err and "--format dcp" in err, err
        assert "corrupt" not in err and "verification" not in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_negative_rank_is_a_usage_error(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "export", str(run), str(tmp_path / "m.pt"), "--rank", "-1")
    assert rc == 2 and "--rank: -1 is out of range" in err and "rank--" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_run_without_valid_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "step-000000001.tmp").mkdir()
    rc, _, err = _run(capsys, "export", str(tmp_path), str(tmp_path / "m.pt"))
    assert rc == 2 and "no valid checkpoint" in err


@pytest.mark.parametrize("threads", ["-1", "0", "many"])
def test_bad_thread_counts_are_usage_errors(run: Path, tmp_path: Path, threads: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(run), str(tmp_path / "o.safetensors"), "--threads", threads])
    assert e.value.code == 2
    assert "--threads" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


def test_complex128_exports_in_torch_format_and_safetensors_says_it_has_no_code(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    z = torch.randn(5, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(3))
    with alpsck.Checkpointer(run_dir) as ck:
        ck.save(1, {"z": z}).wait()
    rc, _, err = _run(capsys, "export", str(run_dir), str(tmp_path / "z.safetensors"))
    assert rc != 0 and "tensor 'z': dtype complex128 has no safetensors code; use --format torch" in err, err
    assert not (tmp_path / "z.safetensors").exists()
    rc, _, err = _run(capsys, "export", str(run_dir), str(tmp_path / "z.pt"))
    assert rc == 0, err
    assert _same(torch.load(tmp_path / "z.pt", weights_only=True)["z"], z)
