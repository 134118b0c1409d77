"""The C++ core through the Python layer: round trips, snapshot isolation, failures, corruption."""

from __future__ import annotations

import errno
import gc
import json
import time
import warnings
from pathlib import Path

import pytest
import torch

import alpsck
from alpsck import _core
from alpsck.checkpointer import read_checkpoint
from alpsck.errors import (
    CheckpointIOError,
    CheckpointWriteError,
    CorruptCheckpointError,
    DiskFullError,
    StateMismatchError,
    UnsafeCheckpointError,
)

ROOT = Path(__file__).resolve().parents[2]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
          torch.bool, torch.complex64, torch.complex128]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    if not dtype.is_signed:  # uint16/32/64 have few kernels: random bytes, viewed (the top bit set too)
        width = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (*shape, width), generator=g, dtype=torch.int64).to(torch.uint8)
        return raw.view(dtype).reshape(shape)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def test_compiled_core_is_inside_the_installed_package() -> None:
    assert Path(_core.__file__).parent == Path(alpsck.__file__).parent
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c_backend() in ("sse42", "armv8-crc", "portable")


def test_no_ctypes_anywhere_in_the_package() -> None:
    for f in Path(alpsck.__file__).parent.rglob("*.py"):
        assert "ctypes" not in f.read_text(), f


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    shapes = [(), (0,), (1,), (3, 5), (1000, 257)]
    saved = {f"t{i}": _tensor(dtype, s, i) for i, s in enumerate(shapes)}
    with alpsck.Checkpointer(tmp_path, chunk_bytes=64 << 10) as ck:
        ck.save(1, {k: v.clone() for k, v in saved.items()}).wait()
        live = {k: torch.zeros_like(v) for k, v in saved.items()}
        assert ck.restore(live) == 1
    for k, v in saved.items():
        assert live[k].dtype == v.dtype and live[k].shape == v.shape
        # Compare raw bytes: bit-exact, and NaN payloads count too.
        assert torch.equal(live[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("urgent", [False, True], ids=["snapshot", "urgent"])
def test_snapshot_is_isolated_from_mutation_after_save(tmp_path: Path, urgent: bool) -> None:
    w = torch.arange(1 << 20, dtype=torch.float32)
    with alpsck.Checkpointer(tmp_path, chunk_bytes=256 << 10) as ck:
        h = ck.save(3, {"w": w}, urgent=urgent)
        w.mul_(-1)  # the next training step
        h.wait()
        back = {"w": torch.empty_like(w)}
        ck.restore(back)
    assert torch.equal(back["w"], torch.arange(1 << 20, dtype=torch.float32))


def test_model_optimizer_scheduler_rng_and_values(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        sched.step()
    state = {"model": model, "optim": opt, "sched": sched, "rng": alpsck.RNGState(), "epoch": 7, "note": ("a", b"\x00")}
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(3, state).wait()
        expect = torch.rand(3)
        model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(torch.bfloat16)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2)
        state2 = {"model": model2, "optim": opt2, "sched": sched2, "rng": alpsck.RNGState(), "epoch": 0, "note": None}
        assert ck.restore(state2) == 3
    assert torch.equal(torch.rand(3), expect)  # RNG restored to the saved point
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert state2["epoch"] == 7 and state2["note"] == ("a", b"\x00")
    assert sched2.state_dict() == sched.state_dict()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg_sq"], s2[i]["exp_avg_sq"]) for i in s1)


def test_shape_or_dtype_mismatch_names_the_tensor(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 3)}).wait()
        with pytest.raises(StateMismatchError, match="weight"):
            ck.restore({"model": torch.nn.Linear(5, 3)})
        with pytest.raises(StateMismatchError, match="weight"):
            ck.restore({"model": torch.nn.Linear(4, 3).to(torch.float64)})


class _Grown(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.extra = torch.nn.Parameter(torch.zeros(2))


def test_a_mismatch_found_after_the_shapes_leaves_the_live_state_untouched(tmp_path: Path) -> None:
    """Tensors matching in shape and dtype used to be read straight into the live module before
    apply() found a missing state entry or a module key difference: the error said nothing
    changed, yet the weights were the checkpoint's. A helper's review found it."""
    torch.manual_seed(0)
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4)}).wait()
    for make_state, match in ((lambda m: {"model": m, "ema": torch.zeros(3)}, "missing from the checkpoint"),
                              (lambda m: {"model": m}, "module state keys differ")):
        torch.manual_seed(1)
        m = _Grown() if match == "module state keys differ" else torch.nn.Linear(4, 4)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with alpsck.Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError, match=match):
            ck.restore(make_state(m))
        assert all(torch.equal(before[k], v) for k, v in m.state_dict().items()), match


@pytest.mark.parametrize("groups", ["fewer-groups", "other-group-sizes"])
def test_an_optimizer_whose_groups_differ_is_refused_before_the_model_is_loaded(tmp_path: Path, groups: str) -> None:
    """Optimizer.load_state_dict refuses another group layout, but it ran after the model earlier in
    the tree was loaded: the error came with the checkpoint's weights already in the live model."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": m[0].parameters()}, {"params": m[1].parameters(), "lr": 0.1}])
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": m, "optim": opt}).wait()
    torch.manual_seed(1)
    live = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if groups == "fewer-groups":
        live_opt = torch.optim.AdamW(live.parameters())
        match = "2 parameter group.*live optimizer 1"
    else:
        live_opt = torch.optim.AdamW([{"params": [live[0].weight]},
                                      {"params": [live[0].bias, *live[1].parameters()]}])
        match = "parameter group 0 has 2 parameter.*1 in the live"
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with alpsck.Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError, match=match):
        ck.restore({"model": live, "optim": live_opt})
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())


def test_every_failed_background_save_reaches_the_caller(tmp_path: Path) -> None:
    """Two saves fail in the background: the first error is raised by the next save(), the
    second by wait() (it used to be dropped). A helper's review found it."""
    st = {"w": torch.randn(1 << 16)}
    ck = alpsck.Checkpointer(tmp_path, direct_io=False, max_in_flight=2,
                             _faults=[{"op": "pwrite", "error": errno.ENOSPC, "count": 1000}])
    try:
        h1, h2 = ck.save(1, st), ck.save(2, st)
        while not (h1.done() and h2.done()):
            time.sleep(0.01)
        with pytest.raises(DiskFullError, match="step-000000001"):
            ck.save(3, st)
        with pytest.raises(DiskFullError, match="step-000000002"):
            ck.wait()
        ck.wait()  # each failure is reported once
    finally:
        ck.close()
    # close() raises the first failure and warns about the others (they used to vanish there).
    # (Each failing write takes 1 s, so no save fails before the next one is issued and reaps it.)
    ck = alpsck.Checkpointer(tmp_path, direct_io=False, max_in_flight=3,
                             _faults=[{"op": "pwrite", "error": errno.ENOSPC, "count": 1000, "delay_us": 1_000_000}])
    handles = [ck.save(s, st) for s in (4, 5, 6)]
    while not all(h.done() for h in handles):
        time.sleep(0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(DiskFullError, match="step-000000004"):
            ck.close()
    assert sorted(str(w.message).split("step ")[1][:1] for w in caught if "failed too" in str(w.message)) == ["5", "6"]
    ck.close()  # closed: nothing more


def test_disk_full_fails_loudly_keeps_earlier_and_recovers(tmp_path: Path) -> None:
    w = torch.ones(300_000)
    # Writes 2..4 of the second save fail with ENOSPC; later ones succeed (space came back).
    faults = [{"op": "pwrite", "path_contains": "step-000000002", "error": errno.ENOSPC, "count": 100}]
    with alpsck.Checkpointer(tmp_path, chunk_bytes=64 << 10, _faults=faults) as ck:
        ck.save(1, {"w": w}).wait()
        h = ck.save(2, {"w": w * 2})
        with pytest.raises(DiskFullError) as ei:
            h.wait()
        assert ei.value.errno == errno.ENOSPC and "step-000000002" in str(ei.value)
        assert isinstance(ei.value, CheckpointWriteError) and isinstance(ei.value, OSError)
        assert [c["step"] for c in ck.checkpoints()] == [1]
        ck.save(3, {"w": w * 3}).wait()  # training goes on, checkpointing again works
        back = {"w": torch.empty_like(w)}
        assert ck.restore(back) == 3 and torch.equal(back["w"], w * 3)


def test_background_error_surfaces_on_next_save(tmp_path: Path) -> None:
    faults = [{"op": "fdatasync", "path_contains": "rank-", "error": errno.EIO, "count": 1}]
    with alpsck.Checkpointer(tmp_path, _faults=faults) as ck:
        h = ck.save(1, {"w": torch.ones(10)})
        while not h.done():
            pass
        with pytest.raises(CheckpointWriteError, match="fdatasync"):
            ck.save(2, {"w": torch.ones(10)})
        ck.save(3, {"w": torch.ones(10)}).wait()
        assert ck.latest_step() == 3


def test_corrupt_newest_falls_back_with_a_warning(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path, keep_last=0) as ck:
        for s in (10, 20):
            ck.save(s, {"w": torch.full((50_000,), float(s))}).wait()
    shard = tmp_path / "step-000000020" / "rank-00000.bin"
    with open(shard, "r+b") as f:
        f.seek(1234)
        b = f.read(1)
        f.seek(1234)
        f.write(bytes([b[0] ^ 0xFF]))
    back = {"w": torch.empty(50_000)}
    with pytest.warns(RuntimeWarning, match=r"step-000000020.*CRC mismatch"):
        assert alpsck.restore_into(tmp_path, back) == 10
    assert torch.equal(back["w"], torch.full((50_000,), 10.0))


def _write_raw(run_dir: Path, step: int, meta: dict) -> None:
    eng = _core.Engine(str(run_dir))
    eng.save(step, [], json.dumps(meta)).wait()
    eng.close()


def test_crafted_tree_naming_a_class_executes_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = {"__t": "class", "module": "os", "name": "system", "args": [f"touch {marker}"]}
    tree = {"format": "alpsck.tree", "version": 1, "entries": {"x": {"kind": "value", "value": evil}}}
    _write_raw(tmp_path, 1, {"format": "alpsck-tree/1", "step": 1, "tree": tree})
    with pytest.raises(UnsafeCheckpointError):
        read_checkpoint(tmp_path / "step-000000001")
    with pytest.warns(RuntimeWarning, match="skipping corrupt checkpoint"):  # restore refuses it, starts fresh
        assert alpsck.restore_into(tmp_path, {"x": 0}) is None
    assert not marker.exists()


def test_non_tree_meta_is_reported_corrupt(tmp_path: Path) -> None:
    _write_raw(tmp_path, 1, {"format": "something-else"})
    with pytest.raises(CorruptCheckpointError, match="alpsck-tree/1"):
        read_checkpoint(tmp_path / "step-000000001")


def test_unwritable_or_bad_run_dir_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(alpsck.errors.UsageError, match="not a directory"):
        alpsck.Checkpointer(f)
    with pytest.raises(CheckpointIOError, match="nope"):
        _core.scan(str(tmp_path / "nope"))


def test_a_checkpointer_that_fails_to_open_is_freed_at_once(tmp_path: Path) -> None:
    """No reference cycle through the frames of a failed open (alpsck/store/engines.py's docstring): one kept the
    half-made Checkpointer, and the process group its ranks hold, alive past destroy_process_group() until the
    cyclic collector ran; a gloo group alive as the interpreter exits aborts it (CI 42)."""
    f = tmp_path / "file"
    f.write_text("x")
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, alpsck.Checkpointer)}
    enabled = gc.isenabled()
    gc.disable()
    try:
        for where, error in ((f, alpsck.errors.UsageError), (f / "run", NotADirectoryError)):  # refused; open failed
            with pytest.raises(error):
                alpsck.Checkpointer(where)
            left = [o for o in gc.get_objects() if isinstance(o, alpsck.Checkpointer) and id(o) not in before]
            assert not left, f"{where}: a half-made Checkpointer is left for the cyclic collector"
            del left
    finally:
        if enabled:
            gc.enable()


def test_mismatch_leaves_live_state_untouched(tmp_path: Path) -> None:
    with alpsck.Checkpointer(tmp_path) as ck:
        ck.save(1, {"a": torch.ones(10), "b": torch.ones(4)}).wait()
        live = {"a": torch.zeros(10), "b": torch.zeros(5)}  # b has another shape
        with pytest.raises(StateMismatchError, match="b"):
            ck.restore(live)
    assert torch.equal(live["a"], torch.zeros(10))  # not overwritten by the read


def test_restore_reads_into_live_tensors_and_refuses_to_hide_a_half_restore(tmp_path: Path) -> None:
    w = torch.arange(300_000, dtype=torch.float32)
    with alpsck.Checkpointer(tmp_path, chunk_bytes=64 << 10, keep_last=0) as ck:
        ck.save(1, {"w": w}).wait()
        live = {"w": torch.zeros_like(w)}
        ptr = live["w"].data_ptr()
        ck.restore(live)
        assert live["w"].data_ptr() == ptr and torch.equal(live["w"], w)  # in place, same memory
    shard = tmp_path / "step-000000001" / "rank-00000.bin"
    with open(shard, "r+b") as fh:  # corrupt the last data chunk: earlier chunks land in live first
        fh.seek(1_100_000)
        fh.write(b"\x01\x02\x03")
    with pytest.warns(RuntimeWarning, match="CRC mismatch"), pytest.raises(CorruptCheckpointError, match="overwrote"):
        alpsck.restore_into(tmp_path, {"w": torch.zeros_like(w)}, threads=1)
