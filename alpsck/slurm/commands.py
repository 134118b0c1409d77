"""Every SLURM command alpsck runs, on the submitting side and inside the job: one timeout, one retry
rule, one error. No other module runs a SLURM command (tests/unit/test_vocabulary.py checks).

A busy controller answers "Socket timed out on send/recv operation" or refuses connections for a
while; a transient failure must never turn into a wrong decision (on Alps, a job run on the login
node). So:

- :func:`run` runs one command (an argument list, never a shell) with a per-call timeout
  (:data:`CALL_TIMEOUT_S`). A read (``sinfo``, ``squeue``, ``sacct``, ``scontrol show``) is retried
  on any failure, with backoff, for up to :func:`retry_budget` seconds (30 by default,
  ``ALPSCK_SLURM_RETRY_SECONDS``); then :class:`SlurmError` names the command, how often it was
  tried over how long, and its last words.
- An action (``sbatch``, ``scancel``) is retried only while its error says the controller was not
  reached or did not answer (:func:`transient`); a refusal ("Invalid account") fails at once.
- Inside the job a question must not hold up the training or its stop: the job side's calls
  (:func:`scontrol`, :func:`scontrol_requeue`) make one try (``budget=0``) under their own timeout,
  under the same rule. ``ALPSCK_NO_SCONTROL=1`` hides scontrol from the job (as inside an Alps
  container without SLURM's commands mounted): :func:`scontrol_hidden` is the one reader of it.
- :func:`backend` decides where ``alpsck submit`` runs a job: ``slurm`` wherever ``sbatch`` is
  installed (a controller that does not answer within the budget is an error, never a reason to
  run the job here), ``local`` only where no SLURM is installed at all.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import SlurmError

RETRY_ENV = "ALPSCK_SLURM_RETRY_SECONDS"
DEFAULT_RETRY_S = 30.0
CALL_TIMEOUT_S = 20.0
REPORT_TIMEOUT_S = 30.0   # sacct, asked once by a report (status) about a job that has ended
REQUEUE_TIMEOUT_S = 60.0  # scontrol requeue from inside the job
VERSION_TIMEOUT_S = 10.0  # a probe of whether a command runs at all (doctor)
NO_SCONTROL_ENV = "ALPSCK_NO_SCONTROL"
_FIRST_PAUSE_S = 1.0
_MAX_PAUSE_S = 8.0

# Words of SLURM's client errors that mean the request did not reach the controller, or its answer
# did not come back: worth another try. Anything else (a refusal) is the controller's answer.
_TRANSIENT = re.compile(
    r"socket timed out|unable to contact slurm controller|connection refused|connection timed out|"
    r"resource temporarily unavailable|transport endpoint is not connected|zero bytes were transmitted|"
    r"communication connection failure|slurm_persist_conn|backup controller in standby|"
    r"temporarily unavailable|try again|did not answer within", re.IGNORECASE)
# Of those, the ones after which an sbatch may have been accepted although its answer was lost.
_AMBIGUOUS = re.compile(r"socket timed out|zero bytes were transmitted|did not answer within", re.IGNORECASE)

NOT_INSTALLED = "sbatch not found"


def retry_budget() -> float:
    """Seconds a failing SLURM command is retried for (``ALPSCK_SLURM_RETRY_SECONDS``, default 30)."""
    raw = os.environ.get(RETRY_ENV, "").strip()
    if not raw:
        return DEFAULT_RETRY_S
    try:
        value = float(raw)
    except ValueError:
        raise SlurmError(f"{RETRY_ENV}={raw!r}: must be a number of seconds (0 .. 3600)") from None
    if not 0 <= value <= 3600:
        raise SlurmError(f"{RETRY_ENV}={raw!r}: must be a number of seconds (0 .. 3600)")
    return value


def transient(said: str) -> bool:
    """Whether a SLURM client's error text means the controller was not reached or did not answer."""
    return _TRANSIENT.search(said) is not None


def ambiguous(said: str) -> bool:
    """Whether an ``sbatch`` that failed so may still have submitted its job."""
    return _AMBIGUOUS.search(said) is not None


@dataclass(frozen=True)
class Answer:
    """What one SLURM command printed, and how often it was tried."""

    stdout: str
    stderr: str
    tries: int


def _last_words(stdout: str, stderr: str, code: int) -> str:
    lines = [ln.strip() for ln in (stderr or stdout).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {code}, no output"


def once(argv: Sequence[str], timeout: float = VERSION_TIMEOUT_S) -> tuple[int, str, str]:
    """One try of a command, never raising: its exit code (-1: no answer within ``timeout``; -2: it cannot
    run at all), stdout and stderr (then the reason, as stderr's last line; after a timeout, what it printed
    before). For probes that report how a command fails (doctor, the health gate's srun)."""
    def text(x: str | bytes | None) -> str:
        return x.decode(errors="backslashreplace") if isinstance(x, bytes) else (x or "")

    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, errors="backslashreplace", timeout=timeout,
                           stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as e:
        before = text(e.stderr).rstrip("\n")
        reason = f"{argv[0]} did not answer within {timeout:.0f} s"
        return -1, text(e.stdout), f"{before}\n{reason}" if before else reason
    except OSError as e:
        return -2, "", f"{argv[0]}: {e.strerror or e}"
    return r.returncode, r.stdout, r.stderr


def run(argv: Sequence[str], *, read: bool, budget: float | None = None, timeout: float = CALL_TIMEOUT_S,
        accept: Callable[[int, str, str], bool] | None = None,
        before_retry: Callable[[str], Answer | None] | None = None,
        sleep: Callable[[float], None] = time.sleep) -> Answer:
    """Run one SLURM command under the retry rule of this module (``read``: retried on any failure;
    else only on :func:`transient` errors). ``accept(code, stdout, stderr)`` says which answers are
    success (default: exit 0). ``before_retry(last_words)``, for an action, may find that the failed
    try took effect after all and return its answer instead of trying again. SlurmError, naming the
    command, the tries and its last words, when no try succeeds within the budget."""
    limit = retry_budget() if budget is None else budget
    started = time.monotonic()
    pause = _FIRST_PAUSE_S
    tries = 0
    while True:
        tries += 1
        code, out, err = once(argv, timeout)
        if (accept(code, out, err) if accept is not None else code == 0):
            return Answer(out, err, tries)
        said = _last_words(out, err, code)
        if code == -2:  # the command cannot be run at all: no retry mends that
            raise SlurmError(f"`{shlex.join(argv)}` cannot run: {said}")
        elapsed = time.monotonic() - started
        worth = read or transient(said)
        if not worth or elapsed + pause > limit:
            how = f" ({tries} tries over {elapsed:.0f} s)" if tries > 1 else ""
            raise SlurmError(f"`{shlex.join(argv)}` failed{how}: {said}")
        sleep(pause)
        if before_retry is not None:
            found = before_retry(said)
            if found is not None:
                return Answer(found.stdout, found.stderr, tries)
        pause = min(pause * 2, _MAX_PAUSE_S)


def installed() -> bool:
    """Whether SLURM's client commands are installed here (``sbatch`` on the PATH)."""
    return shutil.which("sbatch") is not None


def backend(*, budget: float | None = None) -> str:
    """Where ``alpsck submit`` sends a job: ``slurm`` where sbatch is installed and a controller
    answers ``sinfo`` within the retry budget; ``local`` where no SLURM is installed. SlurmError
    where SLURM is installed and its controller does not answer: a job is never run on the
    submitting host (on Alps, a login node) because of a controller's bad minute."""
    if not installed():
        return "local"
    try:
        run(["sinfo", "-h", "-o", "%P"], read=True, budget=budget)
    except SlurmError as e:
        raise SlurmError(f"{e}. SLURM is installed here, so the job is not run on this host: try again when the "
                         "controller answers, or pass --local to run it here on purpose") from None
    return "slurm"


def unavailable() -> str | None:
    """Why SLURM cannot take a job here right now, or None when it can (one ``sinfo``, no retry):
    for reports (``status``, ``doctor``) that must not wait."""
    if not installed():
        return NOT_INSTALLED
    try:
        run(["sinfo", "-h", "-o", "%P"], read=True, budget=0)
    except SlurmError as e:
        return f"no SLURM controller answers ({e})"
    return None


# -- the commands, by name ------------------------------------------------------------------------------


def squeue(*args: str, budget: float | None = None, accept: Callable[[int, str, str], bool] | None = None) -> Answer:
    """``squeue ARGS`` (a read: retried for ``budget`` seconds)."""
    return run(["squeue", *args], read=True, budget=budget, accept=accept)


def sbatch(script: str, before_retry: Callable[[str], Answer | None] | None = None) -> Answer:
    """``sbatch SCRIPT`` (an action: retried on transient errors only; see :func:`run`'s ``before_retry``)."""
    return run(["sbatch", script], read=False, before_retry=before_retry)


def scancel(job_id: str) -> Answer:
    """``scancel JOB`` (an action)."""
    return run(["scancel", job_id], read=False)


def sacct(*args: str) -> Answer:
    """``sacct ARGS``, one try (a report about a job that has ended must not wait)."""
    return run(["sacct", *args], read=True, budget=0, timeout=REPORT_TIMEOUT_S)


def scontrol_hidden() -> bool:
    """Whether ``ALPSCK_NO_SCONTROL=1`` hides scontrol from the job (the one reader of that variable)."""
    return os.environ.get(NO_SCONTROL_ENV) == "1"


def scontrol_available() -> bool:
    """Whether the job can ask scontrol: on the PATH, and not hidden (:func:`scontrol_hidden`)."""
    return not scontrol_hidden() and shutil.which("scontrol") is not None


def scontrol(args: Sequence[str], timeout: float = CALL_TIMEOUT_S) -> str:
    """stdout of ``scontrol ARGS`` from inside the job: one try; SlurmError when it fails."""
    return run(["scontrol", *args], read=True, budget=0, timeout=timeout).stdout


def scontrol_requeue(job_id: str, timeout: float = REQUEUE_TIMEOUT_S) -> None:
    """``scontrol requeue JOB`` from inside the job, one try; SlurmError when it fails.

    SLURM answers a successful requeue by signalling every process of the job's steps with
    SIGTERM, scontrol itself included, often before scontrol has exited: seen as a requeue that
    "died with SIGTERM" although it took effect. scontrol therefore runs with SIGTERM ignored
    (a disposition exec keeps), as the batch script's own requeue does. The job id is an
    argument of the shell, never part of its text."""
    run(["/bin/sh", "-c", 'trap "" TERM; exec scontrol requeue "$1"', "alpsck-requeue", job_id], read=False, budget=0,
        timeout=timeout)


def partition_nodes(partition: str, budget: float = 10.0) -> list[str]:
    """The nodes of ``partition`` (the default partition when empty), as ``sinfo -N`` lists them (a read)."""
    return run(["sinfo", "-h", "-N", "-o", "%N", *(["-p", partition] if partition else [])], read=True,
               budget=budget).stdout.split()


def srun_gather(args: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """``srun ARGS`` run once to gather what its tasks print (the health gate's probe): :func:`once`'s exit code,
    stdout (what the tasks printed before ``timeout`` too, when srun is killed then) and stderr. Not retried: a
    task that does not answer is the finding."""
    return once(["srun", *args], timeout)
