"""Hostile run directories for ``alpsck status`` and the history reader (issue #41, "Status and
history"): whoever can write a run directory writes its ``history.jsonl`` and its logs.

The classes: an event of any JSON shape never ends status in a traceback (history.normalise, the
one check); the newest events decide, however long the log (history.read_log reads from the end);
status stays fast and shows a bounded timeline; nothing from the run directory reaches the
terminal raw (textout.printable, the one escaping function); no job id becomes a path out of the
run directory and no log is read through a symlink.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from alpsck.errors import UsageError
from alpsck.out import jsonout
from alpsck.out.textout import printable
from alpsck.slurm import cli as slurm_cli
from alpsck.slurm import history, watch

NOW = 1_764_300_000.0
TIMELINE_LINE = re.compile(r"  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d  ")
DEAD = "999999999"  # a local job id that names no live process: status sees the job gone

# JSON values of every kind, and the ones that broke status before.
HOSTILE_VALUES: list[Any] = [
    None, True, False, 0, -1, 1.5, 10**30, 1e300, -1e20, -9.9e10, math.nan, math.inf, -math.inf, "", "x",
    "yesterday", "\x00", "\x1b]0;pwned\x07", "\ud800", "../../etc/passwd", "1\x001", "12_", "_3", "\u0663",
    [], [1, "a"], {}, {"a": {"b": [None]}}, "a" * 10_000, json.loads("[" * 600 + "]" * 600),
    json.loads('{"a": ' * 300 + "1" + "}" * 300),
]
FIELDS = ["time", "event", "job_id", "backend", "step", "restart", "seconds", "reason", "message", "mechanism",
          "host", "progress", "will_requeue", "not_requeued", "resume_step", "malformed"]


def _ev(event: str, **fields: Any) -> dict[str, Any]:
    return {"time": NOW, "event": event, **fields}


def _write(run: Path, lines: list[Any], *, raw: bool = False) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    text = "".join((x if raw else json.dumps(x)) + "\n" for x in lines)
    (run / history.HISTORY).write_text(text)
    return run


def _status(run: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "alpsck", "status", str(run), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=run.parent, env=env, errors="surrogateescape")
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    return r


def _strict(text: str) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _terminal_safe(text: str) -> None:
    bad = [(i, c) for i, c in enumerate(text) if c != "\n" and not c.isprintable()]
    assert not bad, bad[:5]


def _hostile_events() -> list[dict[str, Any]]:
    """Every field above with every value above, in an event that is otherwise valid."""
    out = []
    for name in ("submitted", "started", "failed"):
        for field in FIELDS:
            for v in HOSTILE_VALUES:
                e = _ev(name, job_id=DEAD, backend="local")
                e[field] = v
                out.append(e)
    return out


# -- 1. any JSON value in any field -----------------------------------------------------------


def test_every_field_with_every_value_is_an_event_or_skipped_never_an_error() -> None:
    for e in _hostile_events():
        n = history.normalise(json.loads(json.dumps(e)))
        if n is None:
            continue
        assert isinstance(n["event"], str) and n["event"]
        assert isinstance(n["time"], (int, float)) and 0 <= n["time"] < history.MAX_TIME
        if n["event"] == "submitted":
            assert history.is_job_id(n["job_id"])
        for k in ("step", "restart", "resume_step"):
            assert n.get(k) is None or (type(n[k]) is int and n[k] >= 0), (k, n)
        assert n.get("job_id") is None or isinstance(n["job_id"], str)
        line = watch.describe(n)  # the timeline line: a time in the calendar, every field escaped
        _terminal_safe(line)
        assert "\n" not in line
        _strict(jsonout.dumps(n))
    for v in HOSTILE_VALUES:  # a line that is no object at all
        assert history.normalise(json.loads(json.dumps(v))) is None


def test_times_outside_the_calendar_and_submissions_without_a_usable_id_are_skipped() -> None:
    for t in (1e300, -1e20, -9.9e10, -1, math.nan, math.inf, "1764300000", None, True, [NOW], history.MAX_TIME):
        assert history.normalise(_ev("started", time=t)) is None, t
    for job_id in (None, 7, "", "../../x", "1\x00", "12;rm -rf /", "-1", "1_", "_1", "\u0663\u0664", "1 2", "1\n"):
        assert history.normalise(_ev("submitted", job_id=job_id, backend="slurm")) is None, job_id
    e = history.normalise(_ev("started", job_id=DEAD, step="12", restart=-1, seconds=math.nan, progress="yes"))
    assert e is not None and sorted(e["malformed"]) == ["progress", "restart", "seconds", "step"]
    assert not {"step", "restart", "seconds", "progress"} & set(e)
    deep = history.normalise(_ev("started", loss=json.loads("[" * 900 + "]" * 900), ok=[[1]]))  # exhausted --json
    assert deep is not None and deep["malformed"] == ["loss"] and deep["ok"] == [[1]]
    forged = history.normalise(_ev("started", malformed="\x1b[2J"))  # the field is the reader's own
    assert forged is not None and "malformed" not in forged


def test_job_ids_that_alpsck_generates_are_accepted() -> None:
    for job_id in ("1", "4242", "123456789", "4242_7", str(os.getpid())):  # SLURM, array task, local pid
        assert history.is_job_id(job_id)
        assert history.normalise(_ev("submitted", job_id=job_id, backend="local")) is not None


def test_status_of_a_history_of_hostile_events_is_the_valid_events_state(tmp_path: Path) -> None:
    lines = [json.dumps(_ev("submitted", job_id=DEAD, backend="local"))]
    lines += [json.dumps(e) for e in _hostile_events()]
    lines += ['{"time": 1e400, "event": "finished"}', '{"time": 1' + "0" * 5000 + ', "event": "finished"}',
              '{"time": NaN, "event": "finished"}', '{"time": Infinity, "event": "finished"}',
              '{"time": ' + str(NOW) + ', "event": "finished", "job_id": "\\ud800\\u0000"}',
              "[" * 100_000, "\x00\x00", "\ufeff{}", '"just a string"']
    lines += [json.dumps(_ev("failed", job_id=DEAD, will_requeue=False, message="boom"))]
    run = _write(tmp_path / "run", lines, raw=True)
    r = _status(run, "--json")
    assert r.returncode == 0, r.stderr
    doc = _strict(r.stdout)
    assert doc["state"] == "failed" and doc["events"][-1]["message"] == "boom"
    assert doc["malformed_lines"] > 0 and len(doc["events"]) == slurm_cli.TIMELINE
    t = _status(run, "--events", "100000")
    assert t.returncode == 0, t.stderr
    _terminal_safe(t.stdout)
    assert t.stdout.startswith(f"{run}: failed") and "line(s) that are no event skipped" in t.stdout
    assert len([x for x in t.stdout.splitlines() if TIMELINE_LINE.match(x)]) == len(history.read(run))


def test_a_history_with_only_malformed_events_says_so(tmp_path: Path) -> None:
    run = _write(tmp_path / "run", [_ev("started", time=t) for t in (1e300, -1e20, "now")]
                 + [_ev("submitted"), _ev("submitted", job_id="../x")])
    r = _status(run)
    assert r.returncode == 2 and "no readable event in its 5 line(s)" in r.stderr and not r.stdout


# -- 2. the newest events decide --------------------------------------------------------------


def _events_at(run: Path, at: int, early: list[dict[str, Any]], late: list[dict[str, Any]]) -> Path:
    """A log of ``at`` bytes and more: ``early`` events, a hole of NULs (sparse: quick to write), ``late`` ones."""
    run.mkdir(parents=True, exist_ok=True)
    with open(run / history.HISTORY, "wb") as f:
        f.write("".join(json.dumps(e) + "\n" for e in early).encode())
        f.seek(at)
        f.write(("\n" + "".join(json.dumps(e) + "\n" for e in late)).encode())
    return run


def test_a_history_over_256_mib_shows_its_newest_events(tmp_path: Path) -> None:
    early = [_ev("submitted", job_id=DEAD, backend="local"), _ev("started", job_id=DEAD)]
    late = [_ev("started", job_id=DEAD, step=40), _ev("finished", job_id=DEAD, step=50)]
    run = _events_at(tmp_path / "run", 300 << 20, early, late)
    assert [e["event"] for e in history.read(run)] == ["started", "finished"]  # what the job runner reads
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _status(run, "--json")
    assert r.returncode == 0, r.stderr
    doc = _strict(r.stdout)
    assert doc["state"] == "finished" and doc["last_step"] == 50 and doc["unread_bytes"] > 256 << 20
    t = _status(run)
    assert t.returncode == 0 and t.stdout.startswith(f"{run}: finished"), t.stdout
    assert "older byte(s) of the history not read" in t.stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the two commands' CPU time (wall time: see below)
    assert (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) < 30


def test_the_reader_takes_whole_lines_only_wherever_its_window_begins(tmp_path: Path) -> None:
    events = [_ev("started", job_id=DEAD, step=i, message="x" * (i * 7 % 23)) for i in range(12)]
    run = _write(tmp_path / "run", events)
    data = (run / history.HISTORY).read_bytes()
    ends = [i + 1 for i, b in enumerate(data) if b == ord("\n")]
    for k in range(len(data) + 2):
        log = history.read_log(run, max_bytes=k)
        whole = [i for i, end in enumerate(ends) if len(data) - (ends[i - 1] if i else 0) <= k]
        assert [e["step"] for e in log.events] == whole, k
        assert log.malformed == 0 and log.end == len(data)
        assert log.start == (ends[whole[0] - 1] if whole and whole[0] else 0 if whole else len(data))


def test_submit_follows_only_the_events_after_it_submitted_past_the_window(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    run = _write(tmp_path / "run", [_ev("started", job_id=DEAD, step=i) for i in range(2000)])
    since = history.read_log(run).end
    monkeypatch.setattr(history, "MAX_BYTES", 4096)  # the log is far larger than the window
    out = io.StringIO()
    follower = watch.Follower(str(run), lambda _: None, out, since)
    follower.poll()
    assert out.getvalue() == ""
    for i in range(3):
        history.append(run, "requeued", job_id=DEAD, step=5000 + i, message="\x1b[2Jgone\r")
    follower.poll()
    follower.poll()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all("step=500" in x and "\\x1b[2Jgone\\r" in x for x in lines), lines
    _write(run, [_ev("finished", job_id=DEAD, step=1)])  # replaced by a shorter log: read from its start
    follower.poll()
    assert out.getvalue().splitlines()[3:] == [watch.describe(_ev("finished", job_id=DEAD, step=1))]


def test_a_job_whose_submission_lies_before_the_window_is_still_asked_whether_it_lives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its ``submitted`` event is older than the part of the history read; its ``started`` events carry the
    backend too, so status still asks whether the job lives (a dead local job: failed, with the note), rather
    than showing ``running`` for ever; so does submit's check for a live job on the run directory."""
    run = _write(tmp_path / "run", [_ev("submitted", job_id=DEAD, backend="local"),
                                    *[_ev("signal", job_id=DEAD, step=i, reason="timeout") for i in range(2000)],
                                    _ev("started", job_id=DEAD, backend="local", restart=1)])
    monkeypatch.setattr(history, "MAX_BYTES", 4096)
    events = history.read(run)
    assert not any(e["event"] == "submitted" for e in events)  # out of the window
    out = watch.reconcile(run, events)
    assert out["state"] == "failed" and f"job {DEAD} no longer exists" in out["note"], out
    assert watch.last_submission(events) == events[-1]


# -- 3. fast and bounded on 100 MB ------------------------------------------------------------


def test_status_of_a_100_mb_history_is_fast_and_shows_the_newest_events(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    block = "".join(json.dumps(_ev("started", job_id=DEAD, restart=i, step=i, host="nid001234")) + "\n"
                    for i in range(10_000)).encode()
    with open(run / history.HISTORY, "wb") as f:
        f.write(json.dumps(_ev("submitted", job_id=DEAD, backend="local")).encode() + b"\n")
        while f.tell() < 100 << 20:
            f.write(block)
        f.write((json.dumps(_ev("finished", job_id=DEAD, step=77)) + "\n").encode())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _status(run)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{run}: finished") and TIMELINE_LINE.match(lines[-1]) and "finished" in lines[-1]
    assert len(lines) <= slurm_cli.TIMELINE + 5
    assert "earlier event(s) not shown" in r.stdout and "older byte(s) of the history not read" in r.stdout
    # The command's CPU time, not its wall time: 2.0 s here, the newest 8 MiB parsed (before: over a minute of
    # reading all 100 MB). A wall-time bound of 20 s failed once in CI at 25 s, with the other lanes on the CPUs.
    assert cpu < 15, cpu
    j = _status(run, "--json", "--events", "5")
    doc = _strict(j.stdout)
    assert [e.get("step") for e in doc["events"]] == [9996, 9997, 9998, 9999, 77] and doc["earlier_events"] > 0


# -- 4. nothing raw reaches the terminal ------------------------------------------------------

CONTROL = ["\x1b]0;retitled\x07", "\x1b[2J", "\r", "\n  2020-01-01 00:00:00  finished", "\x7f", "\x9b31m",
           "\u202e", "\u2028", "\ud800", "\x00", "\t", "\x85"]


def test_printable_escapes_every_control_character() -> None:
    for c in [chr(i) for i in range(0x20)] + ["\x7f"] + [chr(i) for i in range(0x80, 0xa0)] + CONTROL:
        out = printable(f"a{c}b")
        _terminal_safe(out)
        assert out.startswith("a") and out.endswith("b") and "\n" not in out
    assert printable("\x1b") == "\\x1b" and printable("\r\n") == "\\r\\n" and printable("\ud800") == "\\ud800"
    assert printable("plain text, é, 日本") == "plain text, é, 日本"
    assert printable({"a": "\x1b"}) == '{"a": "\\u001b"}' and printable(None) == "null"
    assert printable("y" * 5000, 10) == "y" * 10 + "... (4990 more characters)"


def test_control_characters_in_the_history_and_the_log_are_shown_escaped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    events = [_ev("submitted", job_id=DEAD, backend="local"), _ev("started\x1b[2J", job_id="x\x1b]0;t\x07")]
    events += [_ev("started", job_id=DEAD, reason=c, message=f"m{c}m", host=c) for c in CONTROL]
    events += [_ev("failed", job_id=DEAD, will_requeue=False, message="RuntimeError: \x1b[31mboom\r\n  faked")]
    _write(run, events)
    (run / "submitit").mkdir()
    (run / "submitit" / f"{DEAD}_0_log.out").write_bytes(
        b"step 1\r\x1b]0;pwned\x07\nbad utf-8 \xff\xfe\nC1 \xc2\x9b31m\nDEL \x7f\n\xe2\x80\xae reversed\nlast\n")
    r = _status(run)
    assert r.returncode == 0, r.stderr
    _terminal_safe(r.stdout)
    assert "\\x1b[2J" in r.stdout and "\\x1b]0;pwned\\x07" in r.stdout and "\\x9b" in r.stdout
    assert "\\u202e" in r.stdout and "\\ud800" in r.stdout and "\\x7f" in r.stdout
    timeline = [x for x in r.stdout.splitlines() if TIMELINE_LINE.match(x)]
    assert len(timeline) == len(events)  # no field made a line of its own
    assert "boom\\r\\n  faked" in r.stdout
    tail = r.stdout.split("last lines of the log:\n")[1].splitlines()
    assert tail[-1] == "    last" and len(tail) == 7
    for enc in ("ascii", "latin-1"):  # a terminal that lacks a character gets it escaped, not a traceback
        a = _status(run, env={**os.environ, "PYTHONIOENCODING": enc})
        assert a.returncode == 0, a.stderr
        assert "\\u202e" in a.stdout
    j = _status(run, "--json")
    doc = _strict(j.stdout)
    assert doc["events"][-1]["message"] == "RuntimeError: \x1b[31mboom\r\n  faked"  # JSON escapes, keeps them
    _terminal_safe(j.stdout)


# -- 5. no path out of the run directory ------------------------------------------------------


def test_job_ids_that_are_paths_never_name_a_log() -> None:
    for job_id in ("../../x", "..", "1/../../x", "/etc/passwd", "1\x00", "", "1_", "\u0663", "1 ", "-1"):
        with pytest.raises(UsageError):
            watch.log_path("/run", job_id)
        with pytest.raises(UsageError):
            watch.log_tail("/run", job_id)
    assert watch.log_path("/run", "4242_3") == Path("/run/submitit/4242_3_0_log.out")


@pytest.mark.parametrize("how", ["id", "log symlink", "dir symlink", "fifo", "hard link"])
def test_status_prints_no_file_from_outside_the_run_directory(tmp_path: Path, how: str) -> None:
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "secret.txt").write_text("TOP SECRET\n")
    (secret / f"{DEAD}_0_log.out").write_text("TOP SECRET\n")
    run = tmp_path / "a" / "run"
    job_id = f"../../../outside/{DEAD}" if how == "id" else DEAD  # before: the log outside
    _write(run, [_ev("submitted", job_id=job_id, backend="local"),
                 _ev("failed", job_id=job_id, will_requeue=False, message="boom")])
    if how == "dir symlink":
        (run / "submitit").symlink_to(secret)
    else:
        (run / "submitit").mkdir()
        if how == "log symlink":
            (run / "submitit" / f"{DEAD}_0_log.out").symlink_to(secret / "secret.txt")
        elif how == "fifo":
            os.mkfifo(run / "submitit" / f"{DEAD}_0_log.out")
        elif how == "hard link":  # no path shows it: the same inode as a file outside
            os.link(secret / "secret.txt", run / "submitit" / f"{DEAD}_0_log.out")
    for args in ((), ("--json",)):
        r = _status(run, *args, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "TOP SECRET" not in r.stdout and "TOP SECRET" not in r.stderr
    doc = _strict(_status(run, "--json").stdout)
    assert doc["state"] == "failed" and doc["log_tail"] == []
    assert doc["log"] is None if how == "id" else doc["log"] == str(run / "submitit" / f"{DEAD}_0_log.out")


def test_a_symlinked_history_is_not_read(tmp_path: Path) -> None:
    elsewhere = _write(tmp_path / "elsewhere", [_ev("submitted", job_id=DEAD, backend="local")])
    run = tmp_path / "run"
    run.mkdir()
    (run / history.HISTORY).symlink_to(elsewhere / history.HISTORY)
    assert history.read(run) == []
    r = _status(run)
    assert r.returncode == 2 and "not a regular file" in r.stderr and not r.stdout


def test_submits_follower_prints_checkpoints_and_events_in_time_order(tmp_path: Path) -> None:
    """A checkpoint line used to carry the time of the poll that found it, and came before events
    of the same poll that were older (the signal before the final checkpoint, printed after it).
    Now a checkpoint carries the time of its commit (LATEST's rewrite) and each poll prints in time
    order; between commits it looks at LATEST with one stat instead of running the picker."""
    run = _write(tmp_path / "run", [])
    since = history.read_log(run).end
    asked: list[int] = []

    def newest(_: str) -> int | None:
        asked.append(1)
        return 40 if (run / "LATEST").exists() else None

    out = io.StringIO()
    follower = watch.Follower(str(run), newest, out, since)
    follower.poll()
    follower.poll()
    assert out.getvalue() == "" and len(asked) == 1  # no LATEST, no change: the picker is asked once
    t0 = time.time() - 30
    history.append(run, "signal", job_id=DEAD, reason="timeout", step=40)  # appended "now" ...
    (run / "LATEST").write_text("step-000000040\n")
    os.utime(run / "LATEST", (t0 + 10, t0 + 10))  # ... after a commit 20 s earlier
    with open(run / "history.jsonl", "a") as f:
        f.write(json.dumps(_ev("started", job_id=DEAD, step=0) | {"time": t0}) + "\n")
    follower.poll()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["started", "checkpoint", "signal"], lines
    stamps = [line[:19] for line in lines]
    assert stamps == sorted(stamps), lines
    follower.poll()
    assert len(out.getvalue().splitlines()) == 3 and len(asked) == 2
