"""``alpsck export --format dcp`` and ``--format hf`` (issue 56, item 5): the way out of alpsck, checked with the
stock readers: DCP's FileSystemReader and safetensors (its index as Hugging Face lays it out)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import alpsck
from alpsck.cli import main
from alpsck.dcp import AlpsckStorageWriter
from alpsck.tools import export


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _hf(out: Path) -> dict[str, torch.Tensor]:
    """What a Hugging Face loader reads: each file the index names, by safetensors."""
    index = json.loads((out / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(load_file(out / name))
    assert sorted(got) == sorted(index["weight_map"]), index
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    return got


def _stock_dcp(out: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    got = {k: torch.empty_like(v) for k, v in like.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(got, storage_reader=dcp.FileSystemReader(str(out)))
    return got


def _restored(run: Path) -> dict[str, object]:
    """The checkpoint as alpsck's own restore gives it back: the reference for what an export holds."""
    model = _model(2)
    live: dict[str, object] = {"model": model, "optim": torch.optim.AdamW(model.parameters()), "step": 0,
                               "bf16": torch.zeros(7, 3, dtype=torch.bfloat16)}
    alpsck.Checkpointer(run).restore(live)
    return live


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    model, opt = _model(0), None
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    with alpsck.Checkpointer(run_dir, keep_last=0) as ck:
        ck.save(5, {"model": model, "optim": opt, "step": 5, "bf16": torch.randn(7, 3).to(torch.bfloat16)}).wait()
    return run_dir


def test_a_checkpointer_checkpoint_exported_as_hf_shards_loads_in_safetensors_and_into_the_model(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(run), str(out), "--format", "hf", "--subtree", "model", "--max-shard-bytes", "4096",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    names = sorted(Path(f).name for f in r["files"])
    # at most 4096 B a file: the 8 KiB weight alone (a tensor is never split), the other three (2,336 B) together
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json"], names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["0.weight"] != index["weight_map"]["2.weight"] == index["weight_map"]["0.bias"]
    assert (r["format"], r["tensors"], r["step"]) == ("hf", 4, 5) and r["bytes"] == sum(Path(f).stat().st_size
                                                                                     for f in r["files"])
    got = _hf(out)
    fresh = _model(1)
    fresh.load_state_dict(got)  # strict: every key, every shape
    for k, v in _model(0).state_dict().items():
        assert not _same(fresh.state_dict()[k], v)  # the optimizer step moved them from the seed's values
    for k, v in _restored(run)["model"].state_dict().items():  # type: ignore[attr-defined]
        assert _same(got[k], v), k


def test_a_checkpointer_checkpoint_exported_as_dcp_loads_with_stock_dcp(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    r = export.export_checkpoint(str(run), str(out), fmt="dcp")
    assert r["format"] == "dcp" and (out / ".metadata").is_file() and not Path(f"{out}.tmp").exists()
    names = {"model/0.weight", "model/2.bias", "optim/state/0/exp_avg", "bf16"}
    like = {n: torch.empty(0) for n in names}
    md = dcp.FileSystemReader(str(out)).read_metadata()
    like = {n: torch.empty(md.state_dict_metadata[n].size, dtype=md.state_dict_metadata[n].properties.dtype)
            for n in names}
    got = _stock_dcp(out, like)
    live = _restored(run)
    assert _same(got["model/0.weight"], live["model"].state_dict()["0.weight"])  # type: ignore[attr-defined]
    assert _same(got["bf16"], live["bf16"])  # type: ignore[arg-type]
    assert _same(got["optim/state/0/exp_avg"], live["optim"].state_dict()["state"][0]["exp_avg"])  # type: ignore[attr-defined]


def test_a_dcp_checkpoint_exported_as_dcp_and_hf_is_the_whole_state(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The way out for torchtitan's runs: alpsck's DCP checkpoint to DCP's own format (tensors and values) and to
    Hugging Face's (the model's tensors)."""
    run = tmp_path / "run"
    state = {"model": _model(3).state_dict(), "train_state": {"step": 12, "name": "run-a"}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=AlpsckStorageWriter(run, 12))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(["export", str(run), str(tmp_path / "out-dcp"), "--format", "dcp"]) == 0
    assert not [w for w in said if "distributed is disabled" in str(w.message)], [str(w.message) for w in said]
    assert "exported step 12 (4 tensors, dcp)" in capsys.readouterr().out
    back = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "train_state": {"step": 0, "name": ""}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "out-dcp")))
    assert back["train_state"] == {"step": 12, "name": "run-a"}
    assert all(_same(back["model"][k], v) for k, v in state["model"].items())
    r = export.export_checkpoint(str(run), str(tmp_path / "out-hf"), fmt="hf", subtree="model")
    assert (r["tensors"], len(r["files"])) == (4, 2)  # one shard and the index
    got = _hf(tmp_path / "out-hf")
    assert sorted(got) == sorted(state["model"]) and all(_same(got[k], v) for k, v in state["model"].items())


def test_a_directory_export_never_writes_over_anything(run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "keep").write_text("mine")
    assert main(["export", str(run), str(tmp_path / "there"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert "there exists: --format dcp and hf write a new directory" in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "there" / "keep").read_text() == "mine"
    assert main(["export", str(run), str(tmp_path / "no" / "out"), "--format", "dcp"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(run), str(tmp_path / "x"), "--format", "hf", "--subtree", "nope"]) == 2
    assert "--subtree 'nope': the checkpoint has no such top-level key" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]  # nothing left behind, no .tmp
