"""The limits alpsck is measured against, taken in the same run on the same directory.

- Raw sequential O_DIRECT write and read bandwidth: fio when installed (libaio, 8 MiB blocks,
  best of 1 job at queue depth 4 and 16 and 4 jobs at depth 4, end_fsync), else a Python
  O_DIRECT loop (reported as such).
- A copy of the state into pre-faulted memory (torch ``copy_`` into touched tensors): the least
  a snapshot can cost.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class RawBandwidth:
    write_bps: float
    read_bps: float
    tool: str  # "fio ..." or "python O_DIRECT"


FIO_CONFIGS = ((1, 4), (1, 16), (4, 4))  # (jobs, iodepth per job); the limit is the best of them


def _fio(path: Path, rw: str, size: int, jobs: int, iodepth: int) -> float:
    part = size // jobs // (8 << 20) * (8 << 20)
    cmd = ["fio", "--name=alpsck-limit", f"--filename={path}", f"--rw={rw}", "--bs=8M", f"--size={part}",
           f"--numjobs={jobs}", f"--offset_increment={part}", "--group_reporting", "--direct=1", "--ioengine=libaio",
           f"--iodepth={iodepth}", "--end_fsync=1", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def _python_direct(path: Path, size: int) -> tuple[float, float]:
    block = 8 << 20
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(4096) * (block // 4096))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    t = time.perf_counter()
    for off in range(0, size, block):
        os.pwritev(fd, [buf], off)
    os.fsync(fd)
    w = size / (time.perf_counter() - t)
    os.close(fd)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    t = time.perf_counter()
    for off in range(0, size, block):
        os.preadv(fd, [buf], off)
    r = size / (time.perf_counter() - t)
    os.close(fd)
    return w, r


def raw_bandwidth(directory: Path, size: int) -> RawBandwidth:
    """Sequential O_DIRECT write/read of ``size`` bytes in ``directory`` (file removed after)."""
    path = directory / "alpsck-raw-limit.dat"
    try:
        if shutil.which("fio"):
            w = max(_fio(path, "write", size, j, qd) for j, qd in FIO_CONFIGS)
            r = max(_fio(path, "read", size, j, qd) for j, qd in FIO_CONFIGS)
            return RawBandwidth(w, r, "fio libaio bs=8M, best of 1 job x QD4, 1 x QD16, 4 x QD4")
        w, r = _python_direct(path, size)
        return RawBandwidth(w, r, "python O_DIRECT bs=8M (fio not installed)")
    finally:
        path.unlink(missing_ok=True)


def prefaulted_copy_seconds(state: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Best time of copying every tensor into already-touched tensors of the same shape."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for t in dst.values():
        t.zero_()  # fault every page in first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        best = min(best, time.perf_counter() - t0)
    return best
