"""What the same-run comparison benchmarks share (benchmarks/dcp_fixed_cost.py, benchmarks/framework_io.py,
benchmarks/megatron_local.py): sizes as "2MiB", the repetitions per size, seconds as text, the header facts (the
commit measured, the load average), and running a cell's worker processes (:func:`run_workers`).
Run as scripts, they import it from their own directory."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = re.compile(r"^(\d+)(KiB|MiB|GiB)$")


def parse_size(text: str) -> int:
    m = _SIZE.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a size is a whole number of KiB, MiB or GiB (2MiB, 2GiB)")
    return int(m[1]) * _UNITS[m[2]]


def size_name(nbytes: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return f"{nbytes}B"


def default_reps(nbytes: int) -> int:
    """Timed repetitions per cell: 21 up to 16 MiB (a save of a few ms moves by a millisecond with what else
    the VM does: 7 gave 1.08-1.37 for the same code), 5 up to 512 MiB, else 3."""
    return 21 if nbytes <= 16 << 20 else 5 if nbytes <= 512 << 20 else 3


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.3f} s"


def alpsck_version() -> str:
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True, check=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "alpsck")
    return f"{head}{' + uncommitted changes under alpsck/' if dirty else ''}"


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def run_workers(argvs: list[list[str]], out: Path, timeout_s: float) -> dict[str, Any]:
    """A cell's worker processes (one argv each, all started at once): the JSON the workers left in ``out`` (then
    removed), or ``{"failed": why}`` once each has exited, or been killed with all the others when ``timeout_s``
    passed. Each worker is named by its index ("rank 1") when there are several."""
    out.unlink(missing_ok=True)
    procs = [subprocess.Popen(argv) for argv in argvs]
    deadline, failed = time.monotonic() + timeout_s, []
    for r, p in enumerate(procs):
        name = f"rank {r} " if len(procs) > 1 else ""
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.wait()
            failed.append(f"{name}timed out after {timeout_s:.0f} s")
            continue
        if rc != 0:
            failed.append(f"{name}exited with {rc}")
    if failed or not out.exists():
        return {"failed": "; ".join(failed) or "no results"}
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return result
