"""torchtitan 0.3.0 as released on PyPI, its real CheckpointManager, through alpsck (docs/dcp.md's recipe).

tests/support/torchtitan_release_worker.py applies the ``diff`` of docs/dcp.md to the installed
``torchtitan/components/checkpointer/dcp.py`` (each hunk must match exactly once) and trains a small
FSDP2 model at 2 gloo ranks with it, the way torchtitan's Trainer calls its checkpointer. CI installs
torchtitan (.ci/run); without it the tests skip here, and fail under CI.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support import SUPPORT
from support.releases import require_release

from alpsck.dcp.paths import is_alpsck_checkpoint_id
from alpsck.job_env import free_port

WORKER = SUPPORT / "torchtitan_release_worker.py"
TORCHTITAN = "0.3.0"


@pytest.fixture(autouse=True)
def _needs_torchtitan() -> None:
    require_release("torchtitan", "torchtitan", TORCHTITAN, "these tests and docs/dcp.md's recipe")


def test_the_recipe_is_a_patch_git_apply_and_patch_take(tmp_path: Path) -> None:
    """docs/dcp.md's diff, as a user copies it, applies to the released file with ``git apply`` and ``patch -p1``,
    and gives what the worker's own application of its hunks gives (the code the other tests run)."""
    import importlib.util
    import re
    import shutil

    sys.path.insert(0, str(SUPPORT))
    try:
        from torchtitan_release_worker import DOCS, MODULE, recipe_hunks
    finally:
        sys.path.remove(str(SUPPORT))
    m = re.search(r"```diff\n(.*?)```", DOCS.read_text(), re.S)
    assert m, "docs/dcp.md has no diff block"
    (tmp_path / "recipe.diff").write_text(m.group(1))
    spec = importlib.util.find_spec(MODULE)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    expected = source
    for old, new in recipe_hunks(DOCS.read_text()):
        expected = expected.replace(f"\n{old}\n", f"\n{new}\n")
    rel = Path("torchtitan/components/checkpointer/dcp.py")
    for tool in (["git", "apply", str(tmp_path / "recipe.diff")], ["patch", "-p1", "-i", str(tmp_path / "recipe.diff")]):
        if shutil.which(tool[0]) is None:
            pytest.fail(f"{tool[0]} is not installed") if os.environ.get("CI") else pytest.skip(f"no {tool[0]}")
        tree = tmp_path / tool[0]
        (tree / rel).parent.mkdir(parents=True)
        (tree / rel).write_text(source)
        r = subprocess.run(tool, cwd=tree, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{tool}: {r.stdout}{r.stderr}"
        assert (tree / rel).read_text() == expected != source, tool


def _train(storage: str, folder: Path, steps: int, async_mode: str, out: Path, stop: int | None = None,
           world: int = 2) -> list[dict[str, Any]]:
    """The worker on ``world`` ranks (a training of ``steps`` steps, this job stopping after ``stop``); every
    rank must exit 0. Returns each rank's OUT/rank-R.pt."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}
        args = [sys.executable, str(WORKER), storage, str(folder), str(steps), async_mode, str(out), str(stop or steps)]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:  # a rank that failed leaves the others waiting in a collective
            if p.poll() is None:
                p.kill()
                p.communicate()
    for r, (p, o) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r}:\n{o[-6000:]}"
    return [torch.load(out / f"rank-{r}.pt", weights_only=True) for r in range(world)]


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors bit for bit, containers recursively."""
    if isinstance(a, torch.Tensor):
        ok = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and
              torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
        return [] if ok else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where}: keys"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{where}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _same(x, y, f"{where}[{i}]")]
    return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} != {b!r}"]


def _final(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in ("resumed", "losses")}


def _steps(folder: Path) -> list[str]:
    return sorted((n for n in os.listdir(folder) if n.startswith("step-")), key=lambda n: int(n[5:]))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """8 steps through alpsck from scratch, saved every 2 steps (synchronously: the purge, which lists the
    folder right after a save starts, is then deterministic), keep_latest_k=2."""
    root = tmp_path_factory.mktemp("titan")
    return root, _train("alpsck", root, 8, "disabled", root / "out")


def test_the_real_manager_saves_purges_and_a_fresh_one_loads_the_newest_bit_for_bit(
        uninterrupted: tuple[Path, list[dict[str, Any]]]) -> None:
    root, run = uninterrupted
    folder = root / "checkpoint"
    assert [r["resumed"] for r in run] == [0, 0] and len(run[0]["losses"]) == 8
    assert _steps(folder) == ["step-4", "step-6", "step-8"]  # purged at step 6; the last save purges nothing
    for name in _steps(folder):
        assert is_alpsck_checkpoint_id(folder / name), name
        assert (folder / name / ".metadata").read_bytes()[:1] == b"{", name  # alpsck's JSON marker, no pickle
    t = time.monotonic()
    again = _train("alpsck", root, 8, "disabled", root / "again")  # a fresh manager: loads step-8, trains nothing
    print(f"load of step-8 by a fresh job: {time.monotonic() - t:.1f} s")
    assert [r["resumed"] for r in again] == [8, 8] and again[0]["losses"] == []
    for r in range(2):
        assert _same(_final(again[r]), _final(run[r])) == [], f"rank {r}"


def test_a_run_saved_by_filesystemwriter_goes_on_with_alpsck_after_import_dcp(
        tmp_path: Path, uninterrupted: tuple[Path, list[dict[str, Any]]]) -> None:
    _, reference = uninterrupted
    folder = tmp_path / "checkpoint"
    first = _train("filesystem", tmp_path, 8, "disabled", tmp_path / "first", stop=4)  # torchtitan as released
    assert _steps(folder) == ["step-2", "step-4"]
    assert (folder / "step-4" / ".metadata").read_bytes()[:1] == b"\x80"  # DCP's pickle
    assert first[0]["losses"] == reference[0]["losses"][:4]

    cmd = [sys.executable, "-m", "alpsck", "import-dcp", str(folder)]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--trust-pickle" in refused.stderr and "runs any code" in refused.stderr
    assert not is_alpsck_checkpoint_id(folder / "step-4")
    done = subprocess.run([*cmd, "--trust-pickle"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [line.split(": ")[1].split(" ")[0] for line in done.stdout.splitlines()] == ["converted", "converted"]
    for name in ("step-2", "step-4"):
        assert is_alpsck_checkpoint_id(folder / name)
        assert (folder / ".alpsck-import" / f"{name}.filesystemwriter" / ".metadata").read_bytes()[:1] == b"\x80"

    rest = _train("alpsck", tmp_path, 8, "async", tmp_path / "rest")  # the recipe's manager, from step-4, thread async
    assert [r["resumed"] for r in rest] == [4, 4]
    assert rest[0]["losses"] == reference[0]["losses"][4:]
    for r in range(2):
        assert _same(_final(rest[r]), _final(reference[r])) == [], f"rank {r}"
    # torchtitan's purge removes converted steps as its own (here at step 6, unless the async save of step 6
    # had not made its directory yet when the purge listed the folder), and never looks into .alpsck-import
    assert _steps(folder)[-2:] == ["step-6", "step-8"] and set(_steps(folder)) <= {"step-2", "step-4", "step-6", "step-8"}
    assert all(is_alpsck_checkpoint_id(folder / name) for name in _steps(folder))
    assert sorted(os.listdir(folder / ".alpsck-import")) == ["step-2.filesystemwriter", "step-4.filesystemwriter"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_dataloader_state_is_its_own_pickle_bytes_through_alpsck(
        uninterrupted: tuple[Path, list[dict[str, Any]]]) -> None:
    """torchtitan's dataloader state is bytes it pickles itself: alpsck stores and returns them as bytes."""
    root, run = uninterrupted
    import torch.distributed.checkpoint as dcp

    from alpsck.dcp import AlpsckStorageReader

    state: dict[str, Any] = {"dataloader": {"dp_rank_0": b"", "dp_rank_1": b"", "world_size": 0}}
    dcp.load(state, checkpoint_id=str(root / "checkpoint" / "step-8"), storage_reader=AlpsckStorageReader(),
             no_dist=True)
    assert state["dataloader"]["world_size"] == 2
    assert [pickle.loads(state["dataloader"][f"dp_rank_{r}"]) for r in range(2)] == [{"pos": 8}, {"pos": 8}]
    assert run[0]["data_pos"] == 8
