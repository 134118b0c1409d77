"""Rollback in the training loop (issue #43, item 3): a bad loss restores the newest healthy checkpoint
in-process, skips the data window that led to it (also after a requeue), and gives up after N rollbacks;
a run without a rollback is bit-exact with rollback off."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.llama_runs import rollback_training_config

from alpsck.errors import CheckpointError, ConfigError, RollbackLimitError
from alpsck.examples.llama.train import config_from_args, train
from alpsck.restore import ROLLBACKS_FILE, loss_problem, read_rollbacks

# -- the health rule of one value ----------------------------------------------------------------

def test_loss_problem() -> None:
    assert loss_problem(float("nan"), [1.0, 2.0], None) == "loss is nan"
    assert loss_problem(math.inf, [], None) == "loss is +inf"
    assert loss_problem(-math.inf, [], 3.0) == "loss is -inf"
    assert loss_problem(2.0, [2.0, 2.1, 2.2], None) is None  # spikes off
    assert loss_problem(7.0, [2.0, 2.1, 2.2], 3.0) == "loss 7 is above 3 x the median 2.1 of the last 3"
    assert loss_problem(6.0, [2.0, 2.1, 2.2], 3.0) is None
    assert loss_problem(100.0, [2.0], 3.0) is None  # fewer than two recent values decide nothing


# -- the reference training ------------------------------------------------------------------------


def test_gives_up_after_max_rollbacks(tmp_path: Path) -> None:
    # max_rollbacks=0: the first bad loss is already one too many.
    with pytest.raises(RollbackLimitError, match=r"max_rollbacks \(0\)"):
        train(rollback_training_config(tmp_path, nan_at_step=6, max_rollbacks=0))
    assert isinstance(RollbackLimitError("x"), CheckpointError)


@pytest.mark.parametrize(("key", "value"), [("max_rollbacks", -1), ("rollback_skip_batches", -2),
                                            ("nan_at_step", 0), ("spike_factor", 0.5), ("spike_factor", math.nan)])
def test_bad_config_names_the_key(tmp_path: Path, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        train(rollback_training_config(tmp_path, **{key: value}))


def test_cli_flags() -> None:
    cfg = config_from_args(["--no-rollback", "--max-rollbacks", "5", "--rollback-skip-batches", "7",
                            "--spike-factor", "4", "--nan-at-step", "9"])
    assert (cfg.rollback, cfg.max_rollbacks, cfg.rollback_skip_batches, cfg.spike_factor, cfg.nan_at_step) == (
        False, 5, 7, 4.0, 9)
    assert config_from_args([]).rollback is True


def test_a_bad_rollback_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / ROLLBACKS_FILE).write_text(json.dumps({"format": 1, "rollbacks": [{"from_step": "x"}]}))
    with pytest.raises(CheckpointError, match="from_step"):
        read_rollbacks(tmp_path)
