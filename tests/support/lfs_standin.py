#!/usr/bin/env python3
"""A stand-in for Lustre's ``lfs`` command (Lustre cannot run on a test machine).

It answers the four calls alpsck makes (``getstripe -d [--raw] DIR``, ``setstripe OPTIONS DIR``,
``quota -q -u UID PATH``, ``df PATH``) in the formats of Lustre 2.15, from a JSON state file, and
records every call, so the tests run alpsck's real code path (``shutil.which("lfs")``, the argument
list, the parsing of the answers) against it. Installed by the tests as ``lfs`` on PATH.

Environment: ``LFS_STANDIN_STATE`` (JSON: ``layouts`` {dir: [setstripe options]}, ``quota``
[kbytes, kquota, klimit, files, fquota, flimit] or absent, ``osts`` [free KiB, ...]),
``LFS_STANDIN_LOG`` (one JSON argument list per line).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _load() -> dict:
    p = Path(os.environ["LFS_STANDIN_STATE"])
    return json.loads(p.read_text()) if p.exists() else {}


def _store(state: dict) -> None:
    Path(os.environ["LFS_STANDIN_STATE"]).write_text(json.dumps(state))


def _getstripe(args: list[str], state: dict) -> int:
    raw = "--raw" in args or "-R" in args
    target = os.path.realpath(args[-1])
    layout = state.get("layouts", {}).get(target)
    if layout is None:
        if raw:
            print("stripe_count:  0 stripe_size:   0 pattern:       0 stripe_offset: -1")
        else:
            print("stripe_count:  1 stripe_size:   1048576 pattern:       0 stripe_offset: -1")
        return 0
    if "-E" in layout:
        print(f"  lcm_layout_gen:    0\n  lcm_mirror_count:  1\n  lcm_entry_count:   {layout.count('-E')}")
        print("    components: " + " ".join(layout))
    else:
        count = layout[layout.index("-c") + 1] if "-c" in layout else "1"
        print(f"stripe_count:  {count} stripe_size:   4194304 pattern:       raid0 stripe_offset: -1")
    return 0


def _setstripe(args: list[str], state: dict) -> int:
    options, target = args[:-1], os.path.realpath(args[-1])
    if not options or not os.path.isdir(target):
        print(f"lfs setstripe: cannot set layout on '{args[-1]}': Invalid argument", file=sys.stderr)
        return 22
    for o in options[0::2]:  # each option takes a value (-E -1: to the end of the file)
        if o not in ("-E", "-c", "-S", "-i", "-p", "--stripe-count", "--stripe-size"):
            print(f"lfs setstripe: unrecognized option '{o}'", file=sys.stderr)
            return 22
    state.setdefault("layouts", {})[target] = options
    _store(state)
    return 0


def _quota(args: list[str], state: dict) -> int:
    q = state.get("quota")
    if q is None:
        q = [0, 0, 0, 0, 0, 0]
    kbytes, kquota, klimit, files, fquota, flimit = q
    # A long mount point goes on a line of its own, the numbers on the next (as lfs prints it).
    print(f"{os.path.realpath(args[-1])}\n {kbytes} {kquota} {klimit} - {files} {fquota} {flimit} -")
    return 0


def _df(args: list[str], state: dict) -> int:
    print("UUID                   1K-blocks        Used   Available Use% Mounted on")
    print("scratch-MDT0000_UUID    1000000000      1000  999999000   1% /scratch[MDT:0]")
    for i, free in enumerate(state.get("osts", [])):
        print(f"scratch-OST{i:04x}_UUID  {free + 1000} 1000 {free}  1% /scratch[OST:{i}]")
    print("\nfilesystem_summary:  0 0 0 0% /scratch")
    return 0


def main(argv: list[str]) -> int:
    with open(os.environ["LFS_STANDIN_LOG"], "a") as log:
        log.write(json.dumps(argv) + "\n")
    state = _load()
    commands = {"getstripe": _getstripe, "setstripe": _setstripe, "quota": _quota, "df": _df}
    if not argv or argv[0] not in commands:
        print(f"lfs: unknown command {argv[:1]}", file=sys.stderr)
        return 1
    return commands[argv[0]](argv[1:], state)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
