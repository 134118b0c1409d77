"""The memory tier: where a run's checkpoints in node memory live, and how its engine is set.

A memory checkpoint is a checkpoint like any other (manifest, shards, CRC32C: the same format, the same
commit, the one picker and verifier), written by a second engine into a directory in node shared memory
(``/dev/shm``, a tmpfs), so that it outlives a crash of the training process but costs no file-system
write. On Alps ``/dev/shm`` is wiped after every job: the tier serves restarts inside an allocation,
and a requeued job reads the run directory (docs/memory-tier.md).

The directory is named after the run directory's identity, not only its path: a random number kept in
the run directory (``.run-id``, :func:`run_token`) and the run directory's real path, so that a run
directory removed and made again under the same name (a new run; its inode may well be the old one's)
never restores the old run's snapshots, and a copy of a run directory is another run. ``ALPSCK_MEMORY_ROOT``
names another root than ``/dev/shm`` (tests; a node-local NVMe).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .durable import read_small, replace_durably
from .names import RUN_ID_NAME

ROOT_ENV = "ALPSCK_MEMORY_ROOT"
NODE_ENV = "ALPSCK_NODE"  # the node a process counts as (tests stand several nodes up on one machine)
_TOKEN_MASK = (1 << 62) - 1  # a token travels between ranks as an int64
DEFAULT_ROOT = "/dev/shm"
TIERS = ("run_dir", "memory")
"""Where a save goes (``Checkpointer.save(tier=...)``)."""

# The memory engine keeps one checkpoint and writes one more at a time: own + one in flight per node (the
# issue's budget; the replica comes on top). Buffered writes: a tmpfs refuses O_DIRECT, and fsync is free there.
# No preallocation: on a tmpfs it zeroes every page of a shard inside save() (the stall was 2.9x a plain copy).
ENGINE_OVERRIDES: dict[str, Any] = {"keep_last": 1, "max_in_flight": 1, "keep_every_steps": 0,
                                    "keep_every_seconds": 0.0, "keep_best": "", "direct_io": False,
                                    "preallocate": False}


def memory_root() -> Path:
    """The directory the memory tier's run directories are made in (``$ALPSCK_MEMORY_ROOT``, else /dev/shm)."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def run_token(run_dir: Path) -> int:
    """The run directory's identity (module docstring): the number in ``RUN_DIR/.run-id``, made there when it
    is missing or not one (a symlink, another file, garbage: a new identity only makes the memory tier's
    snapshots unreachable, never wrong). Called by the run directory's writer, which holds its lock."""
    try:
        token = _stored_token(run_dir)
        if token is not None:
            return token
    except OSError:  # missing, not a regular file, unreadable: a new one replaces it
        pass
    token = secrets.randbits(62)
    replace_durably(run_dir / RUN_ID_NAME, f"{token:016x}\n".encode())
    return token


def _stored_token(run_dir: Path) -> int | None:
    """The number in ``RUN_DIR/.run-id`` (None: not one); OSError where there is no such regular file."""
    text = read_small(run_dir / RUN_ID_NAME, 64, follow=False).decode("ascii", "replace").strip()
    return int(text, 16) & _TOKEN_MASK if re.fullmatch(r"[0-9a-f]{16}", text) else None


def existing_memory_dir(run_dir: Path) -> tuple[bool, Path | None]:
    """For a reader (nothing is made): whether the run ever opened a memory tier (its ``.run-id``), and its memory
    directory on this node where one exists."""
    try:
        token = _stored_token(run_dir)
    except OSError:
        return False, None
    found = memory_dir_for(run_dir, token) if token is not None else None
    return True, found if found is not None and found.is_dir() and not found.is_symlink() else None


def memory_dir_for(run_dir: str | os.PathLike[str], token: int) -> Path:
    """The memory tier's directory for ``run_dir`` whose identity is ``token`` (:func:`run_token`):
    ``ROOT/alpsck-UID/NAME-HASH``, the hash over the token and the run directory's real path."""
    real = os.path.realpath(run_dir)
    digest = hashlib.sha256(f"{token:016x}\0{real}".encode("utf-8", "surrogateescape")).hexdigest()[:20]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(real))[:40] or "run"
    return memory_root() / f"alpsck-{os.getuid()}" / f"{name}-{digest}"


def engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The memory engine's options: the run directory's, with its retention and I/O mode (ENGINE_OVERRIDES)."""
    return {**options, **ENGINE_OVERRIDES}


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise UsageError(f"tier: {tier!r}: use one of {', '.join(TIERS)}")
    return tier


def node_name() -> str:
    """The node this process runs on: its host name, or ``$ALPSCK_NODE`` (tests)."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def host_key() -> int:
    """This node's name as a 62-bit number, for the ranks to compare (every rank on one node: one memory)."""
    return int.from_bytes(hashlib.sha256(node_name().encode()).digest()[:8], "big") >> 2


def group_dir_name(ranks: list[int]) -> str:
    """The directory, inside a run's memory directory, of the checkpoints of the ranks one node runs
    (``ranks-FIRST-LAST``): the node's own copy and, on the next node, its replica, under the same name, so a
    node that takes over those ranks (a spare, a restart in another order) finds them by name."""
    return f"ranks-{ranks[0]:05d}-{ranks[-1]:05d}"


FETCHED_PREFIX = "fetched-"  # a copy another node sent for a restore here (removed once restored)
