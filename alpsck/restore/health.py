"""The health of a training's losses and of a run's checkpoints: the one rule of a bad loss
(:func:`loss_problem`, which saves, :class:`alpsck.restore.Rollback` and the job layer ask), and why a
restore must not start afresh when every checkpoint is unhealthy (:func:`all_unhealthy`)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from ..store.picker import Pick

SPIKE_WINDOW = 8  # the finite losses the spike rule takes the median of (Rollback's default window, the save's)


def loss_problem(value: float, recent: Sequence[float], spike_factor: float | None) -> str | None:
    """What is wrong with one loss value, or None when it is fine: the one health rule of a loss.

    Not finite (NaN, +inf, -inf) is always bad. With ``spike_factor``, a loss above ``spike_factor``
    times the median of ``recent`` (the finite losses just before it) is a spike; fewer than two
    recent values, or a median <= 0, decide nothing. Free of state, so a save path can ask it too.
    """
    if math.isnan(value):
        return "loss is nan"
    if math.isinf(value):
        return f"loss is {'+inf' if value > 0 else '-inf'}"
    if spike_factor is None or len(recent) < 2:
        return None
    median = statistics.median(recent)
    if median > 0 and value > spike_factor * median:
        return (f"loss {value:.6g} is above {spike_factor:g} x the median {median:.6g} of the last "
                f"{len(recent)}")
    return None


def spike(loss: float | None, recent: list[float], spike_factor: float | None) -> tuple[str, list[float]]:
    """A save's spike check: why ``loss`` is a spike over ``recent`` (:func:`loss_problem`), or "", and the
    window after it (a fine loss joins it, the last :data:`SPIKE_WINDOW` kept). A NaN or infinite loss, or
    none, is not judged here: the core judges those by the checkpoint's metrics."""
    if spike_factor is None or loss is None or not math.isfinite(loss):
        return "", recent
    why = loss_problem(loss, recent, spike_factor)
    if why is None:
        return "", [*recent, loss][-SPIKE_WINDOW:]
    return why, recent


def all_unhealthy(picked: Pick) -> str | None:
    """Why a restore must not start afresh: no checkpoint passes, yet some were skipped only as unhealthy (a
    run whose every checkpoint diverged; starting from nothing would throw the run away). None otherwise."""
    sick = [k for k in picked.skipped if k.reason == "unhealthy"]
    if picked.step is not None or not sick:
        return None
    return (f"every checkpoint a restore could use is unhealthy (step {sick[0].step}: {sick[0].message}): pass "
            "allow_unhealthy=True to restore one, or remove them to start afresh")
