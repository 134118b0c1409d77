"""The ranks agree on each commit through torch.distributed's store (StoreAgreement behind the
engine, PyKvStore in the binding): real TCPStores, real engines on a real run directory.

The protocol itself, at 1,024 ranks and with faults, is cpp/tests/test_store_agreement.cc; whole
gloo jobs are tests/ranks/test_distributed.py. Here: the binding's adaptation of a c10d store (its
timeouts, its failures, the GIL), and that the store is left clean."""

from __future__ import annotations

import datetime
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from alpsck import _core
from alpsck.errors import CheckpointError


def _server(timeout_s: float = 30) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _client(server: dist.TCPStore, timeout_s: float = 30) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=timeout_s))


def _save_on_every_rank(run: Path, engines: list[Any], step: int) -> list[BaseException | None]:
    """Each engine saves ``step`` from its own Python thread (as each rank's main thread would)."""
    out: list[BaseException | None] = [None] * len(engines)
    data = torch.arange(1 << 16, dtype=torch.float32)

    def one(rank: int) -> None:
        try:
            h = engines[rank].save(step, [("w", data.view(torch.uint8))])
            h.wait()
        except BaseException as e:
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_four_ranks_commit_through_a_tcpstore_and_leave_no_key(tmp_path: Path) -> None:
    server = _server()
    engines = [_core.Engine(str(tmp_path), {"keep_last": 2, "commit_timeout_s": 30}, rank=r, world_size=4,
                            store=_client(server), store_ns="alpsck/t1/") for r in range(4)]
    base = server.num_keys()  # a client's connection counts as a key of the server's own
    try:
        for step in (1, 2, 3):
            assert _save_on_every_rank(tmp_path, engines, step) == [None] * 4
    finally:
        for e in engines:
            e.close()
    assert [(i["step"], i["status"], i["ranks"]) for i in _core.scan(str(tmp_path))] == [
        (2, "committed", 4), (3, "committed", 4)]
    assert server.num_keys() == base and server.list_keys() == []  # every attempt's keys deleted by its last reader


def test_a_store_that_fails_fails_the_save_naming_it_and_commits_nothing(tmp_path: Path) -> None:
    class Broken:
        def clone(self) -> Broken:
            return self

        def __getattr__(self, name: str) -> Any:
            def fail(*args: object) -> None:
                raise ConnectionResetError(f"{name}: the server went away")
            return fail

    engine = _core.Engine(str(tmp_path), {"commit_timeout_s": 2}, store=Broken(), store_ns="alpsck/t2/")
    try:
        with pytest.raises(CheckpointError, match=r"the server went away"):
            engine.save(1, [("w", torch.zeros(100, dtype=torch.uint8))]).wait()
    finally:
        engine.close()
    assert not any(i["status"] == "committed" for i in _core.scan(str(tmp_path)))


def test_a_store_server_that_vanishes_mid_save_fails_every_rank_with_one_verdict_on_disk(tmp_path: Path) -> None:
    """Rank 1 never arrives; the server goes away while ranks 0 and 2 wait: both fail, and the
    disk holds no committed step 1 (the disk decides when the store cannot)."""
    server = _server(timeout_s=5)
    engines = [_core.Engine(str(tmp_path), {"commit_timeout_s": 5}, rank=r, world_size=3, store=_client(server, 5),
                            store_ns="alpsck/t3/") for r in (0, 2)]
    out: dict[int, BaseException | None] = {}

    def one(i: int, rank: int) -> None:
        try:
            engines[i].save(1, [("w", torch.zeros(4096, dtype=torch.uint8))]).wait()
            out[rank] = None
        except BaseException as e:
            out[rank] = e

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate((0, 2))]
    for t in threads:
        t.start()
    del server  # the TCPStore server (this process's master) shuts down
    for t in threads:
        t.join(60)
    try:
        assert set(out) == {0, 2} and all(isinstance(e, CheckpointError) for e in out.values()), out
    finally:
        for e in engines:
            e.close()
    assert not any(i["status"] == "committed" for i in _core.scan(str(tmp_path)))


def test_engines_opened_per_save_share_one_set_of_connections(tmp_path: Path) -> None:
    """The DCP writer opens an engine per save on each rank, and a TCPStore clone is a new connection
    (about 1 ms, and on torch 2.13 now and then 5 s). Through one ``StoreClients`` (what
    ``alpsck.ranks.store_clients`` keeps per process) five saves of two ranks, each with new engines,
    reuse the same few connections; given the store itself, each engine clones its own."""
    server = _server()
    shared = _core.StoreClients(_client(server))
    for step in range(1, 6):
        engines = [_core.Engine(str(tmp_path), {"commit_timeout_s": 30, "keep_last": 0}, rank=r, world_size=2, store=shared,
                                store_ns=f"alpsck/t4-{step}/") for r in range(2)]
        try:
            assert _save_on_every_rank(tmp_path, engines, step) == [None, None]
        finally:
            for e in engines:
                e.close()
    assert [i["step"] for i in _core.scan(str(tmp_path)) if i["status"] == "committed"] == [1, 2, 3, 4, 5]
    assert 1 <= shared.clients_made <= 3, shared.clients_made  # two ranks at once, and a late reader: never 10
    assert server.list_keys() == []


def test_store_clients_are_one_per_process_group_store_and_keep_none_alive(tmp_path: Path) -> None:
    """One StoreClients per process group's store, made again for a new group (an elastic restart on the
    same port); it holds a clone and a weak reference, never the group's store (rank 0's TCPStore server),
    which goes when its group is destroyed."""
    import gc
    import socket
    import weakref

    from alpsck.ranks import process_group_store, store_clients

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    previous = None
    for _ in range(2):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=20))
        try:
            first = store_clients()
            assert store_clients() is first and isinstance(first, _core.StoreClients)
            assert process_group_store() is process_group_store()  # the identity store_clients keys on
            group_store = weakref.ref(process_group_store())
            engine = _core.Engine(str(tmp_path), {"keep_last": 0}, store=first, store_ns="alpsck/t5/")
            engine.close()
            assert first is not previous
            previous = first
        finally:
            dist.destroy_process_group()
        gc.collect()
        assert group_store() is None, "alpsck's clients keep the destroyed group's store alive"
