"""``alpsck prune``: housekeeping of a run directory.

``prune RUN_DIR --keep-last K [--dry-run] [--verify]`` removes committed checkpoints beyond the
newest K, abandoned ``step-N.tmp`` directories, expired ``free-*`` and ``superseded-*`` directories
(and ``.deleting-*`` leftovers of an interrupted prune). Corrupt checkpoints and manifest-less
``step-N`` directories (never committed) older than the newest valid checkpoint are removed; newer
ones are kept (with a warning) for inspection.
Unreadable ones (permission denied, EIO, ESTALE) are never removed.
The checkpoints kept are always verified to the last byte first (``--verify`` verifies every
checkpoint), so the newest valid checkpoint is never removed. It refuses to run while ``RUN_DIR/.lock`` names a live
process (see :func:`lock_holder`). The run-directory unit removes them (``store.run_dir.remove_entries``,
``RemoveEntries`` in cpp/core/run_dir.h, the same unit as the engine's retention): each is first
renamed to ``.deleting-<name>`` (atomic expiry: the checkpoint disappears from scans at once), the
run directory is fsync'ed, then the files are deleted without following a symlink.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..errors import (
    RunDirLockedError,
    UsageError,
)
from ..options import arg_int
from ..store.run_dir import (
    check_run_dir,
    dir_bytes,
    entry_kind,
    lock_holder,
    pick,
    remove_entries,
    writer_lock,
)
from .progress import human


def plan_prune(run_dir: Path, keep_last: int, verify: bool = False) -> tuple[list[tuple[Path, str]], list[str], list[int]]:
    """(directories to remove with the reason, warnings, steps kept) — nothing is touched.

    The checkpoints kept are checked to the last byte whatever ``verify`` says: the quick scan
    sees sizes, footers and manifests only, and trusting it could remove every good checkpoint
    while keeping one whose data is corrupt. They are what the picker (:func:`alpsck.store.run_dir.pick`,
    data verified) picks, then picks below that, until ``keep_last``; one that fails counts as corrupt.
    ``verify`` verifies every checkpoint, including those removed.
    """
    # The kept ones are the picker's (store.run_dir.pick, any kind), data verified: its pick, then its pick
    # below that, ... With ``verify`` one pick verifies everything, and its candidates are the verified ones.
    check_run_dir(run_dir)
    picked = pick(run_dir, verify_all=verify, verify_data=True)
    infos = [dict(i) for i in picked.scanned]
    by_path = {i["path"]: i for i in infos}
    kept_steps: set[int] = set()
    while True:
        for k in picked.skipped:  # its data check failed: listed as a verifying scan lists it
            if k.reason in ("data_crc", "unreadable") and k.path in by_path:
                by_path[k.path]["status"] = "corrupt" if k.reason == "data_crc" else "unreadable"
                by_path[k.path]["error"] = k.message
        if verify:
            kept_steps.update(int(c["step"]) for c in picked.candidates[:keep_last])
            break
        if picked.step is None:
            break
        kept_steps.add(picked.step)
        if len(kept_steps) == keep_last or picked.step == 0:
            break
        picked = pick(run_dir, verify_data=True, max_step=picked.step - 1)
    newest_valid = max(kept_steps) if kept_steps else None
    # Unhealthy checkpoints (a NaN or infinite metric: the picker's rule 5b): never counted among the kept ones;
    # the newer ones are kept for inspection, like a newer corrupt one, the older ones removed.
    unhealthy = {str(i["path"]): f"its metrics are not finite ({i['unhealthy']})" for i in infos
                 if i["status"] == "committed" and i.get("unhealthy")}
    remove: list[tuple[Path, str]] = []
    warnings: list[str] = []
    for i in infos:
        p = Path(i["path"])
        if i["status"] == "committed":
            if i["path"] in unhealthy and (newest_valid is None or i["step"] > newest_valid):
                warnings.append(f"kept unhealthy checkpoint {p} (newer than the newest healthy one) for inspection: "
                                f"{unhealthy[i['path']]}")
            elif i["path"] in unhealthy:
                remove.append((p, f"unhealthy step {i['step']}: {unhealthy[i['path']]}"))
            elif i["step"] not in kept_steps:
                remove.append((p, f"committed step {i['step']}, beyond the newest {keep_last}"))
        elif i["status"] == "unreadable":  # maybe intact: never removed on an access error
            warnings.append(f"kept unreadable checkpoint {p} (fix its access and run prune again): {i['error']}")
        elif i["status"] == "incomplete" and entry_kind(p.name) != "step":  # an attempt: in flight, abandoned or aborted
            remove.append((p, f"incomplete step {i['step']}: {i['error']}"))
        elif newest_valid is not None and i["step"] < newest_valid:
            remove.append((p, f"{i['status']} step {i['step']}: {i['error']}"))
        else:  # corrupt, or a step-N without MANIFEST.json: kept, like a newer corrupt one
            why = "newer than the newest valid one" if newest_valid is not None else "no valid checkpoint exists"
            what = "corrupt checkpoint" if i["status"] == "corrupt" else "damaged checkpoint"
            warnings.append(f"kept {what} {p} ({why}) for inspection: {i['error']}")
    names = sorted(os.listdir(run_dir))
    for n in names:
        p = run_dir / n
        kind = entry_kind(n)
        if kind in ("free", "free-pending") and p.is_dir() and not p.is_symlink():
            remove.append((p, "expired (free-*) directory"))
        elif kind == "superseded" and p.is_dir() and not p.is_symlink():
            remove.append((p, "superseded (abandoned history)"))
        elif kind == "deleting" and (p.is_dir() or p.is_file()) and not p.is_symlink():
            remove.append((p, "left over by an interrupted prune"))
    return remove, warnings, sorted(kept_steps)


def prune(run_dir: str, keep_last: int, dry_run: bool = False, verify: bool = False) -> int:
    """``alpsck prune``: see the module docstring. Exit 0; refusals raise (exit 2)."""
    if keep_last < 1:
        raise UsageError(f"--keep-last must be at least 1 (the newest valid checkpoint is always kept), not {keep_last}")
    path = check_run_dir(run_dir)
    holder = lock_holder(path)
    if holder is not None:
        raise RunDirLockedError(f"not pruning {run_dir}: {holder}")
    with contextlib.nullcontext() if dry_run else writer_lock(path):
        remove, warnings, kept = plan_prune(path, keep_last, verify)
        for w in warnings:
            print(f"alpsck: warning: {w}", file=sys.stderr)
        sizes = {p: dir_bytes(p) for p, _ in remove}
        if dry_run:
            for p, why in remove:
                print(f"would remove {p} ({human(sizes[p])}): {why}")
            print(f"dry run: would free {human(sum(sizes.values()))}; keeping step(s) {', '.join(map(str, kept)) or 'none'}")
            return 0
        # The run-directory unit removes them: renamed to .deleting-* first (atomic expiry), RUN_DIR
        # fsync'ed, then deleted without following a symlink (run_dir.h, RemoveEntries).
        removed, error = remove_entries(path, [p.name for p, _ in remove])
        freed = 0
        for i in removed:
            p, why = remove[i]
            freed += sizes.get(p, 0)
            print(f"removed {p} ({human(sizes.get(p, 0))}): {why}")
        if error is not None:
            raise error
        print(f"freed {human(freed)}; keeping step(s) {', '.join(map(str, kept)) or 'none'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pr = sub.add_parser(
        "prune", help="remove old checkpoints, abandoned .tmp, expired free-* and superseded-* directories",
        description="Remove committed checkpoints beyond the newest K, incomplete step-N.tmp directories, free-* "
                    "directories, superseded-* directories (an abandoned history, never restored), and corrupt or "
                    "never committed (no MANIFEST.json) checkpoints older than the newest valid one (newer ones are "
                    "kept for inspection; unreadable ones are never removed). Refuses while RUN_DIR/.lock names a live "
                    "process.")
    pr.add_argument("run_dir")
    pr.add_argument("--keep-last", type=arg_int(1), required=True, metavar="K", help="committed checkpoints to keep (K >= 1)")
    pr.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    pr.add_argument("--verify", action="store_true",
                    help="check every checkpoint's CRCs, not only those of the checkpoints kept (which are always "
                         "checked)")
    pr.set_defaults(func=lambda a: prune(a.run_dir, a.keep_last, a.dry_run, a.verify))
