"""alpsck.tree: capture → JSON → apply round-trips every kind of state, and refuses unsafe trees."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
import torch
from torch import nn

from alpsck import fit, tree
from alpsck.capture import Captured, capture
from alpsck.errors import (
    CorruptCheckpointError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from alpsck.rng import RNGState


def _train_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[3])
    return {"model": model, "optim": opt, "sched": sched}


def _steps(state: dict[str, Any], n: int) -> None:
    model, opt, sched = state["model"], state["optim"], state["sched"]
    for _ in range(n):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _roundtrip_json(captured: Captured) -> dict[str, Any]:
    return json.loads(json.dumps(captured.tree, allow_nan=False))


def _cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.detach().cpu().clone() for k, t in tensors.items()}


def test_training_state_roundtrip_continues_identically() -> None:
    a = _train_state(0)
    _steps(a, 4)
    a["rng"] = RNGState()
    a["step"] = 4
    captured = capture(a)
    saved_tree, saved = _roundtrip_json(captured), _cpu_copies(captured.tensors)
    assert "model/0.weight" in saved and "optim/state/0/exp_avg" in saved
    assert saved["optim/state/0/step"].dim() == 0
    specs = tree.tensor_specs(saved_tree)
    assert set(specs) == set(saved)
    assert all(specs[k] == (t.dtype, tuple(t.shape)) for k, t in saved.items())

    _steps(a, 3)  # continues from the captured RNG state
    a_out = a["model"](torch.ones(2, 4))

    b = _train_state(1)  # different weights, optimizer state, schedule position and RNG
    _steps(b, 1)
    b["rng"], b["step"] = RNGState(), 0
    fit.apply(b, saved_tree, saved)  # also rewinds the global RNG to the captured state
    assert b["step"] == 4
    _steps(b, 3)
    b_out = b["model"](torch.ones(2, 4))
    assert torch.equal(a_out, b_out)
    assert a["sched"].get_last_lr() == b["sched"].get_last_lr()
    assert a["sched"].last_epoch == b["sched"].last_epoch == 7


def test_all_dtypes_and_nested_values_roundtrip() -> None:
    tensors = {name: torch.arange(6).reshape(2, 3).to(dtype) for name, dtype in tree.TENSOR_DTYPES.items()}
    value = {
        "tuple": (1, (2, "x"), []),
        "bytes": b"\x00\xffabc",
        "buffer": io.BytesIO(b"\x00\x80abc"),
        "floats": [math.inf, -math.inf, 1.5, -0.0, 1e308],
        "big": [2**63, -(2**63) - 1, 2**200, 2**63 - 1],
        "int_keys": {0: "a", 7: {"b": None}},
        "tuple_keys": {(1, 2): True},
        "reserved": {"__t": "os.system", "x": 1},
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([3, 4]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 5),
    }
    live = {f"t_{k}": torch.zeros_like(v) for k, v in tensors.items()}
    state: dict[str, Any] = {**live, "value": value, "nan": math.nan}
    src = {**{f"t_{k}": v for k, v in tensors.items()}, "value": value, "nan": math.nan}
    captured = capture(src)
    js = _roundtrip_json(captured)
    fit.apply(state, js, _cpu_copies(captured.tensors))
    for k, t in tensors.items():
        assert state[f"t_{k}"] is live[f"t_{k}"]  # restored in place
        assert torch.equal(live[f"t_{k}"].view(torch.uint8), t.view(torch.uint8)), k
    got = state["value"]
    assert got["tuple"] == (1, (2, "x"), []) and isinstance(got["tuple"][1], tuple)
    assert got["bytes"] == b"\x00\xffabc"
    assert isinstance(got["buffer"], io.BytesIO) and got["buffer"].getvalue() == b"\x00\x80abc"
    assert got["buffer"] is not value["buffer"] and got["buffer"].tell() == 0
    assert got["floats"][:2] == [math.inf, -math.inf] and math.copysign(1, got["floats"][3]) == -1
    assert got["big"] == value["big"]
    assert got["int_keys"] == {0: "a", 7: {"b": None}}
    assert got["tuple_keys"] == {(1, 2): True}
    assert got["reserved"] == {"__t": "os.system", "x": 1}
    assert got["dtype"] is torch.bfloat16 and got["device"] == torch.device("cpu")
    assert got["size"] == (3, 4)
    assert torch.equal(got["scalar"], torch.tensor(3.5)) and got["empty"].shape == (0, 5)
    assert math.isnan(state["nan"])


def test_the_fast_paths_encode_exactly_as_the_general_rules() -> None:
    """capture() takes shortcuts for values of the exact types dict, str, int, float and Tensor (a
    save walks the whole state on the training's critical path). Subclasses of each take the
    general chain. Both must give the same tree, including at the edges: out-of-range ints,
    non-finite floats, reserved and non-str keys, parameters and plain tensors."""

    class S(str):
        pass

    class I(int):  # noqa: E742
        pass

    class F(float):
        pass

    class D(dict):  # type: ignore[type-arg]
        pass

    class T(torch.Tensor):
        pass

    w = nn.Parameter(torch.arange(6.0).reshape(2, 3))

    def build(s: Any, i: Any, f: Any, d: Any, t: Any) -> dict[str, Any]:
        return {"v": d({s("a"): i(1), s("b"): f(2.5), s("c"): s("text"),
                        s("ints"): [i(2**63 - 1), i(-(2**63)), i(2**63), i(-(2**63) - 1)],
                        s("floats"): [f(math.nan), f(math.inf), f(-0.0), f(1e308)],
                        s("keys"): d({1: s("x"), s("__t"): i(3)}), s("tagged"): d({s("__t"): s("os.system")}),
                        s("nested"): [d({s("deep"): (i(1), None, True)})]}),
                "w": t(w), "plain": t(torch.ones(2, dtype=torch.bfloat16))}

    def same(x: Any) -> Any:
        return x

    fast = capture(build(same, same, same, dict, same))
    general = capture(build(S, I, F, D, lambda x: x.as_subclass(T)))
    assert fast.tree == general.tree
    assert json.dumps(fast.tree, allow_nan=False) == json.dumps(general.tree, allow_nan=False)
    assert fast.tensors.keys() == general.tensors.keys() == {"v", "w", "plain"} - {"v"}
    entry = fast.tree["entries"]["v"]["value"]
    assert entry["ints"][2:] == [{"__t": "bigint", "v": str(2**63)}, {"__t": "bigint", "v": str(-(2**63) - 1)}]
    assert entry["floats"][:2] == [{"__t": "float", "v": "nan"}, {"__t": "float", "v": "inf"}]
    assert entry["keys"]["__t"] == "dict" and entry["tagged"]["__t"] == "dict"


def test_check_fits_remembers_only_what_fitted() -> None:
    """The memory of fitted entries (Checkpointer keeps one per recorded state) skips only entries
    equal to one that fitted: a changed entry is checked again, and a tree that does not fit
    leaves the memory as it was."""
    state: dict[str, Any] = {"best": 1.0, "cfg": {"lr": 0.1}, "model": nn.Linear(2, 2)}
    recorded = fit.skeleton(state)
    passed: dict[str, Any] = {}
    fit.check_fits(recorded, capture(state).tree, passed)
    assert set(passed) == {"best", "cfg", "model"}
    remembered = dict(passed)
    fit.check_fits(recorded, capture(state).tree, passed)  # the same structure again
    bad = dict(state, cfg={"lr": {"nested": 1}})
    with pytest.raises(StateMismatchError, match="cfg/lr"):
        fit.check_fits(recorded, capture(bad).tree, passed)
    assert passed == remembered
    grown = dict(state, model=nn.Linear(3, 2))
    with pytest.raises(StateMismatchError, match="model/weight"):
        fit.check_fits(recorded, capture(grown).tree, passed)
    # Against another record, what fitted the first one proves nothing: a fresh memory is needed.
    other = fit.skeleton(dict(state, best={"a": 1.0}))
    with pytest.raises(StateMismatchError, match="best"):
        fit.check_fits(other, capture(state).tree, {})


def test_noncontiguous_and_live_tensors() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    captured = capture({"t": base.t(), "live": base})
    assert captured.tensors["t"].is_contiguous() and torch.equal(captured.tensors["t"], base.t())
    assert captured.tensors["live"].data_ptr() == base.data_ptr()  # no copy


def test_numpy_values_are_converted() -> None:
    np = pytest.importorskip("numpy")
    captured = capture({"v": {"i": np.int64(3), "f": np.float32(0.5), "a": np.arange(3)}})
    state: dict[str, Any] = {"v": None}
    fit.apply(state, _roundtrip_json(captured), {})
    assert state["v"] == {"i": 3, "f": 0.5, "a": [0, 1, 2]}


def test_unsupported_value_names_path() -> None:
    with pytest.raises(TypeError, match="cfg/x/0"):
        capture({"cfg": {"x": [object()]}})


@pytest.mark.parametrize("evil", [
    {"__t": "os.system", "v": "touch pwned"},
    {"__t": "class", "module": "os", "name": "system"},
    {"__t": "builtins.eval", "items": ["1"]},
])
def test_unknown_tags_are_refused(evil: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
    bad = {"format": tree.TREE_FORMAT, "version": tree.TREE_VERSION,
           "entries": {"cfg": {"kind": "value", "value": {"nested": [evil]}}}}
    with pytest.raises(UnsafeCheckpointError, match="cfg/nested/0"):
        tree.tensor_specs(bad)
    state: dict[str, Any] = {"cfg": None}
    with pytest.raises(UnsafeCheckpointError):
        fit.apply(state, bad, {})
    assert calls == [] and state == {"cfg": None}


@pytest.mark.parametrize("node", [
    {"__t": "tuple"},
    {"__t": "tuple", "items": 3},
    {"__t": "bytes", "b64": "!!"},
    {"__t": "bytesio", "b64": "!!"},
    {"__t": "bytesio", "v": "AA=="},
    {"__t": "float", "v": "1e9999"},
    {"__t": "bigint", "v": "12a"},
    {"__t": "dtype", "v": "os"},
    {"__t": "dict", "items": [[[1], 2]]},
    {"__t": "tensor", "key": "k", "dtype": "float32", "shape": [-1]},
    {"__t": "tensor", "key": "k", "dtype": "float32", "shape": [2**30, 2**30]},
    {"__t": "tensor", "key": "k", "dtype": "float32", "shape": [True]},
])
def test_malformed_entries_are_corrupt(node: dict[str, Any]) -> None:
    bad = {"format": tree.TREE_FORMAT, "version": tree.TREE_VERSION,
           "entries": {"x": {"kind": "value", "value": node}}}
    with pytest.raises(CorruptCheckpointError, match="x"):
        tree.tensor_specs(bad)


def test_tensor_dtype_outside_allow_list_is_unsafe() -> None:
    bad = {"format": tree.TREE_FORMAT, "version": tree.TREE_VERSION,
           "entries": {"x": {"kind": "value",
                             "value": {"__t": "tensor", "key": "x", "dtype": "object", "shape": [1]}}}}
    with pytest.raises(UnsafeCheckpointError, match="x"):
        tree.tensor_specs(bad)


def test_module_shape_mismatch_names_key_and_leaves_state_untouched() -> None:
    captured = capture({"model": nn.Linear(4, 3), "step": 5})
    js, tensors = _roundtrip_json(captured), _cpu_copies(captured.tensors)
    other = nn.Linear(4, 2)
    before = other.weight.detach().clone()
    state: dict[str, Any] = {"model": other, "step": 0}
    with pytest.raises(StateMismatchError, match=r"model/weight.*\[3, 4\].*\[2, 4\]"):
        fit.apply(state, js, tensors)
    assert torch.equal(other.weight, before) and state["step"] == 0


def test_dtype_mismatch_names_key() -> None:
    captured = capture({"model": nn.Linear(2, 2), "buf": torch.zeros(3)})
    js, tensors = _roundtrip_json(captured), _cpu_copies(captured.tensors)
    with pytest.raises(StateMismatchError, match=r"model/weight.*float32 \[2, 2\].*bfloat16 \[2, 2\]"):
        fit.apply({"model": nn.Linear(2, 2).bfloat16(), "buf": torch.zeros(3)}, js, tensors)
    with pytest.raises(StateMismatchError, match=r"buf.*float32 \[3\].*int64 \[3\]"):
        fit.apply({"model": nn.Linear(2, 2), "buf": torch.zeros(3, dtype=torch.int64)}, js, tensors)


def test_missing_and_unexpected_entries() -> None:
    captured = capture({"model": nn.Linear(2, 2)})
    js, tensors = _roundtrip_json(captured), _cpu_copies(captured.tensors)
    with pytest.raises(StateMismatchError, match="optim"):
        fit.apply({"model": nn.Linear(2, 2), "optim": RNGState()}, js, tensors)
    with pytest.raises(StateMismatchError, match=r"model.*0\.weight"):
        fit.apply({"model": nn.Sequential(nn.Linear(2, 2))}, js, tensors)
    del tensors["model/weight"]
    with pytest.raises(CorruptCheckpointError, match="model/weight"):
        fit.apply({"model": nn.Linear(2, 2)}, js, tensors)


def test_path_collisions_get_unique_keys() -> None:
    captured = capture({"a": {"b/c": torch.zeros(1), "b": {"c": torch.ones(1)}}})
    assert sorted(captured.tensors) == ["a/b/c", "a/b/c~2"]
    state: dict[str, Any] = {"a": None}
    fit.apply(state, _roundtrip_json(captured), captured.tensors)
    assert state["a"]["b"]["c"].item() == 1.0 and state["a"]["b/c"].item() == 0.0
