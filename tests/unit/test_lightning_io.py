"""alpsck.integrations.lightning.AlpsckCheckpointIO on its own (issue 56, item 2): what Lightning's trainer calls,
called directly; the DDP kill-and-resume is tests/ranks/test_lightning.py."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from support.releases import require_release

from alpsck.errors import UsageError


@pytest.fixture
def io_class() -> Any:
    """AlpsckCheckpointIO, once Lightning is there (it imports Lightning)."""
    require_release("lightning", "lightning", "2.6.0", "alpsck.integrations.lightning's tests")
    from alpsck.integrations.lightning import AlpsckCheckpointIO

    return AlpsckCheckpointIO


def _checkpoint(step: int) -> dict[str, object]:
    torch.manual_seed(step)
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(float(step))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"epoch": 1, "global_step": step, "pytorch-lightning_version": "2.6.0", "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()], "lr_schedulers": [],
            "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 1}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "x/epoch=0.ckpt",
                                                               "kth_value": torch.tensor(float("inf"))}},
            "hyper_parameters": {"lr": 0.1, "layers": [3, 2], "name": "m"}}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_what_lightning_saves_it_loads_back_whole_and_a_path_saved_again_keeps_its_newest(tmp_path: Path,
                                                                                          io_class: Any) -> None:
    io = io_class(threads=2)
    for step in (5, 10):
        io.save_checkpoint(_checkpoint(step), tmp_path / f"epoch=0-step={step}.ckpt")
        io.save_checkpoint(_checkpoint(step), tmp_path / "last.ckpt")  # saved again: its newest stays
    io.teardown()
    assert _equal(io.load_checkpoint(tmp_path / "epoch=0-step=5.ckpt"), _checkpoint(5))
    assert _equal(io.load_checkpoint(tmp_path / "last.ckpt", map_location="cpu"), _checkpoint(10))
    assert [p.name for p in (tmp_path / "last.ckpt").iterdir() if p.name.startswith("step-")] == ["step-000000010"]
    io.remove_checkpoint(tmp_path / "epoch=0-step=5.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=10.ckpt", "last.ckpt"]
    with pytest.raises(FileNotFoundError, match="epoch=0-step=5.ckpt"):
        io.load_checkpoint(tmp_path / "epoch=0-step=5.ckpt")


def test_a_load_of_a_path_still_in_flight_waits_for_it_and_bad_arguments_are_named(tmp_path: Path,
                                                                                    io_class: Any) -> None:
    io = io_class()
    io.save_checkpoint(_checkpoint(3), tmp_path / "a.ckpt")  # in flight, read at once
    assert _equal(io.load_checkpoint(tmp_path / "a.ckpt"), _checkpoint(3))
    with pytest.raises(TypeError, match="takes no storage_options"):
        io.save_checkpoint(_checkpoint(4), tmp_path / "b.ckpt", storage_options={"x": 1})
    with pytest.raises(UsageError, match="AlpsckCheckpointIO sets keep_last itself"):
        io_class(keep_last=3)
    io.teardown()


def test_a_routed_path_keeps_its_checkpointer_and_its_retention_until_teardown(tmp_path: Path, io_class: Any) -> None:
    """route(): a job's run directory saves through one Checkpointer kept open (several saves in flight, its own
    keep_last), not a new one per save that keeps one; wait() makes them durable; teardown closes it and drops
    the route."""
    from alpsck import Checkpointer, _core

    run = tmp_path / "run"
    io = io_class()
    with pytest.raises(UsageError, match="the checkpointer writes"):
        io.route(tmp_path / "elsewhere", Checkpointer(run, rank=0, world_size=1))
    ck = Checkpointer(run, rank=0, world_size=1, keep_last=2)
    io.route(run, ck)
    for step in (10, 20, 30):
        io.save_checkpoint(_checkpoint(step), run)
    io.wait(run)
    assert sorted(i["step"] for i in _core.scan(str(run), verify=True) if i["status"] == "committed") == [20, 30]
    assert _equal(io.load_checkpoint(run), _checkpoint(30))
    io.teardown()
    with pytest.raises(UsageError):
        ck.save(40, {"x": torch.zeros(1)})  # closed by the teardown
    io.save_checkpoint(_checkpoint(40), run)  # no route any more: a Checkpointer per save, keeping one
    io.teardown()
    assert [i["step"] for i in _core.scan(str(run), verify=True) if i["status"] == "committed"] == [40]


def test_the_job_bridge_warns_that_a_lightning_job_does_not_apply_memory_every(tmp_path: Path, io_class: Any) -> None:
    """``checkpoint.memory_every`` in the config of a Lightning job: said once, naming the key, not silently dropped."""
    import lightning as L

    from alpsck.integrations.lightning_job import AlpsckJob
    from alpsck.slurm.config import parse_config
    from alpsck.slurm.context import JobContext

    def bridge(checkpoint: str) -> tuple[AlpsckJob, Any, Any]:
        cfg = parse_config(f"name: t\nrun_dir: {tmp_path / 'run'}\nslurm:\n  time: '00:10:00'\n"
                           f"entry:\n  function: m:f\ncheckpoint: {{{checkpoint}}}\n")
        io = io_class()
        trainer = L.Trainer(plugins=[io], accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        return AlpsckJob(JobContext(cfg, "1", 0, 0, 1, stop=None)), io, trainer  # type: ignore[arg-type]

    job, io, trainer = bridge("every_steps: 50, memory_every: 5")
    with pytest.warns(RuntimeWarning, match=r"checkpoint\.memory_every \(5\) is not applied to a Lightning job"):
        job.setup(trainer, None, "fit")
    io.teardown()
    job, io, trainer = bridge("every_steps: 50")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        job.setup(trainer, None, "fit")
    io.teardown()
