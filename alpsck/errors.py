"""The alpsck exception hierarchy.

Every error alpsck raises on purpose derives from :class:`AlpsckError`, so callers can catch
one type. Engine (C++) errors are turned into these classes in exactly one place, the
binding's ``RaiseStatus`` (``cpp/python/binding.cc``), by the engine's status code.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType


class AlpsckError(Exception):
    """Base class of every error alpsck raises on purpose."""


class ConfigError(AlpsckError, ValueError):
    """A configuration value is missing, misspelt or of the wrong type; the message names the key."""


class CheckpointError(AlpsckError):
    """A checkpoint could not be written, committed or read."""


class CheckpointIOError(CheckpointError, OSError):
    """A file-system call failed while reading or scanning checkpoints (``errno`` is set)."""


class CheckpointWriteError(CheckpointIOError):
    """Writing or committing a checkpoint failed (I/O error); earlier checkpoints are untouched."""


class DiskFullError(CheckpointWriteError):
    """The file system ran out of space (ENOSPC/EDQUOT) while saving; earlier checkpoints are untouched."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification (size, footer, index or CRC mismatch, bad manifest)."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint's tree holds something alpsck refuses to decode (unknown tag, class name, ...)."""


class NoCheckpointError(CheckpointError):
    """No valid checkpoint exists where one was required."""


class StateMismatchError(CheckpointError, ValueError):
    """A saved tensor does not fit the live object it is restored into (shape or dtype); names the tensor."""


class RollbackLimitError(CheckpointError):
    """The training's loss went bad again after ``max_rollbacks`` in-process rollbacks
    (:class:`alpsck.restore.Rollback`): retrying will not help, so the job must not be requeued."""


class RunDirLockedError(AlpsckError):
    """Another live process (job id and host named in the message) holds the run directory."""


class UsageError(AlpsckError, ValueError):
    """An API was called with arguments it cannot accept (bad names, sizes, options)."""


class StateTypeError(UsageError, TypeError):
    """The state holds something alpsck cannot checkpoint: a value of an unknown type, a tensor of
    another layout, device or dtype, a key that is not a string. The message names where."""


class SlurmError(AlpsckError):
    """A SLURM command failed or SLURM is not reachable."""


class TorchMissingError(AlpsckError, ImportError):
    """torch is not installed and alpsck's training side (``alpsck.Checkpointer``, a job's entry) was
    reached; the command line runs without torch. The message is the one line of :data:`MISSING_TORCH`
    (:func:`torch_required`, :func:`import_needing_torch`). An ``ImportError`` too, so ``except
    ImportError`` still catches it."""


ECHO_CHARS = 80  # how much of a value an error message quotes


def echo(value: object, limit: int = ECHO_CHARS, *, quoted: bool = True) -> str:
    """``repr(value)`` (``str`` with ``quoted=False``, for a key) for an error message, cut to
    ``limit`` characters: a long value (a 1 MB string in a config) shows its start and its size,
    ``'aaaa…' (1048576 bytes)``, never itself whole. Every config error quotes values through it."""
    text = repr(value) if quoted else str(value)
    if len(text) <= limit:
        return text
    size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else \
        len(value) if isinstance(value, (bytes, bytearray)) else len(text)
    unit = "bytes" if isinstance(value, (str, bytes, bytearray)) else "characters"
    return f"{text[:limit]}… ({size} {unit})"


# ----------------------------------------------------------------------------- torch, missing
# alpsck's command line (submit, status, cancel, doctor, --help) runs without torch, on a login node;
# the training side (alpsck.Checkpointer, the job that runs a training) needs it. This is the one place
# that says so: where that side is reached without torch, TorchMissingError with MISSING_TORCH (inside
# a command, the command line prints it as `alpsck: error: ...`, exit 2). A torch that is installed but
# fails to import (a broken CUDA library, say) is never reported as missing: that error goes up as it is.

TORCH_PIN = "2.13.0"  # what the README's set-up and CI install (the CPU wheel; an unpinned torch pulls CUDA)

MISSING_TORCH = (f"alpsck's training side needs torch; install torch (pip install torch=={TORCH_PIN}, "
                 "or use a uenv/container that has it)")


def torch_missing(what: str | None = None) -> TorchMissingError:
    """The error to raise where ``what`` (``alpsck.Checkpointer``, a job's entry) needs torch."""
    return TorchMissingError(f"{what}: {MISSING_TORCH}" if what else MISSING_TORCH, name="torch")


def _is_torch_missing(e: ImportError) -> bool:
    # Only torch itself: without torch, `import torch.nn` fails on "torch" too; a missing torch.something
    # beside an installed torch (a build without it) is another error, raised as it is.
    return isinstance(e, ModuleNotFoundError) and e.name == "torch"


def import_needing_torch(module: str, what: str | None = None) -> ModuleType:
    """Import ``module`` (an alpsck module that imports torch at its top); a torch that is not
    installed becomes :class:`TorchMissingError` naming ``what``."""
    with torch_required(what or module):
        return importlib.import_module(module)


@contextmanager
def torch_required(what: str) -> Iterator[None]:
    """Run the block (an import, a job's entry); a torch that is not installed, imported anywhere
    inside it, becomes :class:`TorchMissingError` naming ``what``: one line."""
    try:
        yield
    except ImportError as e:
        if _is_torch_missing(e):
            raise torch_missing(what) from None
        raise
