"""``alpsck submit``, ``alpsck status`` and ``alpsck cancel``."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import AlpsckError, UsageError
from ..options import arg_int
from ..out import jsonout
from ..out.textout import local_time, printable
from ..store.picker import metrics_text
from ..store.storage import Storage, storage
from . import commands, goodput, history, status, timeline, watch
from .history import Failed, GaveUp
from .timeline import FINISHED

TIMELINE = 50  # events ``alpsck status`` shows by default (the newest)
FOLLOW_POLL_S = 2.0  # how often ``status --follow`` and ``cancel`` look again


def _submit(args: argparse.Namespace) -> int:
    from .config import load_config
    from .config_source import unset_stand_in
    from .runner import newest_step
    from .submit import check_entry, sbatch_script, submit

    cfg = load_config(args.config, dry_run=args.dry_run)
    where = _storage(cfg.source, cfg.run_dir, allow_home=args.allow_home)
    if args.dry_run:
        print(sbatch_script(cfg), end="")
        # After the script: a reader of the script sees these last.
        print(f"alpsck: dry run: checkpoints go to {cfg.run_dir}: {where.describe()}", file=sys.stderr)
        if where.warning:
            print(f"alpsck: warning: {where.warning}", file=sys.stderr)
        if args.no_check:
            print("alpsck: dry run: not checked whether the entry imports (--no-check)", file=sys.stderr)
        else:
            note = check_entry(cfg)  # ConfigError (exit 2) when it does not import
            print(f"alpsck: dry run: {note or 'the entry imports in the job environment'}", file=sys.stderr)
        for name in cfg.unset:
            print(f"alpsck: dry run: ${name} is not set here; the script shows it as {unset_stand_in(name)}",
                  file=sys.stderr)
        return 0
    before = history.read_log(cfg.run_dir)
    if timeline.fold(before.events).state == FINISHED and not args.resume_finished:
        newest = newest_step(cfg.run_dir)
        held = f"newest checkpoint: step {newest}" if newest is not None else "no checkpoint left in it"
        raise UsageError(f"{cfg.run_dir}: this run has finished ({held}); a "
                         "new job would resume there and end at once. To train further, raise the step count and "
                         "submit with --continue; to start afresh, give the config another run_dir")
    is_local = bool(args.local) or commands.backend() == "local"  # SlurmError: installed, but no answer
    if is_local and not args.local:
        say = sys.stderr if args.json else sys.stdout
        print(f"alpsck: no SLURM installed here ({commands.NOT_INSTALLED}): running through submitit's local executor "
              f"on this machine ({socket.gethostname()})", file=say, flush=True)
    if where.warning and not is_local:  # a job on this machine keeps its run dir, wherever it lies
        print(f"alpsck: warning: {where.warning}", file=sys.stderr, flush=True)
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
    return _ended(cfg.run_dir, str(job.job_id), is_local, quiet=args.json)


def _ended(run_dir: str, job_id: str, is_local: bool, *, quiet: bool) -> int:
    """After ``submit --wait``: the job's end (recorded ``failed`` for a local job that never recorded one),
    printed unless ``quiet``, with its error and its log's last lines; 0 when it finished."""
    from .runner import newest_step

    rec = watch.reconcile(run_dir)
    if is_local and timeline.read(run_dir).state in watch.LIVE_STATES:
        # The job is gone and never recorded its end (it died before the runner, or was killed):
        # record it, so that status and later submits see a failed job, not a pending one.
        history.append(run_dir, Failed(job_id=job_id, step=newest_step(run_dir),
                                       message=watch.error_line(rec["log_tail"]) or "the job ended without recording how",
                                       will_requeue=False, recorded_by="alpsck submit"))
        rec = watch.reconcile(run_dir)
    state = rec["state"]
    if not quiet:
        print(f"job {job_id} ended: {state}")
        if state != FINISHED:
            last = timeline.read(run_dir).newest((Failed, GaveUp))
            if last is not None and last.get("message"):
                print(f"  {last.kind}: {printable(last.get('message'))}")
            tail = rec["log_tail"] or watch.log_tail(run_dir, job_id)
            if tail:
                print(f"  last lines of {watch.log_path(run_dir, job_id)}:")
                print("\n".join(f"    {line}" for line in tail))
    return 0 if state == FINISHED else 1


def _storage(source: str, run_dir: str, *, allow_home: bool) -> Storage:
    """What the run directory lies on (:func:`alpsck.store.storage.storage`); UsageError for a home
    directory on a network file system (Alps: NFS, 50 GB, 500k inodes) unless ``allow_home``."""
    where = storage(run_dir)
    if where.needs_opt_in and not allow_home:
        raise UsageError(f"{source}: run_dir: {run_dir} is on {where.describe()}: {where.warning}; "
                         "pass --allow-home to use it all the same")
    return where


def _status(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if args.follow and args.json:
        raise UsageError("status: --follow prints lines as they come; --json prints one document: choose one")
    s = status.report(run_dir, shown=args.events, purge_days=args.purge_days)
    if args.json:
        print(jsonout.dumps(s.as_json()))
        return 0
    _print_status(s.as_json())
    if args.follow:
        _follow(run_dir, s.log_end, s.state)
    return 0


def _follow(run_dir: Path, since: int, state: str) -> None:
    """``status --follow``: each new event and newly durable checkpoint as it comes (the Follower of
    ``submit --wait``), until the run ends (its state leaves watch.LIVE_STATES); then its end, its
    goodput and its newest checkpoint."""
    from .runner import newest_step

    print(f"  following {printable(str(run_dir))} (Ctrl-C to stop following; the job goes on)", flush=True)
    follower = watch.Follower(str(run_dir), newest_step, sys.stdout, since)
    ended = {"state": state}

    def done() -> bool:
        ended["state"] = watch.reconcile(run_dir)["state"]
        return ended["state"] not in watch.LIVE_STATES

    if state in watch.LIVE_STATES:
        follower.wait(done, interval=FOLLOW_POLL_S)
    g = goodput.goodput(timeline.read(run_dir))
    newest = newest_step(str(run_dir))
    print(f"run ended: {ended['state']}; newest checkpoint: {'-' if newest is None else f'step {newest}'}"
          + (f"; {goodput.line(g)}" if g else ""), flush=True)


def _print_status(s: dict[str, Any]) -> None:
    """The text form of ``alpsck status``: everything from the run directory through :func:`printable`
    (and a character the terminal's encoding lacks escaped too, never a UnicodeEncodeError)."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    ids = [printable(i, 40) for i in s["job_ids"][-10:]]
    more = f" and {len(s['job_ids']) - len(ids)} more" if len(s["job_ids"]) > len(ids) else ""
    print(f"{printable(s['run_dir'])}: {s['state']}  (jobs {', '.join(ids) or '-'}{more}, {s['starts']} starts, "
          f"{s['requeues']} requeues, last step {'-' if s['last_step'] is None else s['last_step']})")
    if s["backend"] == "local":
        print(f"  ran through submitit's local executor on {printable(s['host'] or 'the submitting host', 80)}, "
              "not through SLURM")
    if s["note"]:
        print(f"  note: {printable(s['note'])}")
    for name, why in s["watchers_off"].items():
        print(f"  warning: the {name} watcher is {printable(why)}")
    if s["metrics"]:
        print(f"  metrics of the checkpoint a resume uses: {printable(metrics_text(s['metrics']))}")
    for k in s["unhealthy"][:3]:
        print(f"  skipped as unhealthy: step {k['step']}: {printable(k['message'])}")
    if s["goodput"]:
        print(f"  {goodput.line(s['goodput'])}")
    for c in s["cordoned"]:
        print(f"  cordoned: {printable(c['node'], 80)} since {local_time(c['since'] or 0.0)} (job "
              f"{printable(c['job_id'] or '-', 40)}): {printable(c['reason'] or '-')}")
    for g in s["stragglers"]:
        print(f"  straggler: {printable(g['node'], 80)} (rank {g['rank']}): its part of a save took {g['factor']}x its "
              f"peers' ({g['work_s']} s against {g['peers_s']} s, {g['late_s']} s later at the agreement); named in "
              f"{g['times']} start(s), last {local_time(g['last'] or 0.0)}")
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


LOCAL_GRACE_S = 30.0  # how long a local job has to end on SIGINT before it and its tasks are killed


def _end_local(job_id: str, run_dir: Path) -> None:
    """End a local executor's job (``job_id``: its controller's pid): SIGINT, as submitit's own
    LocalJob.cancel (the controller interrupts its tasks and kills them a second later); a controller
    still there after LOCAL_GRACE_S is killed with its tasks. The task records the interruption as its
    failure: ``cancel`` records the cancel after it, as the last word."""
    import signal

    pid = int(job_id)
    os.kill(pid, signal.SIGINT)
    gone_by = time.monotonic() + LOCAL_GRACE_S
    while watch.local_job_alive(job_id, run_dir):
        if time.monotonic() >= gone_by:
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                children = []
            for victim in [*map(int, children), pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            break
        time.sleep(0.2)


def _cancel(args: argparse.Namespace) -> int:
    """``alpsck cancel RUN_DIR``: end the run's live jobs for good (no requeue) and record it."""
    from .runner import newest_step
    run_dir = Path(args.run_dir)
    status.history_path(run_dir)
    tl = timeline.read(run_dir)
    sub = tl.last_submission()
    slurm = watch.live_jobs(run_dir, budget=None)  # [] without a SLURM job in the history: squeue is not asked
    if slurm is None:
        raise AlpsckError(f"{run_dir}: SLURM did not answer squeue about this run's jobs, so nothing was cancelled; "
                          "try again when the controller answers")
    local = [sub["job_id"]] if sub is not None and sub.get("backend") == "local" and \
        watch.local_job_alive(sub["job_id"], run_dir) else []
    if not slurm and not local:
        state = watch.reconcile(run_dir, tl)["state"]
        print(f"{printable(str(run_dir))}: no live job to cancel (state: {state})")
        return 0
    for job_id, _ in slurm:
        # scancel: SIGTERM to the steps and the batch shell; the runner and the batch script's EXIT trap
        # ask scontrol, see the cancel, take the final checkpoint and do not requeue (alpsck.slurm.stop).
        commands.scancel(job_id)
    for job_id in local:
        _end_local(job_id, run_dir)
    ids = [i for i, _ in slurm] + local
    history.append(run_dir, history.Cancelled(job_id=ids[-1], step=newest_step(str(run_dir)),
                                              recorded_by="alpsck cancel"))
    print(f"cancelled job{'s' if len(ids) > 1 else ''} {', '.join(ids)} of {printable(str(run_dir))}", flush=True)
    if args.no_wait:
        return 0
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        gone = not (watch.live_jobs(run_dir) or any(watch.local_job_alive(i, run_dir) for i in local))
        if gone:
            rec = watch.reconcile(run_dir)
            code = (rec["slurm"] or {}).get("exit_code")
            print(f"job ended: {rec['state']}" + (f" (SLURM: {rec['slurm']['state']}, exit code {code})"
                                                  if rec["slurm"] else ""))
            return 0
        time.sleep(FOLLOW_POLL_S)
    raise AlpsckError(f"{run_dir}: the job was cancelled but is still in the queue after {args.timeout} s (its final "
                      "checkpoint may be running); alpsck status shows when it ends")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    s = sub.add_parser(
        "submit", help="submit a training job (SLURM, or locally where no SLURM is installed)",
        description="Submit the training job a YAML config describes: to SLURM through sbatch wherever SLURM is "
                    "installed (a controller that does not answer is retried for about 30 s, then an error: never a "
                    "run on this host), else, or with --local, through submitit's local executor on this machine. "
                    "The job checkpoints, and at a time limit, "
                    "a preemption or a maintenance window takes a final checkpoint, requeues and resumes "
                    "(docs/slurm.md; every config key: docs/config.md).")
    s.add_argument("config", help="job config (YAML); see slurm/examples/")
    s.add_argument("--dry-run", action="store_true",
                   help="print the sbatch script, where checkpoints go, and whether the entry imports; submit nothing")
    s.add_argument("--local", action="store_true",
                   help="run the job on this machine through submitit's local executor, even where SLURM is installed "
                        "(without it, submit runs locally only where no SLURM is installed)")
    s.add_argument("--json", action="store_true", help='print one line {"job_id": ..., "run_dir": ..., "log": ...}')
    s.add_argument("--wait", action="store_true", help="wait until the job has finished (default for local runs)")
    s.add_argument("--no-wait", action="store_true", help="return at once, also for local runs")
    s.add_argument("--no-check", action="store_true",
                   help="do not check that the entry imports before submitting (or in --dry-run)")
    s.add_argument("--allow-home", action="store_true",
                   help="accept a run_dir in a home directory on a network file system (on Alps: NFS, 50 GB, "
                        "500k inodes; checkpoints belong on /capstor/scratch)")
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
    st.add_argument("--follow", action="store_true",
                    help="then print each new event and checkpoint as it comes, until the run ends")
    st.set_defaults(func=_status)
    c = sub.add_parser(
        "cancel", help="cancel a run's live jobs for good (no requeue)",
        description="Cancel the live jobs of the run a run directory belongs to: scancel under SLURM (the job takes "
                    "its final checkpoint when it can and is not requeued), the local executor's job otherwise, and "
                    "record 'cancelled' in the run's history. Waits until the jobs have left the queue.")
    c.add_argument("run_dir")
    c.add_argument("--no-wait", action="store_true", help="return once the jobs are told, without waiting for their end")
    c.add_argument("--timeout", type=arg_int(1), metavar="SECONDS", default=600,
                   help="how long to wait for the jobs to leave the queue (default 600)")
    c.set_defaults(func=_cancel)
