"""alpsck.rng.RNGState: restoring the captured state replays python, numpy and torch draws."""

from __future__ import annotations

import json
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from alpsck import fit
from alpsck.capture import capture
from alpsck.errors import CorruptCheckpointError
from alpsck.rng import RNGState


def _draw() -> tuple[Any, ...]:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        np.random.rand(3).tolist(),
        np.random.standard_normal(),
        torch.rand(4).tolist(),
        torch.randint(0, 1000, (3,)).tolist(),
    )


def test_restore_replays_all_streams() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()
    saved = RNGState().state_dict()
    first = _draw()
    _draw()
    RNGState().load_state_dict(saved)
    assert _draw() == first


def test_roundtrip_through_tree_and_json() -> None:
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()
    captured = capture({"rng": RNGState()})
    js = json.loads(json.dumps(captured.tree, allow_nan=False))
    tensors = {k: t.clone() for k, t in captured.tensors.items()}
    assert "rng/torch" in tensors and tensors["rng/torch"].dtype == torch.uint8
    first = _draw()
    fit.apply({"rng": RNGState()}, js, tensors)
    assert _draw() == first


def test_cuda_states_on_cpu_only_machine_warn() -> None:
    state = RNGState().state_dict()
    if torch.cuda.is_available():
        state["cuda"] = []
    else:
        state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RNGState().load_state_dict(state)
    assert any("CUDA" in str(w.message) for w in caught)


def test_malformed_state_is_corrupt() -> None:
    state = RNGState().state_dict()
    state["torch"] = torch.zeros(3, dtype=torch.float32)
    with pytest.raises(CorruptCheckpointError, match="rng/torch"):
        RNGState().load_state_dict(state)
    with pytest.raises(CorruptCheckpointError):
        RNGState().load_state_dict({"version": 99})
