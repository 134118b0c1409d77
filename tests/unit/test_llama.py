"""The Llama reference training: model pieces, and crash + resume reproducing losses byte for byte."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.llama_runs import small_training_config

from alpsck.examples.llama.data import SyntheticBatches, TextBatches
from alpsck.examples.llama.model import (
    ModelArgs,
    Transformer,
    apply_rope,
    ffn_hidden_dim,
    rope_frequencies,
)
from alpsck.examples.llama.train import (
    config_from_args,
    train,
)

REPO = Path(__file__).resolve().parents[2]
TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32)


def test_forward_shapes_and_gqa_projections() -> None:
    torch.manual_seed(0)
    model = Transformer(TINY)
    assert model(torch.randint(0, 64, (3, 10))).shape == (3, 10, 64)
    attn = model.layers[0].attention
    assert attn.wq.weight.shape == (32, 32) and attn.wk.weight.shape == (16, 32)
    assert attn.wv.weight.shape == (16, 32) and model.output.weight.data_ptr() != model.tok_embeddings.weight.data_ptr()


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    torch.manual_seed(0)
    gqa = Transformer(TINY)
    mha = Transformer(ModelArgs(**{**TINY.__dict__, "n_kv_heads": 4}))
    sd = gqa.state_dict()
    hd = TINY.head_dim
    for k, v in sd.items():
        if k.endswith(("wk.weight", "wv.weight")):  # kv head j serves query heads 2j, 2j+1
            sd[k] = v.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_rope_uses_theta_and_is_relative() -> None:
    freqs = rope_frequencies(8, 500000.0)
    torch.testing.assert_close(freqs, 500000.0 ** (-torch.arange(0, 8, 2) / 8))
    x = torch.randn(1, 6, 2, 8)
    a, b = apply_rope(x, 500000.0), apply_rope(x, 10000.0)
    torch.testing.assert_close(a[:, 0], x[:, 0])  # position 0 is not rotated
    assert not torch.allclose(a[:, 1:], b[:, 1:])
    torch.testing.assert_close(a.norm(dim=-1), x.norm(dim=-1))
    # <rope(q)_m, rope(k)_n> depends only on m - n
    q, k = torch.randn(8), torch.randn(8)
    seq = torch.stack([q if i % 2 == 0 else k for i in range(6)]).view(1, 6, 1, 8)
    r = apply_rope(seq, 500000.0)[0, :, 0]
    torch.testing.assert_close(r[2] @ r[1], r[4] @ r[3])
    m1 = Transformer(ModelArgs(**{**TINY.__dict__, "rope_theta": 10000.0}))
    m2 = Transformer(TINY)
    m2.load_state_dict(m1.state_dict())
    tokens = torch.randint(0, 64, (1, 8))
    assert not torch.allclose(m1(tokens), m2(tokens))


def test_swiglu_hidden_dim_rule() -> None:
    assert ffn_hidden_dim(4096, 1024, 1.3) == 14336  # Llama-3-8B
    assert ffn_hidden_dim(32, 256, None) == 256
    assert ffn_hidden_dim(96, 32, None) == 256  # int(2 * 384 / 3) = 256
    assert Transformer(TINY).layers[0].feed_forward.w1.weight.shape == (96, 32)


def test_llama3_8b_is_constructible_on_meta() -> None:
    args = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                     multiple_of=1024, ffn_dim_multiplier=1.3)
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_batches_are_pure_functions_of_seed_index_rank(tmp_path: Path) -> None:
    a, b = SyntheticBatches(64, 4, 16, seed=1), SyntheticBatches(64, 4, 16, seed=1)
    b.load_state_dict({"seed": 1, "position": 5})
    for _ in range(5):
        a.next()
    assert all(torch.equal(x, y) for x, y in zip(a.next(), b.next(), strict=True))
    assert not torch.equal(SyntheticBatches(64, 4, 16, seed=1, rank=1).batch(0)[0], a.batch(0)[0])
    text = TextBatches(torch.arange(100) % 256, 2, 8, seed=0)
    inputs, targets = text.batch(3)
    assert inputs.shape == (2, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])


def test_stop_is_not_polled_after_the_last_step(tmp_path: Path) -> None:
    """A stop polled (and so taken) after the last step made the SLURM runner requeue a finished
    run, or give up on it with exit 1 when no restarts were left."""
    polls: list[int] = []
    result = train(small_training_config(tmp_path, training_steps=4), stop_requested=lambda: bool(polls.append(1)))
    assert result.final_step == 4 and not result.stopped
    assert len(polls) == 4  # before steps 1, 2, 3 and 4; none after step 4


def test_text_data_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    result = train(small_training_config(tmp_path, training_steps=4, vocab_size=258, data_file=str(corpus)))
    assert result.final_step == 4 and math.isfinite(result.last_loss or math.nan)


def test_cli_flags() -> None:
    cfg = config_from_args(["--load-checkpoint", "--model-dtype", "bf16", "--n-kv-heads", "8", "--dim", "4096",
                            "--n-layers", "32", "--n-heads", "32", "--checkpointer", "alpsck"])
    assert cfg.load_checkpoint and cfg.load_checkpoint_dir is None and cfg.model_dtype == "bf16"
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (4096, 32, 32, 8)
    cfg.validate()
    assert config_from_args(["--load-checkpoint", "runs/x"]).load_checkpoint_dir == "runs/x"
    assert not config_from_args([]).load_checkpoint


# ---------------------------------------------------- the torch.save baseline checkpointer

def test_torch_checkpointer_retention_and_corrupt_fallback(tmp_path: Path) -> None:
    from alpsck.errors import StateMismatchError
    from alpsck.torch_save import TorchSaveCheckpointer, checkpoint_path

    model = torch.nn.Linear(3, 2)
    with TorchSaveCheckpointer(tmp_path, keep_last=2, max_in_flight=4) as ckpt:
        for step in (10, 20, 30):
            with torch.no_grad():
                model.weight.fill_(step)
            handle = ckpt.save(step, {"model": model, "step": step})
            handle.wait()
            assert handle.done() and handle.step == step
        ckpt.wait()
    # (.lock: the run directory's writer lock, which the baseline takes too; emptied on close)
    assert [p.name for p in sorted(tmp_path.iterdir())] == [".lock", "torch-step-000000020.pt", "torch-step-000000030.pt"]
    assert (tmp_path / ".lock").read_text() == ""
    reader = TorchSaveCheckpointer(tmp_path)
    assert reader.latest_step() == 30
    newest = checkpoint_path(tmp_path, 30)
    newest.write_bytes(newest.read_bytes()[:100])  # torn file
    state = {"model": torch.nn.Linear(3, 2), "step": 0}
    with pytest.warns(UserWarning, match="torch-step-000000030.pt"):
        assert reader.restore(state) == 20
    assert state["step"] == 20 and bool((state["model"].weight == 20).all())
    with pytest.raises(StateMismatchError, match="model/weight"), pytest.warns(UserWarning, match="skipping"):
        reader.restore({"model": torch.nn.Linear(3, 4), "step": 0})
    assert TorchSaveCheckpointer(tmp_path / "empty").restore(state) is None


# --------------------------------------------------------------------- the acceptance test
