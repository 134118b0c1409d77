"""The DCP StorageReader on the alpsck core: :class:`AlpsckStorageReader` (exported by :mod:`alpsck.dcp`,
whose docstring has the call order and the no-pickle policy)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import uuid
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import _core
from ..errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, StateMismatchError, UsageError
from ..options import DEFAULTS, check_step
from ..store.durable import read_small
from ..store.marker import is_marked, marker_problem
from ..store.names import is_committed_step_dir
from ..store.picker import Skipped, data_error, pick, read_failure
from ..store.shards import shard_name
from ..store.values import decode_value
from .formats import MAX_METADATA_BYTES, METADATA_FILE, ExtentRef, decode_metadata
from .load_plan import LoadPlanInfo, LoadVerdict, check_same_layout, like_live, narrow, set_value
from .paths import (
    checkpoint_path,
    damaged_marker,
    is_alpsck_checkpoint_id,
    rank_local_dir,
    refuse_folder_of_checkpoints,
    same_dir,
)

DEFAULT_READ_BATCH_BYTES = 512 << 20
_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")  # folder/step-20 -> ("step-", "20", ""): its siblings' pattern


def _numbered_siblings(named: Path) -> list[tuple[int, Path]]:
    """The directories beside ``named`` of the same pattern (``folder/step-<n>``), with their numbers."""
    m = _NUMBERED.match(named.name)
    out: list[tuple[int, Path]] = []
    if m is not None:
        with contextlib.suppress(OSError):
            for entry in os.scandir(named.parent):
                s = _NUMBERED.match(entry.name)
                if s is not None and (s[1], s[3]) == (m[1], m[3]) and entry.is_dir(follow_symlinks=False):
                    out.append((int(s[2]), Path(entry.path)))
    return out


def _newer_siblings(named: Path) -> list[str]:
    """The names of the checkpoint directories beside ``named`` with a higher number, ascending."""
    m = _NUMBERED.match(named.name)
    return [] if m is None else [p.name for n, p in sorted(_numbered_siblings(named))
                                 if n > int(m[2]) and is_marked(p)]


def _read_small(path: Path, limit: int) -> bytes:
    data = read_small(path, limit)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path}: larger than {limit} bytes")
    return data


class AlpsckStorageReader(StorageReader):
    """DCP StorageReader for checkpoints written by :class:`AlpsckStorageWriter`, at any world size.

    Args:
        run_dir: a run directory, a checkpoint directory (checkpoint-directory mode), or one
            committed ``run/step-00000000N``; None: the ``checkpoint_id`` given to ``dcp.load``.
        step: the checkpoint to load from a run directory; None: the newest committed one that has
            DCP metadata (a newer one that fails its checks is skipped with a warning naming what
            was wrong).
        threads: reader threads per shard (chunks are CRC-checked on them).
        read_batch_bytes: at most this many bytes of extents are read per batch (bounds the
            temporary memory of chunks that cannot be read straight into their destination).
        direct_io: O_DIRECT reads.
        fallback: a checkpoint directory none of whose generations is valid (``folder/step-20``) is
            skipped with a warning for the newest valid sibling of a lower number (``folder/step-10``),
            checkpoint directories both, when it is the folder's newest step (a resume asking for the newest);
            one with newer siblings was asked for by name (torchtitan's ``load_step``), and raises, naming it.
            False raises always. A run directory never falls back to
            another run directory.
        max_step: with ``step`` None, pick the newest at most this step.
        verify_data: check every chunk CRC of the picked checkpoint before loading it (every rank reads
            every shard of it once more), so one whose data is damaged is skipped for the one before.

    The pick is the picker's (:func:`alpsck.store.picker.pick`, kind "dcp"; docs/guarantees.md): what it
    skipped (an alpsck.Checkpointer checkpoint is ``other_kind``) is warned about. Each load picks its
    checkpoint afresh (a reused reader sees saves committed since, and skips what failed in its
    earlier loads: ``failed``). A chunk that fails its CRC in ``read_data`` (or a read's I/O error), on
    any rank, makes every rank fall back within the same ``dcp.load`` (:meth:`read_data`): a plain
    ``dcp.load``, as torchtitan calls it, never crash-loops on a damaged newest checkpoint.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, step: int | None = None, *,
                 threads: int = DEFAULTS["read_threads"], read_batch_bytes: int = DEFAULT_READ_BATCH_BYTES,
                 direct_io: bool = True, fallback: bool = True, max_step: int | None = None,
                 verify_data: bool = False) -> None:
        super().__init__()
        check_step(step, allow_none=True)
        check_step(max_step, allow_none=True)
        self.max_step = max_step
        self.verify_data = verify_data
        # Checkpoints whose data failed while this reader loaded them (this rank's error, or another rank's report).
        self.failed: dict[Path, BaseException | str] = {}
        self.run_dir: Path | None = None if run_dir is None else checkpoint_path(run_dir, "AlpsckStorageReader")
        if self.run_dir is not None and not is_marked(self.run_dir):
            refuse_folder_of_checkpoints(self.run_dir)
        self.requested_step = step
        self.threads = threads
        self.read_batch_bytes = read_batch_bytes
        self.direct_io = direct_io
        self.fallback = fallback
        self.load_id = str(uuid.uuid4())
        self.step: int | None = None          # the step read_metadata picked
        self.path: Path | None = None         # its directory
        self._metadata: Metadata | None = None
        self._local: Path | None = None  # the rank-local checkpoint read_metadata(rank=...) picked from
        self._foreign = False  # the last global read_metadata() found another writer's checkpoint (said once)

    @property
    def checkpoint_id(self) -> str:
        return str(self.path or self.run_dir or "")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for an alpsck run directory, checkpoint directory, or committed step-N inside one."""
        return is_alpsck_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins (DCP calls this with ``dcp.load(checkpoint_id=...)``): the run directory keeps
        ``step``; any other path is read instead (a checkpoint directory, or a run directory's newest)."""
        if checkpoint_id is not None and (self.run_dir is None or not same_dir(checkpoint_id, self.run_dir)):
            self.run_dir, self.requested_step = checkpoint_path(checkpoint_id, "dcp.load's checkpoint_id"), None
            if not is_marked(self.run_dir):  # in one line, before DCP's load starts
                refuse_folder_of_checkpoints(self.run_dir)
        self.load_id = str(uuid.uuid4())
        self.step = self.path = self._metadata = None
        self._foreign = False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """All ranks: picks the checkpoint (afresh on every call) and returns its validated Metadata.

        DCP asks again with ``rank=`` when that fails, for a checkpoint saved with
        ``use_collectives=False``: with several ranks, each rank's is its own checkpoint in
        ``ID/__<rank>`` (:func:`.paths.rank_local_dir`); none there fails at once.
        """
        rank = kwargs.get("rank")
        local: Path | None = None  # where read_data falls back within, too
        if rank is not None:  # the checkpoint this rank saved with use_collectives=False, beside the others'
            local = None if self.run_dir is None else self.run_dir / rank_local_dir(int(rank))
            if (local is None or not local.is_dir()) and self._foreign:  # DCP joins both reasons: the first says it
                raise UsageError("not an alpsck checkpoint (as said)")
            if local is None or not local.is_dir():
                raise NoCheckpointError(f"{self.run_dir}: no checkpoint of rank {rank} saved with use_collectives=False "
                                        f"({rank_local_dir(int(rank))}/)")
        self._local = local
        md = self._metadata = self._pick(local)
        md.storage_meta = replace(md.storage_meta or StorageMeta(), load_id=self.load_id)
        return md

    def _pick(self, local: Path | None = None) -> Metadata:
        if self.run_dir is None:
            raise UsageError("AlpsckStorageReader() was given no checkpoint: pass checkpoint_id= to dcp.load (or a "
                             "path to AlpsckStorageReader)")
        where, step = local or self.run_dir, self.requested_step
        if step is None and is_committed_step_dir(where):  # run/step-00000000N: that step of its run directory
            where, step = where.parent, _core.parse_run_dir_name(where.name)[1]
        if step is not None:
            return self._pick_step(where, step)
        skipped: list[Skipped] = []
        try:
            md = self._pick_newest(where, skipped, self.max_step)
        except NoCheckpointError as e:
            if not (self.fallback and local is None and is_marked(where)):  # never from one run directory to another
                raise
            newer = _newer_siblings(where)
            if newer:  # not the folder's newest: a step asked for by name (torchtitan's load_step) is that step
                raise NoCheckpointError(f"{e}; {where.name} was asked for by name (the folder has newer: "
                                        f"{', '.join(newer[:3])}), so no older step is loaded instead; name another "
                                        "step, or load the newest") from None
            md, instead = self._pick_sibling(where, skipped)
            warnings.warn(instead, RuntimeWarning, stacklevel=4)
            return md
        for k in skipped:
            warnings.warn(k.warning(), RuntimeWarning, stacklevel=4)
        return md

    def _pick_step(self, run_dir: Path, step: int) -> Metadata:
        p = pick(run_dir, kind="dcp", step=step, verify_data=self.verify_data)
        if p.info is not None:
            return self._load(p.info)
        if not any(i["step"] == step for i in p.scanned):
            raise NoCheckpointError(f"{run_dir}: no checkpoint of step {step}")
        why = p.skipped[0]
        if why.reason == "other_kind":
            raise UsageError(f"{why.path}: not a DCP checkpoint (no {METADATA_FILE}); one written by "
                             "alpsck.Checkpointer is restored with Checkpointer.restore at its world size")
        raise CorruptCheckpointError(f"{why.path}: {why.reason}: {why.message}")

    def _pick_newest(self, run_dir: Path, skipped: list[Skipped], max_step: int | None = None) -> Metadata:
        """The newest valid DCP checkpoint of ``run_dir`` (a generation, in a checkpoint directory), the
        picker's (kind "dcp"); what was skipped on the way is appended to ``skipped``."""
        if not run_dir.exists():
            raise NoCheckpointError(f"{run_dir}: no valid DCP checkpoint (no such directory)")
        why = marker_problem(run_dir)
        if why is not None and damaged_marker(run_dir):  # written anew by the next save
            warnings.warn(f"{why}, and damaged: the directory holds alpsck's checkpoints only, read without it",
                          RuntimeWarning, stacklevel=5)
        elif why is not None:
            self._foreign = True
            moving_in = (f", or convert it to alpsck's format in place: alpsck import-dcp {run_dir} --trust-pickle"
                         if "FileSystemWriter" in why else "")
            raise UsageError(f"{why}, not a checkpoint alpsck wrote: load it with DCP's FileSystemReader{moving_in}")
        p = pick(run_dir, kind="dcp", max_step=max_step, verify_data=self.verify_data)
        skipped.extend(k for k in p.skipped if not k.quiet)  # an attempt: quietly
        for info in p.candidates:
            if Path(info["path"]) in self.failed:  # its data failed on a rank while this reader loaded it
                skipped.append(read_failure(info, self.failed[Path(info["path"])]))
                continue
            if self.verify_data and not info["verified"]:
                bad = data_error(info)
                if bad is not None:
                    skipped.append(bad)
                    continue
            try:
                return self._load(info)
            except CorruptCheckpointError as e:  # UnsafeCheckpointError included
                skipped.append(read_failure(info, e, "corrupt"))
        raise NoCheckpointError(f"{run_dir}: no valid DCP checkpoint" +
                                (f" (skipped: {'; '.join(map(str, skipped))})" if skipped else ""))

    def _pick_sibling(self, named: Path, skipped: list[Skipped]) -> tuple[Metadata, str]:
        """``folder/step-20`` held no valid checkpoint: the newest valid ``folder/step-M``, M < 20 (the
        same name with a lower number), as a run directory falls back to its last good step; with the
        warning that says so."""
        m = _NUMBERED.match(named.name)
        siblings = [(n, p) for n, p in _numbered_siblings(named) if m is not None and n < int(m[2])]
        for _, path in sorted(siblings, reverse=True):
            if not is_marked(path):
                continue
            before = len(skipped)
            try:
                md = self._pick_newest(path, skipped)
            except (NoCheckpointError, UsageError):
                continue
            held = "; ".join(map(str, skipped[:before])) or "no committed checkpoint"
            return md, f"{named} held no valid checkpoint ({held}); loading {path} instead"
        raise NoCheckpointError(f"{named}: no valid DCP checkpoint (skipped: {'; '.join(map(str, skipped)) or 'none'}), "
                                "and no valid one of a lower number beside it")

    def _load(self, info: dict[str, Any]) -> Metadata:
        """The Metadata of one committed checkpoint: ``dcp-metadata.json`` checked against the manifest."""
        path = Path(info["path"])
        try:
            manifest = json.loads(_read_small(path / _core.run_dir_names["manifest"], MAX_METADATA_BYTES))
            entry = next(x for x in manifest["extra"] if x.get("name") == METADATA_FILE)
            want_bytes, want_crc = int(entry["bytes"]), int(entry["crc"])
        except (OSError, ValueError, KeyError, TypeError, StopIteration) as e:
            raise CorruptCheckpointError(f"{path}/MANIFEST.json: no valid entry for {METADATA_FILE} ({e!r})") from e
        data = _read_small(path / METADATA_FILE, MAX_METADATA_BYTES)
        if len(data) != want_bytes or _core.crc32c(data) != want_crc:
            raise CorruptCheckpointError(f"{path / METADATA_FILE}: size or CRC32C differs from the manifest")
        md = decode_metadata(data, str(path / METADATA_FILE), step=info["step"], world_size=info["ranks"])
        self.step, self.path = int(info["step"]), path
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """All ranks: the metadata must be the one this reader's read_metadata returned."""
        if metadata is not self._metadata or self.path is None:
            raise UsageError("AlpsckStorageReader reads only the metadata its own read_metadata() returned")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return replace(plan, storage_data=self.step)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Coordinator: every rank must have picked the same checkpoint (a save may have landed in between)."""
        steps = sorted({p.storage_data for p in plans}, key=str)
        if len(steps) > 1:
            raise UsageError(f"{self.run_dir}: the ranks picked different checkpoints (steps {steps}); pass step= to "
                             "AlpsckStorageReader")
        import torch.distributed as dist

        world = len(plans)
        # Several ranks agree on how their reads went through the process group's store, under keys of this load.
        ns = f"alpsck-dcp-load/{uuid.uuid4().hex}/" if world > 1 and dist.is_initialized() else ""
        return [replace(p, storage_data=LoadPlanInfo(i, world, ns)) for i, p in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """All ranks: reads what ``plan`` asks for, shard by shard, each shard opened once; then the ranks
        agree (:class:`LoadVerdict`) that every one of them read its part without a data failure.

        A chunk that fails its CRC, or a read that fails with an I/O error, on any rank makes every rank
        skip that checkpoint, with a warning naming it and why, and read the same items from the one the
        picker gives next (an older generation, or a lower-numbered sibling checkpoint directory), which
        overwrites what the failed one had filled in: the fall-back of the picker's rule, inside one
        ``dcp.load``. Not with ``fallback=False`` or a pinned ``step``, nor to a checkpoint whose stored
        layout differs from the plan's (saved at another world size): then the data failure is raised.
        """
        if self._metadata is None or self.path is None:
            raise UsageError("read_data before read_metadata")
        info = plan.storage_data
        verdict = LoadVerdict(info if isinstance(info, LoadPlanInfo) else None)
        while True:
            failed: BaseException | None = None
            fatal: BaseException | None = None
            try:
                self._read_plan(plan, planner, self._metadata, self.path)
            except CheckpointError as e:
                if isinstance(e, (UsageError, StateMismatchError, NoCheckpointError)):
                    fatal = e
                else:
                    failed = e  # the checkpoint's bytes, or reading them
            except BaseException as e:
                fatal = e
            outcome, why = verdict.agree(fatal, failed)
            if outcome == LoadVerdict.OK:
                break
            if outcome == LoadVerdict.FATAL:
                if fatal is not None:
                    raise fatal
                raise CheckpointError(f"{self.path}: the load failed on another rank ({why}), so no rank loaded")
            bad = failed if failed is not None else why
            if not self.fallback or self.requested_step is not None:
                if isinstance(bad, BaseException):
                    raise bad
                raise CorruptCheckpointError(f"{self.path}: {bad}")
            self.failed[self.path] = bad
            self._fall_back(plan, verdict)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _fall_back(self, plan: LoadPlan, verdict: LoadVerdict) -> None:
        """Every rank: the checkpoint just read failed on some rank; pick the next (it skips ``failed``, with
        the warning) and check that it stores every item of ``plan`` as the failed one did."""
        old, failed_path = self._metadata, self.path
        assert old is not None
        refusal: BaseException | None = None
        try:
            md = self._pick(self._local)
            self._metadata = md
            md.storage_meta = replace(md.storage_meta or StorageMeta(), load_id=self.load_id)
            check_same_layout(plan, old, md, self.path)
        except BaseException as e:
            refusal = e
        outcome, why = verdict.agree(refusal, None)
        if outcome != LoadVerdict.OK:
            if refusal is not None:
                raise refusal
            raise CheckpointError(f"{failed_path}: its data failed, and another rank could not fall back ({why})")

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner, md: Metadata, path: Path) -> None:
        """Reads every item of ``plan`` from the checkpoint at ``path`` (``md`` its metadata)."""
        storage: dict[MetadataIndex, ExtentRef] = md.storage_data
        by_rank: dict[int, dict[str, list[ReadItem]]] = {}
        refs: dict[str, ExtentRef] = {}
        for req in plan.items:
            ref = storage.get(req.storage_index)
            if ref is None:
                raise CorruptCheckpointError(f"{path}: no stored data for {req.storage_index.fqn!r} at "
                                             f"{req.storage_index.offset}")
            by_rank.setdefault(ref.rank, {}).setdefault(ref.extent, []).append(req)
            refs[f"{ref.rank}/{ref.extent}"] = ref
        for rank in sorted(by_rank):
            shard = path / shard_name(rank)
            reader = _core.ShardReader(str(shard), self.direct_io)
            layout = {name: (offset, size) for name, offset, size in reader.extents}
            wanted = by_rank[rank]
            for name in wanted:
                have = layout.get(name)
                if have is None or have[1] != refs[f"{rank}/{name}"].nbytes:
                    raise CorruptCheckpointError(
                        f"{shard}: extent {name!r} " + ("is missing" if have is None else
                                                        f"has {have[1]} bytes, the metadata says "
                                                        f"{refs[f'{rank}/{name}'].nbytes}"))
            batch: list[tuple[ExtentRef, list[ReadItem]]] = []
            size = 0
            for name in sorted(wanted, key=lambda n: layout[n][0]):
                ref = refs[f"{rank}/{name}"]
                batch.append((ref, wanted[name]))
                size += ref.nbytes
                if size >= self.read_batch_bytes:
                    self._read_batch(reader, shard, batch, planner, md)
                    batch, size = [], 0
            if batch:
                self._read_batch(reader, shard, batch, planner, md)

    def _read_batch(self, reader: _core.ShardReader, shard: Path, batch: list[tuple[ExtentRef, list[ReadItem]]],
                    planner: LoadPlanner, md: Metadata) -> None:
        """One read_into call for the batch's extents, then the copies into the destinations and the commits."""
        dsts: list[tuple[str, torch.Tensor]] = []
        direct: list[tuple[ReadItem, torch.Tensor]] = []  # read straight into the destination
        values: list[tuple[ExtentRef, list[ReadItem], torch.Tensor]] = []
        copies: list[tuple[list[ReadItem], torch.Tensor, torch.Tensor | None]] = []  # (reqs, chunk, resolved dest)
        for ref, reqs in batch:
            if ref.kind in ("json", "raw"):
                buf = torch.empty(ref.nbytes, dtype=torch.uint8)
                if ref.nbytes:
                    dsts.append((ref.extent, buf))
                values.append((ref, reqs, buf))
                continue
            tmd = md.state_dict_metadata[reqs[0].storage_index.fqn]
            assert isinstance(tmd, TensorStorageMetadata)  # decode_metadata checked every storage entry
            sizes = tuple(tmd.chunks[self._chunk_index(tmd, reqs[0])].sizes)
            dtype = tmd.properties.dtype
            resolved: torch.Tensor | None = None
            req = reqs[0]
            if len(reqs) == 1 and not any(req.storage_offsets) and tuple(req.lengths) == sizes:
                resolved = planner.resolve_tensor(req).detach()
                if (resolved.device.type == "cpu" and resolved.dtype == dtype and resolved.is_contiguous()
                        and tuple(resolved.shape) == sizes):
                    if ref.nbytes:
                        dsts.append((ref.extent, resolved.reshape(-1).view(torch.uint8)))
                    direct.append((req, resolved))
                    continue
            chunk = torch.empty(sizes, dtype=dtype)
            if ref.nbytes:
                dsts.append((ref.extent, chunk.reshape(-1).view(torch.uint8)))
            copies.append((reqs, chunk, resolved))
        reader.read_into(dsts, self.threads)
        for req, dest in direct:
            planner.commit_tensor(req, dest)
        for reqs, chunk, resolved in copies:
            for req in reqs:
                src = narrow(chunk, req.storage_offsets, req.lengths)
                dest = resolved if resolved is not None else planner.resolve_tensor(req).detach()
                if dest.shape != src.shape:
                    raise CorruptCheckpointError(f"{shard}: {req.storage_index.fqn!r}: the stored region "
                                                 f"{list(src.shape)} does not fit the destination {list(dest.shape)}")
                dest.copy_(src)
                planner.commit_tensor(req, dest)
        for ref, reqs, buf in values:
            raw = buf.numpy().tobytes()
            default = type(planner).load_bytes is DefaultLoadPlanner.load_bytes
            for req in reqs:
                if ref.kind == "raw":  # a save planner's own bytes: for the load planner's own load_bytes, as they are
                    if default or not isinstance(planner, LoadPlanner):
                        raise UsageError(
                            f"{req.storage_index.fqn!r} was saved as a planner's own bytes (its resolve_data or "
                            f"transform_object), which {type(planner).__name__}.load_bytes would unpickle; alpsck "
                            "never unpickles what it reads: load it with a planner whose load_bytes reads those bytes")
                    planner.load_bytes(req, io.BytesIO(raw))
                    continue
                value = decode_value(raw, f"{shard}:{ref.extent}")  # a fresh object for each destination
                if isinstance(planner, DefaultLoadPlanner):
                    value = like_live(planner.state_dict.get(req.dest_index.fqn), value)
                if default:
                    set_value(planner, req, value)  # what DefaultLoadPlanner does, without its pickle round trip
                    continue
                pickled = io.BytesIO()
                torch.save(value, pickled)  # made here from plain values decoded from JSON, for a custom load_bytes
                pickled.seek(0)
                planner.load_bytes(req, pickled)

    @staticmethod
    def _chunk_index(tmd: TensorStorageMetadata, req: ReadItem) -> int:
        hint = req.storage_index.index
        if hint is not None and 0 <= hint < len(tmd.chunks) and tmd.chunks[hint].offsets == req.storage_index.offset:
            return hint
        for i, c in enumerate(tmd.chunks):
            if c.offsets == req.storage_index.offset:
                return i
        raise CorruptCheckpointError(f"{req.storage_index.fqn!r}: no chunk at {req.storage_index.offset}")


def load(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str] | None = None, *,
         storage_reader: AlpsckStorageReader | None = None, **kwargs: Any) -> int:
    """``dcp.load`` that returns the step loaded, and plans again where one ``dcp.load`` cannot fall back.

    The reader falls back within ``dcp.load`` (:meth:`AlpsckStorageReader.read_data`) when the checkpoint
    it falls back to stores every planned item as the failed one did; one saved at another world size
    cannot stand in for it within that plan, and ``dcp.load`` raises. This loads again then: the
    reader's ``failed`` (the same on every rank: the ranks agreed on it) makes the new plan's pick
    skip the failed checkpoint, with a warning. Nothing else is retried: an error with no checkpoint
    newly skipped, ``fallback=False`` or a pinned ``step`` is raised. ``kwargs`` go to ``dcp.load``
    (``planner``, ``process_group``).
    """
    import torch.distributed.checkpoint as dcp

    reader = storage_reader or AlpsckStorageReader(checkpoint_id)
    while True:
        skipped = len(reader.failed)
        try:
            dcp.load(state_dict, checkpoint_id=checkpoint_id, storage_reader=reader, **kwargs)
        except BaseException:  # DCP's CheckpointException derives from BaseException
            if len(reader.failed) == skipped or not reader.fallback or reader.requested_step is not None:
                raise
            continue
        assert reader.step is not None
        return reader.step
