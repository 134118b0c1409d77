"""The file system under a run directory: what a path lies on (:func:`kind`, statfs), asked before any
Lustre call. Alps' scratch is Lustre (Capstor, Iopsstor) or VAST over NFS (Ritom), and home is NFS.

Beside it: :mod:`alpsck.store.lustre` (on Lustre, its layout, quota and targets through ``lfs``),
:mod:`alpsck.store.preflight` (whether the checkpoints to come fit), :mod:`alpsck.store.storage` (which of
Alps' storage a path is on, and its purge).

``ALPSCK_FS_KIND`` (``lustre``, ``nfs`` or any other name) overrides what ``statfs`` says: for a
file system it misreports (a bind or FUSE mount of Lustre), and for the tests, which run the same
code against a stand-in ``lfs`` (Lustre cannot run on a test machine).
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import _core

KIND_ENV = "ALPSCK_FS_KIND"
# statfs f_type values (linux/magic.h and the file systems' own headers).
_MAGIC = {0x0BD00BD0: "lustre", 0x6969: "nfs", 0xEF53: "ext4", 0x58465342: "xfs", 0x01021994: "tmpfs",
          0x794C7630: "overlay", 0x9123683E: "btrfs", 0x65735546: "fuse", 0x2FC12FC1: "zfs", 0x47504653: "gpfs",
          0x858458F6: "ramfs", 0xFF534D42: "cifs", 0xFE534D42: "smb2", 0x00C36400: "ceph"}


def kind(path: str | os.PathLike[str]) -> str:
    """What the file system holding ``path`` (or its nearest existing parent) is: ``lustre``,
    ``nfs``, ``ext4``, ... or its statfs magic in hex; ``ALPSCK_FS_KIND`` overrides it."""
    forced = os.environ.get(KIND_ENV, "").strip()
    if forced:
        return forced.lower()
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    magic = int(_core.fs_magic(str(p)))
    return _MAGIC.get(magic, f"0x{magic:x}")
