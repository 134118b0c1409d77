"""A node's health, checked in seconds before a start (:func:`node_checks`): one :class:`Check` per thing a
training start needs from the node, each ``ok`` or not with what was found.

- ``run_dir``: the run directory takes a file, its fsync and the directory's, and gives the bytes back (a
  read-only or full mount, a hung file system: ``max_fsync_s``);
- ``memory``: the kernel's available memory (``MemAvailable``) against ``min_free_memory_gib``;
- ``shm``: the free space of the memory tier's root (``/dev/shm``) against ``min_free_shm_gib``;
- ``gpu``: where ``nvidia-smi`` is and sees GPUs: each GPU's uncorrected ECC errors (volatile), pages pending
  retirement, temperature (``max_gpu_temperature_c``) and memory in use (``max_gpu_memory_used``, a fraction:
  another process on the GPU), as NVML reports them through ``nvidia-smi``;
- ``gpu_kernel`` (``gpu_kernel: true``, where torch sees CUDA): a small matrix product on each GPU, its
  result compared with the CPU's, and its time.

Nothing here raises for an unhealthy node: a check that cannot run says so as its finding.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .. import _core
from ..store.durable import replace_durably
from ..store.memory_tier import memory_root
from ..store.names import temp_name
from ..store.preflight import mem_available

_GiB = 1 << 30
PROBE_BYTES = 4096


@dataclass
class Limits:
    """The thresholds of :func:`node_checks` (the job config's ``health`` section, :class:`HealthConfig
    <alpsck.slurm.config.HealthConfig>`, holds them; docs/config.md)."""

    max_fsync_s: float = 10.0
    min_free_memory_gib: float = 0.0
    min_free_shm_gib: float = 0.0
    max_gpu_temperature_c: float = 85.0
    max_gpu_memory_used: float = 1.0
    gpu_kernel: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Limits:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def node_name() -> str:
    """This node's name as SLURM knows it (``SLURMD_NODENAME`` in a job step), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _timed(name: str, fn: Any, *args: Any) -> Check:
    t0 = time.monotonic()
    try:
        ok, detail = fn(*args)
    except Exception as e:  # a check that cannot run fails with why, never raises
        ok, detail = False, f"{type(e).__name__}: {e}"
    return Check(name, ok, detail, round(time.monotonic() - t0, 3))


def _run_dir(run_dir: Path, limits: Limits) -> tuple[bool, str]:
    probe = run_dir / _core.health_probe_file_name(node_name(), os.getpid())
    data = os.urandom(PROBE_BYTES)
    t0 = time.monotonic()
    try:
        replace_durably(probe, data)  # written, fsync'ed, renamed into place, the directory fsync'ed
        took = time.monotonic() - t0
        if probe.read_bytes() != data:
            return False, f"{run_dir}: a {PROBE_BYTES}-byte file read back other bytes than were written"
    except OSError as e:
        return False, f"{run_dir}: cannot write and fsync a file there: {e.strerror or e}"
    finally:
        for leftover in (probe, Path(temp_name(str(probe)))):
            try:
                leftover.unlink()
            except OSError:
                pass
    if took > limits.max_fsync_s:
        return False, f"{run_dir}: a {PROBE_BYTES}-byte write and fsync took {took:.2f} s (max_fsync_s {limits.max_fsync_s:g})"
    return True, f"{run_dir}: written, fsync'ed and read back in {took * 1000:.1f} ms"


def _memory(limits: Limits) -> tuple[bool, str]:
    avail = mem_available()
    if avail is None:
        return limits.min_free_memory_gib <= 0, "MemAvailable unknown (no /proc/meminfo)"
    ok = avail >= limits.min_free_memory_gib * _GiB
    return ok, f"{avail / _GiB:.1f} GiB available (min_free_memory_gib {limits.min_free_memory_gib:g})"


def _shm(limits: Limits) -> tuple[bool, str]:
    root = memory_root()
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    ok = free >= limits.min_free_shm_gib * _GiB
    return ok, f"{root}: {free / _GiB:.1f} GiB free (min_free_shm_gib {limits.min_free_shm_gib:g})"


GPU_QUERY = ("index", "temperature.gpu", "memory.used", "memory.total", "ecc.errors.uncorrected.volatile.total",
             "retired_pages.pending")


def gpu_rows(text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits`` as one dict per GPU."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == len(GPU_QUERY):
            rows.append(dict(zip(GPU_QUERY, cells, strict=True)))
    return rows


def gpu_problems(rows: list[dict[str, str]], limits: Limits) -> list[str]:
    """What is wrong with each GPU of ``rows`` ([]: nothing). A field NVML does not report ([N/A], [Not
    Supported]) is not a problem."""

    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None

    out = []
    for r in rows:
        gpu = f"GPU {r['index']}"
        ecc = num(r["ecc.errors.uncorrected.volatile.total"])
        if ecc:
            out.append(f"{gpu}: {ecc:.0f} uncorrected ECC error(s) since the driver loaded")
        if r["retired_pages.pending"].lower() == "yes":
            out.append(f"{gpu}: pages pending retirement (the GPU needs a reset)")
        temp = num(r["temperature.gpu"])
        if temp is not None and temp > limits.max_gpu_temperature_c:
            out.append(f"{gpu}: {temp:.0f} C (max_gpu_temperature_c {limits.max_gpu_temperature_c:g})")
        used, total = num(r["memory.used"]), num(r["memory.total"])
        if used is not None and total and used / total > limits.max_gpu_memory_used:
            out.append(f"{gpu}: {used:.0f} of {total:.0f} MiB in use before the start "
                       f"(max_gpu_memory_used {limits.max_gpu_memory_used:g})")
    return out


def _gpu(smi: str, limits: Limits) -> tuple[bool, str]:
    answer = subprocess.run([smi, f"--query-gpu={','.join(GPU_QUERY)}", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True, timeout=30)
    if answer.returncode != 0:
        return False, f"nvidia-smi failed (exit {answer.returncode}): {answer.stderr.strip()[:300]}"
    rows = gpu_rows(answer.stdout)
    if not rows:
        return False, f"nvidia-smi listed no GPU: {answer.stdout.strip()[:300]}"
    bad = gpu_problems(rows, limits)
    if bad:
        return False, "; ".join(bad)
    temps = ", ".join(f"{r['temperature.gpu']} C" for r in rows)
    return True, f"{len(rows)} GPU(s): no uncorrected ECC error, no page pending retirement; {temps}"


def _gpu_kernel() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(512, 512, generator=gen, dtype=torch.float64)
    want = a @ a
    took = []
    for i in range(torch.cuda.device_count()):
        t0 = time.monotonic()
        got = (a.to(f"cuda:{i}") @ a.to(f"cuda:{i}")).cpu()
        took.append(time.monotonic() - t0)
        if not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
            return False, f"cuda:{i}: a 512x512 float64 product differs from the CPU's (max diff " \
                          f"{(got - want).abs().max().item():.3g})"
    return True, f"{len(took)} GPU(s): a 512x512 float64 product equals the CPU's ({max(took) * 1000:.0f} ms at most)"


def node_checks(run_dir: str | os.PathLike[str], limits: Limits) -> list[Check]:
    """Every check of this node (module docstring), in order."""
    checks = [_timed("run_dir", _run_dir, Path(run_dir), limits), _timed("memory", _memory, limits),
              _timed("shm", _shm, limits)]
    smi = shutil.which("nvidia-smi")
    if smi is not None and os.environ.get("CUDA_VISIBLE_DEVICES", "x") not in ("", "-1"):
        checks.append(_timed("gpu", _gpu, smi, limits))
        if limits.gpu_kernel:
            checks.append(_timed("gpu_kernel", _gpu_kernel))
    return checks
