"""File-system metadata calls per save and per rank, under ``strace``: the budgets of issue #40.

W gloo processes (torch.distributed, one per rank) share one run directory, each under
``strace -f`` (its threads too: the engine's writers and coordinator). Each rank opens
``alpsck.Checkpointer(run_dir, keep_last=2, replicated=("model",))``, makes ``--warmup`` saves
(untimed, unlate: by the third, expired checkpoints are recycled, the steady state), then
``--saves`` measured saves of ``--mib`` MiB (half a replicated "model", half per-rank tensors),
each ``save(step, state).wait()``; the last rank sleeps ``--late`` seconds before each measured
save, so every other rank waits that long for the commit. Then close, open again and
``restore()`` (the restart of a requeued job), counted apart.

What counts: the calls of :data:`METADATA` (namespace and inode lookups and changes, the calls a
Lustre client turns into metadata-server traffic) that the process makes, any thread, any path,
between two markers: a ``stat`` of the non-existent ``/alpsck-marker-begin`` right before the
first measured save and of ``/alpsck-marker-end`` right after the last one's ``wait()`` (the
markers themselves are not counted), divided by ``--saves``. Everything else the process does
(torch, gloo, Python) is counted too, not filtered by path; the report names the paths that
dominate. :data:`SYNC` calls (fsync and the like, data and size, not lookups) are traced and
reported per save but are not in the budget. The restore is counted the same way between its own
markers (``/alpsck-marker-restore-begin``, ``-end``): one restore, not per save; no budget, but
only rank 0 should list ``RUN_DIR`` (``getdents64 $RUN``).

The budgets of issue #40, per save: at most 4 calls on every non-zero rank; rank 0 at most 12 and
not growing with the number of ranks; both the same whether the late rank is 0.1 s or 10 s late.
Prints one row per (ranks, late) and writes every rank's counts, by call and by path, to
``--out``::

    python benchmarks/metadata_budget.py --ranks 4,8 --late 0.1 --saves 3 --out results.json
    python benchmarks/metadata_budget.py --ranks 4,8,16 --late 0.1,10 --saves 3 --out results.json

Needs ``strace`` (ptrace permitted), torch with gloo and an importable ``alpsck``: the one the
child processes import is the one ``python -c "import alpsck"`` finds from ``--dir``'s parent.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Calls that look up, create, rename, remove, list or change the metadata of a file or directory.
METADATA = (
    "open", "openat", "openat2", "creat", "open_by_handle_at", "name_to_handle_at",
    "stat", "lstat", "fstat", "newfstatat", "statx", "fstatat64", "stat64", "lstat64", "fstat64",
    "statfs", "fstatfs",
    "access", "faccessat", "faccessat2",
    "readlink", "readlinkat",
    "rename", "renameat", "renameat2",
    "unlink", "unlinkat", "rmdir",
    "mkdir", "mkdirat", "mknod", "mknodat",
    "link", "linkat", "symlink", "symlinkat",
    "getdents", "getdents64",
    "chmod", "fchmod", "fchmodat", "chown", "fchown", "fchownat", "lchown",
    "utime", "utimes", "futimesat", "utimensat", "truncate",
    "getxattr", "lgetxattr", "fgetxattr", "setxattr", "lsetxattr", "fsetxattr",
    "listxattr", "llistxattr", "flistxattr", "removexattr", "lremovexattr", "fremovexattr",
    "chdir", "fchdir", "getcwd",
)
# Traced and reported, not in the budget: durability and size, not lookups.
SYNC = ("fsync", "fdatasync", "syncfs", "sync_file_range", "ftruncate", "fallocate")

MARK_BEGIN, MARK_END = "/alpsck-marker-begin", "/alpsck-marker-end"
RESTORE_BEGIN, RESTORE_END = "/alpsck-marker-restore-begin", "/alpsck-marker-restore-end"
BUDGET_NONZERO, BUDGET_RANK0 = 4, 12

WORKER = r"""
import datetime, json, os, sys, time, torch, torch.distributed as dist, alpsck
torch.set_num_threads(1)
run_dir, warmup, saves, late, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank, world = dist.get_rank(), dist.get_world_size()
n = max(1, mib * (1 << 20) // 4 // 8)  # 8 tensors of mib/8 MiB: 4 replicated, 4 per rank
model = {f"layer{i}": torch.zeros(n) for i in range(4)}
local = {f"part{i}": torch.zeros(n) for i in range(4)}
ck = alpsck.Checkpointer(run_dir, keep_last=2, replicated=("model",), commit_timeout_s=max(120.0, 10 * late))

def save(step):
    for t in model.values():
        t.fill_(float(step))
    for t in local.values():
        t.fill_(float(1000 * rank + step))
    t0 = time.perf_counter()
    ck.save(step, {"model": model, "local": local, "step": step}).wait()
    return time.perf_counter() - t0

for step in range(1, warmup + 1):
    save(step)
dist.barrier()
times = []
try:
    os.stat("__BEGIN__")
except FileNotFoundError:
    pass
for step in range(warmup + 1, warmup + saves + 1):
    if rank == world - 1:
        time.sleep(late)
    times.append(save(step))
try:
    os.stat("__END__")
except FileNotFoundError:
    pass
dist.barrier()
ck.close()
ck = alpsck.Checkpointer(run_dir, keep_last=2, replicated=("model",))
dist.barrier()
try:
    os.stat("__RBEGIN__")
except FileNotFoundError:
    pass
got = ck.restore({"model": model, "local": local, "step": 0})
try:
    os.stat("__REND__")
except FileNotFoundError:
    pass
ck.close()
print("RESULT " + json.dumps({"rank": rank, "save_s": times, "restored": got}), flush=True)
dist.destroy_process_group()
""".replace("__BEGIN__", MARK_BEGIN).replace("__END__", MARK_END).replace("__RBEGIN__", RESTORE_BEGIN).replace(
    "__REND__", RESTORE_END)

# One strace line, optionally after a pid: "123 openat(AT_FDCWD, ...) = 3" or "... <unfinished ...>".
_LINE = re.compile(r"^(?:\[pid\s+)?(\d+\]?\s+)?([a-z_0-9]+)\((.*)$")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_FD_PATH = re.compile(r"^\s*(?:-?\d+|AT_FDCWD)<([^>]*)>")


def _path_of(args: str) -> str:
    """The path a call names: its quoted path, joined to the directory strace -y prints after a
    leading dirfd (AT_FDCWD<cwd> or 11</run>) when relative; the fd's own path when none is quoted
    (fstat, getdents64, AT_EMPTY_PATH)."""
    fd = _FD_PATH.match(args)
    q = _QUOTED.search(args)
    if q and q.group(1):
        path = q.group(1)
        return path if path.startswith("/") or not fd else f"{fd.group(1)}/{path}"
    return fd.group(1) if fd else "<no path>"


def _normalise(path: str, run_dir: str) -> str:
    """Paths with the run directory as $RUN and digit runs as N: step-000000007 and step-000000008 alike."""
    if path.startswith(run_dir):
        path = "$RUN" + path[len(run_dir):]
    return re.sub(r"\d+", "N", path)


def parse_trace(text: str, run_dir: str, begin: str = MARK_BEGIN, end: str = MARK_END) -> dict[str, Any]:
    """Counts of METADATA and SYNC calls between the markers ``begin`` and ``end`` of one process's
    ``strace -f -y`` output."""
    calls: collections.Counter[str] = collections.Counter()
    sync: collections.Counter[str] = collections.Counter()
    paths: collections.Counter[str] = collections.Counter()
    state = "before"
    for line in text.splitlines():
        if "resumed>" in line or line.startswith(("+++", "---")):
            continue  # the second half of a call counted at its start; exits and signals
        m = _LINE.match(line)
        if not m:
            continue
        name, args = m.group(2), m.group(3)
        if begin in args:
            state = "between"
            continue
        if end in args:
            state = "after"
            continue
        if state != "between":
            continue
        if name in METADATA:
            calls[name] += 1
            paths[f"{name} {_normalise(_path_of(args), run_dir)}"] += 1
        elif name in SYNC:
            sync[name] += 1
    if state != "after":
        raise RuntimeError(f"the trace lacks the {'begin' if state == 'before' else 'end'} marker")
    return {"total": sum(calls.values()), "calls": dict(calls), "sync": dict(sync), "paths": dict(paths)}


def _kill_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:  # each strace leads its own process group: its tracees with it
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def strace_problem() -> str | None:
    """Why this machine cannot count calls with strace (not installed, or ptrace not permitted), or None."""
    if shutil.which("strace") is None:
        return "strace is not installed (apt-get install strace)"
    probe = subprocess.run(["strace", "-f", "-qq", "--seccomp-bpf", "-e", "trace=openat", "-o", os.devnull, "true"],
                           capture_output=True, text=True)
    return f"strace cannot trace here (ptrace not permitted?): {probe.stderr.strip()}" if probe.returncode else None


def run_traced(work: Path, world: int, argv: list[str], timeout: float, what: str) -> float:
    """``world`` gloo ranks of ``python argv`` in ``work``, each under ``strace -f -y`` of :data:`METADATA` and
    :data:`SYNC` (``work/trace.R``, its output ``work/log.R``); RuntimeError naming the rank and its output when
    one fails or the whole outlasts ``timeout`` s (``what``: the configuration, in the message). The wall time."""
    from alpsck.job_env import free_port

    port = str(free_port())
    trace_set = ",".join("?" + name for name in METADATA + SYNC)  # ?: no error where a call does not exist
    procs: list[subprocess.Popen[str]] = []
    logs = []
    start = time.monotonic()
    try:
        for rank in range(world):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world),
                   "RANK": str(rank), "OMP_NUM_THREADS": "1"}
            cmd = ["strace", "-f", "-qq", "-y", "-s", "512", "--seccomp-bpf", "-e", f"trace={trace_set}",
                   "-o", str(work / f"trace.{rank}"), sys.executable, *argv]
            log = open(work / f"log.{rank}", "w")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True, cwd=work))
        deadline = start + timeout
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                _kill_all(procs)
                for log in logs:
                    log.flush()
                tail = (work / f"log.{failed[0] if failed else 0}").read_text()[-3000:]
                why = f"rank {failed[0]} exited with {procs[failed[0]].returncode}" if failed else \
                    f"timed out after {timeout:.0f} s"
                raise RuntimeError(f"{what}: {why}; its output ({work}):\n{tail}")
            time.sleep(0.2)
    finally:
        _kill_all(procs)
        for log in logs:
            log.close()
    return time.monotonic() - start


def one_config(base: Path, world: int, late: float, saves: int, warmup: int, mib: int, timeout: float,
               keep: bool) -> dict[str, Any]:
    """Every rank's calls per measured save, at ``world`` ranks with the last one ``late`` seconds late."""
    work = Path(tempfile.mkdtemp(prefix=f"budget-{world}r-{late:g}s-", dir=base))
    run_dir = str(work / "run")
    script = work / "worker.py"
    script.write_text(WORKER)
    wall = run_traced(work, world, [str(script), run_dir, str(warmup), str(saves), repr(late), str(mib)], timeout,
                      f"{world} ranks, {late:g} s late")
    ranks = []
    for rank in range(world):
        out = (work / f"log.{rank}").read_text()
        result = next((json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")), None)
        if result is None:
            raise RuntimeError(f"rank {rank} printed no result ({work}):\n{out[-3000:]}")
        trace = (work / f"trace.{rank}").read_text(errors="replace")
        counted = parse_trace(trace, run_dir)
        restore = parse_trace(trace, run_dir, RESTORE_BEGIN, RESTORE_END)
        ranks.append({"rank": rank, "per_save": counted["total"] / saves, **counted, "save_s": result["save_s"],
                      "restored": result["restored"], "restore": restore,
                      "restore_lists_run_dir": restore["paths"].get("getdents64 $RUN", 0)})
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    nonzero = [r["per_save"] for r in ranks[1:]]
    return {
        "ranks": world, "late_s": late, "saves": saves, "warmup": warmup, "mib": mib, "wall_s": round(wall, 1),
        "rank0_per_save": ranks[0]["per_save"],
        "nonzero_max_per_save": max(nonzero) if nonzero else None,
        "nonzero_median_per_save": statistics.median(nonzero) if nonzero else None,
        "restore_rank0": ranks[0]["restore"]["total"],
        "restore_nonzero_max": max((r["restore"]["total"] for r in ranks[1:]), default=None),
        "restore_ranks_listing": sum(1 for r in ranks if r["restore_lists_run_dir"]),
        "per_rank": ranks, "kept": str(work) if keep else None,
    }


def _top(rank: dict[str, Any], saves: int, n: int = 8) -> list[str]:
    top = sorted(rank["paths"].items(), key=lambda kv: -kv[1])[:n]
    return [f"    {count / saves:8.1f}/save  {what}" for what, count in top]


def report(results: list[dict[str, Any]], command: str) -> str:
    lines = [f"$ {command}", "",
             f"{'ranks':>5} {'late_s':>6} {'rank0/save':>10} {'max r>0/save':>12} {'median r>0/save':>15} "
             f"{'budget':>7} {'wall_s':>6}"]
    for r in results:
        ok = r["rank0_per_save"] <= BUDGET_RANK0 and (r["nonzero_max_per_save"] or 0) <= BUDGET_NONZERO
        lines.append(f"{r['ranks']:>5} {r['late_s']:>6g} {r['rank0_per_save']:>10.1f} {r['nonzero_max_per_save']:>12.1f} "
                     f"{r['nonzero_median_per_save']:>15.1f} {'ok' if ok else 'OVER':>7} {r['wall_s']:>6.1f}")
    lines += ["", f"budget per save: rank 0 <= {BUDGET_RANK0}, every other rank <= {BUDGET_NONZERO} "
              f"(calls: {', '.join(METADATA)}; markers excluded)", "",
              f"{'ranks':>5} {'late_s':>6} {'restore: rank0':>14} {'max r>0':>7} {'ranks listing RUN_DIR':>21}"]
    for r in results:
        lines.append(f"{r['ranks']:>5} {r['late_s']:>6g} {r['restore_rank0']:>14} {r['restore_nonzero_max']:>7} "
                     f"{r['restore_ranks_listing']:>21}")
    for r in results:
        worst = max(r["per_rank"][1:], key=lambda x: x["total"], default=None)
        lines.append("")
        lines.append(f"{r['ranks']} ranks, {r['late_s']:g} s late:")
        for who in [r["per_rank"][0], *([worst] if worst else [])]:
            calls = ", ".join(f"{k} {v / r['saves']:.1f}" for k, v in sorted(who["calls"].items(), key=lambda kv: -kv[1]))
            sync = ", ".join(f"{k} {v / r['saves']:.1f}" for k, v in sorted(who["sync"].items()))
            label = "rank 0" if who["rank"] == 0 else f"rank {who['rank']} (worst non-zero)"
            lines.append(f"  {label}: {who['per_save']:.1f}/save [{calls}]; not counted: [{sync or 'none'}]; "
                         f"save() to durable {statistics.median(who['save_s']):.3f} s median")
            lines += _top(who, r["saves"])
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=_ints, default=[4, 8, 16], help="world sizes, comma-separated")
    ap.add_argument("--late", type=_floats, default=[0.1, 10.0], help="how late the last rank is, s, comma-separated")
    ap.add_argument("--saves", type=int, default=3, help="measured saves per configuration")
    ap.add_argument("--warmup", type=int, default=3,
                    help="saves before the measured ones (keep_last=2: the third recycles an expired checkpoint)")
    ap.add_argument("--mib", type=int, default=4, help="state per rank, MiB")
    ap.add_argument("--dir", type=Path, default=None, help="where the run directories go (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="per configuration, s (default: 120 + 2 s per rank + (late + 5) per save)")
    ap.add_argument("--keep", action="store_true", help="keep the traces and logs (their folder is printed)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if not a.ranks or min(a.ranks) < 2 or not a.late or min(a.late) < 0 or a.saves < 1 or a.warmup < 0 or a.mib < 1:
        ap.error("need --ranks >= 2, --late >= 0, --saves >= 1, --warmup >= 0, --mib >= 1")
    why = strace_problem()
    if why is not None:
        print(f"metadata_budget: {why}", file=sys.stderr)
        return 2
    command = shlex.join([os.path.basename(sys.executable), *sys.argv]) if argv is None else shlex.join(
        ["metadata_budget.py", *argv])
    base = a.dir or Path(tempfile.mkdtemp(prefix="alpsck-budget-"))
    base.mkdir(parents=True, exist_ok=True)
    results = []
    for world in a.ranks:
        for late in a.late:
            timeout = a.timeout or 120 + 2 * world + (late + 5) * (a.saves + a.warmup)
            try:
                r = one_config(base, world, late, a.saves, a.warmup, a.mib, timeout, a.keep)
            except RuntimeError as e:  # every process was killed; its traces and logs are kept
                print(f"metadata_budget: {e}", file=sys.stderr)
                return 1
            results.append(r)
            print(f"{world} ranks, {late:g} s late: rank 0 {r['rank0_per_save']:.1f}/save, non-zero max "
                  f"{r['nonzero_max_per_save']:.1f}/save ({r['wall_s']:.0f} s)", flush=True)
    if a.dir is None and not a.keep:
        shutil.rmtree(base, ignore_errors=True)
    text = report(results, command)
    print(text)
    if a.out:
        a.out.write_text(json.dumps({"command": command, "metadata_calls": list(METADATA), "sync_calls": list(SYNC),
                                     "budget": {"rank0": BUDGET_RANK0, "nonzero": BUDGET_NONZERO},
                                     "results": results, "report": text}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
