"""Retention's Python face: the policy, the decision over a scan, and pins.

The rule itself is the core's (``cpp/core/retention.h``: ``DecideRetention``), the same one the
engine applies after every commit; ``alpsck prune`` asks it here over its scan, so saving and
pruning can never disagree on what a policy keeps. docs/retention.md explains the rules.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .. import _core
from ..errors import NoCheckpointError
from ..options import DEFAULTS, check, check_step, keep_best_text
from .scan import check_run_dir

__all__ = ["PIN_NAME", "RULES", "Policy", "decide", "pin", "unpin"]

PIN_NAME = _core.run_dir_names["pin"]  # a pin: this file in a checkpoint's directory (cpp/core/run_dir.h)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A retention policy: the engine options of the same names (``alpsck.options.SPECS``)."""

    keep_last: int = DEFAULTS["keep_last"]
    keep_every_steps: int = DEFAULTS["keep_every_steps"]
    keep_every_seconds: float = DEFAULTS["keep_every_seconds"]
    keep_best: str = DEFAULTS["keep_best"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_best", keep_best_text(self.keep_best))
        for f in dataclasses.fields(self):
            check(f.name, getattr(self, f.name))
        self._args()  # the rules together: keep_last 0 with another rule is refused by name (UsageError)

    def _args(self, steps: Sequence[tuple[int, float, list[tuple[str, float]], str, bool]] = ()) -> list[str]:
        return list(_core.decide_retention(list(steps), self.keep_last, self.keep_every_steps,
                                           float(self.keep_every_seconds), self.keep_best))

    def describe(self) -> str:
        """The policy as the docs and ``prune --dry-run`` write it."""
        if not self.keep_last:
            return "keep_last 0 (keep all)"
        parts = [f"keep_last {self.keep_last}", "the newest healthy", "pinned"]
        if self.keep_every_steps:
            parts.append(f"keep_every_steps {self.keep_every_steps}")
        if self.keep_every_seconds:
            parts.append(f"keep_every_seconds {self.keep_every_seconds:g}")
        if self.keep_best:
            parts.append("keep_best " + self.keep_best.replace(":", " "))
        return ", ".join(parts)


RULES = tuple(f.name for f in dataclasses.fields(Policy))  # the retention options: keep_last, keep_every_steps, ...


def decide(policy: Policy, infos: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    """step -> the rules that keep it (``""``: it expires), for committed checkpoints as the scan lists
    them (``step``, ``created``, ``metrics``, ``unhealthy``, ``pinned``; any order, each step once)."""
    ordered = sorted(infos, key=lambda i: int(i["step"]))
    steps = [(int(i["step"]), float(i.get("created") or 0.0), list(dict(i.get("metrics") or {}).items()),
              # The health rule is the core's: a flag the scan reports beyond the metrics' own.
              "" if not i.get("unhealthy") else str(i["unhealthy"]), bool(i.get("pinned"))) for i in ordered]
    return dict(zip((s[0] for s in steps), policy._args(steps), strict=True))


def _pin(run_dir: str | os.PathLike[str], step: int, on: bool) -> None:
    path = check_run_dir(run_dir)
    check_step(step)
    why = _core.pin_step(str(path), step, on)
    if why:
        raise NoCheckpointError(why)


def pin(run_dir: str | os.PathLike[str], step: int) -> None:
    """Pin committed checkpoint ``step`` of ``run_dir``: no retention rule (the engine's, prune's) expires
    it until :func:`unpin`. Durable when it returns. NoCheckpointError when there is no such checkpoint."""
    _pin(run_dir, step, True)


def unpin(run_dir: str | os.PathLike[str], step: int) -> None:
    """Release a pin (a checkpoint that holds none is left as it is)."""
    _pin(run_dir, step, False)
