"""Pipelined snapshots: chunked asynchronous copies into the core's staging slots.

The default CPU path (:class:`alpsck.Checkpointer` without ``overlap_copy``) lets the C++ core
copy the whole snapshot before ``save()`` returns. This module is the other path, used for
states holding CUDA tensors (always) and for CPU states with ``overlap_copy=True``:

1. ``save()`` opens an *external-fill* save in the core and takes as many staging slots (one
   chunk each) as are free without waiting.
2. Tensors fall in two classes. *Guarded* ones — the parameters and state of the optimizers in
   the state — change only in ``optimizer.step()``, and a step pre-hook (installed by the
   Checkpointer) waits for their copy. Every other tensor is *unguarded*: it may change at any
   time after ``save()`` returns.
3. CUDA: guarded pieces are copied on a side stream (which first waits for the work already
   queued on the current stream), so the next forward and backward overlap the copy; unguarded
   pieces are copied on the current stream, ordered before any later kernel that could change
   them. Pieces that found no slot (the pool is bounded) are copied later; unguarded ones are
   first cloned on the device so that later copy still sees the bytes of ``save()``.
   CPU: unguarded pieces are copied in ``save()``; guarded pieces (with ``overlap_copy``) are
   copied by the feeder thread while training goes on.
4. One feeder thread per Checkpointer issues the deferred copies (waiting for slots that the
   writers free: pipelining), waits for each chunk's CUDA events and submits the chunk to the
   writers. A chunk is written only once its bytes have landed.

The staging pool is one mapping in the core, registered once as pinned memory with CUDA, so
device-to-host copies are true DMA into the memory the writers read: one copy, no growth. The
registration pins every page of the pool, seconds for gigabytes (a public report measured about
3.5 s per buffer on GH200), so it is done ahead, off the training's path: ``prepare()`` (which
``restore()`` calls) starts :meth:`Stager.pin_ahead`, which registers the pool on a background
thread once the core has faulted it in. A first save that comes earlier registers it itself, or
waits for the registration already running (never twice).
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import _core, tree

__all__ = ["Stager", "release_staging_memory"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


@dataclass
class _Piece:
    slot_off: int  # where the bytes go within the chunk's slot
    src: torch.Tensor  # uint8, exactly the bytes to copy
    guarded: bool


@dataclass
class _Chunk:
    index: int
    slot: int | None  # offset in the staging pool; None until a slot is taken
    todo: list[_Piece] = field(default_factory=list)  # copies the feeder still has to issue
    events: list[Any] = field(default_factory=list)  # CUDA events the bytes wait for


class _Snapshot:
    """One save being filled: its chunks, and what the optimizer hook waits for."""

    def __init__(self, step: int, fill: Any, chunks: list[_Chunk]) -> None:
        self.step = step
        self.fill = fill
        self.chunks = chunks
        self.copied = threading.Event()  # every copy issued (CUDA) or done (CPU), or failed
        self.done_events: dict[torch.device, Any] = {}  # side-stream work the hook must wait for


def _is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def guarded_pointers(state: Any) -> set[tuple[str, int]]:
    """(device, data_ptr) of every parameter and state tensor of the optimizers among ``state``'s values."""
    out: set[tuple[str, int]] = set()
    for obj in state.values():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        for group in obj.param_groups:
            for p in group["params"]:
                out.add((str(p.device), p.data_ptr()))
        for st in obj.state.values():
            for v in st.values() if isinstance(st, dict) else ():
                if isinstance(v, torch.Tensor):
                    out.add((str(v.device), v.data_ptr()))
    return out


class Stager:
    """The pipelined-snapshot path of one Checkpointer's engine (see the module docstring)."""

    def __init__(self, engine: _core.Engine, overlap_cpu: bool) -> None:
        self._engine = engine
        self._overlap_cpu = overlap_cpu
        self._pool: torch.Tensor | None = None
        self._registered: int | None = None  # pool address registered with CUDA; -1: registration failed
        self._pin_mu = threading.Lock()  # guards _registered and _closing: one registration at a time
        self._closing = False  # close() began: no registration any more
        self._pinner: threading.Thread | None = None
        self._side: dict[torch.device, Any] = {}
        # Snapshots the optimizer hook may still have to wait for; the feeder drops each once its
        # copies have landed, so saves without an optimizer step in between do not pile up here.
        self._unfinished: list[_Snapshot] = []
        self._mu = threading.Lock()
        self._work: queue.Queue[_Snapshot | None] = queue.Queue()
        self._thread = threading.Thread(target=self._feed, name="alpsck-feeder", daemon=True)
        self._thread.start()

    # -- the training thread ------------------------------------------------------------------

    def save(self, step: int, tensors: list[tuple[str, torch.Tensor]], meta: str, guarded: set[tuple[str, int]],
             commit: str = "auto", metrics: list[tuple[str, float]] | None = None, unhealthy: str = "",
             pin: bool = False) -> Any:
        """Start checkpoint ``step`` of ``tensors`` (key, tensor); returns the core's save handle. ``metrics``
        (:func:`alpsck.options.check_metrics`), ``unhealthy`` and ``pin``: as the core's ``Engine.save``."""
        # An earlier snapshot still waiting for slots must get them first: were this save to take
        # the slots the writers free, the feeder (which submits this save's chunks only after the
        # earlier one's) would wait for them forever. Waits only when the pool ran dry.
        with self._mu:
            earlier = list(self._unfinished)
        for snap in earlier:
            snap.copied.wait()
        srcs: dict[str, tuple[torch.Tensor, bool]] = {}
        for key, t in tensors:
            p = tree.plain(t)
            is_guarded = p.data_ptr() == t.data_ptr() and (str(t.device), t.data_ptr()) in guarded and t.numel() > 0
            srcs[key] = (p.reshape(-1).view(torch.uint8), is_guarded)
        handle, fill = self._engine.save_external(step, [(k, s.numel()) for k, (s, _) in srcs.items()], meta, commit,
                                                  metrics or [], unhealthy, pin)
        if not fill.needed:  # the step is already committed
            return handle
        snap = _Snapshot(step, fill, [_Chunk(i, None) for i in range(int(fill.num_chunks))])
        try:
            self._start(snap, srcs)
        except BaseException as e:
            fill.fail(f"the snapshot of step {step} failed: {type(e).__name__}: {e}")
            if any(_is_cuda(s) for s, _ in srcs.values()):
                torch.cuda.synchronize()  # no copy may land in a slot after it is returned
            fill.finish()  # returns the slots taken
            raise
        with self._mu:
            self._unfinished.append(snap)
        self._work.put(snap)
        return handle

    def _start(self, snap: _Snapshot, srcs: dict[str, tuple[torch.Tensor, bool]]) -> None:
        fill, chunks = snap.fill, snap.chunks
        pool = self._pool_tensor(any(_is_cuda(s) for s, _ in srcs.values()))
        cb = int(fill.chunk_bytes)
        pieces: list[list[_Piece]] = [[] for _ in chunks]
        for name, offset, size in fill.extents:
            src, is_guarded = srcs[name]
            pos, end = int(offset), int(offset) + int(size)
            while pos < end:
                i = pos // cb
                n = min(end, (i + 1) * cb) - pos
                pieces[i].append(_Piece(pos - i * cb, src[pos - int(offset): pos - int(offset) + n], is_guarded))
                pos += n
        # Take the slots that are free now, in order; the rest waits for the writers (feeder).
        for c in chunks:
            c.slot = fill.acquire(c.index, block=False)
            if c.slot is None:
                break
        # Unguarded bytes of chunks without a slot are snapshot now: CPU clones at once, device
        # clones on the current stream, before the side stream's wait below orders every later
        # side-stream copy after them.
        for c, ps in zip(chunks, pieces, strict=True):
            if c.slot is None:
                for p in ps:
                    if not p.guarded:
                        p.src = p.src.clone()
                c.todo = ps
        for dev in {p.src.device for ps in pieces for p in ps if _is_cuda(p.src)}:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))
            self._side_stream(dev).wait_event(ready)
        for c, ps in zip(chunks, pieces, strict=True):
            if c.slot is None:
                continue
            assert pool is not None
            streams = []
            for p in ps:
                dst = pool[c.slot + p.slot_off: c.slot + p.slot_off + p.src.numel()]
                if _is_cuda(p.src):
                    # Guarded: the side stream (the optimizer hook waits for it). Unguarded: the
                    # current stream, ordered before any later kernel that could change it.
                    stream = self._side_stream(p.src.device) if p.guarded else torch.cuda.current_stream(p.src.device)
                    with torch.cuda.stream(stream):
                        dst.copy_(p.src, non_blocking=True)
                    streams.append(stream)
                elif p.guarded and self._overlap_cpu:
                    c.todo.append(p)  # copied by the feeder while training goes on
                else:
                    dst.copy_(p.src)
            c.events = [_record(s) for s in dict.fromkeys(streams)]

    def wait_copies(self) -> None:
        """Make the current streams wait for every pending snapshot copy (CPU: block until done).

        The optimizer step pre-hook calls this: guarded tensors may change after it returns.
        """
        with self._mu:
            pending, self._unfinished = self._unfinished, []
        for snap in pending:
            snap.copied.wait()
            for dev, ev in snap.done_events.items():
                torch.cuda.current_stream(dev).wait_event(ev)

    def pin_ahead(self, device: torch.device) -> None:
        """Register the staging pool as pinned memory on a background thread, once the core's
        ``prepare()`` has sized and faulted it (``device``: one the state's tensors are on).

        Returns at once. Nothing happens when the pool is registered already or a registration
        is on its way; a failure only costs the head start (the first save tries again).
        """
        with self._pin_mu:
            if self._registered is not None or self._closing or (self._pinner is not None and self._pinner.is_alive()):
                return
            self._pinner = threading.Thread(target=self._pin_when_prepared, args=(device,), name="alpsck-pinner",
                                            daemon=True)
            self._pinner.start()

    def _pin_when_prepared(self, device: torch.device) -> None:
        try:
            self._engine.wait_prepared()  # pins pages already there; never competes with the faulting
            with torch.cuda.device(device):
                self._pin()
        except Exception as e:  # noqa: BLE001 - only the head start is lost
            warnings.warn(f"pinning alpsck's staging memory ahead of the first save failed: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=1)

    def _pin(self) -> None:
        """Register the pool's memory (the core's first mapping) with CUDA, unless done or closing."""
        with self._pin_mu:
            if self._registered is not None or self._closing:
                return
            addr, size = int(self._engine.staging_address), int(self._engine.staging_bytes)
            if addr == 0:
                return  # no pool yet (its preparation failed): the first save makes it, then pins
            # Portable: pinned for every device's context, not only the one current on this thread.
            code = int(torch.cuda.cudart().cudaHostRegister(addr, size, _HOST_REGISTER_PORTABLE))
            if code == 0:
                self._registered = addr
            else:  # still correct: copies into pageable memory are synchronous, only slower
                warnings.warn(f"pinning {size} bytes of alpsck staging memory failed (cudaError {code}); device "
                              "copies will not overlap training", RuntimeWarning, stacklevel=5)
                self._registered = -1

    def close(self) -> None:
        """Finish every snapshot, stop the feeder and unpin the staging pool (engine still open)."""
        self._work.put(None)
        self._thread.join()
        self.wait_copies()
        self._pool = None
        with self._pin_mu:  # waits for a registration under way; none starts after this
            self._closing = True
            registered, self._registered = self._registered, None
        if registered is not None and registered > 0:
            torch.cuda.synchronize()
            code = int(torch.cuda.cudart().cudaHostUnregister(registered))
            if code != 0:
                warnings.warn(f"unpinning alpsck's staging memory failed (cudaError {code})", RuntimeWarning,
                              stacklevel=2)

    def _side_stream(self, dev: torch.device) -> Any:
        s = self._side.get(dev)
        if s is None:
            s = self._side[dev] = torch.cuda.Stream(device=dev)
        return s

    def _pool_tensor(self, cuda: bool) -> torch.Tensor | None:
        if self._pool is None:
            self._pool = self._engine.staging_tensor()
        if cuda and self._pool is not None:
            self._pin()  # at once when pin_ahead() did it; waits for one it has under way
        return self._pool

    # -- the feeder thread --------------------------------------------------------------------

    def _feed(self) -> None:
        while (snap := self._work.get()) is not None:
            self._fill(snap)
            del snap  # not kept alive (its fill, events, clones) while waiting for the next one

    def _fill(self, snap: _Snapshot) -> None:
        fill, pool = snap.fill, self._pool
        issued: deque[_Chunk] = deque()  # holding a slot, not yet submitted
        try:
            for c in snap.chunks:
                if c.slot is None:
                    c.slot = fill.acquire(c.index, block=False)
                    while c.slot is None and issued:  # free slots by handing filled chunks over
                        self._submit(fill, issued.popleft())
                        c.slot = fill.acquire(c.index, block=False)
                    if c.slot is None:
                        c.slot = fill.acquire(c.index, block=True)
                    if c.slot is None:
                        return  # the save failed (a write error): finish below reports it
                if c.todo:
                    self._issue(pool, c)
                issued.append(c)
                while issued and all(ev.query() for ev in issued[0].events):
                    self._submit(fill, issued.popleft())
            self._mark_copied(snap)
            while issued:
                self._submit(fill, issued.popleft())
        except BaseException as e:  # noqa: BLE001 - the save's handle reports it
            fill.fail(f"the snapshot copy of step {snap.step} failed: {type(e).__name__}: {e}")
            for c in issued:  # no slot may be reused while a copy into it can still land
                for ev in c.events:
                    try:
                        ev.synchronize()
                    except Exception:  # noqa: BLE001,S110 - the device is already in error
                        pass
        finally:  # finish() returns every slot still held
            if not snap.copied.is_set():
                self._mark_copied(snap)
            snap.chunks = []
            self._retire(snap)  # before finish(): a save that is done has left _unfinished
            fill.finish()

    def _issue(self, pool: torch.Tensor | None, c: _Chunk) -> None:
        assert pool is not None and c.slot is not None
        streams = []
        for p in c.todo:
            dst = pool[c.slot + p.slot_off: c.slot + p.slot_off + p.src.numel()]
            if _is_cuda(p.src):
                s = self._side_stream(p.src.device)  # ordered after save()'s clones
                with torch.cuda.device(p.src.device), torch.cuda.stream(s):
                    dst.copy_(p.src, non_blocking=True)
                # p.src may be a clone made on the current stream and dropped below: without this,
                # the caching allocator could hand its block to the next kernel before the copy ran.
                p.src.record_stream(s)
                streams.append(s)
            else:
                dst.copy_(p.src)
        c.todo = []
        c.events += [_record(s) for s in dict.fromkeys(streams)]

    @staticmethod
    def _submit(fill: Any, c: _Chunk) -> None:
        for ev in c.events:
            ev.synchronize()  # releases the GIL
        c.events = []
        fill.submit(c.index, c.slot)

    def _retire(self, snap: _Snapshot) -> None:
        """Drop ``snap`` from what the optimizer hook waits for, once every copy of it has landed.

        On the feeder thread, at the end of the snapshot: its chunks' events are synchronized
        already (the side-stream events then cost nothing), except after a failure, where this
        also keeps an interrupted copy from landing in a slot that finish() returns.
        """
        try:
            for ev in snap.done_events.values():
                ev.synchronize()  # releases the GIL
        except Exception:  # noqa: BLE001 - the device is in error: leave the wait to the hook
            return
        with self._mu:
            if snap in self._unfinished:  # wait_copies() may have taken it already
                self._unfinished.remove(snap)

    def _mark_copied(self, snap: _Snapshot) -> None:
        for dev, side in list(self._side.items()):  # the training thread may add a device meanwhile
            snap.done_events[dev] = _record(side)
        snap.copied.set()


def _record(stream: Any) -> Any:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


# ------------------------------------------------------------------ staging memory to come
# Tensors per parameter of each optimizer's state (torch.optim's, after its first step), by class
# name; an optimizer not listed counts as 2 (Adam's), over- rather than under-sized.
STATE_TENSORS_PER_PARAM = {"SGD": 1, "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2,
                            "Rprop": 2, "Adagrad": 1, "RMSprop": 1, "ASGD": 2, "SparseAdam": 2}


def optimizer_state_to_come(state: Mapping[str, Any]) -> list[int]:
    """Byte sizes of the state tensors that each optimizer of ``state`` with no state yet will
    create at its first step (plain SGD none; a momentum buffer, Adam's two moments per parameter)."""
    sizes: list[int] = []
    for obj in state.values():
        if not isinstance(obj, torch.optim.Optimizer) or obj.state:
            continue
        name = type(obj).__name__
        for group in obj.param_groups:
            k = STATE_TENSORS_PER_PARAM.get(name, 2)
            if name == "SGD" and not group.get("momentum"):
                k = 0
            if name == "RMSprop":
                k += bool(group.get("momentum")) + bool(group.get("centered"))
            params = [p for p in group["params"] if p.requires_grad]
            sizes += [p.numel() * p.element_size() for p in params for _ in range(k)]
            if name != "SGD":  # and a 0-d float32 step count per parameter
                sizes += [4] * len(params)
    return sizes


# ------------------------------------------------------------------ which NUMA node staging belongs on
# Which NUMA node a rank's staging memory belongs on: the one of its GPU's CPU.
#
# On a GH200 node each of the four GPUs has its own Grace CPU with its own memory (one NUMA node
# each). A rank's device-to-host copies and the writers' reads of its staging memory stay on that
# superchip only if the memory is there too; elsewhere every byte crosses the links between the
# chips. Pass the node to the Checkpointer as ``numa_node`` (the engine option, which places the
# staging pool there with ``mbind``; -1, the default, leaves it wherever the thread that faults it
# in runs)::
#
#     ck = alpsck.Checkpointer(run_dir, numa_node=alpsck.gpu_numa_node())
#
# The node is read from the kernel (the GPU's PCI device in sysfs), never guessed from the local
# rank: a wrong guess would be worse than the default.


def _pci_address(device: torch.device) -> str | None:
    """The sysfs name of a CUDA device's PCI function (``0000:01:00.0``), or None if torch does not say."""
    props = torch.cuda.get_device_properties(device)
    bus, dev, domain = (getattr(props, f"pci_{k}_id", None) for k in ("bus", "device", "domain"))
    if not all(isinstance(v, int) for v in (bus, dev, domain)):
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def release_staging_memory() -> int:
    """Unmap the staging memory a closed Checkpointer left for this process's next one; its size in bytes.

    A closed engine's staging pool is kept (one, the newest) so that the next Checkpointer of the process copies
    into memory already faulted in: integrations that open one per checkpoint path (Lightning's CheckpointIO, the
    Trainer) would otherwise fault a new pool for every save. Call this when no more checkpoints come and the
    memory is wanted back before the process ends.
    """
    return int(_core.release_spare_staging())


def gpu_numa_node(device: torch.device | int | None = None, *, sysfs: str | Path = "/sys") -> int:
    """The NUMA node of the CPU attached to CUDA ``device`` (default: the current one), or -1.

    -1 (the ``numa_node`` option's "no placement") when there is no CUDA device, when the kernel
    does not know the device's node (sysfs says -1, as on many VMs), or when that node has no
    CPUs (a node of GPU memory: staging memory belongs on the CPU's node).
    """
    if not torch.cuda.is_available():
        return -1
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device) \
        if not isinstance(device, torch.device) else device
    address = _pci_address(dev)
    if address is None:
        return -1
    return node_of_pci_device(address, sysfs=sysfs)


def node_of_pci_device(address: str, *, sysfs: str | Path = "/sys") -> int:
    """The NUMA node sysfs gives PCI function ``address`` if that node has CPUs, else -1."""
    try:
        node = int((Path(sysfs) / "bus" / "pci" / "devices" / address / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1
    if node < 0:
        return -1
    return node if node in _core.cpu_numa_nodes(str(sysfs)) else -1
