"""Storage that knows Alps' file systems (alpsck.store.filesystem): statfs decides whether ``lfs`` is
ever called; on Lustre a new run directory gets a layout (a user's is kept); a save that the quota,
the free space or the storage targets cannot hold fails before it writes a byte, naming bytes and
inodes, on every rank.

Lustre cannot run here: the Lustre cases run alpsck's real code (``lfs`` found on PATH, called
with an argument list, its answers parsed) against tests/support/lfs_standin.py, which records its calls,
with ALPSCK_FS_KIND=lustre standing in for what statfs says on Lustre. The statvfs case runs on a
real small tmpfs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.lfs import Lfs
from support.tmpfs import mounted_tmpfs

import alpsck
from alpsck import _core, cli
from alpsck.errors import DiskFullError, UsageError
from alpsck.store import filesystem
from alpsck.store import lustre as lustre_unit


@pytest.fixture
def lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Lfs:
    stand_in = Lfs(tmp_path)
    monkeypatch.setenv("PATH", f"{stand_in.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LFS_STANDIN_STATE", str(stand_in.state_path))
    monkeypatch.setenv("LFS_STANDIN_LOG", str(stand_in.log))
    return stand_in


@pytest.fixture
def lustre(lfs: Lfs, monkeypatch: pytest.MonkeyPatch) -> Lfs:
    monkeypatch.setenv(filesystem.KIND_ENV, "lustre")
    return lfs


def _state(mib: float) -> dict[str, Any]:
    return {"w": torch.arange(int(mib * (1 << 20)) // 4, dtype=torch.float32), "step": 0}


def _files_under(run: Path, suffix: str) -> list[Path]:
    return [p for p in run.rglob(f"*{suffix}")]


# ----------------------------------------------------------------------------- which file system


def test_statfs_decides_and_no_lfs_call_is_made_off_lustre(tmp_path: Path, lfs: Lfs,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine's disk is not Lustre: statfs says so, and neither opening, saving, restoring nor
    inspecting calls lfs (it is on PATH); ALPSCK_FS_KIND=nfs (Ritom, home) behaves the same."""
    assert filesystem.kind(tmp_path) not in ("lustre", "nfs")
    assert filesystem.kind(tmp_path / "not" / "made" / "yet") == filesystem.kind(tmp_path)
    for fs in ("", "nfs"):
        monkeypatch.setenv(filesystem.KIND_ENV, fs)
        run = tmp_path / f"run{fs}"
        with alpsck.Checkpointer(run, keep_last=2) as ck:
            ck.save(1, _state(1)).wait()
            assert ck.layout is not None and "not Lustre" in str(ck.layout)
        with alpsck.Checkpointer(run) as ck:
            assert ck.restore(_state(1)) == 1
        assert cli.main(["inspect-checkpoints", str(run)]) == 0
    assert lfs.calls() == []


# ----------------------------------------------------------------------------- layout


def test_a_new_run_dir_on_lustre_gets_the_layout_and_keeps_it_on_restart(tmp_path: Path, lustre: Lfs) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, chunk_bytes=16 << 20, preflight=False) as ck:
        ck.save(1, _state(1)).wait()
    want = ["-E", "4M", "-c", "1", "-E", "64M", "-c", "4", "-E", "-1", "-c", "32", "-S", "16M"]
    assert lustre.layouts() == {os.path.realpath(run): want}
    assert lustre.calls() == [["getstripe", "-d", "--raw", str(run)], ["setstripe", *want, str(run)]]
    assert ck.layout is not None and str(ck.layout) == f"lustre: set layout {' '.join(want)}"
    with alpsck.Checkpointer(run, preflight=False) as ck:  # the requeued job: its layout is its own now
        assert ck.layout is not None and ck.layout.kept
    assert [c[0] for c in lustre.calls()] == ["getstripe", "setstripe", "getstripe"]


@pytest.mark.parametrize(("chunk", "stripe"), [(64 << 10, "1M"), (8 << 20, "8M"), (12 << 20, "8M"), (1 << 30, "64M")])
def test_the_automatic_stripe_size_follows_the_chunk(chunk: int, stripe: str) -> None:
    assert lustre_unit.layout_args("auto", chunk)[-2:] == ["-S", stripe]


def test_a_layout_the_user_set_is_kept_and_one_given_is_set(tmp_path: Path, lustre: Lfs) -> None:
    run = tmp_path / "theirs"
    run.mkdir()
    lustre.set(layouts={os.path.realpath(run): ["-c", "8", "-S", "4M"]})  # as `lfs setstripe -c 8 -S 4M` left it
    with alpsck.Checkpointer(run, preflight=False) as ck:
        assert ck.layout is not None and ck.layout.kept
    assert lustre.layouts()[os.path.realpath(run)] == ["-c", "8", "-S", "4M"]
    assert not any(c[0] == "setstripe" for c in lustre.calls())
    given = tmp_path / "given"
    with alpsck.Checkpointer(given, lustre_layout="-c 16 -S 8M", preflight=False):
        pass
    assert lustre.layouts()[os.path.realpath(given)] == ["-c", "16", "-S", "8M"]
    before = len(lustre.calls())
    with alpsck.Checkpointer(tmp_path / "none", lustre_layout="none", preflight=False):
        pass
    assert len(lustre.calls()) == before  # "none": no lfs call at all


def test_a_bad_layout_is_refused_naming_it(tmp_path: Path, lustre: Lfs) -> None:
    for bad in ("stripe me", "-c '8", 8):
        with pytest.raises(UsageError, match="lustre_layout"):
            alpsck.Checkpointer(tmp_path / "run", lustre_layout=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "run").exists()
    # lfs refusing a layout the user gave is the user's error, named; refusing the automatic one, a warning
    with pytest.raises(UsageError, match=r"lustre_layout '-c 4 --bogus'.*unrecognized option '--bogus'"):
        alpsck.Checkpointer(tmp_path / "run", lustre_layout="-c 4 --bogus", preflight=False)
    lustre.bin.joinpath("lfs").write_text("#!/bin/sh\necho 'lfs: Operation not permitted' >&2\nexit 1\n")
    with pytest.warns(RuntimeWarning, match="layout was not set.*Operation not permitted"):
        with alpsck.Checkpointer(tmp_path / "auto", preflight=False) as ck:
            ck.save(1, _state(0.1)).wait()


def test_the_job_config_takes_the_layout_and_the_preflight(tmp_path: Path) -> None:
    from alpsck.slurm.config import load_config

    base = "name: x\nentry:\n  function: m:f\ncheckpoint:\n"
    (tmp_path / "ok.yaml").write_text(base + "  lustre_layout: '-c 8 -S 4M'\n  preflight: false\n")
    cfg = load_config(tmp_path / "ok.yaml")
    assert cfg.checkpoint.lustre_layout == "-c 8 -S 4M" and cfg.checkpoint.preflight is False
    (tmp_path / "bad.yaml").write_text(base + "  lustre_layout: 'stripe me'\n")
    with pytest.raises(alpsck.errors.ConfigError, match="checkpoint.lustre_layout"):
        load_config(tmp_path / "bad.yaml")


# ----------------------------------------------------------------------------- pre-flight


def test_a_quota_that_cannot_hold_the_checkpoints_fails_before_the_first_save(tmp_path: Path, lustre: Lfs) -> None:
    """keep_last 3 + 1 in flight = 4 checkpoints of 2 MiB: a quota leaving 5 MiB cannot hold them.
    The save fails on rank 0 before a byte is written, naming bytes and inodes; nothing of it stays
    but the aborted attempt's record."""
    run = tmp_path / "run"
    lustre.set(quota=[1000, 0, 1000 + 5 * 1024, 10, 0, 1_000_000])
    with alpsck.Checkpointer(run, keep_last=3, max_in_flight=1) as ck:
        with pytest.raises(DiskFullError) as e:
            ck.save(1, _state(2))
        msg = str(e.value)
        assert "pre-flight" in msg and "4 checkpoint(s)" in msg and "inodes" in msg and "lfs quota" in msg, msg
        assert f"needs 8.0 MiB ({4 * 2 * (1 << 20)} bytes)" in msg, msg
        assert _files_under(run, ".bin") == []
        assert [i["status"] for i in _core.scan(str(run))] == []
        lustre.set(quota=[1000, 0, 1000 + 64 * 1024, 10, 0, 1_000_000])  # room made: the same step saves
        ck.save(1, _state(2)).wait()
    assert [i["step"] for i in _core.scan(str(run)) if i["status"] == "committed"] == [1]
    assert ["quota", "-q", "-u", str(os.getuid()), str(run)] in lustre.calls()


def test_an_inode_quota_fails_the_save_naming_inodes(tmp_path: Path, lustre: Lfs) -> None:
    lustre.set(quota=[0, 0, 0, 999_990, 0, 1_000_000])  # bytes unlimited, 10 inodes left
    with alpsck.Checkpointer(tmp_path / "run", keep_last=3, max_in_flight=1) as ck:
        with pytest.raises(DiskFullError, match=r"12 inodes more.*leaves unlimited bytes and 10 inodes"):
            ck.save(1, _state(0.1))


def test_a_full_storage_target_fails_the_save_naming_it(tmp_path: Path, lustre: Lfs) -> None:
    """459 GB free and still ENOSPC: one target was full. 4 targets, 8 MiB to place: 2 MiB each, and
    one target has 1 MiB."""
    lustre.set(osts=[10 << 20, 1024, 10 << 20, 10 << 20])
    with alpsck.Checkpointer(tmp_path / "run", keep_last=3, max_in_flight=1) as ck:
        with pytest.raises(DiskFullError, match=r"4 storage target\(s\).*only 3 of the 4.*scratch-OST0001_UUID 1.0 MiB"):
            ck.save(1, _state(2))
        lustre.set(osts=[10 << 20] * 4)
        ck.save(1, _state(2)).wait()


def test_a_save_that_grows_is_checked_again(tmp_path: Path, lustre: Lfs) -> None:
    """Adam's state appears at its first step: the save after it is three times the first one."""
    lin = torch.nn.Linear(512, 512)
    opt = torch.optim.Adam(lin.parameters())
    lustre.set(quota=[0, 0, 8 * 1024, 0, 0, 0])  # 8 MiB: 4 saves of the 1 MiB model fit, 3 more of model + Adam not
    with alpsck.Checkpointer(tmp_path / "run", keep_last=3, max_in_flight=1) as ck:
        ck.save(1, {"model": lin, "optim": opt}).wait()
        lin(torch.randn(2, 512)).sum().backward()
        opt.step()
        with pytest.raises(DiskFullError, match="pre-flight"):
            ck.save(2, {"model": lin, "optim": opt})
    assert sum(1 for c in lustre.calls() if c[0] == "quota") == 2


def test_preflight_can_be_turned_off(tmp_path: Path, lustre: Lfs) -> None:
    lustre.set(quota=[0, 0, 1, 0, 0, 0])
    with alpsck.Checkpointer(tmp_path / "run", keep_last=3, preflight=False) as ck:
        ck.save(1, _state(1)).wait()
    assert not any(c[0] in ("quota", "df") for c in lustre.calls())


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 40 inodes: statvfs's limits are real. Needs root, as CI has."""
    with mounted_tmpfs(tmp_path / "small", "size=16m,nr_inodes=40") as mnt:
        yield mnt


def test_statvfs_bytes_and_inodes_limit_the_save_off_lustre(small_fs: Path, lfs: Lfs) -> None:
    with alpsck.Checkpointer(small_fs / "run", keep_last=3, max_in_flight=1) as ck:
        with pytest.raises(DiskFullError, match=r"the file system's free space \(statvfs .*\) leaves"):
            ck.save(1, _state(6))  # 4 x 6 MiB on 16 MiB
    with alpsck.Checkpointer(small_fs / "run1", keep_last=3, max_in_flight=1) as ck:
        ck.save(1, _state(1)).wait()  # 4 x 1 MiB fit
    with alpsck.Checkpointer(small_fs / "run2", keep_last=30, max_in_flight=1) as ck:
        with pytest.raises(DiskFullError, match=r"93 inodes more.*leaves .* and \d+ inodes"):
            ck.save(1, _state(0.01))  # 31 checkpoints of 3 inodes: more than the 40 there are
    assert lfs.calls() == []


WORKER = textwrap.dedent("""
    import datetime, json, sys, time, torch, torch.distributed as dist, alpsck
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    ck = alpsck.Checkpointer(sys.argv[1], keep_last=3, commit_timeout_s=60)
    t0 = time.monotonic()
    try:
        h = ck.save(1, {"w": torch.zeros(1 << 19)})
        h.wait()
        out = {"ok": True}
    except alpsck.errors.CheckpointError as e:
        out = {"ok": False, "type": type(e).__name__, "error": str(e)}
    out.update(rank=rank, seconds=time.monotonic() - t0)
    print(json.dumps(out), flush=True)
    ck.close()
    dist.destroy_process_group()
""")


def test_two_ranks_both_fail_at_once_when_rank_0s_preflight_refuses(tmp_path: Path, lustre: Lfs) -> None:
    """Rank 0 alone checks (one quota call per job, not one per rank); its refusal aborts the
    attempt, so rank 1 hears the verdict at once instead of waiting out its 60 s commit timeout."""
    import socket

    lustre.set(quota=[0, 0, 1024, 0, 0, 0])
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2",
                                   "RANK": str(r), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    deadline = time.monotonic() + 120
    outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    results = {}
    for out in outs:
        line = next((x for x in out.splitlines() if x.startswith("{")), None)
        assert line is not None, out
        doc = json.loads(line)
        results[doc["rank"]] = doc
    assert results[0]["type"] == "DiskFullError" and "pre-flight" in results[0]["error"], results
    assert not results[1]["ok"] and "rank 0" in results[1]["error"] and "pre-flight" in results[1]["error"], results
    assert results[1]["seconds"] < 30, results
    assert sum(1 for c in lustre.calls() if c[0] == "quota") == 1
    assert _files_under(tmp_path / "run", ".bin") == [] or all(p.stat().st_size == 0 for p in
                                                              _files_under(tmp_path / "run", ".bin"))
