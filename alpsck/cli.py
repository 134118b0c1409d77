"""The ``alpsck`` command line (also ``python -m alpsck``).

Each command family lives in its own module with a ``register(subparsers)`` function that adds
its subcommands and sets ``func`` (args -> exit code); this file only assembles and dispatches.
Errors of the AlpsckError family print one line and exit 2; so does a command line argparse refuses
(:class:`Parser`: the error in one line, then a line naming ``--help``, never the usage block).
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from .errors import AlpsckError

# Modules that contribute subcommands.
COMMAND_MODULES = (
    "alpsck.tools.inspect_checkpoints",  # inspect-checkpoints
    "alpsck.tools.prune",                # prune, pin, unpin
    "alpsck.tools.export",               # export
    "alpsck.tools.promote",              # promote
    "alpsck.tools.import_dcp",           # import-dcp
    "alpsck.bench.cli",                  # bench
    "alpsck.slurm.cli",                  # submit, status, cancel
    "alpsck.tools.doctor",               # doctor
    "alpsck.tools.plot",                 # plot
)


def version_line() -> str:
    """``alpsck --version``: the package, the checkpoint format it writes, the CPU tuning the core was
    built with (``neoverse-v2`` or ``portable``), and what the core chose here."""
    from . import __version__, _core

    return (f"alpsck {__version__} (writes {_core.checkpoint_format}; core tuning: {_core.build_info()['tuning']}; "
            f"crc32c: {_core.crc32c_backend()}; page size {_core.page_size()})")


class Parser(argparse.ArgumentParser):
    """The parser of ``alpsck`` and of every subcommand (``parser_class`` of the subparsers): a command
    line it refuses (an unknown flag, a missing argument, a bad value) is one line on stderr,
    ``alpsck prune: error: ...``, then one naming ``--help``, and exit 2, as every other error of
    the command line (docs/tools.md). argparse's own prints the whole usage block first."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())  # one line, whatever the message holds
        self.exit(2, f"{self.prog}: error: {text}\n{self.prog}: see '{self.prog} --help'\n")


def build_parser() -> Parser:
    # Raw: argparse would wrap the --version line at the terminal's width (it is one line, for grep).
    p = Parser(prog="alpsck", description="Checkpoint-and-requeue toolkit for PyTorch on SLURM.",
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with an argument no parser knows blamed on the subcommand it was given
    to (argparse's top parser reports it as its own: ``alpsck: error: unrecognized arguments``)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        subcommands = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
        owner = subcommands.get(str(getattr(args, "command", "")), parser)
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):
        # A path or name that is not UTF-8 (a surrogate-escaped str) is printed as the bytes it was, not as a
        # UnicodeEncodeError from a strict locale's stream (en_US.UTF-8, as on Alps' login nodes).
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="surrogateescape")
    args = parse_args(build_parser(), argv)
    try:
        rc = int(args.func(args))
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return rc
    except AlpsckError as e:
        print(f"alpsck: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`alpsck status RUN | head`): stop quietly, as a tool killed by
        # SIGPIPE would, and keep Python from complaining when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as e:
        # A file system refusal no command turned into its own message (a read-only mount, EIO):
        # one line, and exit 2, never 1, which --verify uses for "corruption found".
        where = f"{e.filename}: " if e.filename else ""
        print(f"alpsck: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("alpsck: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
