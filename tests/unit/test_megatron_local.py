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
