"""Submitting a job config through submitit: to SLURM, or to submitit's local executor.

``submit(cfg)`` validates nothing (``load_config`` did), records ``submitted`` in the run's
history, and returns the job id. Without ``sbatch`` on the PATH (or with ``local=True``) the job
runs through submitit's local executor, which sends the time-limit signal before its timeout and
restarts a task that exits with code 144: the same checkpoint/requeue cycle, no cluster needed.
There, bash runs the venv activation and the setup lines before each start of the job, as the
batch script would, and the job sees ``slurm.gpus_per_node`` GPUs (CUDA_VISIBLE_DEVICES); the
container and the uenv cannot apply on this machine, and ``submit`` warns that they are unused.

The sbatch script is submitit's, with our settings:

- ``--signal=<requeue.signal>@<delay>`` (USR2 by default; submitit in the job is told the same
  signal through SUBMITIT_PREEMPT_SIGNAL) and ``--open-mode=append`` (from submitit; a requeued
  job must not truncate its own log);
- ``--requeue``;
- ``#SBATCH --uenv`` and ``--view`` for a uenv (:func:`uenv_parameters`); srun with the container
  (``--environment``) per step, ``--cpus-per-task`` and ``--kill-on-bad-exit=1``
  (:func:`srun_arguments`); no ``--wckey``;
- the venv activation (with a container or uenv: in each task's command instead, :func:`job_interpreter`)
  and the user's setup lines, run as one block through ``eval`` of their
  quoted text, so that no line of theirs can reach past the block: a here-document or quote left
  open would have swallowed the srun line (the job trained nothing and ended COMPLETED). The
  config refuses such a block (``config.shell_problem``), and ``bash -n`` checks the whole
  script before sbatch gets it;
- an EXIT trap that requeues the job when the job asked for it through
  ``RUN_DIR/.requeue-request`` (the fallback where ``scontrol`` is missing inside a container:
  the batch script runs on the host).

Every value in those lines is either validated by the config or quoted with ``shlex.quote``.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import submitit

from ..errors import ConfigError, SlurmError, UsageError
from ..job_env import ATTEMPT_ENV, PREVIOUS_END_ENV, PREVIOUS_EXIT_ENV
from ..store.durable import make_dirs_durably
from . import commands, health_gate, history, spare_nodes, watch
from .batch_rules import shell_problem
from .config import JobConfig
from .exits import FINAL_EXITS
from .launch import job_python, start_local_controller, user_paths
from .runner import REQUEST_FILE, JobRunner
from .stop import term_verdict_shell


def requeue_trap_lines(run_dir: str) -> list[str]:
    """Batch-script lines: on exit, act on the job's requeue request (:func:`runner.request_text`)
    if it comes from this start: ask scontrol, on the host, how the job is ending
    (:func:`stop.term_verdict_shell`), requeue it unless it was cancelled or SLURM requeued it
    already, append the request's event for that verdict to the history, and remove the request.
    The request's content is only compared and copied, never run."""
    req = shlex.quote(str(Path(run_dir) / REQUEST_FILE))
    return [
        *history.shell_append_lines(run_dir),
        *term_verdict_shell(),
        "alpsck_requeue_on_request() {",
        "  trap '' TERM  # the SIGTERM our own requeue (or a scancel) brings must not kill scontrol or sed here",
        "  local verdict event",
        f'  [ -e {req} ] || [ -L {req} ] || return 0',
        f'  if [ -f {req} ] && [ ! -L {req} ] && [ "$(head -n 1 {req})" = "$SLURM_JOB_ID ${{SLURM_RESTART_COUNT:-0}}" ]; then',
        "    verdict=$(alpsck_term_verdict)",
        f'    event=$(sed -n "s/^$verdict //p" {req} | head -n 1)',
        '    case "$verdict" in',
        '      preemption|timeout) scontrol requeue "$SLURM_JOB_ID" || event= ;;',
        "    esac",
        f'    [ -z "$event" ] || {history.SHELL_APPEND} "$event"',
        "  fi",
        f"  rm -f {req}",
        "}",
        "trap alpsck_requeue_on_request EXIT",
    ]


# submitit's own name for the time-limit signal (its sbatch --signal and its handler in the job).
PREEMPT_SIGNAL_ENV = "SUBMITIT_PREEMPT_SIGNAL"


def venv_in_task(cfg: JobConfig) -> bool:
    """Whether the venv is activated inside each srun'd task rather than in the batch script: with
    a container or a uenv, whose Python (the venv's base) exists only inside the job step. CSCS:
    "every Slurm job making use of this virtual environment will need to activate it first (inside
    the srun command)" (https://docs.cscs.ch/software/ml/pytorch/)."""
    return bool(cfg.environment.venv and (cfg.environment.container or cfg.environment.uenv))


def environment_lines(cfg: JobConfig, *, batch: bool = False) -> list[str]:
    """The venv activation and the user's setup lines: in the batch script on SLURM (``batch``:
    without the venv where ``venv_in_task``, which ``job_interpreter`` activates in each task), and
    run by bash before the job under the local executor (``local_python``).

    The setup lines run verbatim, in this shell (what they export and source reaches the job),
    but as one ``eval`` of their quoted text: whatever a line leaves open (a here-document, a
    quote, ``$(``, an ``if``, a trailing backslash) ends with the eval's text, and cannot swallow
    the lines after it, the srun line among them."""
    lines: list[str] = []
    if cfg.environment.venv and not (batch and venv_in_task(cfg)):
        lines.append(f"source {shlex.quote(str(Path(cfg.environment.venv) / 'bin' / 'activate'))}")
    if cfg.environment.setup:
        lines += ["# environment.setup, as one block: no line of it reaches past it",
                  f"eval {shlex.quote(chr(10).join(cfg.environment.setup))}"]
    return lines


# How the batch shell takes the signals SLURM can send it (docs/slurm.md has the whole table):
# - USR1, USR2 (``scancel --batch --signal=...``): ignored. Their default action would end the
#   job FAILED; the tasks take their own signals (``--signal`` without ``B:``, ``scancel
#   --signal`` without ``--batch``), and the job launcher sets its handlers whatever it inherits.
# - HUP: ignored (a closed session must not end the job); INT: ignored (bash would only defer it
#   until srun returns, then go on: measured); QUIT: bash always ignores it.
# - TERM (scancel, the time limit, ``scontrol requeue``: sent to the steps and the batch shell
#   together): trapped, so the shell waits for the step's final checkpoint (bash runs a trap only
#   after the foreground srun returns), and the EXIT trap then decides on the requeue request.
#   Without it bash would run the EXIT trap at once, before the request exists.
# - ALRM and the other terminating signals: fatal by choice (an explicit signal to the batch
#   shell asks to end it): the job ends without a final checkpoint, and ``alpsck status`` reports
#   SLURM's record.
BATCH_SIGNAL_LINES = ["trap '' USR1 USR2 HUP INT  # scancel --batch --signal=USR1/USR2/HUP/INT must not end the job",
                      "alpsck_stopping=0",
                      "trap alpsck_stopping=1 TERM  # wait for the step's final checkpoint; the EXIT trap decides"]


def restart_loop_lines(srun_line: str, in_job_restarts: int, *, spares: bool = False, gate: bool = False) -> list[str]:
    """The batch script's start of the job step (``srun_line``, submitit's), in a loop: a step that dies,
    with an exit code other than :data:`exits.FINAL_EXITS` (a task killed by a signal, a hard exit, or the
    runner's :data:`exits.RESTART_EXIT` after a failure worth retrying) while no stop came (the TERM trap)
    is started again in this allocation, up to ``in_job_restarts`` times (``requeue.in_job_restarts``): a
    new srun step, every rank together (``--kill-on-bad-exit``: one task's death ends them all), each told
    which attempt it is and how the one before ended (:class:`alpsck.job_env.JobEnv`); the runner of the
    new start records the crash, resumes from the newest checkpoint and applies the give-up rules. The
    script ends with the last step's exit code, so SLURM records the job's end as before. ``spares``:
    :func:`spare_nodes.step_lines`; ``gate``: the health gate before every step (:mod:`.health_gate`)."""
    final = "|".join(str(c) for c in FINAL_EXITS)
    step = spare_nodes.step_lines(srun_line) if spares else [srun_line]
    step = health_gate.gated(step) if gate else step
    return [
        "# requeue.in_job_restarts: a job step that dies (not stopped, not ended) starts again in this allocation",
        "alpsck_attempt=0",
        "while :; do",
        f"  export {ATTEMPT_ENV}=$alpsck_attempt",
        # at the line's start, as submitit writes it (what tools and tests look for)
        *step,
        "  alpsck_rc=$?",
        f"  export {PREVIOUS_EXIT_ENV}=$alpsck_rc {PREVIOUS_END_ENV}=$(date +%s.%N)",
        f'  case "$alpsck_rc" in {final}) break ;; esac',
        f'  if [ "$alpsck_stopping" != 0 ] || [ "$alpsck_attempt" -ge {int(in_job_restarts)} ]; then break; fi',
        "  alpsck_attempt=$((alpsck_attempt + 1))",
        f'  echo "alpsck: the job step ended with exit code $alpsck_rc; starting it again in this allocation '
        f'(in-job restart $alpsck_attempt of {int(in_job_restarts)})" >&2',
        "done",
        'exit "$alpsck_rc"',
    ]


def setup_lines(cfg: JobConfig) -> list[str]:
    # The signal lines first: until bash has run them, a signal to the batch shell ends the job.
    return [*BATCH_SIGNAL_LINES, f"mkdir -p {shlex.quote(cfg.run_dir)}", *requeue_trap_lines(cfg.run_dir),
            # submitit in the job must expect the configured signal too, or an early one finds no
            # handler (USR1's default action ends the process)
            f"export {PREEMPT_SIGNAL_ENV}={shlex.quote(cfg.requeue.signal)}", *spare_nodes.batch_lines(cfg),
            *health_gate.batch_lines(cfg, job_interpreter(cfg), spare_nodes.allocated_nodes(cfg)),
            *environment_lines(cfg, batch=True)]


def local_python(cfg: JobConfig) -> str:
    """The interpreter of the local executor's job command, as shell words (submitit appends its
    arguments and splits the line with shlex): this Python, as in the batch script, behind a bash
    that first runs ``environment_lines``, so that what they export and activate reaches the job.
    submitit's own ``setup`` cannot: it joins the lines with ``&&`` for /bin/sh (no ``source`` in
    dash; a comment swallows the rest)."""
    lines = environment_lines(cfg)
    if not lines:
        return shlex.quote(sys.executable)
    bash = shutil.which("bash")
    if bash is None:
        keys = " and ".join(k for k, v in (("environment.venv", cfg.environment.venv),
                                           ("environment.setup", cfg.environment.setup)) if v)
        raise UsageError(f"{cfg.source}: {keys}: the local executor runs them with bash, as the batch script "
                         "would, and bash is not on the PATH")
    script = "\n".join([*lines, 'exec "$@"'])
    return shlex.join([bash, "-c", script, "alpsck-setup", sys.executable])


def local_unused(cfg: JobConfig) -> list[str]:
    """The config's settings the local executor cannot apply, one line each naming the key."""
    env = cfg.environment
    return [f"environment.{key} ({value}) is not used by the local executor: the job runs on this machine, "
            f"outside {what}"
            for key, value, what in (("container", env.container, "the container"), ("uenv", env.uenv, "the uenv"))
            if value] + (["health.gate is not used by the local executor: there are no nodes to check (alpsck doctor "
                          "--nodes checks this one)"] if cfg.health.gate else [])


# Run by ``check_entry`` in the job's environment: argv = [module, function, *user paths].
_IMPORT_CHECK = (
    "import importlib, sys\n"
    "del sys.path[0]\n"
    "import alpsck\n"  # the installed one, first, as in the job: the user's paths may hold a source tree
    "mod, fn, *paths = sys.argv[1:]\n"
    "sys.path[0:0] = paths\n"
    "obj = getattr(importlib.import_module(mod), fn, None)\n"
    "if not callable(obj):\n"
    "    sys.exit(f'{mod} has no function {fn}')\n"
)
ENTRY_CHECK_TIMEOUT_S = 180


def check_entry(cfg: JobConfig) -> str | None:
    """Refuse an entry that cannot start, before it costs an allocation: a script that does not
    compile, a ``module:function`` that does not import in the job's environment (its venv and
    setup lines, from the directory the job runs in). Returns a note when the check could not run
    (inside a container or uenv, which exist only on the compute nodes; an import that takes
    longer than ENTRY_CHECK_TIMEOUT_S); raises ConfigError naming the entry when it fails."""
    entry = cfg.entry
    if entry.script is not None:
        try:
            compile(Path(entry.script).read_bytes(), entry.script, "exec")
        except (SyntaxError, ValueError) as e:
            raise ConfigError(f"{cfg.source}: entry.script: {entry.script} does not compile: {e}") from None
        return None
    if cfg.environment.container or cfg.environment.uenv:
        return "not checked whether entry.function imports: its container or uenv exists only in the job"
    assert entry.function is not None
    mod, fn = entry.function.split(":")
    argv = [*shlex.split(local_python(cfg)), "-c", _IMPORT_CHECK, mod, fn,
            *user_paths(cfg.config_dir, cfg.workdir or os.getcwd())]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=ENTRY_CHECK_TIMEOUT_S,
                           cwd=cfg.workdir or None, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"not checked whether entry.function imports: importing {mod} took over {ENTRY_CHECK_TIMEOUT_S} s"
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
        raise ConfigError(f"{cfg.source}: entry.function: {entry.function} does not import in the job's environment: "
                          f"{lines[-1] if lines else f'exit code {r.returncode}'} (submit with --no-check to skip this)")
    return None


def signal_delay(cfg: JobConfig) -> int:
    """Seconds before the time limit that the job is signalled (set when the config loads)."""
    return int(cfg.requeue.signal_delay_s or 60)


def job_interpreter(cfg: JobConfig) -> str:
    """The Python the job's tasks run, as shell words: this one, or, inside a container or a uenv
    (which exist only on the compute nodes, with their own Python), ``python3`` from the
    environment's PATH, never a path of the submitting host. With a venv there (``venv_in_task``),
    a bash in the task activates it first and then runs that python3: the venv's own."""
    if venv_in_task(cfg):
        activate = shlex.quote(str(Path(str(cfg.environment.venv)) / "bin" / "activate"))
        return shlex.join(["bash", "-c", f'source {activate} && exec python3 "$@"', "alpsck-task"])
    if cfg.environment.container or cfg.environment.uenv:
        return "python3"
    return shlex.quote(sys.executable)


def srun_arguments(cfg: JobConfig) -> list[str]:
    """Options of the srun that starts the tasks (on Alps as CSCS documents them):

    - the container (``--environment``) per job step, not on the batch script: the batch script stays on
      the host, where its EXIT trap can run ``scontrol requeue`` (a uenv is on the batch script instead,
      :func:`uenv_parameters`, as CSCS's PyTorch job script has it: it only mounts an image, and the
      host's commands stay);
    - ``--cpus-per-task`` again: srun does not inherit it from sbatch (Slurm 22.05 and later);
    - ``--kill-on-bad-exit=1``: one task that dies ends the step, instead of leaving the others
      hanging in a collective until the time limit.
    """
    args = [*spare_nodes.srun_arguments(cfg), f"--cpus-per-task={cfg.slurm.cpus_per_task}", "--kill-on-bad-exit=1"]
    if cfg.environment.container:
        args.append(f"--environment={cfg.environment.container}")
    return args


def uenv_parameters(cfg: JobConfig) -> dict[str, str]:
    """``#SBATCH --uenv=IMAGE`` and ``--view=VIEW`` for a config with a uenv, as CSCS's PyTorch page
    writes its job script: every srun step of the job inherits them. Without a view the uenv is only
    mounted, and python3 would be the node's own. ``alpsck submit`` runs in a plain login shell: uenv
    v10 refuses sbatch from inside ``uenv start``."""
    if not cfg.environment.uenv:
        return {}
    return {"uenv": cfg.environment.uenv, "view": str(cfg.environment.view)}


def slurm_parameters(cfg: JobConfig) -> dict[str, Any]:
    s = cfg.slurm
    delay = signal_delay(cfg)
    # The configured time-limit signal: submitit would write its own (USR2 unless the submitting
    # process had SUBMITIT_PREEMPT_SIGNAL set when it imported submitit).
    extra: dict[str, Any] = {"requeue": True, "signal": f"{cfg.requeue.signal}@{delay}"}
    for key in ("account", "qos", "reservation"):
        if getattr(s, key):
            extra[key] = getattr(s, key)
    if spare_nodes.in_use(cfg):
        extra["no_kill"] = True  # the allocation outlives a node's failure (spare_nodes)
    extra.update(uenv_parameters(cfg))
    extra.update({k: (True if v == "" else v) for k, v in s.extra.items()})
    params: dict[str, Any] = {
        "job_name": cfg.name,
        "time": max(1, math.ceil(s.time_minutes)),
        "nodes": spare_nodes.allocated_nodes(cfg),
        "ntasks_per_node": s.tasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "signal_delay_s": delay,
        "setup": setup_lines(cfg),
        "additional_parameters": extra,
        "srun_args": srun_arguments(cfg),
        "stderr_to_stdout": True,
        "wckey": None,  # submitit's default "submitit" would book every job to that accounting key
    }
    if s.partition:
        params["partition"] = s.partition
    if s.gpus_per_node and s.gpus_per_node % s.tasks_per_node == 0:
        # One GPU (or an equal share) bound to each task, as on Alps: --gpus-per-task
        params["gpus_per_task"] = s.gpus_per_node // s.tasks_per_node
    elif s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.mem:
        params["mem"] = s.mem
    if s.constraint:
        params["constraint"] = s.constraint
    return params


def slurm_unavailable() -> str | None:
    """Why SLURM cannot take a job here right now, or None (:func:`commands.unavailable`: one
    ``sinfo``, no retry; for reports)."""
    return commands.unavailable()


class _LocalExecutor(submitit.LocalExecutor):
    """submitit's local executor, with a controller that restarts a requeued task as often as the
    job asks (submitit's own stops after 6 starts: the quickstart on a slow machine needs more)."""

    def _submit_command(self, command: str) -> submitit.LocalJob[Any]:
        ntasks = self.parameters.get("tasks_per_node", 1)
        process = start_local_controller(
            self.folder, command, tasks=ntasks,
            cuda_devices=",".join(str(k) for k in range(self.parameters.get("gpus_per_node", 0))),
            timeout_min=self.parameters.get("timeout_min", 2.0), signal_delay_s=self.parameters.get("signal_delay_s", 30),
            stderr_to_stdout=True)
        return submitit.LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))


class _SlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor, whose batch script ``bash -n`` checks before sbatch (or --dry-run)
    gets it: a script that does not parse, or leaves the shell open at its end, would run nothing
    of the job and still end COMPLETED."""

    config_source = "<config>"
    in_job_restarts = 0
    spares = False  # slurm.spare_nodes: the restart loop places each restarted step (spare_nodes)
    gate = False  # health.gate: the restart loop runs the health gate before each step (health_gate)
    tag: str | None = None  # the job's --comment, "alpsck:<uuid>": how a lost sbatch answer is found again

    def _submit_command(self, command: str) -> submitit.Job[Any]:
        """submitit's own, with sbatch run through :mod:`commands` (retried while the controller is not
        reached) instead of once."""
        uid = uuid.uuid4().hex
        path = submitit.core.utils.JobPaths.get_first_id_independent_folder(self.folder) / f".submission_file_{uid}.sh"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self._make_submission_file_text(command, uid))
        answer = sbatch(path, self.tag)
        job_id = self._get_job_id_from_submission_command(answer.stdout)
        job: submitit.Job[Any] = self.job_class(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())))
        job.paths.move_temporary_file(path, "submission_file", keep_as_symlink=True)
        self._write_job_id(job.job_id, uid)
        self._set_job_permissions(job.paths.folder)
        return job

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        lines = text.split("\n")
        # submitit's template ends with "# command" and the job step's srun line (a setup line's text, quoted
        # in its eval block above, may hold a line that starts with srun too)
        after = next((i for i, line in enumerate(lines) if line == "# command"), 0)
        starts = [i for i, line in enumerate(lines) if i > after and line.startswith("srun ")]
        if len(starts) != 1:
            raise SlurmError(f"submitit's batch script has {len(starts)} srun lines, alpsck expects one")
        lines[starts[0]:starts[0] + 1] = restart_loop_lines(lines[starts[0]], self.in_job_restarts, spares=self.spares,
                                                            gate=self.gate)
        text = "\n".join(lines)
        why = shell_problem(text)
        if why is not None:
            raise ConfigError(f"{self.config_source}: environment.setup: the batch script with these lines does not "
                              f"parse: {why}")
        return text


def sbatch(script: Path, tag: str | None) -> commands.Answer:
    """``sbatch SCRIPT``, retried while the controller is not reached (:func:`commands.run`). After a
    failure that may have submitted the job all the same (its answer lost: "Socket timed out"), the
    queue is asked for a job whose comment is ``tag`` before sbatch runs again, so that one submit
    makes one job; without a tag (the config sets its own comment) such a failure is not retried."""

    def submitted_already(said: str) -> commands.Answer | None:
        if not commands.ambiguous(said):
            return None
        if tag is None:
            raise SlurmError(f"`sbatch {script}` failed: {said}; it may have submitted the job all the same (see "
                             "squeue --me), and without alpsck's tag in the job's comment (slurm.extra.comment is "
                             "set) alpsck cannot tell, so it does not try again")
        found = commands.squeue("--me", "-h", "-o", "%i|%k")
        job_id = next((i for i, _, k in (ln.partition("|") for ln in found.stdout.splitlines()) if k.strip() == tag), None)
        return None if job_id is None else commands.Answer(f"Submitted batch job {job_id.strip()}", "", 0)

    try:
        return commands.sbatch(str(script), before_retry=submitted_already)
    except SlurmError as e:
        raise SlurmError(f"sbatch refused the job: {e}") from None


class _ScriptOnlyExecutor(_SlurmExecutor):
    """A SlurmExecutor that only writes the script (--dry-run): it needs no ``srun`` here, where
    submitit's own refuses to start without one."""

    @classmethod
    def affinity(cls) -> int:
        return 1


def make_executor(cfg: JobConfig, local: bool, *, script_only: bool = False) -> submitit.Executor:
    folder = Path(cfg.run_dir) / "submitit"
    ex: submitit.Executor
    if local:
        ex = _LocalExecutor(folder=folder, max_num_timeout=cfg.requeue.max_restarts, python=job_python(local_python(cfg)))
        # gpus_per_node too: without it submitit hides every GPU (CUDA_VISIBLE_DEVICES="")
        ex.update_parameters(timeout_min=max(1, math.ceil(cfg.slurm.time_minutes)),
                             signal_delay_s=signal_delay(cfg), tasks_per_node=cfg.slurm.tasks_per_node,
                             gpus_per_node=cfg.slurm.gpus_per_node)
        return ex
    if not script_only and shutil.which("srun") is None:  # submitit's own error would be a traceback
        raise SlurmError("srun not found: the batch script starts the job's tasks with srun; submit where SLURM's "
                         "commands are installed, or use --local")
    cls = _ScriptOnlyExecutor if script_only else _SlurmExecutor
    # python goes into the job's command line as shell text (submitit quotes only its default)
    slurm_ex = cls(folder=folder, max_num_timeout=cfg.requeue.max_restarts, python=job_python(job_interpreter(cfg)))
    slurm_ex.config_source = cfg.source
    slurm_ex.in_job_restarts = cfg.requeue.in_job_restarts
    slurm_ex.spares, slurm_ex.gate = spare_nodes.in_use(cfg), cfg.health.gate
    params = slurm_parameters(cfg)
    if not script_only and "comment" not in params["additional_parameters"]:
        slurm_ex.tag = f"alpsck:{uuid.uuid4().hex}"
        params["additional_parameters"]["comment"] = slurm_ex.tag
    slurm_ex.update_parameters(**params)
    return slurm_ex


def sbatch_script(cfg: JobConfig) -> str:
    """The sbatch script ``submit`` would use (for --dry-run and golden tests); needs no SLURM here."""
    ex = make_executor(cfg, local=False, script_only=True)
    assert isinstance(ex, submitit.SlurmExecutor)
    return ex._make_submission_file_text(ex._submitit_command_str, uid="DRYRUN")


def submit(cfg: JobConfig, *, local: bool | None = None) -> submitit.Job[Any]:
    """Submit the job; ``local=None`` asks :func:`commands.backend` (SLURM wherever it is installed,
    SlurmError when its controller does not answer; the local executor only where none is)."""
    use_local = (commands.backend() == "local") if local is None else local
    if use_local and cfg.slurm.nodes * cfg.slurm.tasks_per_node > 1:
        raise UsageError(f"{cfg.source}: slurm.nodes x slurm.tasks_per_node is {cfg.slurm.nodes * cfg.slurm.tasks_per_node}: "
                         "a multi-task job needs SLURM (srun); the local executor runs one task")
    if not use_local:
        busy = watch.live_jobs(cfg.run_dir)  # None (no answer): the run dir's writer lock still guards it
        if busy:
            jobs = ", ".join(f"job {i} ({state})" for i, state in busy)
            raise SlurmError(f"{cfg.run_dir} is the run directory of {jobs}: a second job there would fight it for "
                             f"the checkpoints. Wait for it, scancel it, or give this job another run_dir")
    try:
        # Durably: the job's checkpoints go in it, and the Checkpointer, finding it there, syncs no parent.
        make_dirs_durably(Path(cfg.run_dir))
    except OSError as e:  # the config refused a file there; one may have appeared since
        raise ConfigError(f"{cfg.source}: run_dir: cannot make the run directory {cfg.run_dir}: {e.strerror}") from None
    if not Path(cfg.run_dir).is_dir():
        raise ConfigError(f"{cfg.source}: run_dir: {cfg.run_dir} exists and is not a directory")
    ex = make_executor(cfg, local=use_local)
    if use_local:
        for unused in local_unused(cfg):
            print(f"alpsck: warning: {cfg.source}: {unused}", file=sys.stderr, flush=True)
    for skipped in cfg.health.vetnode_skipped:
        print(f"alpsck: note: {cfg.source}: health.vetnode: {skipped}", file=sys.stderr, flush=True)
    # The local executor's controller is a child process that imports submitit afresh and sends
    # the signal it names: give it the configured one.
    saved = os.environ.get(PREEMPT_SIGNAL_ENV)
    os.environ[PREEMPT_SIGNAL_ENV] = cfg.requeue.signal
    try:
        job = ex.submit(JobRunner(cfg))
    except SlurmError as e:  # sbatch refused the job, or the controller never answered: its own words say why
        raise SlurmError(f"{cfg.source}: {e}") from None
    finally:
        if saved is None:
            os.environ.pop(PREEMPT_SIGNAL_ENV, None)
        else:
            os.environ[PREEMPT_SIGNAL_ENV] = saved
    history.append(cfg.run_dir, history.Submitted(job_id=str(job.job_id), backend="local" if use_local else "slurm",
                                                  config=cfg.source, name=cfg.name))
    return job
