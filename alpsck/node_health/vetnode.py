"""A vetnode config read as the health gate's thresholds (``health.vetnode``).

CSCS's ``vetnode`` (github.com/eth-cscs/vetnode) vets nodes before a job from a YAML list of ``evals``, each a
``name``, a ``type`` and its own settings. Those alpsck's checks do the same as are taken over:

- the GPU eval (``...gpu_eval.GPUEval``, ``gpu-eval``): ``max_temp`` is ``max_gpu_temperature_c``,
  ``max_used_memory`` (a fraction of the GPU's memory) is ``max_gpu_memory_used``;
- the CUDA kernel eval (``...cuda_eval.CUDAEval``, ``cuda-eval``): ``gpu_kernel: true``.

The others are not run, and :func:`read` says so, each with why: vetnode's NCCL evals time an all-reduce between
GPUs, and alpsck's link probe is gloo's over host memory and TCP, whose rates no NCCL threshold fits (it keeps
``health.min_link_gbps``); the rest (environment variables, internet access, pings) have no alpsck check.
A key given in the job config's ``health`` section wins over the vetnode config's.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

MAX_BYTES = 1 << 20

_GPU = ("vetnode.evaluations.gpu_eval.GPUEval", "gpu-eval")
_KERNEL = ("vetnode.evaluations.cuda_eval.CUDAEval", "cuda-eval")


class VetnodeError(ValueError):
    """The vetnode config cannot be read as thresholds: the message names the eval and its key."""


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise VetnodeError(f"{what}: {v!r} is not a number")
    return float(v)


def thresholds(text: str) -> tuple[dict[str, Any], list[str]]:
    """(the health keys a vetnode config's evals set, with their values; one line per eval alpsck does not run, with
    why). VetnodeError when it is not a vetnode config or an eval alpsck reads is malformed."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise VetnodeError(f"not YAML: {str(e).splitlines()[0]}") from None
    evals = doc.get("evals") if isinstance(doc, dict) else None
    if not isinstance(evals, list):
        raise VetnodeError("no list of evals (a vetnode config has 'evals:', each with a name and a type)")
    keys: dict[str, Any] = {}
    skipped: list[str] = []
    for i, ev in enumerate(evals):
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            raise VetnodeError(f"evals[{i}]: not an eval with a type")
        name, kind = str(ev.get("name", f"evals[{i}]")), ev["type"]
        if kind in _GPU:
            if "max_temp" in ev:
                keys["max_gpu_temperature_c"] = _number(ev["max_temp"], f"{name}: max_temp")
            if "max_used_memory" in ev:
                used = _number(ev["max_used_memory"], f"{name}: max_used_memory")
                if not 0 <= used <= 1:
                    raise VetnodeError(f"{name}: max_used_memory: {used:g}: alpsck reads it as a fraction of the GPU's "
                                       "memory (0 to 1)")
                keys["max_gpu_memory_used"] = used
        elif kind in _KERNEL:
            keys["gpu_kernel"] = True
        elif "nccl" in kind.lower() or "rccl" in kind.lower():
            skipped.append(f"{name} ({kind}): not run: alpsck's link probe is gloo's, host memory over TCP, which no "
                           "NCCL bandwidth threshold fits; health.min_link_gbps sets its own")
        else:
            skipped.append(f"{name} ({kind}): not run: alpsck has no such check")
    return keys, skipped
