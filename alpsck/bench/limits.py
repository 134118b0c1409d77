"""The limits alpsck is measured against, taken in the same run on the same directory.

- Raw sequential O_DIRECT write and read bandwidth (:class:`RawProbe`): fio when installed
  (libaio, 8 MiB blocks, queue depth 16, end_fsync), else a Python O_DIRECT loop (reported as
  such), sampled next to every measured save and restore (an overwrite of one file the size of
  the state, then a read of it). A cloud disk's bandwidth can swing 2-3x between runs seconds
  apart (seen on this project's VM: fio 2.2 to 6.3 GB/s in consecutive runs), so only a sample
  taken next to a measurement compares with it.
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
from pathlib import Path

import torch


def _fio(path: Path, rw: str, size: int) -> float:
    """Bytes/s of one fio pass (libaio, O_DIRECT, 8 MiB blocks, queue depth 16, end_fsync)."""
    cmd = ["fio", "--name=alpsck-limit", f"--filename={path}", f"--rw={rw}", "--bs=8M", f"--size={size}", "--direct=1",
           "--ioengine=libaio", "--iodepth=16", "--end_fsync=1", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


class RawProbe:
    """Raw O_DIRECT write and read of one file the size of the state, sampled on demand.

    The file is written once when the probe is made; each :meth:`write_seconds` then overwrites
    it in place, as alpsck's steady-state saves overwrite their recycled checkpoint files
    (``keep_last``). fio (1 job, queue depth 16, 8 MiB blocks, end_fsync) when installed, else a
    Python O_DIRECT loop. Samples are kept in ``writes`` / ``reads`` (seconds).
    """

    def __init__(self, directory: Path, size: int) -> None:
        self.path = directory / "alpsck-raw-probe.dat"
        self.size = max(8 << 20, size // (8 << 20) * (8 << 20))
        self.fio = shutil.which("fio") is not None
        self.tool = ("fio libaio bs=8M QD16, overwrite in place" if self.fio else "python O_DIRECT bs=8M, overwrite")
        self.writes: list[float] = []
        self.reads: list[float] = []
        self._write()  # lay the file out: later samples overwrite allocated blocks

    def _write(self) -> float:
        if self.fio:
            return self.size / _fio(self.path, "write", self.size)
        return self.size / _python_direct_one(self.path, self.size, write=True)

    def write_seconds(self) -> float:
        self.writes.append(self._write())
        return self.writes[-1]

    def read_seconds(self) -> float:
        bps = _fio(self.path, "read", self.size) if self.fio else _python_direct_one(self.path, self.size, write=False)
        self.reads.append(self.size / bps)
        return self.reads[-1]

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _python_direct_one(path: Path, size: int, *, write: bool) -> float:
    """Bytes/s of one sequential O_DIRECT pass over ``path`` (written in place, no truncation)."""
    block = 8 << 20
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(4096) * (block // 4096))
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        t = time.perf_counter()
        for off in range(0, size, block):
            (os.pwritev if write else os.preadv)(fd, [buf], off)
        if write:
            os.fsync(fd)
        return size / (time.perf_counter() - t)
    finally:
        os.close(fd)


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
