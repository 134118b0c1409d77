"""The health gate (``health.gate: true``): before every start's job step (the first, every restart inside the
allocation, and so every requeue's first), every node of the allocation not yet kept out is checked in seconds
(:mod:`alpsck.node_health.checks`: the run directory written and fsync'ed, free memory and ``/dev/shm``, the GPUs),
and a node that fails is **cordoned**: a ``cordoned`` event in the run's history names it, with the failed
checks' findings, and it is kept out of the run for good.

How it is enforced, by SLURM:

- inside the allocation, the job step leaves the cordoned nodes out (``srun --exclude``; the step takes
  ``slurm.nodes`` of the allocation's nodes, so a spare takes a cordoned node's place: :mod:`.spare_nodes`);
- when too few nodes are left in the allocation, the job is requeued and its own record then excludes every
  cordoned node (``scontrol update JobId=... ExcNodeList=...``, which SLURM takes from a pending job only): its
  next allocation cannot hold one. When the partition has fewer nodes than the job asks for once the cordoned
  are left out, no allocation ever could: the run gives up (``gave_up``, exit 93).

The batch script calls :data:`GATE` before each ``srun`` of the training (:func:`batch_lines`): it runs
:func:`main` on the batch host, which starts the probe on the nodes (one srun task per node,
:mod:`alpsck.node_health.probe`, ``--overlap``), reads their answers, records what it finds, and prints the nodes
to exclude; a node that does not answer within ``health.timeout_s`` fails. Every value in the script's lines is
an int from the config or shell-quoted; the probe's and the gate's arguments are argument lists, never shell.
Under submitit's local executor (no SLURM) there is no gate: ``alpsck doctor --nodes`` runs the same checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SlurmError
from ..job_env import JobEnv, hostnames
from ..node_health.links import CODE as LINKS_CODE
from ..node_health.links import slow_nodes
from ..node_health.probe import CODE as PROBE_CODE
from . import commands, history, stragglers, timeline, trace
from .config import JobConfig
from .exits import GATE_REQUEUED_EXIT, GIVE_UP_EXIT
from .history import Cordoned, GaveUp, Requeued
from .spare_nodes import EXCLUDE

GATE = "alpsck_health_gate"  # the batch script's function: sets spare_nodes.EXCLUDE, or ends the script
CODE = "import sys; del sys.path[0]; from alpsck.slurm.health_gate import main; sys.exit(main(sys.argv[1:]))"
SRUN_LOG = "alpsck_srun_log"  # the batch script's file of the last step's srun messages


@dataclass(frozen=True)
class Answer:
    """One node's answer to the probe: its checks (dicts of alpsck.node_health.checks.Check), or why it has none."""

    node: str
    checks: list[dict[str, Any]]
    silent: str = ""  # no checks: what srun said


    @property
    def failed(self) -> list[dict[str, Any]]:
        return [c for c in self.checks if not c.get("ok")]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and not self.failed

    def reason(self) -> str:
        if not self.checks:
            return f"no answer from the probe (srun {self.silent})" if self.silent else "no answer from the probe"
        return "; ".join(f"{c.get('name')}: {c.get('detail')}" for c in self.failed)


def _json_objects(stdout: str) -> Iterator[dict[str, Any]]:
    """The JSON objects among the lines the probes' tasks printed (anything else srun printed is skipped)."""
    for line in stdout.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            yield doc


def parse_answers(stdout: str) -> dict[str, Answer]:
    """The probe's JSON lines (anything else srun printed is skipped), by node."""
    return {doc["node"]: Answer(doc["node"], [c for c in doc["checks"] if isinstance(c, dict)])
            for doc in _json_objects(stdout) if isinstance(doc.get("node"), str) and isinstance(doc.get("checks"), list)}


def _task_per_node(nodes: list[str], name: str, *, kill_on_bad_exit: bool) -> list[str]:
    """srun's options for a step of the gate: one task (one CPU) on each of ``nodes``, beside the training's own
    (``--overlap``), named ``name``."""
    return [f"--nodelist={','.join(nodes)}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            "--cpus-per-task=1", "--overlap", f"--kill-on-bad-exit={int(kill_on_bad_exit)}", f"--job-name={name}"]


def _srun_probe(nodes: list[str], run_dir: str, limits: dict[str, Any], python: list[str], timeout_s: float,
                container: str | None) -> tuple[dict[str, Answer], str]:
    args = [*_task_per_node(nodes, "alpsck-health", kill_on_bad_exit=False),
            *([f"--environment={container}"] if container else []),
            *python, "-c", PROBE_CODE, run_dir, json.dumps(limits)]
    code, stdout, stderr = commands.srun_gather(args, timeout_s)
    said = " ".join(stderr.split())[-300:]
    return parse_answers(stdout), f"exit {code}: {said}" if said else f"exit {code}"


def probe_nodes(nodes: list[str], run_dir: str, limits: dict[str, Any], python: list[str], timeout_s: float,
                *, container: str | None = None) -> dict[str, Answer]:
    """Every node of ``nodes`` probed (one srun task each, all in one step): its answer. The nodes that gave none
    are probed again one step each, at once, so that one node srun cannot start on (a dead one, which fails the
    whole step) is told apart from the others; a node silent twice gets an answer without checks that says what
    srun said. ``python``: the probe's interpreter, as argument words."""
    if not nodes:
        return {}
    got, said = _srun_probe(nodes, run_dir, limits, python, timeout_s, container)
    missing = [n for n in nodes if n not in got]
    silent: dict[str, str] = {}
    if missing and len(nodes) > 1:
        with ThreadPoolExecutor(max_workers=min(len(missing), 64)) as pool:
            again = list(pool.map(lambda n: _srun_probe([n], run_dir, limits, python, timeout_s, container), missing))
        for n, (answers, why) in zip(missing, again, strict=True):
            if n in answers:
                got[n] = answers[n]
            else:
                silent[n] = why
    return {n: got.get(n) or Answer(n, [], silent.get(n, said)) for n in nodes}


def probe_links(answers: dict[str, Answer], python: list[str], min_gbps: float, mib: int, timeout_s: float) -> None:
    """The links between the nodes whose checks passed, timed (:mod:`alpsck.node_health.links`, one step, one task
    per node) when ``min_gbps`` > 0 and there are three or more: each of them gets a ``links`` check, failed for a
    node both of whose links in the ring run slower. No verdict when some node gives no rate (a warning)."""
    healthy = [n for n, a in answers.items() if a.ok]
    if min_gbps <= 0 or len(healthy) < 3:
        return
    args = [*_task_per_node(healthy, "alpsck-links", kill_on_bad_exit=True),
            *python, "-c", LINKS_CODE, healthy[0], str(int(mib)), f"{timeout_s:g}"]
    code, stdout, stderr = commands.srun_gather(args, timeout_s + 30)
    rates: dict[int, tuple[str, float]] = {}
    for doc in _json_objects(stdout):
        try:
            rates[int(doc["rank"])] = (str(doc["node"]), float(doc["gbps"]))
        except (ValueError, KeyError, TypeError):
            continue
    ring = [rates[r] for r in sorted(rates)]
    if sorted(n for n, _ in ring) != sorted(healthy):
        print(f"alpsck: health gate: the link probe gave no rate for every node (srun exit {code}: "
              f"{' '.join(stderr.split())[-300:]}); no node is judged by its links", file=sys.stderr, flush=True)
        return
    blamed = slow_nodes(ring, min_gbps)
    for i, (node, gbps) in enumerate(ring):
        detail = blamed.get(node) or f"{gbps:.3g} Gbit/s in from {ring[i - 1][0]} (min_link_gbps {min_gbps:g})"
        answers[node].checks.append({"name": "links", "ok": node not in blamed, "detail": detail})


def _keep_out(job_id: str, nodes: set[str]) -> str | None:
    """The job's record excludes ``nodes`` from its next allocations, besides what it excluded already (the user's
    ``--exclude``); why not, or None."""
    try:
        found = re.search(r"\bExcNodeList=(\S+)", commands.scontrol(["show", "job", job_id]))
        before = hostnames(found.group(1)) if found and found.group(1) != "(null)" else []
        commands.scontrol(["update", f"JobId={job_id}", f"ExcNodeList={','.join(sorted(nodes | set(before)))}"])
        return None
    except SlurmError as e:
        return str(e)


def _partition_nodes(partition: str) -> set[str] | None:
    try:
        return set(commands.partition_nodes(partition))
    except SlurmError:
        return None


def decide(run_dir: str, job_id: str, attempt: int, allocation: list[str], excluded: set[str], need: int,
           allocated: int, partition: str, answers_of: Callable[[list[str]], dict[str, Answer]]) -> tuple[int, list[str]]:
    """The gate's decision (module docstring): (exit code, the nodes the step must exclude). ``answers_of``:
    the nodes to probe -> their answers (:func:`probe_nodes`, or a stand-in)."""
    cordoned = timeline.read(run_dir).cordoned()
    probe = [n for n in allocation if n not in excluded and n not in cordoned]
    answers: dict[str, Answer] = answers_of(probe)
    if probe and not any(a.checks for a in answers.values()):  # the probe itself cannot run: no node's fault
        print(f"alpsck: health gate: no node answered the probe ({answers[probe[0]].reason()}); no node is cordoned "
              "for it", file=sys.stderr, flush=True)
        return 1, sorted(excluded | (set(cordoned) & set(allocation)))
    for a in answers.values():
        if a.ok:
            continue
        names = ",".join(str(c.get("name")) for c in a.failed) or "probe"
        history.append(run_dir, Cordoned(node=a.node, reason=a.reason(), checks=names, attempt=attempt), job_id=job_id)
        print(f"alpsck: health gate: node {a.node} cordoned: {a.reason()}", file=sys.stderr, flush=True)
    bad = set(cordoned) | {a.node for a in answers.values() if not a.ok}
    usable = [n for n in probe if answers[n].ok]
    exclude = sorted(excluded | (bad & set(allocation)))
    if len(usable) >= need:
        return 0, exclude
    why = (f"{len(usable)} healthy node(s) in this allocation ({','.join(usable) or 'none'}; cordoned: "
           f"{','.join(sorted(bad)) or 'none'}; not usable: {','.join(sorted(excluded)) or 'none'}), the job step needs "
           f"{need}")
    healthy = _partition_nodes(partition)
    if healthy is not None and len(healthy - bad) < allocated:
        message = (f"{why}; the partition has {len(healthy - bad)} node(s) that are not cordoned, and the job asks for "
                   f"{allocated}: no allocation can hold enough healthy nodes")
        history.append(run_dir, GaveUp(message=message, exit_code=GIVE_UP_EXIT), job_id=job_id)
        print(f"alpsck: giving up (exit {GIVE_UP_EXIT}): {message}", file=sys.stderr, flush=True)
        return GIVE_UP_EXIT, exclude
    # A requeue signals the batch step (this process too): finish recording first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        commands.scontrol_requeue(job_id)
    except SlurmError as e:
        print(f"alpsck: health gate: {why}, and the requeue failed: {e}", file=sys.stderr, flush=True)
        return 1, exclude
    # SLURM takes an ExcNodeList only from a pending job (22.05, running: "Job is no longer pending execution"):
    # set at once, while the requeued job waits for this allocation to end.
    not_kept = _keep_out(job_id, bad)
    history.append(run_dir, Requeued(reason="health", mechanism="scontrol", progress=False), job_id=job_id)
    print(f"alpsck: health gate: {why}: requeued, excluding {','.join(sorted(bad))}"
          + (f" (the exclusion failed: {not_kept})" if not_kept else ""), file=sys.stderr, flush=True)
    return GATE_REQUEUED_EXIT, exclude


def main(argv: list[str]) -> int:
    """The batch script's gate (module docstring): prints the nodes to exclude, comma-separated; exit 0 (run
    the step), :data:`exits.GATE_REQUEUED_EXIT` or :data:`exits.GIVE_UP_EXIT`."""
    p = argparse.ArgumentParser(prog="alpsck-health-gate")
    p.add_argument("run_dir")
    p.add_argument("--need", type=int, required=True)
    p.add_argument("--allocated", type=int, required=True)
    p.add_argument("--limits", required=True)
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--python", required=True, help="the probe's interpreter, shell words")
    p.add_argument("--exclude", default="")
    p.add_argument("--attempt", type=int, default=0)
    p.add_argument("--srun-log", default="", help="srun's messages of the step before (alpsck.slurm.trace)")
    p.add_argument("--cordon-after", type=int, default=0)
    p.add_argument("--min-link-gbps", type=float, default=0.0)
    p.add_argument("--link-mib", type=int, default=64)
    p.add_argument("--cordon-stragglers", action="store_true", help="cordon the nodes named as stragglers (.stragglers)")
    a = p.parse_args(argv)
    job = JobEnv.detect(os.environ)  # SLURM's own variables: the gate runs in the batch script, not in submitit's task
    job_id = job.slurm_job_id or ""
    trace.trace(a.run_dir, job_id, a.attempt, a.srun_log, a.cordon_after)
    if a.cordon_stragglers:
        stragglers.cordon(a.run_dir, job_id, a.attempt)
    allocation = job.nodes
    limits = json.loads(a.limits)

    def answers_of(nodes: list[str]) -> dict[str, Answer]:
        answers = probe_nodes(nodes, a.run_dir, limits, shlex.split(a.python), a.timeout)
        probe_links(answers, shlex.split(a.python), a.min_link_gbps, a.link_mib, a.timeout)
        return answers

    code, exclude = decide(a.run_dir, job_id, a.attempt, allocation, {n for n in a.exclude.split(",") if n},
                           a.need, a.allocated, job.partition, answers_of)
    print(",".join(exclude), flush=True)
    return code


def batch_lines(cfg: JobConfig, python: str, allocated: int) -> list[str]:
    """The batch script's :data:`GATE` function (``python``: the job's interpreter, shell words): runs
    :func:`main` with the config's numbers, sets ``EXCLUDE`` from its answer, and ends the script when it
    requeued the job or gave up. A gate that fails by itself lets the step start, with a warning."""
    if not cfg.health.gate:
        return []
    h = cfg.health
    words = [CODE, str(Path(cfg.run_dir)), f"--need={int(cfg.slurm.nodes)}", f"--allocated={int(allocated)}",
             f"--limits={json.dumps(h.limits(), sort_keys=True)}", f"--timeout={float(h.timeout_s):g}",
             f"--python={python}", f"--cordon-after={int(h.cordon_after_failures)}",
             f"--min-link-gbps={float(h.min_link_gbps):g}", f"--link-mib={int(h.link_probe_mib)}",
             *(["--cordon-stragglers"] if h.cordon_stragglers else [])]
    return [
        "# health.gate: the nodes are checked before every start of the job step; a failing node is cordoned, and so",
        "# is one the steps failed on first cordon_after_failures times (srun's messages of each step kept here)",
        f"{SRUN_LOG}=$(mktemp 2>/dev/null || echo /dev/null)",
        f"{GATE}() {{",
        "  local out rc",
        f'  out=$({python} -c {" ".join(shlex.quote(w) for w in words)} --exclude="${EXCLUDE}" '
        f'--attempt="$alpsck_attempt" --srun-log="${SRUN_LOG}")',
        "  rc=$?",
        '  case "$rc" in',
        f"    0) {EXCLUDE}=$out ;;",
        f"    {GATE_REQUEUED_EXIT}) exit 0 ;;",
        f"    {GIVE_UP_EXIT}) exit {GIVE_UP_EXIT} ;;",
        f'    *) [ -z "$out" ] || {EXCLUDE}=$out',
        '       echo "alpsck: the health gate itself failed (exit $rc); the job step starts without its checks" >&2 ;;',
        "  esac",
        "}",
    ]


def gated(step: list[str]) -> list[str]:
    """The restart loop's start of a job step (``step``: its lines, the srun line last) with the gate before the
    srun, and srun's own messages kept for the next gate (:mod:`.trace`) and shown in the batch log after it, the
    step's exit code unchanged."""
    return [*step[:-1], f"  {GATE}",
            f'{step[-1]} 2>"${SRUN_LOG}"; alpsck_rc=$?; cat "${SRUN_LOG}" >&2; (exit "$alpsck_rc")']

