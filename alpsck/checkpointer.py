"""The concurrent checkpointer: whole training state through the C++ core (docs/python-api.md at length).

Call order: ``restore()`` (optional, before training), then ``save()`` as often as wanted,
``wait()``, ``close()``; or use it as a context manager. ``save()`` returns once the snapshot
is taken: every tensor's bytes are copied into the core's staging memory, so the training loop
may change the state right away, while T writer threads make the checkpoint durable in the
background. With ``max_in_flight`` checkpoints still persisting, ``save()`` waits for one to
finish (back-pressure; nothing is dropped). Errors from the background surface on
``handle.wait()`` and on the next ``save()``/``wait()``.

Several ranks (torch.distributed initialised, or ``world_size`` given): every rank constructs
its Checkpointer at the same point and calls ``save()`` with the same steps. Each rank writes its
own shard (its own tree: RNG streams and data position differ per rank) and the core commits the
checkpoint once every rank's shard is durable, coordinating through the file system, so
``save()`` never waits for the other ranks. Tensors under the top-level state keys named in
``replicated`` are identical on every rank (a DDP model, its optimizer) and are written once,
spread over the ranks by size. ``restore()`` is a collective: the ranks agree on the newest
checkpoint that every one of them reads successfully.

Tensors on a GPU (and CPU states with ``overlap_copy=True``) take the pipelined path of
:mod:`alpsck.staging` (a stager per tier's engine): the copy of the optimizers' tensors overlaps the
next forward and backward, and a step pre-hook on each optimizer makes its next ``step()`` wait for it;
anything else that changes a parameter or optimizer state before then must call ``wait_snapshot()`` first.

A run directory holds one history: when ``restore()`` continues from a step older than checkpoints on
disk, the first ``save()`` after it moves those newer ones (an abandoned future) to
``superseded-step-N-*``, with a warning (never restored; removed by ``alpsck prune``); without a
restore, a save retires the checkpoints of its own and later steps that an earlier run left.

A save that a resumed run could not restore is refused before anything is written: each ``save()``
checks its tree against :func:`alpsck.fit.skeleton` of the state ``restore()`` was given (else of the
state at the first ``save()``), as ``restore()`` would (:func:`alpsck.fit.check_restorable`, which says
what is compared), and raises StateMismatchError naming the key path. The check is local to each rank.

The memory tier (``memory=True``): ``save(step, state, tier="memory")`` writes the checkpoint to node shared
memory instead (:mod:`alpsck.store.memory_tier`: same format, a second engine), which outlives a crash of
the process; each node's ranks commit their own, and with several nodes each node's newest is copied to the
next node (:mod:`alpsck.memory`). ``restore()`` takes the newest step held for every rank, from this node's
memory, another node's replica or the run directory, each copy tried once (:mod:`alpsck.memory.restore`).

Threading: one thread drives a Checkpointer (the training loop's); handles may be waited on
from any thread. Nothing read back is ever unpickled: non-tensor state is tagged JSON
(:mod:`alpsck.tree`), tensors are raw bytes checked against their CRC32C.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from . import _core, fit, tree
from .capture import capture
from .errors import DiskFullError, UsageError
from .handles import CoreSave, reap, warn_unreported
from .memory.restore import restore_across_tiers
from .memory.tier import MemoryTier
from .options import (
    CHECKPOINTER_OPTIONS,
    ENGINE_OPTIONS,
    check_metrics,
    check_run_dir_arg,
    check_state,
    check_step,
    resolve,
    with_options,
)
from .progress import RESTORED_HOOKS, SAVED_HOOKS, blocking
from .ranks import Ranks, mine
from .restore import peek, read_checkpoint, restore_into
from .restore.health import spike
from .staging import Stager, guarded_pointers, optimizer_state_to_come
from .store import memory_tier
from .store.engines import check_memory, open_engine
from .store.lustre import LayoutReport, layout_for_run, layout_problem
from .store.picker import pick, taken_at
from .store.preflight import preflight_refusal
from .store.scan import retired_warning
from .store.shards import encode_meta, read_meta

# peek, read_checkpoint and restore_into live in alpsck.restore; imported here as users import them.
__all__ = ["Checkpointer", "CoreSave", "peek", "read_checkpoint", "read_meta", "restore_into"]


class Checkpointer:
    """Persistent concurrent checkpointing of a whole training state (see the module docstring).

    Args:
        run_dir: directory of this run's checkpoints (created if missing).
        **options: the options of the core's table by name (``alpsck.options.CHECKPOINTER_OPTIONS``:
            the engine's, such as max_in_flight, threads, chunk_bytes, keep_last, keep_every_steps,
            keep_best, pin_cpus, numa_node, commit_timeout_s, and spike_factor below; retention:
            docs/retention.md; ``keep_best`` also takes a ``(metric, "min" | "max", k)`` tuple). Their
            defaults, limits and meaning are defined once, in the core (``alpsck.options.SPECS``; the
            table in docs/python-api.md); None takes the default (``keep_last=None`` is refused). A
            value out of range raises UsageError naming it; a name the table lacks, TypeError.
        rank, world_size: default from torch.distributed when it is initialised, else 0 and 1.
        replicated: top-level state keys whose tensors are identical on every rank (written once).
        overlap_copy: None (default): pipelined snapshots for states holding CUDA tensors, the
            core's blocking copy for CPU states. True: also CPU states take the pipelined path
            (the optimizers' tensors are copied while training goes on). False: never (CUDA
            tensors are then copied to the CPU inside ``save()``).
        lustre_layout: on Lustre, the layout a run directory without one of its own gets (rank 0,
            when the checkpointer opens): ``"auto"`` (CSCS's progressive layout, its stripe size
            matched to chunk_bytes), ``"none"``, or ``lfs setstripe`` options (``"-c 8 -S 4M"``).
            No ``lfs`` call on other file systems (:mod:`alpsck.store.filesystem`).
        spike_factor: a save whose metric ``loss`` is above this many times the median of the last
            8 finite ones this checkpointer saved is recorded unhealthy (a loss spike: the picker
            skips it, :func:`alpsck.loss_problem` is the rule); 0 (default): off.
        preflight: before the first save, and when a save grows by more than a tenth, rank 0 checks
            that keep_last + max_in_flight checkpoints of this size fit (free space, inodes, and on
            Lustre the user's quota and the storage targets); when they do not, the save fails on
            every rank before a byte is written, with the numbers (DiskFullError on rank 0). On
            Lustre without a working ``lfs`` (a container image), the layout, quota and targets
            steps are skipped with one RuntimeWarning per process; saves go on.
        memory: the memory tier (module docstring): False (default), True (node shared memory, a
            directory named after the run directory's identity: :func:`alpsck.store.memory_tier.memory_dir_for`),
            or a directory. Its engine keeps one checkpoint, one more in flight, buffered writes.
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, rank: int | None = None, world_size: int | None = None,
                 replicated: Sequence[str] = (), overlap_copy: bool | None = None, lustre_layout: str = "auto",
                 preflight: bool = True, memory: bool | str | os.PathLike[str] = False,
                 _faults: Sequence[dict[str, Any]] = (), **options: Any) -> None:
        # Every value is checked here, before anything is touched: each option against its row of the
        # core's table, then the engine's together by the core's own check (the retention rules).
        opts = resolve(options, CHECKPOINTER_OPTIONS, "Checkpointer()")
        engine_opts = {name: opts[name] for name in ENGINE_OPTIONS}
        _core.check_engine_options(engine_opts)
        if isinstance(replicated, str):
            raise UsageError("replicated must be a sequence of state keys, not one string")
        why = layout_problem(lustre_layout)
        if why is not None:
            raise UsageError(f"lustre_layout: {why}")
        self._spike_factor = opts["spike_factor"] or None
        self._recent_losses: list[float] = []  # the last SPIKE_WINDOW finite, unflagged losses saved
        if not isinstance(preflight, bool):
            raise UsageError(f"preflight: {preflight!r}: must be True or False")
        check_run_dir_arg(run_dir)
        check_memory(memory)
        self.run_dir = Path(run_dir)
        # What this machine, or its view of the file system, refuses, where another rank's may not: with several
        # ranks it is said through the open's collectives, so that every rank raises and none waits for the others
        # until the process group's timeout.
        refused: Exception | None = None
        try:
            _core.check_numa_node(opts["numa_node"])  # this machine has the node: before the run dir
            if self.run_dir.exists() and not self.run_dir.is_dir():
                raise UsageError(f"run directory {self.run_dir} exists but is not a directory")
        except Exception as e:
            refused = e
        self.ranks = Ranks.detect(rank, world_size)
        if refused is not None and self.ranks.world_size == 1:
            try:
                raise refused
            finally:
                refused = None  # no cycle through this frame (alpsck.store.engines)
        self.rank = self.ranks.rank
        self.world_size = self.ranks.world_size
        self.replicated = frozenset(replicated)
        self.overlap_copy = overlap_copy
        self.layout: LayoutReport | None = None  # what rank 0 found and did about the Lustre layout
        self._preflight = preflight
        self._preflight_bytes = 0  # the shard size rank 0 last checked (0: not yet)
        # What the pre-flight check makes room for: keep_last 0 keeps all, the next one at least. The
        # milestone, time and pinned checkpoints cannot be known ahead; the best K can.
        best = int(opts["keep_best"].rsplit(":", 1)[1]) if opts["keep_best"] else 0
        self._keep = opts["keep_last"] + opts["max_in_flight"] + best if opts["keep_last"] else 1
        self._stagers: dict[str, Stager] = {}  # the pipelined path, of each tier's engine: "run_dir", "memory"
        self._hooks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # optimizer -> its hook
        self._owners: dict[tuple[tuple[str, int], ...], dict[str, int]] = {}
        self._engine: _core.Engine | None = None
        self._lock: _core.RunDirLock | None = None
        self._continued_from: int | None = None  # the step restore() continued from (-1: none valid)
        # What restore() checks of the state a fresh process builds (module docstring), and when it was recorded.
        self._recorded: dict[str, tuple[str, Any]] | None = None
        self._recorded_at = ""
        self._fitted: dict[str, Any] = {}  # fit.check_fits's memory of entries that fitted _recorded
        self._pending: list[CoreSave] = []
        self.memory_dir: Path | None = None
        self._memory: MemoryTier | None = None
        self.restored_tier: str | None = None  # where restore() found its step: "memory", "replica", "run_dir" or None
        def layout() -> None:  # rank 0, before its engine opens
            self.layout = self._ensure_layout(lustre_layout, opts["chunk_bytes"])

        rank0_says, say = MemoryTier.words_at_open(memory, self.run_dir) if memory is not False else (None, [])
        try:
            opened = open_engine(self.run_dir, engine_opts, self.ranks, _faults, layout, rank0_says=rank0_says,
                                 say=say, refused=refused)
        finally:
            refused = None  # no cycle through this frame (alpsck.store.engines)
        self._engine, self._lock = opened.engine, opened.lock
        if opts["direct_io"] and not self.engine.direct_io:
            warnings.warn(
                f"{self.run_dir}: the file system refused O_DIRECT; alpsck writes buffered and "
                "fdatasyncs instead (durable, but slower and through the page cache)",
                RuntimeWarning,
                stacklevel=2,
            )
        if memory is not False:
            try:
                self._memory = MemoryTier(memory, self.run_dir, engine_opts, self.ranks, opened)
                self.memory_dir = self._memory.directory
            except BaseException:
                self._release()
                raise

    # help() and editors see the options spelled out, one keyword each, with the table's defaults.
    __signature__ = with_options(__init__, CHECKPOINTER_OPTIONS)

    def _ensure_layout(self, setting: str, chunk_bytes: int) -> LayoutReport | None:
        """The Lustre layout (:func:`alpsck.store.lustre.layout_for_run`)."""
        return layout_for_run(self.run_dir, setting, chunk_bytes, stacklevel=5)

    def _refusal(self, mine: Sequence[tuple[str, torch.Tensor]], memory: MemoryTier | None) -> str:
        """Rank 0's pre-flight (the ``preflight`` argument): why this save must not start, or ''. A save to
        ``memory``: that tier's, by each node's leader (:meth:`alpsck.memory.tier.MemoryTier.refusal`)."""
        if not self._preflight:
            return ""
        size = sum(t.numel() * t.element_size() for _, t in mine)
        if memory is not None:
            return memory.refusal(size)
        if self.rank != 0:
            return ""
        why, self._preflight_bytes = preflight_refusal(self.run_dir, size, self.world_size, self._keep,
                                                       self._preflight_bytes)
        return why

    def _release(self) -> None:
        """Stop the engine (after its saves) and drop the run directory's lock."""
        stagers, self._stagers = list(self._stagers.values()), {}
        for hook in list(self._hooks.values()):
            hook.remove()
        self._hooks.clear()
        engine, self._engine = self._engine, None
        memory, self._memory = self._memory, None
        try:
            for stager in stagers:
                stager.close()  # every snapshot filled: the saves can finish
            if memory is not None:
                memory.close()
            if engine is not None:
                engine.close()
        finally:
            if memory is not None:
                memory.release()  # a clean close leaves no owner behind
            if self._lock is not None:
                self._lock.release()
            self._lock = None

    # -- saving -------------------------------------------------------------------------------

    @property
    def engine(self) -> _core.Engine:
        """The core engine; UsageError once closed, or in a process forked from the one that made it."""
        if self._engine is None:
            raise UsageError("the checkpointer is closed")
        self._engine.check_owner()
        return self._engine

    def _reap(self, *, finished: bool = False) -> None:
        """Drop finished saves (each committed one of the run directory to :data:`SAVED_HOOKS`); raise the first
        background error not yet seen by the caller. ``finished``: every save is known to be done."""
        before = self._pending
        self._pending, failed = reap(before, finished=finished)
        if SAVED_HOOKS:
            kept = {id(h) for h in self._pending}
            for h in before:
                if id(h) not in kept and h is not failed and h.tier == "run_dir" and h._h.error_message() is None:
                    result = h._value()
                    for hook in list(SAVED_HOOKS):
                        hook(self.run_dir, result)
        if failed is not None:
            failed.wait()  # raises the save's error

    @blocking("save")
    def save(self, step: int, state: Mapping[str, Any], *, urgent: bool = False,
             metrics: Mapping[str, Any] | None = None, pin: bool = False, tier: str = "run_dir") -> CoreSave:
        """Snapshot ``state`` as checkpoint ``step`` and persist it in the background.

        ``metrics``: numbers recorded in the checkpoint's manifest (``{"loss": ..., "val_loss": ...}``),
        shown by ``inspect-checkpoints`` and ``status``; NaN and the infinities are kept as such. Rank 0's
        are recorded: pass the same on every rank (a loss all-reduced already). Retention's ``keep_best``
        ranks checkpoints by one of them, and one holding a NaN or an infinity is unhealthy: no restore
        resumes from it unless asked (docs/retention.md).

        ``pin=True`` commits the checkpoint pinned: no retention rule ever expires it (``alpsck unpin``
        releases it).

        By default the snapshot copy finishes before the writes start, which gives the shortest
        stall: on small machines, writes racing the copy slow it down. ``urgent=True``
        overlaps copy and writes for the shortest time to durable (a final checkpoint before a
        preemption deadline).

        ``tier="memory"``: to the memory tier (``memory=True`` at construction; module docstring), by the
        same path as the run directory's; ``pin`` is refused there (it keeps one checkpoint).

        Raises StateMismatchError, with nothing written, when a resumed run could not restore
        this checkpoint into the state recorded at ``restore()`` or the first ``save()`` (module
        docstring).
        """
        check_step(step)
        check_state(state)
        pairs = check_metrics(metrics)
        if not isinstance(pin, bool):
            raise UsageError(f"pin must be True or False, not {pin!r}")
        in_memory = memory_tier.check_tier(tier) == "memory"
        if in_memory and (self._memory is None or pin):
            raise UsageError("save(tier='memory') needs Checkpointer(memory=True)" if self._memory is None else
                             "save(tier='memory', pin=True): the memory tier keeps one checkpoint; pin in the run directory")
        # With spike_factor: why this save's loss is a spike (restore.health.spike), else ""; a fine one joins the window.
        spiked, self._recent_losses = spike(dict(pairs).get("loss"), self._recent_losses, self._spike_factor)
        self.engine  # noqa: B018 -- raises when closed, or in a forked child, before anything is touched
        self._reap()
        cap = capture(state)
        self._check_restorable(step, state, cap.tree)
        memory = self._memory if in_memory else None  # a save to memory: committed by this node's ranks
        where = memory.local if memory is not None else self.ranks
        meta = encode_meta(step, where.rank, where.world_size, cap.tree)
        mine = memory.mine(cap.tensors, self.replicated) if memory is not None else self._mine(cap.tensors)
        cuda = any(t.device.type == "cuda" for _, t in mine)
        refusal = self._refusal(mine, memory)
        engine = memory.engine if memory is not None else self.engine
        if memory is not None:
            memory.before_save()
        try:
            if refusal:
                engine.save(step, [], meta, refuse=refusal)  # aborts the attempt on every rank
                raise DiskFullError(refusal)
            goes_to = "memory" if in_memory else "run_dir"
            if self._is_pipelined(cuda):
                handle = CoreSave(self._pipelined(tier, engine).save(step, mine, meta, self._guard(state),
                                                                     metrics=pairs, unhealthy=spiked, pin=pin), goes_to)
            else:
                extents = [(key, tree.flat_bytes(t)) for key, t in mine]
                handle = CoreSave(engine.save(step, extents, meta, "overlap" if urgent else "snapshot",
                                              metrics=pairs, unhealthy=spiked, pin=pin), goes_to)
        finally:
            self._report_retired(step)  # also what a save that then failed had already moved aside
        self._pending.append(handle)
        if memory is not None:
            memory.replicate(handle)
        return handle

    def _record(self, skeleton: dict[str, tuple[str, Any]] | None, at: str) -> None:
        """What later saves must fit (module docstring), and forget what fitted the previous one."""
        self._recorded, self._recorded_at = skeleton, at
        self._fitted = {}

    def _check_restorable(self, step: int, state: Mapping[str, Any], tree_doc: dict[str, Any]) -> None:
        """StateMismatchError if restoring ``tree_doc`` into the recorded state would fail (module docstring)."""
        if self._recorded is None:
            self._record(fit.skeleton(state), "the first save()")
            return
        fit.check_restorable(self._recorded, self._recorded_at, tree_doc, self._fitted, f"{self.run_dir}: step {step}")

    def _report_retired(self, step: int) -> None:
        """Warn about the abandoned history's checkpoints the save of ``step`` retired (module docstring)."""
        if self._memory is not None:
            self._memory.engine.take_retired()  # snapshots of an abandoned history in memory: retired without a word
        retired = self.engine.take_retired()
        if retired and self.rank == 0:
            warnings.warn(retired_warning(self.run_dir, retired, self._continued_from, step), RuntimeWarning,
                          stacklevel=3)

    def _is_pipelined(self, cuda: bool) -> bool:
        """Whether saves of a state (holding CUDA tensors or not) take the pipelined path."""
        return bool(self.overlap_copy or (cuda and self.overlap_copy is None))

    def _pipelined(self, tier: str, engine: _core.Engine) -> Stager:
        if tier not in self._stagers:
            self._stagers[tier] = Stager(engine, overlap_cpu=bool(self.overlap_copy))
        return self._stagers[tier]

    def _guard(self, state: Mapping[str, Any]) -> set[tuple[str, int]]:
        """Hook every optimizer of ``state`` (once); return the tensors their hooks guard."""
        for obj in state.values():
            if isinstance(obj, torch.optim.Optimizer) and obj not in self._hooks:
                self._hooks[obj] = obj.register_step_pre_hook(self._before_step)
        return guarded_pointers(state)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for stager in list(self._stagers.values()):
            stager.wait_copies()

    @blocking("save")
    def wait_snapshot(self) -> None:
        """Wait until every snapshot taken so far is copied out of the live tensors.

        Needed only on the pipelined path (GPU tensors, or ``overlap_copy=True``) before changing
        parameters or optimizer state other than through ``optimizer.step()``, which waits by
        itself. For CUDA tensors the wait is queued on the current streams (no host block).
        """
        for stager in list(self._stagers.values()):
            stager.wait_copies()

    def _mine(self, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The tensors this rank writes: its own, and the replicated ones assigned to it (:func:`alpsck.ranks.mine`)."""
        return mine(tensors, self.replicated, self.ranks, self._owners)

    @blocking("save")
    def wait(self) -> None:
        """Block until every save so far is durable; raise the first error among them."""
        if self._engine is not None:
            self.engine.wait_all()
        if self._memory is not None:
            self._memory.wait()
        self._reap(finished=True)

    @blocking("save")
    def close(self) -> None:
        """Wait for in-flight saves, stop the writer threads and free staging memory.

        Raises the first background error not yet reported; any further ones are warned about
        (each naming its step), never dropped silently. In a process forked from the one that
        made it (a DataLoader worker), it lets go without waiting: the saves, the threads and the
        run directory's lock are the parent's, and every other method raises UsageError there."""
        if self._engine is None:
            return
        if self._engine.forked:  # a forked child: the engine, its saves and the lock are the parent's
            self._stagers = {}  # its copies are the parent's: never waited for here
            self._pending = []
            self._release()  # here the engine and the lock let go of the parent's untouched
            return
        try:
            self.wait()
        finally:
            warn_unreported(self._pending, self.run_dir, stacklevel=2)
            self._pending = []
            self._release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring ----------------------------------------------------------------------------

    def checkpoints(self, verify: bool = False) -> list[dict[str, Any]]:
        """Every checkpoint directory of the run, ascending by step, with its status."""
        return list(_core.scan(str(self.run_dir), verify=verify))

    def latest_step(self) -> int | None:
        """Step of the checkpoint ``restore()`` tries first, or None: the picker's choice
        (:func:`alpsck.store.picker.pick`, kind "alpsck"; of both tiers, the newer), quick check only (data
        CRCs are read by the restore itself, which falls back to the one before on a mismatch)."""
        steps = [pick(d, kind="alpsck").step for d in (self.run_dir, self.memory_dir) if d is not None and d.is_dir()]
        return max((s for s in steps if s is not None), default=None)

    @blocking("restore")
    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *,
                allow_unhealthy: bool = False, prepare: bool | str = True) -> int | None:
        """Load the newest valid checkpoint (or exactly ``step``) into the live ``state``.

        A checkpoint whose metrics (``save(..., metrics=)``) hold a NaN or an infinity is unhealthy: a
        diverged run's. It is skipped, with a warning naming its step and metrics, in favour of the newest
        healthy one, unless ``allow_unhealthy=True``.

        A checkpoint that fails verification or cannot be read (I/O error) is reported with a
        warning naming what was wrong and skipped in favour of the previous one. With several
        ranks, a checkpoint any rank cannot read is skipped by all; any other error on one rank
        is raised there, and the other ranks raise a CheckpointError naming that rank. Returns the step restored, or None if the
        run has no valid checkpoint (with ``step`` given: NoCheckpointError). The run then
        continues from that step: the next ``save()`` retires newer checkpoints (module
        docstring); nothing on disk changes before it. With the memory tier, the newer of its step and the
        run directory's (module docstring); ``restored_tier`` says which.

        ``prepare``: then :meth:`prepare` the staging memory for saves of the state restored, of every tier
        (True), of one (``"run_dir"`` or ``"memory"``: the only tier this run saves to), or none (False).
        """
        if prepare is not True and prepare is not False and memory_tier.check_tier(prepare) == "memory" \
                and self._memory is None:
            raise UsageError("restore(prepare='memory') needs Checkpointer(memory=True)")
        self.engine  # noqa: B018 -- raises when closed, or in a forked child, before anything is touched
        self.wait_snapshot()
        self.engine.wait_all()
        try:  # the state a fresh process builds, which every later save must fit (module docstring)
            self._record(fit.skeleton(state), "restore()")
        except Exception:  # restore_into reports an unusable state to every rank; the first save records it
            self._record(None, "")
        if self._memory is not None:
            restored, self.restored_tier = self._memory.restore(self.run_dir, state, step=step, ranks=self.ranks,
                                                                allow_unhealthy=allow_unhealthy)
        else:
            restored, self.restored_tier = restore_across_tiers(self.run_dir, None, None, state, step=step,
                                                                ranks=self.ranks, allow_unhealthy=allow_unhealthy)
        if RESTORED_HOOKS:  # the job layer: the step, its tier, and when its state was taken (goodput's work lost)
            where = self.run_dir if self._memory is None or self.restored_tier == "run_dir" else self._memory.directory
            taken = None if restored is None else taken_at(where, restored)  # None: a copy fetched and removed
            for hook in list(RESTORED_HOOKS):
                hook(self.run_dir, restored, self.restored_tier, taken)
        self._continued_from = -1 if restored is None else restored
        self.engine.continue_from(self._continued_from)
        if self._memory is not None:
            self._memory.engine.continue_from(self._continued_from)
        try:
            if prepare is not False:
                self.prepare(state, tier=None if prepare is True else prepare)
        except Exception as e:  # only a head start is lost: the first save sizes its memory itself
            warnings.warn(f"{self.run_dir}: staging memory not prepared ahead of the first save: {e}", RuntimeWarning,
                          stacklevel=2)
        return restored

    def prepare(self, state: Mapping[str, Any], tier: str | None = None) -> None:
        """Size and fault in the staging memory for saves of ``state``, on a background thread: of each
        tier's engine, or of ``tier``'s only (``"run_dir"`` or ``"memory"``).

        Returns at once, also while an earlier call is still faulting (the newest sizes are taken
        up when it is done). Without it the first ``save()`` of a process allocates and faults its
        staging memory while training waits (16-26x the stall of the saves after it). ``restore()``
        calls it, so a training that restores first needs nothing more; call it after building the
        state when you do not restore, and again when the state grew or shrank a lot. An optimizer
        that has no state yet (before its first step) is counted at what its state will be (Adam:
        two tensors per parameter). With ``staging_bytes`` set the pool is already made, at
        construction. A state on a GPU (with ``overlap_copy`` not False) also has the pool
        registered as pinned memory on a background thread once it is faulted
        (:meth:`alpsck.staging.Stager.pin_ahead`), instead of in its first ``save()``.
        """
        check_state(state)
        engines = [("run_dir", self.engine)] + ([("memory", self._memory.engine)] if self._memory else [])
        if tier is not None:
            if memory_tier.check_tier(tier) == "memory" and self._memory is None:
                raise UsageError("prepare(tier='memory') needs Checkpointer(memory=True)")
            engines = [(t, e) for t, e in engines if t == tier]
        tensors = capture(state).tensors
        to_come = optimizer_state_to_come(state)
        gpu = None
        for name, engine in engines:  # each tier's share of the tensors (the memory tier's: of the node's ranks)
            mine = self._memory.mine(tensors, self.replicated) if name == "memory" and self._memory else self._mine(tensors)
            engine.prepare([t.numel() * t.element_size() for _, t in mine] + to_come)
            gpu = gpu or next((t.device for _, t in mine if t.device.type == "cuda"), None)
        if gpu is not None and self._is_pipelined(True):  # overlap_copy=False copies to pageable memory
            for name, engine in engines:
                self._pipelined(name, engine).pin_ahead(gpu)
