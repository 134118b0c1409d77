"""``alpsck bench``: the command line of the benchmark (see :mod:`alpsck.bench`).

Without ``--overhead``: save/restore of a synthetic state against torch.save, DCP, safetensors
and the raw disk (:mod:`.run`). With ``--overhead``: the throughput cost of checkpointing the
reference Llama training every k iterations (:mod:`.overhead`). With ``--ranks 1,2,4``: aggregate
torch.distributed.checkpoint throughput of several ranks, alpsck's backend against
FileSystemWriter (:mod:`.ranks`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AlpsckError
from ..options import arg_int, arg_real
from ..out import jsonout

# Every benchmark module imports torch: each is imported inside the command that runs it, so that the CLI
# (which imports this module to register `bench`) starts without torch, on a login node.
if TYPE_CHECKING:
    from .overhead_config import OverheadConfig


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return 1 << 20


def _sizes(text: str) -> list[float]:
    """``--size-gib``: one size or a comma-separated sweep, each checked against this machine's memory."""
    one = arg_real(0, _memory_gib())
    vals = [one(x) for x in text.split(",") if x]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected sizes in GiB, e.g. 1 or 0.25,0.5,1,2, got {text!r}")
    return vals


def _methods(text: str) -> list[str]:
    from .overhead_config import METHODS

    vals = [x for x in text.split(",") if x]
    bad = [x for x in vals if x not in METHODS]
    if not vals or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(METHODS)}, got {text!r}")
    return vals


def overhead(args: argparse.Namespace) -> int:
    from .overhead import OverheadConfig, plot, run_overhead, table

    if not Path(args.dir).is_dir():
        raise AlpsckError(f"--dir {args.dir}: no such directory")
    unused = [flag for flag, v in (("--full", args.full), ("--chunk-mib", args.chunk_mib), ("--no-peers", args.no_peers),
                                   ("--copy-threads", args.copy_threads)) if v]
    if unused:
        raise AlpsckError(f"{', '.join(unused)}: not used by --overhead (it runs alpsck with its default settings)")
    if args.threads and len(args.threads) > 1:
        raise AlpsckError("--overhead takes one --threads value (writer threads of every alpsck run)")
    d = OverheadConfig()
    cfg = OverheadConfig(ks=args.ks or d.ks, iters=args.iters, warmup=args.warmup, rounds=args.rounds, block=args.block,
                         methods=args.methods or d.methods,
                         in_flight=args.in_flight or d.in_flight, threads=args.threads[0] if args.threads else None,
                         dim=args.model_dim, n_layers=args.model_layers, n_heads=args.model_heads,
                         n_kv_heads=args.model_kv_heads, vocab_size=args.vocab_size, sequence_length=args.seq_len,
                         batch_size=args.batch_size, seed=args.seed, device=args.device,
                         torch_threads=args.torch_threads)
    result = run_overhead(Path(args.dir), cfg)
    if args.json:
        print(jsonout.dumps(result.to_json()))
    else:
        print(table(result))
    if args.plot:
        if plot(result, Path(args.plot)):
            print(f"plot written to {args.plot}", file=sys.stderr)
        else:
            print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


def ranks(args: argparse.Namespace) -> int:
    from .ranks import run_ranks, table

    if not Path(args.dir).is_dir():
        raise AlpsckError(f"--dir {args.dir}: no such directory")
    unused = [flag for flag, v in (("--full", args.full), ("--chunk-mib", args.chunk_mib), ("--no-peers", args.no_peers),
                                   ("--copy-threads", args.copy_threads), ("--in-flight", args.in_flight),
                                   ("--plot", args.plot), ("--overhead", args.overhead)) if v]
    if unused:
        raise AlpsckError(f"{', '.join(unused)}: not used by --ranks")
    if args.threads and len(args.threads) > 1:
        raise AlpsckError("--ranks takes one --threads value (writer threads of each rank's alpsck engine)")
    if len(args.size_gib) > 1:
        raise AlpsckError("--ranks takes one --size-gib (the total state of all ranks)")
    result = run_ranks(Path(args.dir), int(args.size_gib[0] * 2**30), args.ranks, repeats=args.repeats,
                       alpsck_threads=args.threads[0] if args.threads else None, dcp_threads=args.dcp_threads)
    print(jsonout.dumps(result.to_json()) if args.json else table(result))
    return 0


def bench(args: argparse.Namespace) -> int:
    from . import report
    from .run import run

    if args.ranks:
        return ranks(args)
    if args.overhead:
        return overhead(args)
    if not Path(args.dir).is_dir():
        raise AlpsckError(f"--dir {args.dir}: no such directory")
    threads, chunks, flights = args.threads, args.chunk_mib, args.in_flight
    if args.full:
        threads, chunks, flights = threads or [2, 4, 8], chunks or [4, 16], flights or [1, 2]
    results = [run(Path(args.dir), int(gib * 2**30), threads=threads or [4, 8], chunks_mib=chunks or [8],
                   in_flight=flights or [2], copy_threads=args.copy_threads, urgent=[False, True],
                   peers=not args.no_peers, repeats=args.repeats,
                   iter_seconds=args.iter_seconds, slowdown=args.slowdown, mtbf_hours=args.mtbf_hours)
               for gib in args.size_gib]
    if args.json:  # one size: its document; a sweep: {"sizes": [one document per size]}
        print(jsonout.dumps(results[0].to_json() if len(results) == 1 else {"sizes": [r.to_json() for r in results]}))
    else:
        print("\n\n".join(report.table(r) for r in results))
    if args.plot:
        drawn = report.plot(results[0], Path(args.plot)) if len(results) == 1 else report.plot_sizes(results,
                                                                                                     Path(args.plot))
        if drawn:
            print(f"plot written to {args.plot}", file=sys.stderr)
        else:
            print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    b = sub.add_parser(
        "bench", help="measure alpsck against torch.save, DCP, safetensors and the raw disk",
        description="Save and restore one state with alpsck, torch.save, torch.distributed.checkpoint and safetensors "
                    "(each fsync'ed) on the storage under --dir, beside the raw disk's bandwidth, in the same run, and "
                    "print the times and the ratios (docs/tools.md).")
    b.add_argument("--dir", default=".", help="directory on the storage to measure (e.g. your Lustre scratch)")
    b.add_argument("--size-gib", type=_sizes, default=[1.0],
                   help="state size in GiB, at most this machine's memory (default 1); a list such as 0.25,0.5,1,2 "
                   "runs the bench at each size, and --plot then draws stall and durable time against size")
    b.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    b.add_argument("--plot", metavar="PNG", help="also write a PNG chart (needs matplotlib)")
    b.add_argument("--full", action="store_true", help="sweep threads 2,4,8 x chunk 4,16 MiB x in-flight 1,2")
    b.add_argument("--threads", type=_ints, help="writer threads to try, e.g. 2,4,8")
    b.add_argument("--chunk-mib", type=_ints, help="chunk sizes in MiB to try, e.g. 4,16")
    b.add_argument("--in-flight", type=_ints, help="max_in_flight values to try, e.g. 1,2")
    b.add_argument("--copy-threads", type=_ints, help="snapshot copy threads to try, e.g. 1,2")
    b.add_argument("--no-peers", action="store_true", help="skip torch.save, DCP and safetensors")
    b.add_argument("--repeats", type=arg_int(1, 1000), default=3,
                   help="measured saves, and restores, per method after the warm-up (medians)")
    b.add_argument("--iter-seconds", type=arg_real(0, 1e6), default=1.0, help="your iteration time, for the advice")
    b.add_argument("--slowdown", type=arg_real(0, 1, hi_open=True), default=0.03,
                   help="tolerated training slowdown, for the advice")
    b.add_argument("--mtbf-hours", type=arg_real(0, 1e7), default=24.0, help="mean time between failures, for Young/Daly")
    o = b.add_argument_group("training overhead (--overhead)", "iterations/s of the reference Llama training with a "
                             "checkpoint every k iterations, against none; --dir, --json, --plot (overhead % vs k), "
                             "--in-flight (alpsck max_in_flight values) and --threads apply too")
    d = _overhead_defaults()
    o.add_argument("--overhead", action="store_true", help="run the training-overhead benchmark instead")
    o.add_argument("--ks", type=_ints, help=f"checkpoint intervals in iterations (default {','.join(map(str, d.ks))})")
    o.add_argument("--iters", type=arg_int(1), default=d.iters, help=f"timed iterations per configuration (default {d.iters})")
    o.add_argument("--warmup", type=arg_int(0), default=d.warmup, help=f"untimed iterations first (default {d.warmup})")
    o.add_argument("--rounds", type=arg_int(1, 1000), default=d.rounds,
                   help="repeat the sweep, interleaved; each configuration reports its median round (default 1)")
    o.add_argument("--block", type=arg_int(1, 100000), default=d.block,
                   help=f"iterations per block with or without checkpoints, at least (default {d.block})")
    o.add_argument("--methods", type=_methods,
                   help="alpsck,alpsck-overlap,alpsck-crc-writers,torch,dcp-async (default alpsck,torch)")
    o.add_argument("--model-dim", type=arg_int(1), default=d.dim, help=f"model width (default {d.dim})")
    o.add_argument("--model-layers", type=arg_int(1), default=d.n_layers, help=f"transformer blocks (default {d.n_layers})")
    o.add_argument("--model-heads", type=arg_int(1), default=d.n_heads, help=f"attention heads (default {d.n_heads})")
    o.add_argument("--model-kv-heads", type=arg_int(1), default=d.n_kv_heads, help="key/value heads (default: = heads)")
    o.add_argument("--vocab-size", type=arg_int(1), default=d.vocab_size, help=f"vocabulary (default {d.vocab_size})")
    o.add_argument("--seq-len", type=arg_int(1), default=d.sequence_length,
                   help=f"tokens per sequence (default {d.sequence_length})")
    o.add_argument("--batch-size", type=arg_int(1), default=d.batch_size,
                   help=f"sequences per iteration (default {d.batch_size})")
    o.add_argument("--seed", type=arg_int(0, 2**64 - 1), default=d.seed, help="model and data seed")
    o.add_argument("--torch-threads", type=arg_int(1), help="the training's torch threads (default: torch's, one per "
                   "core); fewer leave cores to alpsck's writers, as a GPU training leaves the CPU's")
    o.add_argument("--device", default=d.device, help="cpu, or cuda: train on the GPU and measure the pipelined "
                   "device-to-host snapshot against a plain pinned copy (default cpu)")
    r = b.add_argument_group("ranks (--ranks)", "aggregate torch.distributed.checkpoint save/load throughput of 1, 2, 4 "
                             "... ranks on this node (gloo, CPU tensors, --size-gib in total), alpsck's DCP backend "
                             "against DCP's FileSystemWriter; --dir, --json, --repeats and --threads apply too")
    r.add_argument("--ranks", type=_ints, help="world sizes to measure, e.g. 1,2,4")
    r.add_argument("--dcp-threads", type=_ints, default=[1, 4],
                   help="FileSystemWriter thread_count values to measure (default 1,4)")
    b.set_defaults(func=bench)


def _overhead_defaults() -> OverheadConfig:
    from .overhead_config import OverheadConfig

    return OverheadConfig()
