"""Checkpointing methods measured by ``alpsck bench``, one class each, same protocol.

``save(step)`` returns (stall, durable): the seconds the training loop is blocked, and the
seconds until the checkpoint is on stable storage (fsync'ed). ``restore()`` reads the newest
checkpoint back into the live tensors, with the page cache of the checkpoint's files dropped
first, so every method reads from the device, not from RAM.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import _core
from ..checkpointer import Checkpointer
from ..store.durable import fsync_path
from ..store.picker import pick


def drop_page_cache(path: Path, *, write_back: bool = False) -> None:
    """Evict the pages of the file ``path``, or of every file below the directory ``path`` (symlinks left alone),
    from the page cache. Only clean pages go: ``write_back`` fdatasyncs each file first, for files whose writer
    did not."""
    files = [str(path)] if os.path.isfile(path) else [os.path.join(root, name) for root, _, names in os.walk(path)
                                                       for name in names]
    for name in files:
        if os.path.islink(name):
            continue
        fd = os.open(name, os.O_RDONLY)
        try:
            if write_back:
                os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Method:
    """Base: a named method writing below ``directory`` from the live ``state``."""

    name = "method"
    warmups = 1  # saves before the timed ones (the first one's stall is reported as first_stall)

    def __init__(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        self.dir = directory
        self.state = state
        directory.mkdir(parents=True, exist_ok=True)

    def save(self, step: int) -> tuple[float, float]:
        raise NotImplementedError

    def restore(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class AlpsckMethod(Method):
    def __init__(self, directory: Path, state: dict[str, torch.Tensor], *, threads: int, chunk_mib: int,
                 max_in_flight: int, copy_threads: int | None = None, urgent: bool = False) -> None:
        super().__init__(directory, state)
        # keep_last=1: from the third save on, each save recycles an expired checkpoint's files and
        # overwrites them in place, alpsck's steady state. The two warm-up saves get it there.
        self.ck = Checkpointer(directory, threads=threads, chunk_bytes=chunk_mib << 20, max_in_flight=max_in_flight,
                               keep_last=1, copy_threads=copy_threads)
        self.ck.restore(state)  # as a training starts: no checkpoint yet (and the staging memory is prepared)
        self.warmups = 2
        self.urgent = urgent
        self.name = (f"alpsck t={threads} c={chunk_mib}M f={max_in_flight} cp={self.ck.engine.copy_threads}"
                     + (" urgent" if urgent else ""))

    def save(self, step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        h = self.ck.save(step, self.state, urgent=self.urgent)
        t1 = time.perf_counter()
        h.wait()
        return t1 - t0, time.perf_counter() - t0

    def restore(self) -> float:
        drop_page_cache(self.dir)
        t0 = time.perf_counter()
        self.ck.restore(self.state)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ck.close()
        super().close()


class CoreZeroCopyMethod(Method):
    """The C++ core alone writing the tensors' memory as it is (no snapshot copy): the number to
    hold against fio, which also writes straight from memory. Not a safe way to checkpoint a
    changing state — the caller must not touch the tensors until the save is durable."""

    def __init__(self, directory: Path, state: dict[str, torch.Tensor], *, threads: int, chunk_mib: int) -> None:
        super().__init__(directory, state)
        self.name = f"core zero-copy t={threads} c={chunk_mib}M"
        self.engine = _core.Engine(str(directory), {"threads": threads, "chunk_bytes": chunk_mib << 20, "max_in_flight": 1,
                                                    "keep_last": 1})
        self.warmups = 2  # steady state: recycled files, as for AlpsckMethod
        self.extents = [(k, v.reshape(-1).view(torch.uint8)) for k, v in state.items()]

    def save(self, step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        h = self.engine.save(step, self.extents, "", "zerocopy")
        t1 = time.perf_counter()
        h.wait()
        return t1 - t0, time.perf_counter() - t0

    def restore(self) -> float:
        drop_page_cache(self.dir)
        t0 = time.perf_counter()
        path = pick(self.dir).path  # what a restore picks (the one picker), its quick scan timed as before
        assert path is not None, f"{self.dir}: no checkpoint to restore"
        _core.ShardReader(f"{path}/rank-00000.bin").read_into(self.extents, 8)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()
        super().close()


class TorchSaveMethod(Method):
    name = "torch.save+fsync"

    def save(self, step: int) -> tuple[float, float]:
        path = self.dir / f"ckpt-{step}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.dir)
        d = time.perf_counter() - t0
        self.last = path
        return d, d

    def restore(self) -> float:
        drop_page_cache(self.dir)
        t0 = time.perf_counter()
        loaded = torch.load(self.last, weights_only=True)
        for k, v in loaded.items():
            self.state[k].copy_(v)
        return time.perf_counter() - t0


class SafetensorsMethod(Method):
    name = "safetensors+fsync"

    def save(self, step: int) -> tuple[float, float]:
        from safetensors.torch import save_file

        path = self.dir / f"ckpt-{step}.safetensors"
        t0 = time.perf_counter()
        save_file(self.state, str(path))
        fsync_path(path)
        fsync_path(self.dir)
        d = time.perf_counter() - t0
        self.last = path
        return d, d

    def restore(self) -> float:
        from safetensors.torch import load_file

        drop_page_cache(self.dir)
        t0 = time.perf_counter()
        for k, v in load_file(str(self.last)).items():
            self.state[k].copy_(v)
        return time.perf_counter() - t0


class DcpMethod(Method):
    """torch.distributed.checkpoint: ``save`` or ``async_save`` (FileSystemWriter, fsync on)."""

    def __init__(self, directory: Path, state: dict[str, torch.Tensor], *, asynchronous: bool) -> None:
        super().__init__(directory, state)
        self.asynchronous = asynchronous
        self.name = "DCP async_save" if asynchronous else "DCP save"

    def save(self, step: int) -> tuple[float, float]:
        import torch.distributed.checkpoint as dcp

        cid = str(self.dir / f"ckpt-{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            if self.asynchronous:
                fut: Any = dcp.async_save(self.state, checkpoint_id=cid)
                t1 = time.perf_counter()
                fut.result()
            else:
                dcp.save(self.state, checkpoint_id=cid)
                t1 = time.perf_counter()
            fsync_path(self.dir)
        self.last = cid
        return t1 - t0, time.perf_counter() - t0

    def restore(self) -> float:
        import torch.distributed.checkpoint as dcp

        drop_page_cache(self.dir)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            dcp.load(self.state, checkpoint_id=self.last)
            return time.perf_counter() - t0


def peer_methods(base: Path, state: dict[str, torch.Tensor]) -> list[Method]:
    """The peers every alpsck configuration is compared with (safetensors when installed)."""
    peers: list[Method] = [TorchSaveMethod(base / "torch", state), DcpMethod(base / "dcp", state, asynchronous=False),
                           DcpMethod(base / "dcp-async", state, asynchronous=True)]
    try:
        import safetensors.torch  # noqa: F401

        peers.append(SafetensorsMethod(base / "safetensors", state))
    except ImportError:
        pass
    return peers
