"""JSON for ``--json`` output: strict JSON, which every parser reads.

``json.dumps`` writes ``NaN`` and ``Infinity`` for non-finite floats (a ``best_loss = inf`` in a
training state, a NaN loss in a history line). Those are not JSON: strict parsers reject the
document and jq silently turns them into other numbers. Here they become the strings ``"nan"``,
``"inf"`` and ``"-inf"``, as the checkpoint tree itself spells them.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` with non-finite floats written as strings (never NaN / Infinity)."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)
