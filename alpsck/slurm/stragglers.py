"""Stragglers named (``health.straggler_factor``): a rank persistently slower than its peers, and its node.

In a data-parallel loop every rank's step takes as long as the slowest's (each waits for it in the gradients'
all-reduce), so step times cannot tell who is slow. A save can: each rank's own part of it (from its admission
to its arrival at the commit agreement: the copy, the writes, the seal; no wait for a peer) is timed by the
core and carried in its record to rank 0, which commits (``SaveResult.ranks``: node, arrival, work seconds).
On a node whose CPU, memory or disk is slow, that part is slow too, and that rank arrives last.

:class:`PaceWatch` (rank 0's, fed each committed save's result by the runner through
:data:`alpsck.progress.SAVED_HOOKS`) compares, at each save, each rank's own work with the median of its peers'
on *other* nodes. What is named is a node (the unit of failure; the gate cordons nodes), and ranks that share one
share its disk, memory and CPU: their parts of a save queue behind each other (on one disk the second fsync waits
for the first one's journal commit), so their ratio measures that queue's order, not the node's health. A rank
whose node has no other node beside it in the save is not judged. A rank whose median ratio over its last
``straggler_saves`` saves is at least ``straggler_factor`` (and slower by at least :data:`MIN_GAP_S`: timer noise
on a tiny save is no straggler) is recorded once per start as a ``straggler`` event (node, rank, factor, the
medians, how late it arrived), which ``alpsck status`` lists.
With ``health.cordon_stragglers`` the health gate before the next start cordons its node (:func:`cordon`),
so a spare takes its place.
"""

from __future__ import annotations

import bisect
import statistics
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from . import history, timeline
from .history import Cordoned, Straggler

MIN_GAP_S = 0.01  # a rank is slow at a save only when its work is also this much longer than its peers' median


def _pace(entry: Mapping[str, Any]) -> tuple[int, str, float, float] | None:
    """(rank, node, arrived, work seconds) of one rank's record in a save's result, or None when it carries none."""
    try:
        rank, node = int(entry["rank"]), str(entry.get("node") or "")
        arrived, work = float(entry.get("arrived") or 0.0), float(entry.get("work_seconds") or 0.0)
    except (KeyError, TypeError, ValueError):
        return None
    return (rank, node, arrived, work) if arrived > 0 and work > 0 else None


def _median_without(ordered: list[float], left_out: list[float]) -> float | None:
    """The median of ``ordered`` (sorted) without the values ``left_out`` (sorted; a sub-multiset of it), or None
    when nothing is left: a node's peers', without a list per node (O(len(left_out)) per element read)."""
    skip: list[int] = []  # the positions left out, ascending: an equal value's next copy for a repeated value
    for k, v in enumerate(left_out):
        skip.append(max(bisect.bisect_left(ordered, v), skip[-1] + 1) if k and left_out[k - 1] == v
                    else bisect.bisect_left(ordered, v))
    m = len(ordered) - len(skip)
    if m <= 0:
        return None

    def at(k: int) -> float:  # the k-th of the list without the skipped positions
        for s in skip:
            if s > k:
                break
            k += 1
        return ordered[k]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


class PaceWatch:
    """Rank 0's view of every rank's pace at the saves of this start (module docstring)."""

    def __init__(self, run_dir: str, job_id: str, attempt: int, *, factor: float, saves: int) -> None:
        self.run_dir, self.job_id, self.attempt = run_dir, job_id, attempt
        self.factor, self.saves = factor, saves
        # rank -> its last ``saves`` (ratio, own work, peers' median, lateness)
        self.window: dict[int, deque[tuple[float, float, float, float]]] = {}
        self.named: dict[int, Straggler] = {}
        self.nodes: dict[int, str] = {}  # rank -> the node its latest record named (alpsck.slurm.trace.trace_missing)

    def saw(self, result: Mapping[str, Any]) -> list[Straggler]:
        """One committed save's result: the stragglers it newly names (each recorded in the history)."""
        paces = [p for p in map(_pace, result.get("ranks") or ()) if p is not None]
        nodes = {rank: node for rank, node, _, _ in paces}
        self.nodes.update((rank, node) for rank, node in nodes.items() if node)
        if self.factor <= 0 or len(paces) < 2:
            return []
        out = []
        works, arrivals = sorted(p[3] for p in paces), sorted(p[2] for p in paces)
        groups: dict[str, tuple[list[float], list[float]]] = {}  # node -> its ranks' works and arrivals
        for rank, node, arrived, work in paces:  # a rank whose node is unknown is a node of its own
            g = groups.setdefault(node or f"\0{rank}", ([], []))
            g[0].append(work)
            g[1].append(arrived)
        peers = {key: (_median_without(works, sorted(w)), _median_without(arrivals, sorted(a)))
                 for key, (w, a) in groups.items()}  # on the training thread, after each save: O(n log n)
        for rank, node, arrived, work in paces:
            ref, their_arrival = peers[node or f"\0{rank}"]
            if ref is None or their_arrival is None:
                continue  # no other node in this save: nothing to compare with
            late = arrived - their_arrival
            seen = self.window.setdefault(rank, deque(maxlen=self.saves))
            seen.append((work / ref, work, ref, late))
            if rank in self.named or len(seen) < self.saves:
                continue
            ratio = statistics.median(s[0] for s in seen)
            mine, theirs = statistics.median(s[1] for s in seen), statistics.median(s[2] for s in seen)
            if ratio >= self.factor and mine - theirs >= MIN_GAP_S:
                out.append(self._name(rank, nodes[rank], ratio, mine, theirs, statistics.median(s[3] for s in seen)))
        return out

    def _name(self, rank: int, node: str, ratio: float, mine: float, theirs: float, late: float) -> Straggler:
        event = Straggler(node=node or None, rank=rank, factor=round(ratio, 2), work_s=round(mine, 4),
                          peers_s=round(theirs, 4), late_s=round(late, 4), saves=self.saves, attempt=self.attempt)
        self.named[rank] = event
        history.append(self.run_dir, event, job_id=self.job_id)
        print(f"alpsck: rank {rank} on node {node or '?'} is a straggler: its part of the last {self.saves} saves took "
              f"{ratio:.1f}x its peers' ({mine:.3f} s against {theirs:.3f} s), and it arrived {late:.3f} s after them",
              file=sys.stderr, flush=True)
        return event


def named(events: Sequence[Straggler]) -> list[dict[str, Any]]:
    """The nodes named as stragglers in the run, newest naming first: node, rank, factor, since (the first
    naming), last (the newest), times (how many starts named it) and the newest naming's medians."""
    by_node: dict[str, list[Straggler]] = {}
    for e in events:
        if e.node:
            by_node.setdefault(e.node, []).append(e)
    out = []
    for node, es in by_node.items():
        last = es[-1]
        out.append({"node": node, "rank": last.rank, "factor": last.factor, "work_s": last.work_s,
                    "peers_s": last.peers_s, "late_s": last.late_s, "since": es[0].time, "last": last.time,
                    "times": len(es), "job_id": last.job_id})
    return sorted(out, key=lambda d: -(d["last"] or 0.0))


def cordon(run_dir: str, job_id: str, attempt: int) -> None:
    """The health gate's (``health.cordon_stragglers``): cordon each node the run named as a straggler that is not
    cordoned yet, so that the next start runs without it."""
    tl = timeline.read(Path(run_dir))
    cordoned = tl.cordoned()
    for s in named(tl.of_kind(Straggler)):
        if s["node"] in cordoned:
            continue
        reason = (f"a straggler: rank {s['rank']}'s part of its saves took {s['factor']}x its peers' "
                  f"({s['work_s']} s against {s['peers_s']} s; named {s['times']} time(s))")
        history.append(run_dir, Cordoned(node=s["node"], reason=reason, checks="pace", attempt=attempt),
                       job_id=job_id)
        print(f"alpsck: health gate: node {s['node']} cordoned: {reason}", file=sys.stderr, flush=True)
