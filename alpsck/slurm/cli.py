"""``alpsck submit`` and ``alpsck status``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

from .. import jsonout
from ..errors import AlpsckError
from . import history


def _submit(args: argparse.Namespace) -> int:
    from .config import load_config
    from .runner import newest_step
    from .submit import sbatch_script, slurm_unavailable, submit

    cfg = load_config(args.config)
    if args.dry_run:
        print(sbatch_script(cfg), end="")
        return 0
    is_local = bool(args.local)
    if not is_local:
        why = slurm_unavailable()
        if why is not None:
            print(f"alpsck: no SLURM here ({why}): running through submitit's local executor", flush=True)
            is_local = True
    job = submit(cfg, local=is_local)
    if args.json:
        print(json.dumps({"job_id": str(job.job_id), "run_dir": cfg.run_dir}), flush=True)
    else:
        print(f"submitted job {job.job_id}; run dir {cfg.run_dir}", flush=True)
        resume = newest_step(cfg.run_dir)
        if resume is not None:
            print(f"the run dir holds checkpoints: the job resumes from step {resume}, its newest (or, if that "
                  "one proves corrupt, the newest valid one)", flush=True)
        print(f"follow it with: alpsck status {cfg.run_dir}", flush=True)
    if args.wait or (is_local and not args.no_wait):
        while not job.done():
            time.sleep(2)
        state = history.state_of(history.read(cfg.run_dir))
        if not args.json:
            print(f"job {job.job_id} ended: {state}")
        return 0 if state == "finished" else 1
    return 0


def _lost_job_note(run_dir: Path, state: str) -> str | None:
    """For a history that says the job is still on: a note when SLURM no longer knows that job.

    A job killed with its node, or on a cluster since restarted, records no end; its history
    would say "running" forever.
    """
    from .submit import live_jobs, slurm_unavailable

    if state not in ("pending", "running", "requeued"):
        return None
    last = next((e for e in reversed(history.read(run_dir)) if e["event"] == "submitted"), None)
    if last is None or last.get("backend") != "slurm" or slurm_unavailable() is not None:
        return None
    live = live_jobs(run_dir)
    if live is None or any(job_id == str(last.get("job_id")) for job_id, _ in live):
        return None  # no answer from squeue, or the job is there
    return (f"SLURM no longer queues or runs job {last.get('job_id')}: it ended without recording how (its node "
            f"failed, or the cluster was restarted). Submit again to resume from the newest checkpoint")


def _status(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise AlpsckError(f"{run_dir}: {'not a directory' if run_dir.exists() else 'no such directory'}")
    path = run_dir / history.HISTORY
    if not path.exists():
        raise AlpsckError(f"{run_dir}: no {history.HISTORY} (not a run directory of a submitted job)")
    if not path.is_file():
        raise AlpsckError(f"{path}: not a regular file, so it holds no job history")
    s = history.summary(run_dir)
    if not s["events"]:  # "pending" would claim a job that nothing here records
        lines = len(path.read_bytes().splitlines())
        raise AlpsckError(f"{path}: no readable event in its {lines} line(s): not a job history, or damaged")
    s["note"] = _lost_job_note(run_dir, s["state"])
    if args.json:
        print(jsonout.dumps(s))
        return 0
    print(f"{run_dir}: {s['state']}  (jobs {', '.join(map(str, s['job_ids'])) or '-'}, {s['starts']} starts, "
          f"{s['requeues']} requeues, last step {'-' if s['last_step'] is None else s['last_step']})")
    if s["note"]:
        print(f"  note: {s['note']}")
    for e in s["events"]:
        when = dt.datetime.fromtimestamp(e["time"]).strftime("%Y-%m-%d %H:%M:%S")
        extra = " ".join(f"{k}={e[k]}" for k in ("reason", "step", "seconds", "restart", "mechanism", "message")
                         if e.get(k) is not None)
        print(f"  {when}  {e['event']:<17} {extra}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser("submit", help="submit a training job (SLURM, or locally when there is no cluster)")
    s.add_argument("config", help="job config (YAML); see slurm/examples/")
    s.add_argument("--dry-run", action="store_true", help="print the sbatch script and submit nothing")
    s.add_argument("--local", action="store_true", help="run through submitit's local executor, even with SLURM")
    s.add_argument("--json", action="store_true", help='print one line {"job_id": ..., "run_dir": ...}')
    s.add_argument("--wait", action="store_true", help="wait until the job has finished (default for local runs)")
    s.add_argument("--no-wait", action="store_true", help="return at once, also for local runs")
    s.set_defaults(func=_submit)
    st = sub.add_parser("status", help="the timeline of a submitted job (history.jsonl)")
    st.add_argument("run_dir")
    st.add_argument("--json", action="store_true", help="print one JSON document")
    st.set_defaults(func=_status)
