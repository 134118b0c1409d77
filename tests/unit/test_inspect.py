"""``alpsck inspect-checkpoints`` (classification, --verify, --step/--tensors, errors) and ``alpsck prune``."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
from pathlib import Path

import pytest
import torch
from support.inspect_runs import prunable_run, run_cli, run_listing, save_steps, shard_of, truncate_shard
from torch import nn

import alpsck
from alpsck import _core, tree
from alpsck.capture import capture
from alpsck.data import ResumableLoader
from alpsck.errors import CheckpointIOError
from alpsck.store import scan as run_dir_unit
from alpsck.tools import inspect_checkpoints as ins
from alpsck.tools import progress


def _flip_data_byte(run_dir: Path, step: int, extent: str = "w", at: int = 100) -> None:
    shard = shard_of(run_dir, step)
    offsets = {name: off for name, off, _ in _core.ShardReader(str(shard)).extents}
    with open(shard, "r+b") as fh:
        fh.seek(offsets[extent] + at)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x10]))


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1, 2 good; 3 bit-flipped in its data; 4 truncated; step-5.tmp; step-6 without MANIFEST.json (damaged)."""
    run = tmp_path_factory.mktemp("mixed")
    save_steps(run, [1, 2, 3, 4])
    _flip_data_byte(run, 3)
    truncate_shard(run, 4)
    (run / "step-000000005.tmp").mkdir()
    (run / "step-000000006").mkdir()
    (run / "step-000000006" / "rank-00000.bin").write_bytes(b"\0" * 10)
    return run


def test_classification_and_latest_valid(mixed_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) == {"latest_valid", "checkpoints", "skipped", "superseded", "lustre_layout", "memory"}
    assert doc["superseded"] == [] and doc["lustre_layout"] is None  # not Lustre: no lfs call
    # Why each step newer than the pick is not it (the picker's reason codes).
    assert [(k["step"], k["reason"]) for k in doc["skipped"]] == [(6, "damaged"), (5, "incomplete"), (4, "corrupt")]
    assert all(set(k) == {"step", "path", "reason", "message"} for k in doc["skipped"])
    assert all(set(c) == {"step", "path", "status", "bytes", "created", "ranks", "tensors", "verified", "error", "metrics",
                          "unhealthy", "pinned"} for c in doc["checkpoints"])
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [
        (1, "committed"), (2, "committed"), (3, "committed"),  # the quick check reads no data: 3 looks fine
        (4, "corrupt"), (5, "incomplete"), (6, "damaged")]
    assert doc["latest_valid"] == 3
    assert "footer" in doc["checkpoints"][3]["error"]
    assert "MANIFEST" in doc["checkpoints"][5]["error"]


def test_verify_finds_the_bit_flip_and_exits_1(mixed_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--verify", "--json")
    assert rc == 1
    doc = json.loads(out)
    assert doc["latest_valid"] == 2
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert by_step[3]["status"] == "corrupt" and "CRC" in by_step[3]["error"]
    assert by_step[1]["verified"] and by_step[2]["verified"]
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--verify")
    assert rc == 1 and "CRC mismatch" in out and "incomplete" in out
    # Said in words off a terminal too (capsys is not one): which rows passed, and the verdict.
    assert sum("every chunk CRC matches" in line for line in out.splitlines()) == 2, out
    verdict = next(line for line in out.splitlines() if line.startswith("--verify: re-read"))
    assert "corrupt or unreadable (step(s) " in verdict and "3" in verdict and verdict.endswith("exit 1"), verdict
    header = next(line for line in out.splitlines() if "status" in line)
    assert all(col in header for col in ("step", "status", "size", "created", "ranks", "tensors", "GB/s"))


def test_a_crc_error_names_the_chunks_tensors_briefly(tmp_path: Path) -> None:
    state = {f"layer_{k:02d}_with_a_long_parameter_name": torch.full((16,), float(k)) for k in range(40)}
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, state).wait()
    _flip_data_byte(tmp_path, 1, extent="layer_00_with_a_long_parameter_name", at=0)
    (info,) = _core.scan(str(tmp_path), verify=True)
    assert info["status"] == "corrupt"
    named = [k for k in state if k in info["error"]]
    assert named and named[0] == "layer_00_with_a_long_parameter_name"
    assert f"and {len(state) - len(named)} more)" in info["error"] and len(info["error"]) < 400


def test_verify_of_a_clean_run_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_steps(tmp_path, [1, 2])
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(tmp_path), "--verify", "--json")
    assert rc == 0 and json.loads(out)["latest_valid"] == 2
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(tmp_path), "--verify")  # not a terminal: no bar
    assert rc == 0
    assert sum("every chunk CRC matches" in line for line in out.splitlines()[1:3]) == 2, out
    assert "--verify: re-read 2 checkpoint(s)" in out and out.rstrip().endswith("every chunk CRC matches"), out


def test_verify_progress_bar(mixed_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_steps(tmp_path, [1, 2, 3], n=100_000)  # several 64 KiB chunks per shard
    bar = io.StringIO()
    assert ins.inspect_checkpoints(str(tmp_path), verify=True, as_json=False, progress_stream=bar) == 0
    frames = bar.getvalue().split("\r")
    assert frames[-1].startswith("verifying [" + "#" * 30 + "] 100.0%")
    assert frames[-1].rstrip().endswith("/ " + progress.human(sum(ins._verify_sizes(run_dir_unit.scan_run_dir(tmp_path)))))
    bar = io.StringIO()
    assert ins.inspect_checkpoints(str(mixed_run), verify=True, as_json=False, progress_stream=bar) == 1
    assert "100.0%" not in bar.getvalue().split("\r")[-1]  # a corrupt shard was not read to the end


def test_shard_progress_banks_each_shard() -> None:
    out = io.StringIO()
    bar = progress.ProgressBar(100, out)
    track = progress.ShardProgress(bar)
    for done in (10, 20, 40, 10, 30, 60):  # shard of 40, then shard of 60
        track(done)
    assert bar.done == 100
    bar.close()
    assert "100.0%" in out.getvalue().split("\r")[-1]


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(8, 8, bias=False)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Attention()
        self.norm = nn.LayerNorm(8)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.out = nn.Linear(8, 4).to(torch.bfloat16)


def _training_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model.layers[0].attention.wq.weight.sum().backward()
    opt.step()
    sched.step()
    loader = ResumableLoader(list(range(64)), batch_size=4, seed=3)
    it = iter(loader)
    for _ in range(3):
        next(it)
    return {"model": model, "optim": opt, "sched": sched, "rng": alpsck.RNGState(), "data": loader, "step": 7}


@pytest.fixture(scope="module")
def training_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    run = tmp_path_factory.mktemp("train")
    state = _training_state()
    with alpsck.Checkpointer(run, keep_last=0) as ck:
        ck.save(7, state).wait()
        state["step"] = 8
        ck.save(8, state).wait()
    state["step"] = 7
    return run, state


def test_step_tensors_json(training_run: tuple[Path, dict[str, object]], capsys: pytest.CaptureFixture[str]) -> None:
    run, state = training_run
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(run), "--step", "7", "--tensors", "--json")
    assert rc == 0
    doc = json.loads(out)
    live = capture(state).tensors
    assert doc["step"] == 7
    assert [t["name"] for t in doc["tensors"]] == list(live)
    for t in doc["tensors"]:
        ref = live[t["name"]]
        assert t["dtype"] == tree.dtype_name(ref.dtype) and t["shape"] == list(ref.shape)
        assert t["bytes"] == ref.numel() * ref.element_size()
    names = {t["name"]: t for t in doc["tensors"]}
    assert names["model/layers.0.attention.wq.weight"]["shape"] == [8, 8]
    assert names["model/out.weight"]["dtype"] == "bfloat16"
    assert doc["tensor_bytes"] == sum(t["bytes"] for t in doc["tensors"])
    s = doc["state"]
    assert s["entries"] == {"model": "module", "optim": "stateful", "sched": "stateful", "rng": "stateful",
                            "data": "stateful", "step": "value"}
    assert s["values"] == {"step": 7}
    lrs = {(lr["path"], lr["source"]): lr["lr"] for lr in s["learning_rates"]}
    assert lrs == {("optim", "param_groups"): [pytest.approx(5e-4)], ("sched", "last_lr"): [pytest.approx(5e-4)]}
    assert s["rng"] == {"rng": ["python", "numpy", "torch"]}
    assert s["data"] == {"data": {"epoch": 0, "position": 12, "seed": 3}}


def test_step_tensors_text(training_run: tuple[Path, dict[str, object]], capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = training_run
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(run), "--step", "8", "--tensors")
    assert rc == 0
    assert "checkpoint step 8" in out
    line = next(x for x in out.splitlines() if "model/out.weight" in x).split()
    assert line[1:] == ["bfloat16", "[4,", "8]", "64"]
    assert "learning rate: optim (param_groups) = 0.0005" in out
    assert "learning rate: sched (last_lr) = 0.0005" in out
    assert "rng streams (rng): python, numpy, torch" in out
    assert "data position (data): epoch=0 position=12" in out
    assert "step = 8" in out
    # --tensors alone describes the newest valid checkpoint; --step alone gives the summary without the table
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(run), "--tensors", "--json")
    assert rc == 0 and json.loads(out)["step"] == 8
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(run), "--step", "7")
    assert rc == 0 and "learning rate" in out and "model/out.weight" not in out


def test_step_verify(training_run: tuple[Path, dict[str, object]], capsys: pytest.CaptureFixture[str]) -> None:
    run, _ = training_run
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(run), "--step", "7", "--verify", "--json")
    assert rc == 0 and json.loads(out)["verified"] is True


def test_step_verify_of_a_checkpoint_the_scan_finds_corrupt_exits_1(mixed_run: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--verify promises exit 1 on corruption (2 is for errors): step 4's truncated shard gave exit 2."""
    rc, out, err = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--step", "4", "--verify")
    assert rc == 1 and "CORRUPT:" in out and "footer" in out and err == ""
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--step", "4", "--verify", "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["step"] == 4 and doc["status"] == "corrupt" and doc["verified"] is False and "footer" in doc["error"]
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--step", "5", "--verify")
    assert rc == 2 and "step 5 is incomplete" in err  # not corruption: an error, as before


def test_missing_step_names_it_and_lists_available(mixed_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--step", "42", "--tensors")
    assert rc == 2
    assert "no checkpoint of step 42" in err
    assert "available: 1 (committed), 2 (committed), 3 (committed), 4 (corrupt), 5 (incomplete)" in err
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(mixed_run), "--step", "4", "--tensors")
    assert rc == 2 and "step 4 is corrupt" in err and "footer" in err


def test_bad_run_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(tmp_path / "missing"))
    assert rc == 2 and f"{tmp_path / 'missing'}: no such directory" in err
    (tmp_path / "file").write_text("x")
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(tmp_path / "file"))
    assert rc == 2 and "not a directory" in err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(tmp_path / "other"))
    assert rc == 2 and "not an alpsck run directory" in err
    rc, _, err = run_cli(capsys, "prune", str(tmp_path / "other"), "--keep-last", "1")
    assert rc == 2 and "not an alpsck run directory" in err
    with alpsck.TorchSaveCheckpointer(tmp_path / "torch") as tc:  # the baseline's files are named as such
        tc.save(4, {"w": torch.ones(2)})
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(tmp_path / "torch"))
    assert rc == 2 and "1 torch-step-*.pt file(s) are the torch.save baseline's" in err, err
    (tmp_path / "other" / "LATEST").write_text("3")  # a run dir whose checkpoints are all gone
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(tmp_path / "other"))
    assert rc == 0 and "no checkpoints" in out


def test_permission_denied_names_the_path(mixed_run: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    def denied_scan(path: str, **_: object) -> None:
        raise CheckpointIOError(errno.EACCES, f"list {path}: Permission denied")

    monkeypatch.setattr(run_dir_unit._core, "scan", denied_scan)
    monkeypatch.setattr(run_dir_unit._core, "pick", denied_scan)  # the picker lists the run directory too
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(mixed_run))
    assert rc == 2 and f"{mixed_run}: permission denied" in err
    monkeypatch.undo()

    def denied_listdir(path: object) -> list[str]:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(run_dir_unit.os, "listdir", denied_listdir)
    rc, _, err = run_cli(capsys, "inspect-checkpoints", str(mixed_run))
    assert rc == 2 and f"{mixed_run}: permission denied" in err


def test_json_output_is_strict_json_with_non_finite_values(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with alpsck.Checkpointer(run) as ck:
        ck.save(1, {"w": torch.ones(3), "best": float("inf"), "last": float("nan"), "low": float("-inf")}).wait()
    rc, out, _ = run_cli(capsys, "inspect-checkpoints", str(run), "--step", "1", "--json")
    assert rc == 0

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    doc = json.loads(out, parse_constant=refuse)
    values = doc["state"]["values"]
    assert (values["best"], values["last"], values["low"]) == ("inf", "nan", "-inf")


def test_a_file_system_error_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 1 means "corruption found" for --verify; an OSError no command explained (here a
    read-only file system, which this machine cannot mount for a test) must not look like it."""
    run = tmp_path / "run"
    save_steps(run, [1, 2])

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(run / "step-000000001"))

    monkeypatch.setattr(os, "walk", read_only)  # prune sizes what it removes
    rc, _, err = run_cli(capsys, "prune", str(run), "--keep-last", "1")
    assert rc == 2
    assert err.strip().splitlines() == [f"alpsck: error: {run / 'step-000000001'}: Read-only file system"]
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- prune


def test_prune_keeps_the_newest_k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prunable_run(tmp_path)
    latest = (tmp_path / "LATEST").read_text()
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "2")
    assert rc == 0, err
    assert run_listing(tmp_path) == ["LATEST", "step-000000005", "step-000000007", "step-000000008"]
    assert "step-000000008" in err and "warning" in err  # the newer corrupt one is kept, with a warning
    for gone in ("step-000000001", "step-000000003", "step-000000009.tmp", "free-2-1234", "step-000000006"):
        assert f"removed {tmp_path / gone}" in out
    assert (tmp_path / "LATEST").read_text() == latest
    infos = _core.scan(str(tmp_path), verify=True)
    assert [(i["step"], i["status"]) for i in infos] == [(5, "committed"), (7, "committed"), (8, "corrupt")]
    live = {"w": torch.zeros(2000), "b": torch.zeros(2000, dtype=torch.int32), "step": 0}
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert alpsck.checkpointer.restore_into(tmp_path, live) == 7
    assert live["w"][0].item() == 7.0


def test_prune_survives_odd_entries_a_user_or_tool_left(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A symlinked step dir is sized (and removed) as the link, never walked; a lock file that is
    deeply nested JSON is read as text, not a RecursionError."""
    save_steps(tmp_path, [2, 3])
    target = tmp_path.parent / "elsewhere"
    target.mkdir()
    (target / "big").write_bytes(b"x" * 3_000_000)
    (tmp_path / "step-000000001").symlink_to(target)  # no manifest, older than the newest valid: removed
    (tmp_path / ".lock").write_text("{\"a\":" * 100_000)
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1", "--dry-run")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if "step-000000001" in x)
    assert "(0 B)" in line, line
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert rc == 0, err
    assert not (tmp_path / "step-000000001").exists() and (target / "big").exists()


def test_prune_dry_run_removes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prunable_run(tmp_path)
    before = run_listing(tmp_path)
    rc, out, _ = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1", "--dry-run")
    assert rc == 0
    assert run_listing(tmp_path) == before
    assert f"would remove {tmp_path / 'step-000000005'}" in out
    assert f"would remove {tmp_path / 'free-2-1234'}" in out
    assert "would remove" not in "".join(x for x in out.splitlines() if "step-000000007" in x)


def test_prune_never_removes_the_last_valid_or_newer_corrupt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_steps(tmp_path, [1, 2])
    truncate_shard(tmp_path, 1)
    truncate_shard(tmp_path, 2)  # no valid checkpoint at all: keep the corrupt ones for inspection
    rc, _, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert rc == 0 and "step-000000001" in err and "step-000000002" in err
    assert run_listing(tmp_path) == ["LATEST", "step-000000001", "step-000000002"]
    rc, _, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "0")  # keep all: still nothing lost
    assert rc == 0 and run_listing(tmp_path) == ["LATEST", "step-000000001", "step-000000002"]


@pytest.mark.parametrize("verify", [False, True])
def test_prune_never_keeps_data_corruption_in_place_of_a_good_checkpoint(tmp_path: Path, verify: bool,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    save_steps(tmp_path, [1, 2, 3, 4])
    _flip_data_byte(tmp_path, 4)  # only a CRC check sees it: sizes, footer and manifest are intact
    _flip_data_byte(tmp_path, 2)
    assert [i["status"] for i in _core.scan(str(tmp_path))] == ["committed"] * 4  # the quick scan trusts both
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "2", *(["--verify"] if verify else []))
    assert rc == 0, err
    # 4 is kept for inspection (newer than the newest valid one), with a warning naming the CRC;
    # 2 is not counted as one of the two kept, so 1 stays beside 3.
    assert "step-000000004" in err and "CRC" in err
    assert run_listing(tmp_path) == ["LATEST", "step-000000001", "step-000000003", "step-000000004"]
    assert f"corrupt step 2: {tmp_path / 'step-000000002'}" in out and "keeping step(s) 1, 3" in out
    live = {"w": torch.zeros(2000), "b": torch.zeros(2000, dtype=torch.int32), "step": 0}
    with pytest.warns(RuntimeWarning, match="corrupt"):
        assert alpsck.checkpointer.restore_into(tmp_path, live) == 3


def test_prune_finishes_an_interrupted_prune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_steps(tmp_path, [1, 2])
    os.rename(tmp_path / "step-000000001", tmp_path / ".deleting-step-000000001")
    rc, _, _ = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert rc == 0 and run_listing(tmp_path) == ["LATEST", "step-000000002"]


def test_prune_refuses_while_the_lock_file_is_flocked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_steps(tmp_path, [1, 2])
    lock = tmp_path / ".lock"
    lock.write_text("")
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rc, _, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    finally:
        os.close(fd)
    assert rc == 2 and "lock" in err
    assert "step-000000001" in run_listing(tmp_path)


def test_prune_keeps_a_manifest_less_step_dir_newer_than_the_newest_valid(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A step-N without MANIFEST.json was never committed (a copy still in progress, say): like a corrupt
    checkpoint, it is removed when older than the newest valid one and kept, with a warning, when newer."""
    save_steps(tmp_path, [1, 2, 3, 4])
    (tmp_path / "step-000000002" / "MANIFEST.json").unlink()
    (tmp_path / "step-000000004" / "MANIFEST.json").unlink()
    (tmp_path / "step-000000005.tmp").mkdir()  # a .tmp is abandoned whatever its step: removed
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert rc == 0, err
    assert run_listing(tmp_path) == ["LATEST", "step-000000003", "step-000000004"]
    warning = next(x for x in err.splitlines() if "step-000000004" in x)
    assert "warning" in warning and "newer than the newest valid one" in warning and "MANIFEST.json" in warning
    for gone in ("step-000000001", "step-000000002", "step-000000005.tmp"):
        assert f"removed {tmp_path / gone}" in out
    truncate_shard(tmp_path, 3)  # no valid checkpoint left: nothing is known to be newer, so it stays too
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "1")
    assert rc == 0 and "no valid checkpoint exists" in err
    assert run_listing(tmp_path) == ["LATEST", "step-000000003", "step-000000004"]


# ----------------------------------------------------------------------------- superseded histories


def _supersede(run: Path, step: int, pid: int = 4321, seq: int = 0) -> str:
    """What the core does to a step of an abandoned history on the first save after resuming from an older one."""
    name = f"superseded-step-{step:09d}-{pid}-{seq}"
    os.rename(run / f"step-{step:09d}", run / name)
    return name


def _abandoned_run(run: Path) -> tuple[str, str]:
    """Committed 1, 2, 3; steps 4 and 5 superseded (the run went on from 3); two look-alikes that are not."""
    save_steps(run, [1, 2, 3, 4, 5])
    names = (_supersede(run, 4, seq=0), _supersede(run, 5, seq=1))
    (run / "superseded-notes").mkdir()  # not a name the core writes: neither listed nor removed
    (run / "superseded-step-12x-1-0").mkdir()
    return names


def test_inspect_lists_superseded_directories_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s4, s5 = _abandoned_run(tmp_path)
    rc, out, err = run_cli(capsys, "inspect-checkpoints", str(tmp_path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert set(doc) == {"latest_valid", "checkpoints", "skipped", "superseded", "lustre_layout", "memory"}
    assert doc["skipped"] == []  # superseded directories are no checkpoints: nothing newer was skipped
    assert doc["latest_valid"] == 3 and [c["step"] for c in doc["checkpoints"]] == [1, 2, 3]
    assert [(s["step"], s["path"]) for s in doc["superseded"]] == [(4, str(tmp_path / s4)), (5, str(tmp_path / s5))]
    assert all(s["bytes"] == run_dir_unit.dir_bytes(tmp_path / s["path"]) > 0 for s in doc["superseded"])
    rc, out, err = run_cli(capsys, "inspect-checkpoints", str(tmp_path))
    assert rc == 0, err
    assert ("2 superseded checkpoint directories (an abandoned history, never restored): "
            f"step 4 ({s4}), step 5 ({s5}); `alpsck prune` removes them") in out.splitlines()
    assert "notes" not in out and "12x" not in out
    live = {"w": torch.zeros(2000), "b": torch.zeros(2000, dtype=torch.int32), "step": 0}
    assert alpsck.checkpointer.restore_into(tmp_path, live) == 3  # never restored
    # a run directory left with nothing but a superseded history is still a run directory
    only = tmp_path / "only"
    only.mkdir()
    os.rename(tmp_path / s5, only / s5)
    rc, out, err = run_cli(capsys, "inspect-checkpoints", str(only))
    assert rc == 0, err
    assert out.splitlines() == [f"{only}: no checkpoints",
                                "1 superseded checkpoint directory (an abandoned history, never restored): "
                                f"step 5 ({s5}); `alpsck prune` removes it"]


def test_prune_removes_superseded_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s4, s5 = _abandoned_run(tmp_path)
    before = run_listing(tmp_path)
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "10", "--dry-run")
    assert rc == 0, err
    assert run_listing(tmp_path) == before
    for s in (s4, s5):
        line = next(x for x in out.splitlines() if s in x)
        assert line.startswith(f"would remove {tmp_path / s} (") and line.endswith("): superseded (abandoned history)")
    assert out.count("would remove") == 2 and "keeping step(s) 1, 2, 3" in out
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "10")
    assert rc == 0, err
    assert run_listing(tmp_path) == ["LATEST", "step-000000001", "step-000000002", "step-000000003",
                                  "superseded-notes", "superseded-step-12x-1-0"]
    assert f"removed {tmp_path / s4}" in out and f"removed {tmp_path / s5}" in out
    assert [(i["step"], i["status"]) for i in _core.scan(str(tmp_path), verify=True)] == [
        (1, "committed"), (2, "committed"), (3, "committed")]
    # an interrupted prune of one (renamed, not yet deleted) is finished by the next
    save_steps(tmp_path, [6])
    os.rename(tmp_path / _supersede(tmp_path, 6), tmp_path / ".deleting-superseded-step-000000006-1-0")
    rc, out, err = run_cli(capsys, "prune", str(tmp_path), "--keep-last", "10")
    assert rc == 0, err
    assert not any(n.startswith(".deleting-") for n in run_listing(tmp_path))


def test_a_folder_of_checkpoints_lists_each_steps_kind_and_exits_1_when_none_can_be_resumed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 56, item 6: torchtitan's folder, a FileSystemWriter step and an alpsck one: neither is called damaged;
    the FileSystemWriter one names import-dcp; exit 1 once no step can be resumed (and so for a run directory
    whose checkpoints are all damaged)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from alpsck.dcp import AlpsckStorageWriter

    folder = tmp_path / "checkpoint"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(folder / "step-10")))
        dcp.save({"w": torch.ones(3)}, checkpoint_id=folder / "step-20", storage_writer=AlpsckStorageWriter())
    assert ins.inspect_checkpoints(str(folder), False, False) == 0
    out = capsys.readouterr().out
    assert "damaged" not in out and "start fresh" not in out, out
    lines = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in out.splitlines()[2:4]}
    assert lines["10"].split()[1] == "filesystemwriter" and f"alpsck import-dcp {folder / 'step-10'} --trust-pickle" in \
        lines["10"], out
    assert lines["20"].startswith("*") and "alpsck's; its newest valid generation: 1" in lines["20"], out
    assert ins.inspect_checkpoints(str(folder), False, True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["folder"] and doc["latest_valid"] == 20
    assert [(s["step"], s["kind"], s["newest_generation"]) for s in doc["steps"]] == [
        (10, "filesystemwriter", None), (20, "alpsck", 1)]
    for p in (folder / "step-20").iterdir():  # alpsck's step gone: nothing left that alpsck's reader can load
        if p.is_dir():
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
    assert ins.inspect_checkpoints(str(folder), False, False) == 1
    assert "no step alpsck's DCP reader can load: a resume would start fresh" in capsys.readouterr().out
    run = tmp_path / "run"  # a run directory whose only checkpoint has lost its manifest
    save_steps(run, [1])
    (run / _core.step_dir_name(1) / "MANIFEST.json").unlink()
    assert ins.inspect_checkpoints(str(run), False, False) == 1
    assert "no valid checkpoint: restore would start fresh" in capsys.readouterr().out
