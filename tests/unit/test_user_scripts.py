"""What a user's own training script (nanoGPT's train.py, say) trips on: numbers that become 0-d
tensors, a state whose types change between saves, reading a checkpoint's settings before the model
exists (``alpsck.peek``), and exporting a plain model ``state_dict`` (``alpsck export --subtree``)."""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support.corrupt import flip_byte
from torch import nn

import alpsck
from alpsck.errors import AlpsckError, NoCheckpointError, StateMismatchError, UsageError
from alpsck.tools import export
from alpsck.tree import TensorRef

MODEL_ARGS: dict[str, Any] = {"n_layer": 2, "n_embd": 8, "vocab_size": 11, "bias": True, "dropout": 0.0}


class TinyGPT(nn.Module):
    """Stands for nanoGPT's GPT: built from ``model_args``, with a parameter, a buffer and an int buffer."""

    def __init__(self, n_layer: int, n_embd: int, vocab_size: int, bias: bool, dropout: float) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.h = nn.ModuleList([nn.Linear(n_embd, n_embd, bias=bias) for _ in range(n_layer)])
        self.ln_f = nn.BatchNorm1d(n_embd)  # running_mean / running_var / num_batches_tracked (int64, 0-d)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx))
        for layer in self.h:
            x = torch.relu(layer(x))
        return self.ln_f(x) @ self.wte.weight.t()


def _state(seed: int = 0) -> dict[str, Any]:
    """A fresh process's state, as nanoGPT builds it: best_val_loss is the float 1e9."""
    torch.manual_seed(seed)
    model = TinyGPT(**MODEL_ARGS)
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=1e-2), "iter_num": 0,
            "best_val_loss": 1e9, "model_args": dict(MODEL_ARGS), "config": {"eval": {"best": 1e9}}}


def _train(state: dict[str, Any], steps: int = 1) -> None:
    model, opt = state["model"], state["optim"]
    for _ in range(steps):
        idx = torch.randint(0, MODEL_ARGS["vocab_size"], (6,))
        nn.functional.cross_entropy(model(idx), idx).backward()
        opt.step()
        opt.zero_grad()
        state["iter_num"] += 1


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))


# --------------------------------------------------------------------------- numbers and 0-d tensors


def test_a_0d_tensor_saved_restores_into_a_fresh_float_as_the_number(tmp_path: Path) -> None:
    state = _state()
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore(state) is None
        _train(state)
        state["best_val_loss"] = torch.tensor(2.3456789)  # nanoGPT: losses['val'], a 0-d float32 tensor
        state["config"]["eval"]["best"] = torch.tensor(1.25, dtype=torch.float64)
        state["config"]["eval"]["evals"] = torch.tensor(3)  # int64
        state["config"]["eval"]["improved"] = torch.tensor(True)
        saved_loss = state["best_val_loss"].item()
        ck.save(1, state).wait()

    fresh = _state(seed=1)  # a new process: floats where the checkpoint has 0-d tensors
    fresh["config"]["eval"].update(evals=0, improved=False)
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore(fresh) == 1
    assert type(fresh["best_val_loss"]) is float and fresh["best_val_loss"] == saved_loss
    assert saved_loss != 2.3456789  # float32's value, exactly: not the decimal literal
    ev = fresh["config"]["eval"]
    assert type(ev["best"]) is float and ev["best"] == 1.25
    assert type(ev["evals"]) is int and ev["evals"] == 3
    assert ev["improved"] is True
    assert fresh["iter_num"] == 1 and fresh["model_args"] == MODEL_ARGS
    for a, b in zip(state["model"].state_dict().values(), fresh["model"].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_number_saved_fills_a_live_0d_tensor_in_place(tmp_path: Path) -> None:
    state = _state()
    state["best_val_loss"] = 0.75
    state["config"]["eval"]["best"] = 3
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, state).wait()

    fresh = _state()
    live = fresh["best_val_loss"] = torch.tensor(1e9, dtype=torch.float64)
    nested = fresh["config"]["eval"]["best"] = torch.tensor(0.0, dtype=torch.bfloat16)
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore(fresh) == 1
    assert fresh["best_val_loss"] is live and live.dtype == torch.float64 and live.item() == 0.75
    assert fresh["config"]["eval"]["best"] is nested and nested.dtype == torch.bfloat16 and nested.item() == 3.0


def test_a_genuine_mismatch_still_names_the_path_and_changes_nothing(tmp_path: Path) -> None:
    state = _state()
    state["best_val_loss"] = torch.tensor([1.0, 2.0])  # 1-d: no number can take it
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, state).wait()
    fresh = _state(seed=1)
    before = {k: v.clone() for k, v in fresh["model"].state_dict().items()}
    with alpsck.Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError, match=r"best_val_loss.*float32 \[2\]"):
        ck.restore(fresh)
    assert fresh["best_val_loss"] == 1e9
    assert all(torch.equal(before[k], v) for k, v in fresh["model"].state_dict().items())

    other = tmp_path / "nested"
    state = _state()
    state["config"]["eval"]["best"] = {"loss": 1.0}
    with alpsck.Checkpointer(other) as ck:
        ck.save(1, state).wait()
    fresh = _state(seed=1)
    with alpsck.Checkpointer(other) as ck, pytest.raises(StateMismatchError, match="config/eval/best.*dict.*float"):
        ck.restore(fresh)
    assert fresh["config"]["eval"]["best"] == 1e9


# --------------------------------------------------------------------------- refused at save time


@pytest.mark.parametrize("change", ["float-to-dict", "float-to-1d", "nested-float-to-dict", "module-shape"])
def test_a_change_restore_could_not_convert_is_refused_at_save_with_nothing_written(tmp_path: Path,
                                                                                    change: str) -> None:
    state = _state()
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.restore(state)  # records the state a fresh process builds
        _train(state)
        state["best_val_loss"] = torch.tensor(2.5)  # float -> 0-d tensor: fine
        ck.save(1, state).wait()
        if change == "float-to-dict":
            state["best_val_loss"], path, now, then = {"val": 2.0}, "best_val_loss", "dict", "float"
        elif change == "float-to-1d":
            state["best_val_loss"], path, now, then = torch.tensor([2.0]), "best_val_loss", "float32 \\[1\\]", "float"
        elif change == "nested-float-to-dict":
            state["config"]["eval"]["best"], path, now, then = {"val": 2.0}, "config/eval/best", "dict", "float"
        else:
            state["model"].wte = nn.Embedding(12, MODEL_ARGS["n_embd"])
            path, now, then = "model/wte.weight", "float32 \\[12, 8\\]", "float32 \\[11, 8\\]"
        with pytest.raises(StateMismatchError, match=f"step 2 not saved.*restore\\(\\).*{path}.*{now}.*{then}"):
            ck.save(2, state)
        assert _steps(tmp_path) == ["step-000000001"]  # no step-2, not even a step-2.tmp
        assert [c["step"] for c in ck.checkpoints()] == [1]
    fresh = _state(seed=1)
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore(fresh) == 1  # what was saved still restores into a fresh process


def test_a_restore_replaces_what_saves_must_fit(tmp_path: Path) -> None:
    """Saves remember which entries fitted the recorded state, so as not to check the same
    structure at every step. A restore() records the state anew, and that memory must go with
    the old record: an entry that fitted the first one may not fit the second."""
    state = _state()
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, state).wait()  # the first save records iter_num as an int
        ck.save(2, state).wait()  # ... and this one remembers that it fitted
        fresh = _state(seed=1)
        fresh["iter_num"] = {"epoch": 0}  # a state whose iter_num no saved number can fill
        with pytest.raises(StateMismatchError, match="iter_num"):
            ck.restore(fresh)
        with pytest.raises(StateMismatchError, match="step 3 not saved.*restore\\(\\).*iter_num"):
            ck.save(3, state)  # equal to what fitted before, but not to what restore() recorded
        assert [c["step"] for c in ck.checkpoints()] == [1, 2]


def test_without_a_restore_the_first_save_is_the_reference(tmp_path: Path) -> None:
    state = _state()
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, state).wait()
        state["iter_num"] = "one hundred"
        with pytest.raises(StateMismatchError, match="first save.*iter_num.*str.*int"):
            ck.save(2, state)
        state["iter_num"] = torch.tensor(100)  # an int and a 0-d tensor convert: saved
        ck.save(3, state).wait()
    assert _steps(tmp_path) == ["step-000000001", "step-000000003"]


def test_adam_state_appearing_after_the_first_step_is_not_refused(tmp_path: Path) -> None:
    state = _state()
    assert not state["optim"].state  # a fresh AdamW has no exp_avg yet
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.restore(state)
        ck.save(1, state).wait()  # before any step
        _train(state, steps=2)
        assert "exp_avg" in state["optim"].state[state["model"].wte.weight]
        ck.save(2, state).wait()
        state["optim"].add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        with pytest.raises(StateMismatchError, match="optim.*2 parameter group.*1"):
            ck.save(3, state)  # a new parameter group would be refused by a fresh optimizer
    fresh = _state(seed=1)
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore(fresh) == 2
    assert fresh["optim"].state_dict()["state"][0]["step"].item() == 2.0


# --------------------------------------------------------------------------- peek


def _saved_run(run: Path) -> None:
    state = _state()
    state["notes"] = ("adamw", b"\x00\x01", torch.bfloat16)
    with alpsck.Checkpointer(run, keep_last=0, chunk_bytes=64 << 10) as ck:
        for step in (1, 2):
            _train(state)
            state["best_val_loss"] = torch.tensor(3.0 - step)
            ck.save(step, state).wait()


def test_peek_reads_model_args_without_a_model_lock_or_pickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _saved_run(tmp_path)

    def no_pickle(*a: Any, **k: Any) -> Any:
        raise AssertionError("peek unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, no_pickle)
    with alpsck.Checkpointer(tmp_path):  # a job holds the run directory: peek is a reader, it takes no lock
        got = alpsck.peek(tmp_path)
    monkeypatch.undo()
    model = TinyGPT(**got["model_args"])  # what peek is for: build the model the checkpoint needs
    assert got["model_args"] == MODEL_ARGS and got["iter_num"] == 2
    assert got["notes"] == ("adamw", b"\x00\x01", torch.bfloat16)
    assert got["best_val_loss"] == TensorRef("best_val_loss", torch.float32, ())  # 0-d: described, not read
    sd = got["model"]
    assert list(sd) == list(model.state_dict())
    assert sd["wte.weight"] == TensorRef("model/wte.weight", torch.float32, (11, 8))
    assert sd["ln_f.num_batches_tracked"].dtype == torch.int64
    assert isinstance(got["optim"]["state"][0]["exp_avg"], TensorRef)
    assert got["optim"]["param_groups"][0]["lr"] == 1e-2
    assert alpsck.peek(tmp_path, step=1)["iter_num"] == 1


def test_peek_skips_a_corrupt_newest_checkpoint_like_restore(tmp_path: Path) -> None:
    _saved_run(tmp_path)
    shard = tmp_path / "step-000000002" / "rank-00000.bin"
    footer = shard.read_bytes()[-64:]
    flip_byte(shard, int.from_bytes(footer[16:24], "little") + 5)  # a byte of the index, which holds the tree
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint .*step-000000002.*index CRC mismatch"):
        assert alpsck.peek(tmp_path)["iter_num"] == 1
    with pytest.warns(RuntimeWarning, match="index CRC"), pytest.raises(NoCheckpointError, match="step 2 is not valid"):
        alpsck.peek(tmp_path, step=2)


def test_peek_verify_skips_corrupt_tensor_data(tmp_path: Path) -> None:
    _saved_run(tmp_path)
    flip_byte(tmp_path / "step-000000002" / "rank-00000.bin", 100)  # in the first tensor's bytes
    assert alpsck.peek(tmp_path)["iter_num"] == 2  # the tree is intact; tensor data is not read
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint.*step 2.*CRC"):
        assert alpsck.peek(tmp_path, verify=True)["iter_num"] == 1


def test_peek_without_a_checkpoint_raises(tmp_path: Path) -> None:
    with pytest.raises(NoCheckpointError, match="no such directory"):
        alpsck.peek(tmp_path / "never-ran")
    with alpsck.Checkpointer(tmp_path):
        pass
    with pytest.raises(NoCheckpointError, match="no valid checkpoint"):
        alpsck.peek(tmp_path)
    _saved_run(tmp_path)
    with pytest.raises(NoCheckpointError, match="no checkpoint of step 7"):
        alpsck.peek(tmp_path, step=7)
    with pytest.raises(UsageError, match="no rank 1"):
        alpsck.peek(tmp_path, rank=1)


# --------------------------------------------------------------------------- export --subtree


def _export(*argv: str) -> tuple[int, str]:
    """``alpsck export ARGV`` through the command's own argparse registration: (exit code, error).

    Not through ``alpsck.cli.main``, whose ``--version`` line needs a newer built core than this
    test needs; errors are turned into exit 2 as ``cli.main`` does."""
    parser = argparse.ArgumentParser(prog="alpsck")
    export.register(parser.add_subparsers())
    args = parser.parse_args(["export", *argv])
    try:
        return int(args.func(args)), ""
    except AlpsckError as e:
        return 2, str(e)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_subtree_is_a_plain_state_dict(tmp_path: Path, fmt: str) -> None:
    run = tmp_path / "run"
    _saved_run(run)
    out = tmp_path / f"model.{'pt' if fmt == 'torch' else 'safetensors'}"
    rc, err = _export(str(run), str(out), "--format", fmt, "--subtree", "model")
    assert rc == 0, err
    loaded = torch.load(out, weights_only=True) if fmt == "torch" else load_file(str(out))
    model = TinyGPT(**alpsck.peek(run)["model_args"])
    assert list(loaded) == list(model.state_dict())
    model.load_state_dict(loaded)  # strict: every key, nothing more
    state = _state(seed=1)
    with alpsck.Checkpointer(run) as ck:
        ck.restore(state)
    for k, v in state["model"].state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k

    rc, err = _export(str(run), str(out), "--format", fmt, "--subtree", "optim")
    assert rc == 0, err
    loaded = torch.load(out, weights_only=True) if fmt == "torch" else load_file(str(out))
    assert "state/0/exp_avg" in loaded and not any(k.startswith("optim/") for k in loaded)


def test_export_subtree_refuses_an_unknown_key_naming_the_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _saved_run(run)
    out = tmp_path / "x.pt"
    rc, err = _export(str(run), str(out), "--subtree", "modle")
    assert rc == 2 and "'modle'" in err and "'model', 'optim'" in err and "'best_val_loss'" in err
    rc, err = _export(str(run), str(out), "--subtree", "model_args")
    assert rc == 2 and "holds no tensor" in err and "'model'" in err
    assert not out.exists() and not any(p.name.startswith("x.pt") for p in tmp_path.iterdir())
    assert os.listdir(tmp_path) == ["run"]
