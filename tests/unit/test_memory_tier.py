"""The memory tier (alpsck.store.memory_tier, alpsck.memory): saves to node memory, restores from the
newer tier, falls back to the run directory once with one warning, never restores another run's snapshot."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from support.corrupt import flip_byte

from alpsck import Checkpointer
from alpsck.errors import CheckpointError, ConfigError, CorruptCheckpointError, UsageError
from alpsck.slurm.config import parse_config
from alpsck.slurm.context import JobContext
from alpsck.store import memory_tier


@pytest.fixture(autouse=True)
def memory_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv(memory_tier.ROOT_ENV, str(root))
    return root


def make_state(seed: int = 0) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    return {"model": model, "step": 0}


def weights(state: dict[str, object]) -> torch.Tensor:
    model = state["model"]
    assert isinstance(model, torch.nn.Linear)
    return model.weight.detach().clone()


def advance(state: dict[str, object], step: int) -> None:
    model = state["model"]
    assert isinstance(model, torch.nn.Linear)
    with torch.no_grad():
        model.weight.add_(1.0)
    state["step"] = step


def shard(step_dir: Path) -> Path:
    return next(step_dir.glob("rank-*.bin"))


def step_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("step-") and p.is_dir())


def saved_with_a_bad_memory_copy(run: Path, state: dict[str, object], *, on_disk: bool) -> Path:
    """Step 0 to the run directory (``on_disk``), step 5 to memory; then a byte of the memory copy flipped."""
    with Checkpointer(run, memory=True) as ck:
        if on_disk:
            ck.save(0, state).wait()
        advance(state, 5)
        ck.save(5, state, tier="memory").wait()
        memory_dir = ck.memory_dir
    assert memory_dir is not None
    bad = shard(memory_dir / "step-000000005")
    flip_byte(bad, bad.stat().st_size // 2)
    return memory_dir


def test_a_newer_memory_snapshot_is_restored_from_memory_bit_exact(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = make_state()
    with Checkpointer(run, memory=True) as ck:
        ck.save(0, state).wait()
        advance(state, 5)
        ck.save(5, state, tier="memory").wait()
        assert ck.memory_dir is not None and ck.memory_dir.parent.parent.parent == Path(memory_tier.memory_root())
        assert ck.memory_dir.name == "ranks-00000-00000"  # this node's ranks: one
        assert step_dirs(ck.memory_dir) == ["step-000000005"] and step_dirs(run) == ["step-000000000"]
        assert ck.latest_step() == 5
    expected = weights(state)
    fresh = make_state(seed=1)
    with Checkpointer(run, memory=True) as ck:
        assert ck.restore(fresh) == 5 and ck.restored_tier == "memory"
    assert torch.equal(weights(fresh), expected) and fresh["step"] == 5


def test_the_run_directory_wins_when_it_is_newer(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = make_state()
    with Checkpointer(run, memory=True) as ck:
        advance(state, 5)
        ck.save(5, state, tier="memory").wait()
        advance(state, 10)
        ck.save(10, state).wait()  # a final checkpoint at a stop: the run directory
    fresh = make_state(seed=1)
    with Checkpointer(run, memory=True) as ck:
        assert ck.restore(fresh) == 10 and ck.restored_tier == "run_dir"
    assert fresh["step"] == 10


def test_a_flipped_byte_in_memory_falls_back_to_the_run_directory_with_one_warning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = make_state()
    on_disk = weights(state)
    memory_dir = saved_with_a_bad_memory_copy(run, state, on_disk=True)
    fresh = make_state(seed=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Checkpointer(run, memory=True) as ck:
            assert ck.restore(fresh) == 0 and ck.restored_tier == "run_dir"
    mine = [str(w.message) for w in said if "memory checkpoint" in str(w.message) or "step 5" in str(w.message)]
    assert len(mine) == 1 and str(memory_dir) in mine[0] and "step 5" in mine[0], mine
    assert torch.equal(weights(fresh), on_disk) and fresh["step"] == 0


def test_a_bad_memory_copy_read_into_nothing_live_is_reported_with_its_chunk(tmp_path: Path) -> None:
    """Restored into an empty state (Megatron-LM's local manager: entries the live state lacks come back as saved),
    nothing live is touched by the bad copy, and the one warning names the chunk that failed its CRC (until stop
    68 it said only that the step "is not valid")."""
    run = tmp_path / "run"
    w = torch.arange(1 << 18, dtype=torch.float32)
    with Checkpointer(run, memory=True) as ck:
        ck.save(1, {"layout": {"w": w}}).wait()
        ck.save(5, {"layout": {"w": w + 1}}, tier="memory").wait()
        memory_dir = ck.memory_dir
    assert memory_dir is not None
    bad = shard(memory_dir / "step-000000005")
    flip_byte(bad, bad.stat().st_size // 2)
    state: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with Checkpointer(run, memory=True) as ck:
            assert ck.restore(state) == 1 and ck.restored_tier == "run_dir"
    [warned] = [str(m.message) for m in said if "memory checkpoint" in str(m.message)]
    assert "step 5 is not valid" in warned and "CRC mismatch in chunk 0" in warned and "layout/w" in warned, warned
    assert torch.equal(state["layout"]["w"], w)  # type: ignore[index]


def test_a_bad_memory_copy_with_nothing_on_disk_says_the_live_state_is_touched(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saved_with_a_bad_memory_copy(run, make_state(), on_disk=False)
    with Checkpointer(run, memory=True) as ck, pytest.warns(RuntimeWarning, match="not usable"):
        with pytest.raises(CorruptCheckpointError):
            ck.restore(make_state(seed=1))


def test_the_memory_tier_keeps_one_checkpoint_and_a_named_step_is_read_from_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = make_state()
    with Checkpointer(run, memory=True) as ck:
        for step in (5, 10, 15):
            advance(state, step)
            ck.save(step, state, tier="memory").wait()
        assert ck.memory_dir is not None
        assert step_dirs(ck.memory_dir) == ["step-000000015"]
    fresh = make_state(seed=1)
    with Checkpointer(run, memory=True) as ck:
        assert ck.restore(fresh, step=15) == 15 and ck.restored_tier == "memory"


def test_a_run_directory_made_again_never_restores_the_old_runs_snapshot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = make_state()
    with Checkpointer(run, memory=True) as ck:
        advance(state, 5)
        ck.save(5, state, tier="memory").wait()
        old = ck.memory_dir
    shutil.rmtree(run)
    run.mkdir()
    with Checkpointer(run, memory=True) as ck:
        assert ck.memory_dir != old
        assert ck.restore(make_state(seed=1)) is None and ck.restored_tier is None


def test_wrong_uses_are_refused_by_name(tmp_path: Path) -> None:
    state = make_state()
    with Checkpointer(tmp_path / "plain") as ck:
        with pytest.raises(UsageError, match="memory=True"):
            ck.save(1, state, tier="memory")
        with pytest.raises(UsageError, match="tier: 'disk'"):
            ck.save(1, state, tier="disk")
    with Checkpointer(tmp_path / "run", memory=True) as ck, pytest.raises(UsageError, match="pin"):
        ck.save(1, state, tier="memory", pin=True)
    with pytest.raises(UsageError, match="memory: 3"):
        Checkpointer(tmp_path / "other", memory=3)  # type: ignore[arg-type]
    assert not (tmp_path / "other").exists()  # refused before anything was made
    Checkpointer(tmp_path / "other").close()


def test_a_run_identity_that_cannot_be_made_fails_the_open_and_leaves_nothing_locked(tmp_path: Path) -> None:
    """Rank 0 reads or makes the run's identity as its engine on the run directory opens (what it says rides on
    that open's collectives): when it can do neither, the open fails, naming it, and leaves the run directory
    unlocked, with its checkpoints."""
    run = tmp_path / "run"
    with Checkpointer(run) as ck:
        ck.save(1, make_state())
    (run / ".run-id").mkdir()  # neither readable as the identity nor replaceable by it
    with pytest.raises(CheckpointError, match="identity could not be read or made for its memory tier"):
        Checkpointer(run, memory=True)
    shutil.rmtree(run / ".run-id")
    with Checkpointer(run, memory=True) as ck:
        state = make_state(1)
        assert ck.restore(state) == 1
        assert ck.restored_tier == "run_dir"


def test_restore_prepares_the_staging_memory_of_the_tiers_it_is_told(tmp_path: Path) -> None:
    """A run that saves to one tier only (Megatron-LM's local checkpoints: memory) has restore() fault in that
    tier's staging alone; the other's engine maps nothing until its first save."""
    state = make_state()
    for prepare, want in ((True, {"run_dir", "memory"}), ("memory", {"memory"}), ("run_dir", {"run_dir"}),
                          (False, set())):
        with Checkpointer(tmp_path / f"run-{prepare}", memory=True) as ck:
            assert ck._memory is not None
            engines = {"run_dir": ck.engine, "memory": ck._memory.engine}
            ck.restore(state, prepare=prepare)
            for engine in engines.values():
                engine.wait_prepared()
            assert {tier for tier, engine in engines.items() if engine.staging_slots} == want, prepare
    with Checkpointer(tmp_path / "plain") as ck:
        with pytest.raises(UsageError, match="tier: 'disk'"):
            ck.restore(state, prepare="disk")
        with pytest.raises(UsageError, match="memory=True"):
            ck.prepare(state, tier="memory")
        with pytest.raises(UsageError, match="memory=True"):
            ck.restore(state, prepare="memory")


def test_an_explicit_memory_directory_is_used_as_given(tmp_path: Path) -> None:
    where = tmp_path / "node-memory"
    state = make_state()
    with Checkpointer(tmp_path / "run", memory=where) as ck:
        ck.save(3, state, tier="memory").wait()
    assert step_dirs(where / "ranks-00000-00000") == ["step-000000003"]


def _job(tmp_path: Path, checkpoint: str) -> JobContext:
    cfg = parse_config(f"name: t\nrun_dir: {tmp_path / 'job-run'}\nslurm:\n  time: '00:10:00'\n"
                       f"entry:\n  function: m:f\ncheckpoint: {{{checkpoint}}}\n")
    return JobContext(cfg, "1", 0, 0, 1, stop=None)  # type: ignore[arg-type]  # stop: not polled here


def test_the_job_says_which_tier_is_due_and_its_checkpointer_opens_the_memory_tier(tmp_path: Path) -> None:
    job = _job(tmp_path, "every_steps: 50, memory_every: 5")
    assert [job.checkpoint_due(s) for s in (5, 7, 45, 50, 100)] == ["memory", "", "memory", "run_dir", "run_dir"]
    with job.checkpointer() as ck:
        assert ck.memory_dir is not None
        ck.save(5, make_state(), tier=job.checkpoint_due(5)).wait()
        assert step_dirs(ck.memory_dir) == ["step-000000005"]
    plain = _job(tmp_path, "every_steps: 50")
    assert plain.checkpoint_due(5) == "" and plain.checkpoint_due(50) == "run_dir"


def test_a_bad_memory_every_names_the_key(tmp_path: Path) -> None:
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(ConfigError, match="checkpoint.memory_every"):
            _job(tmp_path, f"memory_every: {bad}")


def test_a_memory_save_the_nodes_memory_cannot_hold_fails_naming_the_sizes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A tmpfs's pages are the node's memory: its statvfs size is no promise that the node has them. The pre-flight
    counts the node's available memory (MemAvailable) as a room of a tmpfs; a save it cannot hold fails loudly,
    before anything is written, and the run directory's checkpoint stays."""
    from alpsck.errors import DiskFullError
    from alpsck.store import preflight

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\n")
    assert preflight.mem_available(str(meminfo)) == 2048 * 1024
    assert preflight.mem_available(str(tmp_path / "none")) is None
    state = make_state()
    run = tmp_path / "run"
    with Checkpointer(run, memory=True) as ck:
        ck.save(0, state).wait()
        monkeypatch.setenv("ALPSCK_FS_KIND", "tmpfs")
        monkeypatch.setattr(preflight, "mem_available", lambda: 1000)
        with pytest.raises(DiskFullError, match=r"the node's available memory \(MemAvailable.* leaves 0\.0 MiB \(1000 bytes\)"):
            ck.save(5, state, tier="memory")
        memory_dir = ck.memory_dir
    assert memory_dir is not None and step_dirs(memory_dir) == [] and step_dirs(run) == ["step-000000000"]


def test_inspect_checkpoints_lists_what_this_nodes_memory_holds(tmp_path: Path, memory_root: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from alpsck.cli import main

    run, plain = tmp_path / "run", tmp_path / "plain"
    state = make_state()
    with Checkpointer(run, memory=True) as ck:
        ck.save(1, state).wait()
        ck.save(5, state, tier="memory").wait()
    with Checkpointer(plain) as ck:
        ck.save(1, state).wait()

    def inspect(path: Path, *args: str) -> str:
        assert main(["inspect-checkpoints", str(path), *args]) == 0
        return capsys.readouterr().out

    out = inspect(run)
    assert "ranks 0-0: step 5 committed" in out and "newer than the run directory's *" in out, out
    doc = json.loads(inspect(run, "--json"))
    group = doc["memory"]["groups"][0]
    assert group["group"] == "ranks-00000-00000" and [c["step"] for c in group["checkpoints"]] == [5]
    assert json.loads(inspect(plain, "--json"))["memory"] is None and "memory tier" not in inspect(plain)
    monkeypatch.setenv(memory_tier.ROOT_ENV, str(tmp_path / "elsewhere"))  # another node: its memory is not here
    assert "memory tier: nothing on this node" in inspect(run)
