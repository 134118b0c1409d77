"""``alpsck submit`` and ``alpsck status``."""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import AlpsckError, CheckpointError, UsageError
from ..options import arg_int
from ..store.run_dir import metrics_text
from ..tools import jsonout
from ..tools.textout import printable
from . import goodput, history, watch

TIMELINE = 50  # events ``alpsck status`` shows by default (the newest)


def _submit(args: argparse.Namespace) -> int:
    from .config import load_config, unset_stand_in
    from .runner import newest_step
    from .submit import check_entry, sbatch_script, slurm_unavailable, submit

    cfg = load_config(args.config, dry_run=args.dry_run)
    if args.dry_run:
        print(sbatch_script(cfg), end="")
        for name in cfg.unset:  # after the script: a reader of the script sees it last
            print(f"alpsck: dry run: ${name} is not set here; the script shows it as {unset_stand_in(name)}",
                  file=sys.stderr)
        return 0
    before = history.read_log(cfg.run_dir)
    if history.state_of(before.events) == "finished" and not args.resume_finished:
        raise UsageError(f"{cfg.run_dir}: this run has finished (newest checkpoint: step {newest_step(cfg.run_dir)}); a "
                         "new job would resume there and end at once. To train further, raise the step count and "
                         "submit with --continue; to start afresh, give the config another run_dir")
    is_local = bool(args.local)
    if not is_local:
        why = slurm_unavailable()
        if why is not None:
            say = sys.stderr if args.json else sys.stdout
            print(f"alpsck: no SLURM here ({why}): running through submitit's local executor", file=say, flush=True)
            is_local = True
    if not args.no_check:
        note = check_entry(cfg)
        if note:
            print(f"alpsck: {note}", file=sys.stderr, flush=True)
    job = submit(cfg, local=is_local)
    log = watch.log_path(cfg.run_dir, str(job.job_id))
    if args.json:
        print(json.dumps({"job_id": str(job.job_id), "run_dir": cfg.run_dir, "log": str(log)}), flush=True)
    else:
        print(f"submitted job {job.job_id}\n  run dir: {cfg.run_dir}\n  log:     {log}", flush=True)
        resume = newest_step(cfg.run_dir)
        if resume is not None:
            print(f"  the run dir holds checkpoints: the job resumes from step {resume}, its newest (or, if that one "
                  "proves corrupt, the newest valid one)", flush=True)
        print(f"  follow it with: alpsck status {shlex.quote(cfg.run_dir)}", flush=True)
    if not (args.wait or (is_local and not args.no_wait)):
        return 0
    quiet = open(os.devnull, "w") if args.json else sys.stdout  # noqa: SIM115 - closed below
    try:
        watch.Follower(cfg.run_dir, newest_step, quiet, before.end).wait(job.done, interval=1.0)
    finally:
        if quiet is not sys.stdout:
            quiet.close()
    rec = watch.reconcile(cfg.run_dir)
    if is_local and history.state_of(history.read(cfg.run_dir)) in watch.LIVE_STATES:
        # The job is gone and never recorded its end (it died before the runner, or was killed):
        # record it, so that status and later submits see a failed job, not a pending one.
        history.append(cfg.run_dir, "failed", job_id=str(job.job_id), step=newest_step(cfg.run_dir),
                       message=watch.error_line(rec["log_tail"]) or "the job ended without recording how",
                       will_requeue=False, recorded_by="alpsck submit")
        rec = watch.reconcile(cfg.run_dir)
    state = rec["state"]
    if not args.json:
        print(f"job {job.job_id} ended: {state}")
        if state != "finished":
            last = next((e for e in reversed(history.read(cfg.run_dir)) if e["event"] in ("failed", "gave_up")), None)
            if last is not None and last.get("message"):
                print(f"  {last['event']}: {printable(last['message'])}")
            tail = rec["log_tail"] or watch.log_tail(cfg.run_dir, str(job.job_id))
            if tail:
                print(f"  last lines of {log}:")
                print("\n".join(f"    {line}" for line in tail))
    return 0 if state == "finished" else 1


def _purge(run_dir: Path, days: int | None) -> dict[str, Any]:
    """The purge window (``--purge-days``, else the scratch's: filesystem.purge_days) and a warning
    when the newest checkpoint nears it."""
    from ..store.filesystem import newest_committed, purge_days, purge_warning

    days = purge_days(run_dir) if days is None else days or None
    out: dict[str, Any] = {"days": days, "warning": None}
    if days is None:
        return out
    newest = newest_committed(run_dir)  # before anything reads a checkpoint (a read resets the clock)
    if newest is not None:
        out["warning"] = purge_warning(newest, days, time.time())
    return out


def _status(args: argparse.Namespace) -> int:
    from ..store.run_dir import pick

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise AlpsckError(f"{run_dir}: {'not a directory' if run_dir.exists() else 'no such directory'}")
    path = run_dir / history.HISTORY
    if not path.exists():
        raise AlpsckError(f"{run_dir}: no {history.HISTORY} (not a run directory of a submitted job)")
    if path.is_symlink() or not path.is_file():
        raise AlpsckError(f"{path}: not a regular file, so it holds no job history")
    purge = _purge(run_dir, args.purge_days)  # first: what follows reads the checkpoints
    log = history.read_log(run_dir)
    if not log.events:  # "pending" would claim a job that nothing here records
        raise AlpsckError(f"{path}: no readable event in {'its newest' if log.start else 'its'} {log.lines} line(s): "
                          "not a job history, or damaged")
    rec = watch.reconcile(run_dir, log.events)
    s = history.summary(run_dir, log, args.events)
    s.update(state=rec["state"], note=rec["note"], log=rec["log"], log_tail=rec["log_tail"], slurm=rec["slurm"])
    # During a start, the newest committed checkpoint says more than the events (written at a start's ends).
    try:
        picked = pick(str(run_dir))  # the one a resume uses, and why not the newer ones
    except (CheckpointError, OSError):
        picked = None
    on_disk = picked.step if picked is not None else None
    if on_disk is not None and (s["last_step"] is None or on_disk > s["last_step"]):
        s["last_step"] = on_disk
    s["metrics"] = (picked.info or {}).get("metrics") or {} if picked is not None else {}  # its save's
    s["unhealthy"] = [{"step": k.step, "message": k.message} for k in (picked.skipped if picked else ())
                      if k.reason == "unhealthy"]
    s["purge"] = purge
    s["goodput"] = goodput.goodput(log.events)  # of the events read (the newest 8 MiB of the history)
    chosen = next((e for e in reversed(log.events) if e["event"] == "interval"), None)  # checkpoint.every: auto
    s["interval"] = ({k: chosen.get(k) for k in ("seconds", "save_cost_s", "mtbf_s", "mtbf_from", "time")}
                     if chosen else None)
    if args.json:
        print(jsonout.dumps(s))
        return 0
    _print_status(s)
    return 0


def _print_status(s: dict[str, Any]) -> None:
    """The text form of ``alpsck status``: everything from the run directory through :func:`printable`
    (and a character the terminal's encoding lacks escaped too, never a UnicodeEncodeError)."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    ids = [printable(i, 40) for i in s["job_ids"][-10:]]
    more = f" and {len(s['job_ids']) - len(ids)} more" if len(s["job_ids"]) > len(ids) else ""
    print(f"{printable(s['run_dir'])}: {s['state']}  (jobs {', '.join(ids) or '-'}{more}, {s['starts']} starts, "
          f"{s['requeues']} requeues, last step {'-' if s['last_step'] is None else s['last_step']})")
    if s["note"]:
        print(f"  note: {printable(s['note'])}")
    if s["metrics"]:
        print(f"  metrics of the checkpoint a resume uses: {printable(metrics_text(s['metrics']))}")
    for k in s["unhealthy"][:3]:
        print(f"  skipped as unhealthy: step {k['step']}: {printable(k['message'])}")
    if s["goodput"]:
        print(f"  {goodput.line(s['goodput'])}")
    if s["interval"] and all(type(s["interval"][k]) in (int, float) for k in ("seconds", "save_cost_s", "mtbf_s")):
        i = s["interval"]
        print(f"  checkpoint interval (every: auto): {i['seconds']:.1f} s, by Daly from a save cost of "
              f"{i['save_cost_s']:.3f} s and an MTBF of {i['mtbf_s']:.0f} s ({printable(i['mtbf_from'], 20)})")
    if s["purge"]["warning"]:
        print(f"  warning: {printable(s['purge']['warning'])}")
    if s["slurm"]:
        code = s["slurm"]["exit_code"]
        print(f"  SLURM: {printable(s['slurm']['state'])}{'' if code is None else f', exit code {printable(code)}'}")
    left = [f"{s['earlier_events']} earlier event(s) not shown" if s["earlier_events"] else "",
            f"{s['malformed_lines']} line(s) that are no event skipped" if s["malformed_lines"] else "",
            f"{s['unread_bytes']:,} older byte(s) of the history not read" if s["unread_bytes"] else ""]
    if any(left):
        print(f"  ({'; '.join(x for x in left if x)})")
    for e in s["events"]:
        print(f"  {watch.describe(e)}")
    if s["log"]:
        print(f"  log: {printable(s['log'])}")
    if s["log_tail"]:
        print("  last lines of the log:")
        print("\n".join(f"    {line}" for line in s["log_tail"]))


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "submit", help="submit a training job (SLURM, or locally when there is no cluster)",
        description="Submit the training job a YAML config describes: to SLURM through sbatch when a cluster answers, "
                    "else through submitit's local executor on this machine. The job checkpoints, and at a time limit, "
                    "a preemption or a maintenance window takes a final checkpoint, requeues and resumes "
                    "(docs/slurm.md; every config key: docs/config.md).")
    s.add_argument("config", help="job config (YAML); see slurm/examples/")
    s.add_argument("--dry-run", action="store_true", help="print the sbatch script and submit nothing")
    s.add_argument("--local", action="store_true", help="run through submitit's local executor, even with SLURM")
    s.add_argument("--json", action="store_true", help='print one line {"job_id": ..., "run_dir": ...}')
    s.add_argument("--wait", action="store_true", help="wait until the job has finished (default for local runs)")
    s.add_argument("--no-wait", action="store_true", help="return at once, also for local runs")
    s.add_argument("--no-check", action="store_true", help="do not check that the entry imports before submitting")
    s.add_argument("--continue", dest="resume_finished", action="store_true",
                   help="submit on a run dir whose run has finished (to train past its old step count)")
    s.set_defaults(func=_submit)
    st = sub.add_parser(
        "status", help="the timeline of a submitted job (history.jsonl)",
        description="The state of the job a run directory belongs to (pending, running, requeued, finished, failed, "
                    "cancelled, gave_up, timeout), its newest events, where its log is and its last lines, what "
                    "SLURM recorded where the history stops short, and a warning when the newest checkpoint nears "
                    "the scratch's purge window. Exit 0 whatever the state.")
    st.add_argument("run_dir")
    st.add_argument("--json", action="store_true", help="print one JSON document")
    st.add_argument("--events", type=arg_int(0), metavar="N", default=TIMELINE,
                    help=f"show the newest N events of the timeline (default {TIMELINE}); the counts cover all read")
    st.add_argument("--purge-days", type=arg_int(0), metavar="DAYS",
                    help="the scratch's purge window (days without access); warns a week before the newest "
                         "checkpoint reaches it (default: 30 on /capstor, 14 on /iopsstor, none elsewhere; 0: off)")
    st.set_defaults(func=_status)
