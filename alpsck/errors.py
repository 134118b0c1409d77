"""The alpsck exception hierarchy.

Every error alpsck raises on purpose derives from :class:`AlpsckError`, so callers can catch
one type. Engine (C++) errors are turned into these classes in exactly one place, the
binding's ``RaiseStatus`` (``cpp/python/module.cc``), by the engine's status code.
"""

from __future__ import annotations


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
