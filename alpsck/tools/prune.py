"""``alpsck prune``, ``alpsck pin`` and ``alpsck unpin``: housekeeping of a run directory.

``prune RUN_DIR --keep-last K [--keep-every-steps N] [--keep-every-seconds S] [--keep-best METRIC:MODE:K]
[--dry-run] [--verify]`` removes the committed checkpoints that no retention rule keeps (the engine's
own rule, ``cpp/core/retention.h`` through :mod:`alpsck.store.retention`: the newest K, the newest
healthy one, pinned ones, milestones, one per interval, the best K by a metric; ``--dry-run`` prints
every decision and the rules behind it), abandoned ``step-N.tmp`` directories, expired ``free-*`` and
``superseded-*`` directories (and ``.deleting-*`` leftovers of an interrupted prune). Corrupt checkpoints
and manifest-less ``step-N`` directories (never committed) older than the newest valid checkpoint are
removed; newer ones are kept (with a warning) for inspection. Unreadable ones (permission denied, EIO,
ESTALE) are never removed. The checkpoints kept are always verified to the last byte first (``--verify``
verifies every checkpoint), so the newest valid checkpoint is never removed. It refuses to run while
``RUN_DIR/.lock`` names a live process (see :func:`lock_holder`). The run-directory unit removes them
(``store.scan.remove_entries``, ``RemoveEntries`` in cpp/core/run_dir_actions.h, the same unit as the engine's
retention): each is first renamed to ``.deleting-<name>`` (atomic expiry: the checkpoint disappears from
scans at once), the run directory is fsync'ed, then the files are deleted without following a symlink,
so a prune killed anywhere leaves every checkpoint it kept restorable (the next prune finishes it).

``--keep-last 0`` keeps every committed checkpoint (the engine's ``keep_last 0``, "keep all"; another
``--keep-*`` rule beside it is refused by name, as the core refuses it); the leftovers above still go.
``--json`` prints one document saying what was done (:func:`prune_document`).

``pin RUN_DIR STEP`` / ``unpin RUN_DIR STEP``: :func:`alpsck.store.retention.pin`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from .. import _core
from ..errors import (
    RunDirLockedError,
    UsageError,
)
from ..options import SPECS, arg_int
from ..out import jsonout
from ..out.textout import printable
from ..store.lock import lock_holder, writer_lock
from ..store.names import entry_kind, is_text
from ..store.picker import data_error
from ..store.retention import PIN_NAME, RULES, Policy, decide, pin, unpin
from ..store.scan import check_run_dir, dir_bytes, remove_entries, scan_run_dir
from .progress import human


@dataclasses.dataclass
class PrunePlan:
    """What a prune does: the entries it removes and the checkpoints it keeps, each with its reason."""

    remove: list[tuple[Path, str]]
    keep: list[tuple[Path, str]]  # the committed checkpoints kept, with the rules that keep them
    warnings: list[str]
    kept_steps: list[int]
    # Entries kept that are not committed checkpoints (corrupt or damaged newer ones, unreadable ones, a pinned
    # superseded directory): path, status, why.
    spared: list[tuple[Path, str, str]] = dataclasses.field(default_factory=list)


def plan_prune(run_dir: Path, policy: Policy, verify: bool = False) -> PrunePlan:
    """What :func:`prune` would do — nothing is touched.

    The committed checkpoints kept are the retention rule's (:func:`alpsck.store.retention.decide`, the
    engine's own rule) over the valid ones, and each one kept is checked to the last byte whatever
    ``verify`` says: the quick scan sees sizes, footers and manifests only, and trusting it could
    remove every good checkpoint while keeping one whose data is corrupt. One that fails counts as
    corrupt (or unreadable) and the rule decides again without it. ``verify`` checks every checkpoint.
    """
    check_run_dir(run_dir)
    infos = scan_run_dir(run_dir, verify=verify)
    checked: set[str] = set()
    while True:
        valid = [i for i in infos if i["status"] == "committed"]
        rules = decide(policy, valid)
        unchecked = [i for i in valid if rules[i["step"]] and not i["verified"] and i["path"] not in checked]
        if not unchecked:
            break
        for i in unchecked:
            checked.add(i["path"])
            bad = data_error(i)
            if bad is not None:
                i["status"] = "corrupt" if bad.reason == "data_crc" else "unreadable"
                i["error"] = bad.message
    kept_steps = sorted(s for s, why in rules.items() if why)
    newest_valid = max(kept_steps) if kept_steps else None
    plan = PrunePlan([], [], [], kept_steps)
    for i in infos:
        p = Path(i["path"])
        if i["status"] == "committed":
            why = rules[i["step"]]
            if why:
                plan.keep.append((p, why))
            else:
                sick = f", unhealthy: {i['unhealthy']}" if i.get("unhealthy") else ""
                plan.remove.append((p, f"committed step {i['step']}: no rule keeps it{sick}"))
        elif i["status"] == "unreadable":  # maybe intact: never removed on an access error
            plan.warnings.append(f"kept unreadable checkpoint {p} (fix its access and run prune again): {i['error']}")
            plan.spared.append((p, "unreadable", f"never removed on an access error: {i['error']}"))
        elif i["status"] == "incomplete" and entry_kind(p.name) != "step":  # an attempt: in flight, abandoned or aborted
            plan.remove.append((p, f"incomplete step {i['step']}: {i['error']}"))
        elif newest_valid is not None and i["step"] < newest_valid:
            plan.remove.append((p, f"{i['status']} step {i['step']}: {i['error']}"))
        else:  # corrupt, or a step-N without MANIFEST.json: kept, like a newer corrupt one
            why = "newer than the newest valid one" if newest_valid is not None else "no valid checkpoint exists"
            what = "corrupt checkpoint" if i["status"] == "corrupt" else "damaged checkpoint"
            plan.warnings.append(f"kept {what} {p} ({why}) for inspection: {i['error']}")
            plan.spared.append((p, str(i["status"]), f"{why}, kept for inspection: {i['error']}"))
    for n in sorted(os.listdir(run_dir)):
        p = run_dir / n
        kind = entry_kind(n)
        if kind in ("free", "free-pending") and p.is_dir() and not p.is_symlink():
            plan.remove.append((p, "expired (free-*) directory"))
        elif kind == "superseded" and p.is_dir() and not p.is_symlink():
            if (p / PIN_NAME).exists():  # a pin outlives its history: moved aside, never deleted
                plan.warnings.append(f"kept pinned {p} (a checkpoint of an abandoned history; alpsck unpin releases "
                                     "it only while it is a step-N: remove its PINNED file to let prune remove it)")
                plan.spared.append((p, "superseded", "pinned (a checkpoint of an abandoned history)"))
            else:
                plan.remove.append((p, "superseded (abandoned history)"))
        elif kind == "deleting" and (p.is_dir() or p.is_file()) and not p.is_symlink():
            plan.remove.append((p, "left over by an interrupted prune"))
    return plan


def prune_policy(keep_last: int, keep_every_steps: int = 0, keep_every_seconds: float = 0.0,
                 keep_best: str = "") -> Policy:
    """The policy of ``prune``'s options, refused in one line naming the option (UsageError): ``--keep-last 0``
    keeps all, and another ``--keep-*`` rule beside it is moot (the core's CheckRetention says which);
    a ``--keep-best`` that is not UTF-8 text (a metric is named in printable ASCII) never reaches the core."""
    if not is_text(keep_best):
        raise UsageError(f"--keep-best: {printable(keep_best, 80)} holds bytes that are not UTF-8; a metric is named "
                         "in printable ASCII (METRIC:min|max:K)")
    try:
        return Policy(keep_last, keep_every_steps, keep_every_seconds, keep_best)
    except UsageError as e:  # the core names its options (keep_every_steps); here they are command-line options
        said = str(e)
        for rule in RULES:
            said = said.replace(rule, "--" + rule.replace("_", "-"))
        raise UsageError(said) from None


def _entry(p: Path, why: str, size: int) -> dict[str, Any]:
    kind, step, _ = _core.parse_run_dir_name(p.name)
    return {"path": str(p), "name": p.name, "kind": str(kind),
            "step": int(step) if kind in ("step", "attempt", "aborted", "superseded") else None,
            "bytes": size, "reason": why}


def prune_document(path: Path, policy: Policy, plan: PrunePlan, sizes: dict[Path, int], *, dry_run: bool,
                   verify: bool, removed: list[int] | None = None, error: str | None = None) -> dict[str, Any]:
    """``prune --json``: what was done (or, ``dry_run``, what would be), as one document.

    ``run_dir``, ``dry_run``, ``verify``; ``policy`` (the four rules and ``text``, as the text output
    writes it); ``kept``: each entry kept, ``{"path", "name", "step", "status", "rules", "reason"}`` (a
    committed checkpoint with the rules that keep it, or a corrupt, damaged, unreadable or pinned
    superseded one kept with why, ``rules`` empty); ``kept_steps``; ``removed`` (empty in a dry run) and
    ``would_remove`` (only in a dry run): ``{"path", "name", "kind", "step", "bytes", "reason"}``;
    ``freed_bytes`` / ``would_free_bytes``; ``warnings``; ``error``: why the removal stopped, or null.
    """
    kept: list[dict[str, Any]] = []
    for p, why in plan.keep:
        kept.append({"path": str(p), "name": p.name, "step": int(_core.parse_run_dir_name(p.name)[1]),
                     "status": "committed", "rules": why.split(", "), "reason": why})
    for p, status, why in plan.spared:
        kind, step, _ = _core.parse_run_dir_name(p.name)
        kept.append({"path": str(p), "name": p.name, "step": int(step) if kind != "other" else None, "status": status,
                     "rules": [], "reason": why})
    entries = [_entry(p, why, sizes.get(p, 0)) for p, why in plan.remove]
    gone = [entries[i] for i in (removed or [])]
    return {
        "run_dir": str(path),
        "dry_run": dry_run,
        "verify": verify,
        "policy": {**dataclasses.asdict(policy), "text": policy.describe()},
        "kept": kept,
        "kept_steps": plan.kept_steps,
        "removed": [] if dry_run else gone,
        "would_remove": entries if dry_run else [],
        "freed_bytes": 0 if dry_run else sum(e["bytes"] for e in gone),
        "would_free_bytes": sum(e["bytes"] for e in entries) if dry_run else 0,
        "warnings": plan.warnings,
        "error": error,
    }


def prune(run_dir: str, policy: Policy, dry_run: bool = False, verify: bool = False, as_json: bool = False) -> int:
    """``alpsck prune``: see the module docstring. Exit 0; refusals raise (exit 2). ``as_json``: one
    document on stdout (:func:`prune_document`) in place of the lines; a removal that fails part-way
    prints it (with ``error``) before it raises."""
    if policy.keep_last < 0:
        raise UsageError(f"--keep-last must be 0 (keep all) or more, not {policy.keep_last}")
    path = check_run_dir(run_dir)
    holder = lock_holder(path)
    if holder is not None:
        raise RunDirLockedError(f"not pruning {run_dir}: {holder}")
    with contextlib.nullcontext() if dry_run else writer_lock(path):
        plan = plan_prune(path, policy, verify)
        for w in plan.warnings:
            print(f"alpsck: warning: {w}", file=sys.stderr)
        sizes = {p: dir_bytes(p) for p, _ in plan.remove}
        kept = ", ".join(map(str, plan.kept_steps)) or "none"
        if dry_run:
            if as_json:
                print(jsonout.dumps(prune_document(path, policy, plan, sizes, dry_run=True, verify=verify)))
                return 0
            print(f"policy: {policy.describe()}")
            for p, why in plan.keep:
                print(f"keep {p}: {why}")
            for p, why in plan.remove:
                print(f"would remove {p} ({human(sizes[p])}): {why}")
            print(f"dry run: would free {human(sum(sizes.values()))}; keeping step(s) {kept}")
            return 0
        if not as_json:
            print(f"policy: {policy.describe()}")
        # The run-directory unit removes them: renamed to .deleting-* first (atomic expiry), RUN_DIR
        # fsync'ed, then deleted without following a symlink (run_dir_actions.h, RemoveEntries).
        removed, error = remove_entries(path, [p.name for p, _ in plan.remove])
        if as_json:
            print(jsonout.dumps(prune_document(path, policy, plan, sizes, dry_run=False, verify=verify,
                                               removed=removed, error=None if error is None else str(error))))
            if error is not None:
                raise error
            return 0
        freed = 0
        for i in removed:
            p, why = plan.remove[i]
            freed += sizes.get(p, 0)
            print(f"removed {p} ({human(sizes.get(p, 0))}): {why}")
        if error is not None:
            raise error
        print(f"freed {human(freed)}; keeping step(s) {kept}")
    return 0


def _pin(args: argparse.Namespace) -> int:
    (pin if args.func_name == "pin" else unpin)(args.run_dir, args.step)
    print(f"{'pinned' if args.func_name == 'pin' else 'unpinned'} step {args.step} of {args.run_dir}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    pr = sub.add_parser(
        "prune", help="remove old checkpoints, abandoned .tmp, expired free-* and superseded-* directories",
        description="Remove the committed checkpoints no retention rule keeps (the engine's rules: the newest K, "
                    "the newest healthy one, pinned ones, and the --keep-every-*/--keep-best ones; "
                    "docs/retention.md), incomplete step-N.tmp directories, free-* directories, superseded-* "
                    "directories (an abandoned history, never restored), and corrupt or never committed (no "
                    "MANIFEST.json) checkpoints older than the newest valid one (newer ones are kept for "
                    "inspection; unreadable ones are never removed). Refuses while RUN_DIR/.lock names a live "
                    "process.")
    pr.add_argument("run_dir")
    pr.add_argument("--keep-last", type=arg_int(0), required=True, metavar="K",
                    help="committed checkpoints to keep; 0 keeps all (then no other --keep-* rule)")
    pr.add_argument("--keep-every-steps", type=arg_int(0), default=0, metavar="N", help=SPECS["keep_every_steps"]["doc"])
    pr.add_argument("--keep-every-seconds", type=float, default=0.0, metavar="S", help=SPECS["keep_every_seconds"]["doc"])
    pr.add_argument("--keep-best", default="", metavar="METRIC:MODE:K", help=SPECS["keep_best"]["doc"])
    pr.add_argument("--dry-run", action="store_true",
                    help="print each decision and the rule behind it; remove nothing")
    pr.add_argument("--verify", action="store_true",
                    help="check every checkpoint's CRCs, not only those of the checkpoints kept (which are always "
                         "checked)")
    pr.add_argument("--json", action="store_true",
                    help="print one JSON document: the policy, each entry kept with its rules, each removed (or, with "
                         "--dry-run, that would be) with its reason")
    pr.set_defaults(func=lambda a: prune(a.run_dir, prune_policy(a.keep_last, a.keep_every_steps, a.keep_every_seconds,
                                                                 a.keep_best), a.dry_run, a.verify, a.json))
    for name, what in (("pin", "pin a checkpoint: no retention rule (the engine's, prune's) ever removes it"),
                       ("unpin", "release a pin")):
        pp = sub.add_parser(name, help=what, description=what.capitalize() + ". A pin is the file PINNED in the "
                            "checkpoint's directory, written durably; a running job's engine sees it before it "
                            "would expire the checkpoint.")
        pp.add_argument("run_dir")
        pp.add_argument("step", type=arg_int(0))
        pp.set_defaults(func=_pin, func_name=name)
