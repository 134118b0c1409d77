"""``alpsck plot``: a run's timeline and loss as one PNG (alpsck.tools.plot). Run directories are built
by writing their history as the job would; the PNG is checked for its size and for being a drawing,
not a blank canvas. The real quickstart's figure is drawn by the main session's end-to-end run."""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from alpsck import cli
from alpsck.slurm import goodput, history
from alpsck.tools import plot

pytest.importorskip("matplotlib")

T0 = 1_790_000_000.0  # a fixed epoch: the figures do not depend on when the test runs


def _write(run_dir: Path, *events: tuple[float, str, dict[str, Any]]) -> Path:
    """A history with controlled times: each event as history.record makes it, with ``time`` set."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / history.HISTORY, "a", encoding="utf-8") as f:
        for dt, event, fields in events:
            rec = history.record(event, **fields)
            rec["time"] = T0 + dt
            f.write(history.line(rec) + "\n")
    return run_dir


def _losses(run_dir: Path, *segments: range) -> None:
    """loss.csv as the training writes it: a resume appends the recomputed steps again."""
    rows = [f"{s},{3.0 / (1 + 0.05 * s):.4f}" for seg in segments for s in seg]
    (run_dir / "loss.csv").write_text("step,loss\n" + "\n".join(rows) + "\n")


def _check_png(path: Path, drawn: bool = True) -> None:
    """A PNG of plot's size, with a drawing on it (``drawn``): many colours, and many saturated
    pixels (bars, markers, the loss curve), which axes and text alone do not have."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # IHDR: the first chunk
    assert (width, height) == (plot.WIDTH_PX, plot.HEIGHT_PX)
    if not drawn:
        return
    import matplotlib.image
    import numpy as np

    rgb = matplotlib.image.imread(path)[..., :3]
    packed = (rgb * 255).astype(np.uint32) @ np.array([1 << 16, 1 << 8, 1], dtype=np.uint32)
    assert len(np.unique(packed)) > 200
    assert int(((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.3).sum()) > 5000


def test_a_finished_run_with_its_loss(tmp_path: Path) -> None:
    run = _write(tmp_path / "run", (-30, "submitted", {"job_id": "100", "backend": "slurm"}),
                 (0, "started", {"job_id": "100", "restart": 0, "world_size": 4}),
                 (3600, "finished", {"job_id": "100", "step": 200}))
    _losses(run, range(1, 201))
    out = plot.plot_run(run, tmp_path / "t.png")
    assert out == tmp_path / "t.png"
    _check_png(out)


def test_a_crash_with_a_restart_in_the_allocation_a_hang_and_a_requeue(tmp_path: Path) -> None:
    run = _write(tmp_path / "run",
                 (0, "started", {"job_id": "7", "restart": 0}),
                 (1810, "crashed", {"job_id": "7", "attempt": 0, "exit_code": 137, "signal": "SIGKILL",
                                    "time_of_end": T0 + 1800}),
                 (1830, "started", {"job_id": "7", "restart": 0, "attempt": 1, "step": 100}),
                 (2400, "hang", {"job_id": "7", "section": "step", "seconds": 600.0, "attempt": 1}),
                 (2420, "started", {"job_id": "7", "restart": 0, "attempt": 2, "step": 120}),
                 (7000, "signal", {"job_id": "7", "reason": "timeout"}),
                 (7020, "final_checkpoint", {"job_id": "7", "reason": "timeout", "step": 300, "seconds": 12.0}),
                 (7030, "requeued", {"job_id": "7", "reason": "timeout", "progress": True}),
                 (9000, "started", {"job_id": "7", "restart": 1, "step": 300}),
                 (12000, "finished", {"job_id": "7", "step": 400}))
    _losses(run, range(1, 111), range(101, 131), range(121, 301), range(301, 401))
    _check_png(plot.plot_run(run, tmp_path / "t.png"))
    # The start intervals the figure draws (goodput's).
    starts = _starts(run, now=T0 + 99999)
    assert [(s["outcome"], s["attempt"], s["resume_step"], s["end"] - T0) for s in starts] == [
        ("crashed", 0, None, 1800), ("hang", 1, 100, 2400), ("requeued", 2, 120, 7030), ("finished", 0, 300, 12000)]
    assert plot._rows(starts) == [0, 0, 0, 1]  # the restarts in the allocation share its row


def test_restores_from_memory_and_a_replica_are_drawn_at_the_step_they_read(tmp_path: Path) -> None:
    """The run directory held step 50 at both restarts; the restores read 35 from memory and 55 from a replica
    (their restored events): the dashed lines are at 35 and 55, each marked with its tier."""
    run = _write(tmp_path / "run",
                 (0, "started", {"job_id": "9", "restart": 0}),
                 (100, "crashed", {"job_id": "9", "attempt": 0, "exit_code": 137, "signal": "SIGKILL"}),
                 (110, "started", {"job_id": "9", "restart": 0, "attempt": 1}),
                 (115, "restored", {"job_id": "9", "step": 35, "tier": "memory", "taken_at": T0 + 90}),
                 (200, "crashed", {"job_id": "9", "attempt": 1, "exit_code": 137, "signal": "SIGKILL"}),
                 (230, "started", {"job_id": "9", "restart": 0, "attempt": 2, "step": 50}),
                 (235, "restored", {"job_id": "9", "step": 55, "resume_step": 50, "tier": "replica",
                                    "taken_at": T0 + 195}),
                 (300, "finished", {"job_id": "9", "step": 80}))
    _losses(run, range(1, 38), range(36, 58), range(56, 81))
    starts = _starts(run, now=T0 + 999)
    assert [(s["resumed_step"], s["tier"]) for s in starts] == [(None, None), (35, "memory"), (55, "replica")]
    assert plot.resume_lines(starts) == {(35, "memory"): ["attempt 1, job 9"], (55, "replica"): ["attempt 2, job 9"]}
    _check_png(plot.plot_run(run, tmp_path / "t.png"))


def test_a_cordoned_node_is_marked_on_the_start_it_was_cordoned_before(tmp_path: Path) -> None:
    from alpsck.slurm import timeline

    run = _write(tmp_path / "run",
                 (0, "started", {"job_id": "9", "restart": 0}),
                 (100, "crashed", {"job_id": "9", "attempt": 0, "exit_code": 137, "signal": "SIGKILL"}),
                 (105, "traced", {"job_id": "9", "attempt": 0, "node": "n2", "task": 1, "message": "Killed"}),
                 (106, "cordoned", {"job_id": "9", "node": "n2", "checks": "failures", "reason": "failed first"}),
                 (110, "started", {"job_id": "9", "restart": 0, "attempt": 1}),
                 (300, "finished", {"job_id": "9", "step": 80}))
    _losses(run, range(1, 81))
    tl = timeline.read(run)
    assert ("cordoned", T0 + 106) in tl.markers(plot.MARKERS)
    assert plot.MARKERS["cordoned"][2] == "node cordoned (health gate)"
    _check_png(plot.plot_run(run, tmp_path / "t.png"))


def test_a_run_still_going_without_a_loss_file_is_drawn_up_to_now(tmp_path: Path) -> None:
    import time

    run = tmp_path / "run"
    run.mkdir()
    rec = history.record("started", job_id="55", restart=0)
    rec["time"] = time.time() - 600
    (run / history.HISTORY).write_text(history.line(rec) + "\n")
    starts = _starts(run, now=time.time())
    assert starts[0]["outcome"] == "running" and starts[0]["end"] - starts[0]["t0"] == pytest.approx(600, abs=5)
    _check_png(plot.plot_run(run, tmp_path / "t.png"))  # the loss panel says there is none
    # Requeued and not started again: the queue is drawn up to now as well.
    rec = history.record("requeued", job_id="55", reason="preemption")
    rec["time"] = time.time() - 300
    with open(run / history.HISTORY, "a", encoding="utf-8") as f:
        f.write(history.line(rec) + "\n")
    _check_png(plot.plot_run(run, tmp_path / "t.png"))


def _starts(run: Path, now: float) -> list[dict[str, Any]]:
    g = goodput.goodput(history.read(run), now=now)
    assert g is not None
    return list(g["starts"])


def test_the_cli_writes_the_default_file_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run = _write(tmp_path / "myrun", (0, "started", {"job_id": "3"}), (90, "finished", {"job_id": "3", "step": 9}))
    _losses(run, range(1, 10))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli.main(["plot", str(run)]) == 0
    assert capsys.readouterr().out.strip() == "myrun-timeline.png"
    _check_png(work / "myrun-timeline.png")
    assert sorted(os.listdir(run)) == ["history.jsonl", "loss.csv"]  # the run directory is only read


def test_the_cli_errors_in_one_line_with_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for run_dir, what in ((empty, f"has no readable {history.HISTORY}"), (tmp_path / "nowhere", "is not a directory")):
        assert cli.main(["plot", str(run_dir), "-o", str(tmp_path / "x.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("alpsck: error: ") and str(run_dir) in err and what in err and "Traceback" not in err
    pending = _write(tmp_path / "pending", (0, "submitted", {"job_id": "9", "backend": "slurm"}))
    assert cli.main(["plot", str(pending), "-o", str(tmp_path / "x.png")]) == 2
    assert "has not started yet" in capsys.readouterr().err
    run = _write(tmp_path / "run", (0, "started", {"job_id": "3"}), (90, "finished", {"job_id": "3"}))
    (tmp_path / "bad.csv").write_text("epoch,value\n1,2\n")
    assert cli.main(["plot", str(run), "-o", str(tmp_path / "x.png"), "--loss", str(tmp_path / "bad.csv")]) == 2
    assert "is not a step,loss CSV" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert cli.main(["plot", str(run), "-o", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_read_losses_keeps_the_rows_a_resume_repeats(tmp_path: Path) -> None:
    csv = tmp_path / "loss.csv"
    csv.write_text("step,loss\n1,2.5\n2,2.0\n2,2.0\n3,1.5\n")
    assert plot.read_losses(csv) == ([1, 2, 2, 3], [2.5, 2.0, 2.0, 1.5])


def test_a_hostile_history_is_drawn_not_crashed_on(tmp_path: Path) -> None:
    # Whoever can write the run directory writes the log: mathtext, escapes, times out of order, a
    # crash that ends before its start, a marker before any start.
    run = _write(tmp_path / "run", (-50, "signal", {"reason": "$\\frac{1}{0}$\x1b[2J"}),
                 (10, "started", {"job_id": "$x^$", "attempt": 3, "step": 5}),
                 (20, "crashed", {"time_of_end": T0 - 1e6, "exit_code": 9}),
                 (5, "started", {"job_id": "\u202e\ud800", "step": 10**30}),
                 (4, "finished", {}))
    (run / "loss.csv").write_text("step,loss\n5,1.0\n")  # one row: a dot
    _check_png(plot.plot_run(run, tmp_path / "t.png"), drawn=False)  # starts of no length: little to see
