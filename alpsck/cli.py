"""The ``alpsck`` command line (also ``python -m alpsck``).

Each command family lives in its own module with a ``register(subparsers)`` function that adds
its subcommands and sets ``func`` (args -> exit code); this file only assembles and dispatches.
Errors of the AlpsckError family print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

from .errors import AlpsckError

# Modules that contribute subcommands.
COMMAND_MODULES = (
    "alpsck.tools.inspect_checkpoints",  # inspect-checkpoints
    "alpsck.tools.prune",                # prune, pin, unpin
    "alpsck.tools.export",               # export
    "alpsck.tools.promote",              # promote
    "alpsck.tools.import_dcp",           # import-dcp
    "alpsck.bench.cli",                  # bench
    "alpsck.slurm.cli",                  # submit, status
    "alpsck.tools.doctor",               # doctor
    "alpsck.tools.plot",                 # plot
)


def version_line() -> str:
    """``alpsck --version``: the package, the checkpoint format it writes, the CPU tuning the core was
    built with (``neoverse-v2`` or ``portable``), and what the core chose here."""
    from . import __version__, _core

    return (f"alpsck {__version__} (writes {_core.checkpoint_format}; core tuning: {_core.build_info()['tuning']}; "
            f"crc32c: {_core.crc32c_backend()}; page size {_core.page_size()})")


def build_parser() -> argparse.ArgumentParser:
    # Raw: argparse would wrap the --version line at the terminal's width (it is one line, for grep).
    p = argparse.ArgumentParser(prog="alpsck", description="Checkpoint-and-requeue toolkit for PyTorch on SLURM.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
