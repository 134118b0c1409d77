"""AlpsckLocalCheckpointManager's encoding of a MCoreTensorAwareStateDict, in this process (one rank, no process
group): what Megatron-LM's local checkpoints hold comes back with the same types and values, never through a pickle,
and what alpsck cannot hold is refused by name before anything is written. The kill-and-resume runs with a real
megatron-core GPT are tests/ranks/test_megatron.py."""

from __future__ import annotations

import argparse
import enum
from pathlib import Path

import pytest
import torch
from support.releases import require_release

from alpsck.errors import NoCheckpointError, StateTypeError, UsageError


class Backend(enum.Enum):
    LOCAL = 1


@pytest.fixture(autouse=True)
def _needs_megatron() -> None:
    require_release("megatron.core", "megatron-core", "0.16.1", "this test and docs/megatron.md")


def test_a_local_checkpoint_comes_back_with_its_layout_objects_and_namespace(tmp_path: Path) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from alpsck.integrations.megatron_local import AlpsckLocalCheckpointManager

    w = torch.arange(12.0).reshape(3, 4)
    sharded = {"model": {"w": ShardedTensor.from_rank_offsets("w", w, (0, 1, 2), replica_id=(0, 1, 0)),
                         "extra": ShardedObject("extra", {"a": [1, 2]}, (2,), (1,), replica_id=0)},
               "b": ShardedTensor.from_rank_offsets("b", torch.ones(2, dtype=torch.bfloat16))}
    args = argparse.Namespace(hidden_size=32, params_dtype=torch.bfloat16, backend=Backend.LOCAL, ranks=[0, 1])
    manager = AlpsckLocalCheckpointManager(tmp_path / "local", keep_last=1)
    assert manager.find_latest() == -1
    with pytest.raises(NoCheckpointError):
        manager.load()
    for iteration in (5, 10):
        state = MCoreTensorAwareStateDict(common={"args": args, "iteration": iteration}, sharded_state_dict=sharded)
        assert manager.save(state, iteration) is None
    assert manager.find_latest() == 10
    got, name = manager.load()
    assert name.endswith("step-000000010") and (tmp_path / "local" / "rank-00000").is_dir()
    assert got.common["iteration"] == 10 and isinstance(got.common["args"], argparse.Namespace)
    assert vars(got.common["args"]) == {"hidden_size": 32, "params_dtype": torch.bfloat16, "backend": "LOCAL",
                                        "ranks": [0, 1]}  # an Enum comes back as its name
    st, b = got.sharded_state_dict["model"]["w"], got.sharded_state_dict["b"]
    assert isinstance(st, ShardedTensor) and torch.equal(st.data, w)
    for f in ("key", "dtype", "local_shape", "global_shape", "global_offset", "axis_fragmentations", "replica_id"):
        assert getattr(st, f) == getattr(sharded["model"]["w"], f), f
    assert b.dtype == torch.bfloat16 and torch.equal(b.data, torch.ones(2, dtype=torch.bfloat16))
    obj = got.sharded_state_dict["model"]["extra"]
    assert isinstance(obj, ShardedObject) and obj.data == {"a": [1, 2]} and obj.global_offset == (1,)
    manager.close()


def test_a_local_checkpoint_in_memory_is_read_back_and_only_the_memory_tier_made_ready_for_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``memory=True`` a new manager's find_latest() restores from node memory and prepares the staging of
    the tier it saves to, not the run directory's, which it never writes (80 MiB of 8 MiB slots at 2 MiB before)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from alpsck.integrations.megatron_local import AlpsckLocalCheckpointManager
    from alpsck.store import memory_tier

    monkeypatch.setenv(memory_tier.ROOT_ENV, str(tmp_path / "shm"))
    w = torch.arange(1 << 16, dtype=torch.float32)
    state = MCoreTensorAwareStateDict(common={"iteration": 7},
                                      sharded_state_dict={"w": ShardedTensor.from_rank_offsets("w", w)})
    with_saves = AlpsckLocalCheckpointManager(tmp_path / "local", memory=True)
    with_saves.save(state, 7)
    with_saves.close()
    manager = AlpsckLocalCheckpointManager(tmp_path / "local", memory=True)
    assert manager.find_latest() == 7
    got, name = manager.load()
    assert name.endswith("iteration 7 (memory)") and torch.equal(got.sharded_state_dict["w"].data, w)
    ck = manager._ck
    assert ck is not None and ck._memory is not None
    ck._memory.engine.wait_prepared()
    assert ck._memory.engine.staging_slots == 1 and ck.engine.staging_slots == 0  # one 8 MiB chunk, one in flight
    manager.close()


def test_what_a_local_checkpoint_cannot_hold_is_refused_by_name_and_nothing_is_written(tmp_path: Path) -> None:
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    from alpsck.integrations.megatron_local import AlpsckLocalCheckpointManager

    manager = AlpsckLocalCheckpointManager(tmp_path / "local")
    with pytest.raises(StateTypeError, match="opaque"):
        manager.save(MCoreTensorAwareStateDict(common={"opaque": object()}, sharded_state_dict={}), 1)
    with pytest.raises(UsageError, match="MCoreTensorAwareStateDict"):
        manager.save({"w": torch.ones(2)}, 1)
    with pytest.raises(UsageError, match="rank"):
        AlpsckLocalCheckpointManager(tmp_path / "local", rank=1)
    assert manager.find_latest() == -1
    manager.close()


def test_a_failed_save_raises_its_own_error_after_the_ranks_agree() -> None:
    """The agreement both Megatron paths end their saves with (the async strategy's finalize, the local manager's):
    one rank here, so its own error decides."""
    from alpsck.errors import CheckpointError
    from alpsck.integrations.megatron_local import raise_unless_every_rank_saved
    from alpsck.ranks import Ranks

    raise_unless_every_rank_saved(None, Ranks(), "a local checkpoint")  # nothing failed: no error
    cause = OSError(28, "No space left on device")
    with pytest.raises(CheckpointError, match="a local checkpoint through alpsck failed: .*No space") as e:
        raise_unless_every_rank_saved(cause, Ranks(), "a local checkpoint")
    assert e.value.__cause__ is cause


@pytest.mark.parametrize("local_memory", [False, True])
def test_install_puts_alpscks_strategy_and_local_manager_into_pretrains_context(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, local_memory: bool) -> None:
    """``install()`` inside Megatron-LM's ``pretrain``: ``megatron.training`` is not in megatron-core's wheel, so a
    stand-in of its two names (``get_args``, ``training.setup_model_and_optimizer``) takes its place here. The wrapped
    setup puts alpsck's save strategy into ``checkpointing_context`` and replaces the local checkpoint manager
    ``pretrain`` made by alpsck's on the same directory; Megatron-LM's ``--replication`` is said to be dropped
    unless the memory tier keeps a replica."""
    import sys
    import types
    import warnings

    from alpsck.integrations import megatron as alpsck_megatron
    from alpsck.integrations.megatron_local import AlpsckLocalCheckpointManager

    seen: list[dict[str, object]] = []
    training = types.ModuleType("megatron.training.training")
    training.setup_model_and_optimizer = lambda *a, checkpointing_context, **k: seen.append(checkpointing_context) or "model"
    package = types.ModuleType("megatron.training")
    package.training = training  # type: ignore[attr-defined]
    package.get_args = lambda: argparse.Namespace(ckpt_fully_parallel_save=False)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron.training", package)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training)
    alpsck_megatron.install(local_memory=local_memory)

    class NvidiaManager:  # what pretrain makes for --non-persistent-ckpt-type local --replication
        local_ckpt_dir = str(tmp_path / "local")
        repl_strategy = object()

    context: dict[str, object] = {"local_checkpoint_manager": NvidiaManager()}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert training.setup_model_and_optimizer(checkpointing_context=context) == "model"
    assert seen == [context] and isinstance(context["save_strategy"], alpsck_megatron.AlpsckSaveStrategy)
    manager = context["local_checkpoint_manager"]
    assert isinstance(manager, AlpsckLocalCheckpointManager) and manager.local_ckpt_dir == str(tmp_path / "local")
    assert manager.memory is local_memory
    replication = [w for w in said if "--replication is not applied" in str(w.message)]
    assert len(replication) == (0 if local_memory else 1), [str(w.message) for w in said]
