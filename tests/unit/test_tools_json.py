"""``--json`` on ``alpsck prune``, ``alpsck export`` and ``alpsck promote`` (issue 52, item 6): one JSON
document on stdout saying what was done, checked here against the run directory as it is afterwards;
and ``prune --keep-last 0``, which keeps every committed checkpoint (the engine's keep_last 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import alpsck
from alpsck import _core, cli

STEP = _core.step_dir_name


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The real ``alpsck`` command line, in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse refused an argument
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    rc, out, err = _run(capsys, *argv)
    assert rc == 0, err
    assert len(out.strip().splitlines()) == 1, out  # one document, nothing else on stdout
    return json.loads(out)  # type: ignore[no-any-return]


def _save(run: Path, steps: list[int], losses: dict[int, float] | None = None) -> None:
    with alpsck.Checkpointer(run, keep_last=0, max_in_flight=1) as ck:
        for s in steps:
            metrics = {"loss": (losses or {}).get(s, 1.0 / s)}
            ck.save(s, {"w": torch.full((300,), float(s)), "b": torch.arange(7, dtype=torch.int32)}, metrics=metrics).wait()


def _listing(run: Path) -> list[str]:
    return sorted(os.listdir(run))


@pytest.mark.parametrize("dry_run", [True, False])
def test_prune_json_says_what_it_keeps_and_removes_and_why(tmp_path: Path, dry_run: bool,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2, 3, 4, 5, 6], losses={2: 0.01})
    os.mkdir(run / _core.tmp_dir_name(7))  # an abandoned attempt
    sizes = {n: sum(f.stat().st_size for f in (run / n).iterdir()) for n in _listing(run) if (run / n).is_dir()}
    before = _listing(run)
    argv = ["prune", str(run), "--keep-last", "2", "--keep-best", "loss:min:1", "--json"] + (["--dry-run"] if dry_run else [])
    doc = _json(capsys, *argv)
    assert doc["dry_run"] is dry_run and doc["run_dir"] == str(run) and doc["error"] is None
    assert doc["policy"] == {"keep_last": 2, "keep_every_steps": 0, "keep_every_seconds": 0.0,
                             "keep_best": "loss:min:1", "text": "keep_last 2, the newest healthy, pinned, keep_best loss min 1"}
    assert doc["kept_steps"] == [2, 5, 6]
    kept = {k["step"]: k for k in doc["kept"]}
    assert set(kept) == {2, 5, 6} and all(k["status"] == "committed" for k in kept.values())
    assert "keep_best loss min 1 (#1)" in kept[2]["rules"] and "keep_last 2" in kept[5]["rules"]
    assert kept[6]["rules"] == ["newest healthy", "keep_last 2"] and kept[6]["reason"] == "newest healthy, keep_last 2"
    gone = doc["would_remove"] if dry_run else doc["removed"]
    assert doc["removed" if dry_run else "would_remove"] == []
    by_name = {e["name"]: e for e in gone}
    assert set(by_name) == {STEP(1), STEP(3), STEP(4), _core.tmp_dir_name(7)}
    assert by_name[STEP(3)] == {"path": str(run / STEP(3)), "name": STEP(3), "kind": "step", "step": 3,
                                "bytes": sizes[STEP(3)], "reason": "committed step 3: no rule keeps it"}
    assert by_name[_core.tmp_dir_name(7)]["kind"] == "attempt" and by_name[_core.tmp_dir_name(7)]["step"] == 7
    freed = sum(e["bytes"] for e in gone)
    assert freed == sum(sizes[n] for n in by_name)
    assert (doc["would_free_bytes"], doc["freed_bytes"]) == ((freed, 0) if dry_run else (0, freed))
    if dry_run:
        assert _listing(run) == before
    else:  # the document is the run directory's state: what it names removed is gone, what it keeps is there
        assert _listing(run) == sorted({".lock", "LATEST", STEP(2), STEP(5), STEP(6)})


def test_prune_json_lists_what_it_keeps_for_inspection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2, 3])
    (run / STEP(3) / "MANIFEST.json").unlink()  # newer than the newest valid one: kept, damaged
    doc = _json(capsys, "prune", str(run), "--keep-last", "1", "--json")
    spared = [k for k in doc["kept"] if k["status"] != "committed"]
    assert [(k["step"], k["status"], k["rules"]) for k in spared] == [(3, "damaged", [])]
    assert "kept for inspection" in spared[0]["reason"] and len(doc["warnings"]) == 1
    assert [e["step"] for e in doc["removed"]] == [1] and doc["kept_steps"] == [2]
    assert (run / STEP(3)).is_dir() and not (run / STEP(1)).exists()


def test_prune_keep_last_0_keeps_every_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2, 3])
    os.mkdir(run / _core.tmp_dir_name(4))  # a leftover, not a checkpoint: still removed
    rc, out, err = _run(capsys, "prune", str(run), "--keep-last", "0", "--dry-run")
    assert rc == 0, err
    assert "policy: keep_last 0 (keep all)" in out
    assert all(f"keep {run / STEP(s)}: keep_last 0 (keep all)" in out for s in (1, 2, 3)), out
    doc = _json(capsys, "prune", str(run), "--keep-last", "0", "--json")
    assert doc["kept_steps"] == [1, 2, 3] and doc["policy"]["text"] == "keep_last 0 (keep all)"
    assert [e["name"] for e in doc["removed"]] == [_core.tmp_dir_name(4)]
    assert _listing(run) == [".lock", "LATEST", STEP(1), STEP(2), STEP(3)]


@pytest.mark.parametrize(("flag", "value"), [("--keep-every-steps", "10"), ("--keep-every-seconds", "60"),
                                             ("--keep-best", "loss:min:2")])
def test_prune_keep_last_0_with_another_rule_is_refused_by_name(tmp_path: Path, flag: str, value: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2])
    rc, out, err = _run(capsys, "prune", str(run), "--keep-last", "0", flag, value)
    assert rc == 2 and out == ""
    assert err.startswith(f"alpsck: error: {flag} is set, but --keep-last is 0, which keeps every checkpoint") and \
        err.count("\n") == 1, err
    assert _listing(run) == [".lock", "LATEST", STEP(1), STEP(2)]


def test_prune_keep_last_below_0_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, "prune", str(tmp_path), "--keep-last", "-1")
    assert rc == 2 and "--keep-last" in err


def test_export_json_names_the_checkpoint_and_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2])
    out = tmp_path / "w.safetensors"
    doc = _json(capsys, "export", str(run), str(out), "--json")
    assert doc == {"run_dir": str(run), "source": str(run / STEP(2)), "step": 2, "rank": 0, "subtree": None,
                   "path": str(out), "format": "safetensors", "tensors": 2, "tensor_bytes": 300 * 4 + 7 * 4,
                   "bytes": out.stat().st_size, "files": None, "skipped": []}
    back = load_file(out)
    assert sorted(back) == ["b", "w"] and back["w"][0].item() == 2.0
    doc = _json(capsys, "export", str(run), str(tmp_path / "w.pt"), "--step", "1", "--subtree", "w", "--json")
    assert (doc["step"], doc["source"], doc["format"], doc["subtree"], doc["tensors"]) == (1, str(run / STEP(1)), "torch",
                                                                                            "w", 1)
    assert doc["bytes"] == (tmp_path / "w.pt").stat().st_size


def test_export_json_lists_the_newer_steps_it_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1, 2])
    (run / STEP(2) / "MANIFEST.json").unlink()
    doc = _json(capsys, "export", str(run), str(tmp_path / "w.safetensors"), "--json")
    assert doc["step"] == 1 and [(k["step"], k["reason"]) for k in doc["skipped"]] == [(2, "damaged")]


def test_export_json_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _save(run, [1])
    rc, out, err = _run(capsys, "export", str(run), str(tmp_path / "w.safetensors"), "--step", "5", "--json")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "no checkpoint of step 5" in err


def test_promote_json_names_the_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, dest = tmp_path / "run", tmp_path / "store"
    _save(run, [1, 2])
    doc = _json(capsys, "promote", str(run), str(dest), "--step", "1", "--json")
    files = sorted((run / STEP(1)).iterdir())
    assert doc == {"run_dir": str(run), "source": str(run / STEP(1)), "dest": str(dest), "path": str(dest / STEP(1)),
                   "step": 1, "files": len(files), "bytes": sum(f.stat().st_size for f in files), "verified": True,
                   "skipped": []}
    assert sorted(f.name for f in (dest / STEP(1)).iterdir()) == [f.name for f in files]
    assert [i["step"] for i in _core.scan(str(dest), verify=True) if i["status"] == "committed"] == [1]
    rc, out, err = _run(capsys, "promote", str(run), str(dest), "--step", "1", "--json")  # never replaces
    assert rc == 2 and out == "" and err.count("\n") == 1 and "exists already" in err
