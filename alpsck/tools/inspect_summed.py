"""``inspect-checkpoints DIR`` on a directory written through ``alpsck://`` (:mod:`alpsck.store.summed`): every
file with its size and what its checksum says. Without ``--verify`` each file's size is compared with its
sidecar's; with it every byte is read and its CRC32C checked. A file without a sidecar (written some other way,
or its write interrupted before the sidecar) is listed as such. Exit 1 when any file fails."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from ..out import jsonout
from ..out.textout import printable
from ..store import summed
from .progress import human

URL_PREFIX = "alpsck://"


def is_summed_dir(path: Path) -> bool:
    """Whether ``path`` is a directory some file of which was written through ``alpsck://``."""
    try:
        return path.is_dir() and any(summed.is_sidecar(n) for n in os.listdir(path))
    except OSError:
        return False


def _row(root: Path, path: Path, verify: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"file": str(path.relative_to(root)), "bytes": None, "status": "ok", "error": None}
    try:
        want, _crc = summed.read_sum(path)
        row["bytes"] = want
        if verify:
            summed.verify_file(path)
        elif (have := path.stat().st_size) != want:
            raise CorruptCheckpointError(f"{path}: {have} bytes, its checksum file says {want}")
        else:
            row["status"] = "size ok"
    except FileNotFoundError:
        row.update(status="missing", error=f"{path}: its checksum file is there, the file is not")
    except CorruptCheckpointError as e:
        row.update(status="corrupt", error=str(e))
    return row


def summed_listing(directory: str, verify: bool, as_json: bool) -> int:
    root = Path(directory)
    with_sums, without = summed.survey(root)
    rows = [_row(root, p, verify) for p in with_sums]
    rows += [{"file": str(p.relative_to(root)), "bytes": p.stat().st_size, "status": "no checksum",
              "error": f"{p}: no checksum beside it (not written through alpsck://, or its write was interrupted)"}
             for p in without]
    rows.sort(key=lambda r: r["file"])
    bad = [r for r in rows if r["status"] not in ("ok", "size ok")]
    if as_json:
        print(jsonout.dumps({"summed": True, "verified": verify, "ok": not bad, "files": rows}))
    else:
        print(f"{directory}: files written through alpsck:// (each with its CRC32C)")
        print(f"{'status':<12} {'size':>10}  file")
        for r in rows:
            size = human(r["bytes"]) if r["bytes"] is not None else "-"
            print(f"{r['status']:<12} {size:>10}  {printable(r['file'])}")
        for r in bad:
            print(printable(r["error"]))
        total = sum(r["bytes"] or 0 for r in rows)
        what = "every byte read, every CRC32C matches" if verify else "sizes match (--verify reads every byte)"
        print(f"{len(rows)} file(s), {human(total)}: " + (what if not bad else f"{len(bad)} bad"))
    return 1 if bad else 0
