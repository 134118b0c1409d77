"""``alpsck inspect-checkpoints``: what a run directory holds.

``inspect-checkpoints RUN_DIR [--verify] [--json]`` lists every checkpoint with its status
(committed / incomplete / corrupt / unreadable) and which one a restart would use (``*``, the picker's
choice: :func:`alpsck.store.picker.pick`; without ``--verify``, data CRCs are not checked, so ``*`` is what
a restore tries first; ``--json``'s ``skipped`` says why each newer step is not it). ``--verify`` re-reads every
byte and checks every CRC (a progress bar on a terminal; exit 1 on corruption). A run that used the memory
tier (``memory_every``) also gets what this node's memory holds of it (:func:`memory_listing`; ``--json``:
``memory``); a job's memory checkpoints are in its nodes' memory, so run it inside the job to see them.
A trainer's folder of checkpoints (torchtitan's ``checkpoint/step-10``, ``step-20``: one checkpoint directory per
step) is listed by step and kind (:func:`folder_listing`): alpsck's, with its newest valid generation, or DCP's own
FileSystemWriter format, which ``alpsck import-dcp`` converts; never called damaged. Exit 1 when a restore would
start fresh: the directory holds checkpoints and none is usable. A directory written through ``alpsck://``
(``DIR`` or ``alpsck://DIR``) is listed file by file, each checked against its CRC32C
(:mod:`.inspect_summed`).
``--step N`` (or ``--tensors`` alone, for the newest valid one) describes one checkpoint from its
state tree, without reading tensor data: the tensor inventory (``--tensors``: name, dtype, shape,
bytes) and a summary of the non-tensor state (step, learning rates, RNG streams, data position,
entry kinds). Superseded directories (below) are listed apart, after the table (``--json``: the
top-level ``superseded`` list).

A run that resumed from an older checkpoint (the newest was corrupt, or an explicit older step was
restored) renames, at its first save, each ``step-N`` newer than the step it went on from to
``superseded-step-N-<pid>-<seq>`` (``step-N`` as the core names it, zero-padded). They are an
abandoned history: never restored, never counted as checkpoints, kept on disk until ``prune``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from .. import _core
from ..errors import (
    AlpsckError,
    CheckpointError,
    CorruptCheckpointError,
    UsageError,
)
from ..options import DEFAULTS, arg_rank, arg_step
from ..out import jsonout
from ..out.textout import local_time, printable
from ..store import memory_tier
from ..store.lustre import describe_layout
from ..store.marker import ALPSCK, FILESYSTEMWRITER, folder_steps
from ..store.picker import metrics_text, pick, pick_checkpoint
from ..store.scan import check_run_dir, open_shard, scan_run_dir, superseded_dirs
from ..store.shards import UNUSABLE, CheckpointShards
from .inspect_summed import URL_PREFIX, is_summed_dir, summed_listing
from .progress import ProgressBar, ShardProgress, human


def _superseded_line(found: list[dict[str, Any]], limit: int = 10) -> str:
    names = [f"step {d['step']} ({Path(d['path']).name})" for d in found[:limit]]
    if len(found) > limit:
        names.append(f"... and {len(found) - limit} more")
    one = len(found) == 1
    return (f"{len(found)} superseded checkpoint director{'y' if one else 'ies'} (an abandoned history, never "
            f"restored): {', '.join(names)}; `alpsck prune` removes {'it' if one else 'them'}")


def _verify_sizes(infos: list[dict[str, Any]]) -> list[int]:
    """Bytes the core reads to verify each shard of each committed checkpoint (data padded to ``align``)."""
    sizes: list[int] = []
    for info in infos:
        if info["status"] != "committed":
            continue
        shards = info.get("shards") or []
        for name in shards:
            try:
                r = _core.ShardReader(str(Path(info["path"]) / name))
                align = max(1, int(r.align))
                sizes.append(-(-int(r.data_bytes) // align) * align)
            except (AlpsckError, OSError):
                sizes.append(int(info["data_bytes"]) // max(1, len(shards)))
    return sizes


# What the '*' means (docs/guarantees.md, "Which checkpoint a restore uses"): without --verify the
# quick rule only (a restore that then finds a data CRC mismatch falls back to the next one).
_MARK_NOTE = {False: "* = what restore tries first (data CRCs not checked; --verify checks them)",
              True: "* = what restore would use (every CRC checked)"}


def _verify_summary(infos: list[dict[str, Any]], seconds: float) -> str:
    """--verify's verdict in one line: how much it read, and whether every CRC matched."""
    checked = [i for i in infos if i["verified"] or i["status"] in UNUSABLE]
    bad = [i for i in infos if i["status"] in UNUSABLE]
    read = sum(i["bytes"] for i in infos if i["verified"])
    head = f"--verify: re-read {len(checked)} checkpoint(s), {human(read)} in {seconds:.1f} s: "
    if not bad:
        return head + "every chunk CRC matches"
    return head + f"{len(bad)} corrupt or unreadable (step(s) {', '.join(str(i['step']) for i in bad)}); exit 1"


def memory_listing(run_dir: Path) -> dict[str, Any] | None:
    """The memory tier's checkpoints on this node (None: the run never opened a memory tier): each group of
    ranks (``ranks-FIRST-LAST``: a node's own copy, or the replica of the node before) with its checkpoints.
    A job's memory checkpoints are in its nodes' memory: run inside the job to see them."""
    used, directory = memory_tier.existing_memory_dir(run_dir)
    if not used:
        return None
    groups: list[dict[str, Any]] = []
    for group in sorted(directory.iterdir()) if directory is not None else []:
        if group.name.startswith("ranks-") and group.is_dir() and not group.is_symlink():
            try:
                found = [{k: i.get(k) for k in ("step", "path", "status", "bytes", "created", "ranks", "error")}
                         for i in scan_run_dir(group)]
            except (AlpsckError, OSError) as e:  # one unreadable group: said, the others still listed
                found = [{"step": None, "path": str(group), "status": "unreadable", "bytes": 0, "created": None,
                          "ranks": None, "error": str(e)}]
            groups.append({"group": group.name, "checkpoints": found})
    return {"node": memory_tier.node_name(), "directory": str(directory) if directory else None, "groups": groups}


def _created(when: float | None) -> str:
    """A checkpoint's creation time as the listings show it (local time; "-" when unknown)."""
    return local_time(when) if when else "-"


def _memory_lines(memory: dict[str, Any], picked: int | None) -> list[str]:
    if memory["directory"] is None:
        return [f"memory tier: nothing on this node ({memory['node']}); a job's memory checkpoints live in its nodes' "
                "memory: run this inside the job (srun --jobid=JOBID --overlap alpsck inspect-checkpoints RUN_DIR)"]
    lines = [f"memory tier on this node ({memory['node']}): {memory['directory']}"]
    for g in memory["groups"]:
        m = re.fullmatch(r"ranks-(\d+)-(\d+)", g["group"])
        ranks = f"{int(m[1])}-{int(m[2])}" if m else printable(g["group"], 60)
        for i in g["checkpoints"] or [{"step": None, "error": None}]:
            if i["step"] is None:
                lines.append(f"  ranks {ranks}: " + (f"unreadable: {i['error']}" if i["error"] else "no checkpoint"))
                continue
            created = _created(i["created"])
            newer = i["status"] == "committed" and (picked is None or i["step"] > picked)
            lines.append(f"  ranks {ranks}: step {i['step']} {i['status']} {human(i['bytes'])} {created}"
                         + (f" {i['error']}" if i["error"] else "")
                         + (" (newer than the run directory's *: a restart of these ranks reads it)" if newer else ""))
    return lines


def inspect_checkpoints(run_dir: str, verify: bool, as_json: bool, progress_stream: TextIO | None = None) -> int:
    """The checkpoint table (or JSON document) of ``run_dir``; exit code 1 if ``verify`` found corruption.

    The bar goes to ``progress_stream``; by default to stderr when it is a terminal and not ``as_json``.
    """
    run_dir = run_dir.removeprefix(URL_PREFIX)
    if is_summed_dir(Path(run_dir)):  # written through alpsck:// (DCP's fsspec or Hugging Face writer, Lightning)
        return summed_listing(run_dir, verify, as_json)
    folder = folder_steps(Path(run_dir))
    if folder is not None:  # before check_run_dir, which refuses a folder for every other tool
        return folder_listing(run_dir, folder, as_json)
    path = check_run_dir(run_dir)
    started = time.monotonic()
    if progress_stream is None and verify and not as_json and sys.stderr.isatty():
        progress_stream = sys.stderr
    tracker: ShardProgress | None = None
    bar: ProgressBar | None = None
    if verify and progress_stream is not None:
        bar = ProgressBar(sum(_verify_sizes(scan_run_dir(path))), progress_stream)
        tracker = ShardProgress(bar)
    # The picker (store.picker.pick) marks the pick; with --verify every committed checkpoint is verified.
    picked = pick(path, verify_all=verify, progress=tracker)
    infos = list(picked.scanned)
    if bar is not None:
        bar.close(complete=not any(i["status"] in UNUSABLE for i in infos))
    latest = picked.step
    superseded = superseded_dirs(path)
    try:
        layout = describe_layout(path)  # None off Lustre: no lfs call there
    except CheckpointError as e:
        layout = f"unknown ({e})"
    memory = memory_listing(path)
    if as_json:
        doc = {
            "latest_valid": latest,
            "checkpoints": [
                {k: i.get(k) for k in ("step", "path", "status", "bytes", "created", "ranks", "tensors", "verified", "error",
                                        "metrics", "unhealthy", "pinned")}
                for i in infos
            ],
            "skipped": [dataclasses.asdict(k) for k in picked.skipped],
            "superseded": superseded,
            "lustre_layout": layout,
            "memory": memory,
        }
        print(jsonout.dumps(doc))
    else:
        if not infos:
            print(f"{run_dir}: no checkpoints")
        else:
            unhealthy_paths = {k.path for k in picked.skipped if k.reason == "unhealthy"}
            print(f"{'':1} {'step':>10}  {'status':<10} {'size':>10}  {'created':<19}  {'ranks':>5}  {'tensors':>7}  "
                  f"{'GB/s':>6}  note")
            for i in infos:
                mark = "*" if i["path"] == picked.path else ""
                created = _created(i["created"])
                rate = f"{i['bytes'] / i['write_seconds'] / 1e9:6.2f}" if i["write_seconds"] else "     -"
                ranks = str(i["ranks"]) if i["ranks"] else "-"
                note = i["error"] or ("every chunk CRC matches" if verify and i["verified"] else "")
                if i.get("metrics") or i.get("unhealthy"):
                    unhealthy = "unhealthy:" if i["path"] in unhealthy_paths else ""
                    note = " ".join(filter(None, (unhealthy, metrics_text(i["metrics"]), note)))
                if i.get("pinned"):
                    note = " ".join(filter(None, ("pinned", note)))
                print(f"{mark:1} {i['step']:>10}  {i['status']:<10} {human(i['bytes']):>10}  {created:<19}  {ranks:>5}  "
                      f"{i['tensors']:>7}  {rate}  {note}")
            print(_MARK_NOTE[verify] if latest is not None else "no valid checkpoint: restore would start fresh")
            if verify:  # said in words, terminal or not (the bar goes to a terminal only)
                print(_verify_summary(infos, time.monotonic() - started))
        if superseded:
            print(_superseded_line(superseded))
        if layout is not None:
            print(f"Lustre layout of new checkpoints: {layout}")
        for line in _memory_lines(memory, latest) if memory is not None else []:
            print(line)
    bad = any(i["status"] in UNUSABLE for i in infos)
    return 1 if (verify and bad) or (infos and latest is None) else 0


def folder_listing(folder: str, steps: list[tuple[int, Path, str]], as_json: bool) -> int:
    """A trainer's folder of checkpoints (:func:`alpsck.store.marker.folder_steps`): each step, its kind and what
    a resume through alpsck's DCP reader would load; exit 1 when it would load none."""
    rows = []
    for step, path, kind in steps:
        newest = pick(path).step if kind == ALPSCK else None
        if kind == ALPSCK:
            note = (f"alpsck's; its newest valid generation: {newest} (inspect-checkpoints {path})" if newest is not None
                    else f"alpsck's, with no valid generation (inspect-checkpoints {path} says why)")
        elif kind == FILESYSTEMWRITER:
            note = (f"DCP's own format (FileSystemWriter, a pickle): alpsck's reader refuses it; alpsck import-dcp "
                    f"{path} --trust-pickle converts it")
        else:
            note = "neither alpsck's nor FileSystemWriter's (no .metadata a reader takes)"
        rows.append({"step": step, "path": str(path), "kind": kind, "newest_generation": newest, "note": note})
    usable = [r for r in rows if r["newest_generation"] is not None]
    resumes = usable[-1]["step"] if usable else None
    if as_json:
        print(jsonout.dumps({"folder": True, "latest_valid": resumes, "steps": rows}))
    else:
        print(f"{folder}: a folder of checkpoints, one directory per step (as torchtitan writes them)")
        print(f"{'':1} {'step':>10}  {'kind':<16}  note")
        for r in rows:
            print(f"{'*' if r['step'] == resumes else '':1} {r['step']:>10}  {r['kind']:<16}  {printable(r['note'])}")
        print("* = the step a resume through alpsck's DCP reader loads (the newest it can read)" if resumes is not None
              else "no step alpsck's DCP reader can load: a resume would start fresh")
    return 0 if resumes is not None else 1


def _plain(v: Any) -> Any:
    """A JSON-able rendering of a decoded scalar (tensor references become their description)."""
    from .. import tree  # torch: only where a checkpoint's tree is read (the module imports without it)

    if isinstance(v, tree.TensorRef):
        return f"<tensor {v.key} {tree.dtype_name(v.dtype)} {list(v.shape)}>"
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return repr(v)


_RNG_STREAMS = ("python", "numpy", "torch", "cuda")


def _walk(v: Any, path: str, depth: int = 0) -> Iterator[tuple[str, dict[Any, Any]]]:
    """Every dict in a decoded value, with its path (depth-limited)."""
    if depth > 8:
        return
    if isinstance(v, dict):
        yield path, v
        for k, x in v.items():
            if isinstance(x, (dict, list, tuple)):
                yield from _walk(x, f"{path}/{k}", depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if isinstance(x, (dict, list, tuple)):
                yield from _walk(x, f"{path}/{i}", depth + 1)


def summarize_state(tree_doc: dict[str, Any]) -> dict[str, Any]:
    """What a state tree says besides tensor bytes: entry kinds, learning rates, RNG streams, data position.

    Decodes with the tree's own validating decoder; tensors are only references (nothing is read).
    """
    from .. import tree

    entries = tree.decode_refs(tree_doc)
    kinds = {key: kind for key, (kind, _, _) in entries.items()}
    lrs: list[dict[str, Any]] = []
    rng: dict[str, list[str]] = {}
    data: dict[str, dict[str, Any]] = {}
    values: dict[str, Any] = {}
    for key, (kind, decoded, _) in entries.items():
        if kind == "value" and (decoded is None or isinstance(decoded, (bool, int, float, str))):
            values[key] = decoded
        for path, d in _walk(decoded, key):
            groups = d.get("param_groups")
            if isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups):
                lrs.append({"path": path, "source": "param_groups", "lr": [_plain(g.get("lr")) for g in groups]})
            for name in ("_last_lr", "last_lr"):
                if isinstance(d.get(name), (list, tuple)):
                    lrs.append({"path": path, "source": "last_lr", "lr": _plain(d[name])})
                    break
            if "torch" in d and sum(s in d for s in _RNG_STREAMS) >= 2:
                streams = []
                for s in _RNG_STREAMS:
                    x = d.get(s)
                    if x is None or (isinstance(x, (list, tuple)) and not x):
                        continue
                    streams.append(f"cuda ({len(x)} devices)" if s == "cuda" and isinstance(x, (list, tuple)) else s)
                rng[path] = streams
            elif ("position" in d or "epoch" in d) and "param_groups" not in d:
                pos = {str(k): _plain(x) for k, x in d.items()
                       if x is None or isinstance(x, (bool, int, float, str))}
                if any(k in pos for k in ("position", "epoch")):
                    data[path] = pos
    return {"entries": kinds, "values": values, "learning_rates": lrs, "rng": rng, "data": data}


def describe_checkpoint(info: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    """Tensor inventory and state summary of one checkpoint (rank ``rank``'s shard), from its tree only."""
    from .. import tree

    shards = CheckpointShards(info["path"], rank, open_shard)
    meta, specs = shards.meta, shards.specs
    tensors = [
        {"name": key, "dtype": tree.dtype_name(specs[key].dtype), "shape": list(specs[key].shape),
         "bytes": specs[key].nbytes}
        for key in shards.keys_in_file_order()
    ]
    summary = summarize_state(meta["tree"])
    return {
        "step": meta.get("step", info["step"]),
        "path": info["path"],
        "status": info["status"],
        "rank": rank,
        "ranks": info["ranks"],
        "tensor_count": len(tensors),
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "metrics": info.get("metrics") or {},
        "state": summary,
    }


def _print_description(d: dict[str, Any], show_tensors: bool) -> None:
    print(f"checkpoint step {d['step']}: {d['path']} ({d['status']}"
          + (f", rank {d['rank']} of {d['ranks']}" if d["ranks"] > 1 else "") + ")")
    print(f"tensors: {d['tensor_count']}, {human(d['tensor_bytes'])}")
    if d["metrics"]:
        print(f"metrics: {metrics_text(d['metrics'])}")
    if show_tensors and d["tensors"]:
        w = max(len("name"), *(len(t["name"]) for t in d["tensors"]))
        print(f"  {'name':<{w}}  {'dtype':<14} {'shape':<20} {'bytes':>12}")
        for t in d["tensors"]:
            shape = "[" + ", ".join(map(str, t["shape"])) + "]"
            print(f"  {t['name']:<{w}}  {t['dtype']:<14} {shape:<20} {t['bytes']:>12}")
    s = d["state"]
    print("state:")
    print("  entries: " + (", ".join(f"{k} ({v})" for k, v in s["entries"].items()) or "none"))
    for k, v in s["values"].items():
        print(f"  {k} = {v!r}")
    if s["learning_rates"]:
        for lr in s["learning_rates"]:
            print(f"  learning rate: {lr['path']} ({lr['source']}) = {', '.join(map(str, lr['lr']))}")
    else:
        print("  learning rate: none found (no optimizer param_groups or scheduler last_lr)")
    if s["rng"]:
        for k, v in s["rng"].items():
            absent = [x for x in _RNG_STREAMS if not any(y.startswith(x) for y in v)]
            print(f"  rng streams ({k}): {', '.join(v) or 'none'}" + (f" (absent: {', '.join(absent)})" if absent else ""))
    else:
        print("  rng streams: none saved")
    if s["data"]:
        for k, v in s["data"].items():
            print(f"  data position ({k}): " + " ".join(f"{a}={b}" for a, b in v.items()))
    else:
        print("  data position: none found")


def inspect_one(run_dir: str, step: int | None, show_tensors: bool, as_json: bool, verify: bool, rank: int = 0,
                progress_stream: TextIO | None = None) -> int:
    """``inspect-checkpoints --step N [--tensors]``: one checkpoint's inventory and state summary.

    With ``verify``, exit 1 when the checkpoint is corrupt or unreadable, whether its CRCs or the quick
    scan (a truncated shard, a bad footer or manifest) found it; without, such a checkpoint is an error.
    """
    check_run_dir(run_dir)
    info, _ = pick_checkpoint(run_dir, step)
    if verify and info["status"] in UNUSABLE:  # what --verify looks for: reported, exit 1 (as without --step)
        doc = {k: info[k] for k in ("step", "path", "status", "ranks")} | {"rank": rank, "verified": False,
                                                                         "error": info["error"]}
        if as_json:
            print(jsonout.dumps(doc))
        else:
            print(f"checkpoint step {info['step']}: {info['path']} ({info['status']})")
            print(f"{info['status'].upper()}: {info['error']}")
        return 1
    if info["status"] != "committed":
        raise CorruptCheckpointError(f"{run_dir}: checkpoint of step {info['step']} is {info['status']}: {info['error']}")
    if not 0 <= rank < max(1, info["ranks"]):
        raise UsageError(f"--rank {rank}: checkpoint of step {info['step']} has {info['ranks']} rank(s)")
    desc = describe_checkpoint(info, rank)
    rc = 0
    if verify:
        if progress_stream is None and not as_json and sys.stderr.isatty():
            progress_stream = sys.stderr
        desc["verified"], desc["error"] = True, None
        readers = [open_shard(Path(info["path"]) / name) for name in info["shards"]]
        bar = ProgressBar(sum(int(r.data_bytes) for r in readers), progress_stream) if progress_stream else None
        done = 0
        for r in readers:
            try:
                r.verify(DEFAULTS["read_threads"])
            except CorruptCheckpointError as e:
                desc["verified"], desc["error"], rc = False, str(e), 1
                break
            done += int(r.data_bytes)
            if bar:
                bar.update(done)
        if bar:
            bar.close(complete=rc == 0)
    if as_json:
        if not show_tensors:
            desc.pop("tensors")
        print(jsonout.dumps(desc))
    else:
        _print_description(desc, show_tensors)
        if verify:
            print("verified: every chunk CRC matches" if rc == 0 else f"CORRUPT: {desc['error']}")
    return rc


# ----------------------------------------------------------------------------- command line


def _inspect_cmd(a: argparse.Namespace) -> int:
    if a.step is not None or a.tensors:
        return inspect_one(a.run_dir, a.step, a.tensors, a.json, a.verify, a.rank)
    return inspect_checkpoints(a.run_dir, a.verify, a.json)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ins = sub.add_parser(
        "inspect-checkpoints", help="list the checkpoints of a run directory and their status",
        description="List the checkpoints of RUN_DIR (committed / incomplete / corrupt / unreadable) and which one a "
                    "restart uses. "
                    "With --step N (or --tensors) describe one checkpoint from its state tree, without reading tensor data.")
    ins.add_argument("run_dir")
    ins.add_argument("--verify", action="store_true", help="re-read every byte and check every CRC (exit 1 on corruption)")
    ins.add_argument("--json", action="store_true", help="print one JSON document")
    ins.add_argument("--step", type=arg_step, help="describe checkpoint N: state summary (step, lr, RNG streams, data position)")
    ins.add_argument("--tensors", action="store_true",
                     help="list the tensors (name, dtype, shape, bytes) of --step N (default: the newest valid checkpoint)")
    ins.add_argument("--rank", type=arg_rank, default=0, help="shard to describe with --step/--tensors (default 0)")
    ins.set_defaults(func=_inspect_cmd)
