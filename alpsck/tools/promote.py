"""``alpsck promote``: a checkpoint copied to a persistent store, every CRC checked again after the copy.

``alpsck promote RUN_DIR DEST [--step N]`` copies the newest valid checkpoint of RUN_DIR (or step
N) into DEST, which becomes (or already is) a run directory holding ``DEST/step-N`` with the same
files. Scratch on Alps is purged (30 days without access on Capstor, 14 on Iopsstor; ``alpsck
status`` warns before); a project or store directory is not.

The source is verified first (every chunk CRC; without ``--step`` a corrupt one is skipped for the
one before, as restore does). The copy is written into DEST under the attempt name of the
run-directory unit (``step-N.tmp``), each file fsync'ed, renamed to ``step-N`` and DEST fsync'ed:
DEST never shows half a checkpoint. Then the copy is read back and every CRC checked again; one
that does not verify is removed and the command fails (exit 2). A ``step-N`` already in DEST is
never replaced. Only regular files are copied: a symlink in the checkpoint is refused, never
followed. DEST takes the run directory's writer lock for the copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import CorruptCheckpointError, NoCheckpointError, UsageError
from ..options import arg_step
from ..out import jsonout
from ..store.durable import fsync_path, make_dirs_durably
from ..store.lock import writer_lock
from ..store.picker import pick
from ..store.scan import check_run_dir, remove_entries
from .progress import human

_BUFFER = 16 << 20


def _copy_file(src: Path, dst: Path) -> int:
    """One file, never through a symlink; fsync'ed. Returns its size."""
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            n = 0
            while chunk := os.read(fd_in, _BUFFER):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd_out, view):]
                n += len(chunk)
            os.fsync(fd_out)
            return n
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def promote(run_dir: str, dest: str, step: int | None = None, as_json: bool = False) -> int:
    """``alpsck promote``: see the module docstring. Returns 0; failures raise (exit 2). ``as_json``: one
    document on stdout (:func:`promote_checkpoint`'s) in place of the line."""
    r = promote_checkpoint(run_dir, dest, step)
    if as_json:
        print(jsonout.dumps(r))
    else:
        print(f"promoted step {r['step']}: {r['source']} -> {r['path']} ({human(r['bytes'])}), every chunk CRC verified "
              "after the copy")
    return 0


def promote_checkpoint(run_dir: str, dest: str, step: int | None = None) -> dict[str, Any]:
    """Copy one checkpoint into ``dest`` (see the module docstring) and return what was done:
    ``{"run_dir", "source", "dest", "path", "step", "files", "bytes", "verified", "skipped"}``: the
    checkpoint directory copied, DEST, the copy (``DEST/step-N``), its regular files and their bytes,
    ``verified`` (always true: a copy that does not verify raises), and each newer step passed over with
    why (``{"step", "path", "reason", "message"}``)."""
    src_dir = check_run_dir(run_dir)
    out = Path(dest)
    if out.resolve() == src_dir.resolve():
        raise UsageError(f"{dest}: that is the run directory itself; promote copies to another directory")
    picked = pick(src_dir, step=step, verify_data=True)
    if picked.info is None:
        if step is not None and not any(i["step"] == step for i in picked.scanned):
            raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}")
        why = picked.why_not()
        raise CorruptCheckpointError(f"{run_dir}: no valid checkpoint to promote" + (f" ({why})" if why else ""))
    for k in picked.skipped:
        if not k.quiet:
            print(f"alpsck: warning: {k.warning()}", file=sys.stderr)
    files = 0
    info = picked.info
    s = int(info["step"])
    source = Path(info["path"])
    make_dirs_durably(out)
    with writer_lock(out):
        final = out / _core.step_dir_name(s)
        if os.path.lexists(final):
            raise UsageError(f"{final} exists already: promote never replaces a checkpoint")
        tmp = out / _core.tmp_dir_name(s)
        if os.path.lexists(tmp):  # an interrupted promote (or save) left it: the unit removes it
            _, error = remove_entries(out, [tmp.name])
            if error is not None:
                raise CorruptCheckpointError(f"{tmp}: left by an interrupted copy and cannot be removed: {error}")
        os.mkdir(tmp)
        total = 0
        try:
            for entry in sorted(os.scandir(source), key=lambda e: e.name):
                if not entry.is_file(follow_symlinks=False):
                    raise CorruptCheckpointError(f"{entry.path}: not a regular file; a checkpoint holds only regular "
                                                 "files, and promote never follows a link")
                total += _copy_file(Path(entry.path), tmp / entry.name)
                files += 1
            fsync_path(tmp)
            os.rename(tmp, final)
            fsync_path(out)
        except BaseException:
            remove_entries(out, [tmp.name])
            raise
        copied = next((i for i in _core.scan(str(out), verify=True) if i["step"] == s and i["path"] == str(final)),
                      None)
        if copied is None or copied["status"] != "committed" or not copied["verified"]:
            remove_entries(out, [final.name])
            why = "not found" if copied is None else f"{copied['status']}: {copied['error']}"
            raise CorruptCheckpointError(f"{final}: the copy did not verify ({why}); it was removed")
    return {"run_dir": str(run_dir), "source": str(source), "dest": str(dest), "path": str(final), "step": s,
            "files": files, "bytes": total, "verified": True, "skipped": [dataclasses.asdict(k) for k in picked.skipped]}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pr = sub.add_parser(
        "promote", help="copy a checkpoint to a persistent store (out of a purged scratch) and verify the copy",
        description="Copy the newest valid checkpoint of RUN_DIR (or --step N) into DEST/step-N: the source "
                    "verified first, the copy fsync'ed, committed by a rename, then read back and every CRC checked "
                    "again. DEST is a run directory afterwards (restore, inspect-checkpoints, export work on it).")
    pr.add_argument("run_dir")
    pr.add_argument("dest")
    pr.add_argument("--step", type=arg_step, help="promote this checkpoint (default: the newest valid one)")
    pr.add_argument("--json", action="store_true",
                    help="print one JSON document: the checkpoint copied (source, step), the copy (path), its files "
                         "and bytes")
    pr.set_defaults(func=lambda a: promote(a.run_dir, a.dest, a.step, a.json))
