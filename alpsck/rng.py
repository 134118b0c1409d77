"""Capture and restore every global random stream a training run draws from.

:class:`RNGState` is a stateful object to put in the checkpointed state (``state["rng"] =
RNGState()``). Its ``state_dict()`` holds python ``random``, numpy's global ``np.random`` (if
numpy is installed), the torch CPU generator and every CUDA device's default generator, encoded
only with types :mod:`alpsck.tree` supports (tensors, tuples, ints, floats, str, None).

Call order: ``state_dict()`` when the checkpoint is captured (between steps), ``load_state_dict``
when it is restored (before the first resumed step). Not thread-safe: the generators are process
globals, so call both on the training thread while no other thread draws random numbers.
numpy's ``Generator`` objects (``np.random.default_rng``) are not global and are not captured.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from alpsck.errors import CorruptCheckpointError

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is optional
    np = None  # type: ignore[assignment]

_VERSION = 1


class RNGState:
    """The process's global RNG streams as a checkpointable object (see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of all generators; fresh tensors, safe to keep."""
        out: dict[str, Any] = {"version": _VERSION, "python": random.getstate(), "numpy": None}
        if np is not None:
            algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            out["numpy"] = {
                "algorithm": str(algorithm),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        out["torch"] = torch.get_rng_state()
        out["cuda"] = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else []
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore all generators. CUDA states that do not fit this machine are skipped with a warning."""
        if not isinstance(state, Mapping) or state.get("version") != _VERSION:
            raise CorruptCheckpointError(f"rng: unsupported RNG state (version {_version(state)!r})")
        try:
            version, internal, gauss_next = state["python"]
            py_state = (int(version), tuple(int(x) for x in internal), gauss_next)
            torch_state = _byte_tensor(state["torch"], "rng/torch")
            np_state = _numpy_state(state["numpy"])
            cuda_states = [_byte_tensor(t, f"rng/cuda/{i}") for i, t in enumerate(state["cuda"])]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"rng: malformed RNG state: {e}") from e

        random.setstate(py_state)
        if np_state is not None:
            np.random.set_state(np_state)
        elif np is not None:
            warnings.warn("rng: checkpoint has no numpy RNG state; np.random left as is", stacklevel=2)
        torch.set_rng_state(torch_state)
        _restore_cuda(cuda_states)


def _version(state: Any) -> Any:
    return state.get("version") if isinstance(state, Mapping) else type(state).__name__


def _byte_tensor(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise CorruptCheckpointError(f"{name}: expected a 1-d uint8 tensor")
    return t.detach().cpu().contiguous()


def _numpy_state(s: Any) -> tuple[str, Any, int, int, float] | None:
    if s is None or np is None:
        return None
    keys = s["keys"]
    if not isinstance(keys, torch.Tensor) or keys.dim() != 1:
        raise CorruptCheckpointError("rng/numpy/keys: expected a 1-d tensor")
    arr = keys.detach().cpu().numpy().astype(np.uint32)
    return (str(s["algorithm"]), arr, int(s["pos"]), int(s["has_gauss"]), float(s["cached_gaussian"]))


def _restore_cuda(states: list[torch.Tensor]) -> None:
    available = torch.cuda.is_available()
    if not available:
        if states:
            warnings.warn(f"rng: checkpoint has {len(states)} CUDA generator state(s) but CUDA is not "
                          "available; they are not restored", stacklevel=3)
        return
    n = torch.cuda.device_count()
    if not states:
        warnings.warn("rng: checkpoint has no CUDA generator state; CUDA generators left as is", stacklevel=3)
        return
    if len(states) != n:
        warnings.warn(f"rng: checkpoint has {len(states)} CUDA generator state(s), this machine has {n} "
                      f"device(s); restoring the first {min(n, len(states))}", stacklevel=3)
    for i, s in enumerate(states[:n]):
        torch.cuda.set_rng_state(s, i)
