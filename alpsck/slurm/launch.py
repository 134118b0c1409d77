"""How a job's Python starts: the installed alpsck, never a source tree in the working directory.

submitit starts every task as ``PYTHON -u -m submitit.core._submit FOLDER``. With ``-m``, Python
puts the working directory first on ``sys.path``, and the job runs in the directory ``alpsck
submit`` was run from: from a checkout of alpsck (the README's own quickstart) the job then
unpickles its runner from the source tree's ``alpsck/``, which has no compiled ``_core``, and dies
at import. ``job_python`` gives submitit an interpreter command that drops that entry first, then
runs the module submitit names, on every Python we support (``-P``/``PYTHONSAFEPATH`` exist only
from 3.11; ``-I`` would also drop the user's PYTHONPATH). The user's own modules are found again
by the runner (:func:`user_paths`), after alpsck is imported.

The local executor's controller is started here too (:func:`start_local_controller`): submitit's
own restarts a task at most 6 times, whatever the job asks; the runner's budget decides instead.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# Python source run with ``-c``, one line (it sits in the batch script's srun line); its argv is
# what submitit appended: ``-u -m MODULE ARGS...``. It drops sys.path[0] (the working directory),
# then runs MODULE as ``-m`` would.
# It also records the stop signals (USR1, USR2, TERM) that come before the runner's handlers exist:
# submitit unpickles the runner, which imports torch, for a few seconds first, and a signal's
# default action there ends the job (FAILED, no requeue). The runner's StopController takes them in
# (EARLY_SIGNALS, a list of (signal number, unix time) on the sys module).
EARLY_SIGNALS = "_alpsck_early_signals"
_BOOTSTRAP = ('import runpy, signal, sys, time; del sys.path[0]; '
              f'E = sys.{EARLY_SIGNALS} = []; '
              '[signal.signal(s, lambda n, f: E.append((n, time.time()))) '
              'for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)]; '
              'a = sys.argv[1:]; a = a[1:] if a[:1] == ["-u"] else a; '
              '(a[:1] == ["-m"] and len(a) > 1) or sys.exit("alpsck job launcher: expected -m MODULE ARGS"); '
              'sys.argv = a[1:]; runpy.run_module(a[1], run_name="__main__", alter_sys=True)')


def job_python(python: str) -> str:
    """Shell words for submitit's ``python=``: ``python`` (already shell words) that starts the
    module submitit appends with the working directory off ``sys.path``."""
    return f"{python} -u -c {shlex.quote(_BOOTSTRAP)}"


def user_paths(config_dir: str | None, workdir: str) -> list[str]:
    """Where the job looks for the user's own modules (``entry.function: mytrain:main``), first:
    the directory the job runs in (the one ``alpsck submit`` ran in, as ``python mytrain.py``
    would), then the config file's directory."""
    out: list[str] = []
    for d in (workdir, config_dir):
        if d and d not in out:
            out.append(d)
    return out


# How many times the local controller may start a task: in effect unbounded. The runner ends a
# job that makes no progress (requeue.max_restarts, give_up_after_no_progress).
LOCAL_MAX_STARTS = 100_000

# SIGINT ends the controller and its tasks (submitit's LocalJob.cancel, ``alpsck cancel``): its handler is
# set here because a submit run in the background of a non-interactive shell (``alpsck submit ... &``) hands
# its children SIGINT ignored, and Python then never raises KeyboardInterrupt.
_CONTROLLER = (
    "import signal, sys\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "del sys.path[0]\n"
    "from pathlib import Path\n"
    "from submitit.local.local import Controller\n"
    "Controller(Path(sys.argv[1])).run(max_retry=int(sys.argv[2]))\n"
)


def start_local_controller(folder: Path, command: str, *, tasks: int, cuda_devices: str, timeout_min: float,
                           signal_delay_s: int, stderr_to_stdout: bool) -> subprocess.Popen[bytes]:
    """submitit's ``start_controller`` with ``run(max_retry=LOCAL_MAX_STARTS)``: the same
    SUBMITIT_LOCAL_* environment (its controller reads it), no shell (so the controller's pid is
    the job id, as submitit's LocalJob expects)."""
    env = dict(os.environ)
    env.update(
        SUBMITIT_LOCAL_NTASKS=str(tasks),
        SUBMITIT_LOCAL_COMMAND=command,
        SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * timeout_min)),
        SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(signal_delay_s)),
        SUBMITIT_LOCAL_NODEID="0",
        SUBMITIT_LOCAL_JOB_NUM_NODES="1",
        SUBMITIT_STDERR_TO_STDOUT="1" if stderr_to_stdout else "",
        SUBMITIT_EXECUTOR="local",
        CUDA_VISIBLE_DEVICES=cuda_devices,
        SUBMITIT_LOCAL_WITH_SHELL="",
    )
    return subprocess.Popen([sys.executable, "-c", _CONTROLLER, str(folder), str(LOCAL_MAX_STARTS)], env=env)
