"""Bytes that are not UTF-8 are input like any other (issue 52, item 7).

File names and file contents are bytes; Python holds the ones that are not valid UTF-8 with
surrogate escapes, and a str with a lone surrogate raised a TypeError in the binding (a lock
file's owner record) or a UnicodeEncodeError writing the batch script (a ``run_dir`` expanding an
environment variable). Here non-UTF-8 bytes are planted in every place a command reads (the lock,
LATEST, history.jsonl, a manifest, PINNED, rollbacks.json, a job log, entry names of the run
directory and of a checkpoint, the run directory's own name, the environment a config expands) and
every command runs through the real command line: each works or says why in one line (exit 2),
never with a Python traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.manifests import reseal

import alpsck
from alpsck import _core

STEP = _core.step_dir_name
BAD = b"\xff\xfe"  # never valid UTF-8


def _cli(*args: str | bytes, cwd: Path | None = None, env: dict[str, str] | None = None,
         env_bytes: dict[bytes, bytes] | None = None) -> subprocess.CompletedProcess[bytes]:
    full: dict[bytes, bytes] | None = None
    if env_bytes is not None:
        full = {**os.environb, **env_bytes}
    elif env is not None:
        full = {**os.environb, **{k.encode(): v.encode() for k, v in env.items()}}
    return subprocess.run([sys.executable, "-m", "alpsck", *args], capture_output=True, timeout=120, cwd=cwd,
                          env=full)  # type: ignore[arg-type]  # bytes keys and values are what os.environb holds


def _make_run(run: Path) -> Path:
    with alpsck.Checkpointer(run, keep_last=0, max_in_flight=1) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"w": torch.full((500,), float(step))}, metrics={"loss": 1.0 / step}).wait()
    return run


def _bpath(p: Path) -> bytes:
    return os.fsencode(p)


def _plant_lock(run: Path) -> None:
    (run / ".lock").write_bytes(b'{"pid":"1","host":"h' + BAD + b'","job_id":"' + BAD + b'"}')


def _plant_lock_garbage(run: Path) -> None:
    (run / ".lock").write_bytes(BAD + b"\x00not json" + BAD)


def _plant_files(run: Path) -> None:
    """Everything that does not stop a command by itself: small files and entry names."""
    b = _bpath(run)
    (run / "LATEST").write_bytes(b"3" + BAD)
    events = [{"time": 1.0e9, "event": "submitted", "job_id": "12", "backend": "local"},
              {"time": 1.0e9 + 1, "event": "started", "job_id": "12", "backend": "local", "step": 1}]
    lines = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    lines += b'{"time": 1000000002, "event": "sig' + BAD + b'", "message": "m' + BAD + b'"}\n'
    lines += b'{"time": 1000000003, "event": "failed", "job_id": "' + BAD + b'", "reason": "' + BAD + b'"}\n'
    lines += BAD + b"\n"
    (run / "history.jsonl").write_bytes(lines)
    (run / STEP(1) / "PINNED").write_bytes(BAD)
    (run / "rollbacks.json").write_bytes(b'{"format": 1, "rollbacks": [' + BAD + b"]}")
    (run / "submitit").mkdir()
    (run / "submitit" / "12_0_log.out").write_bytes(b"line " + BAD + b"\nValueError: " + BAD + b"\n")
    os.mkdir(b + b"/" + os.fsencode(STEP(9)) + BAD)                   # step-N with a tail
    os.mkdir(b + b"/" + os.fsencode(_core.tmp_dir_name(4)) + BAD)     # an attempt with a tail
    os.mkdir(b + b"/free-" + BAD)
    os.mkdir(b + b"/superseded-" + os.fsencode(STEP(2)) + b"-" + BAD)
    os.mkdir(b + b"/.deleting-" + BAD)
    open(b + b"/" + BAD, "wb").close()
    os.mkdir(b + b"/" + BAD + b"-dir")
    open(b + b"/" + os.fsencode(STEP(2)) + b"/" + BAD, "wb").close()  # a stray file inside a checkpoint


def _plant_manifest_sealed(run: Path) -> None:
    """Step 2's manifest, sealed with its own CRC, with a metric named by bytes that are not UTF-8 (corrupt)."""
    m = run / STEP(2) / "MANIFEST.json"
    m.write_bytes(reseal(m.read_bytes().replace(b'"metrics":{"loss"', b'"metrics":{"l' + BAD + b'"')))


def _plant_manifest_raw(run: Path) -> None:
    m = run / STEP(3) / "MANIFEST.json"
    m.write_bytes(m.read_bytes().replace(b'"format"', b'"f' + BAD + b'"'))


SCENARIOS = {
    "lock": (_plant_lock,),
    "lock-garbage": (_plant_lock_garbage,),
    "files-and-names": (_plant_files,),
    "manifest-sealed": (_plant_manifest_sealed,),
    "manifest-raw": (_plant_manifest_raw,),
    "run-dir-name": (_plant_files, _plant_manifest_sealed),  # in a run directory whose own name is not UTF-8
}


def _commands(run: bytes, out: bytes) -> dict[str, list[bytes]]:
    return {
        "inspect": [b"inspect-checkpoints", run],
        "inspect-json": [b"inspect-checkpoints", run, b"--json"],
        "inspect-verify": [b"inspect-checkpoints", run, b"--verify"],
        "inspect-step": [b"inspect-checkpoints", run, b"--step", b"3", b"--tensors"],
        "prune-dry": [b"prune", b"--dry-run", run, b"--keep-last", b"1"],
        "prune-dry-json": [b"prune", b"--dry-run", run, b"--keep-last", b"1", b"--json"],
        "pin": [b"pin", run, b"3"],
        "unpin": [b"unpin", run, b"3"],
        "export": [b"export", run, out + b"/w-" + BAD + b".safetensors"],
        "export-json": [b"export", run, out + b"/w.pt", b"--json"],
        "promote": [b"promote", run, out + b"/dest-" + BAD],
        "status": [b"status", run],
        "status-json": [b"status", run, b"--json"],
        "prune": [b"prune", run, b"--keep-last", b"1", b"--json"],  # last: it changes the run directory
    }


# Runs every command of every scenario through the command line's own entry point (alpsck.cli.main, as
# `python3 -m alpsck` does) in one process, so torch is imported once: stdout is a UTF-8 stream with the
# error handler this process's own stdout has; anything that escapes main() is reported as a traceback.
DRIVER = """
import io, json, os, sys, traceback
from alpsck import cli
results = []
for argv in json.load(open(sys.argv[1])):
    out, err = io.BytesIO(), io.BytesIO()
    handler = os.environ.get("T_ERRORS", sys.__stdout__.errors)  # T_ERRORS=strict: as under a strict locale
    sys.stdout = io.TextIOWrapper(out, encoding="utf-8", errors=handler, write_through=True)
    sys.stderr = io.TextIOWrapper(err, encoding="utf-8", errors="backslashreplace", write_through=True)
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 2
    except BaseException:
        sys.stderr.write(traceback.format_exc())
        rc = 99
    sys.stdout.flush(), sys.stderr.flush()
    results.append({"rc": rc, "out": out.getvalue().decode("utf-8", "surrogateescape"),
                    "err": err.getvalue().decode("utf-8", "replace")})
sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
print(json.dumps(results))
"""


def _no_traceback(rc: int, err: str, what: str) -> None:
    assert "Traceback" not in err, f"{what}:\n{err}"
    assert rc in (0, 1, 2), f"{what}: exit {rc}\n{err}"
    if rc == 2:
        errors = [ln for ln in err.splitlines() if re.match(r"alpsck( [a-z-]+)?: error: ", ln)]
        assert len(errors) == 1, f"{what}: not one error line:\n{err}"


def test_every_command_works_or_says_why_in_one_line(tmp_path: Path) -> None:
    cases: list[tuple[str, str, list[bytes]]] = []
    runs: dict[str, Path] = {}
    for scenario, plants in SCENARIOS.items():
        base = tmp_path / scenario
        base.mkdir()
        name = b"run-" + BAD if scenario == "run-dir-name" else b"run"
        run = runs[scenario] = Path(os.fsdecode(_bpath(base) + b"/" + name))
        _make_run(run)
        for plant in plants:
            plant(run)
        (base / "out").mkdir()
        cases += [(scenario, what, argv) for what, argv in _commands(_bpath(run), _bpath(base / "out")).items()]
    (tmp_path / "cases.json").write_text(json.dumps([[os.fsdecode(a) for a in argv] for _, _, argv in cases]))
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "cases.json")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    done = {(scenario, what): res for (scenario, what, _), res in zip(cases, json.loads(r.stdout), strict=True)}
    for (scenario, what), res in done.items():
        _no_traceback(res["rc"], res["err"], f"{scenario}: {what}")
    newest = {"manifest-raw": 2}  # step 3's manifest is corrupt there: the newest valid one is step 2
    for scenario, run in runs.items():
        rc = {what: int(done[scenario, what]["rc"]) for (sc, what) in done if sc == scenario}
        ok = {"inspect", "inspect-json", "export", "export-json", "promote"}
        ok |= {"prune-dry", "prune-dry-json", "prune"} if scenario != "lock" else set()
        ok |= {"status", "status-json"} if (run / "history.jsonl").exists() else set()
        ok |= {"inspect-step", "pin", "unpin"} if scenario != "manifest-raw" else set()
        assert {w for w in ok if rc[w] != 0} == set(), (scenario, {w: done[scenario, w]["err"] for w in ok if rc[w]})
        if scenario == "lock":  # a garbled record names another host: refused, naming the lock (garbage: no owner)
            for what in ("prune-dry", "prune-dry-json", "prune"):
                assert rc[what] == 2 and ".lock names a writer on host" in done[scenario, what]["err"]
            continue
        corrupt = _plant_manifest_sealed in SCENARIOS[scenario] or _plant_manifest_raw in SCENARIOS[scenario]
        assert rc["inspect-verify"] == (1 if corrupt else 0), done[scenario, "inspect-verify"]
        doc = json.loads(done[scenario, "prune"]["out"])
        pinned = [1] if (run / STEP(1) / "PINNED").exists() else []  # a pin is its file, whatever it holds
        assert doc["kept_steps"] == [*pinned, newest.get(scenario, 3)], (scenario, doc)
        assert os.path.isdir(run / STEP(newest.get(scenario, 3)))
        for e in doc["removed"]:  # every entry prune removed is gone, whatever the bytes of its name
            assert e["path"].startswith(str(run)) and not os.path.lexists(e["path"]), e
        if scenario in ("files-and-names", "run-dir-name"):  # the odd names prune owns went, the others stay
            left = set(os.listdir(os.fsencode(run)))
            assert not {n for n in left if n.startswith((b"free-", b"superseded-", b".deleting-"))}, left
            assert {BAD, BAD + b"-dir", os.fsencode(STEP(9)) + BAD} <= left, left
        exported = json.loads(done[scenario, "export-json"]["out"])
        assert exported["step"] == newest.get(scenario, 3) and os.path.isfile(exported["path"])


def test_a_lock_that_is_not_utf8_is_read_as_the_core_reads_it(tmp_path: Path) -> None:
    """The reported traceback: ``prune --dry-run`` over a lock file holding bytes that are not UTF-8
    (a TypeError from the binding). The record names another host (its name garbled), which cannot
    be checked from here: a refusal naming the lock, in one line."""
    run = _make_run(tmp_path / "run")
    _plant_lock(run)
    r = _cli("prune", "--dry-run", str(run), "--keep-last", "1")
    _no_traceback(r.returncode, r.stderr.decode(errors="replace"), "prune --dry-run")
    assert r.returncode == 2 and b".lock names a writer on host" in r.stderr, r.stderr
    _plant_lock_garbage(run)  # no owner record at all: no writer, as for any unreadable record
    r = _cli("prune", "--dry-run", str(run), "--keep-last", "1")
    assert r.returncode == 0 and b"would remove" in r.stdout, r.stderr


def test_a_manifest_naming_a_metric_in_bytes_that_are_not_utf8_is_corrupt_like_any_other(tmp_path: Path) -> None:
    """Sealed with its own CRC, so only its content is wrong: the core reads it as corrupt (a metric is
    named in printable ASCII), and prune removes it as an older corrupt checkpoint, never a traceback."""
    run = _make_run(tmp_path / "run")
    _plant_manifest_sealed(run)
    r = _cli("prune", str(run), "--keep-last", "1", "--keep-best", "loss:min:1", "--json")
    _no_traceback(r.returncode, r.stderr.decode(errors="replace"), "prune")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["kept_steps"] == [3] and sorted(Path(e["path"]).name for e in doc["removed"]) == [STEP(1), STEP(2)]
    assert sorted(os.listdir(run)) == [".lock", "LATEST", STEP(3)]


def test_a_keep_best_metric_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    run = _make_run(tmp_path / "run")
    r = _cli(b"prune", _bpath(run), b"--keep-last", b"1", b"--keep-best", b"l" + BAD + b":min:1")
    _no_traceback(r.returncode, r.stderr.decode(errors="replace"), "prune --keep-best")
    assert r.returncode == 2 and b"--keep-best" in r.stderr and b"not UTF-8" in r.stderr, r.stderr


# ------------------------------------------------------------------ submit: the config's environment

CONFIG = """name: t
run_dir: {run_dir}
entry: {{script: t.py}}
slurm: {{time: "10:00"}}
"""


@pytest.mark.parametrize(("key", "line"), [
    ("run_dir", "run_dir: $X/run"),
    ("run_dir", "run_dir: ${X}"),
    ("entry.script", "entry: {script: $X/t.py}"),
    ("environment.venv", "environment: {venv: $X/venv}"),
    ("environment.container", "environment: {container: $X}"),
])
def test_a_config_value_expanding_to_bytes_that_are_not_utf8_names_the_key(tmp_path: Path, key: str,
                                                                           line: str) -> None:
    (tmp_path / "t.py").write_text("pass\n")
    text = CONFIG.format(run_dir=tmp_path / "run")
    top = line.split(":", 1)[0]
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(top + ":")) + "\n" + line + "\n"
    (tmp_path / "cfg.yaml").write_text(text)
    r = _cli("submit", "cfg.yaml", "--dry-run", cwd=tmp_path, env_bytes={b"X": _bpath(tmp_path) + b"/" + BAD})
    _no_traceback(r.returncode, r.stderr.decode(errors="replace"), f"submit with {line}")
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2 and f"{key}: $X expands to bytes that are not UTF-8" in err, err
    assert not (tmp_path / "run").exists()


def test_a_relative_run_dir_under_a_directory_whose_name_is_not_utf8(tmp_path: Path) -> None:
    here = Path(os.fsdecode(_bpath(tmp_path) + b"/cwd-" + BAD))
    here.mkdir()
    (tmp_path / "t.py").write_text("pass\n")
    (here / "cfg.yaml").write_text(CONFIG.format(run_dir="runs/x").replace("t.py", str(tmp_path / "t.py")))
    r = _cli("submit", "cfg.yaml", "--dry-run", cwd=here)
    _no_traceback(r.returncode, r.stderr.decode(errors="replace"), "submit from a directory whose name is not UTF-8")
    assert r.returncode == 2 and b"run_dir: " in r.stderr and b"not UTF-8" in r.stderr, r.stderr


def test_a_config_expanding_utf8_still_submits(tmp_path: Path) -> None:
    """The check refuses only what cannot be written: a UTF-8 value (non-ASCII too) goes through."""
    (tmp_path / "t.py").write_text("pass\n")
    (tmp_path / "cfg.yaml").write_text(CONFIG.format(run_dir="$X/run"))
    r = _cli("submit", "cfg.yaml", "--dry-run", cwd=tmp_path, env={"X": str(tmp_path / "dé")})
    assert r.returncode == 0, r.stderr
    assert str(tmp_path / "dé" / "run").encode() in r.stdout
