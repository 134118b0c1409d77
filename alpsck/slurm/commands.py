"""SLURM's commands as the submitting side runs them: one timeout, one retry rule, one error.

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


def _once(argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, errors="backslashreplace", timeout=timeout,
                           stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return -1, "", f"{argv[0]} did not answer within {timeout:.0f} s"
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
        code, out, err = _once(argv, timeout)
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
