"""The pipelined snapshot and the restore on a real CUDA device (marker ``gpu``).

CI has no GPU: these tests are deselected there (``-m 'not gpu'`` in pyproject's addopts) and
are never counted as passing. A session with a GPU runs them with ``pytest -m gpu`` (see
benchmarks/gpu_session.sh); there a missing device is a failure, not a skip.

Each test checks what was written against a snapshot of the state taken when ``save()`` was
called, while the training changes the state on the GPU right after ``save()`` returns.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import alpsck

pytestmark = pytest.mark.gpu

CHUNK = 1 << 20


@pytest.fixture(autouse=True)
def _cuda() -> None:
    assert torch.cuda.is_available(), "the gpu tests need a CUDA device (they are deselected without -m gpu)"


def _model(seed: int = 0, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)).cuda()
    return m, torch.optim.AdamW(m.parameters(), lr=0.01)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        m(torch.randn(64, m[0].in_features, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint must hold: a CPU copy of ``state`` as it is now."""
    torch.cuda.synchronize()
    out = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    return copy.deepcopy(_to_cpu(out))


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_cpu(v) for v in x]
    return x


def _assert_restores_to(run: Path, want: dict[str, Any], step: int, width: int = 1024) -> None:
    m, opt = _model(seed=1, width=width)  # other values than the saved ones
    _train(m, opt)  # the optimizer has state tensors on the GPU to restore into
    extra = torch.zeros_like(want["extra"], device="cuda")
    with alpsck.Checkpointer(run) as ck:
        assert ck.restore({"model": m, "optim": opt, "extra": extra}, step=step) == step
    for k, v in want["model"].items():
        got = m.state_dict()[k]
        assert got.device.type == "cuda", k
        assert torch.equal(got.cpu(), v), k
    got_opt = opt.state_dict()["state"]
    for i, st in want["optim"]["state"].items():
        for k, v in st.items():
            g = got_opt[i][k]
            if k != "step":
                assert g.device.type == "cuda", (i, k)
            assert torch.equal(torch.as_tensor(g).cpu(), torch.as_tensor(v)), (i, k)
    assert extra.device.type == "cuda"
    assert torch.equal(extra.cpu(), want["extra"])


def test_save_returns_before_the_copy_and_training_changes_nothing_saved(tmp_path: Path) -> None:
    m, opt = _model()
    extra = torch.randn(3 << 20, device="cuda")  # unguarded: may change right after save()
    state = {"model": m, "optim": opt, "extra": extra}
    _train(m, opt, 2)
    with alpsck.Checkpointer(tmp_path, chunk_bytes=CHUNK, keep_last=3) as ck:
        wants = {}
        for step in (1, 2, 3):
            wants[step] = _snapshot(state)
            h = ck.save(step, state)
            extra.add_(1.0)  # on the current stream, right after save() returned
            _train(m, opt)  # the optimizer step waits for the guarded copies (hook)
            h.wait()
        assert (ck._stagers["run_dir"]._registered or 0) > 0, "the staging pool was not pinned"
    for step, want in wants.items():
        _assert_restores_to(tmp_path, want, step)


def test_a_small_pool_streams_a_large_state_through_the_feeder(tmp_path: Path) -> None:
    m, opt = _model()
    extra = torch.randn(24 << 20, device="cuda")  # ~96 MiB, with the model ~230 MiB: ~230 chunks
    state = {"model": m, "optim": opt, "extra": extra}
    _train(m, opt)
    with alpsck.Checkpointer(tmp_path, chunk_bytes=CHUNK, staging_bytes=4 * CHUNK, keep_last=2) as ck:
        want1 = _snapshot(state)
        h1 = ck.save(1, state)
        extra.mul_(-1.0)
        _train(m, opt)
        want2 = _snapshot(state)
        h2 = ck.save(2, state)  # the first may still be streaming: this one waits for its slots
        extra.add_(3.0)
        _train(m, opt)
        h1.wait()
        h2.wait()
    _assert_restores_to(tmp_path, want1, 1)
    _assert_restores_to(tmp_path, want2, 2)


def test_restore_into_gpu_state_resumes_the_same_losses(tmp_path: Path) -> None:
    """Save at step 3 of a GPU training, go on to step 6; a fresh process-like start restores and
    repeats steps 4-6 with the same losses, bit for bit (the CUDA RNG state is part of the state)."""

    def losses(m: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> list[float]:
        out = []
        for _ in range(n):
            x = torch.randn(64, m[0].in_features, device="cuda")  # the CUDA generator
            loss = torch.nn.functional.dropout(m(x), 0.1).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    m, opt = _model(width=256)
    torch.cuda.manual_seed(7)
    losses(m, opt, 3)
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(3, {"model": m, "optim": opt, "rng": alpsck.RNGState()}).wait()
    want = losses(m, opt, 3)

    m2, opt2 = _model(seed=5, width=256)
    _train(m2, opt2)
    torch.cuda.manual_seed(99)
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": m2, "optim": opt2, "rng": alpsck.RNGState()}) == 3
    assert losses(m2, opt2, 3) == want


def test_memory_tier_saves_are_pipelined_and_restore_into_the_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save to the memory tier takes the pipelined path with a pinned staging pool of its own (before, every
    tensor was copied to pageable memory inside save()); training right after it changes nothing saved, and a
    fresh Checkpointer restores that step from memory into the GPU tensors."""
    from alpsck.store import memory_tier

    monkeypatch.setenv(memory_tier.ROOT_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    m, opt = _model()
    extra = torch.randn(3 << 20, device="cuda")
    state = {"model": m, "optim": opt, "extra": extra}
    _train(m, opt, 2)
    run = tmp_path / "run"
    with alpsck.Checkpointer(run, memory=True, chunk_bytes=CHUNK, keep_last=2) as ck:
        assert ck.restore(state) is None  # prepares both tiers' pools and pins them ahead
        ck.save(1, state).wait()
        want = _snapshot(state)
        h = ck.save(2, state, tier="memory")
        extra.add_(1.0)
        _train(m, opt)  # waits for the memory save's guarded copies
        h.wait()
        memory_stager = ck._stagers["memory"]
        assert (memory_stager._registered or 0) > 0, "the memory tier's staging pool was not pinned"
        assert memory_stager._engine is not ck._stagers["run_dir"]._engine
    m2, opt2 = _model(seed=1)
    _train(m2, opt2)
    extra2 = torch.zeros_like(extra)
    with alpsck.Checkpointer(run, memory=True) as ck:
        assert ck.restore({"model": m2, "optim": opt2, "extra": extra2}) == 2 and ck.restored_tier == "memory"
    for k, v in want["model"].items():
        assert torch.equal(m2.state_dict()[k].cpu(), v), k
    assert torch.equal(extra2.cpu(), want["extra"])


def test_restore_reads_into_gpu_tensors_through_pinned_batches_and_big_tensors_alone(tmp_path: Path) -> None:
    """read_to_device with 1 MiB buffers: many batches (the buffers reused while copies run), tensors larger than
    a buffer read on their own, empty ones skipped; every byte lands in the live GPU tensors."""
    from alpsck.restore.device import read_to_device
    from alpsck.store.shards import CheckpointShards

    torch.manual_seed(3)
    saved = {f"t{i}": torch.randn(n, device="cuda") for i, n in enumerate([1000, 300_000, 70_000, 0, 900_000, 5, 200_000])}
    saved["half"] = torch.randn(123_457, device="cuda").half()
    with alpsck.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ck:
        ck.save(1, saved).wait()
        path = ck.checkpoints()[-1]["path"]
    live = {k: torch.full_like(v, -1.0) for k, v in saved.items()}
    read_to_device(CheckpointShards(path, 0), list(live.items()), threads=4, batch_bytes=1 << 20)
    for k, v in saved.items():
        assert torch.equal(live[k], v), k
