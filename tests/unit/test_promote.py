"""``alpsck promote`` (a checkpoint copied out of a purged scratch, verified after the copy) and the
purge warning of ``alpsck status``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck import _core, cli
from alpsck.slurm import history
from alpsck.store import storage as storage_unit
from alpsck.tools import promote as promote_mod


def _state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "b": torch.arange(1000, dtype=torch.int32) * step, "step": step}


def _run(tmp_path: Path, steps: tuple[int, ...] = (1, 2, 3)) -> Path:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        for s in steps:
            ck.save(s, _state(s)).wait()
    return run


def _restored(run: Path) -> tuple[int, dict[str, object]]:
    live = {"w": torch.zeros(300_000), "b": torch.zeros(1000, dtype=torch.int32), "step": 0}
    return alpsck.restore_into(run, live), live


def test_promote_copies_the_newest_and_the_copy_restores_bit_for_bit(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    dest = tmp_path / "store" / "exp1"
    assert cli.main(["promote", str(run), str(dest)]) == 0
    out = capsys.readouterr().out
    assert f"promoted step 3: {run / 'step-000000003'} -> {dest / 'step-000000003'}" in out and "verified" in out
    assert sorted(p.name for p in dest.iterdir() if p.name != ".lock") == ["step-000000003"]
    step, live = _restored(dest)
    want = _state(3)
    assert step == 3 and torch.equal(live["w"], want["w"]) and torch.equal(live["b"], want["b"])  # type: ignore[arg-type]
    assert cli.main(["promote", str(run), str(dest), "--step", "1"]) == 0  # an older one beside it
    assert [i["step"] for i in _core.scan(str(dest), verify=True) if i["verified"]] == [1, 3]
    # never replaced
    assert cli.main(["promote", str(run), str(dest), "--step", "3"]) == 2
    assert "exists already" in capsys.readouterr().err


def test_a_corrupt_newest_is_skipped_and_with_step_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path)
    shard = run / "step-000000003" / "rank-00000.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # a tensor byte: only a CRC check finds it
    shard.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    assert cli.main(["promote", str(run), str(dest)]) == 0
    cap = capsys.readouterr()
    assert "promoted step 2" in cap.out and "skipping corrupt checkpoint" in cap.err
    assert cli.main(["promote", str(run), str(tmp_path / "d2"), "--step", "3"]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err


def test_a_copy_that_does_not_verify_is_removed_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is read back: a byte the storage flipped on the way fails the promote."""
    run = _run(tmp_path)
    real = promote_mod._copy_file

    def flipping(src: Path, dst: Path) -> int:
        n = real(src, dst)
        if dst.name.endswith(".bin"):
            with open(dst, "r+b") as f:
                f.seek(200)
                b = f.read(1)
                f.seek(200)
                f.write(bytes([b[0] ^ 1]))
        return n

    monkeypatch.setattr(promote_mod, "_copy_file", flipping)
    dest = tmp_path / "dest"
    assert cli.main(["promote", str(run), str(dest)]) == 2
    assert "the copy did not verify" in capsys.readouterr().err
    assert [p.name for p in dest.iterdir() if p.name != ".lock"] == []


def test_links_are_refused_and_a_leftover_attempt_is_replaced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, (1,))
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "step-000000001.tmp").mkdir()  # an interrupted promote
    (dest / "step-000000001.tmp" / "rank-00000.bin").write_bytes(b"half")
    assert cli.main(["promote", str(run), str(dest)]) == 0
    assert not (dest / "step-000000001.tmp").exists() and (dest / "step-000000001").is_dir()
    elsewhere = tmp_path / "elsewhere.json"
    manifest = run / "step-000000001" / "MANIFEST.json"
    elsewhere.write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(elsewhere)
    capsys.readouterr()
    assert cli.main(["promote", str(run), str(tmp_path / "d2")]) == 2
    assert "never follows a link" in capsys.readouterr().err
    assert cli.main(["promote", str(run), str(run)]) == 2


# ----------------------------------------------------------------------------- purge


def test_purge_window_by_scratch_and_the_warning_before_it(tmp_path: Path) -> None:
    assert storage_unit.purge_days(tmp_path / "capstor" / "scratch" / "u") == 30
    assert storage_unit.purge_days(tmp_path / "iopsstor" / "u") == 14
    assert storage_unit.purge_days(tmp_path) is None
    run = _run(tmp_path, (1,))
    ckpt = run / "step-000000001"
    now = time.time()
    assert storage_unit.purge_warning(ckpt, 30, now) is None
    old = now - 25 * 86400
    for p in ckpt.iterdir():
        os.utime(p, (old, old))
    w = storage_unit.purge_warning(ckpt, 30, now)
    assert w is not None and "last accessed 25 day(s) ago" in w and "in about 5 day(s)" in w and "alpsck promote" in w
    assert storage_unit.purge_warning(ckpt, 40, now) is None


def test_status_warns_when_the_newest_checkpoint_nears_the_purge(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, (1, 2))
    history.append(run, "started", job_id="4242", restart=0)
    old = time.time() - 12 * 86400
    for p in (run / "step-000000002").iterdir():
        os.utime(p, (old, old))
    assert cli.main(["status", str(run), "--purge-days", "14"]) == 0
    out = capsys.readouterr().out
    assert "warning: the newest checkpoint" in out and "step-000000002" in out and "14 days" in out, out
    assert cli.main(["status", str(run), "--purge-days", "30"]) == 0
    assert "warning" not in capsys.readouterr().out
    assert cli.main(["status", str(run), "--json"]) == 0  # not on a known scratch: no window
    doc = json.loads(capsys.readouterr().out)
    assert doc["purge"] == {"days": None, "warning": None}
