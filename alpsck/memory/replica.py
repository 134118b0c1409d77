"""The replica ring (:class:`Replicator`): each node's newest memory checkpoint is copied to the next node
(node ``i`` to node ``i+1``, the last to the first: any count of two or more), off the training's critical
path, by a thread on each node's leader, over the leaders' own gloo group (host memory to host memory:
:mod:`.wire`).

Every leader handles every memory save, in the order the saves were made (every rank saves the same steps),
so the ring's sends and receives pair up: for each save it waits for its own node's commit, sends that
checkpoint (or word that there is none: the save failed) to the next node, and receives the previous node's
into ``ranks-...`` under the run's memory directory, named after the ranks it holds, where a node that takes
those ranks over finds it. A node keeps one replica: the newest.

Back-pressure: a memory save on a leader first waits until the previous save's replica is sent, so the
checkpoint being sent is never the one a later save recycles (the memory engine keeps one, one in flight).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ..handles import CoreSave
from ..store.names import step_dir
from .nodes import Nodes
from .wire import exchange, keep_only

_STOP = None
CLOSE_TIMEOUT_S = 120.0  # a peer that died leaves the ring waiting: close() gives up after this long


class Replicator:
    """The replica ring's worker on one node's leader (module docstring)."""

    def __init__(self, nodes: Nodes, base: Path, own: Path) -> None:
        self._nodes = nodes
        self._own = own
        k = nodes.count
        self._next = nodes.leader_of((nodes.index + 1) % k)
        self._prev = nodes.leader_of((nodes.index - 1) % k)
        self._into = base / nodes.name((nodes.index - 1) % k)
        self._queue: queue.Queue[CoreSave | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self.error: BaseException | None = None
        self.copies: list[dict[str, Any]] = []  # one per save: step sent, step received, seconds, bytes received
        self._thread = threading.Thread(target=self._run, name="alpsck-replica", daemon=True)
        self._thread.start()

    def submit(self, handle: CoreSave) -> None:
        """Replicate the memory save ``handle`` once it is committed (after :meth:`drain`, called before that
        save started: module docstring)."""
        self._idle.clear()
        self._queue.put(handle)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every replica submitted so far is exchanged; False when ``timeout`` passed first."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            warnings.warn(f"{self._into}: the replica ring did not finish within {CLOSE_TIMEOUT_S:.0f} s (a node's "
                          "leader stopped answering); the newest replica may be missing", RuntimeWarning, stacklevel=3)

    def _run(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is _STOP:
                return
            try:
                if self.error is None:
                    self._exchange(handle)
            except BaseException as e:  # the ring is broken: later saves are not replicated, and close() says so
                self.error = e
                warnings.warn(f"{self._into}: replica of step {handle.step} failed, no more replicas this run: {e}",
                              RuntimeWarning, stacklevel=1)
            finally:
                self._idle.set()

    def _exchange(self, handle: CoreSave) -> None:
        with contextlib.suppress(Exception):  # its error is the caller's (the next save()/wait()), not ours
            handle._settle()
        ok = handle._h.error_message() is None
        t0 = time.monotonic()
        got = exchange(self._nodes.ring, dst=self._next, step=handle.step,
                       source=step_dir(self._own, handle.step) if ok else None, src=self._prev, into=self._into)
        received = 0
        if got is not None:
            keep_only(self._into, step_dir(self._into, got).name)
            received = sum(p.stat().st_size for p in step_dir(self._into, got).iterdir())
        self.copies.append({"sent": handle.step if ok else None, "received": got,
                            "seconds": time.monotonic() - t0, "bytes": received})
