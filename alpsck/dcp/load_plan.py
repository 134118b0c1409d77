"""What one DCP load agrees and puts back, beside :class:`alpsck.dcp.reader.AlpsckStorageReader`: the
ranks' verdict on each checkpoint tried (:class:`LoadVerdict`, through the process group's store), whether
a checkpoint fallen back to stores the plan as the failed one did (:func:`check_same_layout`), and the
values read back put into the live state in their live types (:func:`like_live`, :func:`set_value`)."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from ..errors import CorruptCheckpointError
from ..ranks import process_group_store
from ..tree import np


def set_value(planner: LoadPlanner, req: ReadItem, value: Any) -> None:
    """DefaultLoadPlanner.load_bytes's assignment, given the value itself rather than a pickle of it."""
    assert isinstance(planner, DefaultLoadPlanner)
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[req.dest_index.fqn], value)
    else:
        planner.state_dict[req.dest_index.fqn] = value


def like_live(live: Any, value: Any, depth: int = 0) -> Any:
    """``value`` (decoded from JSON) in the type of the live value it replaces, where JSON lost the type and
    the live value says what it was, as FileSystemWriter's pickle keeps it: a named tuple (of the live
    one's class), a tuple, a set or frozenset, an OrderedDict, a NumPy array (from a list: alpsck stored
    arrays as lists before 0.1) or scalar; recursively through containers of the same shape. Anything
    else, or a value that does not fit the live one, is returned as decoded."""
    if live is None or depth > 200:
        return value
    if isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor) and live.device != value.device:
        with contextlib.suppress(RuntimeError):
            return value.to(live.device)  # a tensor inside a value is stored from and read to the CPU
        return value
    if isinstance(live, tuple) and isinstance(value, (tuple, list)) and len(live) == len(value):
        items = [like_live(x, v, depth + 1) for x, v in zip(live, value, strict=True)]
        make = getattr(type(live), "_make", None)
        if hasattr(type(live), "_fields") and callable(make):
            with contextlib.suppress(Exception):
                return make(items)
        if hasattr(type(value), "_fields"):  # a named tuple decoded as one: keep it
            return type(value)(*items)
        return tuple(items)
    if isinstance(live, list) and isinstance(value, list) and len(live) == len(value):
        return [like_live(x, v, depth + 1) for x, v in zip(live, value, strict=True)]
    if isinstance(live, dict) and isinstance(value, dict):
        out = {k: like_live(live.get(k), v, depth + 1) for k, v in value.items()}
        return collections.OrderedDict(out) if type(live) is collections.OrderedDict else out
    if type(live) in (set, frozenset) and isinstance(value, (set, frozenset, list, tuple)):
        with contextlib.suppress(TypeError):
            return type(live)(value)
        return value
    if np is not None and isinstance(live, np.ndarray) and isinstance(value, list):
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            return np.asarray(value, dtype=live.dtype)
        return value
    if (np is not None and isinstance(live, np.generic) and not isinstance(value, bool | np.generic)
            and isinstance(value, int | float | complex)):
        with contextlib.suppress(TypeError, ValueError, OverflowError):
            return type(live)(value)
    return value


def narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


@dataclass(frozen=True)
class LoadPlanInfo:
    """What the coordinator's global plan tells each rank (``LoadPlan.storage_data``): its index among the
    plans, their number, and the store namespace this load's ranks agree under ('' with one rank)."""

    index: int
    world: int
    store_ns: str


class LoadVerdict:
    """How every rank's read of one checkpoint went, agreed by all ranks after their reads: OK (every rank
    read its part), FALL_BACK (a rank's data failed a CRC or its read an I/O error: every rank skips the
    checkpoint) or FATAL (anything else on a rank: every rank raises). Several ranks agree through the
    process group's store (the writer's commit does the same), one round per checkpoint tried, four
    operations per rank per round whatever the world size, and keys removed by the last rank out.
    """

    OK, FALL_BACK, FATAL = 0, 1, 2
    _WEIGHT = {OK: 0, FALL_BACK: 1, FATAL: 1 << 30}

    def __init__(self, info: LoadPlanInfo | None) -> None:
        self.info = info
        self.round = 0

    def agree(self, fatal: BaseException | None, failed: BaseException | None) -> tuple[int, str]:
        """This rank's outcome in, everyone's out: (outcome, one failing rank's report, or '')."""
        mine = self.FATAL if fatal is not None else self.FALL_BACK if failed is not None else self.OK
        info = self.info
        if info is None or info.world == 1 or not info.store_ns:
            return mine, str(fatal or failed or "")
        store = process_group_store()
        ns = f"{info.store_ns}{self.round}/"
        self.round += 1
        if mine != self.OK:
            store.set(f"{ns}why{mine}", f"rank {info.index}: {fatal or failed}"[:4096])
            store.add(f"{ns}verdict", self._WEIGHT[mine])
        if store.add(f"{ns}arrived", 1) == info.world:  # every rank's report is in before "all" is set
            store.set(f"{ns}all", "1")
        store.wait([f"{ns}all"])
        total = store.add(f"{ns}verdict", 0)
        outcome = self.FATAL if total >= self._WEIGHT[self.FATAL] else self.FALL_BACK if total else self.OK
        why = "" if outcome == self.OK else store.get(f"{ns}why{outcome}").decode(errors="replace")
        if store.add(f"{ns}left", 1) == info.world:  # the last rank out removes the round's keys
            for key in (f"why{self.FALL_BACK}", f"why{self.FATAL}", "verdict", "arrived", "all", "left"):
                with contextlib.suppress(Exception):
                    store.delete_key(ns + key)
        return outcome, why


def check_same_layout(plan: LoadPlan, old: Metadata, new: Metadata, path: Path | None) -> None:
    """The checkpoint fallen back to must store every item of ``plan`` (made from ``old``) as ``old`` did: the
    same chunk of the same tensor with the same dtype, or a value of the same kind. Else the data failure
    stands (a checkpoint saved at another world size is loaded by planning for it: a new ``dcp.load``)."""
    for req in plan.items:
        index = req.storage_index
        a, b = old.storage_data.get(index), new.storage_data.get(index)
        same = a is not None and b is not None and a.kind == b.kind
        if same and a.kind not in ("json", "raw"):
            ta, tb = old.state_dict_metadata.get(index.fqn), new.state_dict_metadata.get(index.fqn)
            same = (isinstance(ta, TensorStorageMetadata) and isinstance(tb, TensorStorageMetadata)
                    and ta.properties.dtype == tb.properties.dtype and ta.size == tb.size
                    and [c.sizes for c in ta.chunks if c.offsets == index.offset]
                    == [c.sizes for c in tb.chunks if c.offsets == index.offset])
        if not same:
            raise CorruptCheckpointError(
                f"{path}: stores {index.fqn!r} otherwise than the checkpoint whose data failed (saved at another "
                "world size?), so it cannot stand in for it within this load; alpsck.dcp.load plans again for it")
