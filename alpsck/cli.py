"""The ``alpsck`` command line (also ``python -m alpsck``).

Subcommands:
  inspect-checkpoints RUN_DIR [--verify] [--json]   classify every checkpoint of a run
  bench [--dir DIR] [--size-gib X] [--json] ...      alpsck vs peers and the hardware limit
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _core
from .errors import AlpsckError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def inspect_checkpoints(run_dir: str, verify: bool, as_json: bool) -> int:
    path = Path(run_dir)
    if not path.exists():
        raise AlpsckError(f"{run_dir}: no such directory")
    if not path.is_dir():
        raise AlpsckError(f"{run_dir}: not a directory")
    progress = None
    if verify and sys.stderr.isatty() and not as_json:
        def progress(done: int) -> None:
            print(f"\rverified {_human(done)}", end="", file=sys.stderr, flush=True)
    infos: list[dict[str, Any]] = list(_core.scan(str(path), verify=verify, progress=progress))
    if progress is not None:
        print(file=sys.stderr)
    committed = [i["step"] for i in infos if i["status"] == "committed"]
    latest = max(committed) if committed else None
    if as_json:
        doc = {
            "latest_valid": latest,
            "checkpoints": [
                {k: i[k] for k in ("step", "path", "status", "bytes", "created", "ranks", "tensors", "verified", "error")}
                for i in infos
            ],
        }
        print(json.dumps(doc))
    else:
        if not infos:
            print(f"{run_dir}: no checkpoints")
        else:
            print(f"{'':1} {'step':>10}  {'status':<10} {'size':>10}  {'created':<19}  {'tensors':>7}  {'GB/s':>6}  note")
            for i in infos:
                mark = "*" if i["step"] == latest and i["status"] == "committed" else ""
                created = dt.datetime.fromtimestamp(i["created"]).strftime("%Y-%m-%d %H:%M:%S") if i["created"] else "-"
                rate = f"{i['bytes'] / i['write_seconds'] / 1e9:6.2f}" if i["write_seconds"] else "     -"
                print(f"{mark:1} {i['step']:>10}  {i['status']:<10} {_human(i['bytes']):>10}  {created:<19}  "
                      f"{i['tensors']:>7}  {rate}  {i['error'] or ''}")
            print("* = what restore would pick" if latest is not None else "no valid checkpoint: restore would start fresh")
    corrupt = any(i["status"] == "corrupt" for i in infos)
    return 1 if (verify and corrupt) else 0


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def bench(args: argparse.Namespace) -> int:
    from .bench import report
    from .bench.run import run

    if not Path(args.dir).is_dir():
        raise AlpsckError(f"--dir {args.dir}: no such directory")
    threads, chunks, flights = args.threads, args.chunk_mib, args.in_flight
    if args.full:
        threads, chunks, flights = threads or [2, 4, 8], chunks or [4, 16], flights or [1, 2]
    result = run(Path(args.dir), int(args.size_gib * 2**30), threads=threads or [4, 8], chunks_mib=chunks or [8],
                 in_flight=flights or [2], copy_threads=args.copy_threads, urgent=[False, True],
                 peers=not args.no_peers, repeats=args.repeats,
                 iter_seconds=args.iter_seconds, slowdown=args.slowdown, mtbf_hours=args.mtbf_hours)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(report.table(result))
    if args.plot:
        if report.plot(result, Path(args.plot)):
            print(f"plot written to {args.plot}", file=sys.stderr)
        else:
            print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alpsck", description="Checkpoint-and-requeue toolkit for PyTorch on SLURM.")
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("inspect-checkpoints", help="list the checkpoints of a run directory and their status")
    ins.add_argument("run_dir")
    ins.add_argument("--verify", action="store_true", help="re-read every byte and check every CRC (exit 1 on corruption)")
    ins.add_argument("--json", action="store_true", help="print one JSON document")
    b = sub.add_parser("bench", help="measure alpsck against torch.save, DCP, safetensors and the raw disk")
    b.add_argument("--dir", default=".", help="directory on the storage to measure (e.g. your Lustre scratch)")
    b.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    b.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    b.add_argument("--plot", metavar="PNG", help="also write a bar chart (needs matplotlib)")
    b.add_argument("--full", action="store_true", help="sweep threads 2,4,8 x chunk 4,16 MiB x in-flight 1,2")
    b.add_argument("--threads", type=_ints, help="writer threads to try, e.g. 2,4,8")
    b.add_argument("--chunk-mib", type=_ints, help="chunk sizes in MiB to try, e.g. 4,16")
    b.add_argument("--in-flight", type=_ints, help="max_in_flight values to try, e.g. 1,2")
    b.add_argument("--copy-threads", type=_ints, help="snapshot copy threads to try, e.g. 1,2")
    b.add_argument("--no-peers", action="store_true", help="skip torch.save, DCP and safetensors")
    b.add_argument("--repeats", type=int, default=3, help="measured saves per method after one warm-up (median)")
    b.add_argument("--iter-seconds", type=float, default=1.0, help="your iteration time, for the advice")
    b.add_argument("--slowdown", type=float, default=0.03, help="tolerated training slowdown, for the advice")
    b.add_argument("--mtbf-hours", type=float, default=24.0, help="mean time between failures, for Young/Daly")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect-checkpoints":
            return inspect_checkpoints(args.run_dir, args.verify, args.json)
        if args.command == "bench":
            return bench(args)
    except AlpsckError as e:
        print(f"alpsck: error: {e}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
