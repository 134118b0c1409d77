"""The reference training keeps the best losses it records (a whole training in the pytest process: the process
tier); the rule itself is tests/unit/test_retention.py."""

from __future__ import annotations

from pathlib import Path

from support.retention_cases import committed_steps


def test_the_reference_training_keeps_the_best_losses_it_records(tmp_path: Path) -> None:
    from alpsck.examples.llama.train import TrainConfig, train

    cfg = TrainConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, sequence_length=32, batch_size=8,
                      training_steps=24, checkpoint_freq=2, warmup_steps=3, lr=1e-2, log_every=0, device="cpu",
                      checkpoint_dir=str(tmp_path / "ckpt"), loss_file=str(tmp_path / "loss.csv"), keep_last=1,
                      keep_every_steps=10, keep_best="loss:min:2")
    train(cfg)
    losses = {int(s): float(v) for s, v in (x.split(",") for x in (tmp_path / "loss.csv").read_text().splitlines()[1:])}
    saved = {s: losses[s] for s in range(2, 25, 2)}
    best = sorted(saved, key=lambda s: (saved[s], -s))[:2]
    assert set(committed_steps(tmp_path / "ckpt")) == {*best, 10, 20, 24}
