"""The pipelined snapshot (alpsck.staging): the GPU path's mechanism, run on CPU tensors.

Here ``overlap_copy=True`` sends a CPU state through it: save() returns before the optimizer's
tensors are copied; the copy runs on the feeder thread, the optimizer's step pre-hook waits for
it, and a bounded staging pool makes chunks wait for written ones. The CUDA specifics (side
stream, events, pinned registration) are the same code with device tensors; they run only on a
GPU (issue 9). Every test checks what was written against a snapshot taken at save().
"""

from __future__ import annotations

import copy
import errno
import gc
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import alpsck
from alpsck.errors import CheckpointWriteError, DiskFullError
from alpsck.store import memory_tier

CHUNK = 64 << 10


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))  # ~1 MB fp32
    return m, torch.optim.AdamW(m.parameters(), lr=0.05)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        m(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _expected(state: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()})


def _assert_restores_to(run: Path, want: dict[str, Any], step: int, tier: str = "run_dir") -> None:
    m, opt = _model()
    extra = torch.zeros_like(want["extra"])
    with alpsck.Checkpointer(run, memory=tier == "memory") as ck:
        assert ck.restore({"model": m, "optim": opt, "extra": extra}, step=step) == step
        assert ck.restored_tier == tier
    for k, v in want["model"].items():
        assert torch.equal(m.state_dict()[k], v), k
    got = opt.state_dict()["state"]
    for i, st in want["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got[i][k]), torch.as_tensor(v)), (i, k)
    assert torch.equal(extra, want["extra"])


def test_save_returns_before_the_copy_and_the_optimizer_step_waits_for_it(tmp_path: Path) -> None:
    """A 3-slot pool and slow writes: most chunks are copied long after save() returned."""
    m, opt = _model()
    _train(m, opt)
    extra = torch.arange(50_000, dtype=torch.float64)  # unguarded: copied (or cloned) inside save()
    state = {"model": m, "optim": opt, "extra": extra}
    slow = [{"op": "pwrite", "path_contains": "rank-", "error": 0, "delay_us": 50_000, "count": 2**63}]
    with alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK, staging_bytes=3 * CHUNK,
                             threads=2, _faults=slow) as ck:
        want = _expected(state)
        t0 = time.perf_counter()
        h = ck.save(7, state)
        returned = time.perf_counter() - t0
        extra.add_(1.0)  # changes right after save(): must not reach the checkpoint
        _train(m, opt, 3)  # the step pre-hook holds the first step until the copy is done
        h.wait()
        res = h.result()
    chunks = res["bytes"] // CHUNK
    assert chunks >= 40
    # The core stamps the snapshot once the last chunk is filled: with 3 slots and 2 writers
    # that waits for chunks-3 writes of >= 50 ms, two at a time; save() returned long before.
    assert res["snapshot_seconds"] >= 0.05 * (chunks - 3) / 2
    assert returned < 0.5 * res["snapshot_seconds"]
    _assert_restores_to(tmp_path, want, 7)


def test_memory_saves_take_the_pipelined_path_through_a_stager_of_their_own(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory tier's engine has its own staging pool: its saves are pipelined too (on a GPU, instead of a
    pageable copy of every tensor inside save()), and the optimizer's next step waits for both tiers' copies."""
    monkeypatch.setenv(memory_tier.ROOT_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    run = tmp_path / "run"
    m, opt = _model()
    _train(m, opt)
    extra = torch.arange(50_000, dtype=torch.float64)
    state = {"model": m, "optim": opt, "extra": extra}
    with alpsck.Checkpointer(run, memory=True, overlap_copy=True, chunk_bytes=CHUNK, staging_bytes=3 * CHUNK) as ck:
        want_disk = _expected(state)
        h_disk = ck.save(4, state)
        extra.add_(1.0)
        _train(m, opt)  # waits for step 4's copies
        want_memory = _expected(state)
        h_memory = ck.save(5, state, tier="memory")
        extra.add_(1.0)
        _train(m, opt, 2)  # waits for step 5's copies, made by the memory tier's stager
        h_disk.wait()
        h_memory.wait()
        assert set(ck._stagers) == {"run_dir", "memory"}
        assert ck._stagers["memory"]._engine is not ck._stagers["run_dir"]._engine
        assert ck._stagers["memory"]._unfinished == []  # its snapshot was copied (and dropped once durable)
    _assert_restores_to(run, want_memory, 5, tier="memory")
    _assert_restores_to(run, want_disk, 4)


def test_without_an_optimizer_everything_is_copied_inside_save(tmp_path: Path) -> None:
    """Nothing is guarded by a hook, so save() must not return before every byte is taken."""
    m, _ = _model()
    extra = torch.ones(10_000)
    slow = [{"op": "pwrite", "path_contains": "rank-", "error": 0, "delay_us": 5_000, "count": 2**63}]
    with alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK, staging_bytes=2 * CHUNK,
                             _faults=slow) as ck:
        want = copy.deepcopy(m.state_dict())
        h = ck.save(1, {"model": m, "extra": extra})
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(-3.0)  # not through an optimizer: no hook to wait
        h.wait()
    m2, _ = _model()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    with alpsck.Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": m2, "extra": torch.empty(10_000)}) == 1
    for k, v in want.items():
        assert torch.equal(m2.state_dict()[k], v), k


def test_many_saves_in_flight_with_training_between_them(tmp_path: Path) -> None:
    m, opt = _model()
    state = {"model": m, "optim": opt, "extra": torch.zeros(3)}
    wants = {}
    with alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK, staging_bytes=4 * CHUNK,
                             max_in_flight=3, keep_last=0) as ck:
        for step in range(1, 7):
            _train(m, opt)
            state["extra"] = torch.full((3,), float(step))
            wants[step] = _expected(state)
            ck.save(step, state)
        ck.wait()
        assert ck.latest_step() == 6
    for step in (1, 4, 6):
        _assert_restores_to(tmp_path, wants[step], step)


def test_write_errors_fail_the_save_free_the_pool_and_keep_the_last_good(tmp_path: Path) -> None:
    m, opt = _model()
    state = {"model": m, "optim": opt, "extra": torch.ones(5)}
    faults = [{"op": "pwrite", "path_contains": "step-000000002", "error": errno.ENOSPC, "count": 2**63}]
    with alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK, staging_bytes=2 * CHUNK,
                             _faults=faults) as ck:
        ck.save(1, state).wait()
        want = _expected(state)
        h = ck.save(2, state)
        _train(m, opt)  # the hook must not hang on a failing save
        with pytest.raises(DiskFullError) as ei:
            h.wait()
        assert isinstance(ei.value, CheckpointWriteError) and "step-000000002" in str(ei.value)
        assert [c["step"] for c in ck.checkpoints()] == [1]
        # Every slot came back: a save needing the whole pool twice over still completes.
        ck.save(3, state).wait()
        want3 = _expected(state)
    _assert_restores_to(tmp_path, want3, 3)
    del want


def test_already_committed_step_is_skipped_without_a_copy(tmp_path: Path) -> None:
    m, opt = _model()
    state = {"model": m, "optim": opt, "extra": torch.ones(5)}
    with alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK) as ck:
        ck.save(1, state).wait()
        h = ck.save(1, state)
        h.wait()
        assert h.result()["skipped"]
        _train(m, opt)  # nothing pending: the hook returns at once


def test_close_drops_the_optimizer_hooks(tmp_path: Path) -> None:
    m, opt = _model()
    before = len(opt._optimizer_step_pre_hooks)
    ck = alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK)
    ck.save(1, {"model": m, "optim": opt})
    ck.save(2, {"model": m, "optim": opt})
    assert len(opt._optimizer_step_pre_hooks) == before + 1  # one hook per optimizer, not per save
    ck.close()
    assert len(opt._optimizer_step_pre_hooks) == before
    _train(m, opt)


def test_back_to_back_saves_on_a_dry_pool_do_not_deadlock(tmp_path: Path) -> None:
    """A second save() must not take the slots the first one's feeder is waiting for."""
    m, opt = _model()
    _train(m, opt)
    state = {"model": m, "optim": opt, "extra": torch.zeros(3)}
    slow = [{"op": "pwrite", "path_contains": "rank-", "error": 0, "delay_us": 2_000, "count": 2**63}]
    ck = alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK, staging_bytes=3 * CHUNK, threads=2,
                             max_in_flight=3, keep_last=0, _faults=slow)
    wants = {}
    handles = []
    for step in (1, 2, 3):
        state["extra"] = torch.full((3,), float(step))
        wants[step] = _expected(state)
        handles.append(ck.save(step, state))  # no optimizer step in between: nothing waits for the copy
    for h in handles:
        h.wait(timeout=120)  # TimeoutError, not a hang, if the feeder starved
    ck.close()
    for step in (1, 3):
        _assert_restores_to(tmp_path, wants[step], step)


def test_saves_without_an_optimizer_step_between_them_do_not_pile_up(tmp_path: Path) -> None:
    """Evaluation-only phases: only the optimizer's step pre-hook used to drop finished snapshots.

    Every save kept its snapshot (fill, events, clones) in the stager until the next step, so a
    run that saved without training grew by one per save; now the feeder drops each once copied.
    """
    m, opt = _model()
    _train(m, opt)  # the optimizer has state: guarded tensors, copied by the feeder
    state = {"model": m, "optim": opt, "extra": torch.zeros(3)}
    with alpsck.Checkpointer(tmp_path, overlap_copy=True, chunk_bytes=CHUNK, staging_bytes=4 * CHUNK,
                             max_in_flight=3, keep_last=2) as ck:
        seen: list[weakref.ref[Any]] = []
        for step in range(1, 31):
            state["extra"] = torch.full((3,), float(step))
            ck.save(step, state if step % 2 else {"model": m, "extra": state["extra"]}).wait()
            stager = ck._stagers["run_dir"]
            seen += [weakref.ref(s) for s in stager._unfinished]
            assert len(stager._unfinished) == 0, step  # a durable save is no longer waited for
        for step in range(31, 41):  # back to back, nothing waited in between
            state["extra"] = torch.full((3,), float(step))
            ck.save(step, state)
            seen += [weakref.ref(s) for s in stager._unfinished]
            assert len(stager._unfinished) <= 3, step  # at most the saves in flight
        ck.wait()
        assert stager._unfinished == []
        want = _expected(state)
        gc.collect()
        assert all(r() is None for r in seen)  # nothing of a finished snapshot stays alive
        _train(m, opt)  # the hook has nothing left to wait for
    _assert_restores_to(tmp_path, want, 40)


def _wait_for_slots(ck: alpsck.Checkpointer, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while ck.engine.staging_slots == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return ck.engine.staging_slots


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "sgd-momentum", "none"])
def test_restore_prepares_the_staging_pool_the_saves_will_use(tmp_path: Path, optimizer: str) -> None:
    """restore() sizes the staging pool in the background for the saves to come, counting the state
    an optimizer will have after its first step: the first save (after that step) then finds its
    memory ready and neither allocates nor grows it (issue #25's first-save penalty)."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256))
    opts: dict[str, Any] = {"adamw": lambda p: torch.optim.AdamW(p), "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                            "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}
    state: dict[str, Any] = {"model": model}
    if optimizer in opts:
        state["optimizer"] = opts[optimizer](model.parameters())
    with alpsck.Checkpointer(tmp_path, chunk_bytes=64 << 10, threads=2, max_in_flight=2) as ck:
        assert ck.restore(state) is None
        prepared = _wait_for_slots(ck)
        assert prepared > 0
        if "optimizer" in state:
            model(torch.randn(4, 512)).sum().backward()
            state["optimizer"].step()
        ck.save(1, state).wait()
        assert ck.engine.staging_slots == prepared  # the first save used the prepared pool as it was
        ck.save(2, state).wait()
        assert ck.engine.staging_slots == prepared


def test_prepare_grows_and_shrinks_the_pool_with_the_state(tmp_path: Path) -> None:
    from alpsck import _core

    def extents(n: int) -> list[tuple[str, torch.Tensor]]:
        return [("w", torch.ones(n, dtype=torch.uint8))]

    def settled(engine: _core.Engine, want: int) -> int:
        deadline = time.monotonic() + 30
        while engine.staging_slots != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return engine.staging_slots

    engine = _core.Engine(str(tmp_path), {"chunk_bytes": 1 << 20, "threads": 2, "max_in_flight": 1, "keep_last": 0})
    try:
        engine.save(1, extents(1 << 20)).wait()  # 1 MiB: one chunk, one slot (max_in_flight 1)
        first = engine.staging_slots
        assert first == 1
        engine.prepare([16 << 20])  # 16 MiB to come: grown in the background
        assert settled(engine, 16) == 16
        engine.save(2, extents(16 << 20)).wait()
        assert engine.staging_slots == 16  # the save found it ready
        engine.prepare([1 << 20])  # smaller again: the grown mapping goes; the first always stays
        assert settled(engine, first) == first
        engine.save(3, extents(1 << 20)).wait()
    finally:
        engine.close()
