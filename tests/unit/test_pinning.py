"""Pinning the staging pool for a GPU state ahead of the first save (alpsck.staging.Stager.pin_ahead).

Registering memory with CUDA pins every page, seconds for gigabytes; done in the first save, it
was a stall of the training (issue #25). ``prepare()`` (and ``restore()``, which calls it) now
registers the pool on a background thread once the core has faulted it in.

This machine has no GPU: the CUDA runtime (``torch.cuda.cudart()``, ``torch.cuda.device``,
``torch.cuda.synchronize``) is replaced by a recorder, the only fake here. The engine, its
background preparation and the pool's memory are real, and the tests check the pool as the
kernel sees it when the registration comes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.smaps import mapping_field

import alpsck
from alpsck.staging import Stager

MIB = 1 << 20
GPU = torch.device("cuda", 0)


class FakeCudaRuntime:
    """Records cudaHostRegister/Unregister; a registration blocks until ``release`` is set."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple[str, int, int, int, str]] = []  # (op, address, size, flags, thread)
        self.rss_at_register = -1  # bytes of the registered range resident when it was registered
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def cudaHostRegister(self, addr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", addr, size, flags, threading.current_thread().name))
        self.rss_at_register = _resident_bytes(addr)
        self.entered.set()
        assert self.release.wait(60)
        return self.code

    def cudaHostUnregister(self, addr: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("unregister", addr, 0, 0, threading.current_thread().name))
        return 0

    def ops(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudaRuntime]:
    fake = FakeCudaRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    yield fake


def _resident_bytes(addr: int) -> int:
    """Rss of this process's mapping that holds ``addr``."""
    return int(mapping_field(addr, "Rss")[0]) * 1024


def _checkpointer(run: Path) -> alpsck.Checkpointer:
    return alpsck.Checkpointer(run, chunk_bytes=MIB, threads=2, max_in_flight=1)


def _pinner(stager: Stager) -> threading.Thread:
    t = stager._pinner
    assert t is not None, "pin_ahead started no thread"
    return t


def test_pin_ahead_registers_the_faulted_pool_on_its_own_thread(tmp_path: Path, cuda: FakeCudaRuntime) -> None:
    with _checkpointer(tmp_path / "run") as ck:
        ck.engine.prepare([64 * MIB])
        stager = ck._pipelined("run_dir", ck.engine)
        cuda.release.clear()
        t0 = time.monotonic()
        stager.pin_ahead(GPU)
        returned_after = time.monotonic() - t0
        assert cuda.entered.wait(60), "the pool was never registered"
        # pin_ahead returned before the registration (still blocked) could have: off the caller's path.
        assert not cuda.release.is_set() and returned_after < 30  # blocked, it would wait for release: forever
        ((op, addr, size, flags, thread),) = cuda.calls
        assert (op, thread) == ("register", "alpsck-pinner")
        assert (addr, size) == (ck.engine.staging_address, ck.engine.staging_bytes) and addr != 0
        assert size >= 64 * MIB
        assert flags == 1  # cudaHostRegisterPortable: pinned for every device's context
        # Registered after the core faulted the pool in: pinning pages that are already there.
        assert cuda.rss_at_register >= size
        cuda.release.set()
        _pinner(stager).join(60)
        stager.pin_ahead(GPU)  # registered already: nothing more
        assert cuda.ops() == ["register"]
    assert cuda.ops() == ["register", "unregister"]  # close() unpinned what was pinned
    assert cuda.calls[1][1] == cuda.calls[0][1]


def test_a_first_save_during_the_registration_waits_for_it_and_never_registers_twice(
        tmp_path: Path, cuda: FakeCudaRuntime) -> None:
    with _checkpointer(tmp_path / "run") as ck:
        ck.engine.prepare([16 * MIB])
        stager = ck._pipelined("run_dir", ck.engine)
        cuda.release.clear()
        stager.pin_ahead(GPU)
        assert cuda.entered.wait(60)
        pools: list[Any] = []
        first_save = threading.Thread(target=lambda: pools.append(stager._pool_tensor(True)))
        first_save.start()  # what the first save of a CUDA state does before its copies
        first_save.join(0.5)
        assert first_save.is_alive(), "the save went on while the pool was being pinned"
        cuda.release.set()
        first_save.join(60)
        assert not first_save.is_alive() and pools and pools[0] is not None
        assert cuda.ops() == ["register"]
    assert cuda.ops() == ["register", "unregister"]


def test_close_during_the_preparation_pins_nothing(tmp_path: Path, cuda: FakeCudaRuntime) -> None:
    ck = _checkpointer(tmp_path / "run")
    ck.engine.prepare([1024 * MIB])  # a GiB to fault: close() comes long before it is done
    stager = ck._pipelined("run_dir", ck.engine)
    stager.pin_ahead(GPU)
    ck.close()
    closed = len(cuda.calls)
    _pinner(stager).join(60)
    assert not _pinner(stager).is_alive()
    assert len(cuda.calls) == closed, "the pool was registered after close()"
    assert cuda.ops().count("register") == cuda.ops().count("unregister")  # whatever was pinned was unpinned


def test_a_failed_registration_warns_and_is_neither_retried_nor_unpinned(tmp_path: Path,
                                                                          cuda: FakeCudaRuntime) -> None:
    cuda.code = 2  # cudaErrorMemoryAllocation
    with _checkpointer(tmp_path / "run") as ck:
        ck.engine.prepare([8 * MIB])
        stager = ck._pipelined("run_dir", ck.engine)
        with pytest.warns(RuntimeWarning, match=r"pinning \d+ bytes of alpsck staging memory failed \(cudaError 2\)"):
            stager.pin_ahead(GPU)
            _pinner(stager).join(60)
        assert stager._pool_tensor(True) is not None  # the first save copies into pageable memory
        assert cuda.ops() == ["register"]
    assert cuda.ops() == ["register"]  # close() does not unpin what was never pinned


def test_a_cpu_state_is_not_pinned(tmp_path: Path, cuda: FakeCudaRuntime) -> None:
    model = torch.nn.Linear(256, 256)
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters())}
    with _checkpointer(tmp_path / "run") as ck:
        assert ck.restore(state) is None  # prepares
        ck.engine.wait_prepared()
        assert ck.engine.staging_slots > 0
        assert ck._stagers == {}  # no pipelined path, no pinner
        ck.save(1, state).wait()
    assert cuda.calls == []
