"""``alpsck import-dcp``: convert DCP FileSystemWriter checkpoints into alpsck ones (alpsck.dcp.convert)."""

from __future__ import annotations

import argparse


def run(target: str, trust_pickle: bool, delete_original: bool) -> int:
    from ..dcp.convert import Converted, import_dcp

    def report(c: Converted) -> None:
        kept = f"; original kept at {c.original} (rm -r it when done)" if c.original is not None else ""
        print(f"{c.path}: {c.action}{f' ({c.detail})' if c.detail else ''}{kept}", flush=True)

    done = import_dcp(target, trust_pickle=trust_pickle, delete_original=delete_original, report=report)
    if not done:
        print(f"{target}: no step-N checkpoint here")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "import-dcp", help="convert DCP FileSystemWriter checkpoints (step-N) into alpsck ones, in place",
        description="Convert the FileSystemWriter checkpoint PATH (folder/step-N), or every step-N in the folder "
                    "PATH, into an alpsck DCP checkpoint under the same name, so a torchtitan run goes on with "
                    "AlpsckStorageReader/Writer. alpsck checkpoints are skipped. Each is loaded in this process, "
                    "saved with alpsck, read back and compared bit for bit, then swapped in; the original is kept "
                    "in folder/.alpsck-import/ unless --delete-original. Converting unpickles the checkpoint "
                    "(.metadata and non-tensor values), which runs any code it names: --trust-pickle is required. "
                    "Needs the checkpoint's full size in memory, twice. Run it again after an interruption.")
    p.add_argument("path", help="folder/step-N, or the folder of step-N checkpoints")
    p.add_argument("--trust-pickle", action="store_true",
                   help="I wrote these checkpoints (or trust who did): unpickling them may run code")
    p.add_argument("--delete-original", action="store_true",
                   help="remove each original once its conversion is verified and durable")
    p.set_defaults(func=lambda a: run(a.path, a.trust_pickle, a.delete_original))
