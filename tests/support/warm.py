"""Start a worker script the way ``python script.py ARGS`` would, but forked from a server that imported torch
and alpsck once (a multiprocessing forkserver, one per test process): a rank then starts in milliseconds of
CPU instead of the 3-4 s of ``import torch``, which was most of what the several-ranks tier cost (the
16-rank test started 32 of them). What the script sees is the same: its own ``os.environ``, ``sys.argv``,
its directory first on ``sys.path``, ``__name__ == "__main__"``, one OMP thread unless told otherwise; its
output (stdout and stderr) goes to a file. :class:`WarmProcess` answers as ``subprocess.Popen`` does where the
tests use it (``poll``, ``wait``, ``returncode``, ``kill``, ``send_signal``, ``pid``)."""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # its exit handler (joins children) registered before ours: ours runs first
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

PRELOAD = ["torch", "torch.distributed", "alpsck", "alpsck.checkpointer", "alpsck.dcp"]
_CONTEXT: Any = None
_STARTED: list[WarmProcess] = []
"""Every warm process this test process started and has not seen end (:func:`kill_leftovers`)."""


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _main(script: str, argv: list[str], env: dict[str, str], output: str) -> None:
    """In the forked child: the script (or ``-m module``) as its own ``__main__``, its output to ``output``."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if script.startswith("-m"):  # as python -m: the module's name; its argv[0] becomes its file
        sys.argv = [script, *argv]
        runpy.run_module(script[2:], run_name="__main__", alter_sys=True)
        return
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


class _Child:
    """What a warm and a cold child share: its output file, and SIGKILL through its own ``send_signal``."""

    output: Path

    def send_signal(self, sig: int) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def read_output(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""


class WarmProcess(_Child):
    """``script`` with ``argv`` and ``env``, forked warm (module docstring); its output appended to ``output``.
    A ``script`` of ``-mNAME`` runs the module NAME, as ``python -m NAME`` would."""

    def __init__(self, script: str | os.PathLike[str], argv: list[str], env: dict[str, str],
                 output: str | os.PathLike[str]) -> None:
        self.output = Path(output)
        self.output.touch()  # there from the start, as a file a parent opens for Popen: tests poll it at once
        self._p = _context().Process(target=_main, args=(str(script), list(argv), dict(env), str(output)))
        self._p.start()
        self.pid = self._p.pid
        _STARTED.append(self)

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"{self._p.name}", timeout or 0)
        return int(self._p.exitcode)

    def send_signal(self, sig: int) -> None:
        if self._p.exitcode is None:
            os.kill(self.pid, sig)


class ColdProcess(_Child):
    """``argv`` as a plain child process, answering as :class:`WarmProcess` does: for a rank that must start
    under a wrapper (``setpriv`` dropping root's permission bypass), which a fork cannot be."""

    def __init__(self, argv: list[str], env: dict[str, str], output: str | os.PathLike[str]) -> None:
        self.output = Path(output)
        with open(self.output, "a") as out:
            self._p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.pid = self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.returncode

    def poll(self) -> int | None:
        return self._p.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._p.wait(timeout)

    def send_signal(self, sig: int) -> None:
        if self._p.poll() is None:
            self._p.send_signal(sig)


def kill_leftovers() -> list[int]:
    """SIGKILL every warm process still running, wait for each, and return their pids. A test that failed
    before it waited for its ranks leaves them running (a rank in a save loop runs forever), and
    multiprocessing joins its children at exit: the test process would hang instead of failing. The
    tests' conftest.py calls this after every test; atexit, once more."""
    killed = [p.pid for p in _STARTED if p.returncode is None]
    for p in _STARTED:
        p.kill()
    for p in _STARTED:
        p._p.join(30)
    _STARTED[:] = [p for p in _STARTED if p.returncode is None]
    return killed


atexit.register(kill_leftovers)  # after multiprocessing.util's exit handler (imported above): runs before it
