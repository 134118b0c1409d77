"""The files a job's start hands to other processes in the run directory: rank 0's start decision,
which the other ranks wait for (:func:`write_decision`, :func:`wait_decision`), and the requeue request,
which the batch script's EXIT trap carries out on the host where the job itself cannot
(:func:`request_text`, :func:`write_request`; see :mod:`alpsck.slurm.runner`)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from .. import _core
from ..store.durable import read_small, replace_durably
from ..store.names import temp_name
from . import history
from .history import Cancelled, Requeued

REQUEST_FILE = _core.run_dir_names["requeue_request"]  # the run directory's names are the core's (run_dir.h)
DECISION_FILE = _core.run_dir_names["start_decision"]
DECISION_TIMEOUT_S = 600.0


def request_text(job_id: str, slurm_restarts: int, reason: str, step: int | None, progress: bool) -> str:
    """The requeue request for the batch script: a first line naming the start it comes from
    (``JOB_ID RESTARTS``), then one line per verdict of :func:`alpsck.slurm.stop.term_verdict`:
    the verdict, a space, and the history event the batch script appends when it finds that
    verdict. The shell copies a line; it never interprets one."""
    lines = [f"{job_id} {slurm_restarts}"]
    for verdict in ("preemption", "timeout", "cancel", "requeue"):
        if verdict == "cancel":
            rec = history.record(Cancelled(job_id=job_id, step=step, recorded_by="batch script"))
        else:
            # "term": the job could not ask scontrol; the batch script's verdict names the cause.
            why = verdict if reason == "term" or verdict == "requeue" else reason
            rec = history.record(Requeued(job_id=job_id, progress=progress, reason=why, step=step,
                                          mechanism="slurm" if verdict == "requeue" else "batch-script",
                                          recorded_by="batch script"))
        lines.append(f"{verdict} {history.line(rec)}")
    return "\n".join(lines) + "\n"


def remove_request(run_dir: str) -> None:
    """Remove a requeue request (a stale one: its batch shell was killed before its EXIT trap)."""
    try:
        os.unlink(os.path.join(run_dir, REQUEST_FILE))
    except FileNotFoundError:
        pass
    except OSError as e:  # a directory in its place, no permission: the request written later fails loudly
        print(f"alpsck: cannot remove {os.path.join(run_dir, REQUEST_FILE)}: {e}", file=sys.stderr, flush=True)


def write_request(run_dir: str, text: str) -> None:
    """Write the requeue request (:func:`request_text`) durably, replacing a stale one."""
    path = os.path.join(run_dir, REQUEST_FILE)
    remove_request(run_dir)
    replace_durably(path, text.encode())


def write_decision(run_dir: str, job_id: str, restart: int, resume: int | None, give_up: str | None,
                   attempt: int = 0) -> None:
    """Rank 0's start decision for the other ranks (atomically replaced: tmp + rename)."""
    path = os.path.join(run_dir, DECISION_FILE)
    replace_durably(path, json.dumps({"job_id": job_id, "restart": restart, "attempt": attempt, "resume": resume,
                                      "give_up": give_up}).encode(), temp_name(path))


def wait_decision(run_dir: str, job_id: str, restart: int, timeout_s: float, attempt: int = 0) -> dict[str, Any]:
    """Wait for rank 0's decision of this start (same job id, restart count and in-job attempt)."""
    path = os.path.join(run_dir, DECISION_FILE)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            d = json.loads(read_small(path, 1 << 16))
            if (isinstance(d, dict) and d.get("job_id") == job_id and d.get("restart") == restart
                    and d.get("attempt", 0) == attempt):
                resume, give_up = d.get("resume"), d.get("give_up")
                if (resume is None or isinstance(resume, int)) and (give_up is None or isinstance(give_up, str)):
                    return {"resume": resume, "give_up": give_up}
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 did not decide how to start job {job_id} (restart {restart}) within "
                               f"{timeout_s:.0f} s: no {path}")
        time.sleep(0.2)
