"""The retention rule's inputs as hypothesis draws them (a policy, a sequence of saves with metrics and pins),
and a run directory's committed steps."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import strategies as st

from alpsck.store.retention import Policy
from alpsck.store.scan import scan_run_dir


def committed_steps(run: Path) -> list[int]:
    return [i["step"] for i in scan_run_dir(run) if i["status"] == "committed"]


METRIC_VALUES = st.one_of(st.floats(min_value=-10, max_value=10), st.sampled_from([math.nan, math.inf, -math.inf]))


SAVE_DRAWS = st.fixed_dictionaries({
    "gap": st.integers(1, 7),  # the next step is this much later
    "dt": st.floats(0, 100),   # and saved this many seconds later
    "metrics": st.dictionaries(st.sampled_from(["loss", "val"]), METRIC_VALUES, max_size=2),
    "pinned": st.booleans(),
})


POLICIES = st.builds(Policy, keep_last=st.integers(1, 5), keep_every_steps=st.sampled_from([0, 2, 5, 10]),
                    keep_every_seconds=st.sampled_from([0.0, 30.0, 120.0]),
                    keep_best=st.sampled_from(["", "val:min:1", "val:max:2", "loss:min:3"]))


def infos_of(seq: list[dict[str, object]]) -> list[dict[str, object]]:
    infos, step, t = [], 0, 0.0
    for s in seq:
        step += int(s["gap"])  # type: ignore[call-overload]
        t += float(s["dt"])  # type: ignore[arg-type]
        metrics = dict(s["metrics"])  # type: ignore[call-overload]
        sick = ", ".join(f"{k}={v}" for k, v in metrics.items() if not math.isfinite(v))
        infos.append({"step": step, "created": t, "metrics": metrics, "unhealthy": sick or None,
                      "pinned": s["pinned"]})
    return infos
